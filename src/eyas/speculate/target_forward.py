"""The target side of speculative decoding: forward q new tokens over a KV cache, return logits and features.

`TargetRunner.forward(ids, positions, tree)` runs q new tokens after the `length` committed cache entries and
returns the logits at every new position and the three EAGLE-3 feature layers [q, 3H] (low|mid|high). Nothing
is committed until `commit(rows)` says which of the q new entries to keep (their indices, in order): a chain
keeps a prefix, a tree keeps the accepted path, gathered in place to the positions after the prefix; the rest
is discarded and later overwritten. The prefix is never recomputed.

Two implementations of one contract:
- `LeanRunner` (Llama-family targets: llama, mistral, qwen2): the decoder written out over the Hugging Face
  modules' own weights, with a preallocated cache, one fused qkv and one fused gate|up matmul per layer. It
  computes what `LlamaForCausalLM` computes, without the per-layer dispatch, mask building and output objects
  that dominate a one-token step on a CPU. Features are read from the residual stream as it passes.
- `HFRunner` (any causal LM): the model's own forward with a `DynamicCache` and a 4D mask; features are captured
  by forward hooks on the decoder layers (no `output_hidden_states`). The reference the lean runner is tested
  against, and the fallback for other architectures.

Feature layers are HF `hidden_states` indices: 0 = embedding output, i = output of decoder layer i-1.

Verify widths (`verify_widths`, `TargetRunner.widths`): where the measured t(q) says a wider forward is faster
than q rows, q tokens are verified in that wider forward, the extra rows filler tokens that the real ones never
see and that are never committed. On an AMD EPYC with AVX2 alone, in float32 (2 threads, SmolLM2-135M, whose
49,152 x 576 output head is a large part of a forward), t(3) = 136 ms against t(4) = 90 ms and t(7) = 137 ms
against t(8) = 108 ms with F.linear: below 4 rows the fp32 GEMM reads the weights once per row. Where t grows with
q (a GPU; bf16 on a CPU that has it in hardware), nothing is widened; with few_rows_linear that CPU's t(q) is
far flatter (t(3) 66 ms against t(4) 62: widened only where the measurement says so).

Projections (`LeanRunner.choose_linear`, `Projections`): per number of rows, F.linear, few_rows_linear ((W @ x.T).T,
a single row doubled) or oneDNN over weights packed once (packed_linear), whichever measured faster on this
machine: on that EPYC in float32 few_rows_linear made t(1) 36 ms against 65; on an Intel Xeon with AMX packed
weights made every forward's products 1.5x faster in bf16, and those of 4 rows or more in float32
(docs/evaluate.md).

Compiled (`LeanRunner(compiled=True)`, `eyas evaluate --compile`): the forwards after a prompt run as torch.compile
graphs (one for a single row, one for any other row count; fullgraph, so a graph break fails loudly) with dynamic
cache lengths. Inductor fuses the norms, rotary embeddings, casts and the gated activation; the projections stay the
runner's own, called through the `eyas::projection` operator the compiler does not trace. The cache is one tensor
per layer, written in place by the graph.
"""

from __future__ import annotations

import os
import shutil
import time
import weakref
from typing import Optional

import torch
import torch.nn.functional as F

from eyas.core.errors import EyasError
from eyas.core.memory import available_bytes
from eyas.models.llama import (
    FEW_ROWS,
    LEAN_MODEL_TYPES,
    MKL_ROWS,
    few_rows_linear,
    fuse_projections,
    layer_forward,
    mkl_linear,
    mkl_pack,
    mkl_unsupported,
    pack_weight,
    packed_linear,
    packing_unsupported,
    supports,
)

LINEARS = {"torch": F.linear, "few-rows": few_rows_linear}
KINDS = ("torch", "few-rows", "packed", "mkl")  # how a projection may be computed (Projections)
MKL_COPIES = 8  # row counts the mkl kind packs the weights for at most (each count a copy of every weight)
LINEAR_MARGIN = 0.1  # another way than F.linear is chosen only where it measured at least this much faster
MEASURED_ROWS = (1, 2, 4, 8, FEW_ROWS)  # the row counts `auto` times a forward at


