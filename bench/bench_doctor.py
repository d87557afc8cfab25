"""eyas doctor on long logs: seconds and peak memory for a 200 MB log of the seed run, in each format.

Each log is written by tests/seedlogs.py (4 ranks, 35,446 samples, not sharded, 1.4 steps/s) into a temporary
folder (never the repo), then read by `eyas doctor --json` in a fresh process, so the peak RSS is doctor's alone.
A log a tenth the size is read the same way beside it: peak memory that stays flat from 20 MB to 200 MB is what
"bounded" means; time that grows tenfold is linear.

    python bench/bench_doctor.py                 # 200 MB and 20 MB, three formats
    python bench/bench_doctor.py --mb 50 --formats torchrun
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.seedlogs import SeedRun, lines  # noqa: E402  (the generator lives with the tests)

from eyas.core.config import check, opt, parse  # noqa: E402


@dataclasses.dataclass(frozen=True, kw_only=True)
class DoctorBenchConfig:
    mb: float = opt(200.0, "the long log's size in MB (the short one is a tenth of it)")
    formats: tuple[str, ...] = opt(("torchrun", "speculators", "specforge"), "the log formats, one pair of logs each",
                                   choices=("torchrun", "speculators", "specforge"))

    def __post_init__(self):
        check(self.mb > 0, f"--mb {self.mb:g} is not a size", "give the long log's size in MB, above 0")
        check(bool(self.formats), "--formats is empty", "give one format or more, e.g. --formats torchrun")


def cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def write_mb(path: Path, fmt: str, mb: float) -> int:
    """Write a log of about `mb` megabytes (a run long enough never to end there); its size in bytes."""
    target, size = int(mb * 1e6), 0
    with open(path, "w") as f:
        for line in lines(SeedRun(fmt=fmt, sharded=False, epochs=1000, stop_at=10**9)):
            f.write(line + "\n")
            size += len(line) + 1
            if size >= target:
                break
    return path.stat().st_size


def doctor(path: Path) -> tuple[float, float, dict]:
    """(seconds, peak RSS in MB, the report) of one `eyas doctor --json` process."""
    t = time.perf_counter()
    code = ("import resource, json, sys; from eyas.cli import main; sys.argv = ['eyas', 'doctor', sys.argv[1], "
            "'--json']; rc = main(); print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if p.returncode:
        raise SystemExit(p.stderr)
    rss_kb = int(p.stderr.strip().splitlines()[-1])
    return seconds, rss_kb / 1024, json.loads(p.stdout)["logs"][0]


def main() -> None:
    a = parse(DoctorBenchConfig, description=__doc__)
    print(f"bench_doctor: {cpu()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="eyas-bench-doctor-") as d:
        for fmt in a.formats:
            rows = []
            for mb in (a.mb / 10, a.mb):
                path = Path(d) / f"{fmt}-{mb:g}.log"
                size = write_mb(path, fmt, mb)
                seconds, peak, rep = doctor(path)
                rows.append((size, seconds, peak))
                print(f"  {fmt:12s} {size / 1e6:7.1f} MB, {rep['lines']:>10,} lines, {rep['steps_found']:>10,} step "
                      f"records: {seconds:6.1f} s ({size / 1e6 / seconds:5.1f} MB/s), peak RSS {peak:6.0f} MB; "
                      f"verdict {rep['verdict']}, {rep['steps_per_rank']:,} steps per rank")
                path.unlink()
            (s1, t1, m1), (s2, t2, m2) = rows
            print(f"  {fmt:12s} {s2 / s1:.1f}x the bytes: {t2 / t1:.1f}x the time, {m2 / m1:.2f}x the peak memory")
    print(f"bench_doctor: load {os.getloadavg()[0]:.2f} after; peak of this process "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
