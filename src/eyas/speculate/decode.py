"""Speculative decoding: a drafter proposes a chain or a tree of tokens, the target checks them in one forward.

A round: the drafter proposes N tokens arranged as a tree under the last committed token (the root; a chain is
a tree whose node i has parent i-1); the target runs root + N tokens in one forward (tree attention mask,
position = prefix length + depth); the verification keeps a path of a accepted tokens and adds one token of
the target's own (the bonus: the correction after a rejection, or the next token after a fully accepted
path); the target's cache keeps the root and the path, the rest is discarded.

What the metrics count (`acceptance_stats`):
- round: one target verification forward;
- tau (acceptance length): mean over rounds of a + 1, tokens produced per verification round, bonus included
  (EAGLE's and SGLang's definition). Rounds in which nothing was drafted count (a = 0): tau is what the target
  forwards buy. `tau_drafted` is the same mean over rounds that had a proposal;
- acceptance rate at position i: among rounds whose proposal reached depth i and whose tokens at depths
  1..i-1 were all accepted, the share whose depth-i token was accepted too (conditional, EAGLE's alpha_i);
- reach at position i: share of drafted rounds with a >= i (unconditional).

The drafters live in `eyas.speculate.drafters`, the target side in `eyas.speculate.target_forward`.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from eyas.speculate.target_forward import TargetRunner, sync


# -- proposals and tree masks ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Proposal:
    """Proposed tokens as a tree under the root (the last committed token). Parents come before children."""

    tokens: torch.Tensor  # [N] target ids
    parents: torch.Tensor  # [N] index of each node's parent in `tokens`, -1 = the root
    q: torch.Tensor | None = None  # [N,V] distribution each token was sampled from; None = chosen deterministically
    scores: torch.Tensor | None = None  # [N] the drafter's cumulative log-probability of each node (trees)

    @classmethod
    def chain(cls, tokens, q=None) -> "Proposal":
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        return cls(tokens, torch.arange(tokens.numel()) - 1, q)

    @classmethod
    def empty(cls) -> "Proposal":
        return cls.chain([])

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def is_chain(self) -> bool:
        return bool(torch.equal(self.parents.cpu(), torch.arange(len(self)) - 1))

    def depths(self) -> list[int]:
        """[N] depth of each node (children of the root have depth 1)."""
        d: list[int] = []
        for p in self.parents.tolist():
            d.append(1 if p < 0 else d[p] + 1)
        return d


def tree_mask(parents: torch.Tensor) -> torch.Tensor:
    """[N+1, N+1] bool over root + nodes (node j at index j+1): row i may attend to column j iff j is i itself or
    one of its ancestors. The root is every node's ancestor; the prefix is added by the runner."""
    n = parents.numel()
    m = torch.eye(n + 1, dtype=torch.bool)
    for j, p in enumerate(parents.tolist()):  # parents come first, so row p+1 is complete
        m[j + 1] |= m[p + 1]
    return m


# -- verification: which proposed tokens the target keeps -----------------------------------------------------------
def _children(parents: list[int]) -> dict[int, list[int]]:
    """node (0 = root, j+1 = proposal j) -> its children's node ids, in proposal order."""
    kids: dict[int, list[int]] = {}
    for j, p in enumerate(parents):
        kids.setdefault(p + 1, []).append(j + 1)
    return kids


def verify_greedy(target_next: list[int], tokens: list[int], parents: list[int]) -> tuple[list[int], int]:
    """Temperature 0. target_next[i] = the target's argmax after node i (0 = root). Walk from the root into the
    child whose token equals the target's choice, while there is one. -> (accepted node ids, bonus token).
    The output is the target's own greedy continuation by construction: a token is kept only if it is the
    target's argmax given exactly the tokens before it."""
    kids, node, path = _children(parents), 0, []
    while True:
        nxt = next((c for c in kids.get(node, []) if tokens[c - 1] == target_next[node]), None)
        if nxt is None:
            return path, target_next[node]
        path.append(nxt)
        node = nxt


