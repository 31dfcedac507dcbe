"""llama.cpp's llama-server as a method of `edgespec bench`.

Each llama-server method starts the binary edgespec.bench.peers finds on a free
loopback port, with the bench's model, context, GPU layers and threads, one
slot, and the speculative settings llama.cpp's docs/speculative.md
recommends for it (SERVER_METHODS), CPU weight repacking off as edgespec
runs (server_args).  The bench sends each prompt as the
token ids edgespec prefills (the chat template already applied), so both
decode the same prompt; greedy (temperature 0), no prompt cache, the
generated token ids returned.  A constrained prompt's grammar goes in the
request's `grammar` field (see completion_request).

Timing comes from the server's own `timings`: predicted_ms runs from the
first generated token to the last (llama.cpp's decode phase: the first token
comes from the prompt's logits), as edgespec's decode_s does; the bench
counts the answer's tokens as for every method (an end-of-generation token
that stopped it is not part of the answer), so tokens_per_s is
(n_generated - 1) / decode_s.  The server's own figures are kept in the row
(`server_timings`).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

from edgespec.backend.ggml import OUTPUT_WEIGHTS, needs_output_override
from edgespec.errors import PeerError

SERVER_METHODS = {
    "llama-server": (),
    "llama-server-ngram-simple": ("--spec-type", "ngram-simple", "--spec-draft-n-max", "64"),
    "llama-server-ngram-map-k": ("--spec-type", "ngram-map-k", "--spec-draft-n-max", "64"),
    "llama-server-ngram-map-k4v": ("--spec-type", "ngram-map-k4v", "--spec-ngram-map-k4v-size-n", "8",
                                   "--spec-ngram-map-k4v-size-m", "8", "--spec-ngram-map-k4v-min-hits", "2",
                                   "--spec-draft-n-max", "64"),
    "llama-server-ngram-mod": ("--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "24",
                               "--spec-ngram-mod-n-min", "48", "--spec-ngram-mod-n-max", "64"),
    "llama-server-ngram-cache": ("--spec-type", "ngram-cache"),
}
"""Method -> llama-server's speculative options (docs/speculative.md's examples)."""

OUTPUT_ON_CPU = f"{OUTPUT_WEIGHTS.decode()}=CPU"     # llama-server's -ot for edgespec's placement
START_TIMEOUT_S = 300.0      # loading a large GGUF from a cold disk
REQUEST_TIMEOUT_S = 3600.0
STOP_REASONS = {"eos": "stop", "word": "stop", "limit": "length"}


def server_args(method: str, binary: str, model_path: str, n_ctx: int, n_gpu_layers: int,
                threads: int | None, port: int, rpc: list[str] = (), tensor_split: list[float] = (),
                rpc_output: str = "local", n_parallel: int = 1) -> list[str]:
    """llama-server's command line for a method (threads None = its default:
    one per physical core for decoding and for batches; n_parallel: its
    slots, -np, which split n_ctx between them).  CPU weight
    repacking is off, as for edgespec and the llama-cpp-python methods
    (backend.llama.load_model: llama.cpp's AMX kernel crashed llama-server
    at its warm-up on the project's Xeon too)."""
    if method not in SERVER_METHODS:
        raise PeerError(f"unknown llama-server method {method!r}")
    # over RPC (the same workers as edgespec's model) every layer goes to them unless -ngl says otherwise
    ngl = n_gpu_layers or (999 if rpc else 0)
    args = [binary, "-m", model_path, "-c", str(n_ctx), "-ngl", str(ngl), "-np", str(n_parallel),
            "--host", "127.0.0.1", "--port", str(port), "--no-webui", "--no-repack"]
    if threads:
        args += ["-t", str(threads), "-tb", str(threads)]
    if rpc:
        args += ["--rpc", ",".join(rpc)]
        if needs_output_override(rpc_output):    # the output layer here, as edgespec places it
            args += ["-ot", OUTPUT_ON_CPU]
    if tensor_split:
        args += ["-ts", ",".join(f"{x:g}" for x in tensor_split)]
    return args + list(SERVER_METHODS[method])


def completion_request(prompt_tokens, max_tokens: int, grammar: str | None = None, json_schema=None) -> dict:
    """The /completion body: the prompt as token ids (no BOS added, as
    given), greedy, no prompt cache (every prompt prefilled afresh, as
    edgespec does), the generated ids returned; with `grammar` (GBNF text)
    or `json_schema` (a schema object) the answer must follow it, in
    llama-server's own fields of those names.  The bench sends the GBNF it
    runs every method under as `grammar`: llama-server turns a json_schema
    into a grammar with its C++ converter, whose whitespace rule (newlines
    and indentation allowed) differs from that of the Python port edgespec
    and llama-cpp-python use, so its answers would not be comparable."""
    if grammar is not None and json_schema is not None:
        raise PeerError("a llama-server request takes a grammar or a JSON schema, not both")
    body = {"prompt": [int(t) for t in prompt_tokens], "n_predict": int(max_tokens), "temperature": 0.0,
            "top_k": 1, "cache_prompt": False, "return_tokens": True, "stream": False}
    if grammar is not None:
        body["grammar"] = grammar
    if json_schema is not None:
        body["json_schema"] = json_schema
    return body


def parse_completion(resp: dict, n_prompt: int) -> dict:
    """A bench result row from llama-server's /completion response (see the
    module doc).  PeerError when it lacks what the bench needs or evaluated
    another prompt than the one sent."""
    if not isinstance(resp, dict):
        raise PeerError("llama-server's response is not a JSON object")
    t = resp.get("timings")
    if not isinstance(t, dict) or not isinstance(t.get("predicted_ms"), (int, float)):
        raise PeerError("llama-server's response has no timings.predicted_ms: not a llama.cpp server of the "
                        "vendored version?")
    tokens = resp.get("tokens")
    text = resp.get("content", "")
    if not isinstance(tokens, list) or not all(isinstance(x, int) for x in tokens) or (text and not tokens):
        raise PeerError("llama-server's response has no generated token ids (`tokens` with return_tokens): "
                        "a llama-server too old for the bench")
    evaluated = resp.get("tokens_evaluated", t.get("prompt_n", 0) + t.get("cache_n", 0))
    if evaluated != n_prompt:
        raise PeerError(f"llama-server evaluated {evaluated} prompt tokens, the bench sent {n_prompt}")
    stop = resp.get("stop_type", "limit")
    if stop == "eos" and tokens:
        tokens = tokens[:-1]          # the end-of-generation token is not part of the answer
    n = len(tokens)
    decode_s = float(t["predicted_ms"]) / 1000.0
    keep = ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second", "draft_n",
            "draft_n_accepted")
    return {"text": text, "tokens": tokens, "n_generated": n, "n_steps": None, "mean_accepted": None,
            "prefill_s": float(t.get("prompt_ms", 0.0)) / 1000.0, "decode_s": decode_s,
            "tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
            "stop_reason": STOP_REASONS.get(stop, stop),
            "server_timings": {k: t[k] for k in keep if k in t}}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServerRunner:
    """One llama-server process for one method (start, request, close)."""

    def __init__(self, method: str, binary: str, model_path: str, n_ctx: int, n_gpu_layers: int,
                 threads: int | None, env: dict | None = None, start_timeout: float = START_TIMEOUT_S,
                 rpc: list[str] = (), tensor_split: list[float] = (), rpc_output: str = "local",
                 extra_args: tuple[str, ...] = (), n_parallel: int = 1):
        self.method = method
        self.port = free_port()
        self.args = server_args(method, binary, model_path, n_ctx, n_gpu_layers, threads, self.port, rpc,
                                tensor_split, rpc_output, n_parallel) + list(extra_args)
        self.log = tempfile.TemporaryFile(mode="w+", prefix="llama-server-", suffix=".log")
        try:
            self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=self.log,
                                         stderr=subprocess.STDOUT, env=env)
        except OSError as e:
            self.log.close()
            raise PeerError(f"{method}: cannot start {binary}: {e}") from None
        try:
            self._wait_ready(start_timeout)
        except BaseException:
            self.close()
            raise

    def _url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _last_log_line(self) -> str:
        self.log.flush()
        self.log.seek(0)
        lines = [x.strip() for x in self.log.read().splitlines() if x.strip()]
        errors = [x for x in lines if "error" in x.lower()]
        return (errors or lines or ["no output"])[-1][:300]

    def _wait_ready(self, timeout: float) -> None:
        """Until GET /health answers 200 (503 while the model loads)."""
        t_end = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise PeerError(f"{self.method}: llama-server exited with code {code} before it was ready: "
                                f"{self._last_log_line()}")
            try:
                with urllib.request.urlopen(self._url("/health"), timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > t_end:
                raise PeerError(f"{self.method}: llama-server did not become ready in {timeout:.0f} s: "
                                f"{self._last_log_line()}")
            time.sleep(0.2)

    def run(self, prompt_tokens, max_tokens: int, grammar: str | None = None, json_schema=None) -> dict:
        body = json.dumps(completion_request(prompt_tokens, max_tokens, grammar, json_schema)).encode()
        req = urllib.request.Request(self._url("/completion"), data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
                resp = json.loads(r.read())
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode("utf-8", "replace")
            raise PeerError(f"{self.method}: llama-server answered HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise PeerError(f"{self.method}: no answer from llama-server ({e}): {self._last_log_line()}") from None
        return parse_completion(resp, len(prompt_tokens))

    def close(self) -> None:
        stop_process(self.proc, 10)
        self.log.close()


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """Terminate a server we started, killing it after grace_s seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:  # pragma: no cover - best effort
            proc.kill()
            proc.wait(5)


def server_env() -> dict:
    """The environment llama-server runs in: the one the user gave (edgespec
    sets one of llama.cpp's switches for its own process, see
    backend.process.TILED_MM_ENV)."""
    from edgespec.backend.process import TILED_MM_ENV, USER_TILED_MM

    env = dict(os.environ)
    env.pop(TILED_MM_ENV, None)
    if USER_TILED_MM is not None:
        env[TILED_MM_ENV] = USER_TILED_MM
    return env
