"""eyas report: every section present, every number on the page equal to the run file it names, "not run" sections
for missing files, highlighted sample generations, tolerance of damaged files, the CLI.

The run folder is hand-written here (`make_run`) in the formats of the stages: eyas.pipeline.stages (stages/*.json,
pipeline.json), eyas.data.prepare._summary (prepared/summary.json), eyas.store.writer.write_manifest
(store/manifest.json), eyas.train.trainer and eyas.train.setup (train/metrics.jsonl, validation.jsonl, plan.json,
audit.json, final/config.json), eyas.speculate.results.aggregate (evaluate/results.json) and eyas.draft.export.run (the
export stage summaries).
"""

from __future__ import annotations

import json
import math
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from eyas.cli import main as cli_main
from eyas.report.build import ReportConfig, run

# ---------------------------------------------------------------------------------------------- the run folder
STAGES = ("regenerate-gsm8k", "regenerate-chitchat", "prepare", "extract", "train", "evaluate", "export-eagle3",
          "export-speculators", "report")
CATS = ("coding", "math", "writing")


def _w(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1))


def _marker(run: Path, name: str, command: str, settings: dict, summary: dict, elapsed: float, nproc: int = 1):
    _w(run / "stages" / f"{name}.json", {"key": "0123456789abcdef", "command": command, "settings": settings,
                                         "nproc": nproc, "summary": summary, "elapsed_s": elapsed})


def regenerate(run: Path, r: str) -> None:
    for name, n, tokens in (("gsm8k", 5, 812), ("chitchat", 2, 131)):
        out = f"{r}/regenerated/{name}.jsonl"
        (run / "regenerated").mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"id": f"{name}:{i}", "messages": [{"role": "user", "content": "q"},
                                                               {"role": "assistant", "content": "a"}],
                             "source": name}) for i in range(n)]
        (run / "regenerated" / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        _marker(run, f"regenerate-{name}", "regenerate", {"target": "tiny", "out": out},
                {"out": out, "data": [name], "backend": "local", "model": "tiny", "to_do": n, "done": n, "skipped": 0,
                 "failed": 0, "failures": {}, "input_issues": {}, "left_out": 2, "left_out_reasons": {},
                 "not_started": 0, "stopped_early": "", "tokens": tokens, "tokens_per_s": 40.25,
                 "replies_cut_at_max_new_tokens": 1, "elapsed_s": 20.2},
                20.9)


PREPARED = {"out": "x", "data": ["a.jsonl"], "chat_template": "target",
            "target": {"name": "tiny", "architecture": "LlamaForCausalLM", "config_hash": "27fc9fe52e474997",
                       "hidden_size": 64, "num_layers": 8, "vocab_size": 49152},
            "samples_in": 1290, "kept": 1234, "samples": {"train": 1172, "validation": 62}, "dropped": 56,
            "dropped_by_reason": {
                "duplicate-content": {"count": 50, "examples": [{"where": "a.jsonl:7", "detail": "d"}]},
                "too-long": {"count": 6, "examples": [{"where": "a.jsonl:99", "detail": "2,000 > 1,024"}]}},
            "prompt_only": 0, "truncated": 3, "notes": {}, "tokens": 456789, "loss_tokens": 123456,
            "tokens_by_split": {"train": 434000, "validation": 22789},
            "loss_tokens_by_split": {"train": 117000, "validation": 6456}, "max_length": 1024, "overlong": "truncate",
            "validation_fraction": 0.05, "seed": 0, "dedup": True, "fingerprint": "ab" * 32,
            "fingerprints": {"train": "cd" * 32, "validation": "ef" * 32}, "elapsed_s": 12.5}


def prepare_and_store(run: Path, r: str) -> None:
    _w(run / "prepared" / "summary.json", PREPARED)
    _marker(run, "prepare", "prepare", {"target": "tiny", "out": f"{r}/prepared"}, PREPARED, 14.0)
    totals = {"samples": 1172, "tokens": 434000, "shards": 12, "bytes": 225_567_890, "bytes_per_token": 519.7}
    _w(run / "store" / "manifest.json", {"format": "eyas-store", "version": 1, "source": "eyas extract",
                                         "target": PREPARED["target"], "layer_ids": [2, 4, 5], "hidden_size": 64,
                                         "dtype": "bfloat16", "compact": False, "forward_dtype": "bfloat16",
                                         "dataset": {"path": "p", "split": "train", "fingerprint": "ab",
                                                     "samples": 1172},
                                         "totals": totals, "shards": [], "samples": []})
    _marker(run, "extract", "extract", {"target": "tiny", "data": f"{r}/prepared", "store": f"{r}/store"},
            {"store": f"{r}/store", **totals, "layer_ids": [2, 4, 5], "compact": False, "extracted_samples": 1172,
             "extracted_tokens": 434000, "resumed_shards": 0, "world_size": 1, "elapsed_s": 61.3,
             "tokens_per_s": 7080.1}, 63.0)


def metrics(steps: int = 24, k: int = 3) -> list[dict]:
    rows = []
    for s in range(1, steps + 1):
        loss_i = [round(6.0 * math.exp(-s / 9) + 1.2 + 0.3 * i, 6) for i in range(k)]
        acc_i = [round(min(0.95, 0.7 * (1 - math.exp(-s / 7)) * 0.85 ** i), 6) for i in range(k)]
        lr = 3e-4 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps)))
        rows.append({"step": s, "epoch": (s - 1) // 8, "lr": lr,
                     "loss": round(sum(0.8 ** i * x for i, x in enumerate(loss_i)), 6), "loss_i": loss_i,
                     "acc_i": acc_i, "tokens_per_s": 5000.0 + 37.5 * s, "samples_seen_global": 16 * s,
                     "elapsed_s": round(4.25 * s, 3), "grad_norm": 0.3})
    return rows


