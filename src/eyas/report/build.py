"""`eyas report RUN`: a run folder as one self-contained HTML page (inline CSS and SVG, no network needed).

    eyas report runs/demo                  -> runs/demo/report.html

Everything on the page is read from the run's own files, each figure from exactly one of them: every number
carries `data-src="FILE#/json/pointer"` (eyas.report.page.num), FILE relative to the run folder. Where a
stage's file is missing, its section says "not run" instead of failing; an unreadable file is named on the page.

Where the files are: a stage's output folder is its setting in `RUN/stages/<stage>.json` (eyas.pipeline.stages writes
it when the stage finishes), taken inside the run folder when it names a path within it (so a moved run folder
still reports); without markers, the demo's layout: `prepared/`, `store/`, `train/`, `evaluate/`.
The sections are listed and put together in eyas.report.sections, the figures drawn in eyas.report.charts, the
HTML pieces and the page template in eyas.report.page.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from eyas.core.config import StageConfig, check, opt
from eyas.core.errors import EyasError
from eyas.core.log import console
from eyas.report.run_files import RunFiles, load
from eyas.report.sections import render


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReportConfig(StageConfig):
    run: str = opt(None, "the run folder (runs/<name>, written by eyas demo or eyas run)", positional=True)
    out: str = opt("", "the HTML file to write; empty: RUN/report.html")
    samples: int = opt(3, "sample generations shown (when evaluate recorded them)")

    def validate(self):
        check(bool(self.run), "no run folder given", "pass the run folder: eyas report runs/<name>")
        check(self.samples >= 0, f"--samples {self.samples} is negative", "give 0 or more")


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def build(root: str | Path, samples: int = 3) -> tuple[str, list[tuple[str, str, bool]], list[str]]:
    """(the page, [(section id, title, ran)], problems) of the run folder `root`."""
    files = RunFiles(root)
    page, parts = render(files, load(files), samples)
    return page, parts, files.problems


def run(cfg: ReportConfig) -> dict:
    con = console(0, cfg.quiet, cfg.json)
    root = Path(cfg.run)
    if not root.is_dir():
        raise EyasError(f"run folder {root} not found", fix="give the folder eyas demo or eyas run wrote (runs/<name>)")
    page, parts, problems = build(root, cfg.samples)
    out = Path(cfg.out) if cfg.out else root / "report.html"
    _write_atomic(out, page)
    missing = [sid for sid, _, ran in parts if not ran]
    for note in problems:
        con.print(f"report: {note}")
    con.summary(f"report: {len(parts)} sections ({len(missing)} not run{': ' if missing else ''}{', '.join(missing)}),"
                f" {len(page.encode()) / 1024:,.0f} KiB -> {out}")
    return {"path": str(out), "sections": [sid for sid, _, _ in parts], "not_run": missing, "problems": problems}
