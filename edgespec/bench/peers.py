"""llama.cpp's own `llama-server` (and `rpc-server`) as peers of edgespec:
built once from the llama.cpp source that the installed llama-cpp-python
vendors (the same commit), cached, and found again by `edgespec bench`.

The build (`edgespec build-peers`) downloads llama-cpp-python's source
distribution of the installed version with pip, extracts its
vendor/llama.cpp, configures it with CMake (RPC on, the server on, no
HTTPS, no web UI download, static libraries, the native CPU) and builds the
two targets.  The binaries and a manifest (build.json: llama-cpp-python
version, llama.cpp commit, `llama-server --version`, CMake options, build
time) land in CACHE/llama-server/<llama-cpp-python version>/, CACHE being
edgespec's cache directory (EDGESPEC_CACHE_DIR, default ~/.cache/edgespec).

EDGESPEC_LLAMA_SERVER=PATH makes the bench run that llama-server binary
instead; a build.json beside it is checked like the cached one's, a binary
without one runs as it is (its --version goes into the bench header).
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

from edgespec.paths import cache_dir
from edgespec.errors import PeerError

SERVER_ENV = "EDGESPEC_LLAMA_SERVER"
BUILD_COMMAND = "edgespec build-peers"
MANIFEST = "build.json"
SERVER_TARGET = "llama-server"
RPC_TARGETS = ("ggml-rpc-server", "rpc-server")   # the target's name in newer and older llama.cpp
CMAKE_OPTIONS = {
    "CMAKE_BUILD_TYPE": "Release",
    "GGML_RPC": "ON",
    "LLAMA_BUILD_SERVER": "ON",
    "LLAMA_BUILD_TESTS": "OFF",
    "LLAMA_BUILD_EXAMPLES": "OFF",
    "LLAMA_CURL": "OFF",               # older llama.cpp: no model downloads
    "LLAMA_OPENSSL": "OFF",            # no HTTPS (the bench talks to it on loopback)
    "LLAMA_BUILD_UI": "OFF",           # no npm build of the web UI ...
    "LLAMA_USE_PREBUILT_UI": "OFF",    # ... nor a download of a prebuilt one
    "BUILD_SHARED_LIBS": "OFF",        # self-contained binaries, copied into the cache
}
"""CMake options of the build; those the vendored CMakeLists does not know are left out."""


def installed_version() -> str:
    """The installed llama-cpp-python's version."""
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        raise PeerError("llama-cpp-python is not installed; edgespec needs it (pip install edgespec)") from None


def peers_dir(version: str | None = None) -> str:
    """Where the binaries built from llama-cpp-python `version`'s source live."""
    return os.path.join(cache_dir(), "llama-server", version or installed_version())


def build_hint() -> str:
    return (f"build it with `{BUILD_COMMAND}` (llama.cpp's server from the source llama-cpp-python "
            f"{installed_version()} vendors; several minutes), or set {SERVER_ENV} to a llama-server binary")


@dataclass
class ServerBinary:
    """A llama-server binary the bench may run, with its build manifest (None
    for a binary given by SERVER_ENV without one)."""
    path: str
    manifest: dict | None = None
    version: str = ""              # what `llama-server --version` says
    checked: bool = True           # built from the installed llama-cpp-python's llama.cpp
    extra: dict = field(default_factory=dict)

    def describe(self) -> dict:
        m = self.manifest or {}
        return {"path": self.path, "version": self.version, "llama_cpp_python": m.get("llama_cpp_python"),
                "llama_cpp_commit": m.get("llama_cpp_commit"), "same_as_llama_cpp_python": self.checked}


def read_manifest(directory: str) -> dict | None:
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            m = json.load(f)
    except (OSError, ValueError) as e:
        raise PeerError(f"cannot read {path} ({e}): build again with `{BUILD_COMMAND} --force`") from None
    if not isinstance(m, dict):
        raise PeerError(f"{path} is not a build manifest: build again with `{BUILD_COMMAND} --force`")
    return m


def server_version(path: str, timeout: float = 60) -> str:
    """The first line `llama-server --version` prints ("version: ... (build N, commit C)")."""
    try:
        p = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=timeout,
                           errors="replace")
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PeerError(f"cannot run {path} --version ({e}): {build_hint()}") from None
    out = (p.stdout + "\n" + p.stderr).strip().splitlines()
    line = next((x.strip() for x in out if x.strip().startswith("version:")), None)
    if p.returncode != 0 or line is None:
        last = out[-1].strip() if out else "no output"
        raise PeerError(f"{path} --version failed (exit code {p.returncode}: {last}): {build_hint()}")
    return line


