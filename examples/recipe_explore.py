"""The exploration table of docs/recipe.md: variants of the recipe's training, each measured by `eyas evaluate`.

Every row retrains the draft with one setting changed; then one `eyas evaluate` per benchmark decodes it with
every row's draft side by side (`--baselines`), chain of 7, not adaptive, so tau depends on the drafts only,
never on how busy the machine is. MT-Bench rows: one question per category, both turns. The data rows (GSM8K
train's own answers against SmolLM2's regenerated ones, same 512 questions) are measured on GSM8K test, the
domain they teach. The table it prints gives each row's change, training time and acceptance.

    eyas run examples/smollm2-recipe.toml --runs-dir runs          # first: the recipe run (data, store)
    python examples/recipe_explore.py --run runs/smollm2-recipe    # then: every row, then the evaluations
    python examples/recipe_explore.py --run runs/smollm2-recipe --rows ttt5 ttt1 ttt3 --epochs 2

Rows already trained (their final/ exists) are kept, so an interrupted exploration resumes. Each run evaluates
and tabulates the rows it is given: its evaluate-BENCH/ folders and table.md replace the previous run's (copy
them first to keep both; give the reference row in every run, its tau reproduces exactly).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from eyas.core.config import check, from_mapping, opt, parse, to_argv
from eyas.pipeline.demo import stages_from_toml
from eyas.train.settings import TrainConfig

RECIPE = Path(__file__).with_name("smollm2-recipe.toml")

# Stores besides the recipe's own: name -> (`eyas prepare` flags, or None to extract the recipe's prepared data;
# extra `eyas extract` flags). "{run}" and "{x}" (the exploration folder) are filled in.
STORES = {
    "compact": (None, ["--compact"]),
    "gsm8k-regenerated": (["--data", "{run}/regenerated/gsm8k.jsonl"], []),
    "gsm8k-human": (["--data", "gsm8k-train", "--max-samples", "512"], []),
}

# name: (what changes, benchmark, the `eyas train` settings it changes; None drops the recipe's setting;
# "{run}" and "{x}" are filled in)
ROWS = {
    "ttt5": ("the recipe's settings (TTT 5, decay 0.8, vocabulary 8,192, bf16 store)", "mt_bench", {}),
    "ttt1": ("TTT 1 (no training-time test)", "mt_bench", {"ttt_steps": 1}),
    "ttt3": ("TTT 3", "mt_bench", {"ttt_steps": 3}),
    "ttt7": ("TTT 7", "mt_bench", {"ttt_steps": 7}),
    "decay1": ("TTT 5, every step weighted 1 (no decay)", "mt_bench", {"step_decay": 1.0}),
    "vocab4k": ("draft vocabulary 4,096", "mt_bench", {"draft_vocab": 4096}),
    "vocab16k": ("draft vocabulary 16,384", "mt_bench", {"draft_vocab": 16384}),
    "compact": ("compact store (fp8 e4m3, per-row scales)", "mt_bench", {"store": "{x}/store-compact"}),
    "half-data": ("half the samples (the first half of one shuffled epoch)", "mt_bench", {"max_steps": "HALF"}),
    "online": ("online: the target computes the features in the loop (no store)", "mt_bench",
               {"online": True, "data": "{run}/prepared", "store": None}),
    "gsm8k-regenerated": ("GSM8K train, 512 questions answered by SmolLM2 (3 epochs)", "gsm8k",
                          {"store": "{x}/store-gsm8k-regenerated", "epochs": 3}),
    "gsm8k-human": ("GSM8K train, the same 512 questions with the dataset's own answers (3 epochs)", "gsm8k",
                    {"store": "{x}/store-gsm8k-human", "epochs": 3}),
}
EVAL = {"mt_bench": ["--per-category", "1", "--num-prompts", "0"], "gsm8k": ["--num-prompts", "10"]}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExploreConfig:
    run: str = opt("", "the recipe's run folder (holds prepared/ and store/); required")
    rows: tuple[str, ...] = opt(tuple(ROWS), "the rows trained, evaluated and tabulated", choices=tuple(ROWS))
    epochs: int = opt(1, "epochs of every row that does not set its own")
    recipe: str = opt(str(RECIPE), "the recipe's TOML file")
    max_new_tokens: int = opt(128, "eyas evaluate --max-new-tokens")

    def __post_init__(self):
        check(bool(self.run), "--run is required", "give the recipe's run folder, e.g. --run runs/smollm2-recipe")


def recipe_settings(recipe: Path, run: Path) -> tuple[dict, int]:
    """The recipe's [train] settings ({run} filled in, as `eyas run` does) that every row shares, and its torchrun
    process count."""
    stage = next(s for s in stages_from_toml(tomllib.loads(recipe.read_text()), run, str(recipe))
                 if s.command == "train")
    drop = ("resume", "checkpoint_every", "out", "epochs")
    return {k: v for k, v in stage.settings.items() if k not in drop}, stage.nproc


def train_argv(settings: dict, fill: dict) -> list[str]:
    """`eyas train` arguments of `settings` (None: the setting left at its default; "{run}", "{x}" filled in),
    generated from TrainConfig as the CLI is."""
    clean = {k: v.format(**fill) if isinstance(v, str) else v for k, v in settings.items() if v is not None}
    return to_argv(from_mapping(TrainConfig, clean, "recipe_explore"))


def sh(cmd: list[str], log: Path) -> float:
    """Run `cmd` with its output in `log`; its wall time in seconds. Stops the exploration on failure."""
    print("  $ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        sys.exit(f"failed ({rc}); see {log}")
    return time.perf_counter() - t0


def make_store(name: str, run: Path, x: Path, fill: dict) -> None:
    store = x / f"store-{name}"
    if (store / "manifest.json").is_file():
        return
    eyas = [sys.executable, "-m", "eyas"]
    prepare, extract = STORES[name]
    data = run / "prepared"
    if prepare is not None:
        data = x / f"prepared-{name}"
        sh(eyas + ["prepare", *[a.format(**fill) for a in prepare], "--out", str(data), "--validation", "0",
                   "--overwrite", "--quiet"], x / f"prepare-{name}.log")
    sh(eyas + ["extract", "--data", str(data), "--store", str(store), *extract, "--quiet"], x / f"extract-{name}.log")


def main() -> None:
    args = parse(ExploreConfig, description=__doc__.split("\n")[0])
    run = Path(args.run).resolve()
    x = run / f"explore-e{args.epochs}"
    x.mkdir(exist_ok=True)
    base, nproc = recipe_settings(Path(args.recipe), run)
    fill = {"run": run, "x": x}
    walls = json.loads((x / "walls.json").read_text()) if (x / "walls.json").is_file() else {}
    for row in args.rows:
        out = x / row
        if (out / "final").is_dir():
            print(f"{row}: trained before ({out}/final), kept")
            continue
        settings = {**base, "epochs": args.epochs, **ROWS[row][2], "out": str(out), "quiet": True}
        store = str(settings.get("store") or "")
        if store.startswith("{x}/store-"):
            make_store(store.removeprefix("{x}/store-"), run, x, fill)
        if settings.get("max_steps") == "HALF":  # half of one epoch of the reference row
            settings["max_steps"] = json.loads((x / "ttt5" / "plan.json").read_text())["steps_per_epoch_actual"][0] // 2
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "-m", "eyas.train",
               *train_argv(settings, fill)]
        walls[row] = round(sh(cmd, x / f"{row}.log"), 1)
        (x / "walls.json").write_text(json.dumps(walls, indent=1))
    lines = [f"every row's flags unless it says otherwise: {' '.join(train_argv(base, fill))} --epochs {args.epochs}",
             ""]
    for bench in EVAL:
        rows = [r for r in args.rows if ROWS[r][1] == bench and (x / r / "final").is_dir()]
        if rows:
            evaluate(x, bench, rows, args.max_new_tokens)
            lines += table(x, bench, rows, walls)
    (x / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def evaluate(x: Path, bench: str, rows: list[str], max_new_tokens: int) -> None:
    finals = [str(x / r / "final") for r in rows]
    sh([sys.executable, "-m", "eyas", "evaluate", "--draft", finals[0], *(["--baselines", *finals[1:]] if finals[1:]
        else ["--baselines", "none"]), "--bench", bench, *EVAL[bench], "--chain", "7", "--no-tree", "--no-adaptive",
        "--no-hf-generate", "--max-new-tokens", str(max_new_tokens), "--out", str(x / f"evaluate-{bench}"),
        "--quiet"], x / f"evaluate-{bench}.log")


def late_accuracy(metrics: Path) -> list[float]:
    """Mean acc_i over the last 10% of the optimizer steps: one step's figure swings by +-0.1."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    tail = [r["acc_i"] for r in rows[-max(1, len(rows) // 10):]]
    return [sum(a[i] for a in tail) / len(tail) for i in range(len(tail[0]))]