class Projections:
    """x @ w.T (+ b) as the lean runner computes it, by the number of rows: `plan` = ((from_rows, kind), ...) in
    increasing from_rows, the first from 1; a call over m rows takes the kind of the last entry with from_rows <= m.
    Kinds: torch (F.linear), few-rows (few_rows_linear), packed (packed_linear over `pack_weight` copies, made
    once per weight by `pack`) and mkl (mkl_linear over `mkl_pack` copies, one per weight and row count, made at
    the first product over that many rows: up to MKL_ROWS rows and MKL_COPIES row counts, F.linear's own kernel
    beyond). The same weights and the same product by every kind, to the order of the sums."""

    def __init__(self, plan: tuple[tuple[int, str], ...]):
        if not plan or plan[0][0] != 1 or any(k not in KINDS for _, k in plan):
            raise ValueError(f"a projection plan starts at one row and names kinds of {KINDS}: {plan}")
        self.plan = tuple((int(r), k) for r, k in plan)
        # weight's data_ptr -> (the weight, its packed copy): holding the weight keeps its address from being reused
        self.packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # rows -> weight's data_ptr -> (the weight, its copy packed by MKL for that many rows)
        self.mkl: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.mkl_copies = MKL_COPIES  # the most row counts mkl packs for (the runner lowers it to what memory holds)

    @classmethod
    def of(cls, how: "str | tuple") -> "Projections":
        return cls(((1, how),) if isinstance(how, str) else how)

    def kind(self, rows: int) -> str:
        return next(k for r, k in reversed(self.plan) if r <= rows)

    def uses(self, kind: str) -> bool:
        return any(k == kind for _, k in self.plan)

    def pack(self, weights) -> None:
        """Pack `weights` (each once; the tied head and embedding are one) where the plan uses packed products."""
        if self.uses("packed"):
            for w in weights:
                if w.data_ptr() not in self.packed:
                    self.packed[w.data_ptr()] = (w, pack_weight(w))

    def mkl_packed(self, w: torch.Tensor, rows: int) -> torch.Tensor | None:
        """w's copy packed by MKL for `rows` rows, made now if it is the first product over that many rows; None
        past MKL_ROWS rows or MKL_COPIES row counts (then F.linear computes it)."""
        packs = self.mkl.get(rows)
        if packs is None:
            if rows > MKL_ROWS or len(self.mkl) >= self.mkl_copies:
                return None
            packs = self.mkl[rows] = {}
        if w.data_ptr() not in packs:
            packs[w.data_ptr()] = (w, mkl_pack(w, rows))
        return packs[w.data_ptr()][1]

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        kind = self.kind(rows)
        if kind == "packed":
            return packed_linear(x, self.packed[w.data_ptr()][1], b)
        if kind == "mkl":
            packed = self.mkl_packed(w, rows)
            return F.linear(x, w, b) if packed is None else mkl_linear(x, packed, w, b, rows)
        return LINEARS[kind](x, w, b)

    def describe(self) -> str:
        """'torch', or by rows: '1-3 rows torch, 4+ rows packed'."""
        if len(self.plan) == 1:
            return self.plan[0][1]
        parts = []
        for i, (r, k) in enumerate(self.plan):
            last = self.plan[i + 1][0] - 1 if i + 1 < len(self.plan) else None
            span = f"{r}+ rows" if last is None else f"{r} row{'s' * (r > 1)}" if last == r else f"{r}-{last} rows"
            parts.append(f"{span} {k}")
        return ", ".join(parts)


def plan_from_times(times: dict[str, dict[int, float]], rows=MEASURED_ROWS) -> tuple[tuple[int, str], ...]:
    """The plan `auto` keeps: at each measured row count the kind with the least time among F.linear and those
    at least LINEAR_MARGIN below it (a close call would flip between runs and, with it, the rounding of
    near-ties), each count's choice holding up to the next count."""
    plan: list[tuple[int, str]] = []
    for i, m in enumerate(rows):
        fast = [k for k in times if times[k][m] <= (1 - LINEAR_MARGIN) * times["torch"][m]]
        kind = min(fast, key=lambda k: times[k][m]) if fast else "torch"
        if not plan or plan[-1][1] != kind:
            plan.append((1 if i == 0 else m, kind))
    return tuple(plan)


