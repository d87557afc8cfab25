"""The sections of `eyas report`: each turns some of the run's files into words, tables and figures.

A section function takes (RunFiles, Loaded) and returns (HTML body, ran): ran is False when the files it shows
are absent, and the body then says "not run" and what is missing. Numbers are rendered by `Doc.num` & co., which
name their source; nothing here recomputes a figure a stage already wrote (tau, speedup, coverage, bytes per
token and the plan's arithmetic are read as they are).
"""

from __future__ import annotations

from eyas import __version__
from eyas.report import scaling
from eyas.report.plots import (
    badge,
    bar_chart,
    esc,
    facts,
    figures,
    kpi,
    line_chart,
    meter,
    not_run,
    num,
    page,
    scaling_chart,
    section,
    step_chart,
    table,
)
from eyas.report.run_files import Doc, Loaded, RunFiles, get

BASELINES = {"plain": "eyas's greedy loop", "hf_generate": "transformers generate"}  # evaluate's baseline names
TAU = '<span class="sym">τ</span>'


def _plural(value, word: str) -> str:
    return word if value == 1 else word + "s"


def _missing(what: str, doc: Doc) -> str:
    return not_run(f"{esc(what)}: no <code>{esc(doc.name)}</code> in this run")


# -- summary card ----------------------------------------------------------------------------------------------------
def lossless(res: Doc) -> tuple[str, str, str]:
    """(verdict, tone, explanation) over every configuration's lossless check."""
    checked = [c for c in res.get("configs") or [] if (c.get("lossless") or {}).get("checked")]
    if not checked:
        return "n/a", "muted", "not checked (sampling at temperature > 0)"
    bad = [c.get("name", "?") for c in checked if not c["lossless"].get("lossless", c["lossless"].get("identical"))]
    if bad:
        return "NO", "bad", (f"{len(bad)} of {len(checked)} configurations emitted a token that is not the target's "
                             f"top-1: {esc(', '.join(bad))}")
    tied = [c.get("name", "?") for c in checked if not c["lossless"].get("identical")]
    if tied:
        return "yes", "good", (f"every emitted token is the target's top-1 (re-scored in fp32); {len(tied)} of "
                               f"{len(checked)} configurations differ from plain greedy only at near-ties: "
                               f"{esc(', '.join(tied))}")
    return "yes", "good", f"all {len(checked)} configurations reproduce greedy decoding token for token"


def headline(res: Doc) -> tuple:
    """The key path of the configuration the card shows: the fastest with the trained draft (evaluate's `best` may
    be a baseline such as prompt lookup), else evaluate's `best`."""
    drafts = [(c.get("speedup") or 0.0, j) for j, c in enumerate(res.get("configs") or [])
              if c.get("drafter") == "eagle3"]
    return ("configs", max(drafts)[1]) if drafts else ("best",)


def card(f: RunFiles, d: Loaded) -> str:
    res = d.results
    if res:
        key, base, best = headline(res), res.get("baseline", "chosen"), res.get("best", "name")
        faster = (f" · {esc(best)} was faster: {res.num('best', 'speedup', fmt=',.2f', suffix='×')}"
                  if key != ("best",) and best != res.get(*key, "name") else "")
        tau = kpi(f"acceptance length {TAU}", res.num(*key, "tau", fmt=",.2f"),
                  f"tokens per target forward · {esc(res.get(*key, 'name'))}")
        slower = (res.get(*key, "speedup") or 0) < 1  # speculation that loses to plain decoding shows red
        speed = kpi("speedup", res.num(*key, "speedup", fmt=",.2f", suffix="×"),
                    f"over {esc(BASELINES.get(base, base))} at {res.num('baseline', 'tokens_per_s', fmt=',.1f')} "
                    f"tokens/s{faster}", "bad" if slower else "")
        verdict, tone, why = lossless(res)
        ll = kpi("lossless", verdict, why, tone)
    else:
        tau, speed, ll = (kpi(k, "–", "evaluate not run", "muted") for k in (f"acceptance length {TAU}", "speedup",
                                                                             "lossless"))
    return f'<div class="card">{tau}{speed}{ll}{_training_time(f, d)}</div>'


def _training_time(f: RunFiles, d: Loaded) -> str:
    """The train stage's wall time (its marker), else the last metrics line's elapsed time."""
    rows, markers = d.metrics.rows(), f.stages("train")
    if markers and markers[0][1].get("elapsed_s") is not None:
        value = markers[0][1].seconds("elapsed_s")
    elif rows:
        value = d.metrics.seconds(rows[-1][0], "elapsed_s")
    else:
        return kpi("training time", "–", "train not run", "muted")
    sub = (f"{d.metrics.num(rows[-1][0], 'step')} optimizer steps (global) on {d.plan.num('world_size')} ranks"
           if rows else f"no {esc(d.metrics.name)}")
    return kpi("training time", value, sub)


