"""The report's sections on the trained draft at work: speculative decoding (tau, speedup, losslessness per
configuration), the data-scaling curve, and sample generations with the accepted draft tokens highlighted.

A section function takes (RunFiles, Loaded) and returns (HTML body, ran), as eyas.report.sections describes.
"""

from __future__ import annotations

from eyas.report import scaling
from eyas.report.charts import bar_chart, line_chart, scaling_chart
from eyas.report.page import badge, esc, figures, missing, table
from eyas.report.run_files import Doc, Loaded, RunFiles

BASELINES = {"plain": "eyas's greedy loop", "hf_generate": "transformers generate"}  # evaluate's baseline names
TAU = '<span class="sym">τ</span>'


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


def _caution(res: Doc) -> str:
    """evaluate's caution (eyas.speculate.results.disturbed_words) when a configuration ran faster than its tau and
    the measured latencies allow: its speedups are not the machine's."""
    words = res.get("caution")
    return f"<p>{badge('caution', 'bad')} {esc(words)}</p>" if words else ""


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


def _calibration(res: Doc, d: Loaded) -> str:
    """The expected acceptance length training's last validation pass predicted for each chain (eyas.train.heldout.
    expected_acceptance_length), beside the tau evaluate measured on the rounds that drafted: how far to trust the
    estimate while training."""
    val = [v for _, v in d.validation.rows() if v.get("expected_tau_by_chain")]
    if not val:
        return ""
    by_chain = val[-1]["expected_tau_by_chain"]
    rows = []
    for c in res.get("configs") or []:
        k, measured = c.get("k"), c.get("tau_drafted", c.get("tau"))
        if c.get("drafter") != "eagle3" or c.get("mode") != "chain" or not isinstance(k, int) or not measured:
            continue
        if 1 <= k <= len(by_chain):
            est = by_chain[k - 1]
            rows.append([esc(c.get("name")), f"{est:.2f}", f"{measured:.2f}", f"{est / measured:.2f}×"])
    if not rows:
        return ""
    return ("<h3>Expected acceptance length from validation</h3>" +
            table(["configuration", f"expected {TAU} (validation)", f"measured {TAU} (drafted rounds)",
                   "expected / measured"], rows, numeric=(1, 2, 3)) +
            "<p class=\"note\">Expected: 1 + the sum over positions of the product of the validation pass's per-step "
            "accuracies up to it (the last validation pass, on held-out samples); measured: this evaluation's tokens "
            "per verification over the rounds that drafted, on its own prompts.</p>")


def evaluations(f: RunFiles, d: Loaded) -> list[tuple[str, Doc]]:
    """(stage name, results.json) of every finished evaluate stage whose results can be read, in pipeline order (a
    demo evaluates on MT-Bench and on GSM8K); the run's main results alone when no stage marker names another."""
    found = []
    for name, marker in f.stages("evaluate"):
        out = marker.get("settings", "out")
        if not isinstance(out, str) or not out:
            continue
        folder = f.resolve(out)
        res = d.results if folder == d.eval else f.json(folder / "results.json")
        if res and all(res.name != r.name for _, r in found):
            found.append((name, res))
    return found or ([("evaluate", d.results)] if d.results else [])


def sec_evaluation(f: RunFiles, d: Loaded) -> tuple[str, bool]:
    found = evaluations(f, d)
    if not found:
        return missing("evaluate", d.results.name), False
    if len(found) == 1:
        return _evaluation(found[0][1], d), True
    return "".join(f"<h3 class=\"stage\">{esc(res.get('bench', 'name') or name)} (stage <code>{esc(name)}</code>)"
                   f"</h3>" + _evaluation(res, d) for name, res in found), True


def _evaluation(res: Doc, d: Loaded) -> str:
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
    return (intro + _configs_table(res) + _caution(res) + _divergences(res) + charts + _calibration(res, d)
            + f"<h3>{TAU} per category</h3>" + per_cat
            + f"<p class=\"note\">{TAU} (acceptance length): tokens produced per target verification forward, the "
              "target's own bonus token included (EAGLE's definition). Acceptance rate at position i: among rounds "
              "whose draft reached position i with positions 1..i-1 accepted, the share accepted at i. Speedup: decode "
              "tokens/s over the faster no-speculation decoder (prefill excluded). Predicted: the speedup the measured "
              "target latencies allow with zero overhead; efficiency = measured / predicted.</p>")


def sec_scaling(f: RunFiles, d: Loaded) -> str | None:
    """Drafts trained on more or less of the same data, evaluated side by side (eyas.report.scaling); None (no
    section) when no evaluation holds two of them."""
    curves = []
    for name, res in evaluations(f, d):
        pts = scaling.points(res.data, f.resolve, lambda p: f.json(p).data)
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
        return missing("evaluate", d.results.name), False
    samples = [s for s in res.get("samples") or [] if isinstance(s, dict)][:limit]
    if samples:
        return ('<p class="legend">Highlighted: <span class="tok-d">tokens the draft proposed and the target '
                "accepted</span>; plain: tokens the target produced itself (the first token, and one per verification "
                "round).</p>" + "".join(generation(s) for s in samples)), True
    return ("<p>This evaluation did not record the generated text with its per-round accepted tokens "
            "(<code>samples</code> in results.json), so no highlighted generation can be shown. Tokens generated and "
            "decode seconds per turn and method:</p>" + _records_table(res, limit)), True
