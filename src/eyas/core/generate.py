"""Batched generation for Llama-family targets: many prompts decoded together over one preallocated cache.

`eyas regenerate` answers thousands of prompts with the target. On a CPU one decoding step of a small model costs
about the same for 1 row as for 32 (per-layer overhead and reading the weights dominate, not arithmetic), so
throughput comes from width, and from a lean step: fused [q|k|v] and [gate|up] projections, a cache written in
place ([L, B, nkv, cap, hd], no per-step concatenation as in transformers' DynamicCache), no logits processors.

Rows are left-padded to the longest prompt. Row b's pad columns are masked out of every attention, and its
positions start at 0 at its first real token, so each row is decoded as if it were alone (up to the rounding of
a batched matmul). A row stops at a stop token or at `max_new`; the batch stops when all rows have.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eyas.core.memory import to_hugepages

LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2")  # pre-norm, RoPE, SiLU-gated MLP, no extra norms


def fuse_projections(layers) -> tuple[list, list, list]:
    """Per layer: [q|k|v] weight, its bias (or None) and [gate|up] weight, one matmul each instead of five."""
    wqkv, bqkv, wgu = [], [], []
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        wqkv.append(torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)))
        b = [p.bias for p in (a.q_proj, a.k_proj, a.v_proj)]
        bqkv.append(torch.cat(b) if b[0] is not None else None)
        wgu.append(torch.cat((m.gate_proj.weight, m.up_proj.weight)))
    packed = iter(to_hugepages([w for w in (*wqkv, *bqkv, *wgu) if w is not None]))  # eyas.core.memory
    return ([next(packed) for _ in wqkv], [None if b is None else next(packed) for b in bqkv],
            [next(packed) for _ in wgu])


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, the rotate-half convention of transformers' Llama."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def layer_forward(layer, weights: tuple, heads: tuple[int, int, int], x: torch.Tensor, cos, sin,
                  k: torch.Tensor, v: torch.Tensor, start: int, attend) -> torch.Tensor:
    """One pre-norm Llama decoder layer over x [B,q,H] at cache columns start..start+q: its keys and values are
    written into k, v [B,nkv,cap,hd] in place, `attend(q, k, v)` [B,nh,q,hd] attends over columns :start+q.
    `weights` = (fused [q|k|v], its bias or None, fused [gate|up]) from fuse_projections; heads = (nh, nkv, hd)."""
    wqkv, bqkv, wgu = weights
    nh, nkv, hd = heads
    B, q, _ = x.shape
    end = start + q
    qs, ks, vs = F.linear(layer.input_layernorm(x), wqkv, bqkv).split((nh * hd, nkv * hd, nkv * hd), dim=-1)
    qs = rotate(qs.view(B, q, nh, hd).transpose(1, 2), cos, sin)  # [B,nh,q,hd]
    k[:, :, start:end] = rotate(ks.view(B, q, nkv, hd).transpose(1, 2), cos, sin)
    v[:, :, start:end] = vs.view(B, q, nkv, hd).transpose(1, 2)
    o = attend(qs, k[:, :, :end], v[:, :, :end])  # [B,nh,q,hd]
    x = x + layer.self_attn.o_proj(o.transpose(1, 2).reshape(B, q, nh * hd))
    g, u = F.linear(layer.post_attention_layernorm(x), wgu).chunk(2, dim=-1)
    return x + layer.mlp.down_proj(F.silu(g) * u)


def supports(target) -> bool:
    return getattr(target.text_config, "model_type", "") in LEAN_MODEL_TYPES


class BatchGenerator:
    """Greedy or sampled decoding of a batch of prompts (token id lists) with a Llama-family target."""

    def __init__(self, target):
        cfg = target.text_config
        self.target, self.model = target, target.model
        self.nh = int(cfg.num_attention_heads)
        self.nkv = int(getattr(cfg, "num_key_value_heads", None) or self.nh)
        self.hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh)
        self.layers = list(target.decoder_layers())
        self.wqkv, self.bqkv, self.wgu = fuse_projections(self.layers)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new: int, stops: set[int], temperature: float = 0.0,
                 top_p: float = 1.0, generator: torch.Generator | None = None) -> list[list[int]]:
        """The new tokens of each row, a stop token included when one ended it."""
        dev = self.target.device
        B, W = len(prompts), max(len(p) for p in prompts)
        pad = torch.tensor([W - len(p) for p in prompts], device=dev)  # [B]
        ids = torch.tensor([[0] * (W - len(p)) + list(p) for p in prompts], device=dev)  # [B,W]
        cols = torch.arange(W + max_new, device=dev)
        valid = cols[None] >= pad[:, None]  # [B,S] real (non-pad) columns; generated columns are all real
        self.k = torch.empty(len(self.layers), B, self.nkv, W + max_new, self.hd, dtype=self.target.dtype, device=dev)
        self.v = torch.empty_like(self.k)
        pos = (cols[None, :W] - pad[:, None]).clamp(min=0)  # [B,W] positions from each row's first real token
        causal = cols[:W, None] >= cols[None, :W]  # [W,W]
        mask = (causal[None] & valid[:, None, :W]) | torch.eye(W, dtype=torch.bool, device=dev)  # pad rows: self
        logits = self._forward(ids, pos, 0, mask[:, None])  # [B,V]
        out: list[list[int]] = [[] for _ in range(B)]
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        stop = torch.tensor(sorted(stops), device=dev)
        for step in range(max_new):
            tok = self._pick(logits, temperature, top_p, generator)  # [B]
            for b, t in enumerate(tok.tolist()):
                if not done[b]:
                    out[b].append(t)
            done |= torch.isin(tok, stop)
            if bool(done.all()) or step + 1 == max_new:
                break
            col = W + step
            logits = self._forward(tok[:, None], (pos[:, -1:] + step + 1), col, valid[:, None, None, :col + 1])
        return out

    @staticmethod
    def _pick(logits: torch.Tensor, temperature: float, top_p: float, generator) -> torch.Tensor:
        """Greedy at temperature 0; else sampled from softmax(logits / T) restricted to the top-p mass."""
        if temperature == 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits.float() / temperature, dim=-1)  # [B,V]
        if top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            keep = sorted_p.cumsum(dim=-1) - sorted_p < top_p  # the smallest prefix reaching top_p (first always)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, start: int, mask: torch.Tensor) -> torch.Tensor:
        """ids [B,q] at cache columns start..start+q, positions [B,q], mask [B,1,q,start+q] -> last logits [B,V]."""
        body = self.model.model
        x = body.embed_tokens(ids)  # [B,q,H]
        cos, sin = body.rotary_emb(x, pos)  # [B,q,hd]
        cos, sin = cos[:, None], sin[:, None]

        def sdpa(qs, ks, vs):
            return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=self.nkv != self.nh)

        for i, layer in enumerate(self.layers):
            x = layer_forward(layer, (self.wqkv[i], self.bqkv[i], self.wgu[i]), (self.nh, self.nkv, self.hd), x,
                              cos, sin, self.k[i], self.v[i], start, sdpa)
        return self.model.lm_head(body.norm(x[:, -1]))  # [B,V]