def subtitle(d: Loaded) -> str:
    ident = d.results.get("target") or d.manifest.get("target") or d.prepared.get("target") or {}
    parts = [f"target <strong>{esc(ident.get('name', '?'))}</strong>"]
    if d.final.get("eyas_draft"):
        layers = d.final.get("eyas_draft", "num_layers")
        parts.append(f"EAGLE-3 draft: {d.final.num('eyas_draft', 'num_layers')} {_plural(layers, 'layer')}, "
                     f"{d.final.num('eyas_draft', 'draft_vocab_size')}-token vocabulary, features from layers "
                     f"{esc(d.final.get('eyas_draft', 'feature_layers'))}")
    if d.results.get("bench"):
        parts.append(f"{esc(d.results.get('bench', 'name'))}: {d.results.num('bench', 'prompts')} prompts, "
                     f"{d.results.num('bench', 'turns')} turns")
    return " · ".join(parts)


# -- pipeline --------------------------------------------------------------------------------------------------------
def sec_pipeline(f: RunFiles, d: Loaded) -> tuple[str, bool]:
    if not f.order:
        return not_run("no <code>stages/</code> and no <code>pipeline.json</code>: not a folder of eyas demo or "
                       "eyas run"), False
    rows, names, times = [], [], []
    for name in f.order:
        m = f.markers.get(name)
        index, plan = f.planned.get(name, (0, {}))
        cmd = m.get("command") if m else plan.get("command", "?")
        if m:
            names.append(name)
            times.append(m.get("elapsed_s"))
        ranks = m.num("nproc") if m else num(plan.get("nproc"), f"pipeline.json#/{index}/nproc")
        status = badge("done", "good") if m else badge("this page" if cmd == "report" else "not run", "muted")
        rows.append([f"<code>{esc(name)}</code>", f"eyas {esc(cmd)}", ranks, m.seconds("elapsed_s") if m else "–",
                     status])
    body = table(["stage", "command", "processes", "wall time", "status"], rows, numeric=(2, 3))
    if times:
        body += figures(bar_chart(names, [("wall time", times)], "Wall time per stage", "seconds", horizontal=True,
                                  annotate=",.0f"))
    return body + ('<p class="note">Wall time: from the stage\'s start to its end (a torchrun stage includes starting '
                   "its processes). A cached stage keeps the time of the run that did it.</p>"), True


# -- data ------------------------------------------------------------------------------------------------------------
def _regenerated(f: RunFiles) -> str:
    rows = []
    for name, m in f.stages("regenerate"):
        out = m.get("settings", "out")
        path = f.resolve(out) if isinstance(out, str) and out else None
        lines = num(f.line_count(path), f"{f.name(path)}#lines") if path else "–"
        s = lambda k, fmt=",.0f": m.num("summary", k, fmt=fmt)  # noqa: E731
        rows.append([f"<code>{esc(name)}</code>", lines, s("done"),
                     s("failed"), s("left_out"), s("tokens"), s("tokens_per_s", ",.1f"),
                     s("replies_cut_at_max_new_tokens"), m.seconds("summary", "elapsed_s")])
    if not rows:  # no markers: the files alone
        rows = [[f"<code>{esc(p.name)}</code>", num(f.line_count(p), f"{f.name(p)}#lines")] + ["–"] * 7
                for p in sorted((f.root / "regenerated").glob("*.jsonl"))]
    if not rows:
        return "<h3>Regenerated answers</h3>" + not_run("no regenerate stage and no <code>regenerated/*.jsonl</code>")
    return ("<h3>Regenerated answers</h3><p>The target wrote its own answers to the training prompts, so the draft "
            "learns to predict what this target says.</p>"
            + table(["stage", "conversations in file", "done this run", "failed", "left out (--max-prompt-tokens)",
                     "tokens generated", "tokens/s", "cut at max tokens", "wall time"], rows, numeric=range(1, 9)))


