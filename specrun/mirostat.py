"""llama.cpp's mirostat samplers (1 and 2): each row cut by a surprise μ the text carries along.

Mirostat aims the text's surprise (-log2 of each token's probability under the row it was drawn
from) at a target τ. A row, after the temperature, keeps the tokens μ allows: version 2 those
whose surprise is at most μ (the likeliest one where none is), version 1 the k likeliest, k from
μ and the row's Zipf exponent estimated over its likeliest MIROSTAT_M tokens. Each token drawn then
moves μ by η (τ - its surprise): μ starts at 2τ and follows the text (llama.cpp's
src/llama-sampler.cpp; common/sampling.cpp puts only the temperature before it: the truncations,
typical-p, XTC and dynamic temperature are off under it, as there).

μ is a function of the text, each token's row being one: a row verified after drafts is cut at
the μ its own path reaches from its parent's (``moved``; the engine's passes carry the text's μ
from step to step), so rejection sampling accepts from exactly the rows plain decoding draws
from, and speculation stays lossless in distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MIROSTAT_M = 100  # the tokens mirostat 1 estimates the row's Zipf exponent over (llama.cpp's)
MAX_TAU = 100.0  # bits: a surprise a row of 2^100 even tokens would have; no vocabulary comes near
MAX_ETA = 1.0
# the least probability llama.cpp's float32 rows hold: below it a token's is 0 there
LEAST_FLOAT32 = float(np.finfo(np.float32).smallest_subnormal)


@dataclass(frozen=True)
class Mirostat:
    """Mirostat's settings: ``version`` 0 (off), 1 or 2, the target surprise ``tau`` in bits
    (llama.cpp's --mirostat-ent) and the rate ``eta`` μ moves at (--mirostat-lr)."""

    version: int = 0
    tau: float = 5.0
    eta: float = 0.1
    # the μ rows are cut at where none is given them (None: ``start``): the text's, where the engine
    # asks its drafters for drafts (the target's rows are each given the μ of their own path)
    mu: float | None = None

    @property
    def on(self) -> bool:
        return self.version != 0

    @property
    def start(self) -> float:
        """μ before the first token (llama.cpp's reset: 2τ)."""
        return 2.0 * self.tau

    @property
    def drafting_mu(self) -> float:
        """The μ a row is cut at where none is given it (``mu``, else ``start``)."""
        return self.start if self.mu is None else self.mu

    def problems(self) -> list[str]:
        """What is wrong with these settings, as option-named messages (empty if fine)."""
        if self.version not in (0, 1, 2):
            return [f"--mirostat must be 0 (off), 1 or 2, got {self.version}"]
        if not self.on:
            return []
        problems = []
        if not 0.0 <= self.tau <= MAX_TAU:  # NaN too
            problems.append(f"--mirostat-ent must be between 0 and {MAX_TAU:g} bits, got {self.tau}")
        if not 0.0 <= self.eta <= MAX_ETA:
            problems.append(f"--mirostat-lr must be between 0 and {MAX_ETA:g}, got {self.eta}")
        return problems

    def describe(self) -> str:
        return f"mirostat {self.version} (τ {self.tau:.10g}, η {self.eta:.10g})" if self.on else ""

    def fields(self) -> dict:
        return {"version": self.version, "tau": self.tau, "eta": self.eta}


def cut(probs: np.ndarray, mirostat: Mirostat, mus: np.ndarray) -> np.ndarray:
    """Rows ``probs`` (n, V) (after the temperature) cut as mirostat cuts them at each row's μ
    ``mus`` (n,), renormalised, in place; returned."""
    for row, mu in zip(probs, mus):
        if mirostat.version == 2:
            kept = row >= 2.0 ** -mu if mu > -math.inf else np.zeros(len(row), bool)  # surprise <= μ
            if not kept.any():
                kept[row.argmax()] = True  # llama.cpp keeps the likeliest where none is
        else:
            kept = _top_k_kept(row, _mirostat_k(row, mu))
        row[~kept] = 0.0
        row /= row.sum()
    return probs


def moved(mu: float, mirostat: Mirostat, row: np.ndarray, token: int) -> float:
    """μ after ``token`` was drawn from ``row`` (V,) (the distribution mirostat left at μ): moved by
    η (τ - its surprise in bits). A token the row gave nothing takes μ to -inf (no text reaches it)."""
    chance = float(row[token])
    if chance <= 0.0:
        return -math.inf
    return mu - mirostat.eta * (-math.log2(chance) - mirostat.tau)


def _mirostat_k(row: np.ndarray, mu: float) -> int:
    """Mirostat 1's k for a row (V,): from its Zipf exponent s estimated over the likeliest
    MIROSTAT_M tokens (a least-squares fit of log(p_i / p_i+1) on log((i + 2) / (i + 1))), then
    k = (ε 2^μ / (1 - V^-ε))^(1/s), ε = s - 1. At least 1; every token where k is past the row
    (or infinite); 1 where it is undefined: a row of even tokens, and one whose likeliest MIROSTAT_M
    hold a probability of 0 as llama.cpp's float32 holds it (a forbidden token's, one a low
    temperature sends below float32's least), where llama.cpp's fit is infinite or NaN."""
    vocab = len(row)
    top = min(MIROSTAT_M, vocab)
    likeliest = np.sort(np.partition(row, vocab - top)[vocab - top:])[::-1]
    if top < 2 or likeliest[-1] < LEAST_FLOAT32 or mu == -math.inf:
        return 1
    ranks = np.arange(1, len(likeliest))
    t = np.log((ranks + 1) / ranks)
    b = np.log(likeliest[:-1] / likeliest[1:])
    s_hat = float((t * b).sum() / (t * t).sum())
    epsilon = s_hat - 1.0
    with np.errstate(all="ignore"):
        k = float(np.power(np.float64(epsilon) * np.exp2(mu) / (1.0 - np.power(np.float64(vocab), -epsilon)),
                           1.0 / s_hat)) if s_hat > 0.0 else math.nan
    if math.isnan(k):
        return 1
    return max(1, min(vocab, int(k))) if math.isfinite(k) else vocab


def _top_k_kept(row: np.ndarray, k: int) -> np.ndarray:
    """Which tokens of ``row`` (V,) are among its k likeliest (every token tied with the k-th too)."""
    if k >= len(row):
        return np.ones(len(row), bool)
    kth = np.partition(row, len(row) - k)[len(row) - k]
    return row >= kth
