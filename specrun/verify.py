"""Acceptance rules: which drafted tokens the target accepts. Pure NumPy.

Every rule takes the drafted tokens and the target's distributions at the
k + 1 verified positions (row i is the target's next-token distribution after
the first i drafted tokens) and returns how many drafts are accepted and the
token the target emits after them: a correction on rejection, or the bonus
token when every draft was accepted. See DESIGN.md, "Acceptance".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specrun.sampling import sample


@dataclass(frozen=True)
class Verdict:
    """The outcome of one verify step: ``n_accepted`` drafts, then ``next_token``."""

    n_accepted: int
    next_token: int


def verify_greedy(draft_tokens: Sequence[int], target_argmax: Sequence[int]) -> Verdict:
    """Temperature 0: accept drafts while they equal the target's argmax.

    draft_tokens: (k,); target_argmax: (k + 1,).
    """
    for i, token in enumerate(draft_tokens):
        if token != target_argmax[i]:
            return Verdict(i, int(target_argmax[i]))
    return Verdict(len(draft_tokens), int(target_argmax[len(draft_tokens)]))


def verify_sampled(
    draft_tokens: Sequence[int],
    p_target: np.ndarray,
    p_draft: Sequence[np.ndarray | None],
    rng: np.random.Generator,
) -> Verdict:
    """Temperature > 0: speculative rejection sampling (Leviathan et al.; Chen et al.).

    p_target: (k + 1, vocab), the target's distributions under the user's settings.
    p_draft: k rows, each the drafter's (vocab,) distribution for that position,
    or None for a deterministic proposal (prompt lookup, n-gram), whose
    distribution is one-hot at the proposed token.
    The emitted tokens are distributed exactly as the target's own samples.
    """
    for i, token in enumerate(draft_tokens):
        p_target_row = p_target[i]
        p_draft_row = p_draft[i]
        accepted, residual = _accept_one(int(token), p_target_row, p_draft_row, rng)
        if not accepted:
            return Verdict(i, sample(residual, rng))
    return Verdict(len(draft_tokens), sample(p_target[len(draft_tokens)], rng))


def _accept_one(
    token: int,
    p_target_row: np.ndarray,
    p_draft_row: np.ndarray | None,
    rng: np.random.Generator,
) -> tuple[bool, np.ndarray]:
    """Accept ``token`` or reject it; on rejection also return the residual to sample from."""
    p_target_x = p_target_row[token]
    if p_draft_row is None:
        # One-hot proposal: accept with p_target(x); else sample p_target without x.
        if rng.random() < p_target_x:
            return True, p_target_row
        residual = p_target_row.copy()
        residual[token] = 0.0
    else:
        # Accept with probability min(1, p_target(x) / p_draft(x)).
        if rng.random() * p_draft_row[token] < p_target_x:
            return True, p_target_row
        residual = np.maximum(p_target_row - p_draft_row, 0.0)
    return False, _normalised(residual, p_target_row)


def _normalised(residual: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    total = residual.sum()
    # A zero residual only arises from rounding when p_target == p_draft; any row is then exact.
    return residual / total if total > 0.0 else fallback


def acceptance_probability(p_target: np.ndarray, p_draft: np.ndarray) -> float:
    """Expected per-token acceptance of rejection sampling: sum(min(p_target, p_draft))."""
    return float(np.minimum(p_target, p_draft).sum())