def _prepared(d: Loaded) -> str:
    s = d.prepared
    if not s:
        return "<h3>Prepared dataset</h3>" + _missing("prepare", d.prepared)
    reasons = s.get("dropped_by_reason") or {}
    rows = [[esc(r), s.num("dropped_by_reason", r, "count"), esc(s.get("dropped_by_reason", r, "examples", 0, "where")
                                                                  or ""),
             esc(s.get("dropped_by_reason", r, "examples", 0, "detail") or "")] for r in reasons]
    body = facts([("samples in", s.num("samples_in")), ("kept", s.num("kept")), ("dropped", s.num("dropped")),
                  ("truncated (kept)", s.num("truncated")), ("prompt-only (kept, no reply)", s.num("prompt_only")),
                  ("tokens (global)", s.num("tokens")), ("loss-masked tokens (trained on)", s.num("loss_tokens")),
                  ("longest sample allowed", s.num("max_length", suffix=" tokens"))])
    splits = ("train", "validation")
    charts = figures(
        bar_chart([f"kept · {k}" for k in splits] + [f"dropped · {r}" for r in reasons],
                  [("samples", [s.get("samples", k) for k in splits] + [v.get("count") for v in reasons.values()])],
                  "Samples kept and dropped, by reason", "samples", horizontal=True, annotate=",.0f",
                  bar_colors=["#059669", "#10b981"] + ["#e11d48"] * len(reasons)),
        bar_chart(list(splits), [("all tokens", [s.get("tokens_by_split", k) for k in splits]),
                                 ("loss-masked (trained on)", [s.get("loss_tokens_by_split", k) for k in splits])],
                  "Tokens per split", "tokens", annotate=",.0f"))
    drops = table(["dropped because", "samples", "first at", "detail"], rows, numeric=(1,)) if rows else \
        '<p class="note">No sample was dropped.</p>'
    return "<h3>Prepared dataset</h3>" + body + charts + drops


def _store(f: RunFiles, d: Loaded) -> str:
    m = d.manifest
    if not m:
        return "<h3>Hidden-state store</h3>" + _missing("extract", d.manifest)
    pairs = [("samples", m.num("totals", "samples")), ("tokens", m.num("totals", "tokens")),
             ("size on disk", m.bytes("totals", "bytes")),
             ("bytes per token", m.num("totals", "bytes_per_token", fmt=",.1f")), ("shards", m.num("totals", "shards")),
             ("feature dtype", esc(m.get("dtype") or "?") + (" (compact)" if m.get("compact") else "")),
             ("feature layers", esc(m.get("layer_ids"))), ("hidden size", m.num("hidden_size"))]
    for _, mk in f.stages("extract")[:1]:
        pairs += [("extraction speed (global)", mk.num("summary", "tokens_per_s", suffix=" tokens/s")),
                  ("extraction ranks", mk.num("summary", "world_size"))]
    return ("<h3>Hidden-state store</h3><p>For every token, the target's three feature layers and its final hidden "
            "state: written once, read by every training epoch.</p>" + facts(pairs))


def _vocab(d: Loaded) -> str:
    p = d.plan
    if not p.get("vocab"):
        return "<h3>Draft vocabulary</h3>" + _missing("train", d.plan)
    return ("<h3>Draft vocabulary</h3>"
            f"<p>The draft predicts only the {p.num('vocab', 'size')} target tokens most frequent among the "
            f"loss-masked training tokens ({p.num('vocab', 'distinct_seen')} distinct ids were seen there). A token "
            "outside it can never be drafted.</p>"
            + meter(p.get("vocab", "coverage"), p.src("vocab", "coverage"),
                    "of the loss-masked training tokens are in the draft vocabulary"))


def sec_data(f: RunFiles, d: Loaded) -> tuple[str, bool]:
    ran = bool(d.prepared or d.manifest or f.stages("regenerate") or d.plan.get("vocab"))
    return _regenerated(f) + _prepared(d) + _store(f, d) + _vocab(d), ran


