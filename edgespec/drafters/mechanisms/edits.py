"""The suffix drafter's learned edits (`edits`, `suffix+edits`): edgespec's
own opt-in, off by default.

Keep the answer aligned to the prompt and learn the edits it makes
(kernels/edits.py): the copy then applies them ahead (a rename proposes the
new name wherever the prompt has the old one).  The edited chain is merged
into the tree ahead of the plain continuations, as SOURCE_EDIT.  Off by
default: it gains on renames and loses as much elsewhere (BENCHMARKS.md,
"Code edits against llama-server").  A plug-in of the suffix drafter
(drafters/registry.py); its state is the current answer's alignment.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgespec.kernels import edits as _e
from edgespec.kernels import suffix as _k
from edgespec.drafters.suffix import SuffixPlugIn
from edgespec.drafters.tree import SOURCE_CONTEXT, SOURCE_EDIT


@dataclass
class EditConfig:
    """edit_gap: the longest old or new span of one edit, in tokens.
    edit_anchor: the tokens on which answer and prompt must agree again after an edit.
    edit_trust: an edit is applied ahead only while (made + 1) / (made + left
        out + 2) is at least this: once made and never left out (2/3) it is;
        an edit the answer then leaves out once (a one-off fix, a rewrite that
        only looked like an edit) is not."""
    edit_gap: int = 8
    edit_anchor: int = 3
    edit_trust: float = 0.6

    def __post_init__(self):
        if not (0.0 <= self.edit_trust <= 1.0):
            raise ValueError("EditConfig: edit_trust must be in [0, 1]")
        for name in ("edit_gap", "edit_anchor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"EditConfig.{name} must be an integer >= 1, got {v!r}")
            setattr(self, name, int(v))


class EditCopy(SuffixPlugIn):
    """The alignment state and recorded edits of the current answer, and the
    edited chain merged ahead of the suffix drafter's tree."""

    name = "edits"

    def __init__(self, config: EditConfig | None = None):
        self.config = config if config is not None else EditConfig()
        self._align = np.zeros(_e.STATE_SIZE, np.int64)
        self._edits = np.zeros((64, _e.EDIT_COLS), np.int64)
        self._n_prompt = 0
        self.attach(None)

    def attach(self, suffix_config) -> None:
        """The chain buffers, as deep as the suffix drafter's max_depth (parents fixed: a chain)."""
        self.max_depth = d = 32 if suffix_config is None else suffix_config.max_depth
        self._chain_tok = np.zeros(d, np.int32)
        self._chain_p = np.zeros(d, np.float32)
        self._chain_par = np.arange(-1, d - 1, dtype=np.int32)
        self._chain_src = np.zeros(d, np.int8)

    def warmup(self) -> None:
        _e.warmup()

    def begin(self, prompt) -> None:
        self._n_prompt = len(prompt)
        self._align[:] = 0

    def extend(self, ctx, n, max_nodes, m, cur, tmp):
        """Merge the aligned, edited copy chain (kernels/edits.py) ahead of the
        tree so far (once the answer has begun); returns (m, cur, tmp) after the merge."""
        if not 0 < self._n_prompt < n:
            return m, cur, tmp
        c = self.config
        st = self._align
        if st[0] > n:           # not this answer's context: start over
            st[:] = 0
        _e.align(ctx, n, self._n_prompt, st, self._edits, c.edit_gap, c.edit_anchor)
        ch, applied, first = _e.edited_chain(ctx, n, self._n_prompt, st, self._edits, self.max_depth,
                                             c.edit_trust, self._chain_tok, self._chain_p)
        if not applied:         # nothing the plain matches lack
            return m, cur, tmp
        src = self._chain_src
        src[:first] = SOURCE_CONTEXT
        src[first:ch] = SOURCE_EDIT
        m = _k.merge_trees(self._chain_tok, self._chain_par, self._chain_p, src, ch,
                           cur[0], cur[1], cur[2], cur[3], m, max_nodes, tmp[0], tmp[1], tmp[2], tmp[3])
        return m, tmp, cur
