"""--tracker (issue 44): TensorBoard, Weights & Biases (offline) and MLflow (a local store) receive the same scalars
at the same steps as RUN/metrics.jsonl and RUN/validation.jsonl; a resumed run continues the same tracker runs."""

import glob
import json

import pytest

from eyas.core.errors import EyasError
from eyas.train.settings import TrainConfig
from eyas.train.trackers import TRACKERS, missing_package, open_trackers
from eyas.train.trainer import run
from tests.train_fakes import write_store

pytestmark = pytest.mark.skipif(any(missing_package(t) for t in TRACKERS),
                                reason="needs tensorboard, wandb and mlflow (scripts/setup.sh installs them)")


@pytest.fixture(scope="module")
def store(tiny_target, tmp_path_factory):
    return write_store(tiny_target, tmp_path_factory.mktemp("store") / "s", n=16)


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))  # W&B's own settings and cache, not the home folder
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store for opt-in use


def wandb_history(run_dir) -> dict[int, dict]:
    """step -> logged values, read from the .wandb files of an offline run (LevelDB-log framed protobuf records
    after a 7-byte header, as wandb writes them)."""
    from wandb.proto import wandb_internal_pb2 as pb

    out: dict[int, dict] = {}
    for path in glob.glob(f"{run_dir}/wandb/offline-run-*/run-*.wandb"):
        data, pos, block, buf = open(path, "rb").read(), 7, 32768, b""
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # a block's tail too short for a header is padding
                pos += block - pos % block
                continue
            length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
            buf, pos = buf + data[pos + 7:pos + 7 + length], pos + 7 + length
            if kind in (1, 4):  # a whole record, or the last piece of one
                rec = pb.Record()
                rec.ParseFromString(buf)
                buf = b""
                if rec.WhichOneof("record_type") == "history":
                    items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                    step = items.pop("_step")
                    out.setdefault(step, {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    return out


def same(got: dict[int, dict], want: dict[int, dict], rel: float = 1e-12) -> bool:
    return got.keys() == want.keys() and all(got[s] == pytest.approx(want[s], rel=rel) for s in want)


def test_every_tracker_gets_the_metrics_files_scalars(store, tmp_path, offline):
    out = tmp_path / "run"
    run(TrainConfig(quiet=True, store=str(store), out=str(out), target="tiny", threads=1, draft_vocab=512,
                    ttt_steps=2, micro_batch=2, val_fraction=0.25, tracker=("tensorboard", "wandb", "mlflow")))
    train = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    val = [json.loads(x) for x in (out / "validation.jsonl").read_text().splitlines()]
    assert len(train) == 6 and len(val) == 1  # 12 training samples / 2 a step; one epoch's validation
    want: dict[int, dict] = {}
    for m in train:
        want.setdefault(m["step"], {}).update(
            {"train/loss": m["loss"], "train/lr": m["lr"], "train/tokens_per_s": m["tokens_per_s"],
             "train/grad_norm": m["grad_norm"], "train/loss_0": m["loss_i"][0], "train/loss_1": m["loss_i"][1],
             "train/acc_0": m["acc_i"][0], "train/acc_1": m["acc_i"][1]})
    for v in val:
        want.setdefault(v["step"], {}).update({"val/loss": v["loss"], "val/acc_0": v["acc_i"][0],
                                               "val/acc_1": v["acc_i"][1],
                                               "val/expected_tau": 1 + v["acc_i"][0] + v["acc_i"][0] * v["acc_i"][1]})

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(out / "tensorboard"))
    tb.Reload()
    got_tb: dict[int, dict] = {}
    for tag in tb.Tags()["scalars"]:
        for e in tb.Scalars(tag):
            got_tb.setdefault(e.step, {})[tag] = e.value
    assert same(got_tb, want, rel=1e-6)  # TensorBoard keeps float32
    assert same(wandb_history(out), want)

    from mlflow.tracking import MlflowClient

    ids = json.loads((out / "trackers.json").read_text())
    client = MlflowClient()
    got_ml: dict[int, dict] = {}
    for key in {k for v in want.values() for k in v}:
        for m in client.get_metric_history(ids["mlflow"], key):
            got_ml.setdefault(m.step, {})[key] = m.value
    assert same(got_ml, want)
    assert client.get_run(ids["mlflow"]).data.params["ttt_steps"] == "2"


def test_a_resumed_run_continues_its_tracker_runs(tmp_path, offline):
    out = tmp_path / "run"
    out.mkdir()
    first = open_trackers(("wandb", "mlflow"), out, {"lr": 1e-4})
    ids = [t.id for t in first]
    for t in first:
        t.log({"train/loss": 2.0}, 1)
        t.close()
    again = open_trackers(("wandb", "mlflow"), out, {"lr": 1e-4})
    assert [t.id for t in again] == ids
    for t in again:
        t.log({"train/loss": 1.0}, 2)
        t.close()
    assert json.loads((out / "trackers.json").read_text()) == {"wandb": ids[0], "mlflow": ids[1]}
    from mlflow.tracking import MlflowClient

    assert [(m.step, m.value) for m in MlflowClient().get_metric_history(ids[1], "train/loss")] == [(1, 2.0),
                                                                                                    (2, 1.0)]
    assert wandb_history(out) == {1: {"train/loss": 2.0}, 2: {"train/loss": 1.0}}


def test_an_unknown_or_missing_tracker_is_refused_with_the_fix(monkeypatch):
    with pytest.raises(EyasError, match="use one or more of tensorboard, wandb, mlflow"):
        TrainConfig(tracker=("neptune",))
    monkeypatch.setattr("eyas.train.trackers.importlib.util.find_spec", lambda name: None)
    with pytest.raises(EyasError, match="pip install wandb"):
        TrainConfig(tracker=("wandb",))
