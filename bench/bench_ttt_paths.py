"""The TTT step's two paths side by side in one run (eyas.draft.ttt): "gathered" eager (the CPU's default) against
"static" eager and "static" under torch.compile(fullgraph=True) (the GPU's default, on a CPU with the chunked
attention, since PyTorch has no flex_attention backward there).

The step is the trainer's: one draft layer of SmolLM2-135M's shape (hidden 576, 9 heads, 3 kv heads, MLP 1536),
target vocabulary 49,152, draft vocabulary 32,000, B rows of T tokens packed with documents of --doc-length, 80%
of positions loss-masked in, k TTT steps, loss = sum_i scale_i loss_sum_i, then backward; bf16 autocast. Each path
is warmed up (the compiled one compiles then, its time printed apart), then timed over --repeats steps alternating
the paths, and the median printed, with each path's time as a ratio of the gathered path's.

    python bench/bench_ttt_paths.py                        # T = 1024, k = 7, ~3 min at 2 threads
    python bench/bench_ttt_paths.py --length 2048 --steps 5
    PYTHONPATH=OLD/src python bench/bench_ttt_paths.py --paths gathered   # an older eyas's CPU path (before/after)
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eyas.core.config import check, opt, parse  # noqa: E402
from eyas.draft.cross_entropy import TargetRows  # noqa: E402
from eyas.draft.model import DraftConfig, Eagle3Draft  # noqa: E402
from eyas.draft.ttt import step_weights, ttt_forward  # noqa: E402
from eyas.draft.vocab import build_draft_vocab  # noqa: E402
from eyas.train.batches import needed_rows, sparse_target_logp, valid_masks  # noqa: E402

VOCAB, DRAFT_VOCAB = 49152, 32000


@dataclasses.dataclass(frozen=True, kw_only=True)
class TTTPathsConfig:
    length: int = opt(1024, "tokens per row (T)")
    rows: int = opt(1, "rows per micro-batch (B)")
    doc_length: int = opt(256, "tokens per packed document")
    steps: int = opt(7, "TTT steps (k)")
    repeats: int = opt(5, "timed steps per path")
    threads: int = opt(0, "torch threads (0: as many as the cores)")
    paths: tuple[str, ...] = opt(("gathered", "static", "compiled"), "the variants measured: gathered, static, "
                                                                     "compiled")

    def __post_init__(self):
        bad = sorted(set(self.paths) - {"gathered", "static", "compiled"})
        check(not bad, f"--paths {' '.join(bad)}: not a variant", "use gathered, static or compiled")


def build(cfg: TTTPathsConfig):
    g = torch.Generator().manual_seed(0)
    dc = DraftConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                     head_dim=64, vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, target_hidden_size=576,
                     feature_layers=(2, 15, 27), num_layers=1)
    m = Eagle3Draft(dc)
    vocab = build_draft_vocab(torch.randint(0, 100, (VOCAB,), generator=g).numpy(), DRAFT_VOCAB)
    m.init_weights(torch.randn(VOCAB, 576, generator=g) * 0.02, torch.randn(VOCAB, 576, generator=g) * 0.02,
                   vocab.d2t)
    B, T = cfg.rows, cfg.length
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    docs = (torch.arange(T) // cfg.doc_length).expand(B, T).contiguous()
    pos = (torch.arange(T) % cfg.doc_length).expand(B, T).contiguous()
    mask = (torch.rand(B, T, generator=g) < 0.8).long()
    aux, final = torch.randn(B, T, 3 * 576, generator=g), torch.randn(B, T, 576, generator=g)
    head = torch.randn(DRAFT_VOCAB, 576, generator=g) * 0.02
    return m, (ids, aux, final, head, mask, pos, docs)


def step_fn(m, batch, k: int, path: str, compiled: bool):
    ids, aux, final, head, mask, pos, docs = batch
    scale = step_weights(k, 0.8) / 1000
    ttt = torch.compile(ttt_forward, fullgraph=True) if compiled else ttt_forward

    def step():
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if path == "gathered":
                with torch.no_grad():
                    target, index = sparse_target_logp(final, head, needed_rows(valid_masks(ids, mask, docs, m.t2d,
                                                                                             k)))
            else:
                target, index = TargetRows(final, head), None
            extra = {} if path == "gathered" else {"path": path}  # so an older eyas (PYTHONPATH) runs it too
            r = ttt(m, ids, aux, target, mask, k, pos, docs, index, scale, **extra)
            (r.loss_sum.float() * scale).sum().backward()
    return step


def main(argv=None) -> None:
    cfg = parse(TTTPathsConfig, argv, description=__doc__.splitlines()[0])
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    m, batch = build(cfg)
    variants = {"gathered": ("gathered, eager", "gathered", False), "static": ("static, eager", "static", False),
                "compiled": ("static, compiled", "static", True)}
    paths = {variants[v][0]: step_fn(m, batch, cfg.steps, *variants[v][1:]) for v in cfg.paths}
    print(f"TTT step, B={cfg.rows} T={cfg.length} k={cfg.steps}, bf16 autocast, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    for name, step in paths.items():
        t0 = time.perf_counter()
        step()
        print(f"  warm-up {name}: {time.perf_counter() - t0:.1f} s")
    times = {name: [] for name in paths}
    for _ in range(cfg.repeats):
        for name, step in paths.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(next(iter(times.values())))
    tokens = cfg.rows * cfg.length
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:17s} {med:7.3f} s/step  {tokens / med:8.0f} tokens/s  {med / base:5.2f}x the first's time")


if __name__ == "__main__":
    main()
