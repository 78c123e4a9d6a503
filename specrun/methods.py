"""Speculation methods by name: what ``--method`` accepts and the drafter each builds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specrun.backends.base import Backend
from specrun.drafters.base import Drafter
from specrun.drafters.draft_model import DraftModelDrafter
from specrun.errors import UsageError

METHODS = ("none", "draft")


@dataclass(frozen=True)
class DrafterOptions:
    """Settings of the draft-free drafters (used by lookup and ngram methods)."""

    ngram_cache: Path | None = None


def needs_draft_model(method: str) -> bool:
    return method == "draft" or method.endswith("+draft")


def check_method(method: str) -> None:
    if method not in METHODS:
        raise UsageError(f"unknown method {method!r}", f"use one of: {', '.join(METHODS)}")


def build_drafter(method: str, draft: Backend | None, options: DrafterOptions | None = None) -> Drafter | None:
    """The drafter for ``method``; ``draft`` is the loaded draft model when the method needs one."""
    check_method(method)
    if method == "none":
        return None
    if draft is None:
        raise UsageError(f"method {method!r} needs a draft model", "pass --draft MODEL")
    return DraftModelDrafter(draft)
