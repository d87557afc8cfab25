"""Local regeneration throughput on real prompts: eyas's continuous batching against its batch-by-batch decoder and
transformers' `generate`, alternated in one run.

Each method answers the same conversations through `eyas regenerate`'s own local backend (the chat template, the
stop at end of turn, up to --max-new-tokens): `slots` refills a finished row's slot at once (the default path),
`batches` decodes --batch-size conversations together and waits for the longest reply, `hf` is transformers'
`generate` batch by batch. tokens/s counts the replies' tokens over the wall time, prefill included. The lean
paths' replies are checked to be the same as each other's (bf16 near-ties aside).

    python bench/bench_regenerate.py                                   # GSM8K train, 48 prompts, 256 new tokens
    python bench/bench_regenerate.py --data chitchat --samples 64 --max-turns 3 --max-new-tokens 96   # the recipe's
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


class Tally:
    """A Sink stand-in: counts finished conversations and their reply tokens, keeps the replies."""

    def __init__(self):
        self.tokens, self.replies = 0, {}

    def finished(self, d) -> None:
        conv = d.result()
        self.replies[conv.id] = [m.content for m in conv.messages if m.role == "assistant"]
        self.tokens += d.tokens  # the replies' tokens as generated (a stop token counted)

    def failed(self, conv, e) -> None:
        self.replies[conv.id] = None

    def step(self, tokens: int) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--data", default="gsm8k-train")
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-turns", type=int, default=0, help="answer only the first N user turns (0: all)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--methods", nargs="+", default=["slots", "batches", "hf"])
    ap.add_argument("--repeats", type=int, default=1)
    a = ap.parse_args()

    from eyas.core.log import Console
    from eyas.data.formats import Issues
    from eyas.data.regenerate import LocalBackend, RegenerateConfig, pending, run_batches, run_slots

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "unknown CPU")
    print(f"bench_regenerate: {cpu}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; {a.target} {a.dtype}, "
          f"{a.samples} {a.data} conversations, up to {a.max_new_tokens} new tokens")
    con = Console(quiet=True)
    backends = {}
    results: dict[tuple[str, int], list[float]] = {}
    replies: dict[tuple[str, int], dict] = {}
    for _ in range(a.repeats):
        for b in a.batch:
            for m in a.methods:  # alternated: a slow spell of the machine hits every method
                gen = "hf" if m == "hf" else "lean"
                cfg = RegenerateConfig(target=a.target, data=(a.data,), max_samples=a.samples, batch_size=b,
                                       max_new_tokens=a.max_new_tokens, max_turns=a.max_turns, dtype=a.dtype,
                                       generator=gen, quiet=True,
                                       out="/dev/null")
                key = (gen, b)
                if key not in backends:
                    backends[key] = LocalBackend(cfg, con)
                backend = backends[key]
                todo, _ = pending(cfg, set(), Issues())
                sink = Tally()
                t0 = time.perf_counter()
                (run_slots if m == "slots" else run_batches)(backend, todo, sink)
                seconds = time.perf_counter() - t0
                toks = sink.tokens
                results.setdefault((m, b), []).append(toks / seconds)
                replies[m, b] = sink.replies
                print(f"  {m:8s} batch {b:3d}: {toks:6d} reply tokens in {seconds:6.1f} s = {toks / seconds:6.1f} "
                      f"tokens/s")
    print(f"{'method':8s} " + " ".join(f"{f'batch {b}':>14s}" for b in a.batch) + "   (tokens/s, median)")
    for m in a.methods:
        print(f"{m:8s} " + " ".join(f"{statistics.median(results[m, b]):14.1f}" for b in a.batch))
    for b in a.batch:
        if ("slots", b) in replies and ("batches", b) in replies:
            x, y = replies["slots", b], replies["batches", b]
            same = sum(x[k] == y[k] for k in x)
            med = {m: statistics.median(results[m, b]) for m in a.methods if (m, b) in results}
            vs_hf = f", slots / hf {med['slots'] / med['hf']:.2f}x" if "hf" in med else ""
            print(f"batch {b}: slots / batches {med['slots'] / med['batches']:.2f}x{vs_hf}; conversations with the "
                  f"same replies in slots and batches: {same}/{len(x)}")
    print(f"bench_regenerate: load {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
