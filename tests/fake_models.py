"""Tabulated fake models for statistical tests: exact distributions, no weights."""

from __future__ import annotations

import zlib
from functools import lru_cache

import numpy as np

from specrun.backends.fake import FakeBackend

COPYING_VOCAB = 50
VOCAB = 64  # the simulated-clock fakes' vocabulary (test_adaptive, test_learned)
REPEATING_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12] * 2 + [1, 2, 3]


def hashed_logits(vocab_size: int, salt: int, spread: float = 1.5):
    """A logit table that depends on the whole context, deterministically."""

    @lru_cache(maxsize=None)
    def table(context: tuple[int, ...]) -> np.ndarray:
        rng = np.random.default_rng(abs(hash((salt, context))) % (2**32))
        return (rng.normal(0.0, spread, vocab_size)).astype(np.float32)

    return table


def hidden_table(vocab_size: int, hidden_size: int = 8, seed: int = 0):
    """A hidden-state table for FakeBackend: a fixed random projection (seeded) of the one-hots
    of a context's last two tokens, so states differ by token and by what precedes it."""
    projection = np.random.default_rng(seed).normal(0.0, 1.0, (2 * vocab_size, hidden_size)).astype(np.float32)

    def table(context: tuple[int, ...]) -> np.ndarray:
        state = projection[vocab_size + context[-1]].copy()  # (H,) the last token's
        if len(context) > 1:
            state += projection[context[-2]]
        return state

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


# ---- fakes on a simulated clock: set costs, set acceptance ----------------------------
class SimClock:
    """Simulated seconds: fake backends advance it by their set costs."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CostedFake(FakeBackend):
    """A fake whose forward pass costs ``base + per_token * n`` simulated seconds."""

    def __init__(self, table, clock: SimClock, base: float, per_token: float, vocab_size: int = VOCAB,
                 **hidden) -> None:
        super().__init__(table, vocab_size, n_ctx=100_000, **hidden)  # hidden: FakeBackend's hidden_table, hidden_size
        self.clock, self.base, self.per_token = clock, base, per_token

    def forward(self, tokens, logit_rows):
        self.clock.now += self.base + self.per_token * len(tokens)
        return super().forward(tokens, logit_rows)

    def forward_tree(self, tokens, tree, logit_rows):
        self.clock.now += self.base + self.per_token * (len(tokens) + len(tree))
        return super().forward_tree(tokens, tree, logit_rows)


def agreeing_draft(target_table, alpha: float):
    """Greedy agreement with the target exactly ``alpha`` of the time, decided per context."""

    def table(context):
        logits = target_table(context).copy()
        # crc32, not hash(): str hashing is salted per process, and the test must not depend on it.
        coin = np.random.default_rng(zlib.crc32(repr(("agree", context)).encode())).random()
        if coin >= alpha:  # disagree: make the target's runner-up the draft's top choice
            order = np.argsort(logits)
            logits[order[-2]] = logits[order[-1]] + 1.0
        return logits

    return table
