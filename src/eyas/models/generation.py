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

import itertools

import torch
import torch.nn.functional as F

from eyas.models.llama import decode_attention, fuse_projections, layer_forward, mask_bias


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
            for b, (t, finished) in enumerate(zip(tok.tolist(), done.tolist())):  # one read of each a step
                if not finished:
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
        if temperature == 0:  # the first maximum, as argmax; 3x faster than argmax on bf16
            return logits.max(dim=-1).indices
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
        bias = mask_bias(mask, x.dtype) if ids.shape[1] == 1 else None  # one for every layer

        def sdpa(qs, ks, vs):
            if bias is not None:
                return decode_attention(qs, ks, vs, bias)
            return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=self.nkv != self.nh)

        return self.logits(x, cos, sin, self.k, self.v, start, sdpa)

    def logits(self, x: torch.Tensor, cos, sin, k: torch.Tensor, v: torch.Tensor, start, attend,
               ends: torch.Tensor | None = None) -> torch.Tensor:
        """Every decoder layer over x [B,q,H] (layer_forward, caches k, v [L,R,nkv,cap,hd]), then the output head
        at each row's last position ([B,V]), or at positions `ends` of a single packed row ([len(ends),V])."""
        for i, layer in enumerate(self.layers):
            x = layer_forward(layer, (self.wqkv[i], self.bqkv[i], self.wgu[i]), (self.nh, self.nkv, self.hd), x,
                              cos, sin, k[i], v[i], start, attend)
        last = x[:, -1] if ends is None else x[0, ends]
        return self.model.lm_head(self.model.model.norm(last))


GROUP = 1000  # row-columns of batched attention one more attention call costs: 65-100 us a call against 0.08-0.17
# us a row-column per layer on a 2-core AMD EPYC, i.e. 400-1,000 (bench/bench_regenerate.py --attention); 400 and
# 3,000 ran within the machine's noise of 1,000 end to end (docs/regenerate.md)


def width_chunks(widths: list[int], depth: int = 3) -> list[tuple[int, int, int]]:
    """[(lo, hi, W)]: the rows of a decode step (their attention widths in slot order, 0 for a free slot) in at
    most 2**depth runs of neighbouring rows, each attended together over its widest row's W columns. A run is
    split in two where that saves more than one more call costs (GROUP), so one long conversation does not make
    every row attend over its length, and runs of free slots are not attended at all."""

    def cost(rows: int, top: int) -> int:  # a run of `rows` rows attended over `top` columns (none when all free)
        return rows * top + GROUP if top else 0

    def split(lo: int, hi: int, depth: int) -> list[tuple[int, int, int]]:
        top = max(widths[lo:hi])
        if depth and hi - lo > 1:
            left = list(itertools.accumulate(widths[lo:hi], max))  # left[i]: max of widths[lo..lo+i]
            right = list(itertools.accumulate(reversed(widths[lo:hi]), max))[::-1]  # right[i]: max of lo+i..hi
            best, at = min((cost(m - lo, left[m - lo - 1]) + cost(hi - m, right[m - lo]), m) for m in range(lo + 1, hi))
            if best < cost(hi - lo, top):
                return split(lo, at, depth - 1) + split(at, hi, depth - 1)
        return [(lo, hi, top)] if top else []

    return split(0, len(widths), depth)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


PACK = 2048  # prompt tokens prefilled together at most (one packed row): the GEMMs at full width, memory bounded


