"""What a finished request reports: GenerationResult (the text, the tokens,
the timings and the drafting statistics) and the tokens-per-step measure
every report shares.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class GenerationResult:
    text: str
    tokens: list
    n_prompt_tokens: int
    n_generated: int
    n_steps: int
    mean_accepted: float
    prefill_s: float
    decode_s: float
    tokens_per_s: float
    stop_reason: str
    n_reused_tokens: int = 0      # prompt tokens whose KV cells were reused, not prefilled (cache_n)
    n_shifted_tokens: int = 0     # of those, cells a splice moved (Request.cache_reuse): > 0, the answer is inexact
    n_draft_steps: int = 0        # steps that verified at least one draft node
    n_draft_nodes: int = 0        # draft nodes verified in all
    n_draft_accepted: int = 0     # draft tokens committed
    n_carried: int = 0            # steps that carried tokens past a batch hole
    decode_call_s: float = 0.0    # time inside llama_decode (+ logits fetch)
    engine_s: float = 0.0         # decode_s - decode_call_s: drafting, gate, verify, bookkeeping
    drafter: str = "none"
    verify: str = "exact"         # exact = lossless; relaxed / entropy change the output
    n_relaxed: int = 0            # tokens accepted by a relaxed rule (not the model's own choice)
    constrained: bool = False     # a grammar or JSON schema constrained the answer
    n_forced: int = 0             # steps that drafted text the grammar forced
    accepted_by_source: dict = dataclasses.field(default_factory=dict)   # committed draft tokens per source name
    topk: list | None = None      # with record_topk: the model's top-k ids at each generated position
    logprobs: list | None = None  # with logprobs=N: a logprobs.TokenLogprob per token of `tokens`
    stop_word: str = ""           # the stop string that ended the answer ("" if none did)

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        if d["topk"] is None:
            del d["topk"]
        if d["logprobs"] is None:
            del d["logprobs"]
        else:
            d["logprobs"] = [dataclasses.asdict(e) for e in d["logprobs"]]
        return d

    def summary(self) -> str:
        cached = f" ({self.n_reused_tokens} more cached)" if self.n_reused_tokens else ""
        return (f"{self.n_generated} tokens in {self.decode_s:.2f}s ({self.tokens_per_s:.1f} tok/s), "
                f"{self.mean_accepted:.2f} tokens/step, prefill {self.n_prompt_tokens - self.n_reused_tokens} "
                f"tokens in {self.prefill_s:.2f}s{cached}, stop: {self.stop_reason}")


def sum_accepted(n_steps: int, n_draft_accepted: int) -> float:
    """Mean tokens committed per verification step (each step commits its bonus)."""
    return (n_steps + n_draft_accepted) / n_steps if n_steps else 0.0
