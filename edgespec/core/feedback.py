"""What the engine tells its drafter, and only what the drafter asks for: the
prompt's top-k rows and hidden states at prefill, and after every step a
StepResult (the verified tree, what was accepted, and on request the model's
top-k, entropy and hidden state at every committed slot).  Everything is
read from logits the step computed anyway.
"""
from __future__ import annotations

import numpy as np

from edgespec.core.plan import StepPlan
from edgespec.drafters.tree import DraftTree
from edgespec.drafters.base import Drafter, StepResult


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


# what a plain (draft-free) step hands to observe(): read-only, shared by every step
EMPTY_BOOL = _readonly(np.zeros(0, np.bool_))
EMPTY_I32 = _readonly(np.zeros(0, np.int32))
EMPTY_TOPK = _readonly(np.zeros((0, 0), np.int32))
EMPTY_TOPK_VAL = _readonly(np.zeros((0, 0), np.float32))
EMPTY_F32 = _readonly(np.zeros(0, np.float32))


class DrafterFeedback:
    """One engine's channel to its drafter, with the scratch rows it needs
    for batches of up to n slots."""

    def __init__(self, drafter: Drafter, backend, n: int):
        self.drafter = drafter
        self.backend = backend
        needs = drafter.needs()
        self.observes = needs.observe
        self.topk = needs.topk if self.observes else 0
        if self.topk:
            from edgespec.kernels.topk import topk_rows_vals
            self._topk_rows = topk_rows_vals
            self._tk = np.zeros((n, self.topk), np.int32)
            self._tv = np.zeros((n, self.topk), np.float32)
            self._rows = np.arange(n, dtype=np.int64)
        self.prefill_topk = needs.prefill_topk
        # ReSpec's trigger wants every committed row's entropy, AdaPLD's rerank its hidden state
        self.want_entropy = self.observes and needs.entropy
        self.want_hidden = self.observes and needs.hidden
        self.hidden_layer = needs.hidden_layer if self.want_hidden else None
        if self.want_entropy:
            from edgespec.kernels.topk import row_entropy
            self._row_entropy = row_entropy
            self._ent = np.zeros(n, np.float32)

    def walk_argmax(self, logits, slot: int) -> int:
        """The argmax of batch row `slot`, read off its top-k: the drafter
        wants this committed slot's ranking anyway, and its first entry is
        the argmax (ties: lowest id, as argmax), so the row is read once
        (right after a decode it is not in cache)."""
        self._topk_rows(logits, self._rows[slot:], 1, self.topk, self._tk[slot:], self._tv[slot:])
        return int(self._tk[slot, 0])

    def prefill_buffers(self, m_pre: int):
        """(top-k rows, hidden states) buffers for a prefill of m_pre tokens,
        each None where the drafter does not ask for it; sets the backend's
        hidden-state output to this drafter's wish (other engines may share
        the backend)."""
        be = self.backend
        k_pre = self.prefill_topk
        pre = hid = None
        if k_pre:
            pre = (np.full((m_pre, k_pre), -1, np.int32), np.zeros((m_pre, k_pre), np.float32))
        if self.want_hidden or be.hidden_on:
            be.set_hidden(self.want_hidden, self.hidden_layer)
        if self.want_hidden:
            hid = np.zeros((m_pre, be.n_embd), np.float32)
        return pre, hid

    def prefilled(self, n_common: int, pre, hid) -> None:
        """Hand the prefill's buffers (prefill_buffers) to the drafter."""
        if pre is not None:
            self.drafter.observe_prefill(n_common, pre[0], pre[1])
        if hid is not None:
            self.drafter.observe_prefill_hidden(n_common, hid)

    def observe(self, ctx, accepted: list[int], logits, tree: DraftTree, btok, plan: StepPlan, slot: int,
                topk_walked: bool, t1_s: float, decode_s: float) -> None:
        """Hand the step to the drafter: the verified subtree of the proposal
        `tree` (the plan's nodes, as Gate.learn judged them), what was
        accepted and (when it asks for them) the model's top-k after every
        committed slot; topk_walked: the verification walk has computed those
        rows already (walk_argmax)."""
        if plan.n_nodes == 0:      # shared empty arrays: observe() must not write to a StepResult
            proposed, nacc, ntest = DraftTree.empty(), EMPTY_BOOL, EMPTY_BOOL
        else:
            sel = plan.nodes
            proposed = DraftTree.raw(tree.tokens[sel], plan.node_parent.copy(), tree.probs[sel], tree.source[sel])
            nacc, ntest = plan.node_accepted.copy(), plan.node_tested.copy()
        if self.topk:
            # the model's ranking after every committed slot's token: it is in
            # the logits already, so this costs one partial sort per row
            if not topk_walked:
                self._topk_rows(logits, self._rows, slot + 1, self.topk, self._tk, self._tv)
            tk_in, tk_tok, tk_val = btok[:slot + 1].copy(), self._tk[:slot + 1].copy(), self._tv[:slot + 1].copy()
        else:
            tk_in, tk_tok, tk_val = EMPTY_I32, EMPTY_TOPK, EMPTY_TOPK_VAL
        ent, hid = EMPTY_F32, EMPTY_TOPK_VAL
        if self.want_entropy:
            self._row_entropy(logits, slot + 1, self._ent)
            ent = self._ent[:slot + 1].copy()
        if self.want_hidden:
            hid = self.backend.hidden()[:slot + 1].copy()
        self.drafter.observe(StepResult(
            context=ctx, accepted=np.array(accepted, np.int32), proposed=proposed, node_accepted=nacc,
            node_tested=ntest, topk_input=tk_in, topk_tokens=tk_tok, topk_logits=tk_val, plain_step_s=t1_s,
            step_decode_s=decode_s, entropy=ent, hidden=hid))
