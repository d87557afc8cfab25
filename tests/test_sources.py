"""--data from where users keep it (issue 44): Parquet, Arrow, CSV, a `datasets` folder and a Hugging Face dataset
id read as the same conversations as JSON Lines, and each goes through prepare -> extract -> train."""

import csv
import json
import os
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eyas.core.errors import EyasError
from eyas.data.formats import Issues
from eyas.data.sources import HubDataset, hub_dataset, read_conversations, resolve_data

# UltraChat's layout (prompt, prompt_id, messages), ShareGPT, a prompt-only record, and an OpenAI chat without id
RECORDS = [
    {"prompt": "Name a colour.", "prompt_id": "u1",
     "messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                  {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Green,\nor red."}]},
    {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}], "id": "s1"},
    {"prompt": "Write a haiku about rain, \"quoted\"."},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!"}]},
]


def conversations(spec, **env):
    issues = Issues()
    return list(read_conversations([str(spec)], issues)), issues


def summary(convs):
    return [(c.messages, c.has_assistant) for c in convs]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def as_table(records):
    """The records as one Arrow table (missing keys are nulls), as `datasets` would hold them."""
    keys = list(dict.fromkeys(k for r in records for k in r))
    return pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in records])


def write_csv(path, records):
    """CSV as a spreadsheet exports it: conversation columns as JSON text, missing values as empty cells."""
    keys = list(dict.fromkeys(k for r in records for k in r))
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        for r in records:
            w.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()})
    return path


def cache_hub_dataset(cache, repo, splits):
    """A Hugging Face dataset as `datasets` leaves it in its cache after a download (HF_DATASETS_CACHE):
    OWNER___NAME/default/0.0.0/HASH/ with its Arrow files and dataset_info.json, built by datasets' own Parquet
    builder from local files."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    src = cache.parent / "hub-src"
    src.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, records in splits.items():
        pq.write_table(as_table(records), src / f"{split}.parquet")
        files[split] = [str(src / f"{split}.parquet")]
    owner, name = repo.split("/")
    Parquet(cache_dir=str(cache), dataset_name=name, config_name="default", data_files=files,
            hash="0123456789abcdef").download_and_prepare()
    built = cache / name
    (config,) = built.iterdir()  # default-<hash of the data files>: a download's config is plain "default"
    config.rename(built / "default")
    built.rename(cache / f"{owner}___{name}")


def offline_env(cache):
    return {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache),
            "OMP_NUM_THREADS": "1"}


def test_every_file_format_reads_as_the_same_conversations(tmp_path):
    want, issues = conversations(write_jsonl(tmp_path / "chats.jsonl", RECORDS))
    assert not issues.counts and len(want) == 4
    assert [c.id for c in want] == ["u1", "s1", "chats:3", "chats:4"]  # own ids, else the file's line
    pq.write_table(as_table(RECORDS), tmp_path / "chats.parquet", row_group_size=2)
    with pa.OSFile(str(tmp_path / "stream.arrow"), "wb") as f, pa.ipc.new_stream(f, as_table(RECORDS).schema) as w:
        w.write_table(as_table(RECORDS), max_chunksize=3)
    with pa.OSFile(str(tmp_path / "file.arrow"), "wb") as f, pa.ipc.new_file(f, as_table(RECORDS).schema) as w:
        w.write_table(as_table(RECORDS))
    write_csv(tmp_path / "chats.csv", RECORDS)
    for name in ("chats.parquet", "stream.arrow", "file.arrow", "chats.csv"):
        got, issues = conversations(tmp_path / name)
        assert not issues.counts, name
        assert summary(got) == summary(want), name
        stem = name.split(".")[0]
        rows = ["2", "3", "4", "5"] if name.endswith(".csv") else ["1", "2", "3", "4"]  # CSV: lines after the header
        assert [c.id for c in got] == ["u1", "s1", f"{stem}:{rows[2]}", f"{stem}:{rows[3]}"], name
        assert got[3].source == f"openai:{name}"


def test_a_saved_dataset_folder_reads_its_arrow_files_not_its_metadata(tmp_path):
    import datasets

    datasets.Dataset(as_table(RECORDS)).save_to_disk(str(tmp_path / "saved"))
    want, _ = conversations(write_jsonl(tmp_path / "chats.jsonl", RECORDS))
    got, issues = conversations(tmp_path / "saved")
    assert not issues.counts and summary(got) == summary(want)
    datasets.DatasetDict({"train": datasets.Dataset(as_table(RECORDS))}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(EyasError, match="train"):
        resolve_data(str(tmp_path / "dict"))


def test_bad_rows_are_counted_with_their_line_and_never_stop_the_file(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text('prompt,response\n"multi\nline",ok\n,no prompt\nfine,"a ""quoted"" reply"\n'
                    'x,y,one cell too many\nlast,one\n', encoding="utf-8")
    got, issues = conversations(path)
    assert [c.messages[0].content for c in got] == ["multi\nline", "fine", "last"]
    assert got[0].id == "bad:2" and got[1].id == "bad:5" and got[2].id == "bad:7"  # the line each row starts on
    assert got[1].messages[1].content == 'a "quoted" reply'
    assert issues.counts == {"unknown-format": 1, "bad-record": 1}
    assert issues.places["unknown-format"][0]["where"] == f"{path}:4"
    assert issues.places["bad-record"][0]["where"] == f"{path}:6"
    broken = tmp_path / "broken.parquet"
    pq.write_table(as_table(RECORDS), broken)
    broken.write_bytes(broken.read_bytes()[:-40])  # a truncated download
    got, issues = conversations(broken)
    assert not got and issues.counts == {"unreadable-file": 1}


def test_dataset_ids_are_told_from_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub_dataset("HuggingFaceH4/ultrachat_200k") == HubDataset("HuggingFaceH4/ultrachat_200k")
    assert hub_dataset("HuggingFaceH4/ultrachat_200k:train_sft") == HubDataset("HuggingFaceH4/ultrachat_200k",
                                                                              None, "train_sft")
    assert hub_dataset("openai/gsm8k/main:test") == HubDataset("openai/gsm8k", "main", "test")
    assert str(HubDataset("openai/gsm8k", "main", "test")) == "openai/gsm8k/main:test"
    assert hub_dataset("data/chats.jsonl") is None and hub_dataset("a/b.parquet") is None
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "chats").mkdir()
    assert hub_dataset("mine/chats") is None  # a local folder wins
    with pytest.raises(EyasError, match="not found"):
        resolve_data("data/missing.jsonl")


def test_a_dataset_id_reads_its_split_from_the_offline_cache(tmp_path):
    """In a subprocess: datasets reads HF_DATASETS_OFFLINE when it is imported."""
    cache = tmp_path / "hf" / "datasets"
    cache_hub_dataset(cache, "eyas-test/chats", {"train_sft": RECORDS, "test_sft": RECORDS[:1]})
    script = """
