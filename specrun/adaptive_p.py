"""llama.cpp's adaptive-p sampler: each row reshaped to favour the tokens whose probability is near a
target, the target adapted by an average of the chosen tokens' probabilities the text carries.

After the rest of the chain, a row's candidates (the tokens it left with a finite logit) take new
logits 5 - 10 d² / (1 + d), d = |p - t'| / 0.3, and the row is their softmax; t' = 2 t - the
average, clamped to [0, 1], so a text whose tokens were likelier than the target t is pushed to
less likely ones. The average is an exponential one (``decay``) of each chosen token's probability
before the reshaping, starting at t (llama.cpp's src/llama-sampler.cpp, PR 17927). It is on only
where its target is 0 or more and a samplers list names it (llama-server's ``samplers``; specrun's
--adaptive-target puts it last).

Like mirostat's μ, the average is a function of the text: a row verified after drafts is reshaped
at the average its own path reaches (engine/passes.py), so speculation stays lossless in
distribution. Not beside XTC: the average would follow the row XTC's coin left, which no text says.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PEAK_LOGIT = 5.0
SHARPNESS = 10.0
WIDTH = 0.3
MAX_DECAY = 0.99  # llama.cpp's: the average's history is about 1 / (1 - decay) tokens


@dataclass(frozen=True)
class AdaptiveP:
    """adaptive-p's settings: its ``target`` probability (below 0: off) and the ``decay`` of its
    average; ``state``: the average (its weighted sum and total weight) rows are reshaped at where
    none is given them (None: ``start``), the text's where the engine asks its drafters for drafts."""

    target: float = -1.0
    decay: float = 0.9
    state: tuple[float, float] | None = None

    @property
    def on(self) -> bool:
        return self.target >= 0.0

    @property
    def start(self) -> tuple[float, float]:
        """The average before the first token (llama.cpp's reset): the target, as if always met."""
        return self.target / (1.0 - self.decay), 1.0 / (1.0 - self.decay)

    @property
    def drafting_state(self) -> tuple[float, float]:
        return self.start if self.state is None else self.state

    def problems(self) -> list[str]:
        """What is wrong with these settings, as option-named messages (empty if fine)."""
        if not self.target <= 1.0:  # NaN too
            return [f"--adaptive-target must be at most 1 (below 0: off), got {self.target}"]
        if self.on and not 0.0 <= self.decay <= MAX_DECAY:
            return [f"--adaptive-decay must be between 0 and {MAX_DECAY:g}, got {self.decay}"]
        return []

    def describe(self) -> str:
        return f"adaptive-p {self.target:.10g} (decay {self.decay:.10g})" if self.on else ""

    def fields(self) -> dict:
        return {"target": self.target, "decay": self.decay}


def reshaped(probs: np.ndarray, adaptive: AdaptiveP, states: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """Rows ``probs`` (n, V) (the rest of the chain's) reshaped at each row's average ``states``
    (n, 2: weighted sum, total weight), over its ``candidates`` (n, V bool; the others stay out): a
    new array."""
    sums, weights = states[:, 0], states[:, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        adapted = np.where(weights == 0.0, adaptive.target, 2.0 * adaptive.target - sums / weights)
    adapted = np.clip(adapted, 0.0, 1.0)
    out = np.zeros_like(probs)
    for row, kept, target, shaped in zip(probs, candidates, adapted, out):
        taken = np.flatnonzero(kept)  # the candidates alone: after a truncation, a few of a vocabulary
        distance = np.abs(row[taken] - target) / WIDTH
        logits = PEAK_LOGIT - SHARPNESS * distance * distance / (1.0 + distance)
        weights = np.exp(logits - logits.max())
        shaped[taken] = weights / weights.sum()
    return out


def moved(state: tuple[float, float], adaptive: AdaptiveP, original: np.ndarray, token: int) -> tuple[float, float]:
    """The average after ``token``, whose probability before the reshaping was ``original[token]``."""
    weighted_sum, total_weight = state
    return float(original[token]) + adaptive.decay * weighted_sum, 1.0 + adaptive.decay * total_weight
