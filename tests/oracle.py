"""An independent oracle for the target's sampling distribution: plain Python, no NumPy.

specrun's ``probabilities()`` is what the engine samples with; an oracle built on it would
share its bugs (a top-p off by one, a min-p step skipped). This is a second, deliberately
simple implementation of the documented order: temperature, then top-k, top-p, min-p, each
followed by renormalising; temperature 0 is a one-hot row at the first largest logit.
The exact joint distribution of a continuation, which the statistical tests compare
against, is built from it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from specrun.sampling import SamplingSettings


def distribution(logits: Sequence[float], settings: SamplingSettings) -> list[float]:
    """The next-token distribution of one row of logits under ``settings``."""
    # a row's own list of Python floats (an array's tolist(): iterating one yields NumPy scalars,
    # and their arithmetic is several times slower)
    logits = [float(value) for value in (logits.tolist() if hasattr(logits, "tolist") else logits)]
    vocab = len(logits)
    if settings.temperature == 0.0:
        best = max(range(vocab), key=lambda token: (logits[token], -token))
        return [1.0 if token == best else 0.0 for token in range(vocab)]
    temperature = settings.temperature
    scaled = [value / temperature for value in logits]
    if 0 < settings.top_k < vocab:
        kth_largest = sorted(scaled, reverse=True)[settings.top_k - 1]
        top = max(scaled)  # the largest is always allowed
        weights = [math.exp(value - top) if value >= kth_largest else 0.0 for value in scaled]
    else:
        top = max(scaled)
        exp = math.exp
        weights = [exp(value - top) for value in scaled]
    probs = _normalise(weights)
    if settings.top_p < 1.0:
        # Most likely first (ties: the lower id first); keep a token while the mass of the
        # tokens before it is still short of top_p, so the one that crosses it is kept.
        kept, mass_before = [0.0] * vocab, 0.0
        for token in sorted(range(vocab), key=lambda t: (-probs[t], t)):
            if mass_before >= settings.top_p:
                break
            kept[token] = probs[token]
            mass_before += probs[token]
        probs = _normalise(kept)
    if settings.min_p > 0.0:
        floor = settings.min_p * max(probs)
        probs = _normalise([p if p >= floor else 0.0 for p in probs])
    return probs


def _normalise(weights: list[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


def exact_joint(
    table: Callable[[tuple[int, ...]], Sequence[float]],
    prompt: Sequence[int],
    n_tokens: int,
    settings: SamplingSettings,
) -> dict[tuple[int, ...], float]:
    """Probability of every ``n_tokens`` continuation of ``prompt`` under the target's own
    sampling, ``table(context)`` giving the target's logits. Sequences of probability 0
    are listed too (a test must never see them)."""
    joint: dict[tuple[int, ...], float] = {}

    def extend(context: tuple[int, ...], prefix: tuple[int, ...], prob: float) -> None:
        if len(prefix) == n_tokens:
            joint[prefix] = prob
            return
        for token, p_token in enumerate(distribution(table(context), settings)):
            extend(context + (token,), prefix + (token,), prob * p_token)

    extend(tuple(prompt), (), 1.0)
    return joint


def joint_of(row: Callable[[tuple[int, ...]], Sequence[float]], prompt: Sequence[int],
             n_tokens: int) -> dict[tuple[int, ...], float]:
    """Probability of every ``n_tokens`` continuation of ``prompt`` that plain decoding can make,
    ``row(context)`` giving its distribution after a context (one a rule of its own shapes: the
    infill rule, penalties, which read the text)."""
    joint: dict[tuple[int, ...], float] = {}

    def extend(prefix: tuple[int, ...], prob: float) -> None:
        if len(prefix) == n_tokens:
            joint[prefix] = prob
            return
        for token, p_token in enumerate(row(tuple(prompt) + prefix)):
            if p_token > 0.0:
                extend(prefix + (token,), prob * p_token)

    extend((), 1.0)
    return joint