PLAN = {"samples": 1172, "world_size": 2, "micro_batch": 1, "grad_accum": 1, "epochs": 3, "drop_remainder": False,
        "samples_per_rank_per_epoch": 586, "padded_samples": 0, "dropped_samples": 0,
        "micro_batches_per_rank_per_epoch": 586, "micro_batches_per_rank_total": 1758,
        "optimizer_steps_per_epoch": 586, "optimizer_steps_total": 1758, "global_batch": 2,
        "unsharded_micro_batches_per_rank_per_epoch": 1172, "unsharded_optimizer_steps_total": 3516,
        "steps_per_s": 1.75, "eta_s": 1004.57, "eta_unsharded_s": 2009.14, "tokens": 434000,
        "optimizer_steps_run": 1758, "steps_per_epoch_actual": [586, 586, 586], "max_tokens": 0,
        "units_per_epoch": [1172, 1172, 1172], "vocab": {"coverage": 0.9731, "distinct_seen": 5123, "size": 4096},
        "dtype": "bf16", "threads_per_rank": 1, "parallel": "ddp",
        "lines": ["plan: dataset 1,172 samples (global), 3 epochs, 434,000 tokens (global)"], "remaining_eta_s": 900.0}


def _audit(epoch: int) -> dict:
    return {"epoch": epoch, "samples": 1172, "world_size": 2, "per_rank": [586, 586], "padded": 0, "dropped": 0,
            "expected_dropped": 0, "duplicates": 0, "duplicate_examples": [], "missing": 0, "units": 0,
            "allowed": False, "disjoint": True, "covers": True, "ok": True,
            "line": "data: 1,172 samples over 2 ranks -> 586 per rank per epoch (0 padded), disjoint: yes"}


def train(run: Path, r: str) -> None:
    t = run / "train"
    t.mkdir(parents=True, exist_ok=True)
    m = metrics()
    (t / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in m))
    val = [{"epoch": e, "samples": 62, "loss_i": [2.5 - 0.2 * e, 2.9 - 0.2 * e, 3.1 - 0.2 * e],
            "acc_i": [0.41 + 0.05 * e, 0.33 + 0.05 * e, 0.27 + 0.05 * e], "loss": 7.0 - e, "step": 8 * (e + 1)}
           for e in range(3)]
    for v in val:  # what the trainer adds: 1 + a0 + a0 a1 + a0 a1 a2 for chains of 1, 2, 3
        a = v["acc_i"]
        v["expected_tau_by_chain"] = [1 + a[0], 1 + a[0] + a[0] * a[1], 1 + a[0] + a[0] * a[1] + a[0] * a[1] * a[2]]
        v["expected_tau"] = v["expected_tau_by_chain"][-1]
    (t / "validation.jsonl").write_text("".join(json.dumps(x) + "\n" for x in val))
    _w(t / "plan.json", PLAN)
    _w(t / "audit.json", {**_audit(2), "epochs": {str(e): _audit(e) for e in range(3)}})
    training = {"steps": 24, "epochs": 3, "samples": 384, "tokens": 99000, "world_size": 2, "ttt_steps": 3,
                "final_loss": m[-1]["loss"], "final_acc_i": m[-1]["acc_i"], "validation": val[-1],
                "vocab_coverage": 0.9731, "dtype": "bf16"}
    _w(t / "final" / "config.json", {"eyas_draft": {"hidden_size": 64, "draft_vocab_size": 4096, "num_layers": 1,
                                                    "feature_layers": [2, 4, 5], "target": PREPARED["target"]},
                                     "training": training})
    _marker(run, "train", "train", {"target": "tiny", "store": f"{r}/store", "out": f"{r}/train", "ttt_steps": 3},
            {"out": f"{r}/train", "final": f"{r}/train/final", **training, "tokens_per_s": 5432.1,
             "data_wait_share": 0.0123, "elapsed_s": 102.0, "audit": {}, "duplicate_data": False}, 118.4, nproc=2)


