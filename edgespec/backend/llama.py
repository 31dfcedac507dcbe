"""A loaded GGUF model and its llama.cpp context: the backend the engine verifies trees on.

It owns the model and context handles, one reusable batch whose arrays are
numpy buffers (so a whole tree is laid in with a few vectorised writes), and
the KV-cache bookkeeping of tree verification:

* The committed sequence lives in KV sequence 0.  `n_past` is its length.
* A draft tree is laid out in depth-first order (the engine chooses the order);
  every root-to-leaf path gets its own sequence id, the leftmost path seq 0 and
  the others 1..L-1, which first see the committed prefix through
  `seq_cp(0, s)` (that only tags existing cells, it copies no data).  A node
  belongs to the sequences of every leaf below it and sits at position
  `n_past + depth`.
* After verification `keep(k)` keeps the first k batch slots, which must be a
  chain from the root along seq 0 (the engine guarantees it), and drops every
  other cell of the step.  The kept cells are then the first cells the batch
  used, in position order, exactly where plain decoding would have put them:
  that is what keeps greedy output token-identical (see shared/DESIGN.md §2).
* Every llama_memory_seq_* call scans the whole cache, so the sequences are
  synced lazily: seqs 0.._synced-1 hold exactly seq 0's cells.  A batch gives
  the leftmost path (the first-child chain, the one `keep` commits) every
  already-synced seq beyond its own leaves, `keep(k)` removes the cells past
  the kept chain with one call and empties only the seqs that left the chain
  before slot k-1, and `seq_cp` runs only for seqs not in sync.  A step that
  accepts nothing costs one scan.

Return codes of llama.cpp become `BackendError`s with a clear message.  What
holds once per process is in backend/process.py, the tokenizer in backend/vocab.py.
"""
from __future__ import annotations

import contextlib
import ctypes
import time

import llama_cpp as L
import numpy as np

from edgespec.backend.protocol import SPLIT_KV_FREE_CELLS
from edgespec.errors import BackendError, ConfigError, Interrupted, ModelLoadError  # noqa: F401 (re-exported)
from edgespec.backend.layer_tap import LayerTap, attach_tap, tap_block
from edgespec.backend.model_file import free_model, load_model, model_metadata  # noqa: F401 (re-exported)
from edgespec.backend.process import CACHE_TYPES_K, default_threads, gpu_offload_available, recent_errors
from edgespec.backend.seqstate import SeqState
from edgespec.backend.splice import Splicer
from edgespec.backend.settings import BackendSettings
from edgespec.backend.slots import Cells, check_slots, seqs_needed
from edgespec.backend.vocab import Vocab

EXACT_MAX_BATCH = 48        # largest batch measured bit-identical to one-token decoding
# llama.cpp rounds every context size up to a multiple of 256 KV cells (its padding), so 256 is
# the smallest context there is (a smaller request is refused, not rounded up silently)
MIN_CTX = 256


def _check_request(n_ctx: int, n_gpu_layers: int, max_nodes: int, max_leaves: int | None, rpc) -> int:
    """Refuse settings llama.cpp cannot serve (ConfigError); return max_leaves, None resolved."""
    if max_leaves is None:
        max_leaves = max(1, min(max_nodes - 1, L.llama_max_parallel_sequences()))
    if max_leaves > L.llama_max_parallel_sequences():
        raise ConfigError(f"max_leaves must be <= {L.llama_max_parallel_sequences()}")
    if n_ctx < MIN_CTX:
        raise ConfigError(f"the context size (--ctx, n_ctx) must be at least {MIN_CTX} tokens, not {n_ctx}: "
                          f"llama.cpp's KV cache holds a multiple of {MIN_CTX} cells")
    if n_gpu_layers and not rpc and not gpu_offload_available():
        raise ConfigError(f"GPU offload (--n-gpu-layers, n_gpu_layers={n_gpu_layers}) was asked for, but this "
                          "llama-cpp-python was built without a GPU backend: reinstall it with "
                          "CMAKE_ARGS=\"-DGGML_CUDA=on\" (see the README's GPU section), or leave "
                          "--n-gpu-layers out to run on the CPU")
    return max_leaves


