"""Drafts for the speculative decoding tests, built from the `tiny` target (shared by test_speculate*.py and
test_evaluate.py). The trained one takes seconds to build and is kept in eyas's cache folder, outside the repo.

- untrained: `init_weights` from the target's embedding and head, draft vocabulary from the tiny target's output;
- trained: 150 steps of `ttt_forward` on the tiny target's own greedy outputs of 16 random prompts, features
  captured by forward hooks (eyas.speculate.target_forward.HFRunner), against the target's distributions sharpened to
  temperature 0.05 (a random model's distributions are nearly flat; greedy acceptance only needs the argmax).
  Tests that need acceptance use those same prompts (`random_prompts(16)`): the point is the engine, not the draft.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import torch

from eyas.core.errors import EyasError
from eyas.core.paths import cache_dir
from eyas.draft.checkpoint import read_draft, save_draft
from eyas.draft.model import DraftConfig, Eagle3Draft
from eyas.draft.ttt import step_weights, ttt_forward
from eyas.draft.vocab import build_draft_vocab, count_tokens
from eyas.speculate.decode import plain_generate
from eyas.speculate.target_forward import HFRunner, LeanRunner

DRAFT_VOCAB = 512
LR = 5e-3
SHARPEN = 0.05  # train against the target's distribution at temperature 0.05: what greedy acceptance rewards
_CACHE: dict = {}


def random_prompts(n: int, length: int = 8, seed: int = 0, vocab: int = 49152) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for _ in range(n)]


def greedy_data(target, n: int = 16, new: int = 40, seed: int = 0):
    """(sequences [n, 8+new], prompt length): the tiny target's greedy continuations of random prompts."""
    key = ("data", n, new, seed)
    if key not in _CACHE:
        runner = LeanRunner(target, target.default_feature_layers())
        seqs = [p + plain_generate(runner, p, new).tokens for p in random_prompts(n, seed=seed)]
        _CACHE[key] = torch.tensor(seqs)
    return _CACHE[key], 8


def vocab_for(target):
    seqs, plen = greedy_data(target)
    counts = count_tokens([(s.numpy(), np.r_[np.zeros(plen), np.ones(s.numel() - plen)]) for s in seqs],
                          target.vocab_size)
    return build_draft_vocab(counts, DRAFT_VOCAB)


def untrained_draft(target, seed: int = 0) -> Eagle3Draft:
    vocab = vocab_for(target)
    d = Eagle3Draft(DraftConfig.for_target(target, DRAFT_VOCAB))
    d.init_weights(target.embed_tokens().weight, target.lm_head().weight, vocab.d2t, seed=seed)
    return d.eval().requires_grad_(False)


@torch.no_grad()
def _features(target, seqs):
    """Target features [B,T,3H] by forward hooks, and its log-probabilities over the draft vocabulary [B,T,Vd]."""
    runner = HFRunner(target, target.default_feature_layers())
    ids = untrained_draft(target).target_ids()
    aux, logp = [], []
    for s in seqs:
        runner.reset()
        logits, feats = runner.forward(s)
        aux.append(feats)
        logp.append(torch.log_softmax(logits[:, ids].float() / SHARPEN, -1))
    runner.close()
    return torch.stack(aux), torch.stack(logp)


def trained_draft(target, steps: int = 150) -> Eagle3Draft:
    """Trained once, then kept in eyas's cache folder (outside the repo) under a key of everything it depends on."""
    if ("trained", steps) in _CACHE:
        return _CACHE[("trained", steps)]
    recipe = dict(steps=steps, vocab=DRAFT_VOCAB, sharpen=SHARPEN, lr=LR, data=(16, 40, 0), target=target.identity(),
                  torch=torch.__version__.split("+")[0], version=1)
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:12]
    folder = cache_dir() / "test-drafts" / f"tiny-trained-{key}"
    try:
        d = read_draft(folder).requires_grad_(False)
    except EyasError:
        d = _train(target, steps)
        save_draft(d, folder, extra={"recipe": recipe})
    _CACHE[("trained", steps)] = d
    return d


def _train(target, steps: int) -> Eagle3Draft:
    seqs, plen = greedy_data(target)
    aux, logp = _features(target, seqs)
    mask = torch.zeros_like(seqs)
    mask[:, plen:] = 1
    torch.manual_seed(0)
    d = untrained_draft(target)
    d.train().requires_grad_(True)
    d.embed_tokens.weight.requires_grad_(False)
    opt = torch.optim.Adam(d.trainable_parameters(), lr=LR)
    w = step_weights(3, 0.8)
    for _ in range(steps):
        r = ttt_forward(d, seqs, aux, logp, mask, steps=3)
        loss = (r.loss_sum * w).sum() / r.count.sum().clamp_min(1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.eval().requires_grad_(False)