def _config(name: str, drafter: str, k: int, tau: float, speedup: float, rates: list) -> dict:
    per_cat = {c: {"turns": 2, "tau": round(tau + 0.1 * j, 3), "speedup": speedup, "tokens_per_s": 20.0,
                   "accept_rate_by_position": rates} for j, c in enumerate(CATS)}
    return {"name": name, "drafter": drafter, "mode": "chain", "k": k, "adaptive": True, "turns": 6, "tokens": 700,
            "decode_s": 30.0, "tokens_per_s": round(18.5 * speedup, 3), "speedup": speedup,
            "predicted_speedup": round(speedup * 1.08, 4), "efficiency": round(1 / 1.08, 4), "overhead_share": 0.05,
            "verify_ms": 60.0, "draft_step_ms": 4.0, "rounds": 300, "drafted_rounds": 290, "tau": tau,
            "tau_drafted": tau, "tau_hist": {"1": 100, "2": 120, "3": 80},
            "accept_rate_by_position": rates, "reach_by_position": rates,
            "end_to_end_speedup_vs_eyas_greedy": speedup,
            "lossless": {"checked": True, "identical": True, "turns": 6, "first_divergence": None},
            "per_category": per_cat}


def results(samples: bool) -> dict:
    configs = [_config("eagle3 chain k=3", "eagle3", 3, 2.345, 1.523, [0.61, 0.42, 0.3]),
               _config("eagle3 chain k=5", "eagle3", 5, 2.512, 1.611, [0.61, 0.42, 0.3, 0.22, 0.15]),
               _config("prompt-lookup k=7", "prompt-lookup", 7, 1.123, 0.987, [0.1, 0.05] + [None] * 5)]
    res = {"settings": {"target": "tiny", "draft": "d", "bench": "mt_bench", "temperature": 0.0, "max_new_tokens": 48,
                        "chain": [3, 5]},
           "target": {**PREPARED["target"], "dtype": "bfloat16", "device": "cpu", "runner": "LeanRunner"},
           "draft": {"path": "d", "feature_layers": [2, 4, 5], "draft_vocab_size": 4096, "num_layers": 1},
           "bench": {"name": "mt_bench", "prompts": 3, "turns": 6, "categories": list(CATS)}, "threads": 2,
           "latency_ms": {"1": 60.0, "4": 61.0}, "latency_prefix": 300,
           "baseline": {"eyas_greedy": {"tokens_per_s": 17.25, "decode_s": 40.0}, "chosen": "hf_generate",
                        "tokens_per_s": 18.5, "hf_generate": {"tokens_per_s": 18.5, "decode_s": 38.0,
                                                              "same_tokens_as_eyas": True}},
           "configs": configs, "best": {"name": "eagle3 chain k=5", "speedup": 1.611, "tau": 2.512},
           "records": [{"id": str(81 + i // 2), "category": CATS[i // 2], "turn": 1 + i % 2, "method": m,
                        "decode_s": 1.5 + i + k, "prefill_s": 0.1, "tokens": 40 + i + 10 * k}
                       for i in range(6) for k, m in enumerate(("plain", "hf_generate", "eagle3 chain k=3"))]}
    if samples:
        res["samples"] = [{"id": "81", "category": "coding", "turn": 1, "method": "eagle3 chain k=5",
                           "prompt": "Write a <b>haiku</b> & more", "pieces": ["The", " sun", " sets", " <b>", " on",
                                                                               " the", " bay", "."],
                           "accepted": [2, 0, 1, 1]}]
    return res


def evaluate(run: Path, r: str, samples: bool) -> None:
    res = results(samples)
    _w(run / "evaluate" / "results.json", res)
    _marker(run, "evaluate", "evaluate", {"target": "tiny", "draft": f"{r}/train/final", "out": f"{r}/evaluate"},
            res, 95.5)


def export(run: Path, r: str) -> None:
    for fmt in ("eagle3", "speculators"):
        out = f"{r}/export/{fmt}"
        (run / "export" / fmt).mkdir(parents=True, exist_ok=True)
        _w(run / "export" / fmt / "config.json", {"architectures": ["LlamaForCausalLMEagle3"]})
        _marker(run, f"export-{fmt}", "export", {"checkpoint": f"{r}/train/final", "format": fmt, "out": out},
                {"format": fmt, "out": out, "tensors": 12, "bytes": 13_017_216, "dtype": "bfloat16",
                 "draft_vocab_size": 4096, "vllm_layer_ids": [2, 4, 5], "sglang_layer_ids": [1, 3, 4],
                 "verifier": None}, 2.5)


def make_run(root: Path, samples: bool = True, settings_prefix: str | None = None) -> Path:
    """The whole run folder at root; stage settings name paths under `settings_prefix` (default: root itself),
    e.g. "runs/demo" as the demo writes them relative to its working directory."""
    root.mkdir(parents=True, exist_ok=True)
    r = settings_prefix or str(root)
    _w(root / "pipeline.json", [{"name": n, "command": n.split("-")[0], "settings": {},
                                 "nproc": 2 if n == "train" else 1} for n in STAGES])
    regenerate(root, r)
    prepare_and_store(root, r)
    train(root, r)
    evaluate(root, r, samples)
    export(root, r)
    return root


# ---------------------------------------------------------------------------------------------- reading the page
class Page(HTMLParser):
    """The page's sections (id -> status and text), sourced numbers, card figures, highlighted tokens, ids."""

    VOID = {"meta", "br", "img", "input", "link", "hr"}
    BLOCKS = {"td", "th", "tr", "p", "div", "li", "dt", "dd", "h2", "h3", "pre", "figure"}  # text breaks between

    def __init__(self, text: str):
        super().__init__()
        self.stack: list[tuple[str, dict]] = []
        self.sections: dict[str, dict] = {}
        self.numbers: list[dict] = []  # {"src", "scale", "text"}
        self.kpis: list[dict] = []  # the card's {"kpi-label", "kpi-value", "kpi-sub"} texts
        self.drafted: list[str] = []
        self.ids: list[str] = []
        self.svgs = self.paths = 0
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.append(a["id"])
        if tag == "div" and (a.get("class") or "").split(" ")[0] == "kpi":
            self.kpis.append({"kpi-label": "", "kpi-value": "", "kpi-sub": ""})
        if tag == "section":
            self.sections[a["id"]] = {"status": a.get("data-status"), "text": ""}
        if tag == "svg" and "plot" in (a.get("class") or ""):
            self.svgs += 1
        if tag == "path" and a.get("d"):
            self.paths += 1
        if a.get("data-src") is not None:
            self.numbers.append({"src": a["data-src"], "scale": float(a.get("data-scale", 1)), "text": ""})
            a["_num"] = self.numbers[-1]
        if tag not in self.VOID:
            self.stack.append((tag, a))
        if tag in self.BLOCKS:
            self.handle_data(" ")

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in self.VOID:
            self.stack.pop()

    def handle_endtag(self, tag):
        if tag in self.BLOCKS:
            self.handle_data(" ")
        while self.stack:
            if self.stack.pop()[0] == tag:
                break

    def handle_data(self, data):
        classes = [(t, a.get("class") or "") for t, a in self.stack]
        for _, a in self.stack:
            if "_num" in a:
                a["_num"]["text"] += data
        for t, a in self.stack:
            if t == "section":
                self.sections[a["id"]]["text"] += data
        if any(c == "tok-d" for _, c in classes) and any(c == "gen" for _, c in classes):  # not the legend
            self.drafted.append(data)
        part = next((c for _, c in reversed(classes) if c in ("kpi-label", "kpi-value", "kpi-sub")), None)
        if part:
            self.kpis[-1][part] += data

def card(page: Page) -> dict:
    """Card label -> value text (labels as written in the page, before CSS upper-casing)."""
    return {k["kpi-label"].strip(): k["kpi-value"].strip() for k in page.kpis}


def source_value(run_dir: Path, src: str):
    """What a data-src names: FILE#/json/pointer (a .jsonl file: the pointer starts with the line index), or
    FILE#lines (the count of its non-empty lines)."""
    name, _, pointer = src.partition("#")
    path = Path(name) if Path(name).is_absolute() else run_dir / name
    text = path.read_text(encoding="utf-8")
    if pointer == "lines":
        return sum(1 for line in text.splitlines() if line.strip())
    parts = pointer.split("/")[1:]
    if path.suffix == ".jsonl":  # only the line named is parsed: another may be cut by a crash
        doc = json.loads([x for x in text.splitlines() if x.strip()][int(parts.pop(0))])
    else:
        doc = json.loads(text)
    for part in parts:
        part = part.replace("~1", "/").replace("~0", "~")
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


def shown(text: str) -> tuple[float, int]:
    """(the first number in a displayed text, its decimals): '1,234.5 MiB' -> (1234.5, 1)."""
    m = re.search(r"-?\d[\d,]*(?:\.(\d+))?", text)
    assert m, f"no number in {text!r}"
    return float(m.group(0).replace(",", "")), len(m.group(1) or "")


def check_numbers(page: Page, run_dir: Path) -> int:
    """Every sourced number on the page equals its source, to the precision displayed; returns how many."""
    for n in page.numbers:
        value, decimals = shown(n["text"])
        expected = source_value(run_dir, n["src"])
        assert isinstance(expected, (int, float)), f"{n['src']} is {expected!r}, not a number"
        tolerance = 0.5 * 10 ** -decimals / n["scale"] + 1e-9 * abs(expected)
        assert abs(value / n["scale"] - expected) <= tolerance, f"{n['src']}: page shows {n['text']!r}, file {expected}"
    return len(page.numbers)


def report(run_dir: Path, **kw) -> tuple[dict, Page]:
    summary = run(ReportConfig(run=str(run_dir), quiet=True, **kw))
    return summary, Page(Path(summary["path"]).read_text(encoding="utf-8"))


SECTIONS = ["summary", "pipeline", "data", "plan", "training", "evaluation", "samples", "export"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, dict, Page]:
    """The whole run, reported once: (run folder, summary, page)."""
    run_dir = make_run(tmp_path_factory.mktemp("report") / "demo")
    return (run_dir, *report(run_dir))


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name,prefix", [("demo", "runs/demo"), ("demo", "/elsewhere/old/runs/demo"),
                                         ("renamed", "runs/demo")])
