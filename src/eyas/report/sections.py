"""The sections of `eyas report` in page order, and `render`, which puts them under the summary card.

A section function takes (RunFiles, Loaded) and returns (HTML body, ran): ran is False when the files it shows
are absent, and the body then says "not run" and what is missing. Numbers are rendered by `Doc.num` & co., which
name their source; nothing here recomputes a figure a stage already wrote (tau, speedup, coverage, bytes per
token and the plan's arithmetic are read as they are).

The summary card, the subtitle and the Pipeline section (every stage with its wall time) are here; the other sections
are in eyas.report.training (data, plan and audit, training), eyas.report.evaluation (speculative decoding, the
data-scaling curve, sample generations) and eyas.report.export.
"""

from __future__ import annotations

from eyas import __version__
from eyas.report.charts import bar_chart
from eyas.report.evaluation import BASELINES, TAU, sec_evaluation, sec_samples, sec_scaling
from eyas.report.export import sec_export
from eyas.report.page import badge, esc, figures, kpi, not_run, num, page, plural, section, table
from eyas.report.run_files import Doc, Loaded, RunFiles
from eyas.report.training import sec_data, sec_plan, sec_training


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
        parts.append(f"EAGLE-3 draft: {d.final.num('eyas_draft', 'num_layers')} {plural(layers, 'layer')}, "
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
