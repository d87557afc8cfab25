"""bench/gpu_check.py, the prepared GPU check, runs here at toy sizes on the CPU (`--device cpu --tiny`), so that
the script a lent GPU runs cannot rot: every stage runs, and speculative decoding equals greedy token for token."""

import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"


def test_the_gpu_check_runs_on_a_cpu_at_toy_sizes():
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--tiny", "--steps", "2"],
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, (out + proc.stderr)[-3000:]
    assert out.startswith("gpu_check: torch ")
    assert "[1] extraction: " in out and " of it" in out
    assert "[2] train (SmolLM2 shape): " in out and " tokens/s, MFU n/a" in out
    assert "[3] speculative decoding = greedy, token for token: yes (3 prompts x 16 tokens" in out, out
    assert "[4] train (8B shape): " in out and "gpu_check: done" in out
    assert time.monotonic() - t0 < 180  # CI's budget for it
