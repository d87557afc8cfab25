"""The cost model of adaptive drafting: how many tokens a draft of size k is expected to yield (the geometric
acceptance model and its tree form), and `Controller`, which sizes each round's draft from measured target
latencies t(q) and the acceptance it has seen, learning both as rounds go.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from eyas.speculate.decode import Round


def chain_yield(accepted: float, rejections: float, k: int) -> float:
    """Expected tokens of a chain of k (bonus included) when each is accepted with probability alpha given the
    ones before, alpha = accepted / (accepted + rejections): sum_{i=0..k} alpha^i."""
    alpha = accepted / (accepted + rejections)
    return float(sum(alpha ** i for i in range(k + 1)))


def _clipped(ratio: float) -> float:
    return min(max(ratio, 0.5), 2.0)


def _interp_weights(points: list[int], q: int) -> list[tuple[int, float]]:
    """The points linear interpolation at q (points[0] <= q <= points[-1]) reads, with their weights."""
    i = bisect.bisect_left(points, q)
    if points[i] == q:
        return [(q, 1.0)]
    lo, hi = points[i - 1], points[i]
    w = (q - lo) / (hi - lo)
    return [(lo, 1.0 - w), (hi, w)]


def decayed_counts(counts: tuple[float, float], accepted: int, depth: int, decay: float) -> tuple[float, float]:
    """(accepted, rejections) after one round that accepted `accepted` of its `depth` drafted tokens."""
    return decay * counts[0] + accepted, decay * counts[1] + (1 if accepted < depth else 0)


def union_yield(chains: list[tuple[tuple[float, float], int]]) -> float:
    """Expected tokens (bonus included) of a tree holding several chains under one root, chain c of k_c tokens
    accepted position by position with probability alpha_c, the chains taken as independent: a round reaches
    depth i unless every chain stops before it, P(reach i) = 1 - prod_c (1 - alpha_c^i) over chains with k_c >= i.
    With one chain this is chain_yield."""
    alphas = [(a / (a + r), k) for (a, r), k in chains]
    return 1.0 + sum(1.0 - math.prod(1.0 - al ** i for al, k in alphas if k >= i)
                     for i in range(1, max((k for _, k in alphas), default=0) + 1))


class Controller:
    """Chooses each round's draft size to maximise expected tokens per second (`choose`), learning as it goes.

    Chain of k tokens, each accepted with probability alpha given the ones before (geometric model):
        E[tokens](k) = sum_{i=0..k} alpha^i = (1 - alpha^(k+1)) / (1 - alpha)
        cost(k)      = t(k+1) + k * t_step            (t from measured target latencies, t_step the draft step)
    alpha = A / (A + R): A accepted tokens, R rounds ending in a rejection, both decayed by `decay` per drafted
    round, from a prior of one each. A tree has one size: E = the decayed mean of its rounds' a + 1.
    Plain decoding (k = 0: E = 1, cost t(1)) wins when the draft is poor; then a probe round drafts anyway,
    often enough to notice a change but rarely enough to cost at most `probe_share` of the time. The first four
    rounds draft in full whatever the priors say, so that a tree's yield is measured before it is judged.

    t(q) starts from the latency table measured at start-up and is learned from every round's own target forward
    (`learn`): a start-up table taken in a slow spell of the machine, or at another context length, would
    otherwise price every round of the run wrongly. At each of the table's points p, t(p) = table(p) * f(p), with
    f(p) the rounds' measured / table ratio near p (geometric moving average, weight `learn`) once a round has
    verified about p tokens, and until then `scale`, the same average over every round (a machine that slows down
    slows every q alike); a round beyond the table's ends moves `scale` only. A round timed at over twice or under
    half its estimate counts as twice or half: one descheduled forward must not move the prices far. A point keeps
    its own price once measured, until rounds near it measure again: a correction relative to `scale` would follow
    the machine there too, but would also move with the mix of sizes the rounds verify (a draft that stops
    drafting would raise every drafted size's price towards plain decoding's ratio, and never test it again).
    """

    def __init__(self, latency: dict[int, float], kmax: int, tree_size: int | None = None,
                 decay: float = 0.9, probe_share: float = 0.02, learn: float = 0.1):
        self._args = (latency, kmax, tree_size, decay, probe_share, learn)
        self._qs, self._table = map(list, zip(*sorted(latency.items())))  # the start-up measurement, seconds
        self.scale, self.learn = 1.0, learn
        self.rho: dict[int, float] = {}  # measured / table at the points rounds have verified near
        self._reprice()
        self.kmax, self.tree_size, self.decay, self.probe_share = kmax, tree_size, decay, probe_share
        self.A, self.R = 1.0, 1.0
        self.tree_tokens, self.tree_weight = 2.0, 1.0  # prior: a tree yields two tokens a round
        self.t_step = 0.05 * self.t(1)  # first guess of a draft step, replaced by measurements
        self.idle = 0  # plain rounds since the last drafted one
        self.observed, self.warm = 0, 4  # drafted rounds seen; the first `warm` rounds draft in full

    def t(self, q: int) -> float:
        """Target latency for q tokens, linear between measured points (flat beyond the ends)."""
        if q not in self._t:
            self._t[q] = float(np.interp(q, self._qs, self._ts))
        return self._t[q]

    def reset(self) -> None:
        """Back to the start: the start-up prices and the priors (after an untimed warm-up, say)."""
        self.__init__(*self._args)

    def _reprice(self) -> None:
        self._ts = [t * self.rho.get(p, self.scale) for p, t in zip(self._qs, self._table)]
        self._t: dict[int, float] = {}

    def learn_latency(self, q: int, seconds: float) -> None:
        """One target forward over q tokens took `seconds`: move t toward it (see the class docstring)."""
        if seconds <= 0 or not self.learn:
            return
        table = float(np.interp(q, self._qs, self._table))
        ratio = _clipped(seconds / self.t(q)) if self._qs[0] <= q <= self._qs[-1] else None
        before = self.scale  # a point's first measurement moves it from where it stood, as much as a later one
        self.scale *= _clipped(seconds / (table * self.scale)) ** self.learn
        if ratio is not None:
            for p, w in _interp_weights(self._qs, q):
                self.rho[p] = self.rho.get(p, before) * ratio ** (self.learn * w)
        self._reprice()

    def latency(self) -> dict[int, float]:
        """t(q) as learned so far, at the table's points."""
        return dict(zip(self._qs, self._ts))

    def expected(self, k: int) -> float:
        return chain_yield(self.A, self.R, k)

    def options(self) -> list[tuple[int, float, float]]:
        """(budget, expected tokens, cost) of every choice; budget None = the full tree."""
        opts = [(0, 1.0, self.t(1))]
        if self.tree_size:
            depth = self.kmax
            opts.append((None, self.tree_tokens / self.tree_weight, self.t(self.tree_size + 1) + depth * self.t_step))
        else:
            opts += [(k, self.expected(k), self.t(k + 1) + k * self.t_step) for k in range(1, self.kmax + 1)]
        return opts

    def choose(self) -> int | None:
        opts = self.options()
        if self.observed < self.warm:  # try the full draft a few times before trusting the estimates
            return opts[-1][0]
        best = max(opts, key=lambda o: o[1] / o[2])
        if best[0] != 0:
            return best[0]
        probe = min(opts[1:], key=lambda o: o[2])  # the cheapest drafting option
        every = math.ceil(max(probe[2] - self.t(1), 0.0) / (self.probe_share * self.t(1))) + 1
        self.idle += 1
        return probe[0] if self.idle >= every else 0

    def observe(self, r: Round) -> None:
        self.learn_latency(r.size + 1, r.target_s)
        if r.depth == 0:
            return
        self.idle = 0
        self.observed += 1
        steps = r.depth if not self.tree_size else self.kmax
        self.t_step = 0.7 * self.t_step + 0.3 * r.draft_s / max(steps, 1)
        if self.tree_size:
            self.tree_tokens = self.decay * self.tree_tokens + r.accepted + 1
            self.tree_weight = self.decay * self.tree_weight + 1
        else:
            self.A, self.R = decayed_counts((self.A, self.R), r.accepted, r.depth, self.decay)
