"""The EAGLE-3 draft, its vocabulary and training-time test, against hand computations."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from eyas.draft.attention import chain_attention
from eyas.draft.checkpoint import read_draft, save_draft
from eyas.draft.model import DraftConfig, Eagle3Draft
from eyas.draft.ttt import shift_left, target_log_probs, ttt_forward
from eyas.draft.vocab import build_draft_vocab, count_tokens

V, H = 50, 16


def small_draft(draft_vocab=20, seed=0, **flags) -> Eagle3Draft:
    cfg = DraftConfig(hidden_size=H, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                      vocab_size=V, draft_vocab_size=draft_vocab, target_hidden_size=H, feature_layers=(2, 3, 4),
                      **flags)
    m = Eagle3Draft(cfg)
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 5, (V,), generator=g).numpy()
    vocab = build_draft_vocab(counts, draft_vocab)
    m.init_weights(torch.randn(V, H, generator=g), torch.randn(V, H, generator=g), vocab.d2t, seed=seed)
    if flags:  # norms away from ones, so that one applied or left out shows
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("norm.weight") or name.startswith("fc_norm."):
                    p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    return m


VARIANTS = [{}, {"fc_norm": True, "norm_output": True},
            {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True}]


def test_vocab_top_k_and_fill():
    counts = np.zeros(10, dtype=np.int64)
    counts[[7, 3, 5]] = [5, 9, 5]
    v = build_draft_vocab(counts, 5)
    ids = v.target_ids().tolist()
    assert ids == [0, 1, 3, 5, 7]  # 3 seen ids, then the lowest unused (0, 1); ascending
    assert v.t2d.nonzero().flatten().tolist() == ids
    assert v.coverage == 1.0 and v.distinct_seen == 3
    v2 = build_draft_vocab(counts, 2)  # 3 (9), then the tie 5 vs 7 at 5 -> lower id 5
    assert v2.target_ids().tolist() == [3, 5]
    assert abs(v2.coverage - 14 / 19) < 1e-12


def test_count_tokens_only_masked():
    c = count_tokens([(np.array([1, 2, 2, 3]), np.array([0, 1, 1, 0]))], 5)
    assert c.tolist() == [0, 0, 2, 0, 0]


def test_save_load_roundtrip(tmp_path):
    m = small_draft()
    save_draft(m, tmp_path / "d", extra={"training": {"steps": 3}})
    m2 = read_draft(tmp_path / "d")
    for (k, a), (k2, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    assert m2.cfg == m.cfg


def test_ttt_k1_equals_hand_cross_entropy():
    torch.manual_seed(0)
    m = small_draft()
    T = 9
    ids = m.target_ids()[torch.randint(0, 20, (1, T))]  # all tokens in the draft vocabulary
    aux = torch.randn(1, T, 3 * H)
    final = torch.randn(1, T, H)
    head = torch.randn(20, H)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    logp = target_log_probs(final, head)
    r = ttt_forward(m, ids, aux, logp, mask, steps=1)
    # by hand: plain causal draft pass over (fc(aux_t), embed(x_{t+1})), CE against p_{t+1} where m[t+2] = 1
    h, _ = m(shift_left(ids, 1), aux, torch.arange(T)[None])
    logq = F.log_softmax(m.logits(h), -1)[0]
    total, n = 0.0, 0
    for t in range(T - 2):
        if mask[0, t + 2]:
            total += -(logp[0, t + 1].exp() * logq[t]).sum()
            n += 1
    assert int(r.count[0]) == n == 6
    torch.testing.assert_close(r.loss_sum[0], torch.as_tensor(total), rtol=1e-5, atol=1e-5)


def test_chain_attention_mask_matches_explicit_inference_mask():
    """Step 2 attention equals plain attention over [step-0 keys (causal), step-1 keys, step-2 keys] with a mask that
    lets position t see step-0 positions <= t and only its own entries of steps 1 and 2."""
    torch.manual_seed(1)
    B, nh, nkv, T, d = 1, 4, 2, 6, 8
    q = torch.randn(B, nh, T, d)
    ks = [torch.randn(B, nkv, T, d) for _ in range(3)]
    vs = [torch.randn(B, nkv, T, d) for _ in range(3)]
    got = chain_attention(q, ks, vs, torch.zeros(B, T, dtype=torch.long))
    K = torch.cat(ks, 2).repeat_interleave(2, 1)
    Vv = torch.cat(vs, 2).repeat_interleave(2, 1)
    eye = torch.eye(T, dtype=torch.bool)
    full = torch.cat([torch.ones(T, T, dtype=torch.bool).tril(), eye, eye], 1)  # [T, 3T]
    want = F.scaled_dot_product_attention(q, K, Vv, attn_mask=full)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flags", VARIANTS, ids=["plain", "eagle-3.1", "speculators-0.9"])
def test_ttt_step1_equals_inference_with_cache(flags):
    """TTT step 1 at position t equals what inference computes: prefix from target features in the cache, then
    one draft step on the draft's own output at position t+1 (read post-norm with norm_output, on both sides)."""
    torch.manual_seed(2)
    m = small_draft(**flags)
    T = 7
    ids = m.target_ids()[torch.randint(0, 20, (1, T))]
    aux = torch.randn(1, T, 3 * H)
    head = torch.randn(20, H)
    logp = target_log_probs(torch.randn(1, T, H), head)
    # reference: for a position t, run prefix 0..t from features, then the draft step with its own hidden
    t = 3
    h0, cache = m(shift_left(ids, 1)[:, : t + 1], aux[:, : t + 1], torch.arange(t + 1)[None])
    h1, _ = m(ids[:, t + 2: t + 3], h0[:, t:t + 1], torch.tensor([[t + 1]]), cache=cache)
    want = F.log_softmax(m.logits(h1[0, 0]), -1)
    # TTT with 2 steps, mask only the step-1 prediction at t (x[t+3])
    mask = torch.zeros(1, T, dtype=torch.long)
    mask[0, t + 3] = 1
    r = ttt_forward(m, ids, aux, logp, mask, steps=2)
    assert r.count.tolist() == [1, 1]  # step 0 counts t+1 (predicting x[t+3]), step 1 counts t
    loss_ref = -(logp[0, t + 2].exp() * want).sum()
    torch.testing.assert_close(r.loss_sum[1], loss_ref, rtol=1e-5, atol=1e-5)


