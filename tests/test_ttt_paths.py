"""The GPU's TTT path against the CPU's and the T^2 reference (tests/ttt_reference.py): flex_attention with the
chain block mask, the static-shape loss over every position of every step (eyas.draft.static_loss), and the whole
step compiled with torch.compile(fullgraph=True), i.e. without one graph break (a host synchronisation such as
.tolist() or a data-dependent shape breaks the graph).

PyTorch has no flex_attention backward on the CPU (flex_attention refuses inputs that require gradients there):
the gradient tests lift that refusal, so torch's unfused reference implementation of flex_attention (its forward
and backward) runs our block mask and key layout; the fused GPU kernel is checked by bench/gpu_check.py."""

from __future__ import annotations

import pytest
import torch

from eyas.draft.attention import chain_attention, chain_block_masks, flex_chain_attention, static_chunks
from eyas.draft.cross_entropy import TargetRows, soft_cross_entropy
from eyas.draft.static_loss import static_cross_entropy
from eyas.draft.ttt import step_weights, ttt_forward
from tests.test_ttt import DOCS, POS, attention_inputs, reference_attention, small_draft, ttt_batch

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def cpu_flex_backward(monkeypatch):
    """Let flex_attention's reference implementation make gradients on the CPU (see the module docstring)."""
    monkeypatch.setattr("torch.nn.attention.flex_attention._validate_device", lambda *a: None)


@pytest.mark.parametrize("n", [1, 2, 4])  # TTT steps 0, 1, 3
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_chain_attention_equals_the_t2_reference(n, dtype, cpu_flex_backward):
    """Output and every input's gradient, packed rows (three documents and padding; four, one of a single token),
    grouped-query heads, blocks of 8 so that the block mask skips and splits blocks."""
    q, ks, vs = attention_inputs(n, dtype)
    inputs = [q, *ks, *vs]
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(9)).to(dtype)
    want = reference_attention(q, ks, vs, DOCS)
    want_grads = torch.autograd.grad(want, inputs, grad.to(want.dtype))
    got = flex_chain_attention(q, ks, vs, chain_block_masks(DOCS, n, block=8)[n - 1])
    got_grads = torch.autograd.grad(got, inputs, grad)
    assert got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.to(want.dtype), want, **tol)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a.to(b.dtype), b, **tol)


def test_the_block_mask_skips_what_no_query_needs():
    """At T = 1024 with one document per 256 positions, step 3's mask over 4T keys keeps about the blocks on and
    below the diagonal of each document plus three diagonals: a seventh of the dense [T, 4T]."""
    docs = torch.arange(1024).div(256, rounding_mode="floor")[None]
    mask = chain_block_masks(docs, 4)[3]
    kept = int(mask.kv_num_blocks.sum() + (mask.full_kv_num_blocks.sum() if mask.full_kv_num_blocks is not None
                                           else 0))
    blocks = 8 * 32  # [1024/128 query blocks, 4096/128 key blocks]
    assert kept == 4 * 3 + 3 * 8  # 4 documents of 2x2 blocks (3 on or below the diagonal), 3 diagonals of 8
    assert kept / blocks < 0.2


def test_static_chunks_equal_the_reference():
    """The chunked kernel with chunks fixed by T (nothing read from doc_ids): the same output and gradients."""
    q, ks, vs = attention_inputs(3, torch.float32)
    inputs = [q, *ks, *vs]
    want = reference_attention(q, ks, vs, DOCS)
    got = chain_attention(q, ks, vs, DOCS, static_chunks(DOCS.shape[1], 8))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    for a, b in zip(torch.autograd.grad(got, inputs, g), torch.autograd.grad(want, inputs, g.double())):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form, weighted, kind", [("table", True, "ce"), ("rows", True, "ce"), ("table", False, "ce"),
                                                  ("rows", False, "ce"), ("rows", True, "tv"),
                                                  ("table", False, "nla"), ("rows", True, "lk-hybrid")])