# -- plan and sharding audit -----------------------------------------------------------------------------------------
def _plan_words(p: Doc) -> str:
    n = p.num
    w = lambda k, word: f"{n(k)} {_plural(p.get(k), word)}"  # noqa: E731
    packed = (f" Samples were packed into sequences of at most {n('max_tokens')} tokens; the plan counts these "
              f"sequences ({n('units_per_epoch', 0)} in epoch 1) as its samples." if p.get("max_tokens") else "")
    if p.get("drop_remainder"):
        rest = f"{w('dropped_samples', 'sample')} per epoch (global) left out to fill whole global batches"
    elif p.get("padded_samples"):
        rest = f"{w('padded_samples', 'repeat')} (global) added so that every rank has the same count"
    else:
        rest = "the samples divide evenly among the ranks"
    tokens = f" ({n('tokens')} tokens, global)" if p.get("tokens") else ""
    text = [f"The draft trained for {w('epochs', 'epoch')} on {w('samples', 'sample')}{tokens}, spread over "
            f"{w('world_size', 'rank')}." + packed
            + f" Each rank takes micro-batches of {w('micro_batch', 'sample')}, and one optimizer step takes "
            f"{w('grad_accum', 'micro-batch')} per rank: every optimizer step covers a global batch of "
            f"{w('global_batch', 'sample')}.",
            f"Each rank trains on {w('samples_per_rank_per_epoch', 'sample')} per epoch ({rest}), in "
            f"{n('micro_batches_per_rank_per_epoch')} micro-batches. All ranks take each optimizer step together: "
            f"{n('optimizer_steps_per_epoch')} per epoch, {n('optimizer_steps_run')} in this run. Had the data not "
            f"been sharded, every rank would have read all {w('samples', 'sample')}: "
            f"{n('unsharded_micro_batches_per_rank_per_epoch')} micro-batches per rank per epoch and "
            f"{n('unsharded_optimizer_steps_total')} optimizer steps in all."]
    if p.get("steps_per_s"):
        text.append(f"Measured after the first steps: {n('steps_per_s', fmt=',.2f')} optimizer steps per second per "
                    f"rank (all ranks step together), so the planned steps take {p.seconds('eta_s')}, against "
                    f"{p.seconds('eta_unsharded_s')} if not sharded. Each rank ran {w('threads_per_rank', 'thread')}, "
                    f"{esc(p.get('dtype') or '?')}, {esc(p.get('parallel') or '?')}.")
    lines = "\n".join(str(x) for x in p.get("lines") or [])
    return ("<h3>The plan</h3>" + "".join(f"<p>{t}</p>" for t in text)
            + (f"<details><summary>the plan block as the trainer printed it</summary><pre><code>{esc(lines)}"
               "</code></pre></details>" if lines else ""))


def _audit_epochs(a: Doc) -> list[tuple[tuple, dict]]:
    """(key path, audit) per epoch: audit.json's "epochs" (by epoch number), else its top level."""
    epochs = a.get("epochs")
    if isinstance(epochs, dict) and epochs:
        return [(("epochs", k), epochs[k]) for k in sorted(epochs, key=lambda k: int(k) if k.isdigit() else 0)]
    return [((), a.data)]


def _audit_words(a: Doc, epochs: list[tuple[tuple, dict]]) -> list[str]:
    """One sentence for the epochs that passed, one per epoch that did not."""
    words, good = [], []
    for key, e in epochs:
        if e.get("ok"):
            good.append(int(e.get("epoch", 0)) + 1)
            continue
        bad = []
        if not e.get("disjoint", True):
            bad.append(f"<strong>{a.num(*key, 'duplicates')} samples were on more than one rank</strong> (for example "
                       f"{esc(', '.join(map(str, e.get('duplicate_examples') or [])))})")
        if e.get("missing"):
            bad.append(f"<strong>{a.num(*key, 'missing')} samples were on no rank</strong>")
        if e.get("dropped") != e.get("expected_dropped"):
            bad.append("the samples left out were not those the plan drops")
        words.append(f"{badge('audit failed', 'bad')} Epoch {int(e.get('epoch', 0)) + 1}: {'; '.join(bad)}."
                     + (" The run trained anyway (--allow-duplicate-data)." if e.get("allowed") else ""))
    if good:
        which = f"epoch {good[0]}" if len(good) == 1 else f"each of the epochs {', '.join(map(str, good))}"
        words.insert(0, f"{badge('audit passed', 'good')} Before {which}, the ranks' actual sample ids (the lists "
                        "their data loaders iterate) were gathered and checked: no sample was given to two ranks, and "
                        "every sample was given to one.")
    return words


def _per_rank(a: Doc, key: tuple, counts: list) -> str:
    """Each rank's count; beyond 8 ranks, the smallest and the largest (with their ranks)."""
    if len(counts) <= 8:
        return " · ".join(f"rank {r}: {a.num(*key, 'per_rank', r)}" for r in range(len(counts)))
    lo, hi = counts.index(min(counts)), counts.index(max(counts))
    return (f"{a.num(*key, 'per_rank', lo)} (rank {lo}) to {a.num(*key, 'per_rank', hi)} (rank {hi}), "
            f"{len(counts):,} ranks")