def attention_mask(prefix: int, tree: torch.Tensor | None, q: int, device) -> torch.Tensor | None:
    """Bool mask [1,1,q,prefix+q] (True = may attend): every new token sees the whole prefix; among the new
    tokens, `tree` [q,q] (ancestor-or-self) or causal when None. None when q == 1 (attend to everything)."""
    if q == 1:
        return None
    new = tree if tree is not None else torch.ones(q, q, dtype=torch.bool, device=device).tril()
    return torch.cat((torch.ones(q, prefix, dtype=torch.bool, device=device), new), dim=1)[None, None]


PAD = 0  # the filler token of a widened forward (its rows are never read, never committed)


def verify_widths(latency: dict[int, float], margin: float = 0.05) -> dict[int, int]:
    """{q: w}: the measured q (>= 2) to verify in a forward over w rows, the measured width in (q, 2q] whose t(w) is
    least, where that is at least `margin` below t(q). The margin keeps small noise from widening, and the cap
    bounds what noise can cost where t is flat (a GPU): at most twice the rows."""
    out = {}
    for q in sorted(latency):
        wider = [w for w in latency if q < w <= 2 * q]
        if q >= 2 and wider:
            w = min(wider, key=lambda x: (latency[x], x))
            if latency[w] < (1 - margin) * latency[q]:
                out[q] = w
    return out


def effective_latency(latency: dict[int, float], widths: dict[int, int]) -> dict[int, float]:
    """What verifying q tokens costs once `widths` apply: t(w) for a widened q."""
    return {q: latency[widths.get(q, q)] for q in latency}


def _widened(ids, positions, tree, w: int):
    """`ids` [q] and their positions and tree, followed by w - q filler tokens at the last real token's position
    (never past it: rotary scalings that depend on the largest position, or learned position tables, see no
    position the narrow forward would not). The real tokens never see the fillers (causal order, or a tree mask
    in which each filler sees only itself), so their rows are what the q-row forward computes."""
    q, n = ids.shape[0], w - ids.shape[0]
    ids = torch.cat((ids, ids.new_full((n,), PAD)))
    positions = torch.cat((positions, positions.max().expand(n)))
    if tree is not None:
        wide = torch.zeros(w, w, dtype=torch.bool, device=tree.device)
        wide[:q, :q] = tree
        wide[q:, q:] = torch.eye(n, dtype=torch.bool, device=tree.device)
        tree = wide
    return ids, positions, tree


def _attend(q, k, v, mask, causal: bool = False) -> torch.Tensor:
    """Attention in which every query row is computed exactly as a one-token decoding step computes it, so that a
    verification over q tokens reproduces plain decoding bit for bit (greedy speculation is then lossless in bf16
    too, not only in exact arithmetic). q [1,nh,T,d] in the model dtype, k/v [1,nkv,S,d] (float64 on a CPU: the
    runner's cache holds the model-dtype keys and values exactly in float64), mask [1,1,T,S] (True = may attend)
    or None -> [1,nh,T,d] in q's dtype. causal (mask None, T == S: a prompt from the cache's start): the kernel's
    own causal mask, which skips the keys after each row's block instead of masking them (the same result, bit for
    bit; one layer's attention over a 1,600-token prompt took 39 ms against 75 with the mask).

    On a CPU, torch's fused attention in float64: scores, softmax and the weighted sum of values in one kernel
    (enable_gqa: the query heads sharing a kv head), keys blocked by their position, not by T. Masked keys add
    exact zeros, and another row count or key count changes a row's float64 result by ~1e-16, far below the
    rounding to the model dtype (a change of rounding is possible, at odds of about 2^-29 a value in float32);
    in float32 or bf16 the same kernel blocks its products by T, and rows differ in the last place (on a Xeon
    with AMX every float32 row of 42, 12 bf16 rows of 42:
    bench/bench_attention.py; tests/test_speculate.py, test_attention_rows_do_not_depend_on_the_row_count).
    Off a CPU the runner calls _attend_fp32 instead: GPU matmuls promise no row invariance to keep, and
    float64 runs at 1/2 to 1/64 of float32's rate there (the lossless check's fp32 replay settles near-ties)."""
    out = F.scaled_dot_product_attention(q.to(torch.float64), k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
    return out.to(q.dtype)


def _attend_fp32(q, k, v, mask) -> torch.Tensor:  # mask: [1,1,rep*T,S], True = masked (_rep_mask)
    """_attend off a CPU: the scores by the model-dtype matmul, softmax and the sum of values in float32. The rep
    query heads sharing a kv head are laid out as rep*T rows of that head (HF's repeat_kv maps head h to kv head
    h // rep), so k and v are never copied per head."""
    _, nh, T, d = q.shape
    nkv = k.shape[1]
    rep = nh // nkv
    qg = q.reshape(1, nkv, rep * T, d)  # row r*T + t = head g*rep + r, token t
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * d ** -0.5  # [1,nkv,rep*T,S]
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float())  # [1,nkv,rep*T,d]
    return out.to(q.dtype).reshape(1, nh, T, d)


