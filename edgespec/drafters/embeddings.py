"""The model's own token embeddings, read from its GGUF file on demand.

The semantic fallback (drafters/semantic.py) compares tokens by the cosine of
their input embeddings.  The matrix is memory-mapped straight from the file
(edgespec.models.gguf finds its offset in the header) and rows are dequantized by
the `gguf` package (the llama.cpp project's Python GGUF library, which knows
every ggml tensor type); only the rows of tokens that actually occur are
dequantized (and kept by the semantic drafter), so a 49k x 576 table costs a
few hundred rows, not 113 MB.

Raw embeddings of most models share a large common direction (for SmolLM2-135M
two random tokens have cosine 0.46 on median), so rows are centred on the mean
row of an evenly spaced sample of the vocabulary before they are normalised
(median cosine of random pairs then ~0, while " quickly" / " rapidly" is 0.82).
Neither the top principal directions nor a random projection to 128
dimensions kept those neighbours (tried), so rows keep their full width.
"""
from __future__ import annotations

import numpy as np

from edgespec.errors import EmbeddingsError  # re-exported

TENSOR = "token_embd.weight"
SAMPLE_ROWS = 4096


class TokenEmbeddings:
    """Centred, unit-length token embeddings of a GGUF model, row by row.

    ``TokenEmbeddings(path)``; ``rows(tokens)`` -> float32 [len(tokens), dim].
    ``TokenEmbeddings.from_matrix(E)`` wraps an in-memory matrix (tests).
    """

    def __init__(self, path: str | None = None, *, matrix: np.ndarray | None = None):
        if matrix is not None:
            self._raw = np.asarray(matrix, np.float32)
            self._qtype = None
        else:
            try:
                from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
                from gguf.quants import dequantize
            except ImportError as e:  # pragma: no cover - a declared dependency
                raise EmbeddingsError("the semantic fallback needs the 'gguf' package (pip install gguf)") from e
            from edgespec.models.gguf import gguf_tensor
            dims, ggml_type, offset = gguf_tensor(path, TENSOR)
            try:
                qtype = GGMLQuantizationType(ggml_type)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError) as e:
                raise EmbeddingsError(f"{path}: {TENSOR} has a tensor type this gguf package "
                                      f"does not know ({ggml_type})") from e
            dim, n_vocab = int(dims[0]), int(dims[1])
            row_bytes = dim // block * type_size
            self._raw = np.memmap(path, np.uint8, mode="r", offset=offset, shape=(n_vocab, row_bytes))
            self._qtype = qtype
            self._dequantize = dequantize
        self.n_vocab = int(self._raw.shape[0])
        step = max(1, self.n_vocab // SAMPLE_ROWS)
        sample = self._dense(np.arange(0, self.n_vocab, step))
        self.mean = sample.mean(axis=0)
        self.dim = int(sample.shape[1])

    @classmethod
    def from_matrix(cls, matrix: np.ndarray) -> "TokenEmbeddings":
        return cls(matrix=matrix)

    def _dense(self, idx: np.ndarray) -> np.ndarray:
        rows = self._raw[idx]
        if self._qtype is not None:
            rows = self._dequantize(np.asarray(rows), self._qtype)
        return np.asarray(rows, np.float32).reshape(len(idx), -1)

    def rows(self, tokens, centred: bool = True) -> np.ndarray:
        """Centred unit vectors of these tokens (out-of-range ids give zeros);
        centred=False: the raw rows made unit (AdaPLD's published cosine).
        Nothing is cached here: the semantic drafter keeps the rows it asked for."""
        tokens = np.asarray(tokens, np.int64).ravel()
        out = np.zeros((len(tokens), self.dim), np.float32)
        ok = (tokens >= 0) & (tokens < self.n_vocab)
        if ok.any():
            x = self._dense(tokens[ok]) - (self.mean if centred else 0.0)
            out[ok] = x / (np.linalg.norm(x, axis=1, keepdims=True) + 1e-9)
        return out


class SeenTokens:
    """The unit embedding rows of the distinct tokens seen so far, in one
    growing matrix: ``vecs[:n]`` / ``ids[:n]``, and ``slot[token]`` its row
    (-1: unseen).  A token's row never changes, so rows are read once per
    token (the semantic drafters' cache); ``centred`` as TokenEmbeddings.rows."""

    def __init__(self, embeddings, centred: bool = True):
        self.emb = embeddings
        self.centred = centred
        self.slot = np.full(int(embeddings.n_vocab), -1, np.int64)
        self.ids = np.zeros(256, np.int64)
        self.vecs = np.zeros((256, embeddings.dim), np.float32)
        self.n = 0

    def add(self, tokens: np.ndarray) -> None:
        """Read the rows of the tokens among these not seen before."""
        new = np.unique(tokens[(tokens >= 0) & (tokens < len(self.slot))])
        new = new[self.slot[new] < 0]
        if len(new) == 0:
            return
        u, k = self.n, len(new)
        if u + k > len(self.ids):
            cap = max(2 * len(self.ids), u + k)
            ids = np.zeros(cap, np.int64)
            vecs = np.zeros((cap, self.vecs.shape[1]), np.float32)
            ids[:u], vecs[:u] = self.ids[:u], self.vecs[:u]
            self.ids, self.vecs = ids, vecs
        self.ids[u:u + k] = new
        self.vecs[u:u + k] = self.emb.rows(new, centred=self.centred)
        self.slot[new] = np.arange(u, u + k)
        self.n = u + k
