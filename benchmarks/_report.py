"""What the benchmark scripts share: where the Spec-Bench prompts are, a ratio's interval, and writing their report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# The Spec-Bench question set (Apache-2.0) in a data folder beside the checkout, the
# benchmarks' default --prompts; never copied into the project (docs/measuring.md).
SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


def write_report(path: Path | None, report: dict) -> None:
    """Write ``report`` as indented JSON to ``path`` (creating its folder); nothing when None."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))


def geometric_mean_interval(ratios: list[float], draws: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """The geometric mean of ``ratios`` and a 90% bootstrap interval (prompts resampled)."""
    logs = np.log(np.asarray(ratios))
    means = np.random.default_rng(seed).choice(logs, size=(draws, len(logs))).mean(axis=1)
    low, high = np.quantile(means, [0.05, 0.95])
    return float(np.exp(logs.mean())), float(np.exp(low)), float(np.exp(high))
