"""`eyas demo` (the whole pipeline on the embedded default target) and `eyas run CONFIG.toml` (the same from a file).

Both build a list of `pipeline.Stage`s and run them in one run folder; a second run skips finished stages.

A config file lists stages as tables in the order they run. A table named after a command is that command;
any other table names its command with `command = "..."`. `nproc = N` launches a stage (train, extract) under
torchrun with N processes. `{run}` in a string setting stands for the run folder.

    [run]
    name = "smollm2"
    [regenerate]
    target = "smollm2-135m"
    data = ["gsm8k-train"]
    out = "{run}/regenerated.jsonl"
    [prepare]
    data = ["{run}/regenerated.jsonl"]
    out = "{run}/prepared"
    ...
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from eyas.core.config import StageConfig, check, from_mapping, load_toml, opt
from eyas.core.errors import EyasError
from eyas.core.log import console
from eyas.pipeline.registry import COMMANDS, load_stage
from eyas.pipeline.stages import Stage, run_pipeline
from eyas.speculate.results import disturbed_words, lossless_word


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig(StageConfig):
    quick: bool = opt(False, "the tiny random target and a few dozen samples (CI uses it; docs/demo.md gives its time)")
    name: str = opt("", "run name: the run folder is RUNS_DIR/NAME (default: demo, or demo-quick with --quick)")
    runs_dir: str = opt("runs", "folder holding the runs")
    target: str = opt("", "the target (default: tiny with --quick, else smollm2-135m); e.g. tiny-deepseek-v3")
    samples: int = opt(0, "training conversations (0: 320, or 48 with --quick)")
    eval_prompts: int = opt(0, "prompts evaluated on each benchmark, GSM8K test and MT-Bench (0: 4)")
    nproc: int = opt(2, "extraction and training processes under torchrun (on a CPU, one per core: docs/threads.md; "
                        "on GPUs at most one per GPU)")
    parallel: str = opt("ddp", "training's data parallelism: ddp, or fsdp (FSDP2)", choices=("ddp", "fsdp"))
    force: bool = opt(False, "rerun every stage even when it finished before with the same settings")

    def validate(self):
        check(self.nproc >= 1, f"--nproc must be at least 1, got {self.nproc}", "pass --nproc 1 or 2")
        check(self.samples >= 0 and self.eval_prompts >= 0, "--samples and --eval-prompts cannot be negative",
              "pass 0 for the defaults")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig(StageConfig):
    config: str = opt(None, "a TOML file listing the stages (see examples/)", positional=True)
    runs_dir: str = opt("runs", "folder holding the runs")
    force: bool = opt(False, "rerun every stage even when it finished before with the same settings")


def gpu_ranks(nproc: int) -> int:
    """The demo's ranks: --nproc, but at most one per GPU where CUDA is (each rank takes cuda:LOCAL_RANK)."""
    import torch  # heavy (seconds to import): only the demo asks it, `eyas run` need not load it

    return min(nproc, torch.cuda.device_count()) if torch.cuda.is_available() else nproc


