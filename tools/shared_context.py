#!/usr/bin/env python3
"""Can several requests share one llama.cpp context exactly?  (issue 62, docs/scheduler.md "Exactness")

    python tools/shared_context.py                    # exact kernels (the default loadout)
    python tools/shared_context.py --kernels fast     # run it in its own process: the tiled product is per process

Request A's greedy decode alone (one token per llama_decode, seq 0, an empty
cache) is the reference; every scenario then decodes A again beside other
requests in the same context, each in KV sequences of its own, and compares
A's logits row by row, bit for bit (B's and C's too where they have a
reference of their own):

  interleaved    B's prompt first (its cells below A's), then A's; one decode for B, one for A, per step
  b-drafts       as interleaved, but B decodes a 4-token chain each step and keeps 1 (holes in the cache)
  cancelled      as b-drafts; B is dropped a third of the way in, and C's prompt is prefilled in
                 16-token chunks between A's steps, then C decodes (drafting like B)
  batched        A's and B's next tokens as two rows of ONE llama_decode (different seqs and positions)
  trees          A's next token and B's 4-token chain in one decode, B keeping 1
  both-trees     A's and B's 4-token chains in one decode (A's rows first), each keeping 1
  compact        both-trees, with the cache compacted halfway (every live sequence saved, the cache
                 cleared, the sequences restored)
  batched-chunk  A's next token and the next 16-token chunk of C's prompt in one decode, then A and C
  batched-prompt A's next token and C's whole prompt in one decode, then A and C

--tomb frees a request's cells (rejected drafts, a cancelled request) into a
tombstone sequence nobody attends instead of removing them, so that no later
cell of another request lands in their holes.

It prints, per scenario and request, the steps whose logits differ from the
reference, the largest |difference| and whether the greedy tokens are the same.
C's prompt goes in 16-token chunks in "cancelled" and "batched-chunk": its
reference there is C alone prefilled in the same chunks.
A diagnostic, not a timing (a couple of minutes of CPU at most on 2 threads);
it drives LlamaBackend's batch arrays directly, as a scheduler would.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from edgespec.backend import llama as B  # noqa: E402
from edgespec.backend.settings import Loadout  # noqa: E402

MODEL = os.path.join(os.environ.get("EDGESPEC_MODELS_DIR", "/work/models"), "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
PROMPTS = {
    "A": "Write a Python function that parses an ISO 8601 date string and returns a datetime object. "
         "Handle time zones, fractional seconds and the 'Z' suffix. Explain every step briefly.",
    "B": "Give this conversation a short title: the user asked how to sort a list of dicts by a key in Python.",
    "C": "Suggest three follow-up questions the user might ask next about sorting in Python, as a JSON list "
         "of strings, one question per line, and nothing else. The conversation so far was about sorted(), "
         "key functions, operator.itemgetter, stability of the sort and reverse=True. Keep each question short.",
}
PROMPTS["D"] = " ".join([PROMPTS["C"]] * 4)        # a prompt past the exact batch width
STEPS = 20
CHUNK = 16
WIDE = 100                                          # a prompt chunk past EXACT_MAX_BATCH
JUNK = np.array([1000, 2000, 3000], np.int32)   # rejected draft tokens of a 4-token chain
TOMB = 7                                        # the tombstone sequence of --tomb (n_seq_max is 8)


class Req:
    """One request's state in the shared context: its seq id, next position, next token, logits rows."""

    def __init__(self, name: str, tokens: np.ndarray, seq: int):
        self.name, self.prompt, self.seq = name, tokens, seq
        self.pos, self.fed = 0, 0            # next position; prompt tokens fed so far
        self.next: int | None = None
        self.rows: list[np.ndarray] = []

    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)


def decode(be, rows):
    """rows: (token, pos, seq, wants_logits); one llama_decode; the logits rows asked for, copied."""
    for i, (t, p, s, lg) in enumerate(rows):
        be._tok[i], be._pos[i], be._nseq[i], be._logits[i] = t, p, 1, int(lg)
        be._seq[i, 0] = s
    be._decode(len(rows))
    be.n_outputs = sum(1 for r in rows if r[3])
    return be.logits().copy()


def chunk_rows(r: Req, n: int):
    """The next n prompt tokens of r as rows (logits at the prompt's last token only)."""
    toks = r.prompt[r.fed:r.fed + n]
    rows = [(int(t), r.pos + i, r.seq, r.fed + i == len(r.prompt) - 1) for i, t in enumerate(toks)]
    r.fed += len(toks)
    r.pos += len(toks)
    return rows


