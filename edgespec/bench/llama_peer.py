"""The llama-cpp-python methods: each runs llama_cpp.Llama in a child
process, streamed and timed there, and records the settings it ran with.

The child is spawned with the environment the bench was started with:
llama.cpp reads some switches once per process, and edgespec turns one of
them off for exactness (see backend.process.TILED_MM_ENV).
"""
from __future__ import annotations

import multiprocessing
import os
import time

from edgespec.bench.methods import split_peer
from edgespec.errors import BenchError

PLD_DRAFT_TOKENS = {"llama-cpp-python-pld": None, "llama-cpp-python-pld-cpu": 2}
"""num_pred_tokens of the prompt-lookup methods (None = LlamaPromptLookupDecoding's default, 10)."""


def _llama_kwargs(method: str, threads: int | None, cache_type_k: str) -> dict:
    """llama_cpp.Llama arguments of a llama-cpp-python method (see
    edgespec.bench.methods), but for pld's draft model."""
    kw: dict = {}
    if method in PLD_DRAFT_TOKENS:
        # the draft model (LlamaPromptLookupDecoding) is made in the worker.
        # With a draft model, Llama keeps logits of every token (it forces
        # logits_all internally) but sizes its scores buffer from the
        # logits_all argument: without it any prompt longer than n_batch
        # fails with a numpy broadcast error (llama-cpp-python 0.3.36).
        kw["logits_all"] = True
    if method == "llama-cpp-python-expert":
        from edgespec.backend.process import CACHE_TYPES_K, default_threads
        n = threads or default_threads()
        kw.update(n_threads=n, n_threads_batch=n, flash_attn=True, type_k=CACHE_TYPES_K[cache_type_k])
    elif threads:
        # otherwise llama-cpp-python as users get it: its own thread defaults
        # (n_threads = cores // 2 for single-token decoding, n_threads_batch =
        # cores), unless the bench was given --threads
        kw["n_threads"] = kw["n_threads_batch"] = threads
    return kw


def _llama_worker(conn, model_path: str, n_ctx: int, n_gpu_layers: int, kw: dict, method: str) -> None:
    """The child process of a llama-cpp-python method: load, then answer
    ("run", turn, max_tokens, raw, gbnf) requests with result dicts until "exit"."""
    try:
        import llama_cpp

        if method in PLD_DRAFT_TOKENS:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
            n = PLD_DRAFT_TOKENS[method]
            kw = dict(kw, draft_model=LlamaPromptLookupDecoding() if n is None else
                      LlamaPromptLookupDecoding(num_pred_tokens=n))
        # with CPU weight repacking off, as edgespec runs (backend.llama.load_model:
        # repacked kernels are not exact and llama.cpp's AMX one crashed here)
        from edgespec.bench.llamacpp import llama_cpp_python_repack
        with llama_cpp_python_repack(False):
            llm = llama_cpp.Llama(model_path, n_ctx=n_ctx, n_batch=512, n_gpu_layers=n_gpu_layers,
                                  verbose=False, **kw)
        cp = llm.context_params
        conn.send(("ready", {"n_threads": cp.n_threads, "n_threads_batch": cp.n_threads_batch,
                             "flash_attn": int(cp.flash_attn_type), "type_k": int(cp.type_k)}))
    except Exception as e:  # pragma: no cover - reported by the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    while True:
        msg = conn.recv()
        if msg[0] != "run":
            break
        try:
            conn.send(("ok", _llama_run(llm, *msg[1:])))
        except Exception as e:  # pragma: no cover - reported by the parent
            conn.send(("error", f"{type(e).__name__}: {e}"))
    llm.close()


