"""Suffix drafting (SuffixDecoding, Oliaro et al., arXiv 2411.04975; vLLM's `suffix` method): no model, only
counts of what followed what.

Two tries count every substring of at most `depth` tokens: one over this request (its prompt and the reply so
far), one over the earlier replies of the run (global). Each round every suffix of the sequence found in a trie
with a continuation (at most `depth` tokens, the match) is followed down that trie, and a speculation tree grows
best first: a child's score is its parent's times the share of the parent's continuations it makes (its count
over the counts of its siblings and itself), children under `min_prob` are left out, and the tree holds at most
`max_spec_factor` x the match length tokens (a longer match earns a longer speculation), capped at k. Of every
match length in both tries, the tree with the largest sum of scores (the tokens it expects to be accepted) is
verified (on a tie the longer match within a trie, the request's trie between the two), as arctic-inference
(the authors' code, behind vLLM's `suffix`) chooses.
The longest match's tree alone accepted fewer tokens per round: on the demo's MT-Bench run (24 x 2 turns,
replayed), tau 1.67 against 1.84 (the results log, 2026-12-06).

The tokens are point masses (no law q): verification stays exact at temperature 0 and keeps the target's law
above it, as for prompt lookup.
"""

from __future__ import annotations

import heapq

import torch

from eyas.speculate.decode import Proposal
from eyas.speculate.drafters import Drafter


class _Node:
    __slots__ = ("children", "count")

    def __init__(self):
        self.children: dict[int, _Node] = {}
        self.count = 0


class SuffixTrie:
    """The counts of every substring of at most `depth` tokens of the token streams fed to it.

    A stream is fed a token at a time (`extend`): `ends` holds the nodes of the stream's suffixes of length
    1, 2, ... (at most `depth`), and each is extended by the new token, so a token costs O(depth)."""

    def __init__(self, depth: int):
        self.root, self.depth = _Node(), depth

    def extend(self, ends: list[_Node], token: int) -> list[_Node]:
        """Count `token` after each of the stream's suffixes (and alone); the stream's new suffix nodes."""
        out = []
        for node in [self.root, *ends[:self.depth - 1]]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
            child.count += 1
            out.append(child)
        return out

    def add(self, tokens: list[int]) -> None:
        ends: list[_Node] = []
        for t in tokens:
            ends = self.extend(ends, t)

    def follow(self, ends: list[_Node], token: int) -> list[_Node]:
        """Without counting: the nodes of a stream's suffixes in this trie after `token` (the longest first absent
        ends the list: a suffix that never occurred is in no longer one that did)."""
        out = []
        for node in [self.root, *ends[:self.depth - 1]]:
            child = node.children.get(token)
            if child is None:
                break
            out.append(child)
        return out


def speculate(node: _Node, budget: int, min_prob: float) -> tuple[list[int], list[int], float]:
    """(tokens, parents, expected accepted tokens) of the best-first tree of at most `budget` tokens below `node`."""
    tokens: list[int] = []
    parents: list[int] = []
    expected, tie = 0.0, 0
    heap: list[tuple[float, int, int, _Node, int]] = []

    def push(n: _Node, score: float, parent: int) -> None:
        nonlocal tie
        total = sum(c.count for c in n.children.values())
        for tok, c in n.children.items():
            p = score * c.count / total
            if p >= min_prob:
                tie += 1
                heapq.heappush(heap, (-p, tie, tok, c, parent))

    push(node, 1.0, -1)
    while heap and len(tokens) < budget:
        neg, _, tok, child, parent = heapq.heappop(heap)
        tokens.append(tok)
        parents.append(parent)
        expected -= neg
        push(child, -neg, len(tokens) - 1)
    return tokens, parents, expected


class SuffixDrafter(Drafter):
    """Suffix decoding's drafter: see the module's docstring. `ngram`: the match lengths the hybrid keeps
    acceptance counts for, when this drafter is its partner (longer matches count as `ngram`)."""

    name = "suffix"

    def __init__(self, k: int = 16, depth: int = 24, max_spec_factor: float = 1.0, min_prob: float = 0.1,
                 ngram: int = 3):
        super().__init__(k)
        self.depth, self.factor, self.min_prob, self.ngram = depth, max_spec_factor, min_prob, ngram
        self.forget()

    def forget(self) -> None:
        self.shared = SuffixTrie(self.depth)  # the earlier replies of this run
        self.own: SuffixTrie | None = None  # this request: its prompt and reply so far
        self.seq: list[int] = []  # the request's tokens fed to the tries so far
        self.reply_from = 0  # where this request's reply begins
        self.own_ends: list[_Node] = []
        self.shared_ends: list[_Node] = []

    def start(self, seq, feats) -> None:
        if self.own is not None:  # the previous request's reply joins the shared trie
            self.shared.add(self.seq[self.reply_from:])
        self.own, self.seq, self.reply_from = SuffixTrie(self.depth), [], len(seq) - 1
        self.own_ends, self.shared_ends = [], []
        self._feed(seq)

    def update(self, seq, feats) -> None:
        if self.own is not None:  # the round's tokens, so that the whole reply joins the run's trie at the next start
            self._feed(seq)

    def repeat(self) -> None:
        self.own, self.seq = None, []  # the next start adds nothing: the last reply is the repeat's own

    def _feed(self, seq: list[int]) -> None:
        """Bring the tries up to the committed sequence (its tokens since the last round)."""
        for t in seq[len(self.seq):]:
            self.own_ends = self.own.extend(self.own_ends, t)
            self.shared_ends = self.shared.follow(self.shared_ends, t)
        self.seq = list(seq)

    def propose(self, seq, temperature, gen, budget) -> Proposal:
        tokens, parents, _, _ = self.tree(seq, self.k if budget is None else min(budget, self.k))
        return Proposal(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))

    def tree(self, seq: list[int], k: int) -> tuple[list[int], list[int], float, int]:
        """(tokens, parents, expected accepted tokens, match length) of this round's better speculation tree."""
        if self.own is None:
            self.start(seq, None)
        self._feed(seq)
        best: tuple[list[int], list[int], float, int] = ([], [], 0.0, 0)
        if k <= 0:
            return best
        for ends in (self.own_ends, self.shared_ends):
            # every suffix length with a continuation seen (the request's own suffix nodes count this occurrence),
            # the longest first: a shorter match replaces a longer one only by a larger expected count, and once
            # the best expects as many tokens as a match may speculate, no shorter one can (its budget is smaller)
            for m in range(len(ends) - 1, -1, -1):
                budget = min(k, max(1, int(self.factor * (m + 1))))
                if best[2] >= budget:
                    break
                if ends[m].children:
                    found = (*speculate(ends[m], budget, self.min_prob), m + 1)
                    if found[2] > best[2]:
                        best = found
        return best

    def match(self, seq: list[int], k: int) -> tuple[list[int], int]:
        """As prompt lookup's `match`, for the hybrid: the tree's first path (its most likely chain) and the match
        length (at most `ngram`), or ([], 0)."""
        tokens, parents, _, n = self.tree(seq, k)
        chain: list[int] = []
        at = -1
        for i, (t, p) in enumerate(zip(tokens, parents)):
            if p == at:  # best-first: the first child of the chain's last node is its most likely one
                chain.append(t)
                at = i
        return chain, min(n, self.ngram) if chain else 0
