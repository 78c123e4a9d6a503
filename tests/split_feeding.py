"""A streamed answer's reader (sessions/reasoning.py's ReasoningSplit, sessions/harmony.py's
HarmonySplit) fed a text cut at random points, as a stream cuts it."""

from __future__ import annotations

import random


def fed_in_pieces(split, text: str, rng: random.Random, longest: int) -> tuple[str, str]:
    """(thinking, answer) the split gives for ``text`` fed in pieces of 1 to ``longest``
    characters, then finished."""
    thought, answer, at = [], [], 0
    while at < len(text):
        step = rng.randint(1, longest)
        got = split.feed(text[at:at + step])
        thought.append(got[0])
        answer.append(got[1])
        at += step
    held = split.finish()
    return "".join(thought) + held[0], "".join(answer) + held[1]