def test_packed_documents_do_not_mix():
    torch.manual_seed(3)
    m = small_draft()
    a = m.target_ids()[torch.randint(0, 20, (1, 6))]
    b = m.target_ids()[torch.randint(0, 20, (1, 5))]
    aux_a, aux_b = torch.randn(1, 6, 3 * H), torch.randn(1, 5, 3 * H)
    head = torch.randn(20, H)
    lp_a, lp_b = target_log_probs(torch.randn(1, 6, H), head), target_log_probs(torch.randn(1, 5, H), head)
    ma, mb = torch.ones(1, 6, dtype=torch.long), torch.ones(1, 5, dtype=torch.long)
    ra = ttt_forward(m, a, aux_a, lp_a, ma, steps=3)
    rb = ttt_forward(m, b, aux_b, lp_b, mb, steps=3)
    packed = ttt_forward(m, torch.cat([a, b], 1), torch.cat([aux_a, aux_b], 1), torch.cat([lp_a, lp_b], 1),
                         torch.cat([ma, mb], 1), steps=3,
                         position_ids=torch.cat([torch.arange(6), torch.arange(5)])[None],
                         doc_ids=torch.tensor([[0] * 6 + [1] * 5]))
    assert torch.equal(packed.count, ra.count + rb.count)
    torch.testing.assert_close(packed.loss_sum, ra.loss_sum + rb.loss_sum, rtol=1e-5, atol=1e-5)


