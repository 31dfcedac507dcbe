"""Benchmark: edgespec drafters against plain decoding and llama-cpp-python.

One process loads the model once (`SpecModel(drafter="none")`) and runs every
requested method (see edgespec.bench.methods) on every prompt, prompt-major
(for each prompt, each method in turn) so that machine noise falls on all
methods alike.  Greedy decoding only: then every edgespec method must give
exactly the tokens of `none`, and the results file records whether it did;
one that does not gets a `divergence` record (edgespec.bench.divergence).
A prompt with a constraint runs under it in every method
(edgespec.bench.prompts).

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
import json
import os
import platform
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

from edgespec.bench.divergence import divergence
from edgespec.bench.llama_peer import LlamaRunner, llama_peer_settings
from edgespec.bench.methods import (DEFAULT_MEMORY, LLAMA_METHODS, SERVER_METHODS, fresh_drafter, is_peer, parse_methods,
                                    resolve_default, server_binary, split_peer, with_memory)
from edgespec.bench.peer_server import SERVER_METHODS as _SERVER_ARGS
from edgespec.bench.prompts import BenchPrompt, Constraint, constraint_summary, prompt_constraint
from edgespec.core.params import Request
from edgespec.core.verify import rouge_l
from edgespec.errors import BenchError

WARMUP_PROMPT = "Say hello."
WARMUP_SCHEMA = {"type": "object", "properties": {"greeting": {"type": "string"}}, "required": ["greeting"]}
"""The constraint of the warm-up's second request when the prompts are constrained
(each method's grammar path runs once before the timed prompts)."""

RESULT_FIELDS = ("question_id", "category", "method", "text", "tokens", "n_prompt_tokens",
                 "n_generated", "n_steps", "mean_accepted", "prefill_s", "decode_s",
                 "tokens_per_s", "stop_reason", "identical_to_none")


def header(model, methods: Sequence[str], max_tokens: int, prompts_file: str | None,
           n_prompts: int, llama_threads: int | None = None, raw: bool = False) -> dict:
    """Machine and settings metadata: the first line of a results file.
    `exact` is the exactness self-check's verdict (SpecModel.exact: None when
    it did not run), `exactness` its detail; `exact_mode` says whether the
    backend runs the settings meant to be exact (CPU thread and K cache
    choices), which alone does not make a model exact."""
    from edgespec.version import __version__
    from edgespec.backend.process import llama_cpp_version, tiled_mm_setting
    from edgespec.backend.ggml import hello_ms
    from edgespec.calibration.cache import cpu_name

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
        "kernels_setting": getattr(model, "kernels_setting", None),
        "kernel_price": None if getattr(model, "kernel_price", None) is None else model.kernel_price.to_json(),
        "flash_attn": "auto" if getattr(be, "flash_attn", None) is None else bool(be.flash_attn),
        "tiled_mm": tiled_mm_setting(),
        "single_token_threads": (f"{be.n_threads} up to {be.one_thread_after} KV cells, then 1 (exact mode, f16 K cache)"
                                 if be.one_thread_after is not None else str(be.n_threads)),
        "llama_cpp_python": {m: llama_peer_settings(m, llama_threads, be.cache_type_k)
                             for m in methods if is_peer(m) and split_peer(m)[0] in LLAMA_METHODS},
        "n_ctx": be.n_ctx,
        "n_gpu_layers": be.n_gpu_layers,
        "rpc": list(getattr(be, "rpc", [])),
        "rpc_hello_ms": {ep: hello_ms.get(ep) for ep in getattr(be, "rpc", [])},
        "tensor_split": list(getattr(be, "tensor_split", [])),
        "rpc_output": getattr(be, "rpc_output", "local") if getattr(be, "rpc", None) else None,
        "max_nodes": model.config.max_nodes,
        "cost_gate": model.config.cost_gate,
        "llama_cpp_version": llama_cpp_version(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "cpu": cpu_name(),
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


class _Methods:
    """Runs the methods of one bench: edgespec's on the loaded model, the
    peers in their own processes (each started on first use, all closed at
    the end).  `default` runs a drafter of its own, new in every pass."""

    def __init__(self, model, methods: Sequence[str], llama_threads: int | None, raw: bool,
                 peer_rpc: Sequence[str] = (), memory_file: str | None = None):
        self.model, self.llama_threads, self.raw = model, llama_threads, raw
        self.memory_file = memory_file
        self.methods = list(methods)
        self.own: dict = {}         # method -> (its drafter, its memory store or None): default, NAME+memory
        self.peer_rpc = list(peer_rpc)
        self.peers: dict = {}
        servers = [m for m in methods if is_peer(m) and split_peer(m)[0] in SERVER_METHODS]
        on_rpc = bool(getattr(model.backend, "rpc", None))
        others = [m for m in methods if is_peer(m) and m not in servers]
        if on_rpc and others:
            raise BenchError(f"{', '.join(others)} cannot run over --rpc: llama-cpp-python's own rpc_servers "
                             "argument does nothing (the bench would time it on this machine); leave it out")
        # a worker serves one client at a time: edgespec's model holds its
        # workers, and each llama-server method (a process kept for the run) would hold its own
        if on_rpc and servers and not self.peer_rpc:
            raise BenchError("over --rpc the llama-server methods need workers of their own (--peer-rpc): a "
                             "worker serves one client at a time, and edgespec's model holds these")
        if self.peer_rpc and len(servers) > 1:
            raise BenchError(f"over --rpc one llama-server method per run ({', '.join(servers)} given): each "
                             "would hold the --peer-rpc workers for the whole run")
        self.default = resolve_default(model) if {"default", DEFAULT_MEMORY} & set(methods) else None
        self.with_memory = [m for m in methods if with_memory(m)]
        self.server = server_binary(methods)

    def new_pass(self) -> None:
        """Fresh drafters for default and the NAME+memory methods, the latter
        with fresh stores."""
        if self.default is not None and "default" in self.methods:
            self.own["default"] = (fresh_drafter(self.model, self.default["drafter"]), None)
        for m in self.with_memory:
            store = self._store()
            spec = self.default["drafter"] if m == DEFAULT_MEMORY else m
            self.own[m] = (fresh_drafter(self.model, spec, store), store)

    def _store(self):
        """A memory store as the run starts: empty, or what --memory FILE holds
        (read, never written)."""
        from edgespec.memory import MemoryStore
        if self.memory_file is None:
            return MemoryStore()
        from edgespec.corpus.format import tokenizer_fingerprint
        from edgespec.memory.file import open_store
        store = open_store(self.memory_file, tokenizer_fingerprint(self.model.vocab))
        store.path = None
        return store

    def start_prompts(self) -> None:
        """After the warm-up: the memory methods' stores as the run starts (the
        warm-up's answers forgotten)."""
        for m in self.with_memory:
            self.own[m][1].load(*self._store().snapshot())

    def drafter(self, m: str):
        """What model.generate runs for method m: its name, or its own drafter."""
        return self.own[m][0] if m in self.own else m

    def engine(self, m: str):
        e = self.model.engine_for(self.drafter(m))
        if m in self.own:
            e.memory = self.own[m][1]
        return e

    def server_settings(self, methods: Sequence[str]) -> dict | None:
        """The header's record of the llama-server methods: binary, version, arguments, threads."""
        if self.server is None:
            return None
        from edgespec.backend.process import default_threads
        out = {"binary": self.server.describe(), "methods": {}}
        for m in methods:
            peer = split_peer(m)
            if peer and peer[0] in SERVER_METHODS:
                n = peer[1] or self.llama_threads
                out["methods"][m] = {"spec_args": list(_SERVER_ARGS[peer[0]]),
                                     "threads": n or default_threads(), "threads_default": n is None}
        return out

    def run(self, m: str, turn: str, tokens, n_tok: int, c: Constraint | None = None) -> dict:
        """One request of method m; c: what the answer must follow (edgespec
        gets the schema or grammar as given, the peers its GBNF)."""
        peer = split_peer(m)
        gbnf = None if c is None else c.gbnf
        if peer is None:
            # the plain run also records the model's top-8 at each position, so
            # that edgespec replay can replay drafters that read the model's ranking
            drafter = self.drafter(m)
            self.engine(m)
            kw = {} if c is None else {"json_schema": c.json_schema, "grammar": c.grammar}
            # each prompt prefilled whole, as the recorded runs were (no prefix kept from the prompt before)
            request = Request(tokens, max_tokens=n_tok, drafter=drafter, record_topk=8 if m == "none" else 0,
                              reuse_prefix=False, **kw)
            r = self.model.run(request).to_dict()
            r["tokens"] = [int(t) for t in r["tokens"]]
            return r
        if peer[0] in SERVER_METHODS:
            return self._peer(m).run(tokens, n_tok, grammar=gbnf)
        return self._peer(m).run(turn, n_tok, gbnf)

    def _peer(self, m: str):
        if m not in self.peers:
            be = self.model.backend
            base, n = split_peer(m)
            if base in SERVER_METHODS:
                from edgespec.bench.peer_server import LlamaServerRunner, server_env
                self.peers[m] = LlamaServerRunner(base, self.server.path, self.model.model_path, be.n_ctx,
                                                  be.n_gpu_layers, n or self.llama_threads, env=server_env(),
                                                  rpc=self.peer_rpc, tensor_split=be.tensor_split,
                                                  rpc_output=be.rpc_output)
            else:
                self.peers[m] = LlamaRunner(m, self.model.model_path, be.n_ctx, self.llama_threads,
                                            be.n_gpu_layers, cache_type_k=be.cache_type_k, raw=self.raw)
        return self.peers[m]

    def close(self) -> None:
        for r in self.peers.values():
            r.close()


def _result_row(model, p: BenchPrompt, i: int, rep: int, m: str, r: dict, base: dict | None, tokens,
                c: Constraint | None = None) -> dict:
    """One result line: a method's run set against none's (tokens, or the
    text for llama-cpp-python, whose tokens are re-tokenized); with a
    constraint, whether the answer follows it ("valid", and "invalid_reason"
    when it does not)."""
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
    if c is not None:
        why = c.answer_error(model.vocab, r["text"])
        rec["valid"] = why is None
        if why is not None:
            rec["invalid_reason"] = why
    if base is not None and not is_peer(m) and m != "none":
        rec["rouge_l_to_none"] = round(rouge_l(base["tokens"], r["tokens"]), 4)
        if not same and r.get("verify", "exact") == "exact":
            rec["divergence"] = divergence(model, tokens, base["tokens"], r["tokens"],
                                           gbnf=None if c is None else c.gbnf)
    return rec


def _warm_up(model, runner: _Methods, methods: Sequence[str], tokens, constrained: bool) -> None:
    """Each method's untimed first request(s) on the warm-up prompt; with
    constrained prompts a second one under WARMUP_SCHEMA, so that what a
    method does once for grammars is not timed on the first prompt."""
    c = prompt_constraint(model.vocab, BenchPrompt(0, "warm-up", WARMUP_PROMPT, WARMUP_SCHEMA)) if constrained else None
    for m in methods:
        runner.run(m, WARMUP_PROMPT, tokens, 16)
        if c is not None:
            runner.run(m, WARMUP_PROMPT, tokens, 16, c)


class _Sink:
    """Where a run's rows go: kept in a list, and written as JSON lines to
    the results file (when there is one) as they come, the header first, so
    that a run stopped half-way keeps what it finished."""

    def __init__(self, out_path: str | None, head: dict):
        self.results: list[dict] = []
        self.out = None
        if out_path:
            self.out = open(out_path, "w", encoding="utf-8")
            self.out.write(json.dumps(head) + "\n")
            self.out.flush()

    def emit(self, rec: dict) -> None:
        self.results.append(rec)
        if self.out is not None:
            self.out.write(json.dumps(rec) + "\n")

    def flush(self) -> None:
        if self.out is not None:
            self.out.flush()

    def close(self) -> None:
        if self.out is not None:
            self.out.close()


@dataclass
class _Bench:
    """One bench run: every method on every prompt (tokenized, with its
    constraint), pass after pass, each row handed to the sink."""
    model: object
    runner: _Methods
    methods: list[str]
    prompts: Sequence[BenchPrompt]
    prompt_tokens: list
    constraints: list
    warm_tokens: list
    max_tokens: int
    repeat: int
    sink: _Sink
    say: Callable[[str], None]

    def run_pass(self, rep: int) -> None:
        """Pass `rep` (0-based): a fresh session after the first, the warm-up,
        every prompt, then each drafter's acceptance calibration."""
        tag = f"[pass {rep + 1}/{self.repeat}] " if self.repeat > 1 else ""
        if rep:
            self.model.new_session()
        self.runner.new_pass()
        self.say(f"{tag}warming up: {', '.join(self.methods)}")
        _warm_up(self.model, self.runner, self.methods, self.warm_tokens, constrained=any(self.constraints))
        self.runner.start_prompts()
        for i in range(1, len(self.prompts) + 1):
            self.run_prompt(i, rep, tag)
        # the acceptance model of each drafter after the pass: predicted
        # against observed acceptance per source (how well the cost gate's
        # inputs held)
        for m in self.methods:
            if not is_peer(m) and m != "none":
                self.sink.emit({"kind": "calibration", "method": m, "repeat": rep,
                                "rows": self.runner.engine(m).acceptance.report()})

    def run_prompt(self, i: int, rep: int, tag: str) -> None:
        """Prompt i (1-based) through every method, its rows written, its speeds said."""
        p, tokens, c = self.prompts[i - 1], self.prompt_tokens[i - 1], self.constraints[i - 1]
        methods = self.methods
        rows = {}
        # rotate the order from prompt to prompt (and pass to pass):
        # whatever running first or second after another method costs
        # falls on every method alike
        k = (i - 1 + rep) % len(methods)
        for m in list(methods[k:]) + list(methods[:k]):
            rows[m] = dict(self.runner.run(m, p.turn, tokens, self.max_tokens, c), n_prompt_tokens=len(tokens))
        for m in methods:
            self.sink.emit(_result_row(self.model, p, i, rep, m, rows[m], rows.get("none"), tokens, c))
        self.sink.flush()
        speeds = "  ".join(f"{m} {rows[m]['tokens_per_s']:.1f} tok/s" for m in methods)
        n = len(self.prompts)
        self.say(f"{tag}[{i:>{len(str(n))}}/{n}] {p.category:<14} {speeds}")


def _tokenize_prompts(model, prompts: Sequence[BenchPrompt], raw: bool) -> tuple[list, list]:
    """(the warm-up prompt's tokens, each prompt's tokens); BenchError for a
    prompt that does not fit the model's context."""
    be = model.backend
    warm_tokens = model.prompt_tokens(WARMUP_PROMPT, raw=raw)
    prompt_tokens = [model.prompt_tokens(p.turn, raw=raw) for p in prompts]
    for p, tokens in zip(prompts, prompt_tokens):
        if len(tokens) >= be.n_ctx:
            raise BenchError(f"prompt {p.question_id} ({p.category}) has {len(tokens)} tokens, "
                             f"more than the context of {be.n_ctx}; raise --ctx")
    return warm_tokens, prompt_tokens


def run_bench(model, prompts: Sequence[BenchPrompt], methods: Sequence[str], *, max_tokens: int = 128,
              out_path: str | None = None, prompts_file: str | None = None,
              progress: Callable[[str], None] | None = None,
              llama_threads: int | None = None, repeat: int = 1, raw: bool = False,
              peer_rpc: Sequence[str] = (), memory_file: str | None = None) -> tuple[dict, list[dict]]:
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
    "divergence" record (see divergence()).  A prompt with a json_schema or
    grammar runs constrained in every method (see Constraint), its rows
    recording whether the answer follows it ("valid"); the header's
    "constrained" counts such prompts.  peer_rpc: the RPC workers the
    llama-server methods use when the model runs over RPC (workers like the
    model's, on the same machines: one worker serves one client).
    The model's own memory store (SpecModel.memory) is switched off for the
    run (and back on after it): only the NAME+memory methods draft from a
    memory, each from its own, which starts empty or as memory_file holds
    it (read, never written) after the warm-up of every pass."""
    if max_tokens < 1:
        raise BenchError("max_tokens must be >= 1")
    if repeat < 1:
        raise BenchError("repeat must be >= 1")
    methods = parse_methods(methods)
    # every prompt is tokenized and checked, and the peers found, before the
    # results file is opened: a prompt that does not fit (or a base model
    # without --raw, or a llama-server not built) fails the run before
    # anything is written
    warm_tokens, prompt_tokens = _tokenize_prompts(model, prompts, raw)
    constraints = [prompt_constraint(model.vocab, p) for p in prompts]
    runner = _Methods(model, methods, llama_threads, raw, peer_rpc, memory_file)
    head = header(model, methods, max_tokens, prompts_file, len(prompts), llama_threads, raw=raw)
    head["peer_rpc"] = list(peer_rpc)
    head.update(repeat=repeat, default=runner.default, llama_server=runner.server_settings(methods),
                constrained=constraint_summary(prompts))
    head["memory_file"] = memory_file
    sink = None
    own_memory = getattr(model, "memory", None)
    if own_memory is not None:
        model.use_memory(False)
    try:
        sink = _Sink(out_path, head)
        bench = _Bench(model, runner, methods, prompts, prompt_tokens, constraints, warm_tokens, max_tokens, repeat,
                       sink, progress or (lambda s: None))
        for rep in range(repeat):
            bench.run_pass(rep)
        return head, sink.results
    finally:
        if sink is not None:
            sink.close()
        runner.close()
        if own_memory is not None:
            model.use_memory(own_memory)


def stderr_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
