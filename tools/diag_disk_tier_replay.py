"""Diagnostic kept for the record (issue 56, 2026-11-28): does the prompt
cache's disk tier or a fresh cache folder slow an app session?

    python tools/diag_disk_tier_replay.py OUT SESSIONS VARIANTS

SESSIONS: trace names in benchmarks/sessions, comma-separated; VARIANTS: NAME or
NAME:SERVE OPTIONS, comma-separated, run in order.  A NAME starting with A
starts on an empty cache folder, replays, waits for its background
calibration and leaves that folder's calibration to the variants after it;
F starts on an empty folder; any other on a copy of what A left.  Each
variant is `edgespec serve` started alone (Qwen2.5-Coder-0.5B from the model
folder, -c 8192 -t 2), the sessions replayed as `bench-sessions` replays
them; a variant line, then its rows, appended to OUT.  Its run of
2026-11-28 is benchmarks/results/xeon-2026-11-28-qwen05-disk-tier-diagnostic.jsonl
(BENCHMARKS.md).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from edgespec.bench.peer_server import free_port, stop_process  # noqa: E402
from edgespec.bench.session_targets import calibration_ended  # noqa: E402
from edgespec.bench.sessions import Client, load_session, replay  # noqa: E402
from edgespec.errors import PeerError  # noqa: E402
from edgespec.models.zoo import models_dir  # noqa: E402

MODEL = os.path.join(models_dir(), "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK = tempfile.mkdtemp(prefix="diag-disk-tier-")     # cache folders and serve logs
SESS: list = []
OUT = ""


def serve(name: str, cache: str, extra: list[str], wait_calib: bool = False) -> None:
    port = free_port()
    args = [sys.executable, "-m", "edgespec", "serve", MODEL, "--port", str(port), "-c", "8192", "-t", "2", *extra]
    t0 = time.monotonic()
    with open(f"{WORK}/{name}.log", "w") as log:
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=WORK,
                             env=dict(os.environ, EDGESPEC_CACHE_DIR=cache))
    c = Client(f"http://127.0.0.1:{port}")
    while True:
        try:
            c.get("/health")
            break
        except PeerError:
            time.sleep(0.3)
    start = time.monotonic() - t0
    rows = replay(c, name, SESS, 256)
    info = {"start_s": round(start, 2), "health": c.get("/health")}
    if wait_calib:
        info["calibrated_after_s"] = calibration_ended(c)
    stop_process(p, 60)
    with open(OUT, "a") as f:
        f.write(json.dumps({"kind": "variant", "name": name, "args": args, "cache": cache, **info}) + "\n")
        for r in rows:
            f.write(json.dumps(r) + "\n")
    ss = [r for r in rows if r["kind"] == "session"]
    print(name, "start", round(start, 1), "wall", round(sum(r["wall_s"] for r in ss), 1),
          "prefill", round(sum(r["prefill_ms"] for r in ss) / 1e3, 1),
          "decode", [round(r["decode_tok_s"], 1) for r in ss], flush=True)


def main() -> None:
    global SESS, OUT
    OUT = sys.argv[1]
    SESS = [load_session(os.path.join(REPO, "benchmarks", "sessions", f"{n}.jsonl")) for n in sys.argv[2].split(",")]
    for v in sys.argv[3].split(","):
        name, _, opts = v.partition(":")
        d = f"{WORK}/cache-{name}"
        shutil.rmtree(d, ignore_errors=True)
        if name.startswith(("A", "F")):
            os.makedirs(d)
        else:
            shutil.copytree(f"{WORK}/calibrated", d)
        serve(name, d, opts.split(), wait_calib=name.startswith("A"))
        if name.startswith("A"):
            shutil.rmtree(f"{WORK}/calibrated", ignore_errors=True)
            shutil.copytree(d, f"{WORK}/calibrated", ignore=shutil.ignore_patterns("prompts"))


if __name__ == "__main__":
    main()