def test_every_section_present_and_every_number_equals_its_file(tmp_path, monkeypatch, name, prefix):
    """Settings name the run relative to the demo's working directory, or a folder it moved from, or the run folder
    was renamed since (the demo fixture: by its absolute path)."""
    run_dir = make_run(tmp_path / "runs" / name, settings_prefix=prefix)
    monkeypatch.chdir(tmp_path / "runs")  # relative settings do not resolve from here: the run folder must be used
    summary, page = report(run_dir)
    assert summary["path"] == str(run_dir / "report.html")
    assert summary["sections"] == SECTIONS and summary["not_run"] == [] and summary["problems"] == []
    assert {k: v["status"] for k, v in page.sections.items()} == {s: "ok" for s in SECTIONS[1:]}
    assert check_numbers(page, run_dir) > 150
    sources = {n["src"].partition("#")[0] for n in page.numbers}
    assert {"prepared/summary.json", "store/manifest.json", "train/plan.json", "train/audit.json",
            "train/metrics.jsonl", "train/validation.jsonl", "evaluate/results.json", "stages/train.json",
            "regenerated/gsm8k.jsonl", "train/final/config.json"} <= sources


def test_key_figures_by_hand(demo):
    """The figures people read first, against values worked out by hand from make_run's files."""
    page = demo[2]
    assert card(page) == {"acceptance length τ": "2.51", "speedup": "1.61×", "lossless": "yes",
                          "training time": "2.0 min"}  # 118.4 s
    text = {k: " ".join(v["text"].split()) for k, v in page.sections.items()}
    assert "215.1 MiB" in text["data"]  # 225,567,890 B / 2**20
    assert "519.7" in text["data"] and "97.31% of the loss-masked" in text["data"]
    assert "duplicate-content 50 a.jsonl:7" in text["data"] and "too-long 6 a.jsonl:99" in text["data"]
    assert "regenerate-gsm8k 5 5 0 2 812 40.2 1 20 s" in text["data"]  # 5 lines in regenerated/gsm8k.jsonl
    assert "rank 0: 586 · rank 1: 586" in text["plan"] and "1,758 in this run" in text["plan"]
    assert "16.7 min, against 33.5 min if not sharded" in text["plan"]  # 1004.57 s, 2009.14 s
    assert "audit passed" in text["plan"] and "each of the epochs 1, 2, 3" in text["plan"]
    # the last metrics line (step 24): loss_0 = 6 exp(-24/9) + 1.2, acc_0 = 0.7 (1 - exp(-24/7))
    assert f"step 0 {6 * math.exp(-24 / 9) + 1.2:.4f} {100 * 0.7 * (1 - math.exp(-24 / 7)):.1f}% 2.1000 51.0%" \
        in text["training"]
    assert "eagle3 chain k=5 2.51 29.8 1.61× 1.74× 93% yes" in text["evaluation"]  # 18.5 * 1.611 tok/s
    assert "no speculation: transformers generate – 18.5 1× (the baseline)" in text["evaluation"]
    assert "writing 2.54 2.71 1.32" in text["evaluation"]  # per category: tau + 0.1 * 2
    # the last validation (acc 0.51, 0.43, 0.37) expects 1 + 0.51 + 0.51 x 0.43 + 0.51 x 0.43 x 0.37 = 1.8104 for a
    # chain of 3, beside the 2.345 measured (0.772x); the chain of 5 is longer than the 3 TTT steps trained: no row
    assert f"eagle3 chain k=3 1.81 {2.345:.2f} 0.77×" in text["evaluation"]
    assert "eagle3 chain k=5 2.51 2.51" not in text["evaluation"]
    assert "expected acceptance length (last validation, chain of 3) 1.81" in text["training"]
    assert "eagle3 runs" in text["export"] or "eagle3 " in text["export"]
    assert "12.4 MiB" in text["export"]  # 13,017,216 B


