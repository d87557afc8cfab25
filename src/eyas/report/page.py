"""The report's HTML: the pieces a section is built from (numbers with their source, tables, cards, badges),
the stylesheet and the page template.

Every number on the page goes through `num`, which writes where it comes from as `data-src="FILE#/json/pointer"`
(FILE relative to the run folder; for a .jsonl file the first pointer part is the line's index among its
non-empty lines; `FILE#lines` counts those lines), so a test can check each displayed figure against its source.
"""

from __future__ import annotations

import html
import math
from typing import Sequence


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


def missing(what: str, name: str) -> str:
    """A section's "not run" note when the file it shows is absent: `what` did not run, no file `name` here."""
    return not_run(f"{esc(what)}: no <code>{esc(name)}</code> in this run")


def plural(value, word: str) -> str:
    return word if value == 1 else word + "s"


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
