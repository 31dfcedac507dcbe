"""The drop-in's state and cache objects, in llama-cpp-python's shapes.

    from edgespec import Llama, LlamaDiskCache       # instead of: from llama_cpp import ...
    llm = Llama(model_path="model.gguf")
    llm.set_cache(LlamaDiskCache(capacity_bytes=2 << 30))   # prefixes kept on disk across restarts
    state = llm.save_state()                                # the KV cache as one value
    ...
    llm.load_state(state)                                   # the next call reuses its prefix

LlamaState has llama_cpp.LlamaState's fields and meaning: input_ids (the
tokens whose cells the state holds, numpy intc), n_tokens (their number),
llama_state (the cells as bytes) and llama_state_size (its length), seed (the
sampling seed then), scores (the logits kept per position: edgespec keeps
none, an array of shape (0, n_vocab): a call after load_state decodes the
prompt's last token again, as every edgespec request does).  Unlike
llama-cpp-python's, llama_state holds only the KV cells of the one sequence
(edgespec.core.prompt_disk's file format: this model's key, the tokens, the
cells and CRC-32s), so a state loaded into another model, another K cache
type or another llama.cpp build is refused with ConfigError instead of
being read as garbage.

LlamaRAMCache / LlamaCache and LlamaDiskCache take llama-cpp-python's
arguments and stand for edgespec's two prompt cache tiers (host memory:
edgespec.core.prefix_cache; files: edgespec.core.prompt_disk) when given to
Llama.set_cache; cache_size is the bytes the tier holds once it is in use.
LlamaDiskCache(cache_dir=None) keeps the files in edgespec's own folder
(<cache dir>/prompts), which `edgespec cache stats|clear` looks into.
"""
from __future__ import annotations

import numpy as np

DEFAULT_CAPACITY = 2 << 30          # llama-cpp-python's default capacity_bytes


class LlamaState:
    """A saved KV cache (Llama.save_state / load_state; the module doc)."""

    def __init__(self, input_ids, scores, n_tokens: int, llama_state: bytes, llama_state_size: int, seed: int):
        self.input_ids = input_ids
        self.scores = scores
        self.n_tokens = n_tokens
        self.llama_state = llama_state
        self.llama_state_size = llama_state_size
        self.seed = seed


class _Tier:
    """A prompt cache tier given to Llama.set_cache; `stats` is bound to the model's cache then."""

    def __init__(self, capacity_bytes: int):
        if not capacity_bytes > 0:
            raise ValueError(f"capacity_bytes must be > 0, not {capacity_bytes!r} (set_cache(None) turns it off)")
        self.capacity_bytes = int(capacity_bytes)
        self.stats = dict

    @property
    def capacity_mib(self) -> float:
        return self.capacity_bytes / 2**20


class LlamaRAMCache(_Tier):
    """Prompt prefixes kept in host memory (edgespec.core.prefix_cache), up to capacity_bytes."""

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY):
        super().__init__(capacity_bytes)

    @property
    def cache_size(self) -> int:
        return int(self.stats().get("bytes", 0))


LlamaCache = LlamaRAMCache


class LlamaDiskCache(_Tier):
    """Prompt prefixes kept in files in cache_dir (None: edgespec's
    <cache dir>/prompts), up to capacity_bytes for the folder, least recently
    used deleted first (edgespec.core.prompt_disk)."""

    def __init__(self, cache_dir: str | None = None, capacity_bytes: int = DEFAULT_CAPACITY):
        super().__init__(capacity_bytes)
        self.cache_dir = cache_dir

    @property
    def cache_size(self) -> int:
        return int(self.stats().get("disk_bytes", 0))


def make_state(tokens: np.ndarray, blob: bytes, n_vocab: int, seed: int) -> LlamaState:
    """A LlamaState of SpecModel.save_prefix()'s value."""
    return LlamaState(input_ids=np.asarray(tokens, np.intc), scores=np.zeros((0, n_vocab), np.single),
                      n_tokens=len(tokens), llama_state=blob, llama_state_size=len(blob), seed=seed)
