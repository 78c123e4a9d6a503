"""What a reader of streamed answer text holds back: the end of a piece that may begin a tag."""

from __future__ import annotations


def held_prefix(text: str, tag: str) -> int:
    """How many characters at ``text``'s end could begin ``tag`` (held back until the next piece)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
