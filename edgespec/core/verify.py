"""Acceptance rules over logits.

Greedy: the target token at a node is argmax of the model's logits there (ties go
to the lowest token id, as numpy's argmax does); a draft child is accepted when it
carries that token.  Because the committed tokens are exactly the model's argmax
chain, greedy output is token-identical to plain decoding whenever the logits
are (the engine makes sure they are: see engine.py on KV cell order).

Sampling: at every position on the accepted path the engine draws ONE uniform
number u from the request's generator and turns it into a token with
`sample_token(logits, cfg, u)`, exactly as plain decoding would at that
position; it then descends to the draft child that carries the drawn token, if
any.  Each committed token is therefore drawn from the model's own distribution
with the same u that plain decoding would use for that position, so the output
distribution is exact, and with a fixed seed the text is even the same as plain
sampling's, given equal logits.

The sampling distribution is defined here once, for plain and speculative
decoding alike: temperature first, then top-k, top-p (nucleus) and min-p, each
over the tempered probabilities, then renormalise.

VerifyConfig names the verification mode; the lossy modes' rules (ReSpec's
relaxed verification, AASD's conditional verification, edgespec's
entropy_inv) live in core/relaxed.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgespec.errors import ConfigError


@dataclass
class SamplingConfig:
    """How the next token is chosen.

    temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / T).
    top_k: keep the k most likely tokens (0 = no limit).
    top_p: keep the smallest set of most likely tokens whose probability sums to
        at least top_p (1.0 = off).
    min_p: drop tokens whose probability is below min_p times the top token's
        (0.0 = off).
    seed: seed of the request's random generator (None = fresh entropy).
    """
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None

    def __post_init__(self):
        if not (self.temperature >= 0):
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p < 1.0):
            raise ConfigError(f"min_p must be in [0, 1), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def sampling_distribution(logits: np.ndarray, cfg: SamplingConfig):
    """Return (token_ids, probs): the candidates in descending probability
    (ties by ascending id) and their renormalised probabilities (float64)."""
    x = np.asarray(logits, dtype=np.float64) / cfg.temperature
    n = x.shape[0]
    if 0 < cfg.top_k < n:
        cand = np.argpartition(-x, cfg.top_k - 1)[: cfg.top_k]
    else:
        cand = np.arange(n)
    # descending value, ties by ascending token id: deterministic order
    order = np.lexsort((cand, -x[cand]))
    cand = cand[order]
    v = x[cand]
    p = np.exp(v - v[0])
    p /= p.sum()
    keep = len(p)
    if cfg.top_p < 1.0:
        c = np.cumsum(p)
        keep = min(keep, int(np.searchsorted(c, cfg.top_p, side="left")) + 1)
    if cfg.min_p > 0.0:
        keep = min(keep, int(np.count_nonzero(p >= cfg.min_p * p[0])))
    keep = max(keep, 1)
    cand, p = cand[:keep], p[:keep]
    return cand, p / p.sum()


def sample_token(logits: np.ndarray, cfg: SamplingConfig, u: float) -> int:
    """The token that plain decoding draws at this position with uniform u in [0, 1)."""
    if cfg.greedy:
        return int(np.argmax(logits))
    cand, p = sampling_distribution(logits, cfg)
    c = np.cumsum(p)
    i = int(np.searchsorted(c, u * c[-1], side="right"))
    return int(cand[min(i, len(cand) - 1)])


# ----------------------------------------------------------------------------
# Relaxed verification: LOSSY, opt-in.  The output is no longer what plain
# decoding gives; `edgespec bench` reports how far it moves (identical outputs,
# ROUGE-L against `none`) beside the speed.

VERIFY_MODES = ("exact", "relaxed", "entropy", "entropy_inv")


@dataclass
class VerifyConfig:
    """How draft tokens are accepted.

    mode "exact" (default): a draft token is accepted only when it is the token
        the model itself chooses (lossless).
    mode "relaxed" (ReSpec's source-aware relaxed verification with look-ahead
        tolerance, lossy): a draft token found by *retrieval* (a context or
        corpus match, never a tri-gram, adjacency or branch guess) passes the
        relaxed check where the model ranks it in its top `top_k` with a
        log-probability within `tau` of the best (ReSpec eqs. 6-7); model-drafted
        tokens are verified strictly.  Along each candidate (root-to-leaf path of
        the verified tree): after the greedy-matched prefix, up to `phi` relaxed
        attempts, each at position `current`: a failed check ends the walk; a
        passed one followed by xi >= `lookahead` (m) greedy matches extends the
        accepted length past them and the next attempt is at the position after;
        one followed by fewer moves the next attempt to the next position, the
        token kept only if a later attempt's look-ahead succeeds (a chain).  The
        longest accepted candidate wins (relaxed_path).
    mode "entropy" (AASD's conditional verification, lossy): a draft token passes
        when its probability is at least the adaptive threshold
        delta = min(alpha * H + beta, max P), H being the entropy (nats) of the
        model's full distribution there and max P its top probability (so the
        model's own choice always passes): the more uncertain the model, the
        *higher* the bar.  Only prompt-retrieved tokens (SOURCE_PROMPT:
        `auto+aasd` marks context matches copied from the prompt) and
        alignment-sampled ones (SOURCE_ALIGN) are verified this way, the others
        strictly; the longest candidate whose tokens all pass is accepted.  No
        look-ahead and no cap.
    mode "entropy_inv" (edgespec's earlier variant, lossy): greedy first; where
        no child carries the model's token, the retrieved child with
        probability at least eps * exp(-H) (the bar *falls* with entropy) whose
        subtree continues with `lookahead` greedy matches, at most
        `max_relaxed` such tokens a step (0 = no cap).  Kept for comparison.
    Values: alpha 0.1 and beta 0.1 are AASD's (its LLaMA3.1 setting).  ReSpec
    gives no value for TopK's k, tau, m or Phi; it recommends tau <= 3 and
    m <= 3: top_k 5, tau 1.5, lookahead 2 and phi 2 are edgespec's choices.
    All relaxed modes apply to greedy decoding only.
    """
    mode: str = "exact"
    top_k: int = 5
    tau: float = 1.5
    lookahead: int | None = None
    eps: float = 0.3
    alpha: float = 0.1
    beta: float = 0.1
    phi: int = 2
    max_relaxed: int = 2

    def __post_init__(self):
        if self.mode not in VERIFY_MODES:
            raise ConfigError(f"verify mode must be one of {', '.join(VERIFY_MODES)}, got {self.mode!r}")
        if self.top_k < 1:
            raise ConfigError("verify top_k must be >= 1")
        if not self.tau >= 0:
            raise ConfigError("verify tau must be >= 0")
        if self.lookahead is None:          # AASD's rule has no look-ahead, the others 2 tokens
            self.lookahead = 0 if self.mode == "entropy" else 2
        if self.lookahead < 0:
            raise ConfigError("verify lookahead must be >= 0")
        if not (0.0 < self.eps <= 1.0):
            raise ConfigError("verify eps must be in (0, 1]")
        if not (self.alpha >= 0 and 0.0 <= self.beta <= 1.0):
            raise ConfigError("verify alpha must be >= 0 and beta in [0, 1]")
        if self.phi < 0:
            raise ConfigError("verify phi must be >= 0 (relaxed attempts a step)")
        if self.max_relaxed < 0:
            raise ConfigError("verify max_relaxed must be >= 0 (0 = no cap)")

    @property
    def exact(self) -> bool:
        return self.mode == "exact"

    @property
    def n_lookahead(self) -> int:
        """lookahead as __post_init__ resolved it (never None after it)."""
        assert self.lookahead is not None
        return self.lookahead

    @property
    def relax_sources(self) -> tuple:
        """The draft sources a relaxed rule may accept."""
        from edgespec.drafters.tree import sources_with
        return sources_with("aligned" if self.mode == "entropy" else "retrieved")


def rouge_l(a, b) -> float:
    """ROUGE-L F-measure of two token sequences (longest common subsequence)."""
    a, b = list(a), list(b)
    if not a or not b:
        return 1.0 if a == b else 0.0
    if a == b:
        return 1.0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(b), lcs / len(a)
    return 2 * p * r / (p + r)