def _audit(a: Doc) -> str:
    epochs, rows = _audit_epochs(a), []
    for key, e in epochs:
        per = _per_rank(a, key, e.get("per_rank") or [])
        rows.append([f"{int(e.get('epoch', 0)) + 1:,}", a.num(*key, "samples"), per, a.num(*key, "padded"),
                     a.num(*key, "dropped"), a.num(*key, "duplicates"), a.num(*key, "missing"),
                     badge("disjoint, complete", "good") if e.get("ok") else badge("FAILED", "bad")])
    line = a.get("line")
    return ("<h3>The sharding audit</h3>" + "".join(f"<p>{w}</p>" for w in _audit_words(a, epochs))
            + table(["epoch", "samples (global)", "samples per rank (repeats included)", "padding repeats (global)",
                     "dropped (global)", "on two ranks", "on no rank", "verdict"], rows, numeric=(0, 1, 3, 4, 5, 6))
            + (f"<details><summary>the audit line as the trainer printed it</summary><pre><code>{esc(line)}</code>"
               "</pre></details>" if line else ""))


def sec_plan(f: RunFiles, d: Loaded) -> tuple[str, bool]:
    body = _plan_words(d.plan) if d.plan else "<h3>The plan</h3>" + _missing("train", d.plan)
    body += _audit(d.audit) if d.audit else "<h3>The sharding audit</h3>" + _missing("train", d.audit)
    return body, bool(d.plan or d.audit)


# -- training --------------------------------------------------------------------------------------------------------
def _training_charts(rows: list[tuple[int, dict]], val: list[tuple[int, dict]], k: int) -> str:
    steps = [r.get("step") for _, r in rows]
    per = lambda key, src: [[get(r, key, i) for _, r in src] for i in range(k)]  # [k][lines]  # noqa: E731
    vx = [v.get("step") for _, v in val]
    return figures(
        step_chart(steps, per("loss_i", rows), "Loss per TTT step", "cross-entropy",
                   val=(vx, per("loss_i", val)) if val else None),
        step_chart(steps, per("acc_i", rows), "Top-1 agreement with the target per TTT step", "acc_i",
                   ylim=(0, 1.02), val=(vx, per("acc_i", val)) if val else None),
        line_chart([("learning rate", steps, [r.get("lr") for _, r in rows])], "Learning rate",
                   "optimizer step (global)", "lr"),
        line_chart([("tokens/s", steps, [r.get("tokens_per_s") for _, r in rows])], "Throughput per optimizer step",
                   "optimizer step (global)", "tokens/s (global)"))


def sec_training(f: RunFiles, d: Loaded) -> tuple[str, bool]:
    m, rows = d.metrics, d.metrics.rows()
    if not rows:
        return _missing("train", d.metrics), False
    val = [(i, v) for i, v in d.validation.rows() if v.get("step") is not None]
    k = max(len(r.get("loss_i") or []) for _, r in rows)
    j, vj = rows[-1][0], (val[-1][0] if val else None)
    pairs = [("optimizer steps (global)", m.num(j, "step")),
             ("samples seen (global, repeats included)", m.num(j, "samples_seen_global")),
             ("final loss (weighted over TTT steps)", m.num(j, "loss", fmt=",.4f")),
             ("time in training steps", m.seconds(j, "elapsed_s"))]
    for _, mk in f.stages("train")[:1]:
        pairs += [("throughput (global, whole run)", mk.num("summary", "tokens_per_s", suffix=" tokens/s")),
                  ("waiting for data", mk.pct("summary", "data_wait_share"))]
    v = d.validation
    table_rows = [[f"step {i}", m.num(j, "loss_i", i, fmt=",.4f"), m.pct(j, "acc_i", i),
                   v.num(vj, "loss_i", i, fmt=",.4f") if val else "–", v.pct(vj, "acc_i", i) if val else "–"]
                  for i in range(k)]
    warn = (f"<p>{badge('duplicate data', 'bad')} these steps ran with a failed sharding audit "
            "(--allow-duplicate-data).</p>" if any(r.get("duplicate_data") for _, r in rows) else "")
    after = f" and the last validation pass (after epoch {int(val[-1][1].get('epoch', 0)) + 1})" if val else ""
    return (warn + facts(pairs) + _training_charts(rows, val, k)
            + "<p>TTT step i is the draft guessing the token i+1 places ahead from its own earlier guesses (step 0 is "
              "the first draft token); acc_i, its top-1 agreement with the target, estimates the acceptance rate at "
              f"that position. The last optimizer step{after}:</p>"
            + table(["TTT step", "loss (train)", "acc (train)", "loss (validation)", "acc (validation)"], table_rows,
                    numeric=(1, 2, 3, 4))), True


