"""Models split over llama.cpp RPC workers (edgespec rpc-worker), on loopback.

Workers are started by these tests as child processes and stopped by process
id.  They need a llama-cpp-python built with CMAKE_ARGS="-DGGML_RPC=on", as
the README installs it; without one they skip and name the reinstall
command, or fail where CI requires the build (conftest.missing_external)."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from click.testing import CliRunner

from edgespec import SpecModel
from edgespec.backend import ggml
from edgespec.app.cli import main
from edgespec.errors import BackendError, ConfigError

from conftest import dev_prompts, missing_external


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def need_rpc():
    if not ggml.rpc_available():
        missing_external("rpc", f"llama-cpp-python is built without RPC: {ggml.REINSTALL}")


def start_worker(port: int, threads: int = 1) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "edgespec", "rpc-worker", "--port", str(port), "-t", str(threads)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    proc.endpoint = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            ggml.probe(f"127.0.0.1:{port}", timeout=2)
            return proc
        except BackendError:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_worker(proc)
                raise AssertionError(f"the worker on {port} did not start: {proc.stderr.read().decode()}")
            time.sleep(0.2)


def stop_worker(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture(scope="module")
def workers():
    need_rpc()
    procs = [start_worker(_free_port()) for _ in range(2)]
    yield [p.endpoint for p in procs]
    for p in procs:
        stop_worker(p)


# ------------------------------------------------------------------ no worker needed
def test_endpoints_parse_and_refuse_nonsense():
    assert ggml.parse_endpoints("10.0.0.2:50052, 127.0.0.1:7") == ["10.0.0.2:50052", "127.0.0.1:7"]
    assert ggml.parse_endpoints(["localhost"]) == ["localhost:50052"]
    for bad in ("host:port", "host:0", ":50052", "a:1,a:1"):
        with pytest.raises(ConfigError):
            ggml.parse_endpoints(bad)


def test_unreachable_worker_is_one_line_naming_it():
    ep = f"127.0.0.1:{_free_port()}"
    with pytest.raises(BackendError, match=f"RPC worker {ep} cannot be reached"):
        ggml.probe(ep, timeout=2)


def test_build_without_rpc_names_the_reinstall(monkeypatch):
    monkeypatch.setattr(ggml, "rpc_available", lambda: False)
    with pytest.raises(ConfigError, match='CMAKE_ARGS="-DGGML_RPC=on"'):
        ggml.rpc_devices(["127.0.0.1:1"])
    r = CliRunner().invoke(main, ["rpc-worker", "--port", str(_free_port())])
    assert r.exit_code != 0 and "GGML_RPC=on" in r.output


def test_worker_refuses_a_public_address_without_allow_remote():
    r = CliRunner().invoke(main, ["rpc-worker", "--host", "0.0.0.0"])
    assert r.exit_code != 0
    assert "--allow-remote" in r.output and "no authentication" in r.output


def test_loopback_addresses():
    assert ggml.is_loopback("127.0.0.1") and ggml.is_loopback("::1") and ggml.is_loopback("localhost")
    assert not ggml.is_loopback("0.0.0.0") and not ggml.is_loopback("192.168.1.5")


# ------------------------------------------------------------------ two workers
LOADED: list[float] = []


@pytest.fixture(scope="module")
def rpc_model(workers, model_path):
    # no cost gate: every proposed draft is verified over the workers
    m = SpecModel(model_path, drafter="none", n_ctx=1024, calibrate=False, cost_gate=False, rpc=workers,
                  kernels="exact", load_progress=LOADED.append)
    yield m
    m.close()


@pytest.fixture(scope="module")
def local_model(model_path):
    m = SpecModel(model_path, drafter="none", n_ctx=1024, calibrate=False, kernels="exact")
    yield m
    m.close()


PROMPTS = [p["turns"][0] for p in dev_prompts(124, 296)] + [
    "Correct the typos and return the whole paragraph: The quick brown fox jumpd over the lazy dog. The dog did "
    "not wake up, and the fox ran into the forrest to find its freinds."]


@pytest.fixture(scope="module")
def local_answers(local_model):
    return [local_model.chat([{"role": "user", "content": p}], max_tokens=48).tokens for p in PROMPTS]


def test_worker_answers_hello_with_the_protocol(workers):
    assert ggml.probe(workers[0])[0] == ggml.RPC_PROTO_MAJOR


@pytest.mark.parametrize("drafter", ["none", "suffix", "trigram", "adjacency", "auto"])
def test_greedy_output_over_two_workers_equals_local(rpc_model, local_answers, drafter):
    accepted = 0
    for prompt, want in zip(PROMPTS, local_answers):
        got = rpc_model.chat([{"role": "user", "content": prompt}], max_tokens=48, drafter=drafter)
        assert got.tokens == want, (drafter, prompt[:40])
        accepted += got.n_draft_accepted
    assert (accepted > 0) == (drafter != "none")     # drafts were verified over the workers, and kept


def test_the_model_runs_on_the_workers(rpc_model, workers):
    assert rpc_model.backend.rpc == workers
    assert LOADED[-1] == 1.0 and LOADED == sorted(LOADED)       # the upload reported its progress
    assert len(ggml.rpc_devices(workers)) == 2
    assert all(ggml.device_memory(d)[1] > 0 for d in ggml.rpc_devices(workers))


def test_calibration_key_names_the_workers(rpc_model, local_model, workers):
    k_rpc, k_local = rpc_model._calibration_key(), local_model._calibration_key()
    assert k_rpc != k_local


def test_a_worker_lost_mid_answer_ends_the_process_with_a_clear_line(model_path):
    need_rpc()
    procs = [start_worker(_free_port()) for _ in range(2)]
    eps = [p.endpoint for p in procs]
    code = ("import sys, edgespec\n"
            f"m = edgespec.SpecModel({model_path!r}, drafter='none', n_ctx=1024, calibrate=False, rpc={eps!r})\n"
            "print('loaded', flush=True)\n"
            "for _ in range(200):\n"
            "    m.generate('Count from one to a thousand in words:', max_tokens=200)\n")
    client = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert client.stdout.readline().strip() == b"loaded"
        time.sleep(0.5)
        os.kill(procs[1].pid, signal.SIGKILL)
        _, err = client.communicate(timeout=60)
    finally:
        if client.poll() is None:
            client.kill()
        for p in procs:
            stop_worker(p)
    assert client.returncode != 0
    assert f"RPC workers in use: {eps[0]}, {eps[1]}" in err.decode(), err.decode()[-2000:]


class CountingRelay:
    """A loopback relay in front of a worker that counts the bytes coming back from it."""

    def __init__(self, target: str):
        self.down, self._lock = 0, threading.Lock()
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._srv.getsockname()[1]}"
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            client, _ = self._srv.accept()
            worker = socket.create_connection(self._target)
            threading.Thread(target=self._pump, args=(client, worker, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(worker, client, True), daemon=True).start()

    def _pump(self, src, dst, count):
        while data := src.recv(1 << 16):
            if count:
                with self._lock:
                    self.down += len(data)
            dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)    # pass the close on (the worker serves one client at a time)


def bytes_back_per_token(model_path, rpc_output) -> tuple[float, int]:
    """(bytes the worker sent back per generated token, n_vocab) for 16 greedy tokens over one worker."""
    proc = start_worker(_free_port())
    relay = CountingRelay(proc.endpoint)
    try:
        m = SpecModel(model_path, drafter="none", n_ctx=512, calibrate=False, rpc=[relay.endpoint],
                      kernels="exact", rpc_output=rpc_output)
        try:
            m.generate("Count from one to twenty:", max_tokens=4)
            before = relay.down
            r = m.generate("List the months of the year:", max_tokens=16)
            return (relay.down - before) / len(r.tokens), m.backend.n_vocab
        finally:
            m.close()
    finally:
        stop_worker(proc)


def test_the_logits_are_computed_here_unless_asked_otherwise(model_path):
    """With the output layer here (the default) a worker sends back hidden
    states; with rpc_output="remote" every token's logits (4 bytes per
    vocabulary entry) cross the link."""
    need_rpc()
    local, n_vocab = bytes_back_per_token(model_path, "local")
    remote, _ = bytes_back_per_token(model_path, "remote")
    assert remote >= 4 * n_vocab
    assert local < remote / 10, (local, remote)


def test_bench_over_rpc_needs_workers_of_its_own_for_llama_server():
    from types import SimpleNamespace

    from edgespec.bench.runner import _Methods
    from edgespec.errors import BenchError

    model = SimpleNamespace(backend=SimpleNamespace(rpc=["127.0.0.1:50052"]))
    with pytest.raises(BenchError, match="--peer-rpc"):
        _Methods(model, ["none", "llama-server-ngram-simple"], None, False)
    with pytest.raises(BenchError, match="llama-cpp-python-pld cannot run over --rpc"):
        _Methods(model, ["none", "llama-cpp-python-pld"], None, False)
    with pytest.raises(BenchError, match="one llama-server method per run"):
        _Methods(model, ["llama-server", "llama-server-ngram-simple"], None, False, ["127.0.0.1:50053"])


def test_bench_report_names_the_workers_and_their_latency():
    from edgespec.bench.report import format_report

    head = {"model": "m.gguf", "rpc": ["127.0.0.1:50071", "127.0.0.1:50072"], "tensor_split": [3, 1],
            "rpc_hello_ms": {"127.0.0.1:50071": 2.25}, "peer_rpc": ["127.0.0.1:50081"], "max_tokens": 8}
    text = format_report([], head)
    assert "RPC workers: 127.0.0.1:50071 (HELLO 2.2 ms), 127.0.0.1:50072, split 3:1; " \
           "llama-server's: 127.0.0.1:50081" in text
