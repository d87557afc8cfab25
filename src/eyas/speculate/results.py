"""The figures of `eyas evaluate` (from its per-turn records), results.json, report.md and the plots.

Definitions (tau and the per-position rates: `eyas.speculate.decode`):
- tokens/s: decode tokens / decode seconds, summed over turns; a turn's decode part is everything after the
  prompt's forward and first token (so prefill, equal for every method, does not dilute the ratio; the
  end-to-end ratio with prefill is reported beside it). transformers' `generate` is timed the same way, from
  its first to its last token.
- baseline: the faster of eyas's plain greedy loop and transformers' `generate`; speedup = tokens/s over it.
- predicted speedup: what the measured costs allow with zero overhead,
      sum_rounds (a + 1) * t(1) / sum_rounds (t(q) + draft seconds),   q = 1 + tokens verified that round,
  with t(q) from the latency table; for a fixed chain of k this is tau * t(1) / (t(k+1) + k * t_draft).
- engine efficiency: measured speedup / predicted speedup.
- overhead share: (decode seconds - target forwards - draft forwards) / decode seconds.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from eyas.core.files import write_json
from eyas.speculate.decode import acceptance_stats
from eyas.speculate.target_forward import effective_latency

EFFICIENCY_CEILING = 1.15  # measured / predicted speedup above this is not the engine's: the run was disturbed


def disturbed(res: dict) -> list[dict]:
    """The configurations faster than the measured latencies allow by more than noise (efficiency above
    EFFICIENCY_CEILING: the prediction counts no overhead at all). Their speedups are not the machine's: the plain
    baseline was timed slower than the target's forwards measured, most often because other work ran beside it."""
    return [c for c in res.get("configs") or [] if (c.get("efficiency") or 0.0) > EFFICIENCY_CEILING]


def disturbed_words(res: dict) -> str:
    """One sentence on `disturbed` configurations, or '' when there are none."""
    bad = disturbed(res)
    if not bad:
        return ""
    worst = max(bad, key=lambda c: c["efficiency"])
    return (f"caution: {len(bad)} configuration(s) ran faster than the measured latencies allow ({worst['name']}: "
            f"{worst['speedup']:.2f}x measured, {worst['predicted_speedup']:.2f}x the most its tau and t(q) allow): "
            "the plain baseline was timed slower than this machine runs it, most often because other work ran "
            "beside the evaluation; these speedups are not to be trusted. Rerun on a quiet machine, or with "
            "--repeats 3")


def _tps(recs) -> float | None:
    toks = sum(max(len(r["tokens"]) - 1, 0) for r in recs)
    secs = sum(r["decode_s"] for r in recs)
    return toks / secs if secs > 0 else None


def _t(latency: dict, q: int) -> float:
    qs = sorted(latency)
    return float(np.interp(q, qs, [latency[x] for x in qs]))


def method_figures(recs: list[dict], base_tps: float | None, latency: dict) -> dict:
    """Figures of one method over some turns (see the module docstring)."""
    rounds = [r for rec in recs for r in rec["rounds"]]
    stats = acceptance_stats([r["accepted"] for r in rounds], [r["depth"] for r in rounds])
    tps = _tps(recs)
    decode = sum(r["decode_s"] for r in recs)
    target_s, draft_s = sum(r["target_s"] for r in rounds), sum(r["draft_s"] for r in rounds)
    calls = sum(r["draft_calls"] for r in rounds)
    ideal = sum(_t(latency, 1 + r["size"]) + r["draft_s"] for r in rounds)
    predicted = sum(r["accepted"] + 1 for r in rounds) * _t(latency, 1) / ideal if ideal else None
    speedup = tps / base_tps if tps and base_tps else None
    return {"turns": len(recs), "tokens": sum(len(r["tokens"]) for r in recs), "decode_s": decode,
            "tokens_per_s": tps, "speedup": speedup, "predicted_speedup": predicted,
            "efficiency": speedup / predicted if speedup and predicted else None,
            "overhead_share": (decode - target_s - draft_s) / decode if decode else None,
            "verify_ms": 1000 * target_s / len(rounds) if rounds else None,
            "draft_step_ms": 1000 * draft_s / calls if calls else None, **stats}