def find_llama_server() -> ServerBinary:
    """The llama-server the bench runs: SERVER_ENV's, else the cached build
    for the installed llama-cpp-python.  PeerError (one line, saying how to
    build it) when there is none, it does not run, or its manifest names
    another llama-cpp-python version."""
    env = os.environ.get(SERVER_ENV)
    path = env or os.path.join(peers_dir(), SERVER_TARGET)
    if not os.path.isfile(path):
        if env:
            raise PeerError(f"{SERVER_ENV}={env}: no such file; unset it to use the cached build, or "
                            f"{build_hint().split(', or ')[0]}")
        raise PeerError(f"llama-server is not built: {build_hint()}")
    if not os.access(path, os.X_OK):
        raise PeerError(f"{path} is not executable: {build_hint()}")
    manifest = read_manifest(os.path.dirname(os.path.abspath(path)))
    want = installed_version()
    if manifest is not None and manifest.get("llama_cpp_python") != want:
        raise PeerError(f"{path} was built from llama-cpp-python {manifest.get('llama_cpp_python')}'s llama.cpp, "
                        f"but {want} is installed: run `{BUILD_COMMAND}`")
    return ServerBinary(path, manifest, server_version(path), checked=manifest is not None)


# ------------------------------------------------------------------ build
def fetch_sdist(version: str, dest: str, say: Callable[[str], None]) -> str:
    """llama-cpp-python's source distribution of `version`, downloaded by pip into dest."""
    say(f"downloading llama-cpp-python {version}'s source distribution with pip...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--quiet",
           f"llama-cpp-python=={version}", "-d", dest]
    p = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    found = [f for f in os.listdir(dest) if f.endswith(".tar.gz")]
    if p.returncode != 0 or not found:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise PeerError(f"pip could not download llama-cpp-python {version}'s source ({last}); "
                        f"download it yourself and pass it with --sdist")
    return os.path.join(dest, found[0])


def extract_llama_cpp(sdist: str, dest: str) -> tuple[str, str | None]:
    """Extract vendor/llama.cpp (and CHANGELOG.md) from the sdist into dest:
    (llama.cpp source directory, the llama.cpp commit the changelog names for
    this version, or None)."""
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            members = [m for m in tar.getmembers()
                       if "/vendor/llama.cpp/" in m.name or m.name.endswith("/CHANGELOG.md")]
            if not any(m.name.endswith("/vendor/llama.cpp/CMakeLists.txt") for m in members):
                raise PeerError(f"{sdist} holds no vendor/llama.cpp: not a llama-cpp-python source distribution")
            if hasattr(tarfile, "data_filter"):
                tar.extractall(dest, members=members, filter="data")
            else:  # pragma: no cover - Python < 3.11.4
                tar.extractall(dest, members=members)
    except (OSError, tarfile.TarError) as e:
        raise PeerError(f"cannot extract {sdist}: {e}") from None
    top = os.path.join(dest, os.listdir(dest)[0])
    return os.path.join(top, "vendor", "llama.cpp"), changelog_commit(os.path.join(top, "CHANGELOG.md"))


