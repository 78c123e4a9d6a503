"""What the benchmark scripts share: where the Spec-Bench prompts are, and writing their report."""

from __future__ import annotations

import json
from pathlib import Path

# ../shared beside the checkout (never copied into the project)
SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


def write_report(path: Path | None, report: dict) -> None:
    """Write ``report`` as indented JSON to ``path`` (creating its folder); nothing when None."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
