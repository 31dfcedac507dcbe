"""BackendSettings: what a LlamaBackend is loaded with, held in one value,
and its Loadout: how the model loads on this hardware, resolved.

SpecModel makes one from its run settings (edgespec.run.settings,
RunConfig.backend_settings, with the Loadout edgespec.run.kernels resolved);
tests and tools that load a backend directly name the fields they change as
LlamaBackend's keywords (a Loadout's fields among them).  The defaults here
are the backend's own (a bare LlamaBackend); RunConfig reads n_ctx's from
here.  The backend takes a Loadout as it is: it derives no kernel, K cache
or exactness of its own.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from edgespec.backend.process import auto_cache_type_k


def is_offloaded(n_gpu_layers: int, rpc) -> bool:
    """Layers on a GPU or on RPC workers (`rpc`: the workers, or whether there
    are any): the one rule, which run/kernels.py and Loadout.resolve follow."""
    return bool(n_gpu_layers or rpc)


@dataclass(frozen=True)
class Loadout:
    """How a model loads on this hardware, every choice made (Loadout.resolve).

    kernels: "exact" or "fast", as resolved from the setting.
    cache_type_k: "f16" or "q8_0".
    flash_attn: None (llama.cpp's auto: on) or False (fast kernels on a CPU).
    tiled_mm: the GGML_CPU_TILED_MM value asked for ("0" off, "1" on; the
        first model a process loads sets it, backend/process.py).
    cpu_repack: llama.cpp's CPU weight repacking (backend/llama.py load_model).
    exact: batches are meant to be bit-identical to one-token decoding here:
        the backend's one-thread policy for an f16 K cache and the cap of
        EXACT_MAX_BATCH apply, and the self-check verifies it.
    offloaded: layers on a GPU or on RPC workers.
    setting, price, source: why: what was asked ("auto", "exact", "fast"),
        the kernel price behind an auto verdict (calibration.kernelchoice's
        KernelPrice, or None), and "asked", "offloaded", "measured" or
        "untimed" (edgespec.run.kernels says which is which).
    The defaults are a bare backend's: exact kernels on a CPU, a q8_0 K cache.
    """
    kernels: str = "exact"
    cache_type_k: str = "q8_0"
    flash_attn: bool | None = None
    tiled_mm: str = "0"
    cpu_repack: bool = False
    exact: bool = True
    offloaded: bool = False
    setting: str = "exact"
    price: Any = None
    source: str = "asked"

    @classmethod
    def resolve(cls, kernels: str, n_threads: int, n_gpu_layers: int = 0, rpc: bool = False,
                cache_type_k: str | None = None, **why) -> "Loadout":
        """The Loadout of `kernels` ("exact" or "fast", already chosen) with
        n_threads threads, n_gpu_layers on a GPU (or, with `rpc`, on the RPC
        workers: 0 = all), `cache_type_k` (None or "auto": by the rule
        below); `why`: setting, price, source, cpu_repack.  The one place each
        of these is decided:

        * fast options (flash attention off, the tiled product on) only with
          no layer count given: with n_gpu_layers set the offloaded layers run
          llama.cpp's defaults, so "fast" changes nothing there (over RPC with
          0 layers the workers' CPUs take every layer, and "fast" is theirs).
        * exact: the exact options, and no layers on a local GPU (a GPU's
          kernels are not the CPU's; over RPC the workers' CPUs run the
          layers with the options asked for, and the self-check says whether
          it holds there).  This is the backend's old rule: where the old run
          rule differed (fast asked, layers counted, RPC) the exact options
          load, so exact it is.
        * fast_cpu, for the K cache (q8_0 makes a fast prompt's K x Q product
          run the 8-bit kernel): the fast options and nothing offloaded.  The
          run's rule (fast and not offloaded) and the backend's (flash
          attention off, no layers, no RPC) said the same for every run.
        """
        fast = kernels == "fast" and not n_gpu_layers
        exact = not fast and (not n_gpu_layers or rpc)
        offloaded = is_offloaded(n_gpu_layers, rpc)
        k = cache_type_k
        if k in (None, "auto"):
            k = auto_cache_type_k(exact, n_threads, fast_cpu=fast and not offloaded)
        return cls(kernels=kernels, cache_type_k=k, flash_attn=False if fast else None,
                   tiled_mm="1" if fast else "0", exact=exact, offloaded=offloaded, **why)


@dataclass(frozen=True)
class BackendSettings:
    """n_ctx, n_gpu_layers, n_threads (None: one per physical core), n_batch:
        llama.cpp's context settings (n_batch is raised to max_nodes).
    max_nodes: the most tokens one verification batch may hold (root + drafts).
    max_leaves: the most root-to-leaf paths one tree may have (KV sequences);
        None: as many as a tree of max_nodes can have (max_nodes - 1), within
        llama.cpp's limit.
    load: the Loadout (kernels, K cache, exactness), taken as it is.
    verbose: llama.cpp's own log on stderr.
    rpc, tensor_split, rpc_output: llama.cpp RPC workers (HOST:PORT list),
        the proportions of the offloaded layers per device, and where the
        output layer runs over RPC ("local" or "remote").
    n_slots: requests held at once in one context (backend/slots.py): each
        slot n_ctx cells and max_leaves KV sequences of its own; 1: a lone
        backend, as before slots existed.
    """
    n_ctx: int = 4096
    n_gpu_layers: int = 0
    n_threads: int | None = None
    n_batch: int = 512
    max_nodes: int = 64
    max_leaves: int | None = 32
    load: Loadout = Loadout()
    verbose: bool = False
    rpc: Any = None
    tensor_split: Any = None
    rpc_output: str = "local"
    n_slots: int = 1

    def but(self, **changes) -> "BackendSettings":
        """A copy with `changes`, a Loadout's fields among them (TypeError
        names a keyword that is no setting)."""
        loads = {k: changes.pop(k) for k in [k for k in changes if k in _LOADOUT_FIELDS]}
        if loads:
            changes["load"] = dataclasses.replace(changes.get("load", self.load), **loads)
        return dataclasses.replace(self, **changes) if changes else self


_LOADOUT_FIELDS = frozenset(f.name for f in dataclasses.fields(Loadout))