def test_static_cross_entropy_equals_the_gathered_one(form, weighted, kind, monkeypatch):
    """Every position of k = 3 steps, weight 0 where a step does not count: the counted rows' loss, hits and the
    gradients of h and W equal eyas.draft.cross_entropy's on the gathered rows (blocks of 5 positions, so that a
    block's target rows run into the next block's and past the row's end)."""
    monkeypatch.setitem(__import__("eyas.draft.static_loss", fromlist=["BLOCK"]).BLOCK, "cpu", 5)
    g = torch.Generator().manual_seed(0)
    k, B, T, H, Vd = 3, 2, 13, 8, 11
    h = torch.randn(k, B, T, H, generator=g, dtype=torch.float64).float().requires_grad_()
    W = torch.randn(Vd, H, generator=g).requires_grad_()
    final, head = torch.randn(B, T, H, generator=g), torch.randn(Vd, H, generator=g)
    target = TargetRows(final, head) if form == "rows" else torch.log_softmax(final @ head.T, -1)
    valid = torch.rand(k, B, T, generator=g) < 0.7
    for i in range(k):
        valid[i, :, T - 1 - i:] = False  # no target row past the end
    scale = torch.tensor([1.0, 0.8, 0.64]) / 7
    weight = valid.float() * scale[:, None, None]
    loss, hit = static_cross_entropy(h, W, target, weight if weighted else None, kind)
    (torch.where(valid, loss, 0.0).sum((1, 2)) * scale).sum().backward()
    gh, gW = h.grad.clone(), W.grad.clone()
    h.grad = W.grad = None
    i, b, t = valid.nonzero(as_tuple=True)
    flat = TargetRows(final.reshape(B * T, H), head) if form == "rows" else target.reshape(B * T, Vd)
    ref_loss, ref_hit = soft_cross_entropy(h[i, b, t], W, flat, b * T + t + 1 + i, scale[i], kind)
    (ref_loss * scale[i]).sum().backward()
    torch.testing.assert_close(loss[valid], ref_loss, rtol=1e-5, atol=1e-5)
    assert torch.equal(hit[valid], ref_hit)
    torch.testing.assert_close(gh, h.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gW, W.grad, rtol=1e-5, atol=1e-6)


def run_path(m, steps, path, attention=None, autocast=False, compiled=False):
    """As the trainer runs a step: loss = sum_i scale_i loss_sum_i, backward -> (loss_sum, correct, count, grads).
    The gathered path takes compact targets, the static path the full ones."""
    from eyas.train.batches import needed_rows, sparse_target_logp, valid_masks

    ids, aux, final, head, mask = ttt_batch(m)
    scale = step_weights(steps, 0.8) / 50
    m.zero_grad(set_to_none=True)
    if path == "gathered":
        target, index = sparse_target_logp(final, head, needed_rows(valid_masks(ids, mask, DOCS, m.t2d, steps)))
    else:
        target, index = TargetRows(final, head), None

    def loss_of(ids, aux, mask):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            r = ttt_forward(m, ids, aux, target, mask, steps, POS, DOCS, index, scale, path=path, attention=attention)
        return (r.loss_sum.float() * scale).sum(), r

    fn = torch.compile(loss_of, fullgraph=True, backend="aot_eager") if compiled else loss_of
    loss, r = fn(ids, aux, mask)
    loss.backward()
    return r.loss_sum.detach(), r.correct, r.count, [p.grad.clone() for p in m.parameters() if p.requires_grad]


@pytest.mark.parametrize("attention", ["chunked", "flex"])
def test_the_static_path_equals_the_gathered_one(attention, cpu_flex_backward):
    """Two layers, four steps on packed rows: the same losses, hits, counts and parameter gradients."""
    m = small_draft()
    l0, c0, n0, g0 = run_path(m, 4, "gathered")
    l1, c1, n1, g1 = run_path(m, 4, "static", attention)
    assert torch.equal(n0, n1) and int(n0.sum()) > 20 and torch.equal(c0, c1)
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_static_path_under_bf16_autocast_is_close_to_the_gathered_one(cpu_flex_backward):
    m = small_draft(1)
    l0, _, n0, g0 = run_path(m, 3, "gathered", autocast=True)
    l1, _, n1, g1 = run_path(m, 3, "static", "flex", autocast=True)
    assert torch.equal(n0, n1)
    torch.testing.assert_close(l1, l0, rtol=2e-2, atol=2e-2)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b, rtol=0.1, atol=2e-2)


@pytest.mark.parametrize("attention", ["chunked", "flex"])
def test_the_static_step_compiles_as_one_graph(attention, cpu_flex_backward):
    """torch.compile(fullgraph=True) of the draft's forward, TTT, the loss and (traced by AOTAutograd) its backward:
    any graph break (a host read, a shape that depends on data) fails here. The compiled step gives the eager
    step's losses and gradients."""
    torch._dynamo.reset()
    m = small_draft(2)
    want = run_path(m, 3, "static", attention)
    got = run_path(m, 3, "static", attention, compiled=True)
    assert torch.equal(got[2], want[2]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(got[3], want[3], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_gathered_step_does_not_compile_as_one_graph():
    """The control: the CPU's path reads its counts back (hidden[valid]), so fullgraph refuses it; the test above
    can fail."""
    torch._dynamo.reset()
    with pytest.raises(Exception, match="(?i)graph break|data.dependent|dynamic|unsupported"):
        run_path(small_draft(2), 2, "gathered", compiled=True)
