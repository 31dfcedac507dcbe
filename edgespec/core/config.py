"""EngineConfig: the settings of one engine (batch size, the gate, lossy
verification, what the acceptance model learns from), checked when made.
The engine, its gate and SpecModel read them; they are one concern because
a request runs under all of them together.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from edgespec.backend.protocol import SPLIT_KV_FREE_CELLS  # noqa: F401  (the gate's short regime reads it here)
from edgespec.core.verify import VerifyConfig
from edgespec.errors import ConfigError


@dataclass
class EngineConfig:
    """Engine settings.

    max_nodes: the most tokens one verification batch holds (root included).
    cost_gate: choose the verified subtree by expected tokens per unit of c(T);
        False verifies every proposed node up to max_nodes (for tests and studies).
    carry_prob: drafter score given to carried tokens (re-verification of tokens
        already accepted once on a batch layout with holes).
    verify: exact (lossless, the default) or one of the lossy opt-ins; see
        verify.VerifyConfig.
    shadow: the acceptance model also learns from the proposed nodes the gate
        did not verify, judged against the tokens committed afterwards (see
        kernels.tree.shadow_learn); False learns from verified nodes only.
    forced_drafts: under a request's grammar, draft the text it forces next
        (keys, brackets, quotes) as a chain scored forced_prob; the gate's
        acceptance statistics for it start from that score.  Never with the
        drafter `none`, which stays plain decoding (the baseline).  Where
        nothing is forced, the prompt text the answer is copying (a value) is
        drafted as a chain scored copy_prob (core/grammar_drafts.py).
    history_cap: at the start of each request, the fine (source, score,
        depth) acceptance counts of earlier requests are scaled down to at
        most this many tested nodes per cell (AcceptanceModel.shrink), so the
        request's own evidence soon outweighs them there, while the coarse
        counts keep the whole history; None keeps them whole.
    gate_overhead: None (default) lets the gate count the engine's own time per
        step as measured (a moving average, in plain-step units); a number fixes
        it, so that two runs of the same drafter on the same outputs (a real
        one and an offline replay) take the same gate decisions.
    learn_costs: correct the calibrated cost curve online from the timed
        decodes the engine runs (core/stepcost.py); False keeps the curve as
        measured.
    guard: stop drafting in a request when it has cost more than it
        gained, by the learned plain step, until probes show it would pay
        again (core/guard.py); with the
        cost gate only (cost_gate=False verifies every draft, guard or not).
    hold_width: an experiment for CUDA builds (issue 40), 0 (off) by default:
        every step verifies exactly this many tokens (the likeliest drafts,
        padded with the tokens that followed the pending one last time), so
        llama.cpp replays one captured graph instead of capturing a new one at
        each change of width; verification is unchanged (exact).  The gate
        and the guard do not decide then; plain decoding (`none`) never pads.
    hold_choice: on by default (the spec `@free`, `suffix@free`, turns it
        off): where no width is fixed, let the costs choose one
        (core/hold.py): where the calibrated and the learned steady widths
        cost markedly less than changing ones (CUDA's captured graphs) and
        holding 2, 4 or 8 tokens would yield more tokens per second than the
        gate's free choice, the engine holds that width; elsewhere (every CPU
        curve) it never holds and steps as before.  On an H200 on 2026-11-28
        it ran code edits at 1.57x `none` where the gate alone ran 0.92x
        (BENCHMARKS.md, GPU).
    """
    max_nodes: int = 48
    cost_gate: bool = True
    carry_prob: float = 0.95
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    gate_overhead: float | None = None
    shadow: bool = True
    forced_drafts: bool = True
    forced_prob: float = 0.9
    copy_prob: float = 0.7
    history_cap: float | None = None
    learn_costs: bool = True
    guard: bool = True
    hold_width: int = 0
    hold_choice: bool = True

    def __post_init__(self):
        if not (1 <= self.max_nodes <= 256):
            raise ConfigError(f"max_nodes must be in 1..256, got {self.max_nodes}")
        if self.hold_width and not (2 <= self.hold_width <= self.max_nodes):
            raise ConfigError(f"hold_width must be 0 (off) or in 2..max_nodes ({self.max_nodes}), got {self.hold_width}")
        if not (0.0 < self.carry_prob <= 1.0):
            raise ConfigError("carry_prob must be in (0, 1]")
        if self.gate_overhead is not None and not (0.0 <= self.gate_overhead < 10.0):
            raise ConfigError(f"gate_overhead must be in [0, 10) plain steps, got {self.gate_overhead}")

    def held_width(self, budget: int) -> int:
        """The batch width a step holds with `budget` slots left (hold_width), or 0."""
        return self.hold_width if 1 < self.hold_width <= budget else 0
