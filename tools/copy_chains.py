"""Which features of a `suffix` proposal tell, before verifying, how long the copy will run?

    python tools/copy_chains.py RESULTS.jsonl --prompts ../shared/data/spec_bench_dev.jsonl \
        [--category summarization --category rag] [--corpus FILE]

On a CPU where a batch of 2 costs nearly two one-token steps, a draft pays only
when a long chain of it is accepted, so a gate is as good as its guess of the
chain length.  This study walks every position of the recorded greedy answers
(the `none` rows of an `edgespec bench` results file), asks the suffix drafter
for its proposal there, and records the length g of its likeliest path that the
answer follows, beside features known at drafting time: the drafter's score of
the first node (what the engine's gate buckets by), the match length, how many
of the answer's preceding positions the drafter had predicted (the copy run so
far), whether the match lies in the prompt or the answer, and how often the last
token and the last two tokens occur in the context.

For each feature set it then fits, per feature group, the verify depth k that
maximises expected tokens per unit of c(T) (1 + E[min(g, k)] over c(k + 1), a
plain step if nothing beats 1) on half of the prompts, and walks the other half
step by step (a step at position i commits min(g, k) + 1 tokens), both ways
round; "in-sample" fits and walks all prompts.  "hindsight" verifies exactly g
tokens whenever that pays: the ceiling of any estimate.  Time is modelled with
the results file's calibrated c(T) at each position's context length, plain
steps as 1, the engine's own work per step left out; the printed figure is
plain steps' time over the walk's, i.e. a modelled speedup over `none`.
"""
from __future__ import annotations

import argparse
import collections
import sys

import numpy as np

from edgespec.app.api import SpecModel
from edgespec.bench.prompts import load_prompts
from edgespec.bench.results import read_results
from edgespec.calibration.curve import CostCurve
from edgespec.drafters import make_drafter
from edgespec.core.gate import CostBuckets, cost_table_at
from edgespec.kernels import suffix as _k

MAX_K = 12


def _bucket(x: int, edges) -> int:
    return int(np.searchsorted(edges, x, side="left"))


FEATURES = {
    # name: key of a position's group, from its feature dict
    "score (the gate's buckets)": lambda f: (f["score_b"],),
    "score + copy run so far": lambda f: (f["score_b"], _bucket(f["run"], [0, 2, 5])),
    "score + match in prompt/answer": lambda f: (f["score_b"], f["in_prompt"]),
    "match length": lambda f: (_bucket(f["L"], [2, 3, 4, 5, 6, 8, 12, 20]),),
    "match length + copy run": lambda f: (_bucket(f["L"], [2, 3, 4, 5, 6, 8, 12, 20]), _bucket(f["run"], [0, 2, 5])),
    "score + last token's count": lambda f: (f["score_b"], _bucket(f["n1"], [1, 2, 4, 10])),
    "score + last bigram's count": lambda f: (f["score_b"], _bucket(f["n2"], [1, 2, 4, 10])),
}


def positions(drafter, prompt: np.ndarray, answer: np.ndarray, budget: int) -> list[dict]:
    """One dict per answer position with a proposal: its features, g, and n_past.
    budget: the draft nodes the engine asks for (its max_nodes - 1); the match
    features use the drafter's own match settings."""
    truth = np.concatenate([prompt, answer])
    n0 = len(prompt)
    cfg = drafter.config
    ends = np.zeros(cfg.max_matches, np.int32)
    lens = np.zeros(cfg.max_matches, np.int32)
    out, run = [], 0
    for i in range(len(answer)):
        ctx = truth[:n0 + i]
        t = drafter.propose(ctx, budget)
        if len(t) == 0:
            out.append(None)
            run = 0
            continue
        # the likeliest path, and how far the answer follows it
        par, g, p0, depth, following = -1, 0, 0.0, 0, True
        while True:
            ch = np.nonzero(t.parents == par)[0]
            if len(ch) == 0:
                break
            c = int(ch[np.argmax(t.probs[ch])])
            if par == -1:
                p0 = float(t.probs[c])
            following = following and n0 + i + depth < len(truth) and t.tokens[c] == truth[n0 + i + depth]
            g += following
            depth += 1
            par = c
        k = _k.find_suffix_matches(ctx, len(ctx), cfg.min_match, cfg.max_match, cfg.max_matches, ends, lens)
        out.append({"g": g, "depth": depth, "n_past": len(ctx) - 1,
                    "score_b": min(int(p0 * 10), 9), "run": run,
                    "L": int(lens[0]) if k else 0, "in_prompt": int(k > 0 and ends[0] < n0),
                    "n1": int((ctx == ctx[-1]).sum()),
                    "n2": int(((ctx[1:] == ctx[-1]) & (ctx[:-1] == ctx[-2])).sum())})
        run = run + 1 if g else 0
    return out


