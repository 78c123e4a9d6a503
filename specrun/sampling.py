"""Sampling settings and the one function that turns logits into a distribution.

The same function is applied to the target's and the drafter's logits, so both
distributions mean "the model under the user's settings" (docs/design.md).
Order: temperature, then top-k, top-p, min-p, then renormalise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# The largest --seed: a signed 64-bit integer, what the server's "seed" field and heads train take
# (numpy's generator would take any size; a seed one command takes, the others should take too).
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingSettings:
    """The user's sampling settings. temperature == 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> list[str]:
        """Problems with these settings, as option-named messages (empty if fine)."""
        problems = []
        if not (0.0 <= self.temperature <= 100.0):
            problems.append(f"--temp must be between 0 and 100, got {self.temperature}")
        if self.top_k < 0:
            problems.append(f"--top-k must be 0 (off) or positive, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            problems.append(f"--top-p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p < 1.0):
            problems.append(f"--min-p must be in [0, 1), got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            problems.append(f"--seed must be between 0 and {MAX_SEED}, got {self.seed}")
        return problems

    def describe(self) -> str:
        """In words, for a table's footnote: ``greedy``, or the temperature and each option that is on."""
        if self.greedy:
            return "greedy"
        said = [f"temperature {self.temperature:.10g}"]
        if self.top_k:
            said.append(f"top-k {self.top_k}")
        if self.top_p < 1.0:
            said.append(f"top-p {self.top_p:.10g}")
        if self.min_p > 0.0:
            said.append(f"min-p {self.min_p:.10g}")
        if self.seed is not None:
            said.append(f"seed {self.seed}")
        return ", ".join(said)

    def fields(self) -> dict:
        """For a trace's header: the temperature, and the options that are on."""
        fields = {"temperature": self.temperature}
        if not self.greedy:
            fields.update({name: value for name, value, off in (("top_k", self.top_k, 0), ("top_p", self.top_p, 1.0),
                                                                ("min_p", self.min_p, 0.0), ("seed", self.seed, None))
                           if value != off})
        return fields


def top_probability(logits: np.ndarray) -> float:
    """The largest probability of softmax(logits) at temperature 1: the model's confidence."""
    logits = np.asarray(logits, dtype=np.float64)  # (V,)
    finite = logits[np.isfinite(logits)]
    if finite.size == 0:
        return 0.0
    return float(1.0 / np.exp(finite - finite.max()).sum())


def probabilities(logits: np.ndarray, settings: SamplingSettings) -> np.ndarray:
    """Row-wise next-token distributions under ``settings``.

    logits: (n, vocab) or (vocab,). Returns float64 of the same shape, rows sum to 1.
    Greedy settings give a one-hot row at the argmax.
    """
    logits = np.asarray(logits, dtype=np.float64)
    squeeze = logits.ndim == 1
    rows = logits[None, :] if squeeze else logits  # (n, V)
    if settings.greedy:
        out = np.zeros_like(rows)
        out[np.arange(len(rows)), rows.argmax(axis=-1)] = 1.0
        return out[0] if squeeze else out

    # One buffer carried through in place: a new array of a vocabulary's rows costs its page faults
    # (9 rows of 49k: ~1.5 ms each), more than the arithmetic on it.
    probs = rows / settings.temperature  # (n, V): the scaled logits, then their probabilities
    vocab = probs.shape[-1]
    if 0 < settings.top_k < vocab:  # chosen on the scaled logits (a shift by the top could tie two)
        kth = np.partition(probs, vocab - settings.top_k, axis=-1)[:, vocab - settings.top_k]
        kept = probs >= kth[:, None]
    # the reductions called directly (what .max and .sum call): a step samples from small rows too
    probs -= np.maximum.reduce(probs, axis=-1, keepdims=True)
    if 0 < settings.top_k < vocab:
        # exp only where top-k keeps a token (exp(-inf) takes a slow path: 9 ms for 9 rows of 49k)
        weights = np.exp(probs[kept])
        probs.fill(0.0)
        probs[kept] = weights
    else:
        np.exp(probs, out=probs)
    probs /= np.add.reduce(probs, axis=-1, keepdims=True)
    if settings.top_p < 1.0:
        _top_p(probs, settings.top_p)
    if settings.min_p > 0.0:
        probs[probs < settings.min_p * probs.max(axis=-1, keepdims=True)] = 0.0
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs[0] if squeeze else probs


def _top_p(probs: np.ndarray, top_p: float) -> None:
    """Keep, in place, the smallest set of most likely tokens of each row of ``probs`` (n, V)
    whose mass reaches top_p, renormalised.

    Exactly what sorting each whole row (stable, likeliest first) and summing it in that order
    keeps, without sorting a whole vocabulary: the tokens kept are a prefix of that order, so each
    row sorts only its likeliest candidates (``_kept_prefix``), widening them until the mass before
    the last one reaches top_p. Rows no longer than the candidates' first widening are sorted
    whole, all at once (a small vocabulary: the per-row calls would cost more than the sort)."""
    if probs.shape[-1] <= TOP_P_CANDIDATES * 8:
        # zero tokens sort last and weigh nothing: kept or not, they stay 0
        order = np.argsort(-probs, axis=-1, kind="stable")  # (n, V)
        at = (np.arange(len(probs))[:, None], order)  # indexed directly: take_along_axis's own set-up costs more
        ranked = probs[at]  # (n, V), likeliest first
        mass_before = ranked.cumsum(axis=-1) - ranked  # (n, V)
        ranked[mass_before >= top_p] = 0.0
        probs[at] = ranked
    else:
        for row in probs:
            kept = _kept_prefix(row, top_p)
            weights = row[kept]
            row.fill(0.0)
            row[kept] = weights
    probs /= probs.sum(axis=-1, keepdims=True)


TOP_P_CANDIDATES = 64  # a row's likeliest tokens sorted first; eight times more each time they fall short


def _kept_prefix(row: np.ndarray, top_p: float) -> np.ndarray:
    """The indices of ``row`` (V,) that top-p keeps. The candidates are every token at least as
    likely as the m-th likeliest (ties included), in index order: the first tokens of the row's
    stable descending order, in that order once sorted stably, with the same running sums (a
    cumulative sum adds left to right). The mass before a token never falls along that order (it
    adds non-negative terms, each no larger than the last), so once the last candidate's reaches
    top_p no later token is kept. Zero tokens come last and weigh nothing: never candidates."""
    positive = np.flatnonzero(row > 0.0)
    values = row[positive]
    wanted = TOP_P_CANDIDATES
    while True:
        order = _likeliest(values, wanted)
        ranked = values[order]
        mass_before = np.cumsum(ranked) - ranked
        kept = mass_before < top_p  # the token that crosses top_p is kept
        # a row with no positive token (all NaN) keeps nothing: NaN after renormalising, as above
        if len(order) == len(values) or not kept[-1]:
            return positive[order[kept]]
        wanted *= 8


def _likeliest(values: np.ndarray, wanted: int) -> np.ndarray:
    """Indices of the first tokens of ``values``' stable descending order (V,), as sorting all of
    it puts them: at least the ``wanted`` likeliest, every token tied with the last of them too
    (taken in index order, then sorted stably, they keep that order). All of them where ``wanted``
    is over an eighth of the row (a partial sort would save little)."""
    if wanted * 8 <= len(values):
        kth = np.partition(values, len(values) - wanted)[len(values) - wanted]
        chosen = np.flatnonzero(values >= kth)
    else:
        chosen = np.arange(len(values))
    return chosen[np.argsort(-values[chosen], kind="stable")]


def token_logprobs(logits: np.ndarray, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The log-probability of ``token`` under softmax(logits) (V,), the model's own distribution at
    temperature 1 (after a grammar's mask, where a run has one), and the ``top`` likeliest tokens
    with theirs, likeliest first."""
    logits = np.asarray(logits, dtype=np.float64)
    finite_max = logits[np.isfinite(logits)].max()
    log_norm = finite_max + np.log(np.exp(logits - finite_max).sum())
    log_probs = logits - log_norm  # (V,), -inf where masked
    best = _likeliest(log_probs, top)[:top] if top > 0 else ()  # a whole vocabulary unsorted: 6 ms at 49k
    return float(log_probs[token]), tuple((int(t), float(log_probs[t])) for t in best)


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from a (vocab,) distribution."""
    cdf = np.asarray(probs).cumsum()  # the array's own methods: np.cumsum's dispatch costs more on a small row
    index = int(cdf.searchsorted(rng.random() * cdf[-1], side="right"))
    return min(index, len(cdf) - 1)
