"""Drafters for `eyas.speculate.decode`: EAGLE-3 (chain and EAGLE-2 dynamic tree), prompt lookup, the hybrid of the
two, an oracle. What sizes each round's draft is `eyas.speculate.controller`; the CPU weight rewrites of a draft
are `eyas.speculate.quantize`.

Every drafter has the same interface:
    start(seq, feats)       the prompt was prefilled: seq = prompt + first token, feats [n,3H] of positions 0..n-1
    propose(seq, T, gen, budget) -> Proposal   (budget: None = the configured size, 0 = draft nothing, k = k tokens)
    update(seq, feats)      a round committed: seq grew; feats [a+1,3H] of the positions the target just kept
    timed(round)            the decoder's figures of that round (Round: sizes, accepted, target and draft seconds)
    forward_time            seconds spent drafting (model forwards, sampling, tree selection), for the overhead share

EAGLE-3 at inference, as vLLM runs it (docs/export.md, facts 3 and 4): the draft at position p reads (target
features of p, embedding of token p+1) with rotary position p; its output there predicts token p+2; step k of a
chain feeds its own pre-norm output back with the embedding of the token it just drafted, at position p+k.
The draft's own cache (eyas.draft.model.KVCache, preallocated and written in place) holds only positions whose
target features are known (committed); a round's speculative entries are written past the committed length
and overwritten by the next round, so rejected tokens leave no trace and nothing is copied.
"""

from __future__ import annotations

import copy
import dataclasses
import time

import numpy as np
import torch

from eyas.speculate.controller import Controller, chain_yield, decayed_counts, union_yield
from eyas.speculate.decode import Proposal, Round
from eyas.speculate.target_forward import sync


class Drafter:
    name = "drafter"
    tree = False

    def __init__(self, k: int):
        self.k = k  # chain length, or tree depth
        self.forward_time = 0.0  # seconds in model forwards
        self.forward_calls = 0

    @property
    def max_depth(self) -> int:
        return self.k

    def start(self, seq: list[int], feats) -> None:
        pass

    def update(self, seq: list[int], feats) -> None:
        pass

    def forget(self) -> None:
        """Drop what the drafter learned from the text it has seen (suffix decoding's run-wide counts): after an
        untimed warm-up, whose reply would otherwise be drafted from when the same prompt comes again."""

    def repeat(self) -> None:
        """The next request decodes the last one's prompt again (evaluate's --repeats): learn nothing from the
        last request, so that every repeat starts from the same state (suffix decoding would otherwise draft the
        repeat's reply from the first one's)."""

    def timed(self, r: Round) -> None:
        """The decoder's figures of the round just verified (a drafter pricing its own rounds learns from them)."""

    def propose(self, seq: list[int], temperature: float, gen, budget: int | None) -> Proposal:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class TreeShape:
    topk: int = 4  # children expanded per node, and nodes expanded per depth
    depth: int = 5  # deepest draft position
    size: int = 16  # candidates verified (tree nodes, root excluded)


