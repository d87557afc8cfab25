"""What a training run carries from one process to the next: its progress, and the checkpoint it resumes from.

`Progress` is written into every checkpoint's trainer_state.json (`to_state`) and read back on resume
(`from_state`): one definition of the keys, used by both. `ResumePoint` is a loaded checkpoint, by name.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

import torch


class ResumePoint(NamedTuple):
    """A complete checkpoint, loaded (eyas.draft.checkpoint.load_checkpoint) and checked resumable."""

    folder: Path
    model_state: dict[str, torch.Tensor]  # keyed like Eagle3Draft.state_dict()
    optimizer_state: dict  # the full (unsharded) optimizer state dict
    state: dict  # trainer_state.json: Progress.to_state() plus world size, config, RNG, vocabulary, data, training


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
