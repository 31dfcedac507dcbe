"""BackendSettings: what a LlamaBackend is loaded with, held in one value.

SpecModel makes one from its run settings (edgespec.run.settings,
RunConfig.backend_settings); tests and tools that load a backend directly
name the fields they change as LlamaBackend's keywords.  The defaults here
are the backend's own (a bare LlamaBackend); RunConfig reads n_ctx's from
here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BackendSettings:
    """n_ctx, n_gpu_layers, n_threads (None: one per physical core), n_batch:
        llama.cpp's context settings (n_batch is raised to max_nodes).
    max_nodes: the most tokens one verification batch may hold (root + drafts).
    max_leaves: the most root-to-leaf paths one tree may have (KV sequences);
        None: as many as a tree of max_nodes can have (max_nodes - 1), within
        llama.cpp's limit.
    exact, cache_type_k, cpu_repack, flash_attn, tiled_mm: the kernels
        (backend/process.py kernel_options makes exact/flash_attn/tiled_mm for
        --kernels exact or fast; cache_type_k None or "auto": by exactness and
        threads).
    verbose: llama.cpp's own log on stderr.
    rpc, tensor_split, rpc_output: llama.cpp RPC workers (HOST:PORT list),
        the proportions of the offloaded layers per device, and where the
        output layer runs over RPC ("local" or "remote").
    """
    n_ctx: int = 4096
    n_gpu_layers: int = 0
    n_threads: int | None = None
    n_batch: int = 512
    max_nodes: int = 64
    max_leaves: int | None = 32
    exact: bool = True
    cache_type_k: str | None = None
    cpu_repack: bool = False
    flash_attn: bool | None = None
    tiled_mm: str = "0"
    verbose: bool = False
    rpc: Any = None
    tensor_split: Any = None
    rpc_output: str = "local"

    def but(self, **changes) -> "BackendSettings":
        """A copy with `changes` (TypeError names a keyword that is no setting)."""
        return dataclasses.replace(self, **changes) if changes else self
