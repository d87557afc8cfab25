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
                  k: torch.Tensor, v: torch.Tensor, start: int | torch.Tensor, attend) -> torch.Tensor:
    """One pre-norm Llama decoder layer over x [B,q,H]; its keys and values are written into k, v [B,nkv,cap,hd]
    in place. `start` is either the cache column of x's first position, the same for every row (an int: columns
    start..start+q are written and `attend(q, k, v)` [B,nh,q,hd] gets columns :start+q), or each row's own column
    for one new token per row (a [B] tensor: `attend` gets the whole cache and masks it itself).
    `weights` = (fused [q|k|v], its bias or None, fused [gate|up]) from fuse_projections; heads = (nh, nkv, hd)."""
    wqkv, bqkv, wgu = weights
    nh, nkv, hd = heads
    B, q, _ = x.shape
    qs, ks, vs = F.linear(layer.input_layernorm(x), wqkv, bqkv).split((nh * hd, nkv * hd, nkv * hd), dim=-1)
    qs = rotate(qs.view(B, q, nh, hd).transpose(1, 2), cos, sin)  # [B,nh,q,hd]
    ks = rotate(ks.view(B, q, nkv, hd).transpose(1, 2), cos, sin)  # [B,nkv,q,hd]
    vs = vs.view(B, q, nkv, hd).transpose(1, 2)
    if isinstance(start, int):
        end = start + q
        k[:, :, start:end], v[:, :, start:end] = ks, vs
        o = attend(qs, k[:, :, :end], v[:, :, :end])
    else:
        rows = torch.arange(B, device=start.device)
        k[rows, :, start], v[rows, :, start] = ks[:, :, 0], vs[:, :, 0]
        o = attend(qs, k, v)
    x = x + layer.self_attn.o_proj(o.transpose(1, 2).reshape(B, q, nh * hd))
    g, u = F.linear(layer.post_attention_layernorm(x), wgu).chunk(2, dim=-1)
    return x + layer.mlp.down_proj(F.silu(g) * u)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of one new token per row: q [B,nh,1,hd] over k, v [B,nkv,W,hd], mask [B,1,1,W] (True: attend).
    Two batched matmuls with the query heads of each kv head side by side. On a CPU this is several times faster
    than scaled_dot_product_attention for a single query (measured in docs/regenerate.md), whose flash kernel
    tiles for long queries."""
    B, nh, _, hd = q.shape
    nkv, W = k.shape[1], k.shape[2]
    g = nh // nkv
    # 3-D views (a column slice of the cache stays a view): 4-D matmul would copy the slice first, 10x slower
    k3, v3 = k.reshape(B * nkv, W, hd), v.reshape(B * nkv, W, hd)
    scores = torch.bmm(q.reshape(B * nkv, g, hd), k3.transpose(1, 2)).view(B, nkv, g, W) * hd ** -0.5
    scores = scores.float()
    if mask is not None:  # None: every column
        scores = scores.masked_fill(~mask.reshape(B, 1, 1, W), float("-inf"))
    o = torch.bmm(torch.softmax(scores, dim=-1).to(v.dtype).view(B * nkv, g, W), v3)  # [B*nkv,g,hd]
    return o.view(B, nh, 1, hd)


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
            if qs.shape[2] == 1:
                return decode_attention(qs, ks, vs, mask)
            return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=self.nkv != self.nh)

        return self.logits(x, cos, sin, self.k, self.v, start, sdpa)

    def logits(self, x: torch.Tensor, cos, sin, k: torch.Tensor, v: torch.Tensor, start, attend) -> torch.Tensor:
        """Every decoder layer over x [B,q,H] (layer_forward, caches k, v [L,B,nkv,cap,hd]), then the output head
        at each row's last position: [B,V]."""
        for i, layer in enumerate(self.layers):
            x = layer_forward(layer, (self.wqkv[i], self.bqkv[i], self.wgu[i]), (self.nh, self.nkv, self.hd), x,
                              cos, sin, k[i], v[i], start, attend)
        return self.model.lm_head(self.model.model.norm(x[:, -1]))