class Eagle3Drafter(Drafter):
    """An `eyas.draft.model.Eagle3Draft` fed by the target's features; chain of k, or a dynamic tree when `tree` is
    set."""

    def __init__(self, draft, k: int = 5, tree: TreeShape | None = None, name: str = "eagle3"):
        super().__init__(tree.depth if tree else k)
        self.draft, self.shape, self.name, self.tree = draft, tree, name, tree is not None
        self.device, self.dtype = draft.d2t.device, draft.embed_tokens.weight.dtype
        self.target_ids = draft.target_ids()  # [Vd] target id of every draft entry
        self.vocab = draft.cfg.vocab_size
        self.start([], None)

    def start(self, seq, feats) -> None:
        self.cache = None  # the KVCache of the committed positions (length done)
        self.done = 0  # positions the committed cache holds
        self.pending = [] if feats is None else [feats]  # target features not yet fed to the draft
        # the draft's prefill, timed with the prompt
        self.ready = self._timed(self._catch_up, seq) if feats is not None else None

    def update(self, seq, feats) -> None:
        self.pending.append(feats)
        self.ready = None

    def _timed(self, fn, *args):
        """fn(*args), its wall time added to forward_time: the device is waited on once before and once after a
        whole proposal, not around each of its forwards, so a GPU runs a chain's steps back to back."""
        sync(self.device)
        t0 = time.perf_counter()
        out = fn(*args)
        sync(self.device)
        self.forward_time += time.perf_counter() - t0
        return out

    def _forward(self, ids, hidden, positions, cache, mask=None, last_only=False):
        """Draft pass + head: ids [1,T], hidden [1,T,3Ht|H], positions [1,T] -> (h [1,T,H], logits [T|1,Vd], cache)."""
        h, cache = self.draft(ids, hidden, positions, cache, mask)
        logits = self.draft.logits(h[0, -1:] if last_only else h[0])
        self.forward_calls += 1
        return h, logits, cache

    def _catch_up(self, seq):
        """Feed the pending features (positions done..done+n-1, paired with tokens done+1..done+n) into the committed
        cache. -> (h [1,1,H], logits [Vd]) at the last position: the draft's view of the token after seq[-1]."""
        feats = torch.cat(self.pending, dim=0)  # [n,3Ht]
        n, p0 = feats.shape[0], self.done
        ids = torch.tensor(seq[p0 + 1: p0 + n + 1], device=self.device)[None]  # [1,n]
        pos = torch.arange(p0, p0 + n, device=self.device)[None]
        h, logits, self.cache = self._forward(ids, feats[None].to(self.dtype), pos, self.cache,
                                              last_only=True)
        self.done, self.pending = p0 + n, []
        return h[:, -1:], logits[-1]

    def propose(self, seq, temperature, gen, budget) -> Proposal:
        k = self.k if budget is None else min(budget, self.k)
        if k <= 0:
            return Proposal.empty()
        return self._timed(self._propose, seq, temperature, gen, k)

    def _propose(self, seq, temperature, gen, k) -> Proposal:
        h, logits = self.ready if self.ready is not None else self._catch_up(seq)
        self.ready = None
        if self.tree:
            return self._tree(h, torch.log_softmax(logits.float(), -1))
        return self._chain(h, logits, k, temperature, gen)

    def _chain(self, h, logits, k, temperature, gen) -> Proposal:
        # Every token stays on the device until the chain is complete: one read of all k at the end, where reading
        # each (int(argmax)) would wait for the device k times a round.
        cache, pos = self.cache, self.done - 1  # the catch-up's last position m-1 predicted token m+1
        positions = torch.arange(pos + 1, pos + k, device=self.device)  # [k-1] the chain's later positions
        drafted, qs = [], []
        for i in range(k):
            if temperature <= 0:
                d = logits.argmax()
            else:  # sample from q = softmax(logits / T), kept on the target vocabulary for the acceptance rule
                probs = torch.softmax(logits.float() / temperature, -1)
                d = torch.multinomial(probs, 1, generator=gen)[0]
                qs.append(torch.zeros(self.vocab, device=probs.device).index_copy_(0, self.target_ids, probs))
            drafted.append(self.target_ids[d.view(1)])  # [1] on the device (a 0-d index would be read back)
            if i + 1 < k:
                h, lg, cache = self._forward(drafted[-1].view(1, 1), h, positions[i:i + 1].view(1, 1), cache)
                logits = lg[0]
        return Proposal.chain(torch.cat(drafted).tolist(), torch.stack(qs) if qs else None)

    def _tree(self, h_root, logp_root) -> Proposal:
        """EAGLE-2 dynamic tree: expand the top-k nodes of each depth by cumulative log-probability, then keep the
        `size` best candidates of all depths (a set closed under ancestors, since a child never scores above its
        parent and ties go to the shallower node)."""
        K, D, N = self.shape.topk, self.shape.depth, self.shape.size
        dev, C, pos_root = self.device, self.done, self.done - 1
        score, tok = logp_root.topk(K)  # [K] depth-1 candidates
        pool_tok, pool_score, pool_parent, pool_depth = [tok], [score], [torch.full((K,), -1)], [torch.ones(K)]
        front = torch.arange(K)  # pool ids of the nodes to expand
        f_tok, f_score, f_hidden = tok, score, h_root.expand(1, K, -1)
        f_anc = [[] for _ in range(K)]  # tree-cache slots of each frontier node's ancestors
        cache, S, base = self.cache, C, K
        for depth in range(2, D + 1):
            T = f_tok.numel()
            mask = torch.zeros(T, S + T, dtype=torch.bool)
            mask[:, :C] = True
            for r, anc in enumerate(f_anc):
                mask[r, anc + [S + r]] = True
            pos = torch.full((1, T), pos_root + depth - 1, device=dev)
            ids = self.target_ids[f_tok.to(dev)][None]  # [1,T] the embedding takes target ids
            h, logits, cache = self._forward(ids, f_hidden, pos, cache, mask[None, None].to(dev))
            cs, cx = torch.log_softmax(logits.float(), -1).topk(K, dim=-1)  # [T,K] children of every frontier node
            cscore = (f_score[:, None] + cs).flatten()  # cumulative log-probability
            pool_tok.append(cx.flatten())
            pool_score.append(cscore)
            pool_parent.append(front.repeat_interleave(K))
            pool_depth.append(torch.full((T * K,), float(depth)))
            top = cscore.topk(min(K, T * K)).indices.cpu()
            front, f_tok, f_score = base + top, cx.flatten()[top], cscore[top]
            f_hidden = h[:, top // K]
            f_anc = [f_anc[int(i)] + [S + int(i)] for i in top // K]
            S, base = S + T, base + T * K
        return self._select(torch.cat(pool_tok), torch.cat(pool_score).cpu(), torch.cat(pool_parent),
                            torch.cat(pool_depth), N)

    def _select(self, tok, score, parent, depth, N) -> Proposal:
        order = torch.sort(depth, stable=True).indices  # shallower first on equal scores
        order = order[torch.sort(-score[order], stable=True).indices]
        keep = order[:N].sort().values  # pool order = parents before children
        new_id = torch.full((tok.numel(),), -1, dtype=torch.long)
        new_id[keep] = torch.arange(keep.numel())
        par = parent[keep]
        parents = torch.where(par >= 0, new_id[par.clamp_min(0)], par)
        return Proposal(self.target_ids[tok[keep].to(self.device)].cpu(), parents, scores=score[keep])


class PromptLookupDrafter(Drafter):
    """n-gram prompt lookup: find the latest earlier occurrence of the last n tokens (n = ngram..1) in the
    sequence and propose the k tokens that followed it. Free: no model runs."""

    name = "prompt-lookup"

    def __init__(self, k: int = 7, ngram: int = 3):
        super().__init__(k)
        self.ngram = ngram

    def propose(self, seq, temperature, gen, budget) -> Proposal:
        return Proposal.chain(self.match(seq, self.k if budget is None else min(budget, self.k))[0])

    def match(self, seq, k: int) -> tuple[list[int], int]:
        """(up to k tokens that followed the latest earlier occurrence of the sequence's last n tokens, n): the
        longest n from `ngram` down to 1 that occurs; ([], 0) where none does."""
        if k <= 0 or len(seq) < 2:
            return [], 0
        arr = np.asarray(seq)
        for n in range(min(self.ngram, len(seq) - 1), 0, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # starts whose continuation exists
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if hits.size:
                i = int(hits[-1]) + n
                return arr[i: i + k].tolist(), n
        return [], 0


def join_chains(chain: Proposal, other: list[int]) -> Proposal:
    """One tree of the draft's chain and another chain of tokens (prompt lookup's match): the common prefix once,
    then the other chain's rest as a branch under it (after the draft's own child, so at temperature 0 nothing
    changes where they agree). Sampled draft tokens keep their law q; the other chain's tokens are point masses,
    which in eyas.speculate.decode.verify_sampling is a one-hot row of q. Verification stays lossless: each node's
    children are tried one after the other, each step leaving the target's law for what follows."""
    mine = chain.tokens.tolist()
    s = matched(other, mine)  # the common prefix
    rest = other[s:]
    if not rest:
        return chain
    k = len(mine)
    tokens = torch.tensor(mine + rest, dtype=torch.long)
    parents = torch.cat((chain.parents.cpu(), torch.tensor([s - 1] + list(range(k, k + len(rest) - 1)))))
    q = chain.q
    if q is not None:
        point = torch.zeros(len(rest), q.shape[1], device=q.device, dtype=q.dtype)
        q = torch.cat((q, point.scatter_(1, torch.tensor(rest, device=q.device)[:, None], 1.0)))
    return Proposal(tokens, parents, q)


def matched(proposed: list[int], made: list[int]) -> int:
    """How many of a chain's tokens a round would have kept had it verified that chain alone: its common prefix
    with what the round made (accepted tokens and the target's own; at temperature 0 exactly so)."""
    n = 0
    while n < min(len(proposed), len(made)) and proposed[n] == made[n]:
        n += 1
    return n


class HybridDrafter(Drafter):
    """An EAGLE-3 chain and prompt lookup in one decoder. Each round it verifies the option expected to make the
    most tokens per second:

        option                          expected tokens E                          cost
        plain decoding                  1                                          t(1)
        prompt lookup's m tokens        sum_{i=0..m} a_n^i                         t(m+1)              (no model runs)
        the draft's chain of k tokens   sum_{i=0..k} a_e^i                         t(k+1) + k t_step
        both, as two branches of a tree 1 + sum_i [1 - (1 - a_e^i)(1 - a_n^i)]     t(k+m+1) + k t_step

    The partner (`lookup`: a drafter with `name`, `k`, `ngram` and `match(seq, k) -> (tokens, n)`) is prompt lookup
    or suffix decoding (eyas.speculate.suffix: its most likely chain, n its match length capped at 3), which plays
    prompt lookup's part below under its own name.
    a_n is prompt lookup's acceptance rate after a match of the last n tokens (a 3-token match predicts the next
    tokens better than a 1-token one), a_e the draft's: accepted / (accepted + rejections) over the rounds that
    option was verified, decayed by `decay` per such round, from a prior of one each. "Both" (`union`) verifies the
    draft's chain and prompt lookup's match in one forward, their common prefix once (join_chains); it needs
    measured costs, so only an adaptive hybrid weighs it, and only when asked (`union`: measured side by side it
    did not pay, docs/evaluate.md). With a `controller` (eyas evaluate's adaptive mode) the
    chain's k, or plain decoding where the draft does not pay, is the controller's choice, the costs are its
    measured latencies, and it learns acceptance from the draft's rounds only (prices from every round); prompt
    lookup, free to make, is still tried wherever its expected tokens pay for its longer verification. Without
    one every round drafts the full chain or prompt lookup's match, whichever has the larger E (ties to the draft).
    After a round each chain it verified is credited with its common prefix with what the round made, the tokens
    it would have kept alone. A round without the draft leaves the draft's features pending and the next EAGLE-3
    round catches up on them. Each proposal keeps each token's own law, so decoding stays lossless."""

    name = "hybrid"

    def __init__(self, eagle: "Eagle3Drafter", lookup: Drafter, decay: float = 0.9,
                 controller: "Controller | None" = None, union: bool = False):
        self.k = max(eagle.k, lookup.k)  # no Drafter.__init__: the time and calls are the draft model's own
        self.eagle, self.lookup, self.decay, self.controller = eagle, lookup, decay, controller
        self.union = union and controller is not None
        self.forget()

    def forget(self) -> None:
        """Back to the priors: what a warm-up taught (and its rounds) does not count."""
        self.lookup.forget()
        # [accepted, rejections], decayed: the draft's, and prompt lookup's after a match of n tokens
        self.stats = {"eagle3": [1.0, 1.0], **{self.key(n): [1.0, 1.0] for n in range(1, self.lookup.ngram + 1)}}
        self.used = {"eagle3": 0, self.lookup.name: 0, **({"both": 0} if self.union else {})}  # rounds of each
        # the open round: (len(seq) before it, the draft's seconds on it, [(stats key, the chain it verified)])
        self.last: tuple[int, float, list[tuple[str, list[int]]]] | None = None
        self.at_start = (copy.deepcopy(self.stats), dict(self.used))  # as the request began, for `repeat`

    def repeat(self) -> None:
        self.lookup.repeat()
        self.stats, self.used = copy.deepcopy(self.at_start[0]), dict(self.at_start[1])

    @property
    def forward_time(self) -> float:
        return self.eagle.forward_time

    @property
    def forward_calls(self) -> int:
        return self.eagle.forward_calls

    def expected(self, which: str, k: int) -> float:
        return chain_yield(*self.stats[which], k)

    def key(self, n: int) -> str:
        """The stats key of the partner (prompt lookup, or suffix drafting) after a match of n tokens."""
        return f"{self.lookup.name}/{n}"

    def start(self, seq, feats) -> None:
        self.eagle.start(seq, feats)
        self.lookup.start(seq, feats)  # a new request: suffix decoding starts its request's trie
        self.last = None
        self.at_start = (copy.deepcopy(self.stats), dict(self.used))

    def update(self, seq, feats) -> None:
        self.eagle.update(seq, feats)
        self.lookup.update(seq, feats)
        if self.last is not None:
            before, draft_s, chains = self.last
            made = seq[before:]  # the accepted tokens and the target's own
            for which, chain in chains:
                kept = matched(chain, made)
                self.stats[which] = list(decayed_counts(self.stats[which], kept, len(chain), self.decay))
                if which == "eagle3" and self.controller is not None:  # its acceptance; target_s 0: the
                    # prices learn from every round of the hybrid, in timed()
                    self.controller.observe(Round(len(chain), len(chain), kept, 0.0, 0.0, draft_s))
            self.last = None

    def timed(self, r: Round) -> None:
        if self.controller is not None:
            self.controller.learn_latency(r.size + 1, r.target_s)

    def options(self, k: int, found: list[int], n: int) -> list[tuple[str, int, float, float]]:
        """(option, draft tokens, expected tokens, cost) of this round: the draft's chain of k (plain decoding for
        k = 0), prompt lookup's match of n tokens if any, and both (an adaptive hybrid). Without a controller every
        cost is 1."""
        ctl = self.controller

        def cost(tokens: int, steps: int) -> float:
            return ctl.t(tokens + 1) + steps * ctl.t_step if ctl is not None else 1.0

        opts = [("eagle3", k, self.expected("eagle3", k), cost(k, k)) if k else ("plain", 0, 1.0, cost(0, 0))]
        if found:
            key, m = self.key(n), len(found)
            opts.append((key, 0, self.expected(key, m), cost(m, 0)))
            if k and self.union:
                both = union_yield([(self.stats["eagle3"], k), (self.stats[key], m)])
                opts.append(("both", k, both, cost(k + m, k)))
        return opts

    def propose(self, seq, temperature, gen, budget) -> Proposal:
        k = self.eagle.k if budget is None else min(budget, self.eagle.k)
        if self.controller is not None:
            k = min(k, self.controller.choose())  # 0: plain decoding, unless prompt lookup pays
        found, n = self.lookup.match(seq, self.lookup.k if budget is None else min(budget, self.lookup.k))
        which, k, _, _ = max(self.options(k, found, n), key=lambda o: o[2] / o[3])  # the first of equals
        if which == "plain":
            return Proposal.empty()
        t0 = self.eagle.forward_time
        chains = []
        if k:  # the draft's chain, alone or with prompt lookup's match
            prop = self.eagle.propose(seq, temperature, gen, k)
            chains.append(("eagle3", prop.tokens.tolist()))
        if which != "eagle3":  # prompt lookup's match, alone or beside the chain
            prop = join_chains(prop, found) if k else Proposal.chain(found)
            chains.append((self.key(n), found))
        self.used[which if which in ("eagle3", "both") else self.lookup.name] += 1
        self.last = (len(seq), self.eagle.forward_time - t0, chains)
        return prop


class OracleDrafter(Drafter):
    """Proposes a known continuation (the target's own greedy output): at temperature 0 every token is accepted.
    With `tree=True` each true token has a wrong sibling placed before it, and that sibling a child carrying the
    next true token, so verification must pick the right branch and ignore a right token on a wrong branch."""

    name = "oracle"

    def __init__(self, k: int, tree: bool = False, vocab: int = 2):
        super().__init__(k)
        self.tree, self.vocab, self.reference, self.offset = tree, vocab, [], 0

    def set_reference(self, tokens: list[int]) -> None:
        self.reference = list(tokens)

    def start(self, seq, feats) -> None:
        self.offset = len(seq) - 1  # seq = prompt + first generated token

    def propose(self, seq, temperature, gen, budget) -> Proposal:
        k = self.k if budget is None else min(budget, self.k)
        done = len(seq) - self.offset
        truth = self.reference[done: done + k]
        if not self.tree or not truth:
            return Proposal.chain(truth)
        tokens, parents, last = [], [], -1
        for i, t in enumerate(truth):
            decoy = (t + 1) % self.vocab
            tokens += [decoy, t]
            parents += [last, last]
            last = len(tokens) - 1
            if i + 1 < len(truth):  # the next true token, under the decoy
                tokens.append(truth[i + 1])
                parents.append(last - 1)
        # parents must precede children: the decoy's child was appended before the true child's children
        return Proposal(torch.tensor(tokens), torch.tensor(parents))