def rounds_latency(records: list[dict]) -> dict[str, dict]:
    """The target forwards the run's speculative rounds took, by q (tokens verified + 1), every method together:
    {q: {"ms": mean, "rounds": n}}; beside the latency table it shows what verification cost as the run went.
    With --repeats n the records hold each turn's fastest decode, so these are its rounds."""
    by_q: dict[int, list[float]] = {}
    for rec in records:
        for r in rec.get("rounds") or ():
            by_q.setdefault(r["size"] + 1, []).append(r["target_s"])
    return {str(q): {"ms": 1000 * sum(v) / len(v), "rounds": len(v)} for q, v in sorted(by_q.items())}


def _lossless(recs: list[dict], tokenizer) -> dict:
    """The verdict: `lossless` is true when every emitted token is the target's top-1 at its position (outputs
    equal to plain greedy decoding, or differing from it only at near-ties, each re-scored in fp32: see
    eyas.speculate.lossless); `identical` says whether they equal plain greedy token for token, and
    `near_ties` lists where they do not, with the margins."""
    bad = [r for r in recs if r.get("divergence") is not None]
    if not bad:
        return {"checked": True, "lossless": True, "identical": True, "turns": len(recs), "near_ties": [],
                "mismatch": None, "first_divergence": None}
    ties = [{"id": r["id"], "turn": r["turn"], "index": r["divergence"], "target_margin": r.get("margin"),
             "fp32_ties": len((r.get("rescore") or {}).get("ties", [])),
             "replayed": [t for t in (r.get("rescore") or {}).get("ties", []) if t.get("replayed")]} for r in bad]
    wrong = next((r for r in bad if (r.get("rescore") or {}).get("mismatch") or "rescore" not in r), None)
    mismatch = None
    if wrong is not None:
        m = (wrong.get("rescore") or {}).get("mismatch") or {}
        mismatch = {"id": wrong["id"], "turn": wrong["turn"], **m,
                    "token_text": tokenizer.decode([m["token"]]) if "token" in m else None,
                    "top1_text": tokenizer.decode([m["top1"]]) if "top1" in m else None,
                    "replay_check": wrong.get("replay"),  # eyas.speculate.lossless.confirm_by_replay
                    # what a replay needs: the turn's ids and each round's draft length and accepted tokens
                    "replay": {"prompt_ids": wrong["prompt"], "output_ids": wrong["tokens"],
                               "reference_ids": wrong["reference"],
                               "rounds": [[r["size"], r["depth"], r["accepted"]] for r in wrong.get("rounds", [])]}}
    r = bad[0]
    i, ref = r["divergence"], r["reference"]
    got = r["tokens"]
    pick = lambda seq: seq[i] if i < len(seq) else None  # noqa: E731
    return {"checked": True, "lossless": mismatch is None, "identical": False, "turns": len(recs),
            "diverging_turns": len(bad), "near_ties": ties if mismatch is None else [], "mismatch": mismatch,
            "first_divergence": {"id": r["id"], "turn": r["turn"], "index": i, "expected": pick(ref), "got": pick(got),
                                 "expected_text": tokenizer.decode([pick(ref)]) if pick(ref) is not None else None,
                                 "got_text": tokenizer.decode([pick(got)]) if pick(got) is not None else None,
                                 "target_margin": r.get("margin")}}


def _samples(recs: list[dict], tokenizer, limit: int = 3) -> list[dict]:
    """A few generations with the tokens each round accepted, for the run report: pieces[0] came from the prompt's
    forward, then round r emitted accepted[r] draft tokens and one of the target's own."""
    return [{"id": r["id"], "category": r["category"], "turn": r["turn"], "method": r["method"], "prompt": r["user"],
             "pieces": [tokenizer.decode([t]) for t in r["tokens"]],
             "accepted": [x["accepted"] for x in r["rounds"]]} for r in recs[:limit]]


