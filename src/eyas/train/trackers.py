"""Where rank 0's training metrics go besides RUN/metrics.jsonl and RUN/validation.jsonl (`--tracker`):
TensorBoard, Weights & Biases and MLflow, each sent the same scalars under the same names (`train_scalars`,
`validation_scalars`) at the same optimizer step.

| --tracker     | writes                                       | configured by                                     |
|---------------|----------------------------------------------|---------------------------------------------------|
| `tensorboard` | RUN/tensorboard/ (event files)               | nothing                                           |
| `wandb`       | a W&B run (files under RUN/wandb/)           | WANDB_PROJECT (default eyas), WANDB_MODE=offline, |
|               |                                              | WANDB_API_KEY, ... (wandb's own variables)        |
| `mlflow`      | an MLflow run                                | MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME       |
|               |                                              | (default eyas)                                    |

A resumed run continues the same W&B and MLflow runs (their ids are kept in RUN/trackers.json), and sends only
the steps after its checkpoint, so each step reaches a tracker once, as it reaches metrics.jsonl once.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Protocol

from eyas.core.errors import EyasError
from eyas.core.files import read_json, write_json

TRACKERS = ("tensorboard", "wandb", "mlflow")
# tracker -> (the module it needs, the command that installs it)
PACKAGES = {"tensorboard": ("tensorboard", "pip install tensorboard"), "wandb": ("wandb", "pip install wandb"),
            "mlflow": ("mlflow", "pip install mlflow-skinny")}
IDS_FILE = "trackers.json"  # the W&B and MLflow run ids of RUN, so a resume continues them


def missing_package(name: str) -> str | None:
    """The install command a tracker still needs, or None when its package is importable."""
    module, install = PACKAGES[name]
    return None if importlib.util.find_spec(module) is not None else install


def train_scalars(rec: dict) -> dict[str, float]:
    """The scalars of one metrics.jsonl line: loss, lr, throughput, gradient norm, and each TTT step's loss and
    accuracy."""
    out = {f"train/{k}": float(rec[k]) for k in ("loss", "lr", "tokens_per_s", "grad_norm")}
    for i, (loss, acc) in enumerate(zip(rec["loss_i"], rec["acc_i"])):
        out[f"train/loss_{i}"], out[f"train/acc_{i}"] = float(loss), float(acc)
    return out


def validation_scalars(rec: dict) -> dict[str, float]:
    """The scalars of one validation.jsonl line: loss, each TTT step's accuracy, the expected acceptance length."""
    out = {"val/loss": float(rec["loss"])}
    if rec.get("expected_tau") is not None:
        out["val/expected_tau"] = float(rec["expected_tau"])
    out.update({f"val/acc_{i}": float(acc) for i, acc in enumerate(rec["acc_i"])})
    return out


class Tracker(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoard:
    def __init__(self, out: Path):
        from torch.utils.tensorboard import SummaryWriter  # optional dependency (--tracker tensorboard)

        self.writer = SummaryWriter(str(out / "tensorboard"))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandB:
    def __init__(self, out: Path, config: dict, run_id: str | None):
        import wandb  # optional dependency (--tracker wandb), seconds to import

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "eyas", name=out.resolve().name,
                              dir=str(out), config=config, id=run_id, resume="allow" if run_id else None)
        self.id = self.run.id

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    def __init__(self, out: Path, config: dict, run_id: str | None):
        import mlflow  # optional dependency (--tracker mlflow), seconds to import

        self.mlflow = mlflow
        if run_id is None:
            mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME") or "eyas")
            self.run = mlflow.start_run(run_name=out.resolve().name)
            mlflow.log_params({k: str(v)[:500] for k, v in config.items()})  # MLflow keeps 6,000 characters
        else:
            self.run = mlflow.start_run(run_id=run_id)
        self.id = self.run.info.run_id

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(scalars, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def open_trackers(names: tuple[str, ...], out: Path, config: dict) -> list[Tracker]:
    """The trackers of a run (rank 0 only), continuing the W&B and MLflow runs RUN/trackers.json names."""
    ids_path = out / IDS_FILE
    ids = read_json(ids_path, f"delete {ids_path} to start new tracker runs") if ids_path.is_file() else {}
    trackers: list[Tracker] = []
    try:
        for name in names:
            if name == "tensorboard":
                trackers.append(TensorBoard(out))
            elif name == "wandb":
                trackers.append(WandB(out, config, ids.get("wandb")))
            else:
                trackers.append(MLflow(out, config, ids.get("mlflow")))
    except Exception as e:  # a tracker's own failure (no login, an unreachable server): named, with the fix
        for t in trackers:
            t.close()
        raise EyasError(f"--tracker {name}: could not start ({type(e).__name__}: {str(e).splitlines()[0]})",
                        fix=_TRACKER_FIX[name]) from e
    new = {n: t.id for n, t in zip(names, trackers) if hasattr(t, "id")}
    if new and new != {k: ids.get(k) for k in new}:
        write_json(ids_path, {**ids, **new})
    return trackers


_TRACKER_FIX = {
    "tensorboard": "check that RUN/tensorboard is writable, or drop tensorboard from --tracker",
    "wandb": "log in (`wandb login`) or set WANDB_MODE=offline (sync later with `wandb sync RUN/wandb`), or drop "
             "wandb from --tracker",
    "mlflow": "set MLFLOW_TRACKING_URI to your tracking server (or a local store), or drop mlflow from --tracker",
}
