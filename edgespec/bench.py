"""Benchmark: edgespec drafters against plain decoding and llama-cpp-python.

One process loads the model once (`SpecModel(drafter="none")`) and runs every
requested method on every prompt, prompt-major (for each prompt, each method in
turn) so that machine noise falls on all methods alike.  Greedy decoding only:
then every edgespec method must give exactly the tokens of `none`, and the
results file records whether it did.

Methods
  none, suffix, ...        edgespec engines (`model.generate(..., drafter=name)`)
  llama-cpp-python         llama_cpp.Llama.create_chat_completion (create_completion
                           with raw prompts), streamed, at that library's defaults
  llama-cpp-python-expert  the same as an expert runs it: one thread per physical
                           core for single tokens and batches, flash attention
                           and the K cache type edgespec uses
  llama-cpp-python-pld     llama-cpp-python with LlamaPromptLookupDecoding (its
                           defaults: 10 draft tokens; logits_all=True, which its
                           draft path needs)
  llama-cpp-python-pld-cpu the same with num_pred_tokens=2, which llama-cpp-python's
                           README recommends for CPU-only machines
  llama-server, llama-server-ngram-simple, -ngram-map-k, -ngram-map-k4v,
  -ngram-mod, -ngram-cache
                           llama.cpp's own server, plain or with its draftless
                           speculative decoding, each with the settings
                           llama.cpp's docs recommend; built by `edgespec
                           build-peers` (see edgespec.peer_server, docs/peers.md)
  default                  what `edgespec generate MODEL PROMPT` runs with no
                           options (its drafter; the bench's model must be loaded
                           with generate's default settings; the header says
                           what it resolved to)
A peer method ending in @tN (llama-server@t1, llama-cpp-python-pld@t2) runs
with N threads for single tokens and batches instead of its own default.
The llama-cpp-python methods run in a child process, in the environment the
bench was started with (llama.cpp reads some switches once per process, and
edgespec turns one of them off for exactness: see backend.llama.TILED_MM_ENV).

Divergences: an edgespec method whose greedy tokens differ from `none`'s gets
a `divergence` record: the first differing position, and the logits plain
decoding gives there (re-decoded: the prompt prefilled and none's tokens
decoded one at a time, as `none` ran), as the gap between its top token and
the method's token.  The report sets each gap against the exactness
self-check's largest |logit difference|: a gap wider than twice that is no
near-tie and points at a bug.

Results file (JSON lines)
  line 1: {"kind": "header", ...}   model path, threads, context, llama_cpp
          version, date, host and CPU, the measured cost curve, the settings
  then:   {"kind": "result", ...}   one line per (prompt, method); see
          RESULT_FIELDS.  For llama-cpp-python methods `tokens` is the
          re-tokenized text and n_steps / mean_accepted are null; for
          llama-server methods `tokens` are the server's ids and
          `server_timings` its own timing figures.

Timing: prefill_s runs from the request to the first generated token (edgespec)
or the first streamed content chunk (llama-cpp-python); decode_s from there to
the end; llama-server's come from its own timings (prompt_ms, predicted_ms).
Decode speed is (n_generated - 1) / decode_s.
"""
from __future__ import annotations

import datetime
import gzip
import multiprocessing
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from .errors import BenchError  # re-exported
from .peer_server import SERVER_METHODS as _SERVER_ARGS
from .verify import rouge_l

LLAMA_METHODS = ("llama-cpp-python", "llama-cpp-python-expert", "llama-cpp-python-pld", "llama-cpp-python-pld-cpu")
SERVER_METHODS = tuple(_SERVER_ARGS)
PEER_METHODS = LLAMA_METHODS + SERVER_METHODS
DEFAULT_METHODS = ("none", "suffix") + LLAMA_METHODS[:3]
PLD_DRAFT_TOKENS = {"llama-cpp-python-pld": None, "llama-cpp-python-pld-cpu": 2}
"""num_pred_tokens of the prompt-lookup methods (None = LlamaPromptLookupDecoding's default, 10)."""
WARMUP_PROMPT = "Say hello."
MAX_PROMPTS_BYTES = 64 << 20     # Spec-Bench's 480 questions take 0.7 MB

RESULT_FIELDS = ("question_id", "category", "method", "text", "tokens", "n_prompt_tokens",
                 "n_generated", "n_steps", "mean_accepted", "prefill_s", "decode_s",
                 "tokens_per_s", "stop_reason", "identical_to_none")


# ------------------------------------------------------------------ prompts
@dataclass
class BenchPrompt:
    question_id: object
    category: str
    turn: str          # the first turn, sent as one user message


def _json_objects(path: str, lines):
    """(line number, dict) for each non-blank line; a line that is not a JSON
    object is an error naming it."""
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise BenchError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        except RecursionError:
            raise BenchError(f"{path}:{lineno}: not valid JSON (nested too deeply)") from None
        if not isinstance(rec, dict):
            raise BenchError(f"{path}:{lineno}: expected a JSON object")
        yield lineno, rec