def aggregate(cfg, target, draft, runner, items, methods, records, latency) -> dict:
    by = lambda name, cat=None: [r for r in records if r["method"] == name and cat in (None, r["category"])]  # noqa
    cats = sorted({i.category for i in items})
    plain_tps, hf_tps = _tps(by("plain")), _tps(by("hf_generate")) if cfg.hf_generate else None
    chosen = "hf_generate" if hf_tps and plain_tps and hf_tps > plain_tps else "plain"
    base = {"eyas_greedy": {"tokens_per_s": plain_tps, "decode_s": sum(r["decode_s"] for r in by("plain"))},
            "chosen": chosen, "tokens_per_s": hf_tps if chosen == "hf_generate" else plain_tps}
    if cfg.hf_generate:
        same = all(h["tokens"] == p["tokens"] for h, p in zip(by("hf_generate"), by("plain")))
        base["hf_generate"] = {"tokens_per_s": hf_tps, "decode_s": sum(r["decode_s"] for r in by("hf_generate")),
                               "same_tokens_as_eyas": same if cfg.temperature == 0 else None}
    configs = []
    widths = runner.widths
    cost = effective_latency(latency, widths)  # what a verification cost, widened where that was faster
    for m in methods:
        fig = method_figures(by(m.name), base["tokens_per_s"], cost)
        e2e = [r for r in by(m.name)]
        e2e_plain = (sum(len(r["tokens"]) for r in by("plain"))
                     / sum(r["decode_s"] + r["prefill_s"] for r in by("plain")))
        e2e_m = sum(len(r["tokens"]) for r in e2e) / sum(r["decode_s"] + r["prefill_s"] for r in e2e)
        per_cat = {}
        for c in cats:
            f = method_figures(by(m.name, c), _tps(by(chosen, c)), cost)
            per_cat[c] = {k: f[k] for k in ("turns", "tau", "speedup", "tokens_per_s", "accept_rate_by_position")}
        configs.append({"name": m.name, "drafter": m.source, "mode": m.mode, "k": m.k,
                        "adaptive": m.controller is not None, **fig,
                        "end_to_end_speedup_vs_eyas_greedy": e2e_m / e2e_plain,
                        "lossless": _lossless(by(m.name), target.tokenizer) if cfg.temperature == 0 else
                        {"checked": False, "identical": None, "first_divergence": None},
                        "per_category": per_cat,
                        **({"rounds_by_drafter": dict(m.drafter.used)} if hasattr(m.drafter, "used") else {}),
                        **({"learned_latency_ms": {str(q): 1000 * t for q, t in m.controller.latency().items()}}
                           if m.controller is not None else {})})
    best = max(configs, key=lambda c: c["speedup"] or 0.0, default=None)
    drafted = [c for c in configs if c["drafter"] == "eagle3"] or configs
    shown = max(drafted, key=lambda c: c["speedup"] or 0.0, default=None)
    settings = {k: v for k, v in cfg.to_dict().items() if k not in ("quiet", "json")}

    return {"settings": settings,
            "target": {**target.identity(), "dtype": str(target.dtype).removeprefix("torch."),
                       "device": str(target.device),
                       "runner": type(runner).__name__ + (" (compiled)" if getattr(runner, "compiled", False) else ""),
                       "projections": getattr(runner, "linear_choice", "the model's own modules")},
            "draft": {"path": cfg.draft, "feature_layers": list(draft.cfg.feature_layers),
                      "draft_vocab_size": draft.cfg.draft_vocab_size, "num_layers": draft.cfg.num_layers},
            "bench": {"name": cfg.bench, "prompts": len(items), "turns": sum(len(i.turns) for i in items),
                      "categories": cats},
            "threads": torch.get_num_threads(),
            "latency_ms": {str(q): 1000 * latency[q] for q in sorted(latency)}, "latency_prefix": cfg.latency_prefix,
            "verify_widths": {str(q): w for q, w in sorted(widths.items())},
            "latency_in_rounds_ms": rounds_latency(records),
            "baseline": base, "configs": configs,
            "best": {k: best[k] for k in ("name", "speedup", "tau")} if best else None,
            "caution": disturbed_words({"configs": configs}) or None,  # for the report, which reads no torch
            "samples": _samples(by(shown["name"]), target.tokenizer) if shown else [],
            "records": [{k: r[k] for k in ("id", "category", "turn", "method", "decode_s", "prefill_s")}
                        | {"tokens": len(r["tokens"])} for r in records]}


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def lossless_word(ll: dict) -> str:
    """yes (token for token as plain greedy), yes* (the target's top-1 everywhere, but near-ties decided otherwise
    than plain greedy's rounding did), NO (a token that is not the target's top-1), n/a (sampling)."""
    if not ll.get("checked"):
        return "n/a"
    if not ll.get("lossless", ll.get("identical")):
        return "NO"
    return "yes" if ll.get("identical") else "yes*"


