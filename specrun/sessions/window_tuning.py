"""`specrun tune --window-search`: which windowed cache a draft model drafts fastest with at a long
context, measured on this machine (MagicDec, StreamingLLM: the draft reads its first SINKS tokens
and a recent window, so its cost stops growing with the context; docs/perf.md 3(s)).

The target reads a long prompt once (Python's own ``argparse.py``, which every interpreter ships,
cut to ``context`` tokens); then the draft model with its full cache and with each window of
CANDIDATES smaller than the prompt continues it greedily, the lines interleaved for ``rounds``
rounds, each at the tuned draft length. The window whose median tokens/s is highest is kept in the
pair's tune entry (0: the full cache won), and later runs that leave --window out draft with it
(sessions/setup.tuned_window); --window sets another.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specrun.backends.base import Backend
from specrun.backends.window import SINKS, block_for
from specrun.drafters.methods import build_drafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine

CANDIDATES = (128, 256, 512, 1024)
DEFAULT_CONTEXT = 4096
FULL = "full cache"


@dataclass(frozen=True)
class WindowChoice:
    """The window a search kept (0: the full cache), its sinks, the context it was timed at, and
    each line's median tokens/s ("full cache", "window 256", …)."""

    window: int
    sinks: int
    context: int
    rates: dict[str, float] = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        """The kept line's tokens/s over the full cache's."""
        full = self.rates.get(FULL, 0.0)
        kept = self.rates.get(label(self.window), 0.0)
        return kept / full if full > 0 else 1.0


def label(window: int) -> str:
    return FULL if window == 0 else f"window {window}"


def long_prompt(target: Backend, context: int) -> list[int]:
    """``context`` tokens of Python's ``argparse.py`` (repeated where it is shorter), for ``target``."""
    text = Path(argparse.__file__).read_text(encoding="utf-8")
    ids = target.tokenize(text, add_bos=target.vocab.add_bos)
    while len(ids) < context:
        ids = ids + ids[1 if target.vocab.add_bos else 0 :]
    return ids[:context]


def search_window(target: Backend, draft: Backend, prompt: list[int], max_new_tokens: int, draft_len: int,
                  rounds: int = 2, sinks: int = SINKS,
                  on_progress: Callable[[int, int], None] | None = None) -> WindowChoice:
    """The draft model ``draft`` with its full cache and with each window of CANDIDATES that is
    smaller than ``prompt``, timed continuing it (module docstring)."""
    windows = [window for window in CANDIDATES if sinks + window + block_for(window) < len(prompt)]
    views: dict[str, Backend] = {FULL: draft}
    try:
        for window in windows:
            views[label(window)] = draft.open_window(sinks, window, owns=False)
        engines = {name: SpeculativeEngine(target, build_drafter("draft", view), method="draft")
                   for name, view in views.items()}
        params = GenerationParams(max_new_tokens, max(draft_len, 1), stop_at_eos=False)
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for round_number in range(rounds):
            order = list(engines) if round_number % 2 == 0 else list(engines)[::-1]
            for name in order:
                result = engines[name].run(prompt, params, complete_cache=False)
                rates[name].append(result.stats.tokens_per_second)
            if on_progress is not None:
                on_progress(round_number + 1, rounds)
    finally:
        for name, view in views.items():
            if name != FULL:
                view.close()
    medians = {name: statistics.median(values) for name, values in rates.items()}
    best = max(medians, key=medians.get)
    return WindowChoice(0 if best == FULL else int(best.split()[-1]), sinks, len(prompt), medians)