def verify_sampling(p: torch.Tensor, tokens: list[int], parents: list[int], q: torch.Tensor | None,
                    gen: torch.Generator) -> tuple[list[int], int]:
    """Temperature > 0. p [N+1,V] the target's (tempered) distribution after each node.

    Standard speculative sampling at a node whose child x was drawn from q:
        accept x with probability min(1, p(x) / q(x));  on rejection draw from r = (p - q)+ / sum (p - q)+.
    Then P(x) = q(x) min(1, p/q) + (1 - sum_y min(p, q)) r(x) = min(p, q) + (p - q)+ = p(x): the target's own law.
    A child chosen deterministically (a tree's top-k, prompt lookup, an oracle) is the point mass q = delta_x:
    accept with r(x), else r <- r with x removed, renormalised; try the next child. Child j is then emitted with
    prob prod_{i<j} (1 - r_i(x_i)) r_j(x_j) = p(x_j) (the product telescopes to 1 - sum_{i<j} p(x_i)), and an
    untried y with (1 - sum_i p(x_i)) p(y) / (1 - sum_i p(x_i)) = p(y): lossless for any set of children.
    After all children of a node are rejected (or it has none) the bonus is drawn from the residual r.
    -> (accepted node ids, bonus token)."""
    kids, node, path = _children(parents), 0, []
    while True:
        r = p[node].float()  # [V] the residual, normalised
        nxt = None
        for c in kids.get(node, []):
            x = tokens[c - 1]
            if q is None:  # point mass: accept with r(x), else remove x
                accept = float(r[x])
                rest = r.index_fill(0, torch.tensor([x], device=r.device), 0.0)
            else:  # drawn from q: accept with min(1, r(x)/q(x)), else keep (r - q)+
                qx = q[c - 1].float()
                accept = float(r[x] / qx[x]) if qx[x] > 0 else 0.0
                rest = (r - qx).clamp_min(0)
            if float(torch.rand((), generator=gen, device=r.device)) < accept:
                nxt = c
                break
            if rest.sum() > 0:  # an empty residual means rejection had probability 0 (it cannot get here)
                r = rest / rest.sum()
        if nxt is None:
            return path, int(torch.multinomial(r, 1, generator=gen))
        path.append(nxt)
        node = nxt


def pick(logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> int:
    """The next token from logits [V]: argmax at temperature 0, else a sample of softmax(logits / T)."""
    if temperature <= 0:
        return int(logits.argmax())
    return int(torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=gen))


# -- statistics --------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Round:
    depth: int  # deepest proposed position (chain length), 0 = nothing drafted
    size: int  # proposed tokens (tree nodes)
    accepted: int  # proposed tokens kept
    time_s: float  # wall time of the whole round
    target_s: float  # target forward
    draft_s: float  # draft forwards (model + head)
    draft_calls: int = 0  # draft forwards run


def acceptance_stats(accepted: list[int], depth: list[int]) -> dict:
    """tau and per-position rates from per-round (accepted, proposal depth) traces; see the module docstring."""
    n = len(accepted)
    drafted = [(a, d) for a, d in zip(accepted, depth) if d > 0]
    max_d = max(depth, default=0)
    hist: dict[int, int] = {}
    for a in accepted:
        hist[a + 1] = hist.get(a + 1, 0) + 1
    rate, reach = [], []
    for i in range(1, max_d + 1):
        tried = sum(1 for a, d in drafted if d >= i and a >= i - 1)
        ok = sum(1 for a, d in drafted if d >= i and a >= i)
        rate.append(ok / tried if tried else None)
        reach.append(sum(1 for a, _ in drafted if a >= i) / len(drafted) if drafted else None)
    return {"rounds": n, "drafted_rounds": len(drafted),
            "tau": (sum(accepted) + n) / n if n else None,
            "tau_drafted": (sum(a for a, _ in drafted) + len(drafted)) / len(drafted) if drafted else None,
            "tau_hist": {str(k): hist[k] for k in sorted(hist)},
            "accept_rate_by_position": rate, "reach_by_position": reach}


@dataclasses.dataclass
class Generation:
    tokens: list[int]  # generated ids (prompt excluded), truncated at a stop token and at max_new_tokens
    rounds: list[Round]
    prefill_s: float  # prompt forward + first token
    decode_s: float  # everything after (the timed part of tokens/s: tokens[1:] were made in it)


def _finish(tokens: list[int], max_new: int, stop: set[int]) -> list[int]:
    for i, t in enumerate(tokens[:max_new]):
        if t in stop:
            return tokens[: i + 1]
    return tokens[:max_new]