import json, sys
from eyas.core.errors import EyasError
from eyas.data.formats import Issues
from eyas.data.sources import read_conversations
out = {}
for spec in sys.argv[1:]:
    try:
        issues = Issues()
        out[spec] = [[c.id, c.source, [[m.role, m.content] for m in c.messages]]
                     for c in read_conversations([spec], issues)]
    except EyasError as e:
        out[spec] = str(e)
print(json.dumps(out))
"""
    specs = ["eyas-test/chats:train_sft", "eyas-test/chats/default:test_sft", "eyas-test/chats",
             "eyas-test/chats:nope", "eyas-test/elsewhere:train"]
    proc = subprocess.run([sys.executable, "-c", script, *specs], env=offline_env(cache), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    want, _ = conversations(write_jsonl(tmp_path / "chats.jsonl", RECORDS))
    train = got["eyas-test/chats:train_sft"]
    assert [[[r, t] for r, t in msgs] for _, _, msgs in train] == [[[m.role, m.content] for m in c.messages]
                                                                  for c in want]
    assert [i for i, _, _ in train] == ["u1", "s1", "eyas-test/chats:train_sft:3", "eyas-test/chats:train_sft:4"]
    assert train[3][1] == "openai:eyas-test/chats:train_sft"
    assert [i for i, _, _ in got["eyas-test/chats/default:test_sft"]] == ["u1"]
    assert "splits test_sft, train_sft" in got["eyas-test/chats"] or "splits train_sft, test_sft" in got[
        "eyas-test/chats"]
    assert "fix: name one after a colon" in got["eyas-test/chats"]
    assert "nope" in got["eyas-test/chats:nope"] and "train_sft" in got["eyas-test/chats:nope"]
    assert "not in the datasets cache and the Hub is offline" in got["eyas-test/elsewhere:train"]


def eyas(*args, env, cwd):
    proc = subprocess.run([sys.executable, "-m", "eyas", *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"eyas {' '.join(args)}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.parametrize("source", ["parquet", "dataset-id"])
def test_a_parquet_file_and_a_dataset_id_go_through_prepare_extract_train(tmp_path, source):
    """Done when of issue 44: each source through the pipeline's three data stages on the tiny target."""
    records = [{"prompt_id": f"p{i}", "messages": [
        {"role": "user", "content": f"What is {i} plus {i}?"},
        {"role": "assistant", "content": f"{i} plus {i} is {2 * i}. " * 3}]} for i in range(12)]
    cache = tmp_path / "hf" / "datasets"
    if source == "parquet":
        pq.write_table(as_table(records), tmp_path / "chats.parquet")
        data = str(tmp_path / "chats.parquet")
    else:
        cache_hub_dataset(cache, "eyas-test/sums", {"train": records})
        shutil.rmtree(cache.parent / "hub-src")  # the cache alone holds it now
        data = "eyas-test/sums"  # one split: no need to name it
    env = offline_env(cache)
    eyas("prepare", "--target", "tiny", "--data", data, "--out", "prep", "--validation", "0", "--quiet",
         env=env, cwd=tmp_path)
    prepared = json.loads((tmp_path / "prep" / "summary.json").read_text())
    assert prepared["samples"]["train"] == 12, prepared
    eyas("extract", "--target", "tiny", "--data", "prep", "--store", "store", "--quiet", env=env, cwd=tmp_path)
    assert len(json.loads((tmp_path / "store" / "manifest.json").read_text())["samples"]) == 12
    eyas("train", "--target", "tiny", "--store", "store", "--out", "run", "--max-steps", "2", "--quiet",
         env=env, cwd=tmp_path)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "loss" in s][-1] == 2
