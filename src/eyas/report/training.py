"""The report's sections on training the draft: its data (regenerated answers, the prepared dataset, the
hidden-state store, the draft vocabulary), the plan with the sharding audit, and the training curves.

A section function takes (RunFiles, Loaded) and returns (HTML body, ran), as eyas.report.sections describes.
"""

from __future__ import annotations

from eyas.report.charts import bar_chart, line_chart, step_chart
from eyas.report.page import badge, esc, facts, figures, meter, missing, not_run, num, plural, table
from eyas.report.run_files import Doc, Loaded, RunFiles, get


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
        return "<h3>Prepared dataset</h3>" + missing("prepare", d.prepared.name)
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
        return "<h3>Hidden-state store</h3>" + missing("extract", d.manifest.name)
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
        return "<h3>Draft vocabulary</h3>" + missing("train", d.plan.name)
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
    w = lambda k, word: f"{n(k)} {plural(p.get(k), word)}"  # noqa: E731
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
    body = _plan_words(d.plan) if d.plan else "<h3>The plan</h3>" + missing("train", d.plan.name)
    body += _audit(d.audit) if d.audit else "<h3>The sharding audit</h3>" + missing("train", d.audit.name)
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
        line_chart([(f"chain of {k}", [v.get("step") for _, v in val], [v.get("expected_tau") for _, v in val])],
                   "Expected acceptance length at each validation pass", "optimizer step (global)", "expected τ",
                   markers=True) if any(v.get("expected_tau") for _, v in val) else "",
        line_chart([("learning rate", steps, [r.get("lr") for _, r in rows])], "Learning rate",
                   "optimizer step (global)", "lr"),
        line_chart([("tokens/s", steps, [r.get("tokens_per_s") for _, r in rows])], "Throughput per optimizer step",
                   "optimizer step (global)", "tokens/s (global)"))


def sec_training(f: RunFiles, d: Loaded) -> tuple[str, bool]:
    m, rows = d.metrics, d.metrics.rows()
    if not rows:
        return missing("train", d.metrics.name), False
    val = [(i, v) for i, v in d.validation.rows() if v.get("step") is not None]
    k = max(len(r.get("loss_i") or []) for _, r in rows)
    j, vj = rows[-1][0], (val[-1][0] if val else None)
    pairs = [("optimizer steps (global)", m.num(j, "step")),
             ("samples seen (global, repeats included)", m.num(j, "samples_seen_global")),
             ("final loss (weighted over TTT steps)", m.num(j, "loss", fmt=",.4f")),
             ("time in training steps", m.seconds(j, "elapsed_s"))]
    if val and val[-1][1].get("expected_tau") is not None:
        pairs.append((f"expected acceptance length (last validation, chain of {k})",
                      d.validation.num(val[-1][0], "expected_tau", fmt=",.2f")))
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
