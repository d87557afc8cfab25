"""The visual layer of `eyas report`: figures as inline SVG, and the HTML pieces the page is built from.

Figures are matplotlib's SVG output with the text kept as text (`svg.fonttype = none`, so the page's font draws
it), element ids prefixed per figure (several SVGs share one document), no XML prolog and no fixed size (they
scale with the page). Nothing here reads a file or computes a figure: the caller hands over the numbers exactly
as the run's files hold them (a curve longer than SMOOTH_ABOVE points is drawn faint under its moving average, a
display aid; tables show the logged values).

Every number on the page goes through `num`, which writes where it comes from as `data-src="FILE#/json/pointer"`
(FILE relative to the run folder; for a .jsonl file the first pointer part is the line's index among its
non-empty lines; `FILE#lines` counts those lines), so a test can check each displayed figure against its source.
"""

from __future__ import annotations

import html
import io
import itertools
import math
import re
from typing import Sequence

import numpy as np

MAX_POINTS = 1500  # per line of a plot
SMOOTH_ABOVE = 60  # longer curves get a moving average over the faint raw values
PALETTE = ("#2563eb", "#e11d48", "#059669", "#d97706", "#7c3aed", "#0891b2", "#65a30d", "#db2777", "#475569")
_ids = itertools.count()


# -- figures -------------------------------------------------------------------------------------------------------
def _style():
    import matplotlib  # heavy: loaded only where a plot is drawn

    matplotlib.use("Agg")
    return {"svg.fonttype": "none", "svg.hashsalt": "eyas", "font.family": "sans-serif", "font.size": 10.5,
            "axes.spines.top": False, "axes.spines.right": False, "axes.edgecolor": "#94a3b8",
            "axes.labelcolor": "#334155", "axes.titlesize": 12, "axes.titleweight": "bold",
            "axes.titlecolor": "#0f172a", "axes.grid": True, "grid.color": "#e2e8f0", "grid.linewidth": 0.7,
            "xtick.color": "#475569", "ytick.color": "#475569", "legend.frameon": False, "legend.fontsize": 9,
            "axes.prop_cycle": matplotlib.cycler(color=PALETTE)}


def to_svg(fig, label: str) -> str:
    """A matplotlib figure as an inline <svg> element (closed afterwards)."""
    import matplotlib.pyplot as plt  # heavy: loaded only where a plot is drawn

    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    plt.close(fig)
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)
    prefix = f"f{next(_ids)}-"  # ids are unique per figure only: make them unique in the page
    svg = re.sub(r'id="([^"]+)"', lambda m: f'id="{prefix}{m.group(1)}"', svg)
    svg = re.sub(r"url\(#([^)]+)\)", lambda m: f"url(#{prefix}{m.group(1)})", svg)
    svg = re.sub(r'href="#([^"]+)"', lambda m: f'href="#{prefix}{m.group(1)}"', svg)
    svg = re.sub(r'<svg([^>]*?) width="[^"]*" height="[^"]*"',
                 lambda m: f'<svg{m.group(1)} class="plot" role="img" aria-label="{esc(label)}"', svg, count=1)
    return svg


def _figure(width: float = 5.6, height: float = 3.0):
    import matplotlib.pyplot as plt  # heavy: loaded only where a plot is drawn

    # constrained layout at a fixed size: every figure has the same width, so the same font size on the page
    return plt.subplots(figsize=(width, height), layout="constrained")