def _rep_mask(mask: torch.Tensor | None, rep: int) -> torch.Tensor | None:
    """attention_mask [1,1,T,S] (True = may attend) -> masked keys per query row of _attend_fp32 [1,1,rep*T,S]."""
    return None if mask is None else ~mask.repeat(1, 1, rep, 1)


_RUNNERS: "weakref.WeakValueDictionary[int, LeanRunner]" = weakref.WeakValueDictionary()  # compiled, by id


@torch.library.custom_op("eyas::projection", mutates_args=())
def _projection(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], runner: int) -> torch.Tensor:
    """x @ w.T (+ b) in a compiled forward of the lean runner `runner` (its id), by that runner's current
    Projections: an operator the compiler calls but does not trace, so the packed copies (looked up by the weight)
    and the choice by row count work in a graph of any row count, as in an eager forward."""
    return _RUNNERS[runner].projections(x, w, b).contiguous()  # few-rows' one row is a view of two: the layout
    # the graph was compiled for is the fake's


@_projection.register_fake
def _(x, w, b, runner):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


class TargetRunner:
    """Shared bookkeeping: committed length, feature layer ids, timing of every forward (seconds)."""

    def __init__(self, target, feature_layers):
        self.target = target
        self.model = target.model
        self.feature_layers = tuple(int(i) for i in feature_layers)
        self.length = 0  # committed cache entries (= sequence positions the target has processed)
        self.pending = 0  # uncommitted entries written by the last forward
        self.forward_time = 0.0  # accumulated wall time of forward passes (for the overhead share)
        self.widths: dict[int, int] = {}  # q -> the wider forward that verifies q tokens faster (verify_widths)

    @property
    def device(self):
        return self.target.device

    def reset(self) -> None:
        self.length, self.pending, self.forward_time = 0, 0, 0.0
        self._reset_cache()

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None, tree: torch.Tensor | None = None,
                last_only: bool = False):
        """ids [q] new tokens after the committed prefix; positions [q] (default length..length+q-1); tree [q,q]
        bool ancestor-or-self mask among the new tokens (default causal). Returns (logits [q|1, V] in the model
        dtype, features [q, 3H]). Uncommitted entries of an earlier forward are dropped first. A q in `widths` runs
        as a forward over widths[q] rows, of which the first q are returned and may be committed."""
        sync(self.device)
        t0 = time.perf_counter()
        q = ids.shape[0]
        if positions is None:
            positions = torch.arange(self.length, self.length + q, device=ids.device)
        w = q if last_only else self.widths.get(q, q)
        if w > q:
            ids, positions, tree = _widened(ids, positions, tree, w)
        self.pending = 0
        logits, feats = self._forward(ids, positions, tree, last_only)
        if w > q:
            logits, feats = logits[:q], feats[:q]
        self.pending = q
        sync(self.device)
        self.forward_time += time.perf_counter() - t0
        return logits, feats

    def commit(self, rows: list[int] | None = None) -> None:
        """Keep the new entries at `rows` (indices into the last forward's tokens, increasing); None = all."""
        if rows is None:
            rows = list(range(self.pending))
        if rows != list(range(len(rows))):  # a tree path: gather the kept rows right after the prefix
            self._gather(rows)
        self.length += len(rows)
        self.pending = 0

    def prefill(self, ids: torch.Tensor):
        """Run and commit a prompt [n]; -> (logits of its last token [1,V], features [n,3H])."""
        logits, feats = self.forward(ids, last_only=True)
        self.commit()
        return logits, feats


