"""Tabulated fake models for statistical tests: exact distributions, no weights."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from specrun.backends.fake import FakeBackend
from specrun.sampling import SamplingSettings, probabilities


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


def exact_joint(table, prompt: Sequence[int], n_tokens: int, vocab_size: int, sampling: SamplingSettings):
    """Exact probability of every n_tokens continuation under the target's own sampling."""
    joint = {}
    for seq in itertools.product(range(vocab_size), repeat=n_tokens):
        prob = 1.0
        context = tuple(prompt)
        for token in seq:
            prob *= probabilities(table(context), sampling)[token]
            context = context + (token,)
        joint[seq] = prob
    return joint
