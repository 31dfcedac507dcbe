"""Reading and checking a GGUF file's header before llama.cpp sees it.

llama.cpp maps a GGUF and trusts its header: a truncated download or a
corrupt value can crash it instead of failing.  This module walks the header
itself (metadata and tensor infos, never the tensor data), refuses what
llama.cpp would abort on, and keeps what edgespec reads from the header
without loading the model: string metadata, a few integers, and each tensor's
offset.
"""
from __future__ import annotations

import math
import os
import struct

from edgespec.errors import ModelFileError


_GGUF_TYPE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def check_gguf(path: str) -> tuple[dict, int]:
    """Raise ModelFileError with a one-line reason unless `path` looks like a
    complete GGUF file: magic, version, a parsable metadata header, and tensor
    data offsets inside the file (so a truncated download is caught before
    llama.cpp maps it).  Returns ({tensor name: (dims, ggml type, offset in the
    data section)}, start of the data section)."""
    if not os.path.exists(path):
        raise ModelFileError(f"model file not found: {path}")
    if not os.path.isfile(path):
        raise ModelFileError(f"not a file: {path}")
    st = os.stat(path)
    # a model is checked when it is resolved and read again for its embeddings
    # (auto): the header walk is done once per file version
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if key not in _CHECKED:
        if len(_CHECKED) >= 8:
            _CHECKED.clear()
        _CHECKED[key] = _check_gguf(path)
    return _CHECKED[key][:2]


def gguf_metadata(path: str) -> dict:
    """The string-valued metadata of a GGUF file (general.architecture,
    general.name, tokenizer.chat_template, ...) and the integers
    general.file_type and ARCH.context_length, read from its header after
    check_gguf's checks."""
    check_gguf(path)
    st = os.stat(path)
    return dict(_CHECKED[(os.path.realpath(path), st.st_size, st.st_mtime_ns)][2])


_CHECKED: dict = {}


def _check_gguf(path: str) -> tuple[dict, int, dict]:
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            head = f.read(24)
            if len(head) < 4 or head[:4] != b"GGUF":
                raise ModelFileError(f"not a GGUF file (bad magic): {path}")
            if len(head) < 24:
                raise ModelFileError(f"truncated GGUF file (header cut short): {path}")
            version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
            if version not in (2, 3):
                raise ModelFileError(f"unsupported GGUF version {version}: {path}")
            if n_tensors > 1_000_000 or n_kv > 1_000_000:
                raise ModelFileError(f"corrupt GGUF header (implausible counts): {path}")
            return _check_body(f, size, n_tensors, n_kv, path)
    except OSError as e:
        raise ModelFileError(f"cannot read {path}: {e.strerror or e}") from None


def gguf_tensor(path: str, name: str) -> tuple[list[int], int, int]:
    """(dims, ggml type id, absolute file offset) of one tensor of a GGUF file,
    from the header alone (edgespec.drafters.embeddings maps token_embd.weight this way:
    a generic GGUF reader parses the whole vocabulary first, which is slow)."""
    tensors, data_start = check_gguf(path)
    if name not in tensors:
        raise ModelFileError(f"{path} has no tensor {name}")
    dims, ggml_type, off = tensors[name]
    return dims, ggml_type, data_start + off


# float hyperparameters llama.cpp uses unchecked: a negative or NaN norm
# epsilon aborts its CPU kernels (GGML_ASSERT(eps >= 0.0f)); a rope base that
# is not positive and finite turns every logit into NaN
_TRUSTED_FLOATS = (b"epsilon", b"freq_base")
_MAX_LAYERS = 512           # LLAMA_MAX_LAYERS
# integer metadata kept (gguf_metadata): the data alignment, what `edgespec models` shows
_INT_KEYS = (b"general.alignment", b"general.file_type", b".context_length")


def _check_float(key: bytes, v: float, path: str) -> None:
    ok = math.isfinite(v) and (v > 0 if key.endswith(b"freq_base") else v >= 0)
    if not ok:
        raise ModelFileError(f"corrupt GGUF metadata ({key.decode('utf-8', 'replace')} = {v}): {path}")


