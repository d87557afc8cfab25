"""The report's figures: matplotlib charts as inline SVG.

Figures are matplotlib's SVG output with the text kept as text (`svg.fonttype = none`, so the page's font draws
it), element ids prefixed per figure (several SVGs share one document), no XML prolog and no fixed size (they
scale with the page). Nothing here reads a file or computes a figure: the caller hands over the numbers exactly
as the run's files hold them (a curve longer than SMOOTH_ABOVE points is drawn faint under its moving average, a
display aid; tables show the logged values).
"""

from __future__ import annotations

import io
import itertools
import math
import re
from typing import Sequence

import numpy as np

from eyas.report.page import esc

MAX_POINTS = 1500  # per line of a plot
SMOOTH_ABOVE = 60  # longer curves get a moving average over the faint raw values
PALETTE = ("#2563eb", "#e11d48", "#059669", "#d97706", "#7c3aed", "#0891b2", "#65a30d", "#db2777", "#475569")
_ids = itertools.count()


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
