"""RunConfig: every setting of a run and its default, held once.

The CLI's options (app/cli/options.py), `load_model`, `SpecModel`, the
llama-cpp-python drop-in and the bench's method `default` take their
defaults from here, so a default changes in one place.  Names follow
llama.cpp's where it has the concept (n_ctx, n_gpu_layers, n_threads); the
engine's own defaults (the largest batch, the gate) stay in
core/config.py's EngineConfig and are read from it.
"""
from __future__ import annotations

from dataclasses import dataclass

from edgespec.calibration.kernelchoice import setting as kernels_setting   # $EDGESPEC_KERNELS, else auto
from edgespec.core.config import EngineConfig


@dataclass(frozen=True)
class RunConfig:
    """drafter: a drafter spec (drafters.parse_drafter_name, app/specs.py).
    n_ctx, n_gpu_layers, n_threads (None: one per physical core), cache_type_k
    ("auto": q8_0 on CPU with 2+ threads, else f16), kernels ("auto": timed
    per machine; $EDGESPEC_KERNELS overrides the default): the backend.
    max_nodes, cost_gate, verify: the engine (EngineConfig).  memory: True (in
    this process), a file, or False (docs/memory.md)."""
    drafter: str = "suffix"
    n_ctx: int = 4096
    n_gpu_layers: int = 0
    n_threads: int | None = None
    cache_type_k: str = "auto"
    kernels: str = "auto"
    max_nodes: int = EngineConfig.max_nodes
    cost_gate: bool = EngineConfig.cost_gate
    verify: str = "exact"
    memory: bool | str = True

    @classmethod
    def defaults(cls) -> "RunConfig":
        """The defaults as this process sees them (kernels from $EDGESPEC_KERNELS when set)."""
        return cls(kernels=kernels_setting(None))


DEFAULTS = RunConfig()
