"""The `auto` drafter's `rerank` mechanism: the hidden states AdaPLD chooses
its anchor by (Eqs. 6-7, and 13-14 for successors).

AdaPLD scores a candidate anchor j by the cosine of the model's hidden states
after reading ctx[:j] and after reading ctx[:n-1] (the preceding contexts of
the candidate and of the last token), at one layer (13 of Vicuna-13B's 40);
the choice itself is kernels/anchor.py's ``best_anchor``, called by
drafters/papers/adapld.py.  This module keeps the states: unit rows by context
position (row p: the state after reading ctx[:p+1], so the row the engine
hands over with that position's logits), filled from the prefill and from
every step's committed slots, and kept valid across requests for the prefix
the new context shares with the last one.
"""
from __future__ import annotations

import numpy as np

from edgespec.drafters.mechanisms import Mechanism


class HiddenStates(Mechanism):
    """Unit hidden states by context position, with which positions hold one."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._H = np.zeros((0, 1), np.float32)
        self._known = np.zeros(0, np.bool_)
        self._ctx = np.zeros(0, np.int32)

    def begin(self, prompt: np.ndarray) -> None:
        """Hidden states stay valid for the prefix shared with the last context."""
        m = min(len(prompt), len(self._ctx))
        neq = np.nonzero(self._ctx[:m] != prompt[:m])[0]
        self._known[int(neq[0]) if len(neq) else m:] = False
        self._ctx = np.asarray(prompt, np.int32)

    def observe(self, result) -> None:
        """Store the hidden states of the step's committed positions."""
        if result.hidden.ndim == 2 and len(result.hidden):
            self._ctx = result.context
            self.store(len(result.context) - len(result.accepted) - 1, result.hidden)

    def store(self, start: int, hidden: np.ndarray) -> None:
        """Normalised rows of `hidden` at context positions start.."""
        r, d = hidden.shape
        if r == 0:
            return
        if self._H.shape[1] != d or len(self._H) < start + r:
            cap = max(start + r, 2 * len(self._H), 1024)
            H = np.zeros((cap, d), np.float32)
            known = np.zeros(cap, np.bool_)
            if self._H.shape[1] == d:
                H[:len(self._H)] = self._H
                known[:len(self._known)] = self._known
            self._H, self._known = H, known
        self._H[start:start + r] = hidden / (np.linalg.norm(hidden, axis=1, keepdims=True) + 1e-9)
        self._known[start:start + r] = True

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(H float32 [cap, d], known bool [cap]): row p is a unit state where
        known[p]; read-only for the caller."""
        return self._H, self._known