def summary_lines(res: dict) -> list[str]:
    b = res["baseline"]
    lines = [f"draft precision: {res['draft'].get('precision', 'not recorded')}",
             "latency t(q) ms: " + ", ".join(f"t({q})={v:.1f}" for q, v in res["latency_ms"].items()
                                             if int(q) in (1, 4, 8, 16, 32)),
             f"baseline: eyas greedy {_fmt(b['eyas_greedy']['tokens_per_s'], '.1f')} tok/s"
             + (f", transformers generate {_fmt(b['hf_generate']['tokens_per_s'], '.1f')} tok/s"
                if "hf_generate" in b else "")
             + f" -> baseline {b['chosen']} {_fmt(b['tokens_per_s'], '.1f')} tok/s",
             f"{'config':<30} {'tau':>5} {'tok/s':>7} {'speedup':>7} {'pred.':>6} {'eff.':>5} {'ovh.':>5}  lossless  "
             "accept rate by position"]
    for c in res["configs"]:
        ll = c["lossless"]
        verdict = lossless_word(ll)
        rates = " ".join(_fmt(r) for r in c["accept_rate_by_position"])
        lines.append(f"{c['name']:<30} {_fmt(c['tau']):>5} {_fmt(c['tokens_per_s'], '.1f'):>7} "
                     f"{_fmt(c['speedup']):>7} {_fmt(c['predicted_speedup']):>6} {_fmt(c['efficiency']):>5} "
                     f"{_fmt(100 * c['overhead_share'] if c['overhead_share'] is not None else None, '.0f'):>4}%  "
                     f"{verdict:<8}  {rates}")
        if ll.get("mismatch"):
            d = ll["mismatch"]
            lines.append(f"   NOT the target's top-1: prompt {d['id']} turn {d['turn']} token {d.get('index')}: "
                         f"{d.get('token_text')!r} where the target's fp32 top-1 is {d.get('top1_text')!r} "
                         f"(gap {_fmt(d.get('fp32_gap'), '.3f')})" + _replay_words(d.get("replay_check")))
        elif ll.get("first_divergence"):
            d = ll["first_divergence"]
            lines.append(f"   {len(ll['near_ties'])} turn(s) differ from plain greedy at near-ties, every token "
                         f"re-scored as the target's fp32 top-1; first: prompt {d['id']} turn {d['turn']} token "
                         f"{d['index']}: {d['expected_text']!r} or {d['got_text']!r} (target top-2 margin "
                         f"{_fmt(d['target_margin'], '.3f')})")
            if replayed := [t for tie in ll["near_ties"] for t in tie.get("replayed", [])]:
                lines.append(f"   {len(replayed)} of those token(s) lie further below the fp32 top-1 than rounding "
                             f"(largest gap {max(t['fp32_gap'] for t in replayed):.3f}); replayed, each is the "
                             "argmax of the target's own logits in the run's verify shapes, and the fp32 replay "
                             "equals the cache-free forward (eyas.speculate.lossless)")
    if words := disturbed_words(res):
        lines.append(words)
    return lines


def _replay_words(check: dict | None) -> str:
    """Why the replay (eyas.speculate.lossless.confirm_by_replay) did not settle a mismatch, in words."""
    if not check:
        return ""
    if "why" in check:
        return f"; not replayed: {check['why']}"
    words = (f"; replayed: fp32 cache error {check['fp32_cache_error']:.1e} (at most "
             f"{check.get('tolerance', 1e-3):.0e} allowed), the run's own tokens "
             + ("reproduced" if check["reproduced"] else f"not reproduced from token {check['first_not_reproduced']}"))
    if "dtype_error" in check:  # eyas.speculate.lossless.DTYPE_SPREAD
        words += (f", its logits {check['dtype_error']:.1e} from fp32 against one-token decoding's "
                  f"{check['plain_dtype_error']:.1e} (at most {check['spread']:g}x allowed)")
    return words


