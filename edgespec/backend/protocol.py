"""What the engine and the calibration need of a backend, as one typing.Protocol.

`LlamaBackend` (backend/llama.py) is the real one; `ReplayBackend`
(replay/simulator.py) stands in for it with recorded output.  Both satisfy
`Backend` (mypy checks it: replay/conformance.py), so the engine
(core/engine.py) and the measurements (calibration/curve.py, exactness.py)
are written against this and nothing else.  The contract behind the methods
(KV sequence 0 holds the committed prefix, a tree batch goes after it,
`keep(k)` commits a chain of k slots) is stated in backend/llama.py's module
docstring.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from edgespec.backend.vocab import Vocab


SPLIT_KV_FREE_CELLS = 256   # a one-token decode up to this many cells avoids llama.cpp's split-KV kernel


@runtime_checkable
class Backend(Protocol):
    """A model that decodes a prompt and verification trees into a KV cache."""

    vocab: Vocab
    n_vocab: int
    n_ctx: int              # KV cells
    max_nodes: int          # the most tokens one decode_tree batch may hold
    n_past: int             # committed tokens (KV sequence 0)
    kv_tokens: np.ndarray   # their ids, int32 (kept by the engine)
    n_embd: int             # width of hidden()
    hidden_on: bool
    spliced_from: int | None    # the first cell a splice made inexact (backend/splice.py); None: all exact

    def splice_refusal(self) -> str | None:
        """Why this backend cannot splice (None: it can)."""

    def splice(self, n_prefix: int, cache_start: int, n_chunk: int, inserted: np.ndarray) -> None:
        """Inexact reuse (core/cache_reuse.py): keep n_prefix cells, move
        n_chunk cells from cache_start to just after `inserted`, decode it
        between them, drop the rest."""

    def reset(self) -> None:
        """Forget every committed token."""

    def truncate(self, n: int) -> None:
        """Forget committed tokens from position n on."""

    def borrow(self, prompt: np.ndarray, have: int, min_gain: int = 16) -> int:
        """Before a request reads prompt holding its first `have` tokens: take a longer prefix's cells
        from another request slot of the same context where one holds them; the prefix held now."""

    def rollback(self) -> None:
        """Drop every cell beyond the committed prefix (an interrupted step)."""

    def save_state(self) -> np.ndarray:
        """The committed prefix's KV cells as uint8 bytes, for restore_state
        (core/prefix_cache.py keeps several in host memory)."""

    def restore_state(self, state: np.ndarray, tokens: np.ndarray) -> None:
        """Replace the whole cache with a save_state() result; `tokens` are its
        tokens (they become kv_tokens and n_past their count)."""

    def prefill(self, tokens: np.ndarray, want_last_logits: bool = True,
                topk_out: tuple[np.ndarray, np.ndarray] | None = None, cancel=None,
                hidden_out: np.ndarray | None = None) -> None:
        """Decode tokens after the committed prefix and commit them."""

    def decode_tree(self, tokens: np.ndarray, depth: np.ndarray, leaf_first: np.ndarray,
                    leaf_count: np.ndarray, n_leaves: int) -> None:
        """Decode one verification batch after the committed prefix (logits at every slot)."""

    def logits(self) -> np.ndarray:
        """float32 [n_outputs, n_vocab] of the last decode."""

    def keep(self, k: int) -> None:
        """After decode_tree: commit the first k slots, drop the rest of the step."""

    def set_hidden(self, on: bool, layer: int | None = None) -> None:
        """Also output hidden states (read with hidden()): the last ones, or block `layer`'s output."""

    def hidden(self) -> np.ndarray:
        """float32 [n_outputs, n_embd] of the last decode; needs set_hidden(True)."""

    def clock(self) -> float:
        """Seconds, for timing steps: time.perf_counter for a real model, the
        modelled time for a replay (the engine learns step costs from it)."""
