"""The data-scaling curve: tau of drafts trained the same way on more or less of the same data, against the tokens
they trained on, read from one evaluation that ran them side by side (`eyas evaluate --baselines CKPT...`).

A point is a draft of that evaluation: the main one (`--draft`) at its longest chain, and every checkpoint among
the baselines (they run at the same chain). Its training tokens are its run's `plan.json` "tokens" (the samples it
trained on, once; `--data-fraction` shrinks them), and its epochs come from there too. The trend is a least-squares
line in log tokens, tau = a + b ln(tokens): what the points say about a run of other size, no more.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

NOT_DRAFTS = ("eagle3", "prompt-lookup", "suffix", "hybrid", "hybrid-suffix", "oracle", "none", "")


@dataclasses.dataclass(frozen=True)
class Point:
    label: str  # the draft's run folder, as the evaluation names it
    tokens: int  # training tokens (each once)
    epochs: int
    tau: float
    config: int  # its index in the results' configs
    plan: Path  # the plan.json its tokens come from


@dataclasses.dataclass(frozen=True)
class Trend:
    a: float
    b: float  # tau gained per e-fold of training tokens

    def tau_at(self, tokens: float) -> float:
        return self.a + self.b * math.log(tokens)

    def tokens_for(self, tau: float) -> float | None:
        """The training tokens the line reaches `tau` at; None when it does not rise."""
        return math.exp((tau - self.a) / self.b) if self.b > 0 else None

    @property
    def per_doubling(self) -> float:
        return self.b * math.log(2)


def points(results: dict, resolve: Callable[[str], Path], read: Callable[[Path], dict | None]) -> list[Point]:
    """The drafts of an evaluation's results.json with known training tokens, fewest tokens first. resolve(path)
    finds a checkpoint folder named in the results; read(file) reads a JSON file (None when it cannot)."""
    configs = list(enumerate(results.get("configs") or []))
    chains = [(j, c) for j, c in configs if c.get("drafter") == "eagle3" and c.get("mode") == "chain"]
    longest = max((c.get("k") or 0 for _, c in chains), default=None)
    drafts = [(results.get("settings", {}).get("draft", ""), j, c) for j, c in chains if c.get("k") == longest]
    drafts += [(c["drafter"], j, c) for j, c in configs if c.get("drafter") not in NOT_DRAFTS]
    out = []
    for path, j, c in drafts:
        plan = plan_file(resolve(path)) if path else None
        doc = (read(plan) if plan else None) or {}
        tokens, tau = doc.get("tokens"), c.get("tau")
        if tokens and tau is not None:
            label = Path(path).parent.name or path
            out.append(Point(label, int(tokens), int(doc.get("epochs") or 0), float(tau), j, plan))
    return sorted(out, key=lambda p: p.tokens)


def trend(pts: list[Point]) -> Trend | None:
    """The least-squares line tau = a + b ln(tokens); None with fewer than two distinct token counts."""
    xs = [math.log(p.tokens) for p in pts]
    if len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(p.tau for p in pts) / len(pts)
    b = sum((x - mx) * (p.tau - my) for x, p in zip(xs, pts)) / sum((x - mx) ** 2 for x in xs)
    return Trend(my - b * mx, b)


def plan_file(checkpoint: Path) -> Path | None:
    """The plan.json of a checkpoint's training run: RUN/final's or RUN/checkpoints/step-N's RUN."""
    return next((run / "plan.json" for run in (checkpoint.parent, checkpoint.parent.parent)
                 if (run / "plan.json").is_file()), None)
