"""A run folder's files, each read once and kept with where it came from: `RunFiles` finds a stage's output
(its marker in RUN/stages/, else the demo's layout), `Doc` is one JSON file with its JSON pointers, `load` reads
what the report shows."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from eyas.core.errors import EyasError
from eyas.core.files import read_json
from eyas.report.page import nbytes, num, pct, seconds


def get(d, *keys):
    """d[k1][k2]... through dicts and lists (negative indices too), or None when any level is missing."""
    for k in keys:
        if isinstance(d, dict):
            d = d.get(k)
        elif isinstance(d, list) and isinstance(k, int) and -len(d) <= k < len(d):
            d = d[k]
        else:
            return None
    return d


def ptr(*keys) -> str:
    """The JSON pointer (RFC 6901) of a key path."""
    return "".join("/" + str(k).replace("~", "~0").replace("/", "~1") for k in keys)


class Doc:
    """A JSON document (a .jsonl file: the list of its non-empty lines, None where a line does not parse) and its
    name in the run folder; `doc.num("totals", "bytes")` renders that value with its data-src."""

    def __init__(self, data, name: str):
        self.data, self.name = data, name

    def __bool__(self) -> bool:
        return self.data is not None

    def get(self, *keys):
        return get(self.data, *keys)

    def src(self, *keys) -> str:
        return f"{self.name}#{ptr(*keys)}"

    def num(self, *keys, fmt: str = ",.0f", suffix: str = "") -> str:
        return num(self.get(*keys), self.src(*keys), fmt, suffix=suffix)

    def pct(self, *keys, digits: int = 1) -> str:
        return pct(self.get(*keys), self.src(*keys), digits)

    def seconds(self, *keys) -> str:
        return seconds(self.get(*keys), self.src(*keys))

    def bytes(self, *keys) -> str:
        return nbytes(self.get(*keys), self.src(*keys))

    def rows(self) -> list[tuple[int, dict]]:
        """(line index, object) of a .jsonl document's readable lines."""
        return [(i, r) for i, r in enumerate(self.data or []) if isinstance(r, dict)]


class RunFiles:
    """A run folder, read tolerantly: a missing file is an empty Doc, an unreadable one too, plus a note in
    `problems` that the page shows."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.problems: list[str] = []
        self.markers: dict[str, Doc] = {}
        for p in sorted((self.root / "stages").glob("*.json")):
            m = self.json(p)
            if isinstance(m.data, dict):
                self.markers[p.stem] = m
        pipe = self.json(self.root / "pipeline.json").data
        pipe = [s for s in pipe if isinstance(s, dict)] if isinstance(pipe, list) else []
        self.planned = {s.get("name"): (i, s) for i, s in enumerate(pipe)}
        self.order = [s.get("name") for s in pipe] + sorted(n for n in self.markers if n not in self.planned)

    def stages(self, command: str) -> list[tuple[str, Doc]]:
        """(stage name, marker) of the finished stages running `command`, in pipeline order."""
        return [(n, self.markers[n]) for n in self.order if n in self.markers
                and self.markers[n].get("command") == command]

    def locate(self, command: str, key: str, default: str) -> Path:
        """The folder a stage wrote: its `key` setting (first such stage, finished or planned), else RUN/default."""
        for name in self.order:
            stage = self.markers[name].data if name in self.markers else self.planned.get(name, (0, {}))[1]
            value = get(stage, "settings", key)
            if stage.get("command") == command and isinstance(value, str) and value:
                return self.resolve(value)
        return self.root / default

    def resolve(self, setting: str) -> Path:
        """A path from a stage's settings. Inside this run folder when it names a path within the run (the run may
        have moved, or the settings be relative to another working directory); else as written when it exists;
        else the longest tail of it that exists in the run folder (a renamed run); else as written."""
        p = Path(setting)
        parts = p.parts
        if self.root.name in parts:
            inside = self.root.joinpath(*parts[len(parts) - parts[::-1].index(self.root.name):])
            if inside.exists() or not p.exists():
                return inside
        if p.exists():
            return p
        tails = (self.root.joinpath(*parts[i:]) for i in range(1, len(parts)))
        return next((t for t in tails if t.exists()), p)

    def name(self, path: Path) -> str:
        """A file's name in data-src: relative to the run folder when inside it, else absolute."""
        try:
            return path.resolve().relative_to(self.root.resolve()).as_posix()
        except ValueError:
            return str(path.resolve())

    def json(self, path: Path) -> Doc:
        data = None
        if path.is_file():
            try:
                data = read_json(path, "rerun the stage that wrote it", expect=None)
            except EyasError as e:
                self.problems.append(f"{e.what}; its figures are left out")
        return Doc(data, self.name(path))

    def jsonl(self, path: Path) -> Doc:
        """A JSON-lines file; a line that does not parse (a run cut mid-write) becomes None and is noted."""
        if not path.is_file():
            return Doc(None, self.name(path))
        rows = []
        try:
            lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
        except (OSError, UnicodeDecodeError) as e:
            self.problems.append(f"{path}: unreadable ({e}); its figures are left out")
            return Doc(None, self.name(path))
        for line in lines:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                rows.append(None)
        if None in rows:
            self.problems.append(f"{path}: {rows.count(None)} line(s) are not JSON (cut by a crash?) and were skipped")
        return Doc(rows, self.name(path))

    def line_count(self, path: Path) -> int | None:
        if not path.is_file():
            return None
        with open(path, encoding="utf-8", errors="replace") as f:
            return sum(1 for line in f if line.strip())


@dataclasses.dataclass
class Loaded:
    """The run's main files, each read once, and the stages' output folders."""

    prep: Path
    store: Path
    train: Path
    eval: Path
    prepared: Doc  # prepared/summary.json (eyas.data.prepare)
    manifest: Doc  # store/manifest.json (eyas.store.writer.write_manifest)
    plan: Doc  # train/plan.json (eyas.train.setup.make_plan, eyas.train.trainer.Trainer.report_rate)
    audit: Doc  # train/audit.json (eyas.train.sharding.Audit.to_dict + "epochs")
    final: Doc  # train/final/config.json (eyas.draft.checkpoint.save_draft + "training")
    metrics: Doc  # train/metrics.jsonl, one object per optimizer step
    validation: Doc  # train/validation.jsonl, one object per validation pass
    results: Doc  # evaluate/results.json (eyas.speculate.results.aggregate)


def load(f: RunFiles) -> Loaded:
    prep, store = f.locate("prepare", "out", "prepared"), f.locate("extract", "store", "store")
    train, ev = f.locate("train", "out", "train"), f.locate("evaluate", "out", "evaluate")
    return Loaded(prep, store, train, ev, f.json(prep / "summary.json"), f.json(store / "manifest.json"),
                  f.json(train / "plan.json"), f.json(train / "audit.json"), f.json(train / "final" / "config.json"),
                  f.jsonl(train / "metrics.jsonl"), f.jsonl(train / "validation.jsonl"), f.json(ev / "results.json"))