def _llama_run(llm, turn: str, max_tokens: int, raw: bool, gbnf: str | None = None) -> dict:
    """One streamed, timed request to a llama_cpp.Llama (in the worker);
    gbnf: the grammar the answer must follow (already checked by llama.cpp's
    parser in the bench: llama-cpp-python does not check what it hands on)."""
    import llama_cpp

    pieces: list[str] = []
    stop_reason = None
    kw = {} if gbnf is None else {"grammar": llama_cpp.LlamaGrammar.from_string(gbnf, verbose=False)}
    t0 = time.perf_counter()
    t_first = None
    if raw:
        stream = llm.create_completion(turn, max_tokens=max_tokens, temperature=0.0, stream=True, **kw)
    else:
        stream = llm.create_chat_completion(messages=[{"role": "user", "content": turn}],
                                            max_tokens=max_tokens, temperature=0.0, stream=True, **kw)
    for chunk in stream:
        choice = chunk["choices"][0]
        content = choice.get("text") if raw else choice.get("delta", {}).get("content")
        if content:
            if t_first is None:
                t_first = time.perf_counter()
            pieces.append(content)
        if choice.get("finish_reason"):
            stop_reason = choice["finish_reason"]
    t_end = time.perf_counter()
    if t_first is None:
        t_first = t_end
    text = "".join(pieces)
    tokens = [int(t) for t in llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)] if text else []
    n = len(tokens)
    decode_s = t_end - t_first
    return {"text": text, "tokens": tokens, "n_generated": n, "n_steps": None, "mean_accepted": None,
            "prefill_s": t_first - t0, "decode_s": decode_s,
            "tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
            "stop_reason": stop_reason or "length"}


class LlamaRunner:
    """A llama-cpp-python method in a child process (spawned with the
    environment the user gave, see the module doc), streamed and timed there."""

    def __init__(self, method: str, model_path: str, n_ctx: int, threads: int | None, n_gpu_layers: int,
                 cache_type_k: str = "f16", raw: bool = False):
        from edgespec.backend.process import TILED_MM_ENV, USER_TILED_MM

        self.method, self.raw = method, raw
        base, n = split_peer(method)
        kw = _llama_kwargs(base, n or threads, cache_type_k)
        mp = multiprocessing.get_context("spawn")
        self.conn, child = mp.Pipe()
        self.proc = mp.Process(target=_llama_worker, args=(child, model_path, n_ctx, n_gpu_layers, kw, base),
                               daemon=True)
        mine = os.environ.get(TILED_MM_ENV)
        _set_env(TILED_MM_ENV, USER_TILED_MM)
        try:
            self.proc.start()
        finally:
            _set_env(TILED_MM_ENV, mine)
        child.close()
        self.settings = self._reply()

    def _reply(self):
        try:
            kind, value = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(5)
            raise BenchError(f"{self.method}: the llama-cpp-python process died "
                             f"(exit code {self.proc.exitcode})") from None
        if kind == "error":
            raise BenchError(f"{self.method}: {value}")
        return value

    def run(self, turn: str, max_tokens: int, gbnf: str | None = None) -> dict:
        self.conn.send(("run", turn, max_tokens, self.raw, gbnf))
        return self._reply()

    def close(self) -> None:
        try:
            self.conn.send(("exit",))
        except (OSError, ValueError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():  # pragma: no cover - best effort
            self.proc.terminate()
            self.proc.join(5)
        self.conn.close()


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def llama_peer_settings(method: str, llama_threads: int | None, cache_type_k: str) -> dict:
    """What a llama-cpp-python method runs with (the header's record; the
    library's defaults: half the logical CPUs for single tokens, all of them
    for batches, no flash attention, an f16 K cache)."""
    from edgespec.backend.process import default_threads

    base, n = split_peer(method)
    n = n or llama_threads
    cpus = multiprocessing.cpu_count()
    if base == "llama-cpp-python-expert":
        return {"n_threads": n or default_threads(), "n_threads_batch": n or default_threads(),
                "flash_attn": True, "cache_type_k": cache_type_k}
    out = {"n_threads": n or max(cpus // 2, 1), "n_threads_batch": n or cpus, "flash_attn": False,
           "cache_type_k": "f16"}
    if base in PLD_DRAFT_TOKENS:
        k = PLD_DRAFT_TOKENS[base]
        out["draft"] = "LlamaPromptLookupDecoding(" + ("" if k is None else f"num_pred_tokens={k}") + ")"
    return out