class SlotGenerator:
    """Continuous batching: up to `slots` rows decode together over one preallocated cache, and a finished row's
    slot takes the next prompt at once, so no row waits for the longest one of its batch.

    `submit(key, prompt)` queues a prompt; `step()` admits queued prompts into free slots, decodes one token for
    every busy slot, and returns [(key, new tokens)] of the rows that finished (a stop token included when one
    ended it). The prompts admitted in a step are prefilled together, packed into one row (each attends only to
    its own slot's columns), their first tokens picked.

    Slot s holds its row's keys and values at columns 0..len[s], column = position, so a column means the same
    in every slot. A prompt's first tokens that some slot's cache already holds (the system prompt every
    conversation starts with, or the conversation's own previous turn, which a freed slot keeps for it) are
    copied from there rather than computed. A decode step writes each row's new column at its own length and
    masks every column past it, so a row is decoded as if alone, whatever its neighbours and the order rows were
    refilled in. Rows are taken lowest slot first and a step computes only the slots up to the last busy one.
    The cache grows (doubling its columns) when a longer row arrives."""

    def __init__(self, target, slots: int, max_new: int, stops: set[int], temperature: float = 0.0,
                 top_p: float = 1.0, generator: torch.Generator | None = None):
        self.lean = BatchGenerator(target)
        self.target, self.S, self.max_new = target, slots, max_new
        self.stops = set(stops)
        self.sampling = (temperature, top_p, generator)
        self.queue: list[tuple[object, list[int]]] = []
        self.key: list[object | None] = [None] * slots  # the row each slot holds (None: free)
        self.out: list[list[int]] = [[] for _ in range(slots)]
        self.len = torch.zeros(slots, dtype=torch.long, device=target.device)  # cache columns filled, per slot
        self.last = torch.zeros(slots, dtype=torch.long, device=target.device)  # the token each slot feeds next
        self.cap = 0
        self.k = self.v = self.cos = self.sin = None
        self.held: list[list[int]] = [[] for _ in range(slots)]  # tokens whose columns slot s holds (a prefix)
        self.kept: list[object | None] = [None] * slots  # a free slot's last key (its next turn may reuse the slot)
        self.reused = 0  # prompt tokens whose cache columns were copied or kept, not recomputed

    def submit(self, key, prompt: list[int]) -> None:
        self.queue.append((key, prompt))

    def busy(self) -> int:
        return sum(k is not None for k in self.key)

    def idle(self) -> bool:
        return not self.queue and not self.busy()

    def _room(self, need: int) -> None:
        """Cache columns for `need` tokens in every slot (grown by doubling, the filled columns kept), and the
        rotary table of their positions."""
        if need <= self.cap:
            return
        cap = max(need, 2 * self.cap, 256)
        lean, dev, dt = self.lean, self.target.device, self.target.dtype
        shape = (len(lean.layers), self.S, lean.nkv, cap, lean.hd)
        k = torch.zeros(shape, dtype=dt, device=dev)  # in huge pages on a CPU (eyas sets THP_MEM_ALLOC_ENABLE)
        v = torch.zeros_like(k)
        if self.k is not None:
            k[..., :self.cap, :], v[..., :self.cap, :] = self.k, self.v
        self.k, self.v, self.cap = k, v, cap
        x = torch.zeros(1, 1, 1, dtype=dt, device=dev)  # rotary_emb reads only its dtype and device
        cos, sin = lean.model.model.rotary_emb(x, torch.arange(cap, device=dev)[None])  # [1,cap,hd]
        self.cos, self.sin = cos[0], sin[0]

    @torch.inference_mode()
    def step(self) -> list[tuple[object, list[int]]]:
        done: list[tuple[object, list[int]]] = []
        admitted = self._admissions()
        for group in _packs(admitted):
            for s, tok in self._prefill(group):
                self.out[s] = [tok]
                if tok in self.stops or self.max_new == 1:
                    done.append(self._retire(s))
        busy = [s for s in range(self.S) if self.key[s] is not None]
        if not busy:
            return done
        tok = self._decode(busy[-1] + 1).tolist()  # [busy[-1] + 1]
        for s in busy:
            self.out[s].append(tok[s])
            if tok[s] in self.stops or len(self.out[s]) >= self.max_new:
                done.append(self._retire(s))
        return done

    def _admissions(self) -> list[tuple[int, object, list[int]]]:
        """The queued prompts that fit in the free slots now, in queue order, each with its slot: the one that
        kept its conversation's previous turn, else the lowest free slot no queued prompt is waiting for."""
        free = self.S - self.busy()
        take, self.queue = self.queue[:free], self.queue[free:]
        waiting = {id(key) for key, _ in take + self.queue}
        out = []
        for key, prompt in take:
            open_ = [s for s in range(self.S) if self.key[s] is None]
            warm = next((s for s in open_ if self.kept[s] is key), None)
            cold = [s for s in open_ if id(self.kept[s]) not in waiting] or open_
            s = warm if warm is not None else cold[0]
            self.key[s], self.kept[s] = key, None
            self._room(len(prompt) + self.max_new)
            out.append((s, key, prompt))
        return out

    def _retire(self, s: int) -> tuple[object, list[int]]:
        """Free slot s, keeping what its cache holds (prompt and reply but the last token) for the next turn."""
        key, row = self.key[s], self.out[s]
        self.held[s] = self.held[s] + row[:-1]
        self.key[s], self.kept[s], self.out[s] = None, key, []
        return key, row

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        return BatchGenerator._pick(logits, *self.sampling)

    def _reuse(self, s: int, prompt: list[int], fresh: set[int]) -> int:
        """Columns of `prompt` slot s can start from (at least its last token is computed anew): the longest
        prefix some slot's cache holds (slot s's own, or copied from another slot not being refilled now)."""
        best, src = _common_prefix(self.held[s], prompt[:-1]), s
        for r in range(self.S):
            if r not in fresh and r != s and self.held[r][:1] == prompt[:1]:
                n = _common_prefix(self.held[r], prompt[:-1])
                if n > best:
                    best, src = n, r
        if src != s:
            self.k[:, s, :, :best], self.v[:, s, :, :best] = self.k[:, src, :, :best], self.v[:, src, :, :best]
        self.reused += best
        return best

    def _prefill(self, group: list[tuple[int, object, list[int]]]) -> list[tuple[int, int]]:
        """The group's prompts into their slots, packed into one row (each prompt attends to its own slot's
        columns); [(slot, first new token)]."""
        lean, dev = self.lean, self.target.device
        fresh = {s for s, _, _ in group}
        starts = [self._reuse(s, prompt, fresh) for s, _, prompt in group]
        ids, rows, cols, spans, at = [], [], [], [], 0
        for (s, _, prompt), start in zip(group, starts):
            n = len(prompt) - start
            ids += prompt[start:]
            rows += [s] * n
            cols += range(start, len(prompt))
            spans.append((s, at, start, len(prompt)))
            at += n
        cols_t = torch.tensor(cols, device=dev)
        x = lean.model.model.embed_tokens(torch.tensor([ids], device=dev))  # [1,N,H]
        cos, sin = self.cos[cols_t][None, None], self.sin[cols_t][None, None]  # [1,1,N,hd]
        gqa = lean.nkv != lean.nh

        def attend(qs, k, v):  # qs [1,nh,N,hd]; each prompt over its own slot's columns 0..len
            o = torch.empty_like(qs)
            for s, a, start, end in spans:
                mask = None if start == 0 else \
                    torch.arange(end, device=dev)[None] <= torch.arange(start, end, device=dev)[:, None]
                o[:, :, a:a + end - start] = F.scaled_dot_product_attention(
                    qs[:, :, a:a + end - start], k[s:s + 1, :, :end], v[s:s + 1, :, :end], attn_mask=mask,
                    is_causal=start == 0, enable_gqa=gqa)
            return o

        ends = torch.tensor([a + end - start - 1 for _, a, start, end in spans], device=dev)
        place = (torch.tensor(rows, device=dev), cols_t)
        toks = self._pick(lean.logits(x, cos, sin, self.k, self.v, place, attend, ends)).tolist()
        for (s, _, prompt), tok in zip(group, toks):
            self.len[s], self.last[s], self.held[s] = len(prompt), tok, list(prompt)
        return [(s, tok) for (s, _, _), tok in zip(group, toks)]

    def _decode(self, n: int) -> torch.Tensor:
        """One token for each of slots 0..n (free ones are computed but not attended; their tokens are ignored)."""
        lean, dev = self.lean, self.target.device
        cols = self.len[:n]  # each row's new column is its current length
        busy = [self.key[s] is not None for s in range(n)]
        runs = width_chunks([c + 1 if b else 0 for c, b in zip(cols.tolist(), busy)])
        widest = max(w for _, _, w in runs)
        x = lean.model.model.embed_tokens(self.last[:n, None])  # [n,1,H]
        cos, sin = self.cos[cols][:, None, None], self.sin[cols][:, None, None]  # [n,1,1,hd]
        bias = mask_bias((torch.arange(widest, device=dev)[None] <= cols[:, None])[:, None, None], x.dtype)

        def attend(qs, k, v):
            if len(runs) == 1 and runs[0][:2] == (0, n):
                return decode_attention(qs, k[:n, :, :widest], v[:n, :, :widest], bias)
            o = torch.zeros_like(qs)  # free slots outside every run: never read
            for a, b, w in runs:
                o[a:b] = decode_attention(qs[a:b], k[a:b, :, :w], v[a:b, :, :w], bias[a:b, ..., :w])
            return o

        place = (torch.arange(n, device=dev), cols)
        tok = self._pick(lean.logits(x, cos, sin, self.k, self.v, place, attend))  # [n]
        self.len[:n] += torch.tensor(busy, device=dev)
        self.last[:n] = tok
        return tok


def _packs(admitted: list) -> list[list]:
    """Admitted prompts in groups of at most PACK tokens (a longer prompt alone)."""
    groups, size = [], PACK
    for item in admitted:
        if size + len(item[2]) > PACK:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += len(item[2])
    return groups
