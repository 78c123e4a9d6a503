"""Tabulated fake models for statistical tests: exact distributions, no weights."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from specrun.backends.fake import FakeBackend

COPYING_VOCAB = 50
REPEATING_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12] * 2 + [1, 2, 3]


def hashed_logits(vocab_size: int, salt: int, spread: float = 1.5):
    """A logit table that depends on the whole context, deterministically."""

    @lru_cache(maxsize=None)
    def table(context: tuple[int, ...]) -> np.ndarray:
        rng = np.random.default_rng(abs(hash((salt, context))) % (2**32))
        return (rng.normal(0.0, spread, vocab_size)).astype(np.float32)

    return table


def make_pair(vocab_size: int = 5, spread_target: float = 1.2, spread_draft: float = 1.2):
    target = FakeBackend(hashed_logits(vocab_size, salt=1, spread=spread_target), vocab_size)
    draft = FakeBackend(hashed_logits(vocab_size, salt=2, spread=spread_draft), vocab_size)
    return target, draft


def copying_logits(salt: int, copy_bonus: float = 6.0, vocab_size: int = COPYING_VOCAB):
    """A target that mostly repeats what followed the last token's previous occurrence."""
    noise = hashed_logits(vocab_size, salt, spread=1.5)

    @lru_cache(maxsize=None)
    def table(context: tuple[int, ...]) -> np.ndarray:
        logits = noise(context).copy()
        last = context[-1]
        for i in range(len(context) - 2, -1, -1):
            if context[i] == last:
                logits[context[i + 1]] += copy_bonus
                break
        return logits

    return table


def noisy_copy(salt: int, vocab_size: int = COPYING_VOCAB):
    """A draft model: the copying target plus noise, so it agrees often but not always."""
    target = copying_logits(salt, vocab_size=vocab_size)
    extra = hashed_logits(vocab_size, salt + 100, spread=1.5)
    return lambda context: target(context) + extra(context)