def demo_stages(cfg: DemoConfig, run: Path) -> list[Stage]:
    """The demo: regenerate answers, prepare, extract and train on 2 ranks, evaluate, export, report."""
    quick = cfg.quick
    target = cfg.target or ("tiny" if quick else "smollm2-135m")
    n = cfg.samples or (48 if quick else 320)
    n_chat = max(2, n // 8)  # some chitchat dialogues (their first 3 turns, answered in turn), the rest GSM8K
    # generation is bound by per-step overhead on a CPU, so a wide batch costs little more per step than a narrow one
    regen = dict(target=target, dtype="auto", max_new_tokens=48 if quick else 160, batch_size=32, quiet=cfg.quiet)
    r = str(run)
    ranks = gpu_ranks(cfg.nproc)
    evaluate = dict(target=target, draft=f"{r}/train/final", num_prompts=cfg.eval_prompts or 4, chain=(3, 5),
                    hf_generate=False,  # the lean greedy decoder is the baseline either way
                    quiet=cfg.quiet)
    return [
        Stage("regenerate-gsm8k", "regenerate", dict(regen, data=("gsm8k-train",), max_samples=n - n_chat,
                                                      out=f"{r}/regenerated/gsm8k.jsonl")),
        Stage("regenerate-chitchat", "regenerate", dict(regen, data=("chitchat",), max_samples=n_chat,
                                                         max_new_tokens=16 if quick else 64, max_turns=3,
                                                         out=f"{r}/regenerated/chitchat.jsonl")),
        Stage("prepare", "prepare", dict(target=target, data=(f"{r}/regenerated/gsm8k.jsonl",
                                                              f"{r}/regenerated/chitchat.jsonl"),
                                         out=f"{r}/prepared", max_length=1024, overwrite=True, quiet=cfg.quiet)),
        Stage("extract", "extract", dict(target=target, data=f"{r}/prepared", store=f"{r}/store", quiet=cfg.quiet),
              nproc=ranks),
        Stage("train", "train", dict(target=target, store=f"{r}/store", out=f"{r}/train", epochs=2 if quick else 3,
                                     ttt_steps=3, lr=1e-3, micro_batch=1, max_tokens=1024,
                                     draft_vocab=2048 if quick else 8192, checkpoint_every=50, resume=True,
                                     parallel=cfg.parallel, quiet=cfg.quiet),
              nproc=ranks, fresh=(f"{r}/train",)),
        # judged where it cannot pay (MT-Bench's first questions, all writing: the report shows this one) and where
        # it should (GSM8K test, like its training data), each beside prompt lookup and the hybrid of both
        Stage("evaluate", "evaluate", dict(evaluate, bench="mt_bench", out=f"{r}/evaluate",
                                           max_new_tokens=48 if quick else 64)),
        Stage("evaluate-gsm8k", "evaluate", dict(evaluate, bench="gsm8k", out=f"{r}/evaluate-gsm8k",
                                                 max_new_tokens=48 if quick else 96)),
        Stage("export-eagle3", "export", dict(checkpoint=f"{r}/train/final", format="eagle3",
                                              out=f"{r}/export/eagle3", overwrite=True, quiet=cfg.quiet)),
        Stage("export-speculators", "export", dict(checkpoint=f"{r}/train/final", format="speculators",
                                                   out=f"{r}/export/speculators", overwrite=True, quiet=cfg.quiet)),
        Stage("report", "report", dict(run=r, quiet=cfg.quiet)),
    ]


def _best(configs: list[dict], drafter: str) -> dict | None:
    """A drafter's fastest configuration (the draft's best chain), or None when it did not run."""
    runs = [c for c in configs if c.get("drafter") == drafter]
    return max(runs, key=lambda c: c.get("speedup") or 0.0) if runs else None


DRAFTERS = (("draft", "eagle3"), ("hybrid", "hybrid"), ("prompt lookup", "prompt-lookup"))
BENCHES = {"gsm8k": "GSM8K test", "mt_bench": "MT-Bench"}


def _bench_row(ev: dict) -> tuple[str, str, dict[str, tuple[float, float]]] | None:
    """One benchmark's line (the draft, the hybrid and prompt lookup), its short name, and each one's tau and
    speedup."""
    configs = ev.get("configs") or []
    if _best(configs, "eagle3") is None:
        return None
    bench = ev.get("bench") or {}
    what = BENCHES.get(bench.get("name"), str(bench.get("name")))
    cats = ", ".join(bench.get("categories") or [])
    label = f"{what} ({bench.get('prompts')} prompts" + (f", {cats}" if cats and cats != "gsm8k" else "") + ")"
    cells, speed = [], {}  # name -> (tau, speedup)
    for name, drafter in DRAFTERS:
        if (b := _best(configs, drafter)) is not None:
            chain = f" (chain {b['k']})" if drafter == "eagle3" else ""
            cells.append(f"{name} tau {b['tau']:.2f}, {b['speedup']:.2f}x{chain}")
            speed[name] = (b["tau"] or 0.0, b["speedup"] or 0.0)
    short = what + (f" {cats}" if cats and cats != "gsm8k" else "")
    return f"  {label}: " + "; ".join(cells), short, speed


def _final_lines(summaries: dict, run: Path) -> list[str]:
    """Each evaluation's figures (the draft's best chain, the hybrid, prompt lookup), the lossless verdict over
    all of them, what they say, and the report's path."""
    lines = [f"run folder: {run}"]
    evals = {name: s for name, s in summaries.items() if s and isinstance(s, dict) and "configs" in s}
    rows = [(name, row) for name, s in evals.items() if (row := _bench_row(s)) is not None]
    shorts = [short for _, (_, short, _) in rows]
    # a run with two evaluations of one benchmark (the recipe's and a side experiment's): each named by its stage,
    # so neither's figures stand in for the other's
    rows = [(f"{line[:2]}{name}, {line[2:]}", f"{short} in {name}", speed) if shorts.count(short) > 1
            else (line, short, speed) for name, (line, short, speed) in rows]
    if rows:
        checked = [c["lossless"] for s in evals.values() for c in s["configs"]
                   if (c.get("lossless") or {}).get("checked")]
        words = {lossless_word(x) for x in checked}
        verdict = ("not checked" if not checked else "NO" if "NO" in words else "yes" if words == {"yes"}
                   else "yes (every token the target's top-1; near-ties rounded otherwise than plain greedy)")
        prepared = summaries.get("prepare") or {}
        kept = (prepared.get("samples") or {}).get("train")
        data = ", ".join(Path(str(d)).stem for d in prepared.get("data") or [])
        trained = f" of the draft trained on {kept:,} conversations" + (f" ({data})" if data else "") if kept else ""
        lines.append(f"acceptance length tau and speedup over plain greedy decoding{trained}, beside prompt lookup "
                     f"and the hybrid of both (lossless: {verdict}):")
        lines += [line for line, _, _ in rows]
        lines += [f"{BENCHES.get((s.get('bench') or {}).get('name'), 'evaluation')}: {caution}"
                  for s in evals.values() if (caution := disturbed_words(s))]
        lines.append(_verdict([(short, speed) for _, short, speed in rows], kept))
    rep = summaries.get("report") or {}
    if rep.get("path"):
        lines.append(f"report: {rep['path']}")
    return lines


PAYS = 1.10  # a drafter "pays" on a benchmark where it is at least this much faster than plain greedy decoding
RECIPE = "docs/recipe.md trains a draft on broad data (eyas run examples/smollm2-recipe.toml)"


def _verdict(rows: list[tuple[str, dict[str, tuple[float, float]]]], kept: int | None = None) -> str:
    """What the figures say, drawn from them alone: where the draft pays, whether prompt lookup (no training) does
    better, and where the hybrid of both does best."""

    def named(benches: list[str]) -> str:
        return " and ".join(benches) if benches else "none"

    speed = [(b, {k: v[1] for k, v in s.items()}) for b, s in rows]
    draft = [(b, s["draft"]) for b, s in speed]
    pays = [b for b, x in draft if x >= PAYS]
    rest = [b for b, x in draft if x < PAYS]
    figures = {b: f"{x:.2f}x" for b, x in draft}
    if pays and rest:
        said = (f"The draft alone pays on {named([f'{b} ({figures[b]})' for b in pays])} and not on "
                f"{named([f'{b} ({figures[b]})' for b in rest])}.")
    elif pays:
        said = f"The draft alone pays on {named([f'{b} ({figures[b]})' for b in pays])}."
    else:
        said = f"The draft alone does not pay yet ({', '.join(f'{b} {figures[b]}' for b, _ in draft)})."
    lookup_better = [b for b, s in speed if s.get("prompt lookup", 0.0) > s["draft"]]
    if lookup_better:
        said += f" Prompt lookup, which needs no training, does better on {named(lookup_better)}."
    # the hybrid adds to prompt lookup where it is fastest and accepts more (its own tau, not its pricing alone)
    no = (0.0, 0.0)
    hybrid_best = [b for b, s in rows if s.get("hybrid", no)[1] > max(s["draft"][1], s.get("prompt lookup", no)[1])
                   and s.get("hybrid", no)[0] > s.get("prompt lookup", no)[0]]
    if hybrid_best:
        said += (f" The hybrid, taking each round from the draft or prompt lookup, is fastest on "
                 f"{named(hybrid_best)}, where the draft's tokens add to prompt lookup's.")
    small = f" {kept:,} conversations and minutes of training buy that much;" if kept and kept < 1000 else ""
    return f"{said}{small} {RECIPE}."


def run(cfg: DemoConfig) -> dict:
    con = console(0, cfg.quiet, cfg.json)
    name = cfg.name or ("demo-quick" if cfg.quick else "demo")
    run_dir = Path(cfg.runs_dir) / name
    con.print(f"eyas demo: {'tiny target (quick)' if cfg.quick else 'SmolLM2-135M-Instruct'} -> {run_dir}")
    summaries = run_pipeline(demo_stages(cfg, run_dir), run_dir, con, cfg.force)
    for line in _final_lines(summaries, run_dir):
        con.summary(line)
    return {"run": str(run_dir), "stages": summaries}


def stages_from_toml(doc: dict, run: Path, source: str) -> list[Stage]:
    stages = []
    for name, table in doc.items():
        if name == "run":
            continue
        if not isinstance(table, dict):
            raise EyasError(f"{source}: [{name}] is not a table", fix="write each stage as a [table] of settings")
        table = dict(table)
        command = table.pop("command", name)
        nproc = table.pop("nproc", 1)
        if isinstance(nproc, bool) or not isinstance(nproc, int) or not 1 <= nproc <= 4096:
            raise EyasError(f"{source}: [{name}] nproc = {nproc!r} is not a process count",
                            fix="write nproc = N, a whole number from 1 (one process) to the ranks it runs on")
        if command not in COMMANDS:
            raise EyasError(f"{source}: [{name}] names no eyas command ({command!r})",
                            fix=f"name the table after a command or add command = one of {', '.join(COMMANDS)}")
        settings = {k: _substitute(v, run) for k, v in table.items()}
        # refused now, before the run folder holds a copy of it (an `api_key = ...` is no setting, and not kept)
        from_mapping(load_stage(command)[0], settings, f"{source} [{name}]")
        fresh = (settings["out"],) if command == "train" and settings.get("resume") and "out" in settings else ()
        stages.append(Stage(name, command, settings, nproc, fresh))
    if not stages:
        raise EyasError(f"{source} lists no stages", fix="add tables such as [prepare], [extract], [train]")
    return stages


def _substitute(value, run: Path):
    if isinstance(value, str):
        return value.replace("{run}", str(run))
    if isinstance(value, list):
        return tuple(_substitute(v, run) for v in value)
    return value


def run_config(cfg: RunConfig) -> dict:
    con = console(0, cfg.quiet, cfg.json)
    doc = load_toml(cfg.config)
    name = (doc.get("run") or {}).get("name") or Path(cfg.config).stem
    if not isinstance(name, str) or not name.strip() or Path(name).name != name or name in (".", ".."):
        raise EyasError(f"{cfg.config}: [run] name = {name!r} is not a folder name",
                        f"the run folder is --runs-dir/NAME ({cfg.runs_dir}/...), and it must stay inside it",
                        'write name = "my-run": one folder name, without "/" or ".."')
    run_dir = Path(cfg.runs_dir) / name
    stages = stages_from_toml(doc, run_dir, cfg.config)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(Path(cfg.config).read_text())
    summaries = run_pipeline(stages, run_dir, con, cfg.force)
    for line in _final_lines(summaries, run_dir):
        con.summary(line)
    return {"run": str(run_dir), "stages": json.loads(json.dumps(summaries, default=str))}