class _HeaderReader:
    """Reads the metadata and tensor infos of an open GGUF file, every length
    checked against the file size first."""

    def __init__(self, f, size: int, path: str):
        self.f, self.size, self.path = f, size, path

    def need(self, n: int) -> bytes:
        b = self.f.read(n)
        if len(b) < n:
            raise ModelFileError(f"truncated GGUF file (metadata cut short): {self.path}")
        return b

    def read_str(self) -> bytes:
        (ln,) = struct.unpack("<Q", self.need(8))
        if ln > self.size:
            raise ModelFileError(f"corrupt GGUF metadata (string length {ln}): {self.path}")
        return self.need(ln)

    def skip_value(self, t: int, key: bytes) -> object:
        """Read one value of type `t`; returns it when it is a string or an
        integer of _INT_KEYS, else None (after the checks on trusted values)."""
        path = self.path
        if t in _GGUF_TYPE_SIZES:
            b = self.need(_GGUF_TYPE_SIZES[t])
            if t in (6, 12) and key.endswith(_TRUSTED_FLOATS):
                _check_float(key, struct.unpack("<f" if t == 6 else "<d", b)[0], path)
            if key.endswith(b".block_count") and not 1 <= int.from_bytes(b, "little") <= _MAX_LAYERS:
                # llama.cpp asserts 0 < n_layer <= LLAMA_MAX_LAYERS (abort)
                raise ModelFileError(f"corrupt GGUF metadata ({key.decode('utf-8', 'replace')} = "
                                     f"{int.from_bytes(b, 'little')}): {path}")
            return int.from_bytes(b, "little") if key.endswith(_INT_KEYS) and t not in (6, 7, 12) else None
        if t == 8:
            return self.read_str().decode("utf-8", "replace")
        if t == 9:
            self._skip_array()
            return None
        raise ModelFileError(f"corrupt GGUF metadata (value type {t}): {path}")

    def _skip_array(self) -> None:
        (et,) = struct.unpack("<I", self.need(4))
        (cnt,) = struct.unpack("<Q", self.need(8))
        if cnt > self.size:
            raise ModelFileError(f"corrupt GGUF metadata (array of {cnt}): {self.path}")
        if et in _GGUF_TYPE_SIZES:
            self.need(_GGUF_TYPE_SIZES[et] * cnt)
        elif et == 8:
            read_str = self.read_str     # a vocabulary is one such array: 100k+ strings
            for _ in range(cnt):
                read_str()
        else:
            for _ in range(cnt):
                self.skip_value(et, b"")

    def metadata(self, n_kv: int) -> tuple[int, dict]:
        """(data alignment, {key: kept value}) of the n_kv metadata entries."""
        alignment = 32
        strings = {}
        for _ in range(n_kv):
            key = self.read_str()
            (t,) = struct.unpack("<I", self.need(4))
            v = self.skip_value(t, key)
            if key == b"general.alignment":
                alignment = v or alignment
            elif v is not None:
                strings[key.decode("utf-8", "replace")] = v
        return alignment, strings

    def tensor_infos(self, n_tensors: int) -> tuple[dict, int]:
        """({name: (dims, ggml type, offset)}, the largest offset) of the n_tensors tensor infos."""
        max_off = 0
        tensors = {}
        for _ in range(n_tensors):
            name = self.read_str().decode("utf-8", "replace")
            (nd,) = struct.unpack("<I", self.need(4))
            if nd > 8:
                raise ModelFileError(f"corrupt GGUF tensor info: {self.path}")
            dims = list(struct.unpack(f"<{nd}Q", self.need(8 * nd)))
            (ggml_type,) = struct.unpack("<I", self.need(4))
            (off,) = struct.unpack("<Q", self.need(8))
            if nd == 1 and ggml_type != 0:
                # norm weights and biases meet F32 activations in llama.cpp's CPU
                # binary ops, which abort on any other type (converters write F32)
                raise ModelFileError(f"unsupported GGUF tensor {name}: a one-dimensional tensor must be F32, "
                                     f"not ggml type {ggml_type}: {self.path}")
            tensors[name] = (dims, ggml_type, off)
            max_off = max(max_off, off)
        return tensors, max_off


def _check_body(f, size: int, n_tensors: int, n_kv: int, path: str):
    r = _HeaderReader(f, size, path)
    alignment, strings = r.metadata(n_kv)
    tensors, max_off = r.tensor_infos(n_tensors)
    data_start = (f.tell() + alignment - 1) // alignment * alignment
    if n_tensors and data_start + max_off >= size:
        raise ModelFileError(f"truncated GGUF file (tensor data missing, file is {size} bytes): {path}")
    return tensors, data_start, strings


# general.file_type (llama.cpp's llama_ftype) -> the quantization's usual name
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
              11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
              18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S",
              25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M",
              32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4"}


def model_summary(path: str) -> dict:
    """architecture, quantization, context length and chat template (yes/no)
    of a GGUF, from its header (edgespec models)."""
    meta = gguf_metadata(path)
    arch = meta.get("general.architecture", "?")
    ftype = meta.get("general.file_type")
    return {"architecture": arch, "quantization": FILE_TYPES.get(ftype, "?" if ftype is None else f"type {ftype}"),
            "context_length": meta.get(f"{arch}.context_length"),
            "chat_template": "tokenizer.chat_template" in meta}