def test_card_shows_the_draft_even_when_a_baseline_was_faster(tmp_path):
    run_dir = make_run(tmp_path / "demo")
    path = run_dir / "evaluate" / "results.json"
    res = json.loads(path.read_text())
    res["configs"][2]["speedup"] = 1.9
    res["best"] = {"name": "prompt-lookup k=7", "speedup": 1.9, "tau": 1.123}
    path.write_text(json.dumps(res))
    _, page = report(run_dir)
    assert card(page)["acceptance length τ"] == "2.51" and card(page)["speedup"] == "1.61×"  # eagle3 chain k=5
    assert page.kpis[1]["kpi-sub"].strip().endswith("prompt-lookup k=7 was faster: 1.90×")
    assert "prompt-lookup k=7 baseline 1.12" in " ".join(page.sections["evaluation"]["text"].split())


def test_every_evaluation_of_the_run_is_shown(tmp_path):
    """The demo evaluates on MT-Bench and on GSM8K test: both stages' figures are on the page, each from its file."""
    run_dir = make_run(tmp_path / "demo")
    res = results(samples=False)
    res["bench"] = {"name": "gsm8k", "prompts": 4, "turns": 4, "categories": []}
    res["configs"] = [_config("eagle3 chain k=3", "eagle3", 3, 1.876, 1.432, [0.55, 0.31, 0.2])]
    for c in res["configs"]:
        c["per_category"] = {}
    res["best"] = {"name": "eagle3 chain k=3", "speedup": 1.432, "tau": 1.876}
    _w(run_dir / "evaluate-gsm8k" / "results.json", res)
    _marker(run_dir, "evaluate-gsm8k", "evaluate", {"bench": "gsm8k", "out": str(run_dir / "evaluate-gsm8k")}, res,
            40.0)
    summary, page = report(run_dir)
    text = " ".join(page.sections["evaluation"]["text"].split())
    assert summary["problems"] == [] and check_numbers(page, run_dir) > 150
    first, second = text.index("mt_bench (stage evaluate)"), text.index("gsm8k (stage evaluate-gsm8k)")
    assert first < second
    assert "eagle3 chain k=5 2.51 29.8 1.61×" in text[:second]  # MT-Bench's best, from evaluate/results.json
    assert "eagle3 chain k=3 1.88 26.5 1.43×" in text[second:]  # 18.5 * 1.432 tok/s
    sources = {n["src"].partition("#")[0] for n in page.numbers}
    assert {"evaluate/results.json", "evaluate-gsm8k/results.json"} <= sources
    assert card(page)["speedup"] == "1.61×"  # the card keeps the run's main evaluation