def _cat_reference(m: Eagle3Draft, ids, hidden, pos, kv):
    """The draft's forward with a cache grown by concatenation: what Eagle3Draft.forward computed before its cache
    was preallocated, from the same layer pieces."""
    if hidden.shape[-1] == 3 * m.cfg.target_hidden_size:
        hidden = m.fuse(hidden)
    embeds = m.embed_tokens(ids).to(hidden.dtype)
    cos, sin = m.rope(pos, hidden.dtype)
    S, T = (kv[0][0].shape[2] if kv else 0), ids.shape[1]
    mask = torch.ones(T, S + T, dtype=torch.bool).tril(S)[None, None]
    out = []
    for i, layer in enumerate(m.all_layers()):
        q, k, v, residual = layer.qkv(hidden, embeds, cos, sin)
        if kv:
            k, v = torch.cat((kv[i][0], k), dim=2), torch.cat((kv[i][1], v), dim=2)
        out.append((k, v))
        hidden = layer.finish(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), residual)
    return hidden, out


def test_preallocated_cache_equals_concatenation_and_keeps_committed_positions(monkeypatch):
    """Decoding in place over a preallocated cache gives the concatenating cache's outputs, across a regrowth of
    its buffers; a speculative pass past a committed cache (tokens later rejected) leaves that cache as it was."""
    from eyas.draft.model import KVCache

    monkeypatch.setattr(KVCache, "MIN_CAPACITY", 4)  # so the buffers grow (twice) within a few steps
    torch.manual_seed(3)
    m = small_draft().eval()
    ids, aux = m.target_ids()[torch.randint(0, 20, (1, 12))], torch.randn(1, 12, 3 * H)
    with torch.no_grad():
        h, cache = m(ids[:, :3], aux[:, :3], torch.arange(3)[None])
        h_ref, ref = _cat_reference(m, ids[:, :3], aux[:, :3], torch.arange(3)[None], None)
        torch.testing.assert_close(h, h_ref)
        committed, committed_ref = cache, ref
        for p in range(3, 12):  # one position at a time, as the chain drafter does
            h, cache = m(ids[:, p:p + 1], h[:, -1:], torch.tensor([[p]]), cache)
            h_ref, ref = _cat_reference(m, ids[:, p:p + 1], h_ref[:, -1:], torch.tensor([[p]]), ref)
            torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-6)
        assert cache.length == 12 and cache.capacity >= 12
        # a new pass from the committed cache of 3 positions: the speculative writes above did not change it
        h2, _ = m(ids[:, 3:5], aux[:, 3:5], torch.arange(3, 5)[None], committed)
        h2_ref, _ = _cat_reference(m, ids[:, 3:5], aux[:, 3:5], torch.arange(3, 5)[None], committed_ref)
        torch.testing.assert_close(h2, h2_ref, rtol=1e-5, atol=1e-6)


def test_fc_norm_normalises_each_target_feature_before_fc(tmp_path):
    """EAGLE-3.1's fc_norm: fc(cat(w_i * x_i / rms(x_i))) over the three features, by hand; each feature's scale
    no longer reaches the draft; saved and read back with the flag."""
    cfg = DraftConfig(hidden_size=H, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                      vocab_size=V, draft_vocab_size=20, target_hidden_size=H, feature_layers=(2, 3, 4), fc_norm=True)
    m = Eagle3Draft(cfg)
    g = torch.Generator().manual_seed(1)
    m.init_weights(torch.randn(V, H, generator=g), torch.randn(V, H, generator=g), torch.zeros(20, dtype=torch.long))
    assert all(torch.equal(n.weight, torch.ones(H)) for n in m.fc_norm)  # initialised as the other norms
    with torch.no_grad():
        for n in m.fc_norm:
            n.weight.copy_(torch.rand(H, generator=g) + 0.5)
    aux = torch.randn(2, 5, 3 * H, generator=g) * torch.tensor([1.0, 30.0, 0.01]).repeat_interleave(H)
    parts = aux.split(H, dim=-1)
    by_hand = torch.cat([n.weight * x / x.pow(2).mean(-1, keepdim=True).add(cfg.rms_norm_eps).sqrt()
                         for n, x in zip(m.fc_norm, parts)], dim=-1) @ m.fc.weight.T
    with torch.no_grad():
        assert torch.allclose(m.fuse(aux), by_hand, atol=1e-5)
        scaled = torch.cat((parts[0] * 100, parts[1], parts[2]), dim=-1)
        assert torch.allclose(m.fuse(scaled), m.fuse(aux), atol=1e-4)  # the scale of a feature is gone
    save_draft(m, tmp_path / "d")
    back = read_draft(tmp_path / "d")
    assert back.cfg.fc_norm and torch.equal(back.fc_norm[2].weight, m.fc_norm[2].weight)
    plain = small_draft()
    assert plain.fc_norm is None and "fc_norm.0.weight" not in plain.state_dict()


