"""One request's state between the engine's phases (Engine.run) and what it
yields from it: a Chunk for what each step added to the answer, and at the
end the GenerationResult.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from edgespec.core.params import Request
from edgespec.core.result import GenerationResult, sum_accepted
from edgespec.core.stream import Chunk, TextStream
from edgespec.drafters.tree import source_name
from edgespec.core.verify import SamplingConfig

if TYPE_CHECKING:
    from edgespec.backend.grammar import Grammar
    from edgespec.core.grammar_drafts import GrammarDrafts


@dataclass(eq=False)
class RunState:
    """The request (the value Engine.run took) and its prompt as checked token
    ids, its answer so far (the context, the committed tokens, the text), what
    passes from one step to the next (the pending token, a carried chain,
    proposals still being judged) and the counts its GenerationResult reports."""
    request: Request
    prompt: np.ndarray
    max_tokens: int                   # request.max_tokens, or with None the room the context leaves
    out: TextStream
    t_start: float
    rng: np.random.Generator | None = None
    topk_walk: bool = False
    n_common: int = 0                 # prompt tokens whose cells the KV cache held before the prefill
    n_spliced: int = 0                # of those, tokens a splice decoded (core/cache_reuse.py): not reused
    n_shifted: int = 0                # reused cells a splice moved or made (inexact: Request.cache_reuse)
    ctx: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))   # prompt + committed tokens (first n)
    n: int = 0
    pending: int = -1                 # the last committed token, not yet decoded
    carry: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    generated: list = field(default_factory=list)
    n_streamed: int = 0               # tokens of `generated` already handed out in chunks
    stop_reason: str | None = None
    t_prefill: float = 0.0
    t_decode_calls: float = 0.0
    n_steps: int = 0
    n_draft_steps: int = 0
    n_draft_nodes: int = 0
    n_draft_accepted: int = 0
    n_carried: int = 0
    n_relaxed: int = 0
    n_forced: int = 0                 # steps that drafted grammar-forced text
    by_source: dict = field(default_factory=dict)   # committed draft tokens per node source id
    topk_log: list = field(default_factory=list)
    shadow: list = field(default_factory=list)   # proposals still being judged (Gate.record_shadow)
    rec_rows: np.ndarray | None = None   # with record_topk: the batch rows ranked, and their top-k
    rec_buf: np.ndarray | None = None
    grammar: Grammar | None = None    # the grammar the answer follows (Engine.run)
    gdrafts: GrammarDrafts | None = None   # its drafts, when the engine drafts under it
    n_logprobs: int = 0               # alternatives per token when logprobs are asked for (lp then)
    lp: list | None = None            # a TokenLogprob per token of `generated` (then)
    eog: np.ndarray | None = None     # the tokens that end the answer: the model's EOG and request.stop_tokens
    newline: bool = False             # the answer holds a newline (request.t_max_predict_ms counts then)

    @property
    def sampling(self) -> SamplingConfig:
        return self.request.sampling

    @property
    def record_topk(self) -> int:
        return self.request.record_topk


def over_time(st: RunState) -> bool:
    """request.t_max_predict_ms has passed since the prompt was read, and the
    answer holds a newline (llama-server's rule: a first line is never cut)."""
    limit = st.request.t_max_predict_ms
    if limit is None:
        return False
    if not st.newline:
        st.newline = "\n" in st.out.text
    return st.newline and (time.perf_counter() - st.t_prefill) * 1e3 > limit


def count_sources(counts: dict, sources) -> None:
    """Add the sources of a step's committed drafts to a request's counts."""
    for s in sources.tolist():
        counts[s] = counts.get(s, 0) + 1


def chunks(st: RunState, n_drafted: int):
    """Yield what a step added to the answer (nothing when it added nothing)."""
    text, spans = st.out.delta()
    a = st.n_streamed
    # a step that ended at a stop string or an n_indent cut may have committed
    # tokens past it (several accepted drafts): they are not the answer's
    end = st.out.n_tokens_before_stop() if st.out.stopped_at >= 0 else len(st.generated)
    toks = st.generated[a:max(a, end)]
    st.n_streamed = len(st.generated)
    lp = None
    if st.lp is not None:       # none for tokens at or past a stop string
        lp = st.lp[a:max(a, min(end, len(st.lp)))]
    if text or toks:
        yield Chunk(text, toks, min(n_drafted, len(toks)), spans, lp)


def finish(st: RunState, drafter_name: str, verify_mode: str):
    """Flush the held-back text and build the GenerationResult (the
    generator's return value); drafter_name and verify_mode: the engine's."""
    out = st.out
    out.finish()
    generated = st.generated
    if out.stopped_at >= 0:
        generated = generated[:out.n_tokens_before_stop()]
    tail, spans = out.delta(final=True)
    if tail:
        yield Chunk(tail, [], 0, spans, [] if st.lp is not None else None)
    decode_s = time.perf_counter() - st.t_prefill
    n_gen = len(generated)
    return GenerationResult(
        text=out.text, tokens=generated, n_prompt_tokens=len(st.prompt), n_generated=n_gen,
        n_steps=st.n_steps, mean_accepted=sum_accepted(st.n_steps, st.n_draft_accepted),
        prefill_s=st.t_prefill - st.t_start, decode_s=decode_s,
        tokens_per_s=(n_gen - 1) / decode_s if n_gen > 1 and decode_s > 0 else 0.0,
        stop_reason=st.stop_reason or "length", n_reused_tokens=st.n_common - st.n_spliced,
        n_shifted_tokens=st.n_shifted, stop_word=out.stop_word,
        n_draft_steps=st.n_draft_steps, n_draft_nodes=st.n_draft_nodes, n_draft_accepted=st.n_draft_accepted,
        n_carried=st.n_carried, decode_call_s=st.t_decode_calls, engine_s=decode_s - st.t_decode_calls,
        drafter=drafter_name, verify=verify_mode, n_relaxed=st.n_relaxed,
        constrained=st.grammar is not None, n_forced=st.n_forced,
        accepted_by_source={source_name(s): n for s, n in sorted(st.by_source.items())},
        topk=np.concatenate(st.topk_log)[:n_gen + 1].tolist() if st.topk_log else None,
        logprobs=st.lp[:n_gen] if st.lp is not None else None)
