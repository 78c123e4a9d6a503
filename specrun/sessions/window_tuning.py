"""`specrun tune --window-search`: which windowed cache a draft model drafts fastest with at a long
context, measured on this machine (MagicDec, StreamingLLM: the draft reads its first SINKS tokens
and a recent window, so its cost stops growing with the context; docs/perf.md 3(s)).

The target reads a long prompt once (Python's own ``argparse.py``, which every interpreter ships,
cut to ``context`` tokens, in the model's chat template with a question about it: long_prompt);
then the draft model with its full cache and with each window of CANDIDATES smaller than the
prompt continues it greedily, the lines interleaved for ``rounds`` rounds, each at the tuned
draft length. A window wins only where every round of it beat every round of the full cache (the
fastest such by its median): a window costs acceptance on some prompts, so one within the
rounds' own spread of the full cache is not worth keeping (one run of session 44 kept window 1,024
at 15.0 tokens/s against the full cache's 13.9, two rounds a line). Where a window wins and the
sinks were not given, the
kept window is timed again beside SINK_CANDIDATES' other sink counts (StreamingLLM's 4 are a
guess for a model it never saw: how many first tokens a model's attention leans on is the
model's), the lines interleaved as before. What wins is kept in the pair's tune entry (0: the
full cache won), and later runs that leave --window out draft with it (sessions/setup.tuned_window);
--window sets another.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specrun.backends.base import Backend
from specrun.backends.window import SINKS, block_for
from specrun.drafters.methods import build_drafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine

CANDIDATES = (128, 256, 512, 1024)
SINK_CANDIDATES = (4, 16, 64)
DEFAULT_CONTEXT = 4096
FULL = "full cache"
Progress = Callable[[str, int, int], None]  # (what is timed: "window" or "sinks", rounds done, rounds)


@dataclass(frozen=True)
class WindowChoice:
    """The window a search kept (0: the full cache), its sinks, the context it was timed at, each
    line's median tokens/s ("full cache", "window 256", then "window 256 (16 sinks)", …), and the
    kept line's speed over the full cache's (a sinks stage's ratio to its window's first line,
    times that line's to the full cache's)."""

    window: int
    sinks: int
    context: int
    rates: dict[str, float] = field(default_factory=dict)
    speedup: float = 1.0


def label(window: int, sinks: int | None = None) -> str:
    if window == 0:
        return FULL
    return f"window {window}" if sinks is None else f"window {window} ({sinks} sinks)"


def long_prompt(target: Backend, context: int) -> list[int]:
    """``context`` tokens for ``target``: Python's ``argparse.py`` (repeated where it is shorter)
    handed to the model's chat template with QUESTION after it, as a user asks about a long
    document; the file's text alone (continued as code) where the model has no chat template.

    The question matters: continuing code leans on the last few hundred tokens, and a search on
    it kept a 128-256-token window that, asked about a document, accepted 57% of its drafts
    after 7,900 tokens against the full cache's 94% (docs/perf.md 3(s))."""
    text = Path(argparse.__file__).read_text(encoding="utf-8")
    document = target.tokenize(text, add_bos=False)
    before, after = _chat_around(target)
    room = context - len(before) - len(after)
    if room < context // 2:  # no template, or one that leaves the document too little room
        before, after = ([target.vocab.bos_id] if target.vocab.add_bos else []), []
        room = context - len(before)
    ids = document
    while len(ids) < room:
        ids = ids + document
    return before + ids[:room] + after


QUESTION = "Explain what the Python code above does: its main classes, what each one is for, and how they work together."
_MARK = "\u2063DOCUMENT\u2063"  # where the document goes in the rendered conversation


