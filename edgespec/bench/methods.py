"""Bench methods: their names, parsing a --methods list, and what method
`default` resolves to.

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
                           build-peers` (see edgespec.bench.peer_server, docs/peers.md)
  default                  what `edgespec generate MODEL PROMPT` runs with no
                           options (its drafter; the bench's model must be loaded
                           with generate's default settings; the header says
                           what it resolved to), without a memory of earlier requests
  NAME+memory              (suffix+memory, auto+memory, default+memory) the method
                           with a memory store of its own (edgespec.memory) that
                           starts empty (or as bench --memory FILE holds it) at
                           the first prompt and keeps every answer of the run,
                           prompts in file order; every other edgespec method
                           runs without one
A peer method ending in @tN (llama-server@t1, llama-cpp-python-pld@t2) runs
with N threads for single tokens and batches instead of its own default.
The llama-cpp-python methods run in a child process (see edgespec.bench.llama_peer).
"""
from __future__ import annotations

from typing import Sequence

from edgespec.bench.peer_server import SERVER_METHODS as _SERVER_ARGS
from edgespec.errors import BenchError

LLAMA_METHODS = ("llama-cpp-python", "llama-cpp-python-expert", "llama-cpp-python-pld", "llama-cpp-python-pld-cpu")
SERVER_METHODS = tuple(_SERVER_ARGS)
PEER_METHODS = LLAMA_METHODS + SERVER_METHODS
DEFAULT_METHODS = ("none", "suffix") + LLAMA_METHODS[:3]
DEFAULT_MEMORY = "default+memory"


def with_memory(method: str) -> bool:
    """Whether an edgespec method runs with a memory store of its own
    (NAME+memory: its drafter's `memory` switch set by name)."""
    if method == DEFAULT_MEMORY:
        return True
    if method == "default" or is_peer(method):
        return False
    from edgespec.run.specs import split_verify
    from edgespec.drafters import parse_drafter_name
    return parse_drafter_name(split_verify(method)[0])[2].get("memory") is True


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
    from edgespec.run.specs import check_drafter_name

    items = spec.split(",") if isinstance(spec, str) else list(spec)
    methods: list[str] = []
    for m in (x.strip() for x in items):
        if not m or m in methods:
            continue
        if split_peer(m) is None and m not in ("default", DEFAULT_MEMORY):
            try:
                check_drafter_name(m)
            except ValueError as e:
                raise BenchError(f"unknown method {m!r}: {e}; or default, or one of {', '.join(PEER_METHODS)} "
                                 f"(with @tN for N threads)") from None
        methods.append(m)
    if not methods:
        raise BenchError("no methods given")
    return methods


def resolve_default(model) -> dict:
    """What method `default` runs: `edgespec generate`'s defaults (drafter,
    kernels, K cache, largest batch, cost gate, verification) with the bench
    model's own placement (threads, context, GPU layers, RPC workers), as
    generate would resolve them on this machine with that placement: `bench
    -ngl -1 --methods default` is the defaults on this GPU.  The bench's model
    must run the same settings otherwise (it is loaded once for every
    method); BenchError naming the differences.  "drafter" is the spec to
    run: without the corpora the bench loaded (generate loads none by
    default)."""
    from edgespec.run.settings import RunConfig

    d = RunConfig.defaults()
    be = model.backend
    threads = be.n_threads
    # what generate would load here with this placement (auto: the cached verdict, else fast)
    load = d.but(n_threads=threads, n_gpu_layers=be.n_gpu_layers,
                 rpc=getattr(be, "rpc", None) or None).resolve_kernels(model.model_path, measure=False)
    want = {"kernels": load.kernels, "cache_type_k": load.cache_type_k,
            "max_nodes": d.max_nodes, "cost_gate": d.cost_gate, "verify": d.verify}
    have = {"kernels": getattr(model, "kernels", "exact"), "cache_type_k": be.cache_type_k,
            "max_nodes": model.config.max_nodes, "cost_gate": model.config.cost_gate,
            "verify": model.config.verify.mode}
    diff = [f"{k} {have[k]} (generate's default: {want[k]})" for k in want if have[k] != want[k]]
    if diff:
        raise BenchError(f"method default runs `edgespec generate`'s defaults, but this bench's model runs "
                         f"{', '.join(diff)}: bench default without those options")
    drafter = d.drafter + ("-nocorpus" if getattr(model, "corpora", None) and "-nocorpus" not in d.drafter
                           else "")
    placement = {"n_threads": threads, "n_ctx": be.n_ctx, "n_gpu_layers": be.n_gpu_layers}
    return dict(want, **placement, drafter=drafter, generate_drafter=d.drafter)


def fresh_drafter(model, spec: str, memory_store=None):
    """A new drafter object for `spec`, built as SpecModel builds a named one
    (drafting from `memory_store` when it uses one).  Method `default` runs
    its own (so its own engine, drafter memory and acceptance statistics): it
    never learns from the answers of a method that runs the same drafter in
    this bench; a NAME+memory method likewise."""
    from edgespec.run.specs import drafter_from_spec

    return drafter_from_spec(spec, n_vocab=model.vocab.n_vocab, model_path=model.model_path,
                             corpora=model.corpora, memory_store=memory_store)[0]


def server_binary(methods: Sequence[str]):
    """The llama-server the methods need (edgespec.bench.peers.find_llama_server),
    None when they need none; PeerError (one line, with the build command)
    when it is not built, does not run or was built from another llama.cpp."""
    if not any(split_peer(m) and split_peer(m)[0] in SERVER_METHODS for m in methods):
        return None
    from edgespec.bench.peers import find_llama_server
    return find_llama_server()