def changelog_commit(path: str) -> str | None:
    """The llama.cpp commit of the newest release section of llama-cpp-python's
    CHANGELOG.md ("update llama.cpp to ggml-org/llama.cpp@<sha>")."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    sections = re.split(r"^## \[", text, flags=re.M)
    for sec in sections[1:]:
        if sec.startswith("Unreleased"):
            continue
        m = re.search(r"llama\.cpp@([0-9a-f]{7,40})", sec)
        return m.group(1) if m else None
    return None


def cmake_args(src: str, build: str, commit: str | None) -> list[str]:
    """The configure command: CMAKE_OPTIONS the source knows, the commit for
    --version, then the user's CMAKE_ARGS (as llama-cpp-python's own build
    takes them, e.g. -DGGML_CUDA=on)."""
    known = ""
    for sub in ("CMakeLists.txt", os.path.join("ggml", "CMakeLists.txt")):
        try:
            with open(os.path.join(src, sub), encoding="utf-8") as f:
                known += f.read()
        except OSError:
            pass
    args = ["cmake", "-S", src, "-B", build]
    if shutil.which("ninja"):
        args += ["-G", "Ninja"]
    for k, v in CMAKE_OPTIONS.items():
        if k.startswith("CMAKE_") or f"option({k} " in known or f"option({k}\t" in known:
            args.append(f"-D{k}={v}")
    if commit:
        args.append(f"-DLLAMA_BUILD_COMMIT={commit}")
    args += shlex.split(os.environ.get("CMAKE_ARGS", ""))
    return args


_PROGRESS = re.compile(r"^\[\s*(\d+)(?:/(\d+)\]|%\])")


def progress_fraction(line: str) -> float | None:
    """How far a build is by one line of Ninja ("[12/340] ...") or Make ("[ 35%] ...") output."""
    m = _PROGRESS.match(line)
    if not m:
        return None
    done, total = int(m.group(1)), m.group(2)
    return done / int(total) if total else done / 100.0


def run_logged(cmd: list[str], log, say: Callable[[str], None], what: str) -> None:
    """Run cmd with its output into log; on a build, one progress line per
    5% (or every line's fraction on a terminal).  PeerError with the last
    lines of output when it fails."""
    log.write("$ " + shlex.join(cmd) + "\n")
    log.flush()
    tail: list[str] = []
    shown = -1
    tty = sys.stderr is not None and sys.stderr.isatty()
    t0 = time.monotonic()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace") as p:
        for line in p.stdout:
            log.write(line)
            tail = (tail + [line.rstrip()])[-20:]
            frac = progress_fraction(line)
            if frac is not None and (tty or int(frac * 20) > shown):
                shown = int(frac * 20)
                msg = f"  {what}: {frac:4.0%} ({time.monotonic() - t0:.0f} s)"
                if tty:
                    print("\r" + msg, end="", file=sys.stderr, flush=True)
                else:
                    say(msg)
        rc = p.wait()
    if tty and shown >= 0:
        print(file=sys.stderr)
    if rc != 0:
        errors = [x for x in tail if "error" in x.lower()] or tail[-3:]
        raise PeerError(f"{what} failed (exit code {rc}): {' | '.join(errors[-3:])} (full log: {log.name})")


def rpc_target(src: str) -> str:
    """The rpc server's target name in this llama.cpp (renamed over time)."""
    try:
        with open(os.path.join(src, "tools", "rpc", "CMakeLists.txt"), encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return RPC_TARGETS[-1]
    return next((t for t in RPC_TARGETS if f"set(TARGET {t})" in text or f"add_executable({t} " in text),
                RPC_TARGETS[-1])


def build_peers(*, jobs: int | None = None, force: bool = False, sdist: str | None = None,
                say: Callable[[str], None] = print) -> dict:
    """Build llama-server and rpc-server from the installed llama-cpp-python's
    llama.cpp into peers_dir(); return the manifest (an existing build's, unless force)."""
    version = installed_version()
    out = peers_dir(version)
    have = read_manifest(out)
    if have and not force and os.path.isfile(os.path.join(out, SERVER_TARGET)):
        say(f"already built for llama-cpp-python {version}: {out} (--force builds again)")
        return have
    if shutil.which("cmake") is None:
        raise PeerError("building llama-server needs cmake and a C++ compiler: install them "
                        "(e.g. apt install cmake g++, or pip install cmake)")
    jobs = jobs or os.cpu_count() or 1
    os.makedirs(cache_dir(), exist_ok=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="build-peers-", dir=cache_dir()) as work:
        if sdist is None:
            sdist = fetch_sdist(version, work, say)
        src, commit = extract_llama_cpp(sdist, os.path.join(work, "src"))
        build = os.path.join(work, "build")
        rpc = rpc_target(src)
        say(f"building llama.cpp {commit or '(commit unknown)'}'s {SERVER_TARGET} and {rpc} from llama-cpp-python "
            f"{version}'s source with {jobs} jobs: this takes several minutes (about 8 on 2 cores)")
        log_path = os.path.join(cache_dir(), "llama-server", f"build-{version}.log")
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        configure = cmake_args(src, build, commit)
        with open(log_path, "w", encoding="utf-8") as log:
            run_logged(configure, log, say, "configure")
            run_logged(["cmake", "--build", build, "--config", "Release", "-j", str(jobs),
                        "--target", SERVER_TARGET, rpc], log, say, "build")
        staged = out + ".new"
        shutil.rmtree(staged, ignore_errors=True)
        os.makedirs(staged)
        for name in (SERVER_TARGET, rpc):
            shutil.copy2(_built_binary(build, name), os.path.join(staged, name))
        manifest = {"llama_cpp_python": version, "llama_cpp_commit": commit,
                    "version": server_version(os.path.join(staged, SERVER_TARGET)),
                    "binaries": {"llama-server": SERVER_TARGET, "rpc-server": rpc},
                    "cmake_options": [a for a in configure if a.startswith("-D")],
                    "jobs": jobs, "build_s": round(time.monotonic() - t0, 1),
                    "built": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                    "log": log_path}
        with open(os.path.join(staged, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(staged, out)
    say(f"built in {manifest['build_s'] / 60:.1f} minutes: {out} ({manifest['version']})")
    return manifest


def _built_binary(build: str, name: str) -> str:
    for sub in ("bin", os.path.join("bin", "Release"), ""):
        p = os.path.join(build, sub, name)
        if os.path.isfile(p):
            return p
    raise PeerError(f"the build finished but {name} is not in {build}/bin")