# -- speculative decoding --------------------------------------------------------------------------------------------
def _configs_table(res: Doc) -> str:
    base, rows = res.get("baseline") or {}, []
    for key, label in (("eyas_greedy", "plain"), ("hf_generate", "hf_generate")):
        if key in base:
            rows.append([f"no speculation: {esc(BASELINES[label])}", "–",
                         res.num("baseline", key, "tokens_per_s", fmt=",.1f"),
                         "1× (the baseline)" if base.get("chosen") == label else "–", "–", "–", "–"])
    for j, c in enumerate(res.get("configs") or []):
        ll = c.get("lossless") or {}
        verdict = badge("n/a", "muted") if not ll.get("checked") else badge("yes", "good") if ll.get("identical") \
            else badge("NO", "bad")
        tag = "" if c.get("drafter") == "eagle3" else " " + badge("baseline", "muted")
        rows.append([f"<strong>{esc(c.get('name'))}</strong>{tag}", res.num("configs", j, "tau", fmt=",.2f"),
                     res.num("configs", j, "tokens_per_s", fmt=",.1f"),
                     res.num("configs", j, "speedup", fmt=",.2f", suffix="×"),
                     res.num("configs", j, "predicted_speedup", fmt=",.2f", suffix="×"),
                     res.pct("configs", j, "efficiency", digits=0), verdict])
    return table(["configuration", TAU, "tokens/s", "speedup", "predicted", "efficiency", "lossless"], rows,
                 numeric=(1, 2, 3, 4, 5))


def _divergences(res: Doc) -> str:
    out = []
    for c in res.get("configs") or []:
        dv = (c.get("lossless") or {}).get("first_divergence")
        if dv:
            out.append(f"<p>{badge('not lossless', 'bad')} <strong>{esc(c.get('name'))}</strong> first differs from "
                       f"greedy decoding at prompt {esc(dv.get('id'))}, turn {esc(dv.get('turn'))}, token "
                       f"{esc(dv.get('index'))}: expected {esc(repr(dv.get('expected_text')))}, got "
                       f"{esc(repr(dv.get('got_text')))} (the target's top-2 logit margin there: "
                       f"{esc(dv.get('target_margin'))}).</p>")
    return "".join(out)


def sec_evaluation(f: RunFiles, d: Loaded) -> tuple[str, bool]:
    res = d.results
    if not res:
        return _missing("evaluate", d.results), False
    configs, cats = res.get("configs") or [], res.get("bench", "categories") or []
    names = [c.get("name", "?") for c in configs]
    intro = (f"<p class=\"lead\">{res.num('bench', 'prompts')} prompts of {esc(res.get('bench', 'name'))} "
             f"({res.num('bench', 'turns')} turns), at most {res.num('settings', 'max_new_tokens')} new tokens per "
             f"turn, temperature {res.num('settings', 'temperature', fmt=',.1f')}; target in "
             f"{esc(res.get('target', 'dtype'))} on {esc(res.get('target', 'device'))} with {res.num('threads')} "
             f"threads; draft {esc(res.get('draft', 'precision') or 'precision not recorded')}. Every method ran "
             "on the same prompts in the same run, alternating prompt by prompt.</p>")
    rates = [(n, list(range(1, len(c.get("accept_rate_by_position") or []) + 1)), c.get("accept_rate_by_position"))
             for n, c in zip(names, configs)]
    charts = figures(
        line_chart(rates, "Acceptance rate by draft position", "draft position", "acceptance rate", ylim=(0, 1.05),
                   markers=True),
        bar_chart(names, [("measured", [c.get("speedup") for c in configs]),
                          ("predicted from latencies", [c.get("predicted_speedup") for c in configs])],
                  "Speedup per drafting configuration", "speedup (×)", hline=(1.0, "no speculation"), annotate=".2f"),
        bar_chart(cats, [(n, [(c.get("per_category") or {}).get(k, {}).get("tau") for k in cats])
                         for n, c in zip(names, configs)], "Acceptance length τ per MT-Bench category", "τ")
        if cats else "",
        bar_chart(names, [("τ", [c.get("tau") for c in configs])], "Acceptance length τ per configuration", "τ",
                  annotate=".2f"))
    per_cat = table(["category"] + [f"{TAU} · {esc(n)}" for n in names],
                    [[esc(k)] + [res.num("configs", j, "per_category", k, "tau", fmt=",.2f") for j in range(len(names))]
                     for k in cats], numeric=range(1, len(names) + 1))
    return (intro + _configs_table(res) + _divergences(res) + charts + f"<h3>{TAU} per category</h3>" + per_cat
            + f"<p class=\"note\">{TAU} (acceptance length): tokens produced per target verification forward, the "
              "target's own bonus token included (EAGLE's definition). Acceptance rate at position i: among rounds "
              "whose draft reached position i with positions 1..i-1 accepted, the share accepted at i. Speedup: decode "
              "tokens/s over the faster no-speculation decoder (prefill excluded). Predicted: the speedup the measured "
              "target latencies allow with zero overhead; efficiency = measured / predicted.</p>"), True