def walk(pos: list, choose, cost_at) -> tuple[float, float]:
    """(plain time, walk time) of one answer, in plain-step units."""
    i, t = 0, 0.0
    while i < len(pos):
        f = pos[i]
        k = min(choose(f), f["depth"]) if f is not None else 0
        if k == 0:
            t += 1.0
            i += 1
        else:
            t += cost_at(f["n_past"])[k + 1]
            i += min(f["g"], k) + 1
    return float(len(pos)), t


def fit(answers: list, key, cost_at):
    """Per group: the k maximising (1 + E[min(g, k)]) / c(k + 1), 0 if no k beats a plain step."""
    hist = collections.defaultdict(lambda: np.zeros(MAX_K + 1))
    costs = collections.defaultdict(lambda: np.zeros(MAX_K + 2))
    for pos in answers:
        for f in pos:
            if f is None:
                continue
            h = hist[key(f)]
            h[0] += 1
            h[1:min(f["g"], MAX_K) + 1] += 1
            costs[key(f)] += cost_at(f["n_past"])[:MAX_K + 2]
    best = {}
    for kk, h in hist.items():
        c = costs[kk] / h[0]                     # mean c(T) over the group's contexts
        p = h[1:] / h[0]                         # P(g >= j), j = 1..MAX_K
        gains = 1.0 + np.cumsum(p)
        rates = gains / c[2:MAX_K + 2]
        j = int(np.argmax(rates))
        best[kk] = j + 1 if rates[j] > 1.0 else 0
    return lambda f: best.get(key(f), 0)


def speedup(answers: list, choose, cost_at) -> float:
    plain = total = 0.0
    for pos in answers:
        a, b = walk(pos, choose, cost_at)
        plain += a
        total += b
    return plain / total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--category", action="append", default=[])
    ap.add_argument("--corpus", action="append", default=[])
    a = ap.parse_args(argv)

    head, rows = read_results(a.results)
    if head is None or not head.get("cost_curve"):
        sys.exit("the results file has no header with a cost curve (run `edgespec bench` to make one)")
    cost = CostCurve.from_json(head["cost_curve"])
    buckets = CostBuckets(cost, MAX_K + 2)
    short = cost.table(MAX_K + 2, short=True)

    def cost_at(n_past: int) -> np.ndarray:
        return cost_table_at(n_past, short, buckets)[0]

    none = {r["question_id"]: r for r in rows if r.get("kind", "result") == "result" and r["method"] == "none"}
    prompts = [p for p in load_prompts(a.prompts, categories=a.category or None) if p.question_id in none]
    if not prompts:
        sys.exit("no prompt of the prompts file has a `none` row in the results file")
    m = SpecModel(head.get("model"), drafter="none", n_ctx=int(head["n_ctx"]), calibrate=False, corpora=a.corpus)
    d = make_drafter("suffix", n_vocab=m.vocab.n_vocab, model_path=m.model_path, corpora=m.corpora)
    d.warmup()
    answers, cats = [], []
    for p in prompts:
        prompt = m.prompt_tokens([{"role": "user", "content": p.turn}])
        answers.append(positions(d, prompt, np.asarray(none[p.question_id]["tokens"], np.int32),
                                 int(head["max_nodes"]) - 1))
        cats.append(p.category)
    m.close()

    n_pos = sum(len(x) for x in answers)
    n_prop = sum(f is not None for x in answers for f in x)
    print(f"{len(answers)} answers, {n_pos} positions, {n_prop} with a proposal")
    for c in sorted(set(cats)):
        sel = [x for x, cc in zip(answers, cats) if cc == c]
        print(f"hindsight ({c}): {speedup(sel, lambda f: f['g'], cost_at):.3f}x")
    print(f"hindsight (all): {speedup(answers, lambda f: f['g'], cost_at):.3f}x")
    halves = (answers[0::2], answers[1::2])
    print(f"\n{'feature set':<32} {'fit A, walk B':>13} {'fit B, walk A':>13} {'in-sample':>10}")
    for name, key in FEATURES.items():
        ab = speedup(halves[1], fit(halves[0], key, cost_at), cost_at)
        ba = speedup(halves[0], fit(halves[1], key, cost_at), cost_at)
        ins = speedup(answers, fit(answers, key, cost_at), cost_at)
        print(f"{name:<32} {ab:>12.3f}x {ba:>12.3f}x {ins:>9.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
