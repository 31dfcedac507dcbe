"""The `auto` drafter's mechanisms, one module each, apart from its merge loop.

Each is a small object holding its own state.  The lifecycle hooks of
`Mechanism` (begin, start_step, observe) are called by drafters/hybrid.py on
every enabled mechanism alike, in one fixed order; each mechanism's own
action (scale, check, graft, ...) is called where it acts in the merge:

* schedule.py     which parts propose this step, from their learnt cost and yield
* entropy.py      edgespec's soft retrieval trigger (`entropy`): retrieved scores scaled by recent entropy
* trigger.py      ReSpec's hard retrieval trigger (`trigger`)
* feedback.py     ReSpec's feedback-scored match positions (`feedback`; used by the suffix drafter)
* rerank.py       the hidden states AdaPLD's `rerank` compares, by context position
* graft.py        Graft's prune-then-graft under a fixed budget (`graft`)
* graft_tail.py   edgespec's retrieval continued from the best drafted leaves (`graft_tail`)
"""


class Mechanism:
    """The hooks every mechanism of `auto` has (no-ops here).

    enabled:      whether the hybrid calls its hooks at all
    begin:        a request starts with this prompt
    start_step:   a proposal starts
    observe:      a verification step's StepResult (read-only)"""

    enabled = True

    def begin(self, prompt) -> None:
        pass

    def start_step(self) -> None:
        pass

    def observe(self, result) -> None:
        pass