def sec_scaling(f: RunFiles, d: Loaded) -> str | None:
    """Drafts trained on more or less of the same data, evaluated side by side (eyas.report.scaling); None (no
    section) when no evaluation holds two of them."""
    curves = []
    for name, marker in f.stages("evaluate"):
        out = marker.get("settings", "out")
        res = f.json(f.resolve(out) / "results.json") if isinstance(out, str) else None
        pts = scaling.points(res.data, f.resolve, lambda p: f.json(p).data) if res else []
        if len({p.tokens for p in pts}) >= 2:  # drafts of one amount of data (ablations) make no curve
            curves.append((name, res, pts, scaling.trend(pts)))
    if not curves:
        return None
    chart = scaling_chart([(f"{n} ({r.get('bench', 'name')})", [p.tokens for p in pts], [p.tau for p in pts],
                            (t.a, t.b) if t else None) for n, r, pts, t in curves],
                          "Acceptance length τ against training tokens", "training tokens (log scale)", "τ")
    rows = []
    for name, res, pts, t in curves:
        for p in pts:
            plan = f.json(p.plan)
            rows.append([esc(name), esc(p.label), plan.num("tokens"), plan.num("epochs"),
                         res.num("configs", p.config, "tau", fmt=",.3f"), f"{t.tau_at(p.tokens):.3f}" if t else "–"])
        if t:
            reach = [(goal, t.tokens_for(goal)) for goal in (2.0, 2.5, 3.0)]
            words = "; ".join(f"{TAU} {goal:.1f} at {n:,.0f} tokens ({n / pts[-1].tokens:,.1f}× the largest)" if n
                              else f"{TAU} {goal:.1f}: never (the line does not rise)" for goal, n in reach)
            rows.append([esc(name), "<em>trend</em>", "–", "–", f"{t.per_doubling:+.3f} per doubling", words])
    return (figures(chart) + table(["evaluation", "draft", "training tokens", "epochs", TAU, "trend · extrapolated"],
                                   rows, numeric=(2, 3, 4))
            + f"<p class=\"note\">Each point: a draft of that evaluation at the same chain length, trained on the "
              f"tokens its run's plan.json counts (each once). Trend: the least-squares line {TAU} = a + b ln(tokens) "
              "through the points; extrapolating assumes the line goes on, which nothing guarantees past them.</p>")


# -- sample generations ----------------------------------------------------------------------------------------------
def generation(sample: dict) -> str:
    """Token pieces with the draft's accepted tokens highlighted. pieces[0] comes from the prompt's forward; then
    round r emits accepted[r] draft tokens followed by one token of the target's own."""
    pieces, accepted = [str(p) for p in sample.get("pieces") or []], [int(a) for a in sample.get("accepted") or []]
    drafted, pos = set(), 1
    for a in accepted:
        drafted.update(range(pos, min(pos + a, len(pieces))))
        pos += a + 1
    text = "".join(f'<span class="tok-d">{esc(p)}</span>' if i in drafted else esc(p) for i, p in enumerate(pieces))
    meta = (f"prompt {esc(sample.get('id'))} · {esc(sample.get('category', ''))} · turn {esc(sample.get('turn'))} · "
            f"{esc(sample.get('method'))} · {len(pieces):,} tokens in {len(accepted):,} verification rounds, "
            f"{len(drafted):,} of them drafted and accepted")
    prompt = f'<div class="prompt">{esc(sample["prompt"])}</div>' if sample.get("prompt") else ""
    return f'<div class="gen"><div class="meta">{meta}</div>{prompt}<div class="text">{text}</div></div>'


def _records_table(res: Doc, limit: int) -> str:
    """What evaluate keeps per turn and method without the text: tokens generated and decode seconds."""
    recs = res.get("records") or []
    methods = list(dict.fromkeys(r.get("method") for r in recs))
    turns = list(dict.fromkeys((r.get("id"), r.get("turn")) for r in recs))[:max(limit, 1) * 2]
    index = {(r.get("id"), r.get("turn"), r.get("method")): j for j, r in enumerate(recs)}
    rows = []
    for key in turns:
        js = [index.get((*key, m)) for m in methods]
        category = next((recs[j].get("category", "") for j in js if j is not None), "")
        rows.append([esc(key[0]), esc(category), esc(key[1])]
                    + ["–" if j is None else f"{res.num('records', j, 'tokens')} in "
                       f"{res.num('records', j, 'decode_s', fmt=',.2f', suffix=' s')}" for j in js])
    return table(["prompt", "category", "turn"] + [esc(m) for m in methods], rows)