def take(r: Req, row: np.ndarray) -> None:
    r.rows.append(row)
    r.next = int(np.argmax(row))


def token_rows(r: Req, extra=()):
    """r's next token (and `extra` draft tokens after it) as rows, every row with logits."""
    toks = [r.next, *extra]
    return [(int(t), r.pos + i, r.seq, True) for i, t in enumerate(toks)]


def finish(be, r: Req, n_rows: int) -> None:
    """After r's rows of a step decoded: commit its first row, drop its other (draft) cells."""
    r.pos += 1
    if n_rows > 1:
        drop(be, r.seq, r.pos)


def drop(be, seq: int, p0: int) -> None:
    """Free seq's cells from position p0 on (-1: all): removed, or with --tomb kept in the
    tombstone sequence (occupied, attended by nobody) so that no later cell fills their holes."""
    if be.tomb:
        B.L.llama_memory_seq_cp(be.mem, seq, TOMB, p0, -1)
    B.L.llama_memory_seq_rm(be.mem, seq, p0, -1)


def compact(be, seqs) -> None:
    """Save every live sequence, clear the cache (tombstones and holes), restore them: each
    sequence's cells land contiguous, in position order (backend/seqstate.py does this for seq 0)."""
    import ctypes
    saved = []
    for s in seqs:
        n = int(B.L.llama_state_seq_get_size(be.ctx, s))
        buf = np.empty(n, np.uint8)
        n = int(B.L.llama_state_seq_get_data(be.ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), n, s))
        saved.append((s, buf[:n]))
    B.L.llama_memory_clear(be.mem, True)
    for s, buf in saved:
        ok = B.L.llama_state_seq_set_data(be.ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), buf.nbytes, s)
        assert ok, f"seq {s} not restored"


def step(be, groups):
    """One decode of several requests' rows: groups = [(req, rows)]; returns each group's logits."""
    flat = [row for _, rows in groups for row in rows]
    lg = decode(be, flat)
    out, i = [], 0
    for _, rows in groups:
        k = sum(1 for row in rows if row[3])
        out.append(lg[i:i + k])
        i += k
    return out


def alone(be, name, tokens, chunk=None):
    """r decoded alone from an empty cache: its prompt in chunks of `chunk` (None: one batch), then STEPS tokens."""
    be.reset()
    r = Req(name, tokens, 0)
    while r.prefilling():
        lg = step(be, [(r, chunk_rows(r, chunk or len(tokens)))])[0]
    take(r, lg[-1])
    for _ in range(STEPS):
        take(r, step(be, [(r, token_rows(r))])[0][0])
        finish(be, r, 1)
    return r


def feed(be, r: Req, rows_fn=None, extra=()):
    """One decode of r alone: its next prompt chunk, or its next token (+ extra)."""
    if r.prefilling():
        lg = step(be, [(r, chunk_rows(r, CHUNK))])[0]
        if not r.prefilling():
            take(r, lg[-1])
        return
    rows = token_rows(r, extra)
    lg = step(be, [(r, rows)])[0]
    take(r, lg[0])
    finish(be, r, len(rows))


def prefill_all(be, *reqs):
    for r in reqs:
        take(r, step(be, [(r, chunk_rows(r, len(r.prompt)))])[0][-1])


def interleaved(be, name, a, b, c):
    """Separate decodes per request; B drafts (a 4-chain, keeps 1) unless plain; cancelled: B is
    dropped a third of the way in and C's prompt fills its place."""
    prefill_all(be, b, a)
    live = [b, a]
    for i in range(STEPS):
        if name == "cancelled" and i == STEPS // 3:
            drop(be, b.seq, -1)
            live = [c, a]
        for r in live:
            extra = JUNK if (r is b and name != "interleaved") or (r is c and not r.prefilling()) else ()
            feed(be, r, extra=extra)


def batched(be, name, a, b, c):
    """A's and B's rows in one decode per step (trees: B's 4-chain; both-trees: A's too, A first,
    so A's rejected cells lie below B's kept ones); compact: both-trees, compacted halfway."""
    prefill_all(be, b, a)
    for i in range(STEPS):
        if name == "compact" and i == STEPS // 2:
            compact(be, (a.seq, b.seq))
        both = name in ("both-trees", "compact")
        ga, gb = token_rows(a, JUNK if both else ()), token_rows(b, JUNK if name != "batched" else ())
        la, lb = step(be, [(a, ga), (b, gb)])
        take(a, la[0]), take(b, lb[0])
        finish(be, a, len(ga)), finish(be, b, len(gb))


