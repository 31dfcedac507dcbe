"""Every way to name a MODEL (edgespec.models.sources) on hand-made trees:
Ollama's manifests and blobs, LM Studio's folders, folders with split GGUFs,
and a Hugging Face-shaped repository served on loopback (HF_ENDPOINT) to the
real huggingface_hub.  The GGUFs are tiny headers without tensors (what
`edgespec models` and the resolver read)."""
from __future__ import annotations

import hashlib
import http.server
import json
import os
import struct
import threading
from contextlib import contextmanager

import pytest

from edgespec.models import sources as M
from edgespec.errors import ModelFileError
from edgespec.models.gguf import model_summary
from edgespec.models.resolve import resolve_model


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def fake_gguf(arch="llama", file_type=15, ctx=2048, template=True, pad=0) -> bytes:
    """A valid GGUF v3 header with no tensors: architecture, file type,
    context length and (optionally) a chat template; `pad` bytes after it."""
    kv = [_str("general.architecture") + struct.pack("<I", 8) + _str(arch),
          _str("general.file_type") + struct.pack("<II", 4, file_type),
          _str(f"{arch}.context_length") + struct.pack("<II", 4, ctx)]
    if template:
        kv.append(_str("tokenizer.chat_template") + struct.pack("<I", 8) + _str("{{ messages }}"))
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv)) + b"".join(kv) + b"\0" * pad


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty HOME with Ollama's and Hugging Face's stores inside it."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("OLLAMA_MODELS", "HF_HOME", "HF_HUB_CACHE", "XDG_CACHE_HOME", "HF_ENDPOINT", "HF_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.setenv("EDGESPEC_MODELS_DIR", str(tmp_path / "zoo"))
    return tmp_path


def listed() -> dict:
    """What list_models finds besides the installed default model."""
    return {e.name: e.source for e in M.list_models() if e.source != "bench"}


