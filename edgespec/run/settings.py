"""RunConfig: every setting of a run and its default, held once.

`SpecModel(model, config=RunConfig(...))` takes one (keyword arguments named
as its fields override it); the CLI's options build one (app/cli/options.py
`run_config_options`), and the llama-cpp-python drop-in and the bench's method
`default` read their defaults from it, so a default changes in one place.
Names follow llama.cpp's where it has the concept (n_ctx, n_gpu_layers,
n_threads); the engine's own defaults (the largest batch, the gate) stay in
core/config.py's EngineConfig and the backend's (the context size) in
backend/settings.py's BackendSettings, and are read from them.  A RunConfig
is passed whole: `engine_config()` and `backend_settings()` are the one place
each that makes the engine's and the backend's settings of it (the engine's
ranges are checked, once, when a RunConfig is made), and `resolve_kernels()`
(edgespec.run.kernels) the one place that resolves the kernels and the K cache.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from edgespec.backend.ggml import RPC_OUTPUTS, parse_endpoints
from edgespec.backend.llama import EXACT_MAX_BATCH
from edgespec.backend.settings import BackendSettings
from edgespec.core.config import EngineConfig
from edgespec.core.verify import VerifyConfig
from edgespec.errors import ConfigError
from edgespec.run.kernels import Loadout, loadout, times_kernels


DISK_MIB = 2048.0        # prompt_cache_disk_mib's default (RunConfig's doc says why)
DISK_MIB_ENV = "EDGESPEC_PROMPT_CACHE_DISK_MIB"


def disk_mib_setting() -> float:
    """prompt_cache_disk_mib as this process's environment sets it (DISK_MIB_ENV), else DISK_MIB."""
    raw = os.environ.get(DISK_MIB_ENV)
    if raw is None or not raw.strip():
        return DISK_MIB
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{DISK_MIB_ENV} must be a number of MiB (0 = off), not {raw!r}") from None


