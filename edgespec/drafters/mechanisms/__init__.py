"""The `auto` drafter's mechanisms, one module each, apart from its merge loop.

Each is a small object holding its own state, with the hooks
drafters/hybrid.py calls around its parts' proposals and observations:

* schedule.py     which parts propose this step, from their learnt cost and yield
* entropy.py      edgespec's soft retrieval trigger (`entropy`): retrieved scores scaled by recent entropy
* trigger.py      ReSpec's hard retrieval trigger (`trigger`)
* rerank.py       AdaPLD's hidden-state rerank of the lexical anchors (`rerank`)
* graft.py        Graft's prune-then-graft under a fixed budget (`graft`)
* graft_tail.py   edgespec's retrieval continued from the best drafted leaves (`graft_tail`)
"""