def ollama_model(root, name, tag, data: bytes | None, media=M.OLLAMA_MODEL_MEDIA, ns=("registry.ollama.ai", "library")):
    digest = hashlib.sha256(data or b"missing").hexdigest()
    man = root / "manifests" / ns[0] / ns[1] / name / tag
    man.parent.mkdir(parents=True, exist_ok=True)
    man.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.license", "digest": "sha256:" + "0" * 64, "size": 1},
        {"mediaType": media, "digest": f"sha256:{digest}", "size": len(data or b"")}]}))
    if data is not None:
        (root / "blobs").mkdir(exist_ok=True)
        (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    return root / "blobs" / f"sha256-{digest}"


# ------------------------------------------------------------------ Ollama
def test_ollama_names_resolve_to_their_blobs(home):
    root = home / ".ollama" / "models"
    blob = ollama_model(root, "qwen2.5-coder", "1.5b", fake_gguf("qwen2"))
    latest = ollama_model(root, "smolthing", "latest", fake_gguf(pad=1))
    user = ollama_model(root, "tiny", "q8", fake_gguf(pad=2), ns=("registry.ollama.ai", "someone"))
    assert resolve_model("qwen2.5-coder:1.5b") == str(blob)            # read in place, never copied
    assert resolve_model("smolthing") == str(latest)                    # tag defaults to latest
    assert resolve_model("someone/tiny:q8") == str(user)
    assert listed() == {"qwen2.5-coder:1.5b": "ollama", "smolthing:latest": "ollama", "someone/tiny:q8": "ollama"}


def test_ollama_missing_and_foreign_blobs_fail_in_one_line(home, monkeypatch):
    root = home / "olla"
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    ollama_model(root, "gone", "latest", None)
    ollama_model(root, "safet", "latest", b"PK\x03\x04 not a gguf")
    with pytest.raises(ModelFileError, match=r"lacks its blob .*ollama pull gone"):
        resolve_model("gone")
    with pytest.raises(ModelFileError, match="is not a GGUF file"):
        resolve_model("safet:latest")
    assert listed() == {}                         # neither is listed as usable
    with pytest.raises(ModelFileError, match=r"no model named 'gon:latest'.*close matches"):
        ollama_model(root, "gonf", "latest", fake_gguf())
        resolve_model("gon:latest")


# ------------------------------------------------------------------ LM Studio, folders
def test_lmstudio_files_by_path_name_and_stem(home):
    folder = home / ".lmstudio" / "models" / "lmstudio-community" / "Tiny-GGUF"
    folder.mkdir(parents=True)
    f = folder / "Tiny-Q4_K_M.gguf"
    f.write_bytes(fake_gguf())
    (folder / "mmproj-Tiny-F16.gguf").write_bytes(fake_gguf())          # a projector is not a model
    for name in ("lmstudio-community/Tiny-GGUF/Tiny-Q4_K_M.gguf", "Tiny-Q4_K_M.gguf", "tiny-q4_k_m",
                 "lmstudio-community/Tiny-GGUF"):
        assert resolve_model(name) == str(f), name
    other = home / ".cache" / "lm-studio" / "models" / "x" / "y"
    other.mkdir(parents=True)
    (other / "Tiny-Q4_K_M.gguf").write_bytes(fake_gguf())
    with pytest.raises(ModelFileError, match="names 2 LM Studio models"):
        resolve_model("Tiny-Q4_K_M")


def test_folders_and_split_ggufs(tmp_path, home):
    d = tmp_path / "m"
    d.mkdir()
    for i in (1, 2, 3):
        (d / f"big-Q8_0-0000{i}-of-00003.gguf").write_bytes(fake_gguf(pad=i))
    assert resolve_model(str(d)) == str(d / "big-Q8_0-00001-of-00003.gguf")    # llama.cpp loads the rest
    (d / "small.gguf").write_bytes(fake_gguf())
    with pytest.raises(ModelFileError, match="holds 2 models"):
        resolve_model(str(d))
    with pytest.raises(ModelFileError, match="no .gguf file"):
        resolve_model(str(tmp_path / "zoo")) if (tmp_path / "zoo").mkdir() is None else None
    assert M.split_parts("a/b-00001-of-00002.gguf") == ["a/b-00001-of-00002.gguf", "a/b-00002-of-00002.gguf"]


def test_missing_benchmark_model_never_names_a_checkout_tool(home):
    with pytest.raises(ModelFileError) as e:
        resolve_model("gemma3-270m")
    assert "get_models" not in str(e.value) and "get-models" not in str(e.value) and "Ollama name" in str(e.value)


def test_pick_quant_like_llama_cpp():
    files = ["README.md", "m-Q4_K_S.gguf", "m-Q4_K_M.gguf", "m-IQ4_XS.gguf", "mmproj-m-f16.gguf",
             "big/m-Q8_0-00001-of-00002.gguf", "big/m-Q8_0-00002-of-00002.gguf", "m-q8_0.gguf"]
    assert M.pick_quant(files, None) == "m-Q4_K_M.gguf"
    assert M.pick_quant(files, "q4_k_s") == "m-Q4_K_S.gguf"
    assert M.pick_quant(files, "Q8_0") == "m-q8_0.gguf"                 # a whole file before a split one
    assert M.pick_quant(files[5:7], "Q8_0") == "big/m-Q8_0-00001-of-00002.gguf"
    assert M.pick_quant(["x-IQ4_XS.gguf", "x-F16.gguf"], None) == "x-F16.gguf"   # no Q4_K_M: the first
    with pytest.raises(ModelFileError, match="no .gguf file for Q4_XS"):
        M.pick_quant(files, "Q4_XS")                                     # IQ4_XS is another quantization
    with pytest.raises(ModelFileError, match="no .gguf"):
        M.pick_quant(["model.safetensors"], None)


# ------------------------------------------------------------------ Hugging Face
COMMIT = "a" * 40
REPO = {"me/tiny-GGUF": {"tiny-Q4_K_M.gguf": fake_gguf(pad=3000), "tiny-Q8_0.gguf": fake_gguf(file_type=7),
                         "README.md": b"# tiny\n"}}
PRIVATE = "me/private-GGUF"


class HubHandler(http.server.BaseHTTPRequestHandler):
    """The two endpoints huggingface_hub uses here: the file tree of a
    revision, and a file by revision (HEAD for its metadata, GET with Range)."""
    ranges: list = []
    cut: set = set()            # files whose next GET drops the connection after 1000 bytes

    def log_message(self, *a):
        pass

    def _fail(self, code, error_code):
        self.send_response(code)
        self.send_header("X-Error-Code", error_code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _route(self):
        parts = self.path.split("?")[0].strip("/").split("/")
        api = parts[0] == "api"
        repo = "/".join(parts[2:4] if api else parts[0:2])
        if repo == PRIVATE and self.headers.get("Authorization") != "Bearer sesame":
            return self._fail(401, "RepoNotFound") or (None, None, None)
        if repo not in REPO:
            return self._fail(404, "RepoNotFound") or (None, None, None)
        return api, REPO[repo], "/".join(parts[6:] if api else parts[4:])

    def do_GET(self, head=False):
        api, files, name = self._route()
        if files is None:
            return
        if api:
            body = json.dumps([{"type": "file", "oid": hashlib.sha1(d).hexdigest(), "size": len(d), "path": f}
                               for f, d in files.items()]).encode()
            return self._send(200, body, {"Content-Type": "application/json"})
        if name not in files:
            return self._fail(404, "EntryNotFound")
        data = files[name]
        rng = self.headers.get("Range")
        HubHandler.ranges.append(rng)
        start = int(rng.split("=")[1].split("-")[0]) if rng and not head else 0
        if not head and name in HubHandler.cut:
            HubHandler.cut.discard(name)
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[:1000])
            self.close_connection = True
            return
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                   "Content-Length": str(len(data)) if head else None}
        self._send(206 if start else 200, b"" if head else data[start:], headers, total=len(data))

    def do_HEAD(self):
        self.do_GET(head=True)

    def _send(self, code, body, headers, total=None):
        self.send_response(code)
        for k, v in headers.items():
            if v is not None:
                self.send_header(k, v)
        if code == 206:
            self.send_header("Content-Range", f"bytes {total - len(body)}-{total - 1}/{total}")
        if "Content-Length" not in headers or headers["Content-Length"] is None:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