class LeanRunner(TargetRunner):
    """A Llama-family decoder over the HF modules' weights with a preallocated cache: per layer, keys and values
    [1,nkv,cap,hd]. compiled: its forwards after the prompt run as two torch.compile graphs (module docstring); any
    further graph (torch.compile allows 8 a function, then fails under fullgraph) would come from a new grad mode,
    which the runner fixes, or a one-token prompt, whose cache start 1 the compiler specialises on."""

    def __init__(self, target, feature_layers, capacity: int = 2048, linear: "str | tuple" = "torch",
                 compiled: bool = False):
        super().__init__(target, feature_layers)
        self.compiled = bool(compiled)
        cfg = target.text_config
        self.nh, self.nkv = (int(cfg.num_attention_heads),
                             int(getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)))
        self.hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh)
        self.layers = list(target.decoder_layers())
        # by hidden-state index (0 = embeddings, i = layer i-1's output): a list, since a compiled graph misreads
        # `i in tuple` when the ints are symbols
        self._keeps = [j in self.feature_layers for j in range(len(self.layers) + 1)]
        # fused weights: [q|k|v] and [gate|up], one matmul each instead of three and two (copies; ~60% of the weights)
        self.wqkv, self.bqkv, self.wgu = fuse_projections(self.layers)
        self.capacity = 0
        # on a CPU the cache keeps keys and values in float64 (exactly the model-dtype values written), the dtype
        # _attend computes in there: no conversion of the whole prefix at every layer of every forward; 2x the
        # float32 cache's memory (SmolLM2-135M at 2,048 positions: 189 MB), 4x bf16's
        self.cache_dtype = torch.float64 if self.device.type == "cpu" else self.target.dtype
        self.k: list[torch.Tensor] = []  # per layer [1,nkv,cap,hd]: one tensor each, so a compiled forward
        self.v: list[torch.Tensor] = []  # writes its columns in place (no copy of a shared base)
        self._ensure(capacity)
        self.projections, self.linear_choice = Projections.of("torch"), ""  # how projections are computed, and why
        # compiled: the decoding forwards (after a prompt) run as one torch.compile graph each (fullgraph: a graph
        # break is an error, not a silent fallback): inductor's kernels for everything between the projections,
        # which stay the runner's own (`_projection`: opaque to the compiler, by the current plan)
        self._compiled_layers = None
        if self.compiled:
            compilers = (os.environ.get("CXX", ""), "g++", "c++", "clang++")
            if self.device.type == "cpu" and not any(c and shutil.which(c) for c in compilers):
                raise EyasError("a compiled forward asked for", "torch.compile builds its CPU kernels with a C++ "
                                "compiler and none is on PATH ($CXX, g++, c++, clang++)",
                                "install one (Debian: apt install g++), or leave out --compile")
            _RUNNERS[id(self)] = self
            for w in (*self.wqkv, *self.wgu, *(b for b in self.bqkv if b is not None)):
                torch._dynamo.mark_static(w)  # the weights' shapes are constants: only rows and lengths vary
            self._compiled_layers = torch.compile(self._layers, dynamic=True, fullgraph=True)
        self.choose_linear(linear)

    def _weights(self) -> list[torch.Tensor]:
        """Every weight the forward multiplies by, for packing."""
        out = [*self.wqkv, *self.wgu, self.model.lm_head.weight]
        for layer in self.layers:
            out += [layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight]
        return out

    def use_projections(self, projections: Projections) -> None:
        """Compute the projections by `projections`, packing the weights it needs (once per Projections)."""
        projections.pack(self._weights())
        projections.mkl_copies = min(projections.mkl_copies, self._mkl_copies())
        self.projections = projections

    def _weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in {w.data_ptr(): w for w in self._weights()}.values())

    def _mkl_copies(self) -> int:
        """How many row counts the mkl kind may pack the weights for: MKL_COPIES, or fewer where half the memory
        available holds fewer copies of them."""
        available = available_bytes()
        return MKL_COPIES if available is None else min(MKL_COPIES, int(available * 0.5 // self._weight_bytes()))

    @torch.inference_mode()
    def choose_linear(self, how: "str | tuple" = "auto", reps: int = 3) -> str:
        """How every projection is computed (Projections): `how` (a kind for every row count, or a plan), or with
        "auto" per number of rows the fastest kind as measured on this model here: a forward over each of
        MEASURED_ROWS rows by each kind this machine offers, alternated, `reps` rounds after a warm-up (on a CPU
        only: elsewhere the BLAS calls of F.linear are the fast ones). Sets and returns `linear_choice`, a line
        saying what was chosen and why."""
        if isinstance(how, str) and how != "auto" and how not in KINDS:
            raise EyasError(f"projections {how!r} unknown", f"the lean runner computes them by {', '.join(KINDS)}",
                            "use one of those, or auto")
        dtype = self.target.dtype
        if how != "auto":
            asked = Projections.of(how)
            for kind, unsupported in (("packed", packing_unsupported), ("mkl", mkl_unsupported)):
                if asked.uses(kind) and (why := unsupported(dtype, self.device)):
                    raise EyasError(f"{kind} projections asked for", why, "use --projections torch or auto")
            self.use_projections(asked)
            self.linear_choice = f"{self.projections.describe()} (as asked)"
            return self.linear_choice
        if self.device.type != "cpu":
            self.use_projections(Projections.of("torch"))
            self.linear_choice = "torch (not a CPU: not measured)"
            return self.linear_choice
        kinds = ["torch"] + (["few-rows"] if dtype == torch.float32 else [])
        if not packing_unsupported(dtype, self.device):
            kinds.append("packed")
        copies = self._mkl_copies()
        if not mkl_unsupported(dtype, self.device) and copies >= len(MEASURED_ROWS):  # measuring packs each count
            kinds.append("mkl")
        g = torch.Generator().manual_seed(0)
        vocab = self.target.vocab_size
        times: dict[str, dict[int, list[float]]] = {k: {m: [] for m in MEASURED_ROWS} for k in kinds}
        by_kind = {k: Projections.of(k) for k in kinds}
        for p in by_kind.values():
            p.pack(self._weights())
        self.reset()
        self.prefill(torch.randint(0, vocab, (64,), generator=g))
        for rep in range(reps + 1):  # the first round warms up, untimed
            for kind in kinds:
                self.projections = by_kind[kind]
                for m in MEASURED_ROWS:
                    ids = torch.randint(0, vocab, (m,), generator=g)
                    t0 = time.perf_counter()
                    self.forward(ids)  # uncommitted: the prefix stays
                    if rep:
                        times[kind][m].append(time.perf_counter() - t0)
        self.reset()
        med = {k: {m: sorted(v)[len(v) // 2] for m, v in t.items()} for k, t in times.items()}
        chosen = Projections(plan_from_times(med))
        if chosen.uses("packed"):
            chosen.packed = by_kind["packed"].packed  # packed once; unused, they are freed with by_kind
        if chosen.uses("mkl"):  # the copies for the row counts the plan computes by mkl
            chosen.mkl = {m: p for m, p in by_kind["mkl"].mkl.items() if chosen.kind(m) == "mkl"}
            chosen.mkl_copies = copies
        self.projections = chosen
        table = "; ".join(f"{m} {'/'.join(f'{1e3 * med[k][m]:.1f}' for k in kinds)}" for m in MEASURED_ROWS)
        self.linear_choice = f"{chosen.describe()} (measured, rows: ms by {'/'.join(kinds)}: {table})"
        if chosen.uses("mkl"):
            self.linear_choice += (f"; mkl packs the {self._weight_bytes() / 2**20:,.0f} MiB of weights once per "
                                   f"row count, for at most {copies} counts of up to {MKL_ROWS} rows")
        return self.linear_choice

    def _ensure(self, needed: int) -> None:
        """Grow the cache (doubling, copying the committed part) so `needed` entries fit."""
        if needed <= self.capacity:
            return
        cap = max(needed, 2 * self.capacity, 256)
        shape = (1, self.nkv, cap, self.hd)
        for cache in (self.k, self.v):
            for i in range(len(self.layers)):
                grown = torch.empty(shape, dtype=self.cache_dtype, device=self.device)
                for dim in (0, 1, 3) if self.compiled else ():  # only the length is ever another size (a symbol)
                    torch._dynamo.mark_static(grown, dim)
                if len(cache) > i:
                    grown[:, :, : self.capacity] = cache[i]
                    cache[i] = grown
                else:
                    cache.append(grown)
        self.capacity = cap

    def _reset_cache(self) -> None:
        pass  # entries past `length` are overwritten, never read

    def _forward(self, ids, positions, tree, last_only):
        q, start = ids.shape[0], self.length
        self._ensure(start + q + 1)  # a spare column: the attended slice is never the whole cache, a case that a
        # compiled graph (which specialises on the slice's contiguity) would compile again for
        causal = self.device.type == "cpu" and start == 0 and tree is None and q > 1  # a prompt from the start
        mask = None if causal else attention_mask(start, tree, q, ids.device)
        if mask is not None and self.device.type != "cpu":
            mask = _rep_mask(mask, self.nh // self.nkv)
        # a prompt runs once per request (uncompiled: its shapes would each compile anew); decoding steps compiled
        if not self.compiled or start == 0 or last_only:
            return self._layers(ids, positions, mask, start, causal, last_only, self.k, self.v)
        with torch.inference_mode():  # one grad mode and one kind of input tensor always (inference tensors):
            # the compiler would compile again for the other
            ids, positions, mask = (t if t is None or t.is_inference() else t.clone() for t in (ids, positions, mask))
            return self._compiled_layers(ids, positions, mask, start, causal, last_only, self.k, self.v)

    def _layers(self, ids, positions, mask, start: int, causal: bool, last_only: bool, ks: list, vs: list):
        """The decoder over q new tokens written at cache columns start..start+q: (logits, features). mask: from
        attention_mask (CPU) or _rep_mask (elsewhere), None for one row or a causal prompt."""
        body = self.model.model
        x = body.embed_tokens(ids)[None]  # [1,q,H]
        cos, sin = body.rotary_emb(x, positions[None])  # [1,q,hd]
        cos, sin = cos[:, None], sin[:, None]
        feats = [x] if self._keeps[0] else []
        if self.device.type != "cpu":
            def attend(qs, k, v):
                return _attend_fp32(qs, k, v, mask)
        elif causal:  # a Python branch, not a flag: a compiled graph keeps no symbolic bool in the kernel's call
            def attend(qs, k, v):
                return _attend(qs, k, v, None, True)
        else:
            def attend(qs, k, v):
                return _attend(qs, k, v, mask)
        if self.compiled:  # the plan is read by the operator, never by the graph: a new plan compiles nothing
            def linear(x, w, b=None):
                return torch.ops.eyas.projection(x, w, b, id(self))
        else:
            linear = self.projections
        # the head counts from static shapes, not from attributes: a compiled graph would take attributes' ints
        # for symbols, and relate them to the row count
        nkv, hd = ks[0].shape[1], ks[0].shape[3]
        heads = (self.layers[0].self_attn.o_proj.weight.shape[1] // hd, nkv, hd)
        for i, layer in enumerate(self.layers):
            x = layer_forward(layer, (self.wqkv[i], self.bqkv[i], self.wgu[i]), heads, x, cos, sin, ks[i],
                              vs[i], start, attend, linear)
            if self._keeps[i + 1]:
                feats.append(x)
        if last_only:
            x = x[:, -1:]
        head = self.model.lm_head
        logits = linear(body.norm(x), head.weight, head.bias)[0]  # [q|1, V]
        return logits, torch.cat(feats, dim=-1)[0]  # [q,3H]

    def _gather(self, rows: list[int]) -> None:
        src = torch.tensor(rows, device=self.device) + self.length
        n = len(rows)
        for cache in (*self.k, *self.v):
            cache[:, :, self.length:self.length + n] = cache[:, :, src]  # index first: a copy, safe to overlap


class HFRunner(TargetRunner):
    """Any HF causal LM: its own forward, a DynamicCache, a 4D mask, features by forward hooks."""

    def __init__(self, target, feature_layers):
        super().__init__(target, feature_layers)
        from transformers import DynamicCache  # heavy (seconds to import): loaded only where a model is

        self._cache_cls = DynamicCache
        self.cache = DynamicCache(config=self.model.config)
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = []
        for idx in self.feature_layers:
            module = target.embed_tokens() if idx == 0 else target.decoder_layers()[idx - 1]
            self._hooks.append(module.register_forward_hook(self._hook(idx)))

    def _hook(self, idx):
        def save(module, args, output):
            self._captured[idx] = output[0] if isinstance(output, tuple) else output
        return save

    def close(self) -> None:
        for h in self._hooks:
            h.remove()

    def _reset_cache(self) -> None:
        self.cache = self._cache_cls(config=self.model.config)

    def _forward(self, ids, positions, tree, last_only):
        q = ids.shape[0]
        have = self.cache.get_seq_length()
        if have > self.length:  # drop the uncommitted entries of the last forward
            self.cache.crop(self.length - have)
        mask = attention_mask(self.length, tree, q, ids.device)
        if mask is None:
            mask = torch.ones(1, 1, 1, self.length + 1, dtype=torch.bool, device=ids.device)
        out = self.model.model(input_ids=ids[None], position_ids=positions[None], attention_mask=mask,
                               cache=self.cache, use_cache=True)
        h = out.last_hidden_state[:, -1:] if last_only else out.last_hidden_state
        feats = torch.cat([self._captured.pop(i) for i in self.feature_layers], dim=-1)[0]
        return self.model.lm_head(h)[0], feats

    def _gather(self, rows: list[int]) -> None:
        keep = torch.tensor(list(range(self.length)) + [self.length + r for r in rows], device=self.device)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(-2, keep)
            layer.values = layer.values.index_select(-2, keep)

    def commit(self, rows: list[int] | None = None) -> None:
        super().commit(rows)
        extra = self.cache.get_seq_length() - self.length
        if extra > 0:  # a chain's rejected tail
            self.cache.crop(-extra)


def make_runner(target, feature_layers, impl: str = "auto", capacity: int = 2048,
                linear: "str | tuple" = "auto", compiled: bool = False) -> TargetRunner:
    """The lean runner for Llama-family targets (its projections by `linear`, a kind or a plan:
    LeanRunner.choose_linear; its decoding forwards compiled with `compiled`), the HF one otherwise (or when
    impl='hf')."""
    if impl == "lean" or (impl == "auto" and supports(target)):
        return LeanRunner(target, feature_layers, capacity, linear, compiled)
    if compiled:
        why, fix = (("--runner hf was asked for", "use --runner auto or lean, or leave out --compile")
                    if supports(target) else
                    (f"this target is not of the Llama family ({', '.join(sorted(LEAN_MODEL_TYPES))})",
                     "leave out --compile"))
        raise EyasError("a compiled target forward asked for", f"only the lean runner compiles its forward, and {why}",
                        fix)
    return HFRunner(target, feature_layers)


def sync(device) -> None:
    """Wait for the device (timings on a GPU are meaningless without it)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure_latency(runner: TargetRunner, qs=(1, 4, 8, 16, 32), prefix: int = 300, reps: int = 5,
                    vocab: int | None = None, seed: int = 0) -> dict[int, float]:
    """t(q): median wall time (s) of one forward over q new tokens after a `prefix`-token cache (q rows, whatever
    the runner's widths)."""
    widths, runner.widths = runner.widths, {}
    try:
        g = torch.Generator().manual_seed(seed)
        vocab = vocab or runner.target.vocab_size
        runner.reset()
        runner.prefill(torch.randint(0, vocab, (prefix,), generator=g).to(runner.device))
        times: dict[int, list[float]] = {q: [] for q in qs}
        for _ in range(reps):
            for q in qs:  # interleaved, so a slow spell of the machine hits every q alike
                ids = torch.randint(0, vocab, (q,), generator=g).to(runner.device)
                sync(runner.device)
                t0 = time.perf_counter()
                runner.forward(ids)
                sync(runner.device)
                times[q].append(time.perf_counter() - t0)
        runner.reset()
        return {q: sorted(t)[len(t) // 2] for q, t in times.items()}
    finally:
        runner.widths = widths