ALONE = 256  # columns of batched attention one more single-row attention costs (its call overhead), estimated


def _split_widths(widths: list[int]) -> tuple[int, list[tuple[int, int]]]:
    """(the common attention width W of a decode step, [(row, width)] of the rows attended alone past it): the W
    that minimises the columns computed, len(rows) x W + the long rows' own widths (plus ALONE each), so one long
    conversation does not make every row attend over its length."""
    order = sorted(set(widths))  # a row alone also costs two more matmul calls per layer: ~ALONE columns' worth
    best = min(order, key=lambda w: len(widths) * w + sum(x + ALONE for x in widths if x > w))
    return best, [(r, x) for r, x in enumerate(widths) if x > best]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class SlotGenerator:
    """Continuous batching: up to `slots` rows decode together over one preallocated cache, and a finished row's
    slot takes the next prompt at once, so no row waits for the longest one of its batch.

    `submit(key, prompt)` queues a prompt; `step()` admits queued prompts into free slots (each prefilled alone,
    its first token picked), decodes one token for every busy slot, and returns [(key, new tokens)] of the rows
    that finished (a stop token included when one ended it). A freed slot keeps its cache: when the same key
    comes back (a conversation's next turn) it takes that slot again and only the tokens after the longest common
    prefix with what the cache holds are computed. Slot s holds its row's keys and values at columns
    0..len[s]; a decode step writes each row's new column at its own length and masks every column past it, so a
    row is decoded as if alone (positions from 0), whatever its neighbours and the order rows were refilled in.
    The cache grows (doubling its columns) when a longer row arrives."""

    def __init__(self, target, slots: int, max_new: int, stops: set[int], temperature: float = 0.0,
                 top_p: float = 1.0, generator: torch.Generator | None = None):
        self.lean = BatchGenerator(target)
        self.target, self.S, self.max_new = target, slots, max_new
        self.stop = torch.tensor(sorted(stops) or [-1], device=target.device)
        self.sampling = (temperature, top_p, generator)
        self.queue: list[tuple[object, list[int]]] = []
        self.key: list[object | None] = [None] * slots  # the row each slot holds (None: free)
        self.out: list[list[int]] = [[] for _ in range(slots)]
        self.len = torch.zeros(slots, dtype=torch.long, device=target.device)  # cache columns filled, per slot
        self.last = torch.zeros(slots, dtype=torch.long, device=target.device)  # the token each slot feeds next
        self.cap = 0
        self.k = self.v = None
        self.fed: list[list[int]] = [[] for _ in range(slots)]  # the prompt each slot was given
        self.hist: list[tuple | None] = [None] * slots  # a free slot's (key, tokens its cache holds, when freed)
        self.clock = 0
        self.reused = 0  # prompt tokens whose cache columns were kept from the previous turn (not recomputed)

    def submit(self, key, prompt: list[int]) -> None:
        self.queue.append((key, prompt))

    def busy(self) -> int:
        return sum(k is not None for k in self.key)

    def idle(self) -> bool:
        return not self.queue and not self.busy()

    def _room(self, need: int) -> None:
        """Cache columns for `need` tokens in every slot (grown by doubling, the filled columns kept)."""
        if need <= self.cap:
            return
        cap = max(need, 2 * self.cap, 256)
        lean, dev, dt = self.lean, self.target.device, self.target.dtype
        k = torch.zeros(len(lean.layers), self.S, lean.nkv, cap, lean.hd, dtype=dt, device=dev)
        v = torch.zeros_like(k)
        if self.k is not None:
            k[..., :self.cap, :], v[..., :self.cap, :] = self.k, self.v
        self.k, self.v, self.cap = k, v, cap

    @torch.inference_mode()
    def step(self) -> list[tuple[object, list[int]]]:
        done: list[tuple[object, list[int]]] = []
        for key, prompt in self._admissions():  # each queued prompt prefilled alone into its slot
            s = self._slot_for(key)
            self._room(len(prompt) + self.max_new)
            tok = self._prefill(s, key, prompt)
            self.key[s], self.out[s] = key, [tok]
            if tok in self.stop.tolist() or self.max_new == 1:
                done.append(self._retire(s))
        busy = [s for s in range(self.S) if self.key[s] is not None]
        if not busy:
            return done
        tok = self._decode(busy)  # [S]
        stopped = torch.isin(tok, self.stop).tolist()
        for s in busy:
            self.out[s].append(int(tok[s]))
            if stopped[s] or len(self.out[s]) >= self.max_new:
                done.append(self._retire(s))
        return done

    def _admissions(self) -> list[tuple[object, list[int]]]:
        """The queued prompts that fit in the free slots now, in queue order."""
        free = self.S - self.busy()
        take, self.queue = self.queue[:free], self.queue[free:]
        return take

    def _slot_for(self, key) -> int:
        """A free slot for `key`: the one still holding its conversation's previous turn (its cache is reused),
        else one holding nothing, else the free slot whose history is oldest."""
        free = [s for s in range(self.S) if self.key[s] is None]
        warm = next((s for s in free if self.hist[s] is not None and self.hist[s][0] is key), None)
        if warm is not None:
            return warm
        cold = next((s for s in free if self.hist[s] is None), None)
        return cold if cold is not None else min(free, key=lambda s: self.hist[s][2])

    def _retire(self, s: int) -> tuple[object, list[int]]:
        """Free slot s, keeping what its cache holds (prompt and reply but the last token) for the next turn."""
        key, row = self.key[s], self.out[s]
        self.hist[s] = (key, self.fed[s] + row[:-1], self.clock)
        self.clock += 1
        self.key[s], self.out[s] = None, []
        return key, row

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        return BatchGenerator._pick(logits, *self.sampling)

    def _prefill(self, s: int, key, prompt: list[int]) -> int:
        """Prompt into slot s, reusing the columns that already hold its first tokens (the conversation's previous
        turn, when the slot kept it); the first new token."""
        lean, dev = self.lean, self.target.device
        kept = self.hist[s][1] if self.hist[s] is not None and self.hist[s][0] is key else []
        start = _common_prefix(kept, prompt[:-1])  # at least the last prompt token is computed anew
        self.hist[s] = None
        self.reused += start
        n = len(prompt) - start
        ids = torch.tensor([prompt[start:]], device=dev)
        body = lean.model.model
        x = body.embed_tokens(ids)
        cos, sin = body.rotary_emb(x, torch.arange(start, start + n, device=dev)[None])
        cos, sin = cos[:, None], sin[:, None]
        mask = (torch.arange(start + n, device=dev)[None] <= torch.arange(start, start + n, device=dev)[:, None])

        def attend(qs, ks, vs):
            if start == 0:
                return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=lean.nkv != lean.nh)
            return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=lean.nkv != lean.nh)

        tok = int(self._pick(lean.logits(x, cos, sin, self.k[:, s:s + 1], self.v[:, s:s + 1], start, attend))[0])
        self.len[s], self.last[s], self.fed[s] = len(prompt), tok, list(prompt)
        return tok

    def _decode(self, busy: list[int]) -> torch.Tensor:
        """One token for every slot (free slots compute on whatever they hold; their tokens are ignored)."""
        lean = self.lean
        body = lean.model.model
        cols = self.len  # each row's new column is its current length
        width, long = _split_widths([int(c) + 1 if s in busy else 1 for s, c in enumerate(cols.tolist())])
        x = body.embed_tokens(self.last[:, None])  # [S,1,H]
        cos, sin = body.rotary_emb(x, cols[:, None])
        cos, sin = cos[:, None], sin[:, None]
        mask = (torch.arange(width, device=cols.device)[None] <= cols[:, None])[:, None, None]  # [S,1,1,width]

        def attend(qs, k, v):
            o = decode_attention(qs, k[:, :, :width], v[:, :, :width], mask)
            for r, w in long:  # rows longer than the common width: alone, over their own columns
                o[r:r + 1] = decode_attention(qs[r:r + 1], k[r:r + 1, :, :w], v[r:r + 1, :, :w], None)
            return o

        tok = self._pick(lean.logits(x, cos, sin, self.k, self.v, cols, attend))  # [S]
        self.len[busy] += 1
        self.last = tok
        return tok
