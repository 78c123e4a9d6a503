"""For ``ab_commits.py --patch-after``: side B's auto drafts with the demo target's shipped EAGLE
heads on every prompt, whatever ``heads_pay`` predicts (what asking idle heads costs auto).

    .venv/bin/python benchmarks/ab_commits.py --before HEAD --after HEAD --methods auto --repeats 4 \\
        --spec-bench-per-category 3 --patch-after benchmarks/patches/auto_heads_always.py
"""

from specrun.drafters.methods import DrafterOptions, build_drafter as _build_drafter
from specrun.heads.files import load_heads
from specrun.registry.heads import shipped_heads_path

_HEADS = load_heads(shipped_heads_path("demo-target", "eagle"))


def build_drafter(method, draft, options=None):  # rebinds the worker's own name (ab_commits.WORKER)
    if method != "auto":
        return _build_drafter(method, draft, options)
    return _build_drafter(method, draft, DrafterOptions(heads=_HEADS, auto_heads="eagle"))