def load_prompts(path: str, categories: Sequence[str] | None = None,
                 limit: int | None = None) -> list[BenchPrompt]:
    """Read a JSON-lines prompts file (fields question_id, category, turns).

    Every non-blank line must be a JSON object with a non-empty list of string
    `turns`; anything else is a BenchError naming the line.  `categories`
    keeps only those categories; `limit` then keeps the first N.
    """
    if not os.path.isfile(path):
        raise BenchError(f"prompts file not found: {path}")
    size = os.path.getsize(path)
    if size > MAX_PROMPTS_BYTES:
        raise BenchError(f"prompts file {path} is {size / 2**20:.0f} MiB; the bench reads at most "
                         f"{MAX_PROMPTS_BYTES >> 20} MiB of prompts")
    prompts: list[BenchPrompt] = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        raise BenchError(f"cannot read prompts file {path}: {e}") from None
    for lineno, rec in _json_objects(path, lines):
        turns = rec.get("turns")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0]:
            raise BenchError(f"{path}:{lineno}: needs `turns`, a list whose first item is a non-empty string")
        category = str(rec.get("category", "none"))
        try:
            turns[0].encode("utf-8")
            category.encode("utf-8")
        except UnicodeEncodeError:
            raise BenchError(f"{path}:{lineno}: an unpaired surrogate escape (\\ud800-\\udfff) in the first "
                             "turn or the category, which is not text") from None
        prompts.append(BenchPrompt(rec.get("question_id", lineno), category, turns[0]))
    if not prompts:
        raise BenchError(f"no prompts in {path}")
    if categories:
        wanted = set(categories)
        known = {p.category for p in prompts}
        missing = wanted - known
        if missing:
            raise BenchError(f"no prompts of category {', '.join(sorted(missing))} in {path} "
                             f"(categories: {', '.join(sorted(known))})")
        prompts = [p for p in prompts if p.category in wanted]
    if limit is not None:
        if limit < 1:
            raise BenchError("--limit must be >= 1")
        prompts = prompts[:limit]
    return prompts


def split_peer(method: str) -> tuple[str, int | None] | None:
    """(peer method, threads or None) of a peer method name ("llama-server@t2"
    -> ("llama-server", 2)); None for any other name."""
    base, _, suffix = method.partition("@")
    if base not in PEER_METHODS:
        return None
    if not suffix:
        return base, None
    if suffix[:1] != "t" or not suffix[1:].isdigit() or int(suffix[1:]) < 1:
        raise BenchError(f"method {method!r}: a peer's suffix is @tN, N threads (e.g. {base}@t2)")
    return base, int(suffix[1:])


def is_peer(method: str) -> bool:
    """Whether a method runs another program (llama-cpp-python, llama-server) rather than edgespec."""
    return method.partition("@")[0] in PEER_METHODS


def parse_methods(spec: str | Sequence[str]) -> list[str]:
    """'none,suffix,...' -> a list without duplicates; edgespec drafter names are
    checked against the drafter registry, peer names against PEER_METHODS."""
    from .drafters import check_drafter_name
    from .verify import VerifyConfig

    items = spec.split(",") if isinstance(spec, str) else list(spec)
    methods: list[str] = []
    for m in (x.strip() for x in items):
        if not m or m in methods:
            continue
        if split_peer(m) is None and m != "default":
            try:
                base, _, mode = m.partition("@")
                check_drafter_name(base)
                if mode:
                    VerifyConfig(mode)
            except ValueError as e:
                raise BenchError(f"unknown method {m!r}: {e}; or default, or one of {', '.join(PEER_METHODS)} "
                                 f"(with @tN for N threads)") from None
        methods.append(m)
    if not methods:
        raise BenchError("no methods given")
    return methods