@dataclass(frozen=True)
class RunConfig:
    """drafter: a drafter spec ("none" = plain decoding through the same
        engine, "suffix", "trigram", "adjacency", "auto", with switches and an
        engine mode: docs/cli.md; "-nocorpus" ignores the loaded corpora) or a
        Drafter instance.
    corpora: paths of compiled corpora (`edgespec build-corpus`) for the
        drafters that use one; each is checked against the model's tokenizer.
    verify: "exact" (default, lossless) or a LOSSY opt-in, "relaxed" (ReSpec),
        "entropy" (AASD) or "entropy_inv", or a VerifyConfig (edgespec.core.verify).
    n_ctx, n_gpu_layers, n_threads: llama.cpp's settings (n_threads None = one
        per physical core).
    cache_type_k: the K cache's type, "f16" (llama.cpp's default) or "q8_0";
        "auto" (or None) = q8_0 on CPU with more than one thread or with fast
        kernels, else f16.  On CPU an f16 K cache makes exact one-token decodes
        past 256 KV cells run on one thread, to stay exact (see
        backend/llama.py); q8_0 lets them use every thread, and with fast
        kernels it reads prompts faster (docs/exactness.md).
    kernels: "auto": "exact" where an app's mix of prompt reading, one-token
        decodes and verification batches, timed at an app's shape, costs no
        more with it than with "fast" on this machine, else "fast", as
        measured once per model and thread count in two child processes
        (several seconds for a small model; edgespec.calibration.kernelchoice;
        cached); until measured
        (calibrate=True, `edgespec generate`, `bench` or `calibrate` measure
        it) "fast", the better bet on every machine measured.  "exact":
        llama.cpp settings under which a verification batch gives logits
        bit-identical to one-token decoding on CPU (flash attention on, the
        tiled K-quant product off).  "fast": llama.cpp's fastest CPU settings
        (flash attention off, q8_0 K cache unless cache_type_k says otherwise,
        the tiled product on): cheaper prefill, decodes and batches
        (BENCHMARKS.md, "What does exactness cost?"), but batched logits
        differ in the last bits, so greedy output can differ from `none` at
        near-ties; the self-check (SpecModel.exact) reports it.  The tiled
        product is a process-wide switch that the first model a process
        loads sets (unless GGML_CPU_TILED_MM is in the environment).  On a
        GPU both are llama.cpp's defaults.  None: $EDGESPEC_KERNELS, else
        "auto" (RunConfig.defaults() leaves it None; edgespec.run.kernels
        reads the variable when it resolves the kernels).
    max_nodes: the largest verification batch (root + drafts).
    cost_gate: verify only drafts whose expected gain beats their measured cost.
    calibrate: how c(T) and the exactness self-check are had (both cached on
        disk per model file, settings and machine).  "background" (default):
        the cached ones; on a fresh cache, start at once with a conservative
        built-in c(T) and measure both in a background thread between requests
        (a request waits at most for one decode), then switch to them.  True:
        measure now if not cached (a minute or more on 2 cores).  False: no
        measurement: c(T) = T, a CPU-like worst case.
    rpc: llama.cpp RPC workers ("HOST:PORT", a list or one comma-separated
        string; `edgespec rpc-worker` or llama.cpp's rpc-server): the model's
        layers go to them (n_gpu_layers 0 = all; N keeps the rest here).
        Needs a llama-cpp-python built with CMAKE_ARGS="-DGGML_RPC=on".
    tensor_split: proportions of the offloaded layers per device (workers in
        order, then local GPUs); None: by their free memory.
    rpc_output: over RPC, where the output layer runs: "local" (this machine
        computes the logits; only hidden states cross the link) or "remote"
        (the last worker; every verified token's logits cross the link).
    memory: the memory of earlier requests (docs/memory.md): True: in this
        process; a path: kept in that file too; False: off; a MemoryStore:
        that store (shared between models of one tokenizer).
    prompt_cache_mib: host memory (MiB) for the KV cells of earlier prompts'
        prefixes, beside the live cache: a request starts from the longest
        prefix of its prompt held in either (edgespec.core.prefix_cache;
        docs/serving.md says what a token costs).  0 turns it off (the live
        cache's common prefix is still reused).
    prompt_cache_disk_mib: disk (MiB) for prompt prefixes' KV cells kept in
        files under the cache directory (<cache dir>/prompts: $EDGESPEC_CACHE_DIR,
        else $XDG_CACHE_HOME/edgespec, else ~/.cache/edgespec), found again by a later
        process: a restarted server, a resumed chat, an app's next launch
        (edgespec.core.prompt_disk; docs/serving.md).  The budget is shared by
        every model and process using the folder; the least recently used
        files go first.  2048 MiB holds about 220,000 cached tokens of
        Qwen2.5-Coder-0.5B (9.2 KiB of cells a token with the q8_0 K cache),
        120,000 of SmolLM2-135M (17.2 KiB) or 95,000 of Qwen2.5-Coder-1.5B
        (21.4 KiB): two dozen 4,000-token conversations of the 1.5B, or an
        Aider system prompt and its examples for a hundred sessions, while
        staying a small share of a laptop's disk.  0 turns it off; None:
        $EDGESPEC_PROMPT_CACHE_DISK_MIB, else 2048 (RunConfig.defaults() reads it).
    verbose: llama.cpp's own log on stderr.
    parallel: requests run at once (llama-server's -np): that many slots in
        one llama.cpp context of parallel * n_ctx cells, stepped in turn by one
        model thread (edgespec.app.scheduler; docs/scheduler.md); 1: one
        request at a time, the others queue.
    """
    drafter: Any = "suffix"
    corpora: tuple = ()
    verify: Any = "exact"
    n_ctx: int = BackendSettings.n_ctx
    n_gpu_layers: int = 0
    n_threads: int | None = None
    cache_type_k: str | None = "auto"
    kernels: str | None = "auto"
    max_nodes: int = EngineConfig.max_nodes
    cost_gate: bool = EngineConfig.cost_gate
    calibrate: bool | str = "background"
    rpc: Any = None
    tensor_split: Any = None
    rpc_output: str = "local"
    memory: Any = True
    prompt_cache_mib: float = 256
    prompt_cache_disk_mib: float | None = DISK_MIB
    verbose: bool = False
    parallel: int = 1

    def __post_init__(self):
        if isinstance(self.corpora, (str, bytes)):
            raise ConfigError("corpora: a list of corpus paths, not one string")
        object.__setattr__(self, "corpora", tuple(self.corpora))
        if self.calibrate not in (True, False, "background"):
            raise ConfigError(f"calibrate must be True, False or 'background', not {self.calibrate!r}")
        if self.prompt_cache_disk_mib is None:
            object.__setattr__(self, "prompt_cache_disk_mib", disk_mib_setting())
        for name in ("prompt_cache_mib", "prompt_cache_disk_mib"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, not {getattr(self, name)!r}")
        if not (isinstance(self.parallel, int) and self.parallel >= 1):
            raise ConfigError(f"parallel must be a whole number >= 1, not {self.parallel!r}")
        if self.rpc_output not in RPC_OUTPUTS:     # checked here without workers too (the backend: with them)
            raise ConfigError(f"rpc_output must be one of {', '.join(RPC_OUTPUTS)}, not {self.rpc_output!r}")
        self.engine_config()           # max_nodes' range and verify's mode: EngineConfig checks them

    def times_kernels(self) -> bool:
        """Whether the kernels are chosen by timing exact against fast ones
        here: kernels "auto" (as set or from $EDGESPEC_KERNELS) on a CPU
        (edgespec.run.kernels.times_kernels, the rule loadout follows)."""
        return times_kernels(self)

    def resolve_kernels(self, model_path: str, measure: bool | None = None, progress=None) -> Loadout:
        """The kernels and K cache this run loads `model_path` with, and why
        (edgespec.run.kernels.loadout): an "auto" choice not cached is timed
        if `measure` (None: when calibrate is True), else fast until timed."""
        return loadout(self, model_path, measure, progress)

    def backend_settings(self, load: Loadout) -> BackendSettings:
        """The backend's settings of this run with its resolved Loadout, taken
        as it is.  The backend's batch holds at least EXACT_MAX_BATCH tokens
        whatever max_nodes says."""
        return BackendSettings(n_ctx=self.n_ctx, n_gpu_layers=self.n_gpu_layers, n_threads=self.n_threads,
                               max_nodes=max(EXACT_MAX_BATCH, self.max_nodes), max_leaves=None, load=load,
                               verbose=self.verbose, rpc=parse_endpoints(self.rpc),
                               tensor_split=self.tensor_split, rpc_output=self.rpc_output, n_slots=self.parallel)

    def engine_config(self, batch_cap: int | None = None) -> EngineConfig:
        """The engine's settings of this run: max_nodes (at most `batch_cap`, the
        backend's largest batch), cost_gate and verify (a mode's name or a
        VerifyConfig); the rest at EngineConfig's defaults."""
        verify = VerifyConfig(self.verify) if isinstance(self.verify, str) else (self.verify or VerifyConfig())
        max_nodes = self.max_nodes if batch_cap is None else min(self.max_nodes, batch_cap)
        return EngineConfig(max_nodes=max_nodes, cost_gate=self.cost_gate, verify=verify)

    @classmethod
    def defaults(cls) -> "RunConfig":
        """The defaults as this process sees them (kernels None: $EDGESPEC_KERNELS
        when set, else auto, read when the kernels are resolved, by
        edgespec.run.kernels.setting; prompt_cache_disk_mib from
        $EDGESPEC_PROMPT_CACHE_DISK_MIB when set)."""
        return cls(kernels=None, prompt_cache_disk_mib=disk_mib_setting())

    def but(self, **changes) -> "RunConfig":
        """A copy with `changes`; TypeError names a keyword that is no setting."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"unknown setting {unknown[0]!r} (RunConfig's fields: "
                            f"{', '.join(f.name for f in dataclasses.fields(self))})")
        return dataclasses.replace(self, **changes) if changes else self


DEFAULTS = RunConfig()