def _finish(ax, title: str, xlabel: str, ylabel: str, legend: bool, integer_x: bool = False):
    from matplotlib.ticker import FuncFormatter, MaxNLocator  # heavy: loaded only where a plot is drawn

    if integer_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for axis in (ax.xaxis, ax.yaxis):  # thousands separators on linear axes with large values
        lo, hi = axis.get_view_interval()
        if axis.get_scale() == "linear" and max(abs(lo), abs(hi)) >= 10_000:
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    # the title starts at the figure's left edge (not the axes'), so long tick labels never push it off the figure
    ax.figure.suptitle(title, x=0.01, ha="left", fontsize=12, fontweight="bold", color="#0f172a")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if legend:  # below the axes, never over the data, in as many columns as fit the figure's width
        handles, labels = ax.get_legend_handles_labels()
        ncols = legend_columns(labels, ax.figure.get_figwidth())
        ax.figure.legend(handles, labels, loc="outside lower center", ncols=ncols)


def legend_columns(labels: Sequence[str], width_in: float, fontsize: float = 9.0, most: int = 4) -> int:
    """The most columns (up to `most`) whose legend fits `width_in` inches: each entry is its handle and gaps
    (~0.75 in) plus its text (~0.55 em a character); a column is as wide as its widest entry. Long labels get fewer
    columns instead of being cut at the figure's edge."""
    entry = [0.75 + 0.55 * fontsize / 72 * len(label) for label in labels]
    for n in range(min(most, len(labels)), 1, -1):
        if sum(max(entry[c::n]) for c in range(n)) <= width_in - 0.2:
            return n
    return 1


