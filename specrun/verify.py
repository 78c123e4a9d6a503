"""Acceptance rules: which drafted tokens the target accepts. Pure NumPy.

Every rule takes the drafted tokens and the target's distributions at the
k + 1 verified positions (row i is the target's next-token distribution after
the first i drafted tokens) and returns how many drafts are accepted and the
token the target emits after them: a correction on rejection, or the bonus
token when every draft was accepted. See docs/design.md, "Acceptance".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specrun.sampling import sample
from specrun.tree import TokenTree


@dataclass(frozen=True)
class Verdict:
    """The outcome of one verify step: ``n_accepted`` drafts, then ``next_token``."""

    n_accepted: int
    next_token: int

    @property
    def path(self) -> range:
        """The accepted drafts as node indices, as a TreeVerdict gives them (a chain's prefix)."""
        return range(self.n_accepted)


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


def verify_block(
    draft_tokens: Sequence[int],
    p_target: np.ndarray,
    p_draft: Sequence[np.ndarray | None],
    rng: np.random.Generator,
) -> Verdict:
    """Temperature > 0: block verification (Sun, Mendlovic, Leviathan et al. 2024, Algorithm 2).

    Takes the arguments of ``verify_sampled`` and is exact like it, but decides the block as a
    whole: it never accepts fewer drafts in expectation, and more wherever a draft the target
    finds less likely than the drafter is followed by ones it finds likelier. Each prefix of i
    drafts is kept with probability h_i (``block_keep_chances``) and the last one kept wins
    (none: n = 0). The token after n < k kept drafts comes from
    norm(max(0, weight_n p_target_n - p_draft_n)); after all k, from p_target_k.
    """
    k = len(draft_tokens)
    if k == 0:  # a plain step: the target's own draw (rng.random(0) below would draw nothing)
        return Verdict(0, sample(p_target[0], rng))
    keep, weights = block_keep_chances(draft_tokens, p_target, p_draft)
    kept = np.flatnonzero(rng.random(k) < keep)
    n_accepted = int(kept[-1]) + 1 if len(kept) else 0
    if n_accepted == k:
        return Verdict(k, sample(p_target[k], rng))
    weight = weights[n_accepted - 1] if n_accepted else 1.0
    residual = _shortfall(int(draft_tokens[n_accepted]), p_target[n_accepted], p_draft[n_accepted], weight)
    return Verdict(n_accepted, sample(_normalised(residual, p_target[n_accepted]), rng))


def block_keep_chances(
    draft_tokens: Sequence[int], p_target: np.ndarray, p_draft: Sequence[np.ndarray | None]
) -> tuple[np.ndarray, np.ndarray]:
    """Block verification's h_i and weights p_i for the prefixes of i = 1..k drafts, both (k,).

    weight_i = min(1, weight_{i-1} p_target_i(x_i) / p_draft_i(x_i)), weight_0 = 1: how much of
    the drafted prefix the target still vouches for. h_i = r_i / (r_i + 1 - weight_i), with
    r_i = sum(max(0, weight_i p_target_{i+1} - p_draft_{i+1})) the mass the weighted target
    leaves at the next position and 1 - weight_i what the prefix has lost; h_k = weight_k.
    Verification keeps n = the last i with u_i < h_i, so P(n = t) = h_t prod_{i > t} (1 - h_i)."""
    k = len(draft_tokens)
    keep, weights = np.zeros(k), np.zeros(k)
    weight = 1.0
    for i, token in enumerate(draft_tokens):
        p_draft_x = 1.0 if p_draft[i] is None else p_draft[i][token]
        weight = min(1.0, weight * p_target[i][token] / p_draft_x)
        weights[i] = weight
        if weight <= 0.0:
            break  # every later weight and h is 0
        if i + 1 < k:
            left = _shortfall(int(draft_tokens[i + 1]), p_target[i + 1], p_draft[i + 1], weight).sum()
            lost = left + 1.0 - weight
            # Nothing left and nothing lost: no residual to sample at this position, never stop here.
            keep[i] = left / lost if lost > 0.0 else 0.0
        else:
            keep[i] = weight
    return keep, weights


def _accept_one(
    token: int,
    p_target_row: np.ndarray,
    p_draft_row: np.ndarray | None,
    rng: np.random.Generator,
) -> tuple[bool, np.ndarray]:
    """Accept ``token`` or reject it; on rejection also return the residual to sample from."""
    p_target_x = p_target_row[token]
    # Accept with probability min(1, p_target(x) / p_draft(x)); one-hot p_draft(x) = 1.
    if rng.random() * (1.0 if p_draft_row is None else p_draft_row[token]) < p_target_x:
        return True, p_target_row
    return False, _residual(token, p_target_row, p_draft_row)


def _residual(token: int, p_target_row: np.ndarray, p_draft_row: np.ndarray | None) -> np.ndarray:
    """norm(max(0, p_target - p_draft)): p_target without ``token`` for a one-hot proposal."""
    return _normalised(_shortfall(token, p_target_row, p_draft_row), p_target_row)


def _shortfall(
    token: int, p_target_row: np.ndarray, p_draft_row: np.ndarray | None, weight: float = 1.0
) -> np.ndarray:
    """max(0, weight p_target - p_draft) (vocab,), unnormalised; p_draft one-hot at ``token``
    where None (weight <= 1, so that entry is 0 and the rest is weight p_target)."""
    if p_draft_row is None:
        shortfall = weight * p_target_row
        shortfall[token] = 0.0
        return shortfall
    return np.maximum(weight * p_target_row - p_draft_row, 0.0)


def _normalised(residual: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    total = residual.sum()
    # A zero residual only arises from rounding when p_target == p_draft; any row is then exact.
    return residual / total if total > 0.0 else fallback


def acceptance_probability(p_target: np.ndarray, p_draft: np.ndarray) -> float:
    """Expected per-token acceptance of rejection sampling: sum(min(p_target, p_draft))."""
    return float(np.minimum(p_target, p_draft).sum())


# ---- lossy acceptance ----------------------------------------------------------------
# Relaxed rules judge a draft by the target's probability of it alone. They accept more drafts
# than the exact rules and the text is no longer the target's own: off unless asked for, and
# labelled lossy wherever they are on (docs/design.md, "Relaxed acceptance").

EXACT = "exact"  # the lossless rules above, as the acceptance of a run is labelled (Stats.acceptance)
ACCEPTANCE_RULES = (EXACT, "typical", "margin")
LOSSY_RULES = ACCEPTANCE_RULES[1:]
# Medusa's defaults (Cai et al. 2024; posterior_threshold and posterior_alpha in its code): delta
# about sqrt(epsilon).
TYPICAL_EPSILON = 0.09
TYPICAL_DELTA = 0.3
MARGIN_FACTOR = 2.0  # a draft at least half as likely as the target's top token


@dataclass(frozen=True)
class LossyAcceptance:
    """A lossy acceptance rule and its settings: ``"typical"`` (``typical_accepts``, epsilon and
    delta) or ``"margin"`` (``margin_accepts``, factor)."""

    rule: str
    epsilon: float = TYPICAL_EPSILON
    delta: float = TYPICAL_DELTA
    factor: float = MARGIN_FACTOR

    @property
    def label(self) -> str:
        """How outputs made with it say so: ``"typical (lossy)"``."""
        return f"{self.rule} (lossy)"

    def validate(self) -> list[str]:
        """Problems with these settings, as option-named messages (empty if fine)."""
        problems = []
        if self.rule not in LOSSY_RULES:
            problems.append(f"--accept must be one of {', '.join(ACCEPTANCE_RULES)}, got {self.rule!r}")
        if not 0.0 < self.epsilon < 1.0:
            problems.append(f"--epsilon must be in (0, 1), got {self.epsilon:g}")
        if not 0.0 < self.delta < 1.0:  # below 1, the target's top token always passes
            problems.append(f"--delta must be in (0, 1), got {self.delta:g}")
        if not 1.0 <= self.factor < math.inf:  # an infinite margin accepts every draft: no target left
            problems.append(f"--margin must be at least 1 and finite, got {self.factor:g}")
        return problems

    def accepts(self, tokens: Sequence[int], p_target: np.ndarray) -> np.ndarray:
        """Which of ``tokens`` the rule accepts, token i judged on row i of ``p_target`` (n, vocab): (n,) bool."""
        if self.rule == "typical":
            return typical_accepts(tokens, p_target, self.epsilon, self.delta)
        return margin_accepts(tokens, p_target, self.factor)


def typical_accepts(tokens: Sequence[int], p_target: np.ndarray, epsilon: float, delta: float) -> np.ndarray:
    """Medusa-2's typical acceptance (Cai et al. 2024, arXiv 2401.10774): accept x where
    p_target(x) > min(epsilon, delta exp(-H(p_target))), H the row's entropy in nats: a flat row
    (the target unsure) lets unlikely drafts through, a peaked one only likely ones.
    p_target: (n, vocab), row i judging tokens[i]. Returns (n,) bool."""
    rows = np.asarray(p_target, dtype=np.float64)  # (n, V)
    logs = np.log(rows, out=np.zeros_like(rows), where=rows > 0.0)
    entropy = -(rows * logs).sum(axis=-1)  # (n,)
    threshold = np.minimum(epsilon, delta * np.exp(-entropy))  # (n,)
    return rows[np.arange(len(rows)), np.asarray(tokens, dtype=np.intp)] > threshold


def margin_accepts(tokens: Sequence[int], p_target: np.ndarray, factor: float) -> np.ndarray:
    """Accept x where p_target(x) >= max(p_target) / factor (factor >= 1; 1: only a top token).
    p_target: (n, vocab), row i judging tokens[i]. Returns (n,) bool."""
    rows = np.asarray(p_target, dtype=np.float64)  # (n, V)
    chosen = rows[np.arange(len(rows)), np.asarray(tokens, dtype=np.intp)]  # (n,)
    return (chosen > 0.0) & (chosen * factor >= rows.max(axis=-1))


def verify_lossy(
    draft_tokens: Sequence[int], p_target: np.ndarray, acceptance: LossyAcceptance,
    rng: np.random.Generator | None = None,
) -> Verdict:
    """A lossy rule on a chain: accept drafts while ``acceptance`` accepts each on its row, then
    the target's own token from the row after the last accepted: its argmax where ``rng`` is None
    (T = 0), else a sample from that row. p_target: (k + 1, vocab)."""
    k = len(draft_tokens)
    accepted = acceptance.accepts(draft_tokens, p_target[:k])  # (k,)
    n_accepted = k if accepted.all() else int(accepted.argmin())
    return Verdict(n_accepted, _own_token(p_target[n_accepted], rng))


def _own_token(p_target_row: np.ndarray, rng: np.random.Generator | None) -> int:
    """The target's own next token from a (vocab,) row: the argmax (rng None), else a sample."""
    return int(p_target_row.argmax()) if rng is None else sample(p_target_row, rng)


# ---- trees -------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeVerdict:
    """The outcome of verifying a tree: the accepted ``path`` (node indices from the root
    down), then ``next_token``. On a chain-shaped tree the path is range(n_accepted)."""

    path: tuple[int, ...]
    next_token: int

    @property
    def n_accepted(self) -> int:
        return len(self.path)


def verify_tree_greedy(tree: TokenTree, target_argmax: Sequence[int]) -> TreeVerdict:
    """Temperature 0 on a tree: follow the children equal to the target's argmax; the deepest
    such path wins (the first in index order among equally deep ones).

    target_argmax: (1 + n,), row 0 after the root, row 1 + i after node i.
    """
    argmax = np.asarray(target_argmax)
    path = _deepest_path(tree, np.asarray(tree.tokens) == argmax[_parent_rows(tree)])
    return TreeVerdict(path, int(argmax[path[-1] + 1 if path else 0]))


def verify_tree_lossy(
    tree: TokenTree, p_target: np.ndarray, acceptance: LossyAcceptance, rng: np.random.Generator | None = None
) -> TreeVerdict:
    """A lossy rule on a tree: every node is judged by ``acceptance`` on its parent's row, and
    the deepest path of accepted nodes wins (the first in index order among equally deep ones;
    Medusa too takes the longest, breaking ties by likelihood). Then the target's own token from
    the row after it, as in ``verify_lossy``. p_target: (1 + n, vocab), row 0 after the root."""
    path = _deepest_path(tree, acceptance.accepts(tree.tokens, p_target[_parent_rows(tree)]))
    return TreeVerdict(path, _own_token(p_target[path[-1] + 1 if path else 0], rng))


def _parent_rows(tree: TokenTree) -> np.ndarray:
    """The row each node's token is judged on: its parent's, 0 for the root's children. (n,)"""
    return np.asarray(tree.parents, dtype=np.intp) + 1


def _deepest_path(tree: TokenTree, accepted: np.ndarray) -> tuple[int, ...]:
    """The deepest path from the root of nodes all ``accepted`` ((n,) bool), the first in index
    order among equally deep ones."""
    # reach[i]: accepted nodes below node i on its best path; nodes go children-first backwards.
    reach = [0] * len(tree)
    best_child = [-1] * (len(tree) + 1)  # by node + 1; -1: no child accepted
    for node in range(len(tree) - 1, -2, -1):
        best = 0
        for child in tree.children_of(node):
            if accepted[child] and 1 + reach[child] > best:
                best, best_child[node + 1] = 1 + reach[child], child
        if node >= 0:
            reach[node] = best
    path, node = [], best_child[0]
    while node >= 0:
        path.append(node)
        node = best_child[node + 1]
    return tuple(path)


def sibling_row(p_draft_row: np.ndarray, earlier_siblings: Sequence[int]) -> np.ndarray:
    """The distribution a later sibling was drawn from when siblings are drawn without
    replacement: the drafter's row (vocab,) with the earlier siblings' tokens removed,
    renormalised (a draw from it that is none of them). It is that sibling's ``p_draft``
    row in ``verify_tree_sampled``."""
    row = p_draft_row.copy()
    row[list(earlier_siblings)] = 0.0
    return row / row.sum()


def verify_tree_sampled(
    tree: TokenTree,
    p_target: np.ndarray,
    p_draft: Sequence[np.ndarray | None],
    rng: np.random.Generator,
    independent: str = "k-sequential",
) -> TreeVerdict:
    """Temperature > 0 on a tree: multi-round rejection sampling over siblings (SpecInfer).

    At each accepted node the children are tried in index order: child x is accepted
    with probability min(1, p(x) / p_draft(x)), where p starts as the target's row;
    after a rejection p becomes norm(max(0, p - p_draft)) for the next sibling. When
    every child is rejected the next token is sampled from what p is left.
    p_target: (1 + n, vocab), row 0 after the root, row 1 + i after node i.
    p_draft: n entries: the (vocab,) distribution node i's token was drawn from given
    its earlier siblings (the same row for siblings drawn independently; ``sibling_row``
    for siblings drawn without replacement), or None for a deterministic node (one-hot
    at its token).
    independent: how leading siblings drawn independently from one row (``independent_run``)
    are verified: ``"k-sequential"``, SpecTr's selection (``select_k_sequential``), or
    ``"rejection"``, the multi-round rule above; the siblings after them are tried in turn
    against what is left.
    The emitted tokens are distributed exactly as the target's own samples; on a
    chain-shaped tree this draws the same random numbers as ``verify_sampled``.
    """
    path: list[int] = []
    node = -1
    while True:
        p_row = p_target[node + 1]  # (vocab,)
        children = tree.children_of(node)
        first = 0
        if independent == "k-sequential" and (run := independent_run(children, p_draft)) > 1:
            tokens = [tree.tokens[child] for child in children[:run]]
            chosen, p_row = select_k_sequential(tokens, p_row, p_draft[children[0]], rng)
            if chosen is not None:
                path.append(children[chosen])
                node = children[chosen]
                continue
            first = run
        for child in children[first:]:
            accepted, p_row = _accept_one(tree.tokens[child], p_row, p_draft[child], rng)
            if accepted:
                path.append(child)
                node = child
                break
        else:
            return TreeVerdict(tuple(path), sample(p_row, rng))


def independent_run(children: Sequence[int], p_draft: Sequence[np.ndarray | None]) -> int:
    """How many of the first ``children`` were drawn independently from one row: they carry
    the same ``p_draft`` row (a sibling drawn without replacement carries ``sibling_row``, a
    deterministic one None)."""
    if not children or p_draft[children[0]] is None:
        return 0
    row = p_draft[children[0]]
    run = 1
    while run < len(children) and (other := p_draft[children[run]]) is not None and (
        other is row or np.array_equal(other, row)
    ):
        run += 1
    return run


# Bisection steps for SpecTr's rho in [1, k]: k 2^-40 is far below any probability that matters.
RHO_STEPS = 40
# NumPy sums fewer float64s than this one after another from 0.0 (more, pairwise): a Python loop
# over so few gives the same bits, without three NumPy calls a bisection step.
_SEQUENTIAL_SUM = 8


def k_sequential_rho(p_target_row: np.ndarray, p_draft_row: np.ndarray, n_drafts: int) -> tuple[float, float]:
    """SpecTr's rho for ``n_drafts`` independent draws from ``p_draft_row``: the least rho in
    [1, n_drafts] with 1 - (1 - beta)^n_drafts <= rho beta, where beta(rho) =
    sum(min(p_draft, p_target / rho)); returns rho and beta(rho). The left side is the chance
    some draft is accepted, which falls as rho grows; the right side rises."""
    drawn = p_draft_row > 0.0
    p_target_drawn, p_draft_drawn = p_target_row[drawn], p_draft_row[drawn]
    small = len(p_draft_drawn) < _SEQUENTIAL_SUM and p_draft_drawn.dtype == p_target_drawn.dtype == np.float64
    if small:  # a small support (top-k) of float64 rows: the bisection in Python floats
        pairs = list(zip(p_draft_drawn.tolist(), p_target_drawn.tolist()))

        def beta(rho: float) -> float:
            total = 0.0
            for draft_p, target_p in pairs:
                total += min(draft_p, target_p / rho)
            return total
    else:
        def beta(rho: float) -> float:
            return float(np.minimum(p_draft_drawn, p_target_drawn / rho).sum())

    low, high = 1.0, float(n_drafts)
    for _ in range(RHO_STEPS):
        middle = 0.5 * (low + high)
        b = beta(middle)
        if 1.0 - (1.0 - b) ** n_drafts <= middle * b:
            high = middle
        else:
            low = middle
    return high, beta(high)


def select_k_sequential(
    tokens: Sequence[int], p_target_row: np.ndarray, p_draft_row: np.ndarray, rng: np.random.Generator
) -> tuple[int | None, np.ndarray]:
    """SpecTr's k-sequential selection (Sun et al. 2023, Algorithm 3) of one of ``tokens``,
    independent draws from ``p_draft_row`` (vocab,): each in turn is accepted with probability
    min(1, p_target(x) / (rho p_draft(x))). Returns the index accepted (None: every one
    rejected) and the row the next token comes from otherwise: p_target less what the
    selection emits, norm(max(0, p_target - min(p_draft, p_target / rho) (1 - (1 - beta)^k) / beta))."""
    n_drafts = len(tokens)
    rho, beta = k_sequential_rho(p_target_row, p_draft_row, n_drafts)
    for index, token in enumerate(tokens):
        if rng.random() * rho * p_draft_row[token] < p_target_row[token]:
            return index, p_target_row
    if beta <= 0.0:
        return None, p_target_row
    emitted = np.minimum(p_draft_row, p_target_row / rho) * ((1.0 - (1.0 - beta) ** n_drafts) / beta)  # (vocab,)
    return None, _normalised(np.maximum(p_target_row - emitted, 0.0), p_target_row)
