"""The `auto` drafter's mechanisms that are on by default, one module each,
apart from its merge loop.

Each is a small object holding its own state.  The lifecycle hooks of
`Mechanism` (begin, start_step, observe) are called by drafters/hybrid.py on
every enabled mechanism alike, in one fixed order; each mechanism's own
action (scale, check, graft, ...) is called where it acts in the merge:

* schedule.py     which parts propose this step, from their learnt cost and yield
* entropy.py      edgespec's soft retrieval trigger (`entropy`): retrieved scores scaled by recent entropy
* graft_tail.py   edgespec's retrieval continued from the best drafted leaves (`graft_tail`)

And the suffix drafter's plug-ins of edgespec's own (drafters/suffix.py
SuffixPlugIn, named in drafters/registry.py with their settings):

* position_ema.py the moving average per match position (`position_ema`; `ema` inside `auto`, on there)
* edits.py        the learned edits applied ahead of the copy (`edits`, off by default)

The papers' mechanisms as published (`trigger`, `feedback`, `rerank`,
`graft`), off by default, are in drafters/papers/, imported only when
switched on; they have these hooks too.

The merge and its mechanisms tell the parts apart by the role the hybrid
declares for each (``HybridDrafter.roles``), never by which object a part is.
"""

RETRIEVAL = "retrieval"
"""The suffix part: always on (the schedule never idles it), its drafts scaled
by `entropy`, keyed by `trigger`; the others are weighed against it."""
GUESS = "guess"
"""A part that guesses beside retrieval (tri-gram, branch, semantic, AdaPLD):
the schedule idles it when its drafts do not pay for its time."""
TEMPLATE = "template"
"""A guess part that `graft` keeps aside as its root-centred template
(adjacency); without `graft` it merges as a guess part."""


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

