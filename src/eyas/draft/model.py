"""The EAGLE-3 draft model, in pure PyTorch (no ranks, no I/O: its folder is eyas.draft.checkpoint's).

    aux [B,T,3Ht] --fc--> g [B,T,H]          (target's low|mid|high features fused; first step only; with fc_norm
                                              each of the three is RMS-normalised first, as EAGLE-3.1; with
                                              norm_before_fc all three together, speculators' default)
    e = embed(token) [B,T,H]                  (frozen target embeddings)
    x = cat(input_layernorm(e), hidden_norm(g)) [B,T,2H]  -> attention (q/k/v in 2H) -> + g (residual)
      -> post_attention_layernorm -> MLP -> + residual  = h [B,T,H]   (fed forward to the next draft step;
                                                                       with norm_output as norm(h), EAGLE-3.1)
    logits = lm_head(norm(h)) [B,T,Vd]        (draft vocabulary; target id = d + d2t[d])

Parameter names are the Hugging Face Llama ones under `midlayer.` plus `fc`, `norm`, `lm_head`, `d2t`,
`t2d` (and `fc_norm.{0,1,2}` with fc_norm, `input_norm` with norm_before_fc): the names vLLM's and SGLang's
`LlamaForCausalLMEagle3` load. Extra
layers (num_layers > 1) are plain Llama layers named `layers.{i}`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    feature_layers: tuple[int, ...] = (2, 15, 27)  # HF hidden_states indices of the target's low/mid/high features
    num_layers: int = 1
    fc_norm: bool = False  # an RMSNorm on each target feature before fc (EAGLE-3.1; vLLM's `fc_norm`)
    norm_before_fc: bool = False  # one RMSNorm over the three features together before fc (vLLM's `input_norm`)
    norm_output: bool = False  # the next draft step reads the post-norm output (EAGLE-3.1; vLLM's `norm_output`)
    norm_before_residual: bool = False  # the first layer's residual is hidden_norm(g), not g (speculators' default)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    target: tuple[tuple[str, object], ...] = ()  # the target's identity (eyas.core.target.Target.identity()), as items

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if len(self.feature_layers) != 3:
            raise ValueError(f"EAGLE-3 takes exactly 3 feature layers, got {self.feature_layers}")
        if self.fc_norm and self.norm_before_fc:
            raise ValueError("fc_norm (a norm per feature) and norm_before_fc (one over all three) exclude each other")

    @property
    def target_identity(self) -> dict:
        return dict(self.target)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["feature_layers"] = list(self.feature_layers)
        d["target"] = dict(self.target)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in names}
        d["feature_layers"] = tuple(d.get("feature_layers", (2, 15, 27)))
        d["target"] = tuple(sorted(dict(d.get("target", {})).items()))
        return cls(**d)

    @classmethod
    def for_target(cls, target, draft_vocab_size: int, feature_layers=None, num_layers: int = 1,
                   fc_norm: bool = False, norm_before_fc: bool = False, norm_output: bool = False,
                   norm_before_residual: bool = False) -> "DraftConfig":
        """The draft shape EAGLE-3 uses: the target's own layer shape."""
        tc = target.text_config
        heads = int(tc.num_attention_heads)
        kv_heads, head_dim = int(getattr(tc, "num_key_value_heads", heads)), getattr(tc, "head_dim", None)
        if getattr(tc, "kv_lora_rank", None):
            # Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) has no plain layer shape to copy: the draft is
            # a GQA Llama layer (what vLLM's and SGLang's LlamaForCausalLMEagle3 run) of v_head_dim heads
            # spanning the hidden size, 8 key/value heads: 56 x 128 with 8 for hidden 7168, as SpecForge's
            # DeepSeek-V3 draft.
            head_dim = int(tc.v_head_dim)
            heads = target.hidden_size // head_dim
            kv_heads = 8 if heads % 8 == 0 else heads
        rope = getattr(tc, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        return cls(hidden_size=target.hidden_size, intermediate_size=int(tc.intermediate_size),
                   num_attention_heads=heads, num_key_value_heads=kv_heads,
                   head_dim=int(head_dim or target.hidden_size // heads),
                   vocab_size=target.vocab_size, draft_vocab_size=draft_vocab_size,
                   target_hidden_size=target.hidden_size,
                   feature_layers=tuple(feature_layers or target.default_feature_layers()), num_layers=num_layers,
                   fc_norm=fc_norm, norm_before_fc=norm_before_fc, norm_output=norm_output,
                   norm_before_residual=norm_before_residual,
                   rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
                   rope_theta=float(theta or getattr(tc, "rope_theta", 10000.0)),
                   max_position_embeddings=int(getattr(tc, "max_position_embeddings", 8192)),
                   target=tuple(sorted(target.identity().items())))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype  # normalise in float32, as Llama does
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin [*positions.shape, head_dim] for the default (unscaled) Llama rotary embedding."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # [..., hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B,h,T,d]; cos/sin [B,T,d] (broadcast over heads)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig, in_dim: int):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_dim, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(in_dim, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(in_dim, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos, sin):
        """x [B,T,in] -> q [B,nh,T,d], k and v [B,nkv,T,d], rotary applied to q and k."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, attn: torch.Tensor) -> torch.Tensor:
        """attn [B,nh,T,d] -> [B,T,H]"""
        B, _, T, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(B, T, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """A Llama decoder layer. The first one (EAGLE-3's `midlayer`) reads [norm(embeds), hidden_norm(hidden)]."""

    def __init__(self, cfg: DraftConfig, first: bool):
        super().__init__()
        H = cfg.hidden_size
        self.first = first
        self.normed_residual = first and cfg.norm_before_residual
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 2 * H if first else H)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def qkv(self, hidden: torch.Tensor, embeds: torch.Tensor | None, cos, sin):
        """-> (q, k, v, residual). The residual is the raw (un-normalised) hidden, as in EAGLE-3, or with
        norm_before_residual the first layer's hidden_norm(hidden)."""
        if self.first:
            normed = self.hidden_norm(hidden)
            x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)  # [B,T,2H]
            if self.normed_residual:
                hidden = normed
        else:
            x = self.input_layernorm(hidden)
        q, k, v = self.self_attn.qkv(x, cos, sin)
        return q, k, v, hidden

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h = residual + self.self_attn.out(attn)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor | None, cos, sin, attention) -> torch.Tensor:
        """The layer as one module call (what FSDP2 hooks: eyas.train.parallelize shards each layer):
        attention(q, k, v) -> [B,nh,T,d] is the caller's (TTT keeps every step's keys and values)."""
        q, k, v, residual = self.qkv(hidden, embeds, cos, sin)
        return self.finish(attention(q, k, v), residual)