def test_sample_generation_highlights_exactly_the_accepted_draft_tokens(demo):
    page = demo[2]
    # pieces The|sun|sets|<b>|on|the|bay|. with accepted [2, 0, 1, 1]: token 0 from the prompt's forward, then
    # round 1: sun sets (draft) + <b> (target); round 2: on (target); round 3: the (draft) + bay; round 4: "." (draft)
    assert page.drafted == [" sun", " sets", " the", "."]
    text = page.sections["samples"]["text"]
    assert "The sun sets <b> on the bay." in text  # the markup in the text is escaped, not interpreted
    assert "8 tokens in 4 verification rounds, 4 of them drafted and accepted" in " ".join(text.split())


def test_without_sample_traces_the_records_are_shown_and_the_field_named(tmp_path):
    run_dir = make_run(tmp_path / "demo", samples=False)
    _, page = report(run_dir)
    text = " ".join(page.sections["samples"]["text"].split())
    assert page.sections["samples"]["status"] == "ok" and page.drafted == []
    assert "samples in results.json" in text and "81 coding 1 40 in 1.50 s 50 in 2.50 s 60 in 3.50 s" in text
    check_numbers(page, run_dir)


def test_missing_files_render_not_run_sections(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    summary, page = report(empty)
    assert summary["not_run"] == SECTIONS[1:]
    assert all(s["status"] == "not run" and "not run" in s["text"] for s in page.sections.values())
    assert card(page) == {"acceptance length τ": "–", "speedup": "–", "lossless": "–", "training time": "–"}
    # a run stopped after training: evaluation and what depends on it are "not run", the rest is there
    run_dir = make_run(tmp_path / "demo")
    for p in (run_dir / "evaluate" / "results.json", run_dir / "stages" / "evaluate.json"):
        p.unlink()
    for name in ("export-eagle3", "export-speculators"):
        (run_dir / "stages" / f"{name}.json").unlink()
    summary, page = report(run_dir)
    assert summary["not_run"] == ["evaluation", "samples", "export"]
    assert "evaluate/results.json" in page.sections["evaluation"]["text"]
    assert check_numbers(page, run_dir) > 100


def test_damaged_files_are_named_and_the_rest_still_reports(tmp_path):
    run_dir = make_run(tmp_path / "demo")
    metrics = run_dir / "train" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 25, "epoch": 2, "lo')  # a crash mid-line
    (run_dir / "store" / "manifest.json").write_text("{not json")
    summary, page = report(run_dir)
    assert len(summary["problems"]) == 2 and "problems" in page.sections
    assert "manifest.json" in page.sections["problems"]["text"] and "metrics.jsonl" in page.sections["problems"]["text"]
    assert "Hidden-state store" in page.sections["data"]["text"] and "not run" in page.sections["data"]["text"]
    assert page.sections["training"]["status"] == "ok"
    check_numbers(page, run_dir)  # the valid lines keep their line numbers in data-src


def test_page_is_self_contained_with_drawn_plots(demo):
    run_dir, summary, page = demo
    assert summary["not_run"] == [] and check_numbers(page, run_dir) > 150  # settings by absolute path
    html = Path(summary["path"]).read_text(encoding="utf-8")
    assert page.svgs == 12 and page.paths > 100  # the expected acceptance length per validation pass: the 12th
    assert len(page.ids) == len(set(page.ids))  # every figure's SVG ids are prefixed: no clash in one document
    assert not re.search(r"<(script|link|img|iframe)\b", html)
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)  # nothing fetched from the network
    assert re.findall(r"url\((?!#)", html) == []


