"""The speed guard: drafting may not make a request slower than plain decoding.

The gate drafts when its estimates say drafting pays; estimates can be wrong
(acceptance learned on other text, a cost the machine no longer has).  The
guard keeps an account, in plain steps, of what drafting has gained: each
step adds the tokens it committed and subtracts its whole time (drafting,
the decode, verification) over the seconds a plain step takes here (learned,
core/stepcost.py).  While the balance stays above -(SLACK + EPS x the
request's tokens), the gate works as usual; below it the engine runs plain
steps, drafting nothing (the drafter is not even asked), until the request's
tokens have earned back room for one more try, or until drafting is seen to
pay again: while blocked, the drafter still proposes and the gate still
chooses (a probe, one at a time), nothing of it is verified, and once the
committed tokens decide how much of the chosen subtree the model would have
accepted, what that step would have gained is booked (one that would have
lost cost nothing, and books nothing).  Probes never cost a decode; their
credit counts at most CREDIT plain steps a request.

Worst case, per request: the time of plain decoding plus SLACK plain steps
(plus CREDIT, what the probes may credit), plus EPS of the answer's plain time
(which also pays for the proposals of the probes), plus the one step during
which the balance crosses the limit (whose width the learned costs' ramp bounds on a
fresh engine: StepCosts.widest_allowed).  The account carries half its final
balance, within -SLACK/2 and +SLACK, into the next request: a request after
a loss starts on a shorter leash, one after gains with some room.
"""
from __future__ import annotations

SLACK = 2.0       # plain steps a request may lose before drafting stops
EPS = 0.01        # and this fraction of the request's plain time
CARRY = 0.5       # the share of a request's final balance carried into the next
CREDIT = 4 * SLACK  # the most the probes may credit a request


class SpeedGuard:
    """One engine's account (see the module doc); in plain steps."""

    def __init__(self):
        self.balance = 0.0
        self.tokens = 0
        self.blocked_steps = 0
        self.credit = 0.0         # the probes' credit this request
        self.probe: tuple | None = None    # (root, tokens, parents, cost): the probe being judged
        self.probe_end = 0        # the context index where the next probe may start

    def begin(self) -> None:
        """A request starts: carry part of the last request's balance."""
        self.balance = max(-SLACK / 2, min(SLACK, CARRY * self.balance))
        self.tokens = 0
        self.blocked_steps = 0
        self.credit = 0.0
        self.probe, self.probe_end = None, 0

    def probing(self, root: int) -> bool:
        """Whether a probe may start at context index `root` (the pending token)."""
        return self.probe is None and root >= self.probe_end

    def start_probe(self, root: int, tokens, parents, cost: float) -> None:
        """The subtree the gate chose at `root` while drafting was blocked:
        tokens and parents (-1: the root) of its nodes, and what verifying it
        would have cost, in plain steps."""
        self.probe = (root, [int(t) for t in tokens], [int(p) for p in parents], cost)

    def judge(self, ctx, n: int) -> None:
        """Book the probe once the committed tokens ctx[:n] decide it: the
        step would have committed its accepted path and the bonus token
        (a + 1 tokens, a + 1 plain steps) for its cost."""
        if self.probe is None:
            return
        root, tokens, parents, cost = self.probe
        node, a = -1, 0
        while True:
            if root + 1 + a >= n:
                return                  # not decided yet
            want = int(ctx[root + 1 + a])
            nxt = next((i for i, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == want), -1)
            if nxt < 0:
                break
            node, a = nxt, a + 1
        gain = max(0.0, min(a + 1 - cost, CREDIT - self.credit))     # a probe that would have lost cost nothing
        self.credit += gain
        self.balance += gain
        self.probe, self.probe_end = None, root + a + 1

    def allows(self) -> bool:
        """Whether this step may draft."""
        ok = self.balance >= -(SLACK + EPS * self.tokens)
        if not ok:
            self.blocked_steps += 1
        return ok

    def account(self, step_s: float, n_committed: int, plain_s: float) -> None:
        """A step took step_s seconds and committed n_committed tokens; a
        plain step takes plain_s seconds."""
        if plain_s > 0:
            self.balance += n_committed - step_s / plain_s
        self.tokens += n_committed