def attend(q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
    """q [B,nh,T,d], k/v [B,nkv,S,d], mask bool [B|1,1,T,S] (True = may attend) -> [B,nh,T,d]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


class KVCache:
    """The draft's keys and values of earlier positions: per layer a buffer [B, nkv, capacity, d], written in place.

    A forward over T new positions writes them at slots S..S+T-1 (S = `length`) and returns a cache of length S+T
    over the same buffers, while the cache it was given keeps length S: positions a speculative pass wrote past a
    committed cache (rejected tokens) are overwritten by the next pass. Nothing is copied per call; a buffer grows
    (doubling, the `length` positions copied) only when S+T exceeds its capacity."""

    MIN_CAPACITY = 256

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int):
        self.keys, self.values, self.length = keys, values, length

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @classmethod
    def holding(cls, cache: KVCache | None, layers: int, like: torch.Tensor, n: int) -> KVCache:
        """`cache` if its buffers hold n positions, else a cache with larger buffers shaped like `like` [B,nkv,T,d]
        (its first `cache.length` positions copied)."""
        if cache is not None and n <= cache.capacity:
            return cache
        B, nkv, _, d = like.shape
        cap = max(cls.MIN_CAPACITY, 2 * n)
        keys = [like.new_empty(B, nkv, cap, d) for _ in range(layers)]
        values = [like.new_empty(B, nkv, cap, d) for _ in range(layers)]
        length = cache.length if cache is not None else 0
        if length:
            for dst, src in zip(keys + values, cache.keys + cache.values):
                dst[:, :, :length] = src[:, :, :length]
        return cls(keys, values, length)

    def write(self, layer: int, at: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Put k, v [B,nkv,T,d] at slots at..at+T-1 of `layer`; -> its keys and values of slots 0..at+T-1."""
        end = at + k.shape[2]
        self.keys[layer][:, :, at:end] = k
        self.values[layer][:, :, at:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # the target's embeddings, frozen
        self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(3)) \
            if cfg.fc_norm else None
        self.input_norm = RMSNorm(3 * cfg.target_hidden_size, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc = nn.Linear(3 * cfg.target_hidden_size, H, bias=False)
        self.midlayer = DraftLayer(cfg, first=True)
        self.layers = nn.ModuleList(DraftLayer(cfg, first=False) for _ in range(cfg.num_layers - 1))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))  # target = d + d2t[d]
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))  # in the draft vocabulary?

    # -- pieces, shared by training-time test (eyas.draft.ttt) and inference (eyas.speculate.decode) ------------
    def all_layers(self) -> list[DraftLayer]:
        return [self.midlayer, *self.layers]

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B,T,3Ht] (low|mid|high target features) -> [B,T,H]."""
        if self.fc_norm is not None:
            aux = torch.cat([norm(x) for norm, x in zip(self.fc_norm, aux.chunk(3, dim=-1))], dim=-1)
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        return self.fc(aux)

    def carry(self, hidden: torch.Tensor) -> torch.Tensor:
        """A step's output [.., H] (pre-norm) as the next draft step reads it: through the final norm with
        norm_output (EAGLE-3.1), as it is otherwise."""
        return self.norm(hidden) if self.cfg.norm_output else hidden

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_theta, dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [.., H] (a layer output, pre-norm) -> draft-vocabulary logits [.., Vd]."""
        return self.lm_head(self.norm(hidden))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_ids(self) -> torch.Tensor:
        """[Vd] the target token id of every draft-vocabulary entry."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    # -- inference: one call over T new tokens with a KV cache -------------------------------------------------
    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                cache: KVCache | None = None, mask: torch.Tensor | None = None):
        """One draft pass over T new positions.

        input_ids [B,T] tokens whose embeddings pair with `hidden`; hidden [B,T,3Ht] (target features, fused
        here by fc) or [B,T,H] (the draft's own previous output, pre-norm: `carry` decides what the step reads);
        position_ids [B,T]; cache: the keys and values
        of S earlier positions, or None; mask bool [B|1,1,T,S+T] (True = may attend), default: all of the cache
        plus causal among the new positions. Returns (h [B,T,H] pre-norm output, the cache of S+T positions).
        The new positions are written in place into the cache's buffers; `cache` itself still holds S.
        """
        if hidden.shape[-1] == 3 * self.cfg.target_hidden_size:  # target features: fuse (3Ht != H always)
            hidden = self.fuse(hidden)
        else:  # the draft's own previous output
            hidden = self.carry(hidden)
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rope(position_ids, hidden.dtype)
        S, T = (cache.length if cache is not None else 0), input_ids.shape[1]
        if mask is None:
            mask = torch.ones(T, S + T, dtype=torch.bool, device=hidden.device).tril(S)[None, None]
        for i, layer in enumerate(self.all_layers()):
            q, k, v, residual = layer.qkv(hidden, embeds, cos, sin)
            cache = KVCache.holding(cache, len(self.all_layers()), k, S + T)
            k, v = cache.write(i, S, k, v)  # [B,nkv,S+T,d] views of the buffers
            hidden = layer.finish(attend(q, k, v, mask), residual)
        return hidden, KVCache(cache.keys, cache.values, S + T)

    # -- initialisation and persistence ----------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, embed: torch.Tensor, head: torch.Tensor, d2t: torch.Tensor, seed: int = 0) -> None:
        """Initialise from the target.

        | parameter          | rule                                                  |
        |--------------------|-------------------------------------------------------|
        | embed_tokens       | the target's input embeddings (frozen)                |
        | lm_head            | the target's output-head rows of the draft vocabulary |
        | d2t, t2d           | from the draft vocabulary (eyas.draft.vocab)                |
        | fc, attention, MLP | normal(0, 0.02), as Llama                             |
        | norms (fc_norm too)| ones                                                  |
        """
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or name.startswith("fc_norm."):
                p.fill_(1.0)
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        self.embed_tokens.weight.copy_(embed)
        self.d2t.copy_(d2t)
        ids = self.target_ids()
        self.t2d.zero_()
        self.t2d[ids] = True
        self.lm_head.weight.copy_(head[ids.to(head.device)])

    @torch.no_grad()
    def init_from_layer(self, layer: dict[str, torch.Tensor]) -> list[str]:
        """Start the draft layer from a target decoder layer's weights (Hugging Face Llama names, relative to the
        layer: self_attn.q_proj.weight, ...), instead of random ones. The attention reads [norm(embeds), hidden]
        of twice the width: the layer's q/k/v weights go to the hidden half (the fused features, which stand where
        the layer's input stood), the embedding half keeps its initialisation; the target's input norm becomes
        hidden_norm; o_proj, the MLP and the post-attention norm are copied. -> the parameters set. A shape that
        differs (a target whose layers are not the draft's shape), or a weight the draft layer lacks (biases, q/k
        norms), is refused."""
        H, done = self.cfg.hidden_size, []
        own = dict(self.midlayer.named_parameters())
        plan = {f"self_attn.{x}_proj.weight": (f"self_attn.{x}_proj.weight", slice(H, 2 * H)) for x in "qkv"}
        plan |= {k: (k, None) for k in ("self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                        "mlp.down_proj.weight", "post_attention_layernorm.weight")}
        plan["hidden_norm.weight"] = ("input_layernorm.weight", None)
        left = sorted(set(layer) - {theirs for theirs, _ in plan.values()})
        if left:  # biases (Qwen2), q/k norms (Qwen3): the draft layer has nowhere to put them
            raise ValueError(f"the target layer has weights the draft layer lacks: {', '.join(left)}")
        for mine, (theirs, cols) in plan.items():
            if theirs not in layer:
                raise ValueError(f"the target layer has no weight {theirs!r}")
            dst = own[mine] if cols is None else own[mine][:, cols]
            src = layer[theirs]
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"the target layer's {theirs} is {list(src.shape)}, the draft's {mine} needs "
                                 f"{list(dst.shape)}")
            dst.copy_(src.to(dst.dtype))
            done.append(mine)
        return done

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]


def num_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)