def thin(xs: Sequence, ys: Sequence, most: int = MAX_POINTS) -> tuple[list, list]:
    """Every k-th point (and the last) of a long series: what a 500-pixel-wide plot can show, in a small SVG."""
    k = max(1, -(-len(xs) // most))
    keep = list(range(0, len(xs), k)) + ([len(xs) - 1] if (len(xs) - 1) % k else [])
    return [xs[i] for i in keep], [ys[i] for i in keep]


def _nan(ys: Sequence[float | None]) -> list[float]:
    return [math.nan if y is None else y for y in ys]  # a gap in the line


def smooth(ys: Sequence[float], window: int) -> list[float]:
    """Centred moving average over `window` points (NaNs skipped): the trend of a noisy per-step curve."""

    a = np.asarray(ys, dtype=float)
    ok = ~np.isnan(a)
    k = np.ones(window)
    total, count = np.convolve(np.where(ok, a, 0.0), k, "same"), np.convolve(ok.astype(float), k, "same")
    return np.where(count > 0, total / np.maximum(count, 1), np.nan).tolist()


def _trace(ax, xs, ys, color: str, label: str, lw: float = 1.6):
    """A line; over SMOOTH_ABOVE points, the raw values faint and their moving average on top."""
    ys = _nan(ys)
    if len(xs) > SMOOTH_ABOVE:
        ax.plot(*thin(xs, ys), color=color, lw=0.8, alpha=0.28)
        ax.plot(*thin(xs, smooth(ys, max(5, len(xs) // 25))), color=color, lw=lw, label=label)
    else:
        ax.plot(xs, ys, color=color, lw=lw, label=label, marker="o" if len(xs) <= 12 else None, ms=3.5)


def line_chart(series: Sequence[tuple[str, Sequence[float], Sequence[float | None]]], title: str, xlabel: str,
               ylabel: str, ylim: tuple | None = None, markers: bool = False) -> str:
    """Lines (label, xs, ys); `None` values leave gaps; a legend when there is more than one."""
    import matplotlib.pyplot as plt  # heavy: loaded only where a plot is drawn

    with plt.rc_context(_style()):
        fig, ax = _figure()
        for j, (label, xs, ys) in enumerate(series):
            if markers:
                ax.plot(xs, _nan(ys), label=label, color=PALETTE[j % len(PALETTE)], lw=1.6, marker="o", ms=3.5)
            else:
                _trace(ax, xs, ys, PALETTE[j % len(PALETTE)], label)
        if ylim:
            ax.set_ylim(*ylim)
        _finish(ax, title, xlabel, ylabel, len(series) > 1, integer_x=True)
        return to_svg(fig, title)


def scaling_chart(series: Sequence[tuple[str, Sequence[float], Sequence[float], tuple[float, float] | None]],
                  title: str, xlabel: str, ylabel: str) -> str:
    """Points (label, xs, ys, trend) on a log x axis; trend (a, b): the dashed line y = a + b ln(x) over the points'
    span and a factor of 4 beyond it."""
    import matplotlib.pyplot as plt  # heavy: loaded only where a plot is drawn
    from matplotlib.ticker import FuncFormatter  # heavy: loaded only where a plot is drawn

    with plt.rc_context(_style()):
        fig, ax = _figure()
        for j, (label, xs, ys, line) in enumerate(series):
            color = PALETTE[j % len(PALETTE)]
            ax.plot(xs, ys, color=color, lw=0, marker="o", ms=5, label=label)
            if line and xs:
                grid = np.geomspace(min(xs), 4 * max(xs), 50)
                ax.plot(grid, line[0] + line[1] * np.log(grid), color=color, lw=1.2, ls="--")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        _finish(ax, title, xlabel, ylabel, len(series) > 1)
        return to_svg(fig, title)


def ramp(n: int) -> list[str]:
    """n colours from deep purple to green (viridis): TTT step 0 darkest (a sequence, not categories)."""
    import matplotlib  # heavy: loaded only where a plot is drawn

    cmap = matplotlib.colormaps["viridis"]
    return [matplotlib.colors.to_hex(cmap(0.05 + 0.75 * i / max(n - 1, 1))) for i in range(n)]


def step_chart(xs: Sequence[float], per_step: Sequence[Sequence[float]], title: str, ylabel: str,
               ylim: tuple | None = None, val: tuple[Sequence[float], Sequence[Sequence[float]]] | None = None) -> str:
    """One line per TTT step i (per_step[i] over xs), coloured as a sequence; `val`: (xs, per-step values) drawn
    as diamonds."""
    import matplotlib.pyplot as plt  # heavy: loaded only where a plot is drawn

    colors = ramp(len(per_step))
    with plt.rc_context(_style()):
        fig, ax = _figure()
        for i, ys in enumerate(per_step):
            _trace(ax, xs, ys, colors[i], f"step {i}", lw=1.5)
            if val:
                ax.plot(val[0], _nan(val[1][i]), ls="none", marker="D", ms=5, color=colors[i], markeredgecolor="white")
        if ylim:
            ax.set_ylim(*ylim)
        if val:
            ax.plot([], [], ls="none", marker="D", color="#475569", label="validation")
        _finish(ax, title, "optimizer step (global)", ylabel, True, integer_x=True)
        return to_svg(fig, title)


def bar_chart(labels: Sequence[str], groups: Sequence[tuple[str, Sequence[float | None]]], title: str, ylabel: str,
              hline: tuple[float, str] | None = None, horizontal: bool = False, annotate: str = "",
              bar_colors: Sequence[str] | None = None) -> str:
    """Grouped bars: one group per label, one bar per (name, values) series; `annotate` formats bar values;
    `bar_colors`: one colour per label (a single series only)."""
    import matplotlib.pyplot as plt  # heavy: loaded only where a plot is drawn

    n = max(len(groups), 1)
    height = max(1.6, 0.38 * len(labels) * n + 0.9) if horizontal else 3.0
    with plt.rc_context(_style()):
        fig, ax = _figure(5.6, height)
        x = np.arange(len(labels))
        width = 0.8 / n
        for j, (name, values) in enumerate(groups):
            vals = [0.0 if v is None else float(v) for v in values]
            pos = x + (j - (n - 1) / 2) * width
            color = list(bar_colors) if bar_colors and n == 1 else PALETTE[j % len(PALETTE)]
            bars = (ax.barh(pos, vals, width * 0.92, label=name, color=color) if horizontal
                    else ax.bar(pos, vals, width * 0.92, label=name, color=color))
            if annotate:
                ax.bar_label(bars, labels=["–" if v is None else format(v, annotate) for v in values], padding=2,
                             fontsize=8.5, color="#334155")
        if horizontal:
            ax.set_yticks(x, labels)
            ax.invert_yaxis()
            ax.grid(axis="y", visible=False)
            ax.margins(x=0.12)
        else:
            slanted = max((len(s) for s in labels), default=0) > 10  # long names would overlap side by side
            ax.set_xticks(x, labels, rotation=20 if slanted else 0, ha="right" if slanted else "center")
            ax.grid(axis="x", visible=False)
            ax.margins(y=0.12)
        if hline:
            (ax.axvline if horizontal else ax.axhline)(hline[0], color="#0f172a", lw=1, ls="--", label=hline[1])
        _finish(ax, title, ylabel if horizontal else "", "" if horizontal else ylabel, n > 1 or bool(hline))
        return to_svg(fig, title)


# -- HTML pieces ---------------------------------------------------------------------------------------------------
def esc(text) -> str:
    return html.escape(str(text), quote=True)


def num(value, src: str, fmt: str = ",.0f", scale: float = 1.0, suffix: str = "") -> str:
    """A figure with its source: `value * scale` formatted with `fmt` (thousands separators), then `suffix`."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return '<span class="num none">–</span>'
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f'<span class="num">{esc(value)}</span>'
    extra = (f' data-src="{esc(src)}"' if src else "") + (f' data-scale="{scale:.17g}"' if scale != 1 else "")
    return f'<span class="num"{extra}>{format(value * scale, fmt)}{esc(suffix)}</span>'


def pct(value, src: str, digits: int = 1) -> str:
    return num(value, src, f",.{digits}f", 100.0, "%")


def seconds(value, src: str) -> str:
    """A duration as eyas.core.log.fmt_duration prints it (s, min or h), with its source."""
    if value is None:
        return num(None, src)
    v = float(value)
    if v < 90:
        return num(v, src, ",.0f", 1, " s")
    if v < 5400:
        return num(v, src, ",.1f", 1 / 60, " min")
    return num(v, src, ",.1f", 1 / 3600, " h")


def nbytes(value, src: str) -> str:
    """A size in B / KiB / MiB / GiB (as eyas.core.log.fmt_bytes), with its source."""
    if value is None:
        return num(None, src)
    v, k = float(value), 0
    while abs(v) >= 1024 and k < 4:
        v, k = v / 1024, k + 1
    unit = ("B", "KiB", "MiB", "GiB", "TiB")[k]
    return num(value, src, ",.0f" if k == 0 else ",.1f", 1024.0 ** -k, f" {unit}")


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[int] = (), cls: str = "") -> str:
    """A table of pre-rendered cells; columns in `numeric` are right-aligned with tabular figures."""
    head = "".join(f'<th class="{"r" if i in numeric else ""}">{h}</th>' for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(f'<td class="{"r" if i in numeric else ""}">{c}</td>' for i, c in enumerate(r))
                   + "</tr>" for r in rows)
    return (f'<div class="tablewrap"><table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody>'
            "</table></div>")


def facts(pairs: Sequence[tuple[str, str]]) -> str:
    """A grid of (label, rendered value) pairs."""
    return '<dl class="facts">' + "".join(f"<div><dt>{k}</dt><dd>{v}</dd></div>" for k, v in pairs) + "</dl>"


def kpi(label: str, value: str, sub: str, tone: str = "") -> str:
    return f'<div class="kpi {tone}"><div class="kpi-label">{label}</div><div class="kpi-value">{value}</div>' \
           f'<div class="kpi-sub">{sub}</div></div>'


def badge(text: str, tone: str) -> str:
    return f'<span class="badge {tone}">{esc(text)}</span>'


def meter(share: float | None, src: str, label: str) -> str:
    """A horizontal bar filled to `share` (0..1), with the percentage."""
    width = 0 if share is None else max(0.0, min(1.0, share)) * 100
    return f'<div class="meter" aria-label="{esc(label)}"><div class="fill" style="width:{width:.2f}%"></div></div>' \
           f'<div class="meter-label">{pct(share, src, 2)} {esc(label)}</div>'


def figures(*svgs: str) -> str:
    return '<div class="figs">' + "".join(f"<figure>{s}</figure>" for s in svgs if s) + "</div>"


def not_run(message: str) -> str:
    return f'<div class="notrun"><strong>not run</strong> · {message}</div>'


def section(sid: str, title: str, body: str, status: str = "ok") -> str:
    tag = "" if status == "ok" else f' {badge("not run", "muted")}'
    return f'<section id="{sid}" data-status="{status}"><h2>{esc(title)}{tag}</h2>{body}</section>'


CSS = """
:root{--ink:#0f172a;--ink2:#334155;--mute:#64748b;--line:#e2e8f0;--bg:#f8fafc;--card:#fff;--accent:#2563eb;
--good:#059669;--bad:#dc2626;--warn:#d97706}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--ink);font:15px/1.6 system-ui,-apple-system,"Segoe UI",Roboto,
"Helvetica Neue",Arial,sans-serif;-webkit-font-smoothing:antialiased}
main{max-width:1120px;margin:0 auto;padding:32px 28px 80px}
header.top{display:flex;justify-content:space-between;align-items:baseline;gap:16px;flex-wrap:wrap}
h1{font-size:28px;line-height:1.2;margin:0 0 4px;letter-spacing:-.02em}
h1 small{font-weight:500;color:var(--mute)}
.subtitle{color:var(--ink2);margin:0 0 20px}
h2{font-size:20px;margin:0 0 12px;letter-spacing:-.01em;display:flex;gap:10px;align-items:center}
h3{font-size:15px;margin:22px 0 8px;color:var(--ink2)}
section{background:var(--card);border:1px solid var(--line);border-radius:14px;padding:24px 28px;margin:22px 0;
box-shadow:0 1px 2px rgba(15,23,42,.04)}
nav.toc{display:flex;flex-wrap:wrap;gap:6px;margin:0 0 8px}
nav.toc a{font-size:13px;color:var(--ink2);text-decoration:none;border:1px solid var(--line);border-radius:99px;
padding:3px 12px;background:var(--card)}
nav.toc a:hover{border-color:var(--accent);color:var(--accent)}
nav.toc a.off{color:var(--mute);opacity:.7}
.card{display:grid;grid-template-columns:repeat(4,1fr);gap:14px;margin:18px 0 6px}
.kpi{background:var(--card);border:1px solid var(--line);border-radius:14px;padding:16px 18px;
border-top:4px solid var(--accent)}
.kpi.good{border-top-color:var(--good)}.kpi.bad{border-top-color:var(--bad)}.kpi.muted{border-top-color:#cbd5e1}
.kpi-label{font-size:12px;text-transform:uppercase;letter-spacing:.06em;color:var(--mute);font-weight:600}
.kpi-value{font-size:34px;font-weight:700;line-height:1.15;margin:4px 0;font-variant-numeric:tabular-nums}
.kpi.good .kpi-value{color:var(--good)}.kpi.bad .kpi-value{color:var(--bad)}
.kpi-sub{font-size:13px;color:var(--ink2)}
p{margin:8px 0 12px;max-width:78ch}
.lead{font-size:16px;color:var(--ink2)}
.num{font-variant-numeric:tabular-nums;white-space:nowrap}
.tablewrap{overflow-x:auto;margin:10px 0 14px}
table{border-collapse:collapse;width:100%;font-size:14px}
th{font-size:12px;text-transform:uppercase;letter-spacing:.04em;color:var(--mute);font-weight:600;text-align:left;
border-bottom:2px solid var(--line);padding:6px 10px}
td{border-bottom:1px solid var(--line);padding:6px 10px;vertical-align:top}
td code{white-space:nowrap}td code.path{white-space:normal;word-break:break-all}
tbody tr:hover{background:#f1f5f9}
.r{text-align:right;font-variant-numeric:tabular-nums}
dl.facts{display:grid;grid-template-columns:repeat(auto-fill,minmax(210px,1fr));gap:10px 18px;margin:12px 0}
dl.facts div{border-left:3px solid var(--line);padding-left:10px}
dt{font-size:12px;color:var(--mute)}dd{margin:0;font-size:17px;font-weight:600}
.figs{display:grid;grid-template-columns:repeat(auto-fill,minmax(440px,1fr));gap:14px;margin:12px 0}
figure{margin:0;border:1px solid var(--line);border-radius:10px;padding:10px;background:#fff;display:flex;
align-items:center}
svg.plot{width:100%;height:auto;display:block}
.badge{font-size:12px;font-weight:600;border-radius:99px;padding:2px 10px;letter-spacing:.02em;white-space:nowrap}
.sym{text-transform:none}
.badge.good{background:#d1fae5;color:#065f46}.badge.bad{background:#fee2e2;color:#991b1b}
.badge.muted{background:#f1f5f9;color:var(--mute)}.badge.warn{background:#fef3c7;color:#92400e}
.notrun{color:var(--mute);background:#f8fafc;border:1px dashed #cbd5e1;border-radius:10px;padding:12px 16px;
margin:8px 0}
.meter{height:12px;background:#e2e8f0;border-radius:99px;overflow:hidden;max-width:520px}
.meter .fill{height:100%;background:linear-gradient(90deg,#2563eb,#0891b2)}
.meter-label{font-size:14px;color:var(--ink2);margin:4px 0 10px}
details{margin:10px 0}summary{cursor:pointer;color:var(--ink2);font-size:14px}
pre{background:#0f172a;color:#e2e8f0;border-radius:10px;padding:12px 14px;overflow-x:auto;font-size:12.5px;
line-height:1.5;white-space:pre-wrap;word-break:break-all}
code{font:12.5px/1.5 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
.gen{border:1px solid var(--line);border-radius:10px;padding:12px 16px;margin:12px 0}
.gen .meta{font-size:13px;color:var(--mute);margin-bottom:6px}
.gen .prompt{overflow-wrap:anywhere;font-size:14px;color:var(--ink2);border-left:3px solid var(--line);
  padding-left:10px;margin:6px 0 10px}
.gen .text{white-space:pre-wrap;overflow-wrap:anywhere;font-size:14.5px;line-height:1.75}
.tok-d{background:#dbeafe;color:#1e3a8a;border-radius:3px;box-shadow:0 0 0 1px #bfdbfe}
.tok-b{background:#fde68a;border-radius:3px}
.legend{font-size:13px;color:var(--ink2)}
.note{font-size:13px;color:var(--mute)}
footer{color:var(--mute);font-size:13px;margin-top:30px}
@media (max-width:820px){.card{grid-template-columns:repeat(2,1fr)}.figs{grid-template-columns:1fr}}
"""


def page(title: str, subtitle: str, card: str, toc: Sequence[tuple[str, str, bool]], sections: Sequence[str],
         footer: str) -> str:
    links = "".join(f'<a href="#{sid}" class="{"" if on else "off"}">{esc(name)}</a>' for sid, name, on in toc)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">"
            f"<title>{esc(title)} · eyas run report</title><style>{CSS}</style></head><body><main>"
            f"<header class=\"top\"><div><h1>{esc(title)} <small>· eyas run report</small></h1>"
            f"<p class=\"subtitle\">{subtitle}</p></div></header>"
            f"<nav class=\"toc\">{links}</nav>{card}{''.join(sections)}<footer>{footer}</footer>"
            "</main></body></html>\n")