def test_cli_writes_where_asked_and_refuses_a_missing_folder(tmp_path, capsys):
    run_dir = tmp_path / "demo"  # an empty run: the command line is what is tested here
    run_dir.mkdir()
    out = tmp_path / "elsewhere" / "r.html"
    assert cli_main(["report", str(run_dir), "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["path"] == str(out) and out.is_file() and not (run_dir / "report.html").exists()
    assert cli_main(["report", str(tmp_path / "nope")]) == 2
    assert "run folder" in capsys.readouterr().err


def test_data_scaling_curve_points_trend_and_extrapolation_by_hand(tmp_path):
    """Drafts trained on 1/4, 1/2 and all of the data, evaluated side by side: one point each at the chain they
    share, their training tokens from their runs' plan.json, and the least-squares line in log tokens."""
    run_dir = make_run(tmp_path / "scaling")
    r = str(run_dir)
    for share, tokens in (("q", 100_000), ("h", 200_000)):
        _w(run_dir / "curve" / share / "plan.json", {**PLAN, "tokens": tokens, "epochs": 2})
        _w(run_dir / "curve" / share / "final" / "config.json", {})
    _w(run_dir / "train" / "plan.json", {**PLAN, "tokens": 400_000, "epochs": 2})
    res = results(samples=False)
    res["settings"]["draft"] = f"{r}/train/final"
    res["configs"] = [_config("eagle3 chain k=5", "eagle3", 5, 1.5, 1.2, [0.4]),  # all: 400k tokens
                      _config("q/final chain k=5", f"{r}/curve/q/final", 5, 1.1, 0.9, [0.2]),
                      _config("h/final chain k=5", f"{r}/curve/h/final", 5, 1.4, 1.1, [0.3]),
                      _config("eagle3 chain k=3", "eagle3", 3, 9.0, 1.0, [0.4]),  # not the shared chain
                      _config("prompt-lookup k=7", "prompt-lookup", 7, 9.0, 1.0, [0.1])]
    _w(run_dir / "evaluate" / "curve" / "results.json", res)
    _marker(run_dir, "evaluate-curve", "evaluate", {"draft": f"{r}/train/final", "out": f"{r}/evaluate/curve"},
            {}, 10.0)
    _, page = report(run_dir)
    assert page.sections["scaling"]["status"] == "ok"
    check_numbers(page, run_dir)
    text = " ".join(page.sections["scaling"]["text"].split())
    # by hand: x = ln(tokens) steps by ln 2; taus 1.1, 1.4, 1.5 -> slope b = (1.5 - 1.1) / (2 ln 2) per e-fold,
    # +0.2 per doubling; the line's mean 4/3 at the middle point (200k): 2.0 is (2 - 4/3) / 0.2 doublings past it
    assert "evaluate-curve q 100,000 2 1.100 1.133" in text
    assert "evaluate-curve train 400,000 2 1.500 1.533" in text
    assert "+0.200 per doubling" in text
    at2 = 200_000 * 2 ** ((2 - 4 / 3) / 0.2)
    assert f"τ 2.0 at {at2:,.0f} tokens ({at2 / 400_000:,.1f}× the largest)" in text
    assert "9.000" not in text  # neither the shorter chain nor prompt lookup is a point


def test_no_scaling_section_without_drafts_of_different_data(demo):
    assert "scaling" not in demo[2].sections


def test_drafts_of_one_amount_of_data_make_no_curve(tmp_path):
    """Ablations (several drafts, each trained on the same samples) are not a data-scaling curve."""
    run_dir = make_run(tmp_path / "ablations")
    r = str(run_dir)
    _w(run_dir / "curve" / "a" / "plan.json", {**PLAN, "tokens": 434000})
    _w(run_dir / "curve" / "a" / "final" / "config.json", {})
    res = results(samples=False)
    res["settings"]["draft"] = f"{r}/train/final"  # train/plan.json: 434,000 tokens too
    res["configs"] = [_config("eagle3 chain k=5", "eagle3", 5, 1.5, 1.2, [0.4]),
                      _config("a/final chain k=5", f"{r}/curve/a/final", 5, 1.1, 0.9, [0.2])]
    _w(run_dir / "evaluate" / "ab" / "results.json", res)
    _marker(run_dir, "evaluate-ab", "evaluate", {"draft": f"{r}/train/final", "out": f"{r}/evaluate/ab"}, {}, 1.0)
    assert "scaling" not in report(run_dir)[1].sections


def test_a_disturbed_evaluation_is_cautioned_on_the_page(tmp_path):
    """evaluate writes its caution into results.json when a configuration ran faster than its tau and the measured
    latencies allow (eyas.speculate.results.disturbed_words); the page shows it under the figures, and shows none
    for an evaluation without one."""
    run_dir = make_run(tmp_path / "demo")
    _, page = report(run_dir)
    assert "caution" not in " ".join(page.sections["evaluation"]["text"].split())
    path = run_dir / "evaluate" / "results.json"
    res = json.loads(path.read_text())
    res["caution"] = ("caution: 1 configuration(s) ran faster than the measured latencies allow (eagle3 chain k=5: "
                      "1.61x measured, 1.30x the most its tau and t(q) allow)")
    _w(path, res)
    _, page = report(run_dir)
    text = " ".join(page.sections["evaluation"]["text"].split())
    assert "caution caution: 1 configuration(s) ran faster than the measured latencies allow (eagle3 chain k=5" in text
