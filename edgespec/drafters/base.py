"""The one drafter interface."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edgespec.drafters.tree import DraftTree


@dataclass
class StepResult:
    """What one verification step found, handed to every drafter's observe().

    context:   all tokens of the sequence after this step (prompt + generation,
               including the new bonus token at the end), int32
    accepted:  the tokens this step appended to the context (accepted drafts,
               then the bonus token), int32
    proposed:  the tree that was verified (already cut by the cost gate)
    node_accepted: bool per node of `proposed`: True if on the accepted path
    node_tested:   bool per node: True if its parent was accepted, so that the
               node's own acceptance was actually decided by the model
    topk_input:  int32 [r]: the tokens decoded at this step's committed batch
               slots (the root first, then accepted drafts in the batch's
               first-child chain); row i of topk_tokens is the model's
               next-token ranking after topk_input[i] in this context
    topk_tokens: int32 [r, K]: the model's K most likely next tokens after each
               topk_input token, most likely first (K = the drafter's `topk`);
               both are empty when the drafter's `topk` is 0
    topk_logits: float32 [r, K]: the model's logits of those tokens
    plain_step_s: what one plain one-token step costs on this machine (the
               engine's calibrated t1; 0 when not measured): the value of an
               accepted draft token, for drafters that weigh their own time
    step_decode_s: the measured time of this step's verification batch
    entropy:   float32 [r]: with the drafter's `wants_entropy`, the entropy
               (nats, over the whole vocabulary) of the model's next-token
               distribution after each topk_input / committed slot (ReSpec's
               trigger); empty otherwise
    hidden:    float32 [r, n_embd]: with the drafter's `wants_hidden`, the
               model's final hidden state at each committed slot (the row the
               logits are computed from); empty otherwise

    observe() must treat a StepResult as read-only: steps that verified no
    draft share read-only empty arrays (proposed, node_accepted, ...).
    """
    context: np.ndarray
    accepted: np.ndarray
    proposed: DraftTree
    node_accepted: np.ndarray
    node_tested: np.ndarray
    topk_input: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    topk_tokens: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int32))
    topk_logits: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    plain_step_s: float = 0.0
    step_decode_s: float = 0.0
    entropy: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    hidden: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))


@dataclass(frozen=True)
class Needs:
    """What a drafter asks of the engine, as the engine reads it once when it
    is built (Drafter.needs()).  The contract is declared once, by Drafter's
    attributes (documented there); this is their snapshot, field for field:
    observe (wants_observe()), topk, prefill_topk, entropy (wants_entropy),
    hidden (wants_hidden), hidden_layer (with hidden only).  The top-K,
    entropy and hidden states are computed only for a drafter that observes."""
    observe: bool = False
    topk: int = 0
    prefill_topk: int = 0
    entropy: bool = False
    hidden: bool = False
    hidden_layer: int | None = None


class Drafter:
    """Base class: a drafter that proposes nothing (the `none` method).

    begin(prompt)            a new request starts; prompt is the whole token
                             sequence that the model will have seen (for a chat:
                             every earlier turn too)
    propose(context, budget) a DraftTree of at most `budget` nodes that may follow
                             context[-1]; it must not keep a reference to context
    observe(result)          learn from what the model accepted
    """

    name = "none"
    observes: bool | None = None
    """Whether the engine must call observe() (None: when the class overrides it)."""
    topk = 0
    """K > 0 asks the engine for the model's top-K next tokens at every committed
    slot of each step (StepResult.topk_input / topk_tokens)."""

    prefill_topk = 0
    """K > 0 asks the engine for the model's top-K next tokens after every
    prompt position it prefills (AASD); they arrive in observe_prefill()."""

    wants_entropy = False
    """True asks the engine for the entropy of the model's distribution after
    every committed slot of each step (StepResult.entropy)."""

    wants_hidden = False
    """True asks the engine for the model's final hidden state after every
    committed slot (StepResult.hidden) and every prompt position it prefills
    (observe_prefill_hidden); the prefill then computes every prompt row's
    output, as with prefill_topk."""

    hidden_layer: int | None = None
    """With wants_hidden: which block's hidden state (None: the last; 0: the
    backend's middle one; else block N)."""

    sources: tuple = ()
    """The node sources (drafters/tree.py's registry) this drafter's proposals
    carry: what `auto`'s schedule credits to it."""

    retrieves = False
    """Its drafts are retrieved text (or anchored on it): ReSpec's trigger
    gates it inside `auto`."""

    def needs(self) -> Needs:
        """What this drafter asks of the engine: the attributes above, read once
        (wrappers such as PredictionDrafter hand on their inner drafter's)."""
        return Needs(observe=self.wants_observe(), topk=int(self.topk), prefill_topk=int(self.prefill_topk),
                     entropy=bool(self.wants_entropy), hidden=bool(self.wants_hidden),
                     hidden_layer=self.hidden_layer if self.wants_hidden else None)

    def set_prediction(self, tokens) -> None:
        """Only a drafter built for predicted outputs takes one
        (drafters/prediction.py); anything else is misuse."""
        raise TypeError(f"drafter {self.name!r} takes no prediction (wrap it in PredictionDrafter)")

    def begin(self, prompt: np.ndarray) -> None:
        pass

    def observe_prefill(self, start: int, topk_tokens: np.ndarray, topk_logits: np.ndarray) -> None:
        """With prefill_topk: after begin(), the model's ranking after each prompt
        position from `start` on (row i: after prompt[start + i]; the positions
        before `start` were decoded in an earlier turn and kept in the KV cache)."""

    def observe_prefill_hidden(self, start: int, hidden: np.ndarray) -> None:
        """With wants_hidden: after begin(), the model's hidden state at each
        prompt position from `start` on (row i: at prompt[start + i])."""

    def propose(self, context: np.ndarray, budget: int) -> DraftTree:
        return DraftTree.empty()

    def observe(self, result: StepResult) -> None:
        pass

    @property
    def plain(self) -> bool:
        """Plain decoding: the `none` drafter itself (a subclass that proposes
        nothing is not plain); the engine then drafts nothing, not even the
        text a grammar forces, and holds no batch width."""
        return type(self) is Drafter

    def wants_observe(self) -> bool:
        """Whether observe() must be called: `observes` when set, else whether
        the class overrides observe()."""
        if self.observes is not None:
            return bool(self.observes)
        return type(self).observe is not Drafter.observe

    def warmup(self) -> None:
        """Compile numba kernels with real dtypes, so no request pays for JIT."""