def test_the_eagle31_switches_compute_as_vllm_does_by_hand():
    """norm_before_fc: fc(w * x / rms(x)) over the three features together (vLLM's input_norm); norm_before_residual:
    the first layer's residual is hidden_norm(g); norm_output: a step's output is read through the final norm by
    the next step. fc_norm and norm_before_fc exclude each other."""
    m = small_draft(norm_before_fc=True, norm_before_residual=True, norm_output=True)
    plain = small_draft()
    plain.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("input_norm.")})
    g = torch.Generator().manual_seed(3)
    aux = torch.randn(1, 5, 3 * H, generator=g) * 7
    rms = aux.pow(2).mean(-1, keepdim=True).add(m.cfg.rms_norm_eps).sqrt()
    with torch.no_grad():
        torch.testing.assert_close(m.fuse(aux), (m.input_norm.weight * aux / rms) @ m.fc.weight.T)
        gfused = m.fuse(aux)
        cos, sin = m.rope(torch.arange(5)[None], gfused.dtype)
        embeds = m.embed_tokens(torch.arange(5)[None])
        residual = m.midlayer.qkv(gfused, embeds, cos, sin)[3]
        torch.testing.assert_close(residual, m.midlayer.hidden_norm(gfused))
        assert torch.equal(plain.midlayer.qkv(gfused, embeds, cos, sin)[3], gfused)  # the raw g otherwise
        h = torch.randn(1, 1, H, generator=g)
        ids, pos = torch.tensor([[3]]), torch.tensor([[5]])
        torch.testing.assert_close(m(ids, h, pos)[0], plain_with_residual_norm(m)(ids, m.norm(h), pos)[0])
    with pytest.raises(ValueError, match="exclude each other"):
        small_draft(fc_norm=True, norm_before_fc=True)


def plain_with_residual_norm(m):
    """`m` without norm_output (the same weights): what reads a hidden state as it is given."""
    other = Eagle3Draft(DraftConfig(**{**m.cfg.to_dict(), "norm_output": False, "feature_layers": (2, 3, 4),
                                       "target": ()}))
    other.load_state_dict(m.state_dict())
    return other


def test_init_from_layer_refuses_another_shape_and_a_missing_weight():
    m = small_draft()
    layer = {k.replace("hidden_norm", "input_layernorm"): v.clone() for k, v in m.midlayer.state_dict().items()
             if not k.startswith("input_layernorm")}
    for x in "qkv":  # a target layer reads H, not 2H
        layer[f"self_attn.{x}_proj.weight"] = layer[f"self_attn.{x}_proj.weight"][:, H:]
    assert len(m.init_from_layer(layer)) == 9
    layer["mlp.up_proj.weight"] = torch.zeros(7, H)
    try:
        m.init_from_layer(layer)
        raise AssertionError("a wrong shape was taken")
    except ValueError as e:
        assert "mlp.up_proj.weight is [7, 16]" in str(e)
    layer["mlp.up_proj.weight"] = torch.zeros(32, H)
    layer["self_attn.q_proj.bias"] = torch.zeros(16)  # a Qwen2 layer: the draft layer has no bias to take it
    try:
        m.init_from_layer(layer)
        raise AssertionError("a bias was dropped")
    except ValueError as e:
        assert "weights the draft layer lacks: self_attn.q_proj.bias" in str(e)
    del layer["self_attn.q_proj.bias"], layer["mlp.up_proj.weight"]
    try:
        m.init_from_layer(layer)
        raise AssertionError("a missing weight was taken")
    except ValueError as e:
        assert "no weight 'mlp.up_proj.weight'" in str(e)