def _chat_around(target: Backend) -> tuple[list[int], list[int]]:
    """The target's chat template around a document: the ids before it (a BOS among them where
    the model takes one) and after it (QUESTION and the assistant's turn); ([], []) without one."""
    from specrun.errors import ChatTemplateError
    from specrun.sessions.templates import ChatTemplate, tokenize_chat, tokenize_rendered

    try:
        template = ChatTemplate.for_backend(target)
        if template.is_fallback:
            return [], []
        rendered = template.render([{"role": "user", "content": f"{_MARK}\n\n{QUESTION}"}])
    except ChatTemplateError:
        return [], []
    head, mark, tail = rendered.partition(_MARK)
    if not mark:
        return [], []
    # the template's own markers become control tokens, the BOS is written once (as chat prompts are)
    return tokenize_rendered(target, template, head, []), tokenize_chat(target, tail, [], add_bos=False)


def search_window(target: Backend, draft: Backend, prompt: list[int], max_new_tokens: int, draft_len: int,
                  rounds: int = 2, sinks: int = SINKS, sink_candidates: Sequence[int] = (),
                  on_progress: Progress | None = None) -> WindowChoice:
    """The draft model ``draft`` with its full cache and with each window of CANDIDATES that is
    smaller than ``prompt`` at ``sinks`` sinks, timed continuing it; then, where a window won,
    that window with each other count of ``sink_candidates`` (module docstring)."""
    fits = [window for window in CANDIDATES if sinks + window + block_for(window) < len(prompt)]
    params = GenerationParams(max_new_tokens, max(draft_len, 1), stop_at_eos=False)
    lines = {FULL: None, **{label(window): (sinks, window) for window in fits}}

    def report(stage: str) -> Callable[[int], None]:
        return (lambda done: on_progress(stage, done, rounds)) if on_progress is not None else (lambda done: None)

    timed = _timed(target, draft, prompt, params, lines, rounds, report("window"))
    rates = _medians(timed)
    best = _clear_winner(timed, FULL)
    window = 0 if best == FULL else lines[best][1]
    speedup = rates[best] / rates[FULL] if rates[FULL] > 0 else 1.0
    others = [count for count in sink_candidates if count != sinks and count + window + block_for(window) < len(prompt)]
    if not window or not others:
        return WindowChoice(window, sinks, len(prompt), rates, speedup)
    lines = {label(window, count): (count, window) for count in (sinks, *others)}
    timed = _timed(target, draft, prompt, params, lines, rounds, report("sinks"))
    stage = _medians(timed)
    kept = _clear_winner(timed, label(window, sinks))
    first = stage[label(window, sinks)]
    return WindowChoice(window, lines[kept][0], len(prompt), {**rates, **stage},
                        speedup * (stage[kept] / first if first > 0 else 1.0))


def _medians(timed: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in timed.items()}


def _clear_winner(timed: dict[str, list[float]], default: str) -> str:
    """The line with the best median among those whose every round beat every round of
    ``default``'s; ``default`` where none did."""
    bar = max(timed[default])
    clear = {name: statistics.median(values) for name, values in timed.items()
             if name != default and min(values) > bar}
    return max(clear, key=clear.get) if clear else default


def _timed(target: Backend, draft: Backend, prompt: list[int], params: GenerationParams,
           lines: dict[str, tuple[int, int] | None], rounds: int, done: Callable[[int], None]) -> dict[str, list[float]]:
    """Each line's tokens/s continuing ``prompt``, a round each: the draft with its full cache
    (None) or with a window of (sinks, window), interleaved over ``rounds`` rounds (every other one
    reversed)."""
    views: dict[str, Backend] = {}
    try:
        for name, shape in lines.items():
            views[name] = draft if shape is None else draft.open_window(*shape, owns=False)
        engines = {name: SpeculativeEngine(target, build_drafter("draft", view), method="draft")
                   for name, view in views.items()}
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for round_number in range(rounds):
            order = list(engines) if round_number % 2 == 0 else list(engines)[::-1]
            for name in order:
                result = engines[name].run(prompt, params, complete_cache=False)
                rates[name].append(result.stats.tokens_per_second)
            done(round_number + 1)
    finally:
        for name, view in views.items():
            if view is not draft:
                view.close()
    return rates