def table(x: Path, bench: str, rows: list[str], walls: dict) -> list[str]:
    """Markdown lines: one per row, from evaluate's results.json and each run's metrics."""
    results = json.loads((x / f"evaluate-{bench}" / "results.json").read_text())
    by_draft = {c["drafter"]: c for c in results["configs"]}
    lines = [f"{bench} (baseline {results['baseline']['tokens_per_s']:.1f} tokens/s):", "",
             "| row | change | train wall | train acc_0..k (last 10% of steps) | tau (chain 7) "
             "| accept rate by position 1-3 | speedup | lossless |",
             "|---|---|---|---|---|---|---|---|"]
    for i, row in enumerate(rows):
        c = by_draft["eagle3"] if i == 0 else by_draft[str(x / row / "final")]
        acc = " ".join(f"{a:.2f}" for a in late_accuracy(x / row / "metrics.jsonl"))
        rates = ", ".join(f"{a:.3f}" for a in c["accept_rate_by_position"][:3] if a is not None)
        lines.append(f"| {row} | {ROWS[row][0]} | {walls.get(row, float('nan')) / 60:.1f} min | {acc} | "
                     f"**{c['tau']:.3f}** | {rates} | {c['speedup']:.2f}x | {c['lossless']['identical']} |")
    return lines + [""]


if __name__ == "__main__":
    main()