@contextmanager
def hub():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), HubHandler)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def hf(home, monkeypatch):
    with hub() as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setenv("HF_HOME", str(home / "hf"))
        HubHandler.ranges, HubHandler.cut = [], set()
        yield home / "hf" / "hub"


def test_hf_quant_file_and_listing(hf):
    path = resolve_model("hf://me/tiny-GGUF:Q8_0")
    assert open(path, "rb").read() == REPO["me/tiny-GGUF"]["tiny-Q8_0.gguf"]
    assert path.startswith(str(hf / "models--me--tiny-GGUF" / "snapshots" / COMMIT))
    default = resolve_model("hf://me/tiny-GGUF")                       # Q4_K_M when no tag is given
    assert os.path.basename(default) == "tiny-Q4_K_M.gguf"
    assert resolve_model("hf://me/tiny-GGUF/tiny-Q8_0.gguf") == path
    assert list(listed()) == ["hf://me/tiny-GGUF/tiny-Q4_K_M.gguf",
                                                 "hf://me/tiny-GGUF/tiny-Q8_0.gguf"]
    assert model_summary(path)["quantization"] == "Q8_0"


def test_hf_resumes_a_dropped_download(hf, monkeypatch):
    """The connection drops after 1000 bytes: huggingface_hub asks for the
    rest (Range) and the file is whole.  (Its chunks are 10 MB: made small
    here so the bytes before the drop reach the file.)"""
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 500)
    data = REPO["me/tiny-GGUF"]["tiny-Q4_K_M.gguf"]
    HubHandler.cut = {"tiny-Q4_K_M.gguf"}
    path = resolve_model("hf://me/tiny-GGUF/tiny-Q4_K_M.gguf")
    assert open(path, "rb").read() == data
    assert HubHandler.ranges[-2:] == [None, "bytes=1000-"] and not HubHandler.cut, HubHandler.ranges


def test_hf_missing_repo_file_and_401(hf, monkeypatch):
    with pytest.raises(ModelFileError, match="Hugging Face repo me/nothing is not found"):
        resolve_model("hf://me/nothing:Q4_K_M")
    with pytest.raises(ModelFileError, match="no .gguf file for Q2_K in the repo; it has: tiny-Q4_K_M.gguf"):
        resolve_model("hf://me/tiny-GGUF:Q2_K")
    with pytest.raises(ModelFileError, match="needs a token: set HF_TOKEN|not found .*HF_TOKEN"):
        resolve_model(f"hf://{PRIVATE}:Q4_K_M")


def test_hf_pretrained_picks_one_file_by_glob(hf):
    path = M.hf_pretrained("me/tiny-GGUF", "*Q8_0.gguf")
    assert os.path.basename(path) == "tiny-Q8_0.gguf"
    with pytest.raises(ModelFileError, match=r"2 files match '\*.gguf'"):
        M.hf_pretrained("me/tiny-GGUF", "*.gguf")
    with pytest.raises(ModelFileError, match="no file matching '\\*Q2_K\\*' .* tiny-Q4_K_M.gguf"):
        M.hf_pretrained("me/tiny-GGUF", "*Q2_K*")


def test_llama_from_pretrained_loads_the_downloaded_model(hf, model, model_path):
    """edgespec.Llama.from_pretrained as llama-cpp-python's: the real SmolLM2
    served by the loopback hub, downloaded into the cache and loaded; greedy
    text equal to the session model's."""
    import edgespec
    with open(model_path, "rb") as f:
        REPO["me/smol-GGUF"] = {"SmolLM2-135M-Instruct.Q4_1.gguf": f.read()}
    try:
        llm = edgespec.Llama.from_pretrained("me/smol-GGUF", "*Q4_1.gguf", n_ctx=model.n_ctx, verbose=False)
    finally:
        del REPO["me/smol-GGUF"]
    try:
        assert llm.model_path.startswith(str(hf / "models--me--smol-GGUF" / "snapshots"))
        prompt = "The capital of France is"
        out = llm(prompt, max_tokens=8, temperature=0.0)["choices"][0]["text"]
        assert out == model.generate(prompt, max_tokens=8, raw=True).text
    finally:
        llm.close()
