"""The papers' mechanisms as published, off by default: one module each, each
with its worked-example test (tests/test_papers_*.py).

Nothing on the default path imports this package: `auto`, `suffix` and
`trigram` import a module here inside the branch that switches it on
(tests/test_hybrid.py checks it in a fresh interpreter).  edgespec's own
variants, on by default, are the drafters beside it and drafters/mechanisms/.

* adapld.py     AdaPLD's drafter: one anchor, its copy, branches and successors (`branch`, `semantic`, `rerank`)
* rerank.py     the hidden states AdaPLD's `rerank` compares, by context position
* aded.py       ADED as published: the `trigram` part's published form (`aded`)
* trigger.py    ReSpec's hard retrieval trigger (`trigger`)
* feedback.py   ReSpec's feedback-scored match positions (`feedback`; a plug-in of the suffix drafter)
* graft.py      Graft's prune-then-graft under a fixed budget (`graft`)

The mechanisms of `auto` here have the lifecycle hooks of
drafters/mechanisms/Mechanism, as edgespec's own do.
"""