# ------------------------------------------------------------------ running
def _llama_kwargs(method: str, threads: int | None, cache_type_k: str) -> dict:
    """llama_cpp.Llama arguments of a llama-cpp-python method (see the module
    doc), but for pld's draft model."""
    kw: dict = {}
    if method in PLD_DRAFT_TOKENS:
        # the draft model (LlamaPromptLookupDecoding) is made in the worker.
        # With a draft model, Llama keeps logits of every token (it forces
        # logits_all internally) but sizes its scores buffer from the
        # logits_all argument: without it any prompt longer than n_batch
        # fails with a numpy broadcast error (llama-cpp-python 0.3.36).
        kw["logits_all"] = True
    if method == "llama-cpp-python-expert":
        from .backend.llama import CACHE_TYPES_K, default_threads
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
    ("run", turn, max_tokens, raw) requests with result dicts until "exit"."""
    try:
        import llama_cpp

        if method in PLD_DRAFT_TOKENS:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
            n = PLD_DRAFT_TOKENS[method]
            kw = dict(kw, draft_model=LlamaPromptLookupDecoding() if n is None else
                      LlamaPromptLookupDecoding(num_pred_tokens=n))
        # with CPU weight repacking off, as edgespec runs (backend.llama.load_model:
        # repacked kernels are not exact and llama.cpp's AMX one crashed here)
        from .backend.llama import llama_cpp_python_repack
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


def _llama_run(llm, turn: str, max_tokens: int, raw: bool) -> dict:
    """One streamed, timed request to a llama_cpp.Llama (in the worker)."""
    pieces: list[str] = []
    stop_reason = None
    t0 = time.perf_counter()
    t_first = None
    if raw:
        stream = llm.create_completion(turn, max_tokens=max_tokens, temperature=0.0, stream=True)
    else:
        stream = llm.create_chat_completion(messages=[{"role": "user", "content": turn}],
                                            max_tokens=max_tokens, temperature=0.0, stream=True)
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


class _LlamaRunner:
    """A llama-cpp-python method in a child process (spawned with the
    environment the user gave, see the module doc), streamed and timed there."""

    def __init__(self, method: str, model_path: str, n_ctx: int, threads: int | None, n_gpu_layers: int,
                 cache_type_k: str = "f16", raw: bool = False):
        from .backend.llama import TILED_MM_ENV, USER_TILED_MM

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

    def run(self, turn: str, max_tokens: int) -> dict:
        self.conn.send(("run", turn, max_tokens, self.raw))
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


def header(model, methods: Sequence[str], max_tokens: int, prompts_file: str | None,
           n_prompts: int, llama_threads: int | None = None, raw: bool = False) -> dict:
    """Machine and settings metadata: the first line of a results file.
    `exact` is the exactness self-check's verdict (SpecModel.exact: None when
    it did not run), `exactness` its detail; `exact_mode` says whether the
    backend runs the settings meant to be exact (CPU thread and K cache
    choices), which alone does not make a model exact."""
    from . import __version__
    from .backend.llama import llama_cpp_version, tiled_mm_setting
    from .costmodel import _cpu_name

    be = model.backend
    ex = getattr(model, "exactness", None)
    return {
        "kind": "header",
        "edgespec_version": __version__,
        "model": model.model_path,
        "n_threads": be.n_threads,
        "exact": None if ex is None else ex.exact,
        "exactness": None if ex is None else ex.to_json(),
        "exact_mode": be.exact,
        "cache_type_k": be.cache_type_k,
        "kernels": getattr(model, "kernels", "exact"),
        "flash_attn": "auto" if getattr(be, "flash_attn", None) is None else bool(be.flash_attn),
        "tiled_mm": tiled_mm_setting(),
        "single_token_threads": (f"{be.n_threads} up to {be.one_thread_after} KV cells, then 1 (exact mode, f16 K cache)"
                                 if be.one_thread_after is not None else str(be.n_threads)),
        "llama_cpp_python": {m: llama_peer_settings(m, llama_threads, be.cache_type_k)
                             for m in methods if is_peer(m) and split_peer(m)[0] in LLAMA_METHODS},
        "n_ctx": be.n_ctx,
        "n_gpu_layers": be.n_gpu_layers,
        "max_nodes": model.config.max_nodes,
        "cost_gate": model.config.cost_gate,
        "llama_cpp_version": llama_cpp_version(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "cost_curve": model.cost.to_json() if model.cost is not None else None,
        "methods": list(methods),
        "max_tokens": max_tokens,
        "prompts_file": prompts_file,
        "n_prompts": n_prompts,
        "raw": raw,
        "corpora": [{"path": c.path, "n_tokens": int(c.header.get("n_tokens", 0)),
                     "sources": len(c.header.get("sources", []))} for c in getattr(model, "corpora", [])],
        "decoding": "greedy",
    }


def llama_peer_settings(method: str, llama_threads: int | None, cache_type_k: str) -> dict:
    """What a llama-cpp-python method runs with (the header's record; the
    library's defaults: half the logical CPUs for single tokens, all of them
    for batches, no flash attention, an f16 K cache)."""
    from .backend.llama import default_threads

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


def resolve_default(model) -> dict:
    """What method `default` runs: `edgespec generate`'s defaults (drafter,
    kernels, K cache, threads, context, GPU layers, largest batch, cost gate,
    verification), resolved on this machine.  The bench's model must run the
    same backend settings (it is loaded once for every method); BenchError
    naming the differences otherwise.  "drafter" is the spec to run: without
    the corpora the bench loaded (generate loads none by default)."""
    from .backend.llama import auto_cache_type_k, default_threads
    from .cli import generate_defaults

    d = generate_defaults()
    be = model.backend
    threads = d["threads"] or default_threads()
    exact = d["kernels"] != "fast" and not d["n_gpu_layers"]
    want = {"kernels": d["kernels"], "n_threads": threads, "n_ctx": d["ctx"], "n_gpu_layers": d["n_gpu_layers"],
            "cache_type_k": (auto_cache_type_k(exact, threads) if d["cache_type_k"] == "auto" else d["cache_type_k"]),
            "max_nodes": d["max_nodes"], "cost_gate": not d["no_gate"], "verify": d["verify"]}
    have = {"kernels": getattr(model, "kernels", "exact"), "n_threads": be.n_threads, "n_ctx": be.n_ctx,
            "n_gpu_layers": be.n_gpu_layers, "cache_type_k": be.cache_type_k, "max_nodes": model.config.max_nodes,
            "cost_gate": model.config.cost_gate, "verify": model.config.verify.mode}
    diff = [f"{k} {have[k]} (generate's default: {want[k]})" for k in want if have[k] != want[k]]
    if diff:
        raise BenchError(f"method default runs `edgespec generate`'s defaults, but this bench's model runs "
                         f"{', '.join(diff)}: bench default without those options")
    drafter = d["drafter"] + ("-nocorpus" if getattr(model, "corpora", None) and "-nocorpus" not in d["drafter"]
                              else "")
    return dict(want, drafter=drafter, generate_drafter=d["drafter"])


def fresh_drafter(model, spec: str):
    """A new drafter object for `spec`, built as SpecModel builds a named one.
    Method `default` runs its own (so its own engine, drafter memory and
    acceptance statistics): it never learns from the answers of a method that
    runs the same drafter in this bench."""
    from .drafters import make_drafter, parse_drafter_name

    name, use_corpora, switches = parse_drafter_name(spec)
    return make_drafter(name, n_vocab=model.vocab.n_vocab, model_path=model.model_path,
                        corpora=model.corpora if use_corpora else (), **switches)


def plain_logits_at(model, prompt_tokens, prefix) -> np.ndarray:
    """The logits plain decoding (`none`) has for the token after prompt +
    prefix, recomputed as `none` computed them: the prompt prefilled in one
    go (in n_batch chunks), then the prefix decoded one token at a time.
    Leaves the KV cache empty."""
    be = model.backend
    be.reset()
    try:
        be.prefill(np.asarray(prompt_tokens, np.int32))
        one = np.ones(1, np.int32)
        zero = np.zeros(1, np.int32)
        for t in prefix:
            be.decode_tree(np.array([t], np.int32), zero, zero, one, 1)
            be.keep(1)
        return be.logits()[0].astype(np.float64)
    finally:
        be.reset()


def divergence(model, prompt_tokens, ref: Sequence[int], other: Sequence[int]) -> dict | None:
    """Where `other` first leaves `ref` (none's greedy tokens), and how close
    plain decoding was to choosing other's token there: None when they are
    equal, else {"index", "none_token", "token" (None = the answer ended
    there), "gap": none's top logit minus the logit of other's choice (the
    best end-of-generation token's when other ended), "top2_gap", and
    "reproduced": whether the re-decoded argmax is none's token}."""
    ref, other = list(ref), list(other)
    if ref == other:
        return None
    n = min(len(ref), len(other))
    i = next((k for k in range(n) if ref[k] != other[k]), n)
    lg = plain_logits_at(model, prompt_tokens, ref[:i])
    eog = model.backend.vocab.eog_mask()
    a = ref[i] if i < len(ref) else None
    b = other[i] if i < len(other) else None
    top = float(lg.max())
    b_logit = float(lg[b]) if b is not None else float(lg[eog].max())
    second = float(np.partition(lg, -2)[-2])
    best = int(lg.argmax())
    return {"index": i, "none_token": a, "token": b, "gap": top - b_logit, "top2_gap": top - second,
            "reproduced": best == a if a is not None else bool(eog[best])}


def server_binary(methods: Sequence[str]):
    """The llama-server the methods need (edgespec.peers.find_llama_server),
    None when they need none; PeerError (one line, with the build command)
    when it is not built, does not run or was built from another llama.cpp."""
    if not any(split_peer(m) and split_peer(m)[0] in SERVER_METHODS for m in methods):
        return None
    from .peers import find_llama_server
    return find_llama_server()


class _Methods:
    """Runs the methods of one bench: edgespec's on the loaded model, the
    peers in their own processes (each started on first use, all closed at
    the end).  `default` runs a drafter of its own, new in every pass."""

    def __init__(self, model, methods: Sequence[str], llama_threads: int | None, raw: bool):
        self.model, self.llama_threads, self.raw = model, llama_threads, raw
        self.peers: dict = {}
        self.default = resolve_default(model) if "default" in methods else None
        self.default_drafter = None
        self.server = server_binary(methods)

    def new_pass(self) -> None:
        if self.default is not None:
            self.default_drafter = fresh_drafter(self.model, self.default["drafter"])

    def engine(self, m: str):
        return self.model._engine_for(self.default_drafter if m == "default" else m)

    def server_settings(self, methods: Sequence[str]) -> dict | None:
        """The header's record of the llama-server methods: binary, version, arguments, threads."""
        if self.server is None:
            return None
        from .backend.llama import default_threads
        out = {"binary": self.server.describe(), "methods": {}}
        for m in methods:
            peer = split_peer(m)
            if peer and peer[0] in SERVER_METHODS:
                n = peer[1] or self.llama_threads
                out["methods"][m] = {"spec_args": list(_SERVER_ARGS[peer[0]]),
                                     "threads": n or default_threads(), "threads_default": n is None}
        return out

    def run(self, m: str, turn: str, tokens, n_tok: int) -> dict:
        peer = split_peer(m)
        if peer is None:
            # the plain run also records the model's top-8 at each position, so
            # that tools/replay.py can replay drafters that read the model's ranking
            drafter = self.default_drafter if m == "default" else m
            r = self.model.generate(tokens, max_tokens=n_tok, drafter=drafter,
                                    record_topk=8 if m == "none" else 0).to_dict()
            r["tokens"] = [int(t) for t in r["tokens"]]
            return r
        return self._peer(m).run(tokens if peer[0] in SERVER_METHODS else turn, n_tok)

    def _peer(self, m: str):
        if m not in self.peers:
            be = self.model.backend
            base, n = split_peer(m)
            if base in SERVER_METHODS:
                from .peer_server import LlamaServerRunner, server_env
                self.peers[m] = LlamaServerRunner(base, self.server.path, self.model.model_path, be.n_ctx,
                                                  be.n_gpu_layers, n or self.llama_threads, env=server_env())
            else:
                self.peers[m] = _LlamaRunner(m, self.model.model_path, be.n_ctx, self.llama_threads,
                                             be.n_gpu_layers, cache_type_k=be.cache_type_k, raw=self.raw)
        return self.peers[m]

    def close(self) -> None:
        for r in self.peers.values():
            r.close()


def _result_row(model, p: BenchPrompt, i: int, rep: int, m: str, r: dict, base: dict | None, tokens) -> dict:
    """One result line: a method's run set against none's (tokens, or the
    text for llama-cpp-python, whose tokens are re-tokenized)."""
    text_only = is_peer(m) and split_peer(m)[0] in LLAMA_METHODS
    if base is None:
        same = None
    elif text_only:
        same = r["text"] == base["text"]
    else:
        same = r["tokens"] == base["tokens"]
    rec = {"kind": "result", "question_id": p.question_id, "category": p.category,
           "method": m, "prompt_index": i - 1, "repeat": rep}
    rec.update(r)
    rec["identical_to_none"] = same
    if base is not None and not is_peer(m) and m != "none":
        rec["rouge_l_to_none"] = round(rouge_l(base["tokens"], r["tokens"]), 4)
        if not same and r.get("verify", "exact") == "exact":
            rec["divergence"] = divergence(model, tokens, base["tokens"], r["tokens"])
    return rec


def run_bench(model, prompts: Sequence[BenchPrompt], methods: Sequence[str], *, max_tokens: int = 128,
              out_path: str | None = None, prompts_file: str | None = None,
              progress: Callable[[str], None] | None = None,
              llama_threads: int | None = None, repeat: int = 1, raw: bool = False) -> tuple[dict, list[dict]]:
    """Run every method on every prompt with `model` (a SpecModel); return the
    header and the result dicts, writing them as JSON lines to `out_path` as
    they come (a run stopped half-way keeps what it finished).  llama_threads:
    threads for the peer methods without an @tN suffix (None = each one's
    defaults).  repeat: run the whole prompt list that many times (passes);
    each pass starts a fresh session (model.new_session(): no acceptance
    statistics or drafter memory carried over, so a later pass cannot copy an
    earlier answer) and rows carry their pass number in "repeat".  raw: send
    each prompt as plain text (no chat template; for base models),
    llama-cpp-python through create_completion, llama-server as the same
    token ids.  An edgespec method whose tokens differ from none's gets a
    "divergence" record (see divergence())."""
    if max_tokens < 1:
        raise BenchError("max_tokens must be >= 1")
    if repeat < 1:
        raise BenchError("repeat must be >= 1")
    methods = parse_methods(methods)
    say = progress or (lambda s: None)
    be = model.backend
    # every prompt is tokenized and checked, and the peers found, before the
    # results file is opened: a prompt that does not fit (or a base model
    # without --raw, or a llama-server not built) fails the run before
    # anything is written
    warm_tokens = model.prompt_tokens(WARMUP_PROMPT, raw=raw)
    prompt_tokens = [model.prompt_tokens(p.turn, raw=raw) for p in prompts]
    for p, tokens in zip(prompts, prompt_tokens):
        if len(tokens) >= be.n_ctx:
            raise BenchError(f"prompt {p.question_id} ({p.category}) has {len(tokens)} tokens, "
                             f"more than the context of {be.n_ctx}; raise --ctx")
    runner = _Methods(model, methods, llama_threads, raw)
    head = header(model, methods, max_tokens, prompts_file, len(prompts), llama_threads, raw=raw)
    head.update(repeat=repeat, default=runner.default, llama_server=runner.server_settings(methods))
    out = None
    try:
        if out_path:
            out = open(out_path, "w", encoding="utf-8")
            out.write(json.dumps(head) + "\n")
            out.flush()
        results: list[dict] = []

        def emit(rec: dict) -> None:
            results.append(rec)
            if out is not None:
                out.write(json.dumps(rec) + "\n")

        for rep in range(repeat):
            tag = f"[pass {rep + 1}/{repeat}] " if repeat > 1 else ""
            if rep:
                model.new_session()
            runner.new_pass()
            say(f"{tag}warming up: {', '.join(methods)}")
            for m in methods:
                runner.run(m, WARMUP_PROMPT, warm_tokens, 16)
            for i, (p, tokens) in enumerate(zip(prompts, prompt_tokens), 1):
                rows = {}
                # rotate the order from prompt to prompt (and pass to pass):
                # whatever running first or second after another method costs
                # (measured: a few percent of decode time on the 2-core machine)
                # falls on every method alike
                k = (i - 1 + rep) % len(methods)
                for m in list(methods[k:]) + list(methods[:k]):
                    rows[m] = dict(runner.run(m, p.turn, tokens, max_tokens), n_prompt_tokens=len(tokens))
                for m in methods:
                    emit(_result_row(model, p, i, rep, m, rows[m], rows.get("none"), tokens))
                if out is not None:
                    out.flush()
                speeds = "  ".join(f"{m} {rows[m]['tokens_per_s']:.1f} tok/s" for m in methods)
                say(f"{tag}[{i:>{len(str(len(prompts)))}}/{len(prompts)}] {p.category:<14} {speeds}")
            # the acceptance model of each drafter after the pass: predicted
            # against observed acceptance per source (how well the cost gate's
            # inputs held)
            for m in methods:
                if not is_peer(m) and m != "none":
                    emit({"kind": "calibration", "method": m, "repeat": rep,
                          "rows": runner.engine(m).acceptance.report()})
        return head, results
    finally:
        if out is not None:
            out.close()
        runner.close()


# ------------------------------------------------------------------ report
def read_results(path: str) -> tuple[dict | None, list[dict]]:
    """Read a results file written by run_bench, plain or gzip-compressed
    (results.jsonl.gz, as the repository keeps them): (header or None, result dicts)."""
    if not os.path.isfile(path):
        raise BenchError(f"results file not found: {path}")
    head, results = None, []
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    try:
        with (gzip.open(path, "rt", encoding="utf-8") if gz else open(path, encoding="utf-8")) as f:
            for lineno, rec in _json_objects(path, f):
                if rec.get("kind") == "header":
                    head = rec
                    continue
                if rec.get("kind") == "calibration":
                    results.append(rec)
                    continue
                missing = [k for k in ("category", "method", "n_generated", "decode_s") if k not in rec]
                if missing:
                    raise BenchError(f"{path}:{lineno}: not a bench result (missing {', '.join(missing)})")
                results.append(rec)
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise BenchError(f"cannot read results file {path}: {e}") from None
    if not results:
        raise BenchError(f"no results in {path}")
    return head, results


POOL_KEYS = ("model", "max_tokens", "raw", "n_threads", "cache_type_k", "kernels", "n_ctx", "n_gpu_layers",
             "cpu", "cost_gate", "max_nodes")
"""Header fields that must agree for results files to be reported together."""
POOL_DEFAULTS = {"kernels": "exact"}
"""What a header field absent from an older results file meant (before --kernels, every run was exact)."""


def _pool_key(r: dict):
    """(prompt, method, pass) of a result row; None for other rows (calibration)."""
    if r.get("kind", "result") != "result":
        return None
    return r.get("question_id"), r.get("method"), r.get("repeat", 0)


def _pool_value(head: dict, key: str):
    return head.get(key, POOL_DEFAULTS.get(key))


def read_results_pooled(paths: Sequence[str]) -> tuple[dict | None, list[dict]]:
    """Several results files of the same model and settings, reported as one
    (a bench stopped part way and completed with --category or --limit on the
    remaining prompts): the first file's header with "pooled" listing every
    file, and every file's rows.  Files whose headers differ in a POOL_KEYS
    field, or that hold the same prompt and method in the same pass, are an
    error: their rows would not be comparable."""
    head, results = read_results(paths[0])
    if len(paths) == 1:
        return head, results
    seen = {_pool_key(r) for r in results} - {None}
    pooled = [{"file": paths[0], "date": (head or {}).get("date")}]
    for path in paths[1:]:
        h, rows = read_results(path)
        if head is None or h is None:
            raise BenchError(f"{path if h is None else paths[0]}: no header, so it cannot be pooled with other runs")
        diff = [f"{k} ({_pool_value(h, k)} vs {_pool_value(head, k)})" for k in POOL_KEYS
                if _pool_value(h, k) != _pool_value(head, k)]
        if diff:
            raise BenchError(f"{path} and {paths[0]} differ in {', '.join(diff)}: runs with different models "
                             f"or settings cannot be pooled")
        for r in rows:
            k = _pool_key(r)
            if k is None:
                continue
            if k in seen:
                raise BenchError(f"{path}: prompt {k[0]} with {k[1]} is also in an earlier file; pool runs of "
                                 f"different prompts (bench --category / --limit)")
            seen.add(k)
        results += rows
        pooled.append({"file": path, "date": h.get("date")})
    return dict(head, pooled=pooled), results


def _is_edgespec(rows: list[dict]) -> bool:
    return any(r.get("n_steps") is not None for r in rows)


def method_stats(rows: list[dict]) -> dict:
    """Aggregate one method's results over a set of prompts."""
    n_tok = sum(max(0, r["n_generated"] - 1) for r in rows)
    dec = sum(r["decode_s"] for r in rows)
    st = {"n": len(rows), "tokens_per_s": n_tok / dec if dec > 0 else 0.0,
          "mean_accepted": None, "engine_ms_per_step": None, "decode_ms_per_step": None,
          "identical": None, "n_compared": 0}
    steps = [r for r in rows if r.get("n_steps")]
    if steps:
        n_steps = sum(r["n_steps"] for r in steps)
        committed = sum(r["mean_accepted"] * r["n_steps"] for r in steps)
        st["mean_accepted"] = committed / n_steps
        eng = [r["engine_s"] / r["n_steps"] * 1000 for r in steps if r.get("engine_s") is not None]
        if eng:
            st["engine_ms_per_step"] = sum(eng) / len(eng)
        dc = [r["decode_call_s"] / r["n_steps"] * 1000 for r in steps if r.get("decode_call_s") is not None]
        if dc:
            st["decode_ms_per_step"] = sum(dc) / len(dc)
    cmp = [r["identical_to_none"] for r in rows if r.get("identical_to_none") is not None]
    if cmp:
        st["identical"] = sum(1 for x in cmp if x)
        st["n_compared"] = len(cmp)
    rl = [r["rouge_l_to_none"] for r in rows if r.get("rouge_l_to_none") is not None]
    st["rouge_l"] = sum(rl) / len(rl) if rl else None
    return st


def pass_speedups(rows: list[dict], method: str) -> list[float]:
    """The method's speedup over `none` in each pass (bench --repeat) on its own."""
    out = []
    for rep in sorted({r.get("repeat", 0) for r in rows}):
        here = [r for r in rows if r.get("repeat", 0) == rep]
        a = method_stats([r for r in here if r["method"] == method])
        b = method_stats([r for r in here if r["method"] == "none"])
        if a["n"] and b["n"] and b["tokens_per_s"] > 0:
            out.append(a["tokens_per_s"] / b["tokens_per_s"])
    return out


CI_MIN_UNITS = 4
"""Fewest (prompt, pass) runs for which the report gives a confidence interval."""


def speedup_ci(rows: list[dict], method: str, level: float = 0.95, n_boot: int = 2000,
               seed: int = 0) -> tuple[float, float] | None:
    """A bootstrap confidence interval of the method's speedup over `none`.

    The unit is one (prompt, pass) pair with both runs, so each resample keeps
    a run beside the `none` run it was timed against.  With several passes the
    units are resampled within each prompt: the interval then says how far
    machine noise moves the speedup on these prompts (the drafts are the same
    in every pass).  With one pass the prompts themselves are resampled, so
    the interval also holds the spread between prompts.  The statistic is the
    pooled speedup, sum(tokens) / sum(decode_s) over sum(tokens) / sum(decode_s)
    of `none`, as in the tables.  None when fewer than CI_MIN_UNITS units."""
    def key(r):
        return r.get("question_id", r.get("prompt_index")), r.get("repeat", 0)

    base = {key(r): r for r in rows if r["method"] == "none" and key(r)[0] is not None}
    units: dict = {}
    several = len({k[1] for k in base}) > 1
    for r in rows:
        k = key(r)
        if r["method"] == method and k in base:
            b = base[k]
            units.setdefault(k[0] if several else None, []).append(
                (max(0, r["n_generated"] - 1), r["decode_s"], max(0, b["n_generated"] - 1), b["decode_s"]))
    if sum(len(v) for v in units.values()) < CI_MIN_UNITS:
        return None
    rng = np.random.default_rng(seed)
    tot = np.zeros((n_boot, 4))
    for group in units.values():
        a = np.asarray(group, np.float64)
        pick = rng.integers(0, len(a), size=(n_boot, len(a)))
        tot += a[pick].sum(axis=1)
    ok = (tot[:, 1] > 0) & (tot[:, 2] > 0)
    sp = (tot[ok, 0] / tot[ok, 1]) / (tot[ok, 2] / tot[ok, 3])
    if len(sp) == 0:
        return None
    lo, hi = np.quantile(sp, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def _table(title: str, rows: list[dict], methods: list[str]) -> list[str]:
    by_m = {m: [r for r in rows if r["method"] == m] for m in methods}
    stats = {m: method_stats(v) for m, v in by_m.items() if v}
    n_prompts = max((len({r.get("question_id", i) for i, r in enumerate(v)}) for v in by_m.values()), default=0)
    n_passes = len({r.get("repeat", 0) for r in rows})
    base = stats.get("none")
    lossy = any(s.get("rouge_l") is not None and s["identical"] != s["n_compared"] for s in stats.values())
    cols = ("method", "tok/s", "acc/step", "speedup", "95% CI") + (("passes",) if n_passes > 1 else ()) + \
        ("identical",) + \
        (("ROUGE-L",) if lossy else ()) + ("engine ms/step", "decode ms/step")
    body = []
    for m in methods:
        if m not in stats:
            continue
        s = stats[m]
        speed = (f"{s['tokens_per_s'] / base['tokens_per_s']:.2f}x"
                 if base and base["tokens_per_s"] > 0 else "-")
        ci = speedup_ci(rows, m) if base and m != "none" else None
        ci_s = f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else "-"
        spread = ()
        if n_passes > 1:
            ps = pass_speedups(rows, m) if base and m != "none" else []
            spread = (f"{min(ps):.2f}-{max(ps):.2f}" if ps else "-",)
        ident = "-" if m == "none" or s["identical"] is None else f"{s['identical']}/{s['n_compared']}"
        body.append((m, f"{s['tokens_per_s']:.1f}",
                     "-" if s["mean_accepted"] is None else f"{s['mean_accepted']:.2f}",
                     speed, ci_s) + spread + (ident,) +
                    ((("-" if s.get("rouge_l") is None else f"{s['rouge_l']:.3f}"),) if lossy else ()) + (
                     "-" if s["engine_ms_per_step"] is None else f"{s['engine_ms_per_step']:.2f}",
                     "-" if s["decode_ms_per_step"] is None else f"{s['decode_ms_per_step']:.2f}"))
    widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(cols)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    passes = f" x {n_passes} passes" if n_passes > 1 else ""
    lines = [f"{title} ({n_prompts} prompt{'s' if n_prompts != 1 else ''}{passes})", fmt(cols),
             fmt(["-" * w for w in widths])]
    lines += [fmt(b) for b in body]
    return lines


def format_report(results: Iterable[dict], head: dict | None = None) -> str:
    """Tables per category (in order of first appearance) and over all prompts.

    tok/s: decode tokens per second, sum(n_generated - 1) / sum(decode_s).
    acc/step: tokens committed per verification step (edgespec methods).
    speedup: tok/s over the tok/s of `none` on the same prompts.
    95% CI: a bootstrap interval of the speedup (see speedup_ci): with
        several passes, how far the machine's noise moves it on these
        prompts; with one pass, across prompts as well.
    passes (with bench --repeat): the lowest and highest speedup of a single
        pass, each pass on its own.
    identical: runs whose output equals `none`'s in the same pass (tokens for
        edgespec and llama-server methods, text for llama-cpp-python methods),
        as k/n.
    engine ms/step: edgespec's own time per step outside llama_decode
        (drafting, gate, verification, bookkeeping), averaged over prompts;
    decode ms/step: time inside llama_decode per step, averaged over prompts.
    """
    results = list(results)
    calib = [r for r in results if r.get("kind") == "calibration"]
    results = [r for r in results if r.get("kind", "result") == "result"]
    methods, cats = methods_and_categories(results)
    out: list[str] = []
    if head:
        out.append(f"model: {head.get('model')}")
        out.append(f"machine: {head.get('cpu')} ({head.get('hostname')}), {head.get('n_threads')} threads, "
                   f"n_ctx {head.get('n_ctx')}, n_gpu_layers {head.get('n_gpu_layers')}, "
                   f"K cache {head.get('cache_type_k', 'f16')}, "
                   + (f"kernels {head['kernels']}, " if head.get("kernels", "exact") != "exact" else "") +
                   f"llama_cpp {head.get('llama_cpp_version')}, {head.get('date')}")
        reps = int(head.get("repeat", 1) or 1)
        out.append(f"max_tokens {head.get('max_tokens')}, greedy decoding" +
                   (", raw prompts (no chat template)" if head.get("raw") else "") +
                   (f", {reps} passes (each a fresh session)" if reps > 1 else ""))
        out.append(_exact_line(head))
        out += peer_header_lines(head)
        if head.get("pooled"):
            out.append(f"pooled from {len(head['pooled'])} runs (each prompt's methods side by side in one of them): "
                       + ", ".join(f"{os.path.basename(p['file'])} ({p['date']})" for p in head["pooled"]))
        out.append("")
    for c in cats:
        out += _table(c, [r for r in results if r["category"] == c], methods)
        out.append("")
    out += _table("all", results, methods)
    few = [c for c in cats if len({r.get("question_id") for r in results if r["category"] == c}) < 5]
    if few and len({r.get("repeat", 0) for r in results}) == 1 and "none" in methods:
        out += ["", f"note: {len(few)} categor{'y has' if len(few) == 1 else 'ies have'} fewer than 5 prompts "
                    f"({', '.join(few)}); on a busy machine their speedups can move by 0.1x or more from run "
                    f"to run: --repeat N runs every prompt N times and shows the spread"]
    out += divergence_lines(results, head)
    if calib:
        out += ["", "acceptance calibration (draft nodes whose parent was accepted; predicted = the gate's "
                    "estimate, observed = share accepted)",
                f"{'method':<20} {'source':<10} {'tested':>8} {'predicted':>10} {'observed':>9}"]
        agg: dict = {}          # (method, source) over every pass
        for c in calib:
            for row in c["rows"]:
                a = agg.setdefault((c["method"], row["source"]), [0, 0.0, 0.0])
                a[0] += row["tested"]
                a[1] += row["predicted"] * row["tested"]
                a[2] += row["observed"] * row["tested"]
        for (m, src), (n, pr, ob) in agg.items():
            out.append(f"{m:<20} {src:<10} {n:>8} {pr / n:>10.3f} {ob / n:>9.3f}")
    return "\n".join(out)


def peer_header_lines(head: dict) -> list[str]:
    """What method `default` resolved to and which llama-server ran, for the report's header."""
    out = []
    d = head.get("default")
    if d:
        out.append(f"default = `edgespec generate` with no options: drafter {d['generate_drafter']}, kernels "
                   f"{d['kernels']}, K cache {d['cache_type_k']}, {d['n_threads']} threads, n_ctx {d['n_ctx']}, "
                   f"max_nodes {d['max_nodes']}, cost gate {'on' if d['cost_gate'] else 'off'}")
    srv = head.get("llama_server")
    if srv:
        b = srv["binary"]
        same = (f"built from llama-cpp-python {b['llama_cpp_python']}'s llama.cpp" if b.get("same_as_llama_cpp_python")
                else "not built by edgespec build-peers (its llama.cpp unchecked)")
        out.append(f"llama-server: {b['version']}, {same}; " + ", ".join(
            f"{m} {s['threads']} thread{'s' if s['threads'] != 1 else ''}" for m, s in srv["methods"].items()))
    return out


def _exact_line(head: dict) -> str:
    ex = head.get("exactness")
    if head.get("exact") is None or not ex:
        return "exact: not checked (the exactness self-check did not run)"
    if ex["exact"]:
        return (f"exact: true (self-check: batches of 2..{ex['max_t']} tokens gave logits bit-identical "
                f"to one-token decoding)")
    return (f"exact: FALSE (self-check: batches of {', '.join(map(str, ex['failed']))} tokens differ from "
            f"one-token decoding by up to {ex['max_abs_diff']:.3g}; greedy text can differ at near-ties)")


def divergence_lines(results: list[dict], head: dict | None) -> list[str]:
    """The divergences of exact edgespec methods from `none`, each with its
    logit gap, set against the self-check: a gap wider than twice its largest
    |logit difference| (or any gap when the check found the model exact) is
    no near-tie that batched arithmetic explains."""
    rows = [r for r in results if r.get("divergence")]
    ex = (head or {}).get("exactness") or {}
    bound = 2 * float(ex.get("max_abs_diff", 0.0)) if ex else None
    compared = [r for r in results if r.get("identical_to_none") is not None and r["method"] != "none"
                and not is_peer(r["method"]) and r.get("verify", "exact") == "exact"]
    if not compared:
        return []
    out = ["", f"divergences from none: {len(rows)} of {len(compared)} runs of exact edgespec methods"
               + (" (gap = none's top logit minus the logit of the method's token, re-decoded plainly)" if rows else "")]
    for r in rows:
        d = r["divergence"]
        tok = "end of answer" if d["token"] is None else f"token {d['token']}"
        if not d.get("reproduced", True):
            verdict = "re-decoding did not reproduce none's token: look for a bug"
        elif bound is None:
            verdict = "no self-check to compare with"
        elif d["gap"] <= bound:
            verdict = f"near-tie (<= 2 x the self-check's {bound / 2:.3g})"
        else:
            verdict = (f"NOT a near-tie batched arithmetic explains (self-check max |dlogit| {bound / 2:.3g}): "
                       "look for a bug")
        out.append(f"  {r['method']:<18} q{r.get('question_id')} ({r.get('category')}), pass {r.get('repeat', 0)}, "
                   f"at token {d['index']} ({tok} instead of {d['none_token']}): gap {d['gap']:.4g}, "
                   f"top-2 gap {d['top2_gap']:.4g}: {verdict}")
    return out


def methods_and_categories(results: list[dict]) -> tuple[list[str], list[str]]:
    """The methods and the categories of result rows, each in first-seen order."""
    return list(dict.fromkeys(r["method"] for r in results)), list(dict.fromkeys(r["category"] for r in results))


def plot_results(results: Iterable[dict], path: str, head: dict | None = None) -> None:
    """Decode tokens/s by category (and over all prompts) and method, as
    grouped bars, into an image file (matplotlib: the `plot` extra)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install 'edgespec[plot]'") from None
    results = [r for r in results if r.get("kind", "result") == "result"]
    methods, cats = methods_and_categories(results)
    cats.append("all")
    speeds = np.array([[method_stats([r for r in results if r["method"] == m and c in ("all", r["category"])])
                        ["tokens_per_s"] for c in cats] for m in methods])
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(6.0, (0.5 + 0.12 * len(methods)) * len(cats) + 3), 4.5))
    x = np.arange(len(cats))
    for i, m in enumerate(methods):
        ax.bar(x + (i - (len(methods) - 1) / 2) * width, speeds[i], width, label=m)
    ax.set_xticks(x)
    ax.set_xticklabels(cats, rotation=30, ha="right")
    ax.set_ylabel("decode tokens/s")
    title = os.path.basename(str((head or {}).get("model", "")))
    if head:
        title += f"\n{head.get('cpu')}, {head.get('n_threads')} threads, K cache {head.get('cache_type_k')}, " \
                 f"max_tokens {head.get('max_tokens')}"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except (OSError, ValueError) as e:
        raise BenchError(f"cannot write the plot {path}: {e}") from None
    finally:
        plt.close(fig)


def stderr_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