def with_prompt(be, name, a, c):
    """A's next token and C's next prompt chunk (16 tokens, WIDE, or all of it) in one decode, then both
    decoding (wide-chunk: C's prompt is D's, 200+ tokens)."""
    prefill_all(be, a)
    for _ in range(STEPS):
        n = {"batched-chunk": CHUNK, "wide-chunk": WIDE}.get(name, len(c.prompt))
        cg = chunk_rows(c, n) if c.prefilling() else token_rows(c)
        la, lc = step(be, [(a, token_rows(a)), (c, cg)])
        take(a, la[0]), finish(be, a, 1)
        if cg[0][1] + len(cg) <= len(c.prompt):         # a prompt chunk
            if not c.prefilling():
                take(c, lc[-1])
        else:
            take(c, lc[0]), finish(be, c, 1)


SCENARIOS = ("interleaved", "b-drafts", "cancelled", "batched", "trees", "both-trees", "compact",
             "batched-chunk", "batched-prompt", "wide-chunk", "chunkings")


def scenario(be, name, toks):
    be.reset()
    a, b, c = Req("A", toks["A"], 0), Req("B", toks["B"], 1), Req("C", toks["C"], 2)
    if name == "chunkings":
        return {}
    if name == "wide-chunk":
        c = Req("D", toks["D"], 2)
    if name in ("interleaved", "b-drafts", "cancelled"):
        interleaved(be, name, a, b, c)
    elif name in ("batched-chunk", "batched-prompt", "wide-chunk"):
        with_prompt(be, name, a, c)
    else:
        batched(be, name, a, b, c)
    return {"A": a, "B": b, "C": c}


def compare(got: Req, ref: Req) -> str:
    n = len(got.rows)
    if n == 0:
        return "no rows"
    diffs = [float(np.max(np.abs(g - r))) for g, r in zip(got.rows, ref.rows)]
    bad = [i for i, d in enumerate(diffs) if d != 0.0]
    same = [int(np.argmax(g)) for g in got.rows] == [int(np.argmax(r)) for r in ref.rows[:n]]
    return (f"{n:2d} rows, {len(bad):2d} differ (first at step {bad[0] if bad else '-'}), "
            f"max |diff| {max(diffs):.3g}, greedy tokens {'same' if same else 'DIFFERENT'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", choices=("exact", "fast"), default="exact")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--tomb", action="store_true", help="free cells into a tombstone sequence, not out of the cache")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    a = ap.parse_args(argv)
    load = Loadout.resolve(a.kernels, a.threads)
    be = B.LlamaBackend(a.model, n_ctx=1024, n_threads=a.threads, max_nodes=64, max_leaves=8, load=load)
    be.tomb = a.tomb
    print(f"loadout: kernels={load.kernels} flash_attn={be.flash_attn} cache_type_k={be.cache_type_k} "
          f"exact={be.exact} threads={be.n_threads} n_seq_max={max(1, be.max_leaves)} kv_unified=True "
          f"freed cells: {'tombstoned' if a.tomb else 'removed'}")
    toks = {k: be.vocab.tokenize(v) for k, v in PROMPTS.items()}
    print("prompt tokens: " + ", ".join(f"{k} {len(t)}" for k, t in toks.items()))
    refs: dict = {}

    def ref(k):         # computed when first needed: "D64" is D alone, its prompt in 64-token chunks
        if k not in refs:
            name, chunk = k[0], int(k[1:]) if len(k) > 1 else None
            refs[k] = alone(be, name, toks[name], chunk)
        return refs[k]
    for name in a.scenarios.split(","):
        if name == "chunkings":     # one request alone, its prompt chunked in several ways
            for k in ("C16", "D16", "D48", "D64", f"D{WIDE}"):
                print(f"{k[0]} alone, prompt in {k[1:]}-token chunks vs one batch: {compare(ref(k), ref(k[0]))}")
            continue
        got = scenario(be, name, toks)
        for k, r in got.items():
            if r.rows and not (k == "B" and name == "cancelled"):
                chunked = {"cancelled": "C16", "batched-chunk": "C16", "wide-chunk": f"D{WIDE}"}
                print(f"{name:14s} {r.name}: {compare(r, ref(chunked.get(name) if k == 'C' else k))}")
    be.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
