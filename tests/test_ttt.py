"""Training-time test in memory linear in T (eyas.draft.attention) and flat in vocabulary x length
(eyas.draft.cross_entropy), against the T^2 / [N,Vd] implementation it replaced (tests/ttt_reference.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from eyas.draft import attention as eyas_attention
from eyas.draft import cross_entropy
from eyas.draft.attention import chain_attention, query_chunks
from eyas.draft.cross_entropy import TargetRows, soft_cross_entropy
from eyas.draft.model import DraftConfig, Eagle3Draft
from eyas.draft.ttt import step_weights, ttt_forward
from eyas.draft.vocab import build_draft_vocab
from eyas.train.batches import needed_rows, sparse_target_logp, valid_masks
from eyas.train.objective import TTTObjective
from tests import ttt_reference as ref

pytestmark = pytest.mark.usefixtures("one_thread")

# two rows: three documents and padding (-1), and four documents (one of a single token)
DOCS = torch.tensor([[0] * 9 + [1] * 14 + [2] * 8 + [-1] * 6,
                     [0] * 4 + [1] * 1 + [2] * 20 + [3] * 12])
POS = torch.cat([torch.arange(n) for n in (9, 14, 8, 6, 4, 1, 20, 12)]).view(2, -1)


def attention_inputs(n: int, dtype, seed=0, B=2, nh=6, nkv=2, T=37, d=8):
    g = torch.Generator().manual_seed(seed)
    # strided like the model's q/k/v ([B,T,h,d] transposed)
    q = torch.randn(B, T, nh, d, generator=g).to(dtype).transpose(1, 2).requires_grad_()
    ks = [torch.randn(B, T, nkv, d, generator=g).to(dtype).transpose(1, 2).requires_grad_() for _ in range(n)]
    vs = [torch.randn(B, T, nkv, d, generator=g).to(dtype).transpose(1, 2).requires_grad_() for _ in range(n)]
    return q, ks, vs


def reference_attention(q, ks, vs, doc_ids):
    """The old T^2 attention in float64 (float32 for bf16 inputs): the values both dtypes are compared with."""
    wide = torch.float64 if q.dtype == torch.float32 else torch.float32
    return ref.chain_attention(q.to(wide), [k.to(wide) for k in ks], [v.to(wide) for v in vs], ref.base_mask(doc_ids))


@pytest.mark.parametrize("n", [1, 2, 3, 4])  # TTT steps 0..3
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chain_attention_equals_the_t2_reference(n, dtype):
    """Output and the gradients of q, every k_j and v_j, for packed rows, grouped-query heads and chunks of 8 query
    rows (several per document, and chunks whose first keys are skipped)."""
    q, ks, vs = attention_inputs(n, dtype)
    inputs = [q, *ks, *vs]
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(9)).to(dtype)
    want = reference_attention(q, ks, vs, DOCS)
    want_grads = torch.autograd.grad(want, inputs, grad.to(want.dtype))
    got = chain_attention(q, ks, vs, DOCS, query_chunks(DOCS, 8))
    got_grads = torch.autograd.grad(got, inputs, grad)
    assert got.dtype == dtype and all(g.dtype == dtype for g in got_grads)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.to(want.dtype), want, **tol)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a.to(b.dtype), b, **tol)


def test_chain_attention_keeps_documents_apart():
    """Changing the keys and values of one document changes no output of another (a mask that ignored documents,
    or a chunk that skipped keys it needs, fails here or above)."""
    q, ks, vs = attention_inputs(3, torch.float32)
    before = chain_attention(q, ks, vs, DOCS, query_chunks(DOCS, 8))
    other = DOCS[:, :, None, None] != 1  # [B,T,1,1] not document 1
    ks2 = [(k.transpose(1, 2) + 5 * (DOCS == 1)[:, :, None, None]).transpose(1, 2) for k in ks]
    vs2 = [(v.transpose(1, 2) + 5 * (DOCS == 1)[:, :, None, None]).transpose(1, 2) for v in vs]
    after = chain_attention(q, ks2, vs2, DOCS, query_chunks(DOCS, 8))
    same = other.expand(-1, -1, q.shape[1], q.shape[3]).transpose(1, 2)  # [B,nh,T,d]
    torch.testing.assert_close(after[same], before[same], rtol=0, atol=1e-6)
    assert not torch.allclose(after[~same], before[~same])


def test_query_chunks_start_at_the_first_key_any_row_needs():
    chunks = query_chunks(DOCS, 8)
    assert [(a, b) for a, b, _ in chunks] == [(0, 8), (8, 16), (16, 24), (24, 32), (32, 37)]
    # rows 16..31 reach back to row 1's document 2 (from 5); rows 32..36 to row 1's document 3 (from 25), row 0's
    # padding starting at 31
    assert [lo for _, _, lo in chunks] == [0, 0, 5, 5, 25]


def reference_cross_entropy(h, W, logp, where):
    """-sum_v p_v log softmax(h W^T)_v per row, and the top-1 agreement."""
    logq = F.log_softmax(h @ W.T, -1)
    return -(logp[where].exp() * logq).sum(-1), logq.argmax(-1) == logp[where].argmax(-1)


@pytest.mark.parametrize("head_grad", [True, False])
@pytest.mark.parametrize("weighting", ["announced", "other", "none"])
@pytest.mark.parametrize("lazy", [True, False])
def test_soft_cross_entropy_equals_log_softmax(monkeypatch, head_grad, weighting, lazy):
    """Loss, hit and the gradients of h and W against log_softmax, with the target as a log-prob table or as
    TargetRows (final rows + head rows), the head trainable or frozen, the upstream gradient the announced row
    weights times a constant (the trainer's case), anything else, or not announced; blocks of 16 rows and chunks
    of 5."""
    monkeypatch.setitem(cross_entropy.SIZES, "cpu", (16, 5))
    g = torch.Generator().manual_seed(0)
    N, M, H, Vd = 61, 23, 12, 40
    h = torch.randn(N, H, generator=g, requires_grad=True)
    W = torch.randn(Vd, H, generator=g, requires_grad=head_grad)
    final, head = torch.randn(M, H, generator=g), torch.randn(Vd, H, generator=g)
    logp = torch.log_softmax(final @ head.T, -1)
    where = torch.randint(0, M, (N,), generator=g)
    weight = torch.rand(N, generator=g) + 0.1
    upstream = 3 * weight if weighting == "announced" else torch.rand(N, generator=g)
    announced = None if weighting == "none" else weight
    loss, hit = soft_cross_entropy(h, W, TargetRows(final, head) if lazy else logp, where, announced)
    (loss * upstream).sum().backward()
    gh, gW = h.grad, W.grad
    h.grad = W.grad = None
    want, want_hit = reference_cross_entropy(h, W, logp, where)
    (want * upstream).sum().backward()
    assert loss.dtype == torch.float32 and torch.equal(hit, want_hit)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh, h.grad, rtol=1e-5, atol=1e-6)
    if head_grad:
        torch.testing.assert_close(gW, W.grad, rtol=1e-5, atol=1e-6)
    else:
        assert gW is None


def test_soft_cross_entropy_under_bf16_autocast():
    """bf16 matmuls, float32 softmax: close to the float32 values."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(50, 16, generator=g, requires_grad=True)
    W = torch.randn(64, 16, generator=g, requires_grad=True)
    final, head = torch.randn(20, 16, generator=g), torch.randn(64, 16, generator=g)
    where = torch.randint(0, 20, (50,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = soft_cross_entropy(h, W, TargetRows(final, head.bfloat16()), where)
    loss.sum().backward()
    want, _ = reference_cross_entropy(h, W, torch.log_softmax(final @ head.T, -1), where)
    gh, gW = h.grad, W.grad
    h.grad = W.grad = None
    want.sum().backward()
    torch.testing.assert_close(loss, want.detach(), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(gh, h.grad, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(gW, W.grad, rtol=5e-2, atol=5e-2)


V, H, VD = 60, 16, 24


def small_draft(seed=0) -> Eagle3Draft:
    cfg = DraftConfig(hidden_size=H, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      vocab_size=V, draft_vocab_size=VD, target_hidden_size=H, feature_layers=(2, 3, 4), num_layers=2)
    m = Eagle3Draft(cfg)
    g = torch.Generator().manual_seed(seed)
    vocab = build_draft_vocab(torch.randint(0, 5, (V,), generator=g).numpy(), VD)
    m.init_weights(torch.randn(V, H, generator=g), torch.randn(V, H, generator=g), vocab.d2t, seed=seed)
    return m


def ttt_batch(m: Eagle3Draft, seed=0):
    """The packed rows of DOCS: tokens, features, final hidden states and the target's head rows."""
    g = torch.Generator().manual_seed(seed)
    B, T = DOCS.shape
    ids = torch.randint(0, V, (B, T), generator=g)  # some outside the draft vocabulary
    aux, final = torch.randn(B, T, 3 * H, generator=g), torch.randn(B, T, H, generator=g)
    mask = (torch.rand(B, T, generator=g) < 0.8).long() * (DOCS >= 0)
    return ids, aux, final, torch.randn(VD, H, generator=g), mask


def run_both(m, steps, autocast, freeze_head=False):
    """(old, new) as the trainer runs them: compact targets, loss = sum_i scale_i loss_sum_i, backward; each as
    (loss_sum, correct, count, gradients of the trainable parameters)."""
    ids, aux, final, head, mask = ttt_batch(m)
    m.lm_head.weight.requires_grad_(not freeze_head)
    scale = step_weights(steps, 0.8) / 50
    out = []
    for impl in ("old", "new"):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            need = needed_rows(valid_masks(ids, mask, DOCS, m.t2d, steps))
            if impl == "old":
                logp, index = ref.sparse_target_logp(final, head, need)
                r = ref.ttt_forward(m, ids, aux, logp, mask, steps, POS, DOCS, index)
            else:
                target, index = sparse_target_logp(final, head, need)
                r = ttt_forward(m, ids, aux, target, mask, steps, POS, DOCS, index, scale)
            (r.loss_sum.float() * scale).sum().backward()
        out.append((r.loss_sum.detach(), r.correct, r.count,
                    [p.grad.clone() for p in m.parameters() if p.requires_grad]))
    return out


@pytest.mark.parametrize("freeze_head", [False, True])
def test_ttt_forward_equals_the_old_implementation(freeze_head):
    """Two layers, four TTT steps on packed rows: the same losses, hits, counts and parameter gradients."""
    m = small_draft()
    (l0, c0, n0, g0), (l1, c1, n1, g1) = run_both(m, 4, autocast=False, freeze_head=freeze_head)
    assert torch.equal(n0, n1) and int(n0.sum()) > 20 and torch.equal(c0, c1)
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
    assert len(g0) == len(g1)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_ttt_forward_under_bf16_autocast_is_close_to_the_old():
    m = small_draft(1)
    (l0, _, n0, g0), (l1, _, n1, g1) = run_both(m, 3, autocast=True)
    assert torch.equal(n0, n1)
    torch.testing.assert_close(l1, l0, rtol=2e-2, atol=2e-2)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=0.1, atol=2e-2)


def test_ttt_forward_takes_every_target_form():
    """Full [B,T,Vd] log-probs, TargetRows over [B,T,H], and the compact forms give the same loss."""
    m = small_draft()
    ids, aux, final, head, mask = ttt_batch(m)
    need = needed_rows(valid_masks(ids, mask, DOCS, m.t2d, 3))
    compact, index = sparse_target_logp(final, head, need)
    forms = [(torch.log_softmax(final @ head.T, -1), None), (TargetRows(final, head), None), (compact, index),
             (torch.log_softmax(compact.final @ head.T, -1), index)]
    with torch.no_grad():
        losses = [ttt_forward(m, ids, aux, t, mask, 3, POS, DOCS, i).loss_sum for t, i in forms]
    for other in losses[1:]:
        torch.testing.assert_close(other, losses[0], rtol=1e-5, atol=1e-5)


def test_objective_gradients_with_and_without_the_step_weights():
    """TTTObjective (what the trainer calls): with step_scale the head's weight gradient is made in the forward,
    without it in the backward; the same gradients either way, and validation (no_grad) gives the same sums."""
    m = small_draft(2)
    ids, aux, final, head, mask = ttt_batch(m)
    objective = TTTObjective(m, 3)
    scale = step_weights(3, 0.8) / 40
    target, index = sparse_target_logp(final, head, needed_rows(valid_masks(ids, mask, DOCS, m.t2d, 3)))
    grads = []
    for announced in (scale, None):
        m.zero_grad(set_to_none=True)
        loss_sum, _, _ = objective(ids, aux, target, index, mask, POS, DOCS, announced)
        (loss_sum * scale).sum().backward()
        grads.append([p.grad for p in m.parameters() if p.requires_grad])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        torch.testing.assert_close(objective(ids, aux, target, index, mask, POS, DOCS)[0], loss_sum.detach())


class LargestTensor(TorchDispatchMode):
    """The element count of the largest tensor any op makes (forward and backward) while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.largest = max([self.largest, *sizes])
        return out


def largest_in_ttt(T: int, Vd: int = 4000) -> int:
    cfg = DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      vocab_size=Vd, draft_vocab_size=Vd, target_hidden_size=32, feature_layers=(2, 3, 4))
    m = Eagle3Draft(cfg)
    m.t2d.fill_(True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, Vd, (1, T), generator=g)
    mask = torch.ones(1, T, dtype=torch.long)
    aux, final, head = torch.randn(1, T, 96, generator=g), torch.randn(1, T, 32, generator=g), torch.randn(Vd, 32)
    with LargestTensor() as seen:
        target, index = sparse_target_logp(final, head, needed_rows(valid_masks(ids, mask, mask - 1, m.t2d, 3)))
        r = ttt_forward(m, ids, aux, target, mask, 3, target_index=index, step_scale=torch.ones(3))
        r.loss_sum.sum().backward()
    return seen.largest


def test_memory_is_linear_in_t_and_flat_in_vocabulary_x_length(monkeypatch):
    """No [T,T] tensor (attention scores, mask) and no [N,Vd] one: with query chunks of 64 rows and cross-entropy
    blocks of 128 rows, the largest tensor of a TTT forward and backward at 2T = 1024 is at most 2.2x the one at
    T = 512 (a T^2 tensor would make it 4x), and exactly the one at T when the draft vocabulary dominates (a
    [block, Vd] block, whatever the number of rows)."""
    monkeypatch.setitem(cross_entropy.SIZES, "cpu", (128, 16))
    monkeypatch.setitem(eyas_attention.CHUNK, "cpu", 64)
    small, large = largest_in_ttt(512, Vd=64), largest_in_ttt(1024, Vd=64)
    assert large <= 2.2 * small, (small, large)
    assert largest_in_ttt(512) == largest_in_ttt(1024) == 128 * 4000


def test_expected_acceptance_length_is_the_mean_accepted_run_of_independent_positions():
    """1 + sum_k prod_{j<k} acc_j is the mean of (1 + the leading run of accepted positions) when position j is
    accepted with probability acc_j independently: checked against 200,000 simulated chains."""
    import numpy as np

    from eyas.train.heldout import expected_acceptance_length

    acc = [0.8, 0.6, 0.5, 0.3]
    rng = np.random.default_rng(0)
    accepted = rng.random((200_000, len(acc))) < np.array(acc)
    run = np.cumprod(accepted, axis=1).sum(axis=1)  # leading accepted positions
    assert expected_acceptance_length(acc) == pytest.approx(1 + run.mean(), abs=0.01)
    assert expected_acceptance_length(acc) == pytest.approx(1 + 0.8 + 0.48 + 0.24 + 0.072)
    assert expected_acceptance_length(acc, chain=2) == pytest.approx(1 + 0.8 + 0.48)
    assert expected_acceptance_length([1.0, 1.0, 1.0]) == 4.0 and expected_acceptance_length([0.0, 1.0]) == 1.0