def sec_samples(f: RunFiles, d: Loaded, limit: int) -> tuple[str, bool]:
    res = d.results
    if not res:
        return _missing("evaluate", d.results), False
    samples = [s for s in res.get("samples") or [] if isinstance(s, dict)][:limit]
    if samples:
        return ('<p class="legend">Highlighted: <span class="tok-d">tokens the draft proposed and the target '
                "accepted</span>; plain: tokens the target produced itself (the first token, and one per verification "
                "round).</p>" + "".join(generation(s) for s in samples)), True
    return ("<p>This evaluation did not record the generated text with its per-round accepted tokens "
            "(<code>samples</code> in results.json), so no highlighted generation can be shown. Tokens generated and "
            "decode seconds per turn and method:</p>" + _records_table(res, limit)), True


# -- export ----------------------------------------------------------------------------------------------------------
def _serve(exports: list[tuple[str, Doc]]) -> str:
    """The commands that serve the exported folders (see eyas.draft.export), with this run's paths."""
    lines = []
    for _, m in exports:
        fmt, out = m.get("summary", "format"), m.get("summary", "out")
        if fmt == "eagle3" and m.get("summary", "fc_norm"):
            lines += ["# vLLM, given the target model (TARGET); SGLang was not checked for fc_norm drafts",
                      f"vllm serve TARGET --speculative-config '{{\"method\": \"eagle3\", \"model\": \"{out}\"}}'"]
        elif fmt == "eagle3":
            lines += ["# SGLang or vLLM, given the target model (TARGET)",
                      f"python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 "
                      f"--speculative-draft-model-path {out}",
                      f"vllm serve TARGET --speculative-config '{{\"method\": \"eagle3\", \"model\": \"{out}\"}}'"]
        elif fmt == "speculators":
            lines += ["# vLLM reads the target (the verifier) and the speculative settings from the folder",
                      f"vllm serve {out}"]
    return f"<h3>Serving the draft</h3><pre><code>{esc(chr(10).join(lines))}</code></pre>" if lines else ""


def sec_export(f: RunFiles, d: Loaded) -> tuple[str, bool]:
    exports = f.stages("export")
    if not exports:
        return not_run("no export stage finished in this run"), False
    rows = [[f"<strong>{esc(m.get('summary', 'format'))}</strong>",
             f'<code class="path">{esc(f.name(f.resolve(str(m.get("summary", "out")))))}</code>',
             m.num("summary", "tensors"), m.bytes("summary", "bytes"), esc(m.get("summary", "dtype")),
             esc(m.get("summary", "vllm_layer_ids")), esc(m.get("summary", "sglang_layer_ids"))] for _, m in exports]
    return (table(["format", "folder", "tensors", "weights", "dtype", "layer ids (vLLM)", "layer ids (SGLang)"], rows,
                  numeric=(2, 3)) + _serve(exports)), True


# -- the page --------------------------------------------------------------------------------------------------------
SECTIONS = (("pipeline", "Pipeline", sec_pipeline), ("data", "Data", sec_data),
            ("plan", "Plan and sharding audit", sec_plan), ("training", "Training", sec_training),
            ("evaluation", "Speculative decoding", sec_evaluation), ("scaling", "Data-scaling curve", sec_scaling),
            ("samples", "Sample generations", None),
            ("export", "Export", sec_export))


def render(f: RunFiles, d: Loaded, samples: int = 3) -> tuple[str, list[tuple[str, str, bool]]]:
    """(the page, [(section id, title, ran)]), the summary card first."""

    parts, html = [("summary", "Summary", True)], []
    for sid, title, make in SECTIONS:
        made = make(f, d) if make else sec_samples(f, d, samples)
        if made is None:  # an optional section with nothing to show
            continue
        body, ran = made if isinstance(made, tuple) else (made, True)
        parts.append((sid, title, ran))
        html.append(section(sid, title, body, "ok" if ran else "not run"))
    if f.problems:
        html.append(section("problems", "Files that could not be read",
                            "<ul>" + "".join(f"<li>{esc(p)}</li>" for p in f.problems) + "</ul>"))
    root = f.root.resolve()
    doc = page(root.name, subtitle(d), card(f, d), parts[1:], html,
               f"Written by eyas {esc(__version__)} from the files of <code>{esc(root)}</code>. Every number on this "
               "page is read from one of them; its <code>data-src</code> attribute names the file and the field.")
    return doc, parts