class LlamaBackend(SeqState, Splicer):
    """A loaded GGUF model with one context sized for tree verification
    (save_state / restore_state: backend/seqstate.py; splice: backend/splice.py), loaded with the
    settings of a BackendSettings (backend/settings.py documents them).
    """

    def __init__(self, model_path: str, settings: BackendSettings | None = None, *, load_progress=None,
                 **changes):
        """settings (BackendSettings; None: its defaults), with `changes` named as its fields."""
        self.settings = s = (settings or BackendSettings()).but(**changes)
        max_leaves = _check_request(s.n_ctx, s.n_gpu_layers, s.max_nodes, s.max_leaves, s.rpc)
        self.model_path = model_path
        self.n_gpu_layers = n_gpu_layers = s.n_gpu_layers
        self.n_threads = s.n_threads or default_threads()
        self.max_nodes = s.max_nodes
        self.max_leaves = max_leaves
        self.n_slots = s.n_slots
        check_slots(s.n_slots, max_leaves)
        self.n_batch = max(s.n_batch, s.max_nodes)
        self.rpc, self.tensor_split = list(s.rpc or []), list(s.tensor_split or [])
        self.rpc_output = s.rpc_output
        load = s.load           # taken as it is: the Loadout decided the kernels (backend/settings.py)
        self.exact = load.exact
        if load.cache_type_k not in CACHE_TYPES_K:
            raise ConfigError(f"cache_type_k must be one of {', '.join(CACHE_TYPES_K)} (or auto), "
                              f"not {load.cache_type_k!r}")
        self.cache_type_k = load.cache_type_k
        self.cpu_repack = bool(load.cpu_repack)
        self.model = load_model(model_path, n_gpu_layers, verbose=s.verbose, cpu_repack=self.cpu_repack,
                                tiled_mm=load.tiled_mm, rpc=self.rpc, tensor_split=self.tensor_split,
                                rpc_output=s.rpc_output, load_progress=load_progress)
        self.vocab = Vocab(self.model)
        self.n_vocab = self.vocab.n_vocab
        self._tap: LayerTap | None = None     # a middle layer's hidden states (set_hidden(True, layer))
        self._owner = True          # the slots' views (backend/slots.py) share this context; only it frees it
        self.seq0 = 0               # this slot's first KV sequence
        self._create_context(s.n_ctx, load.flash_attn)
        self._create_batch()
        self._init_state()
        self._cells: Cells | None = None
        if s.n_slots > 1:       # sets every slot's _cells; their Broker combines at most this many rows
            Cells(self, s.n_slots, EXACT_MAX_BATCH if self.exact else self.n_batch)

    def slot(self, k: int) -> "LlamaBackend":
        """Request slot k's view of this context (backend/slots.py): slot 0 is this backend."""
        return self if k == 0 else self._cells.views[k]   # type: ignore[union-attr]

    def _create_context(self, n_ctx: int, flash_attn: bool | None) -> None:
        """The llama.cpp context: KV cache, batch and output sizes, threads, kernels."""
        cp = L.llama_context_default_params()
        cp.n_ctx = int(n_ctx) * self.n_slots
        cp.n_batch = self.n_batch
        cp.n_ubatch = self.n_batch
        cp.n_seq_max = seqs_needed(self.n_slots, self.max_leaves)
        # outputs per ubatch: a tree needs max_nodes, a prefill that ranks every
        # prompt position (prefill(topk_out=...)) a whole chunk.  llama.cpp grows
        # its output buffer only when a batch asks for that many rows.
        cp.n_outputs_max = self.n_batch
        cp.n_outputs_max_per_seq = 0
        cp.n_threads = self.n_threads
        cp.n_threads_batch = self.n_threads
        cp.kv_unified = True
        cp.type_k = CACHE_TYPES_K[self.cache_type_k]
        # flash attention: llama.cpp's "auto" (None) turns it on here, and
        # exactness needs it: without it a batch's attention products (KQ, KQV)
        # run other kernels than a one-token decode's and the logits differ.
        # False is for measuring what it costs (tools/kernel_cost.py).
        if flash_attn is not None:
            cp.flash_attn_type = 1 if flash_attn else 0
        self.flash_attn = flash_attn
        cp.no_perf = True
        if self._tap is not None:
            cp.cb_eval, cp.cb_eval_user_data = self._tap.callback, self._tap.user_data
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            L.llama_model_free(self.model)
            self.model = None
            raise BackendError(f"llama.cpp could not create a context (n_ctx={n_ctx}): {recent_errors()}")
        self.n_cells = int(L.llama_n_ctx(self.ctx))
        self.n_ctx = self.n_cells // self.n_slots      # a request's room: each slot's
        # llama.cpp caps the batch at the context it was asked for (n_ctx may be
        # rounded up); feed it no more than that, or it aborts the process
        self.n_batch = int(L.llama_n_batch(self.ctx))
        if self.n_batch < self.max_nodes:
            self.max_nodes = self.n_batch
        self.mem = L.llama_get_memory(self.ctx)

    def _create_batch(self) -> None:
        """One batch, owned by numpy.  seq_id rows are one contiguous matrix."""
        nb, S = max(self.n_batch, self.max_nodes), max(1, self.max_leaves)
        self._tok = np.zeros(nb, np.int32)
        self._pos = np.zeros(nb, np.int32)
        self._nseq = np.ones(nb, np.int32)
        self._seq = np.zeros((nb, S), np.int32)
        self._logits = np.zeros(nb, np.int8)
        self._seq_rows = (ctypes.POINTER(L.llama_seq_id) * nb)(
            *[self._seq[i].ctypes.data_as(ctypes.POINTER(L.llama_seq_id)) for i in range(nb)])
        self._batch = L.llama_batch()       # llama_cpp types its pointer fields as ctypes arrays: hence the ignores
        self._batch.token = self._tok.ctypes.data_as(ctypes.POINTER(L.llama_token))  # type: ignore[assignment]
        self._batch.embd = ctypes.POINTER(ctypes.c_float)()  # type: ignore[assignment]
        self._batch.pos = self._pos.ctypes.data_as(ctypes.POINTER(L.llama_pos))  # type: ignore[assignment]
        self._batch.n_seq_id = self._nseq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))  # type: ignore[assignment]
        self._batch.seq_id = ctypes.cast(self._seq_rows, ctypes.POINTER(ctypes.POINTER(L.llama_seq_id)))  # type: ignore[assignment]
        self._batch.logits = self._logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))  # type: ignore[assignment]
        self._arange_s = np.arange(S, dtype=np.int32)

    def _init_state(self) -> None:
        """The KV bookkeeping of an empty cache, the thread policy, the output views."""
        self._init_seq_state()
        # Exactness on CPU (docs/exactness.md): with an f16 K cache a one-token
        # decode over 512+ cells on several threads takes ggml's split-KV
        # attention, which sums in another order than a batch (a q8_0 K cache
        # never does).  So with f16 and `exact`, one-token decodes use one thread
        # once more than 256 cells are in use (below that the KV view is 256
        # cells); batches always use every thread.  Batches of 64 or more tokens
        # take a tiled kernel that differs too, hence EXACT_MAX_BATCH.
        self.one_thread_after = SPLIT_KV_FREE_CELLS if (self.exact and self.cache_type_k == "f16") else None
        self._threads_box = [self.n_threads]    # threads of one-token decodes: the context's, shared by its slots
        self.n_embd = int(L.llama_model_n_embd(self.model))
        self.hidden_on = False
        self.hidden_layer: int | None = None    # set_hidden(True, layer)

    def _init_seq_state(self) -> None:
        """One slot's own state: its sequences' sync, its committed tokens, its last decode's output rows."""
        S = max(1, self.max_leaves)
        self._synced = 1                       # seqs 0.._synced-1 equal seq 0
        self._dirty = np.zeros(S, np.bool_)    # seq has cells but is not in sync
        self._step_lc = np.ones(1, np.int32)   # seqs through each slot of the last batch
        self._n_leaves = 1
        self.n_past = 0           # committed tokens in seq 0
        self.kv_tokens = np.zeros(0, np.int32)  # their ids (kept by the engine)
        self.spliced_from = None    # the first cell a splice made inexact (backend/splice.py)
        self.n_outputs = 0        # rows of logits from the last decode
        self._out_off = 0         # first of them in llama.cpp's output buffer
        self._logits_addr: int | None = None
        self._logits_view: np.ndarray | None = None
        self._hidden_addr: int | None = None
        self._hidden_view: np.ndarray | None = None

    @property
    def _single_threads(self) -> int:
        return self._threads_box[0]

    def _in_use(self) -> int:
        """The cells a one-token decode's attention covers at most: this request's, or with slots every slot's."""
        return self.n_past if self._cells is None else self._cells.used

    def _drop(self, p0: int, seqs=None) -> None:
        """Remove cells from position p0 on: from every sequence (a lone backend), or from this slot's
        sequences `seqs` (offsets; None: all of them) into the tombstone (backend/slots.py)."""
        if self._cells is None:
            L.llama_memory_seq_rm(self.mem, -1, p0, -1)
        else:
            self._cells.free(self.mem, [self.seq0 + s for s in (seqs if seqs is not None else range(len(self._dirty)))],
                             p0)

    # ------------------------------------------------------------------ basics
    def close(self) -> None:
        if not getattr(self, "_owner", False):      # a slot's view: the context is slot 0's
            return
        if getattr(self, "ctx", None):
            L.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            L.llama_model_free(self.model)
            self.model = None

    def __del__(self):  # pragma: no cover - best effort
        with contextlib.suppress(Exception):
            self.close()

    def metadata(self, key: str) -> str | None:
        return model_metadata(self.model, key)

    def chat_template(self) -> str | None:
        return self.vocab.chat_template()

    @property
    def broker(self):
        """The slots' batch broker (backend/batching.py); None without slots."""
        return self._cells.broker if self._cells is not None else None

    def _decode(self, n: int, off: int = 0) -> None:
        """Decode the n rows laid at off: now, or with a Broker's job, in its next combined decode."""
        if self._cells is not None and self._cells.batched():
            rc = self._cells.broker.submit(self, off, n)        # sets _out_off
        else:
            assert off == 0, "rows laid past row 0 outside a Broker's run"
            self._batch.n_tokens = n
            self._out_off = 0
            if self._tap is not None:
                self._tap.reset()
            rc = L.llama_decode(self.ctx, self._batch)
        if rc != 0:
            if rc == 1:
                raise BackendError("llama_decode: no KV cache slot for the batch (context full?)")
            if rc == 2:         # interrupted (backend/interrupt.py): no cell past the committed prefix stays
                self.rollback()
                raise Interrupted("llama_decode was interrupted")
            raise BackendError(f"llama_decode failed with code {rc}: {recent_errors()}")

    # -------------------------------------------------------------- KV / decode
    def reset(self) -> None:
        if self._cells is None:
            L.llama_memory_clear(self.mem, True)
        else:
            self._drop(0)
        self._synced, self._n_leaves = 1, 1
        self._dirty[:] = False
        if self.exact and self._single_threads != self.n_threads:
            self.set_single_threads(self.n_threads)
        self.n_past = 0
        self.kv_tokens = np.zeros(0, np.int32)
        self.spliced_from = None

    def borrow(self, prompt: np.ndarray, have: int, min_gain: int = 16) -> int:   # slots.py, Cells.borrow
        return have if self._cells is None else self._cells.borrow(self, prompt, have, min_gain)

    def set_single_threads(self, n: int) -> None:
        """Threads for one-token decodes (batches keep every thread).  In exact
        mode decode_tree chooses them itself; with exact=False they stay as set
        (tools/kcache_numerics.py, in git at ff5bfef, compares thread counts this way)."""
        L.llama_set_n_threads(self.ctx, n, self.n_threads)
        self._threads_box[0] = n

    def truncate(self, n: int) -> None:
        """Forget committed tokens from position n on (used for chat prefix reuse)."""
        if n < self.n_past:
            self._drop(n)
            self.n_past = n
            self.kv_tokens = self.kv_tokens[:n]
            if self.spliced_from is not None and n <= self.spliced_from:
                self.spliced_from = None

    def prefill(self, tokens: np.ndarray, want_last_logits: bool = True,
                topk_out: tuple[np.ndarray, np.ndarray] | None = None, cancel=None,
                hidden_out: np.ndarray | None = None) -> None:
        """Decode tokens after the committed prefix, in chunks of n_batch, into seq 0;
        logits only at the very last token.

        cancel: a callable checked before every chunk after the first; when it
        returns True the prefill stops there (n_past tells how far it got, and
        the KV cache holds exactly those tokens).

        topk_out: (ids int32 [len(tokens), K], logits float32 [len(tokens), K]):
        also rank the model's K most likely next tokens after every one of these
        tokens (AASD).  Each chunk then asks llama.cpp for the logits of all its
        rows, which costs the output layer once per token and a 512-row logits
        buffer; the chunks stay the same, so the KV cache and the last
        position's logits are those of a plain prefill.

        hidden_out: float32 [len(tokens), n_embd]: also copy the model's final
        hidden state at every one of these tokens (needs set_hidden(True));
        like topk_out it makes every row of a chunk an output row."""
        tokens = np.asarray(tokens, dtype=np.int32)
        every_row = topk_out is not None or hidden_out is not None
        if hidden_out is not None and not self.hidden_on:
            raise ValueError("prefill(hidden_out=...) needs set_hidden(True)")
        n = len(tokens)
        rows = np.arange(self.n_batch, dtype=np.int64) if topk_out is not None else None
        if n:          # cells go to seq 0 only: the other synced seqs fall behind
            self._dirty[1:self._synced] = True
            self._synced = 1
        if self.n_past + n > self.n_ctx:
            raise BackendError(f"{self.n_past + n} tokens do not fit the context of {self.n_ctx}")
        chunk = self.n_batch if self._cells is None else self._cells.chunk(self.n_batch)
        i = 0
        while i < n:
            if i and self._cells is not None:   # in a Broker's run it parks: one chunk per round (slots.py)
                self._cells.between_chunks(self, tokens[:i])
            if i and cancel is not None and cancel():
                self.n_outputs = 0
                return
            m = min(chunk, n - i)
            off = self._cells.room(self, m, solo=self.exact) if self._cells is not None else 0
            self._decode_chunk(tokens[i:i + m], every_row, want_last_logits and i + m == n, off)
            self._copy_rows(i, m, topk_out, hidden_out, rows)
            self.n_past += m
            i += m
        self.n_outputs = 1 if (want_last_logits and n) else 0
        if every_row and n:
            # logits() shows the last token's row alone, as after a plain prefill
            self._out_off += m - 1

    def _decode_chunk(self, chunk: np.ndarray, every_row: bool, last_logits: bool, off: int = 0) -> None:
        """Decode one prefill chunk (laid at batch row off) into seq 0 after the committed prefix (n_past
        unchanged); output rows: all of them with every_row, else the last one with last_logits."""
        m = len(chunk)
        r = slice(off, off + m)
        self._tok[r] = chunk
        self._pos[r] = np.arange(self.n_past, self.n_past + m, dtype=np.int32)
        self._nseq[r] = 1
        self._seq[r, 0] = self.seq0
        self._logits[r] = 1 if every_row else 0
        if last_logits:
            self._logits[off + m - 1] = 1
        self._decode(m, off)

    def _copy_rows(self, i: int, m: int, topk_out, hidden_out, rows) -> None:
        """After a chunk of m tokens decoded with every row: its top-k and
        hidden states into rows i..i+m-1 of topk_out / hidden_out."""
        if topk_out is not None:
            from edgespec.kernels.topk import topk_rows
            ids, vals = topk_out
            self.n_outputs = m
            lg = self.logits()
            topk_rows(lg, rows, m, ids.shape[1], ids[i:i + m])
            vals[i:i + m] = np.take_along_axis(lg, ids[i:i + m].astype(np.int64), axis=1)
        if hidden_out is not None:
            self.n_outputs = m
            hidden_out[i:i + m] = self.hidden()

    def decode_tree(self, tokens: np.ndarray, depth: np.ndarray, leaf_first: np.ndarray,
                    leaf_count: np.ndarray, n_leaves: int) -> None:
        """Decode one verification batch after the committed prefix.

        tokens[i], depth[i] (root = slot 0 at depth 0), and the sequences of slot i
        are leaf_first[i] .. leaf_first[i]+leaf_count[i]-1.  Logits are requested
        at every slot; read them with logits().
        """
        n = len(tokens)
        if n > self.max_nodes:
            raise ValueError(f"tree of {n} nodes exceeds max_nodes={self.max_nodes}")
        if n_leaves > self.max_leaves:
            raise ValueError(f"tree of {n_leaves} leaves exceeds max_leaves={self.max_leaves}")
        if self.n_past + n > self.n_ctx:
            raise BackendError("verification batch does not fit the context")
        if self.exact and n > EXACT_MAX_BATCH:
            raise ValueError(f"exact mode verifies at most {EXACT_MAX_BATCH} tokens per batch")
        if self.exact and not (self._cells is not None and self._cells.batched()):   # else the Broker's decode
            lim = self.one_thread_after
            want = self.n_threads if (n > 1 or lim is None or self._in_use() + 1 <= lim) else 1
            if want != self._single_threads:
                self.set_single_threads(want)
        # first: a compaction empties the path seqs; off: the batch row the tree starts at (a Broker's)
        off = self._cells.room(self, n) if self._cells is not None else 0
        e = self._synced - n_leaves
        if e > 0:
            # seqs already in sync ride along the leftmost path (the nodes whose
            # first leaf is 0), so they stay in sync when that chain is kept
            left = leaf_first == 0
            leaf_count = leaf_count + e * left
            leaf_first = leaf_first + e * ~left
            n_leaves += e
        for s in range(self._synced, n_leaves):
            if self._dirty[s]:
                L.llama_memory_seq_rm(self.mem, self.seq0 + s, -1, -1)    # its cells are seq 0's too
                self._dirty[s] = False
            L.llama_memory_seq_cp(self.mem, self.seq0, self.seq0 + s, -1, -1)
        r = slice(off, off + n)
        self._tok[r] = tokens
        self._pos[r] = self.n_past + depth
        self._nseq[r] = leaf_count
        self._seq[r] = self.seq0 + leaf_first[:, None] + self._arange_s[None, :]
        self._logits[r] = 1
        self._synced = self._n_leaves = n_leaves
        self._step_lc = leaf_count
        self._decode(n, off)
        self.n_outputs = n

    def logits(self) -> np.ndarray:
        """float32 view [n_outputs, n_vocab] of the last decode's logits (no copy;
        valid until the next decode)."""
        addr = ctypes.cast(L.llama_get_logits(self.ctx), ctypes.c_void_p).value
        if addr != self._logits_addr or self._logits_view is None:   # the output buffer moved: rebuild the view
            assert addr is not None     # read after a decode, which filled llama.cpp's output buffer
            buf = (ctypes.c_float * (self.n_batch * self.n_vocab)).from_address(addr)
            self._logits_view = np.frombuffer(memoryview(buf), dtype=np.float32).reshape(self.n_batch, self.n_vocab)
            self._logits_addr = addr
        return self._logits_view[self._out_off:self._out_off + self.n_outputs]

    def set_hidden(self, on: bool, layer: int | None = None) -> None:
        """Also read each output row's hidden state (hidden()): layer None, the last (llama_set_embeddings);
        layer b, block b's output (0: a middle one; backend/layer_tap.py).  Logits stay bit-identical."""
        if on and self._cells is not None:
            raise ConfigError("hidden states are read from a backend without parallel slots (n_slots=1)")
        was_final = self.hidden_on and self.hidden_layer is None
        block = tap_block(self.model, layer) if on and layer is not None else None
        if block is not None and self._tap is None:
            was_final = attach_tap(self)
        if self._tap is not None:
            self._tap.set_block(block)
        if (on and block is None) != was_final:
            L.llama_set_embeddings(self.ctx, on and block is None)
        self.hidden_on, self.hidden_layer = on, block

    def hidden(self) -> np.ndarray:
        """float32 view [n_outputs, n_embd] of the last decode's hidden states (no copy; valid until the next decode)."""
        if not self.hidden_on:
            raise BackendError("hidden() needs set_hidden(True) before the decode")
        if self.hidden_layer is not None:
            assert self._tap is not None        # set_hidden attached it
            return self._tap.rows(self._out_off, self.n_outputs)
        ptr = L.llama_get_embeddings(self.ctx)
        addr = ctypes.cast(ptr, ctypes.c_void_p).value
        if not addr:
            raise BackendError("llama.cpp returned no hidden states")
        if addr != self._hidden_addr or self._hidden_view is None:   # the output buffer moved: rebuild the view
            buf = (ctypes.c_float * (self.n_batch * self.n_embd)).from_address(addr)
            self._hidden_view = np.frombuffer(memoryview(buf), dtype=np.float32).reshape(self.n_batch, self.n_embd)
            self._hidden_addr = addr
        return self._hidden_view[self._out_off:self._out_off + self.n_outputs]

    clock = staticmethod(time.perf_counter)     # the engine times its steps with it

    def keep(self, k: int) -> None:
        """After decode_tree: commit the first k slots (a seq-0 chain from the root)
        and free every other cell of the step."""
        base = self.n_past
        self._drop(base + k, range(self._n_leaves))
        through = int(self._step_lc[k - 1]) if k > 0 else self._n_leaves   # seqs 0..through-1 pass slot k-1
        for s in range(through, self._n_leaves):              # seqs that left the chain earlier
            if self._cells is not None:                         # their branch cells: into the tombstone
                self._cells.free(self.mem, [self.seq0 + s], base)
            L.llama_memory_seq_rm(self.mem, self.seq0 + s, -1, -1)
        self._synced = through
        self._n_leaves = 1
        self.n_past = base + k

    def rollback(self) -> None:
        """Drop every cell beyond the committed prefix, in every sequence (used when
        a step is interrupted)."""
        self._drop(self.n_past)
        # the batch's seqs now hold only committed cells, but which of them got
        # seq_cp before an interruption is unknown: treat all as behind
        self._dirty[1:] = True
        self._synced = self._n_leaves = 1
