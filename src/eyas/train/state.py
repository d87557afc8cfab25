"""What a training run carries from one process to the next: its progress, and the checkpoint it resumes from.

`TrainerState` is what a checkpoint's trainer_state.json holds besides the weights and the optimizer: the trainer
writes it with `to_dict` and a resumed run reads it with `from_dict`, one definition of the keys used by both
(`Progress` is its position in the data). `ResumePoint` is a loaded checkpoint, by name.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

import torch


@dataclasses.dataclass
class Progress:
    """Where a run is, in global counts (every rank holds the same values)."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # the epoch the next step belongs to
    step_in_epoch: int = 0  # optimizer steps done within that epoch
    samples_seen: int = 0  # samples trained on, repeats included, all ranks
    tokens_seen: int = 0  # real tokens fed to the draft, all ranks
    epoch_samples: int = 0  # samples of the current epoch so far
    elapsed_s: float = 0.0  # training time spent before this process started

    # field -> key in trainer_state.json (the keys predate this class: checkpoints already written keep loading)
    KEYS = {"step": "step", "epoch": "epoch", "step_in_epoch": "step_in_epoch", "samples_seen": "samples_seen_global",
            "tokens_seen": "tokens_seen_global", "epoch_samples": "epoch_samples_global", "elapsed_s": "elapsed_s"}

    def to_state(self) -> dict:
        return {key: getattr(self, name) for name, key in self.KEYS.items()}

    @classmethod
    def from_state(cls, state: dict) -> Progress:
        """The progress a checkpoint recorded (a new run: `Progress()`)."""
        values = {name: state[key] for name, key in cls.KEYS.items() if key in state}
        values["elapsed_s"] = float(values.get("elapsed_s", 0.0))
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class TrainerState:
    """A checkpoint's trainer_state.json (eyas.draft.checkpoint adds its format, optimizer layout and checksum)."""

    progress: Progress  # where the run was
    world_size: int  # ranks of the run that wrote it (a resume must have as many)
    config: dict  # its TrainConfig, as a dict (eyas.draft.checkpoint.check_resumable compares it)
    rng: list  # each rank's RNG states (eyas.draft.checkpoint.rng_state), by rank
    vocab: dict  # the draft vocabulary's size, coverage and distinct ids seen
    training: dict  # the training summary so far (its "validation": the last validation's figures)
    data: dict  # samples, skipped samples and shards of the training data (setup's data record)

    def to_dict(self) -> dict:
        return {**self.progress.to_state(), "world_size": self.world_size, "config": self.config, "rng": self.rng,
                "vocab": self.vocab, "training": self.training, "data": self.data}

    @classmethod
    def from_dict(cls, state: dict) -> TrainerState:
        return cls(progress=Progress.from_state(state), world_size=int(state["world_size"]),
                   config=state.get("config", {}), rng=state["rng"], vocab=state["vocab"],
                   training=state.get("training", {}), data=state.get("data"))

    @property
    def validation(self) -> dict | None:
        return self.training.get("validation")


class ResumePoint(NamedTuple):
    """A complete checkpoint, loaded (eyas.draft.checkpoint.load_checkpoint) and checked resumable."""

    folder: Path
    model_state: dict[str, torch.Tensor]  # keyed like Eagle3Draft.state_dict()
    optimizer_state: dict  # the full (unsharded) optimizer state dict
    state: TrainerState