def _done(tokens: list[int], max_new: int, stop: set[int]) -> bool:
    return len(tokens) >= max_new or tokens[-1] in stop


# -- the decoding loops ----------------------------------------------------------------------------------------------
@torch.inference_mode()
def plain_generate(runner: TargetRunner, prompt: list[int], max_new: int, temperature: float = 0.0, seed: int = 0,
                   stop: set[int] = frozenset()) -> Generation:
    """The baseline: one target forward per token, same runner and cache as speculation."""
    dev = runner.device
    gen = torch.Generator(dev).manual_seed(seed)
    sync(dev)
    t0 = time.perf_counter()
    runner.reset()
    logits, _ = runner.prefill(torch.tensor(prompt, device=dev))
    out = [pick(logits[-1], temperature, gen)]
    t1 = time.perf_counter()
    while not _done(out, max_new, stop):
        logits, _ = runner.forward(torch.tensor(out[-1:], device=dev))
        runner.commit()
        out.append(pick(logits[-1], temperature, gen))
    sync(dev)
    return Generation(_finish(out, max_new, stop), [], t1 - t0, time.perf_counter() - t1)


@torch.inference_mode()
def speculative_generate(runner: TargetRunner, drafter, prompt: list[int], max_new: int, temperature: float = 0.0,
                         seed: int = 0, stop: set[int] = frozenset(), controller=None) -> Generation:
    """Speculative decoding of one prompt. `controller` (eyas.speculate.drafters.Controller) picks each round's
    draft length; without one the drafter proposes its configured maximum every round."""
    dev = runner.device
    gen = torch.Generator(dev).manual_seed(seed)
    sync(dev)
    t0 = time.perf_counter()
    runner.reset()
    logits, feats = runner.prefill(torch.tensor(prompt, device=dev))
    seq = list(prompt) + [pick(logits[-1], temperature, gen)]
    drafter.start(seq, feats)
    t1 = time.perf_counter()
    rounds: list[Round] = []
    done = _done(seq[len(prompt):], max_new, stop)
    while not done:
        before = len(seq)
        rounds.append(_round(runner, drafter, seq, temperature, gen, controller))
        done = len(seq) - len(prompt) >= max_new or any(t in stop for t in seq[before:])  # a stop token anywhere
    sync(dev)
    return Generation(_finish(seq[len(prompt):], max_new, stop), rounds, t1 - t0, time.perf_counter() - t1)


def _round(runner: TargetRunner, drafter, seq: list[int], temperature: float, gen, controller) -> Round:
    """Draft, verify, commit; appends the new tokens to `seq` and returns the round's figures."""
    t0 = time.perf_counter()
    f0, d0, c0 = runner.forward_time, drafter.forward_time, drafter.forward_calls
    budget = controller.choose() if controller is not None else None
    prop = drafter.propose(seq, temperature, gen, budget)
    dev = runner.device
    ids = torch.cat((torch.tensor(seq[-1:]), prop.tokens.cpu())).to(dev)  # [N+1] root first
    chain = prop.is_chain()
    depths = prop.depths()
    positions = runner.length + torch.tensor([0] + depths, device=dev)
    logits, feats = runner.forward(ids, positions, None if chain else tree_mask(prop.parents).to(dev))
    tokens, parents = prop.tokens.tolist(), prop.parents.tolist()
    if temperature <= 0:
        path, bonus = verify_greedy(logits.argmax(-1).tolist(), tokens, parents)
    else:
        path, bonus = verify_sampling(torch.softmax(logits.float() / temperature, -1), tokens, parents, prop.q, gen)
    rows = [0] + path
    runner.commit(rows)
    seq.extend([tokens[j - 1] for j in path] + [bonus])
    drafter.update(seq, feats[rows] if feats is not None else None)
    r = Round(max(depths, default=0), len(tokens), len(path), 0.0, runner.forward_time - f0,
              drafter.forward_time - d0, drafter.forward_calls - c0)
    if controller is not None:
        controller.observe(r)
    drafter.timed(r)
    r.time_s = time.perf_counter() - t0
    return r


def first_divergence(reference: list[int], got: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts at the shorter end), None if equal."""
    for i, (a, b) in enumerate(zip(reference, got)):
        if a != b:
            return i
    return None if len(reference) == len(got) else min(len(reference), len(got))