def _plots(res: dict, out: Path) -> list[str]:
    import matplotlib  # heavy: loaded only where a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: loaded only where a plot is drawn

    files = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for c in res["configs"]:
        r = c["accept_rate_by_position"]
        ax.plot(range(1, len(r) + 1), [np.nan if x is None else x for x in r], marker="o", label=c["name"])
    ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.05), title="Acceptance by position")
    ax.legend(fontsize=7)
    files.append(_save(fig, out / "acceptance_by_position.png"))
    cats = res["bench"]["categories"]
    fig, ax = plt.subplots(figsize=(max(7, len(cats)), 4))
    width = 0.8 / max(len(res["configs"]), 1)
    for j, c in enumerate(res["configs"]):
        ax.bar(np.arange(len(cats)) + j * width, [c["per_category"][k]["tau"] or 0 for k in cats], width,
               label=c["name"])
    ax.set_xticks(np.arange(len(cats)) + 0.4 - width / 2, cats, rotation=30, fontsize=8)
    ax.set(ylabel="tau (tokens per round)", title="tau per category")
    ax.legend(fontsize=7)
    files.append(_save(fig, out / "tau_per_category.png"))
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [c["name"] for c in res["configs"]]
    x = np.arange(len(names))
    ax.bar(x - 0.2, [c["speedup"] or 0 for c in res["configs"]], 0.4, label="measured")
    ax.bar(x + 0.2, [c["predicted_speedup"] or 0 for c in res["configs"]], 0.4, label="predicted from latencies")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x, names, rotation=20, fontsize=7, ha="right")
    ax.set(ylabel="speedup over the baseline", title="Speedup per configuration")
    ax.legend(fontsize=7)
    files.append(_save(fig, out / "speedup.png"))
    return files


def _save(fig, path: Path) -> str:
    import matplotlib.pyplot as plt  # heavy: loaded only where a plot is drawn

    tmp = path.with_name(path.stem + ".tmp.png")
    fig.tight_layout()
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return str(path)


def _markdown(res: dict) -> str:
    s, t = res["settings"], res["target"]
    lines = [f"# eyas evaluate: {res['bench']['name']}", "",
             f"Target {t['name']} ({t['dtype']}, {t['device']}, {res['threads']} threads, runner {t['runner']}"
             f"{', projections ' + t['projections'] if 'projections' in t else ''}); "
             f"draft `{res['draft']['path']}` ({res['draft'].get('precision', 'precision not recorded')}); "
             f"{res['bench']['prompts']} prompts, {res['bench']['turns']} turns; "
             f"temperature {s['temperature']}, at most {s['max_new_tokens']} new tokens; adaptive {s['adaptive']}.", "",
             "```", *summary_lines(res), "```", "",
             "tau: tokens per target verification round, bonus included. Speedup: decode tokens/s over the faster of "
             "eyas's greedy loop and transformers' generate. Predicted: sum (a+1) t(1) / sum (t(q) + draft time) from "
             "the measured latencies; efficiency = measured / predicted; overhead = share of decode time outside the "
             "target and draft forwards.", "", "## Latency of the target", "",
             "t(q): one forward over q new tokens. Where a wider forward measured faster, q tokens were verified in "
             "it (fillers in the extra rows, never committed; `--no-widen` turns this off).", "",
             f"t(q) is measured after {res.get('latency_prefix', '?')} tokens of context, before the run and again "
             "after it (the mean of the two is shown); the adaptive controller starts from the first and learns "
             "from the rounds. The last column is what the run's rounds measured (every method; a q verified in a "
             "wider forward was timed as that forward).", "",
             "| q | t(q) ms | t(q)/t(1) | verified in a forward of | the run's rounds: mean ms (rounds) |",
             "|---|---|---|---|---|"]
    t1, widths = res["latency_ms"]["1"], res.get("verify_widths", {})
    seen = res.get("latency_in_rounds_ms", {})
    for q in sorted(set(res["latency_ms"]) | set(seen), key=int):
        v, r = res["latency_ms"].get(q), seen.get(q)
        lines.append(f"| {q} | {_fmt(v, '.1f')} | {_fmt(v / t1 if v else None)} | {widths.get(q, q) if v else '-'} | "
                     + (f"{r['ms']:.1f} ({r['rounds']:,}) |" if r else "- |"))
    lines += ["", "## Per category", "", "| config | category | turns | tau | speedup |", "|---|---|---|---|---|"]
    for c in res["configs"]:
        lines += [f"| {c['name']} | {k} | {v['turns']} | {_fmt(v['tau'])} | {_fmt(v['speedup'])} |"
                  for k, v in c["per_category"].items()]
    lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in res.get("_plots", [])]
    return "\n".join(lines) + "\n"


def write(res: dict, out: Path, tokenizer=None) -> dict:
    """OUT/results.json, OUT/report.md and the PNG plots (each written atomically)."""
    out.mkdir(parents=True, exist_ok=True)
    plots = _plots(res, out)
    files = {"results": str(out / "results.json"), "report": str(out / "report.md"), "plots": plots}
    res = {**res, "files": files}
    write_json(out / "results.json", res)
    tmp = out / "report.md.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(_markdown({**res, "_plots": plots}))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(out / "report.md")
    return files
