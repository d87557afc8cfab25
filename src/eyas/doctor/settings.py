"""`DoctorConfig`: the settings of `eyas doctor`, read by every step of the diagnosis."""

from __future__ import annotations

import dataclasses

from eyas.core.config import StageConfig, check, opt


@dataclasses.dataclass(frozen=True, kw_only=True)
class DoctorConfig(StageConfig):
    """Settings of `eyas doctor`. The hints stand in for figures a log does not state."""

    logs: tuple[str, ...] = opt((), "training logs or eyas run folders (RUN/metrics.jsonl)", positional=True)
    samples: int = opt(0, "dataset samples, if the log does not state them (0 = unknown)")
    world_size: int = opt(0, "ranks, if the log does not show them (0 = unknown)")
    micro_batch: int = opt(0, "samples per micro-batch per rank, if the log does not state it (0 = unknown)")
    grad_accum: int = opt(1, "micro-batches per optimizer step (used with --micro-batch)")
    epochs: int = opt(0, "epochs of the run, if the log does not state them (0 = unknown)")
    follow: bool = opt(False, "keep reading a log that is still being written, printing progress as steps arrive")
    follow_timeout: float = opt(600.0, "with --follow: stop after this many seconds without a new line (0 = never)")
    poll: float = opt(1.0, "with --follow: seconds between reads of the log")

    def validate(self):
        check(len(self.logs) > 0, "doctor: no log given", "give one or more log files or eyas run folders")
        check(not self.follow or len(self.logs) == 1, "doctor: --follow reads one log", "give a single log")
        for name in ("samples", "world_size", "micro_batch", "epochs"):
            check(getattr(self, name) >= 0, f"doctor: --{name.replace('_', '-')} must be >= 0", "give 0 for unknown")
        check(self.grad_accum >= 1, "doctor: --grad-accum must be >= 1", "give a whole number >= 1")
        check(self.follow_timeout >= 0 and self.poll > 0, "doctor: --follow-timeout >= 0 and --poll > 0 required",
              "give seconds, e.g. --follow-timeout 60 --poll 1")
