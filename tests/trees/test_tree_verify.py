"""Acceptance on token trees (specrun.verify): chains agree with the chain rules, greedy takes
the deepest matching path, and multi-round rejection sampling over siblings emits exactly
the target's distribution (chi-square), which a wrong residual fails."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from scipy import stats as scipy_stats

import specrun.verify
from specrun.tree import TokenTree
from specrun.verify import sibling_row, verify_greedy, verify_sampled, verify_tree_greedy, verify_tree_sampled

ALPHA = 1e-3  # a correct verifier fails a fixed seed's chi-square with this probability
VOCAB = 4
SAMPLES = 50_000


def _random_rows(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    return rng.dirichlet(np.full(vocab, 0.7), size=n)  # (n, vocab)


# ---- chain-shaped trees agree with the chain rules ----------------------------------------


@pytest.mark.parametrize("seed", range(200))
def test_greedy_on_a_chain_equals_the_chain_rule(seed):
    rng = np.random.default_rng(seed)
    draft = rng.integers(0, 3, size=rng.integers(0, 6)).tolist()
    argmax = rng.integers(0, 3, size=len(draft) + 1).tolist()
    chain_verdict = verify_greedy(draft, argmax)
    tree_verdict = verify_tree_greedy(TokenTree.chain(draft), argmax)
    assert tree_verdict.path == tuple(range(chain_verdict.n_accepted))
    assert tree_verdict.next_token == chain_verdict.next_token


@pytest.mark.parametrize("seed", range(200))
def test_sampling_on_a_chain_equals_the_chain_rule(seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(0, 6))
    p_target = _random_rows(rng, k + 1, VOCAB)
    draft_rows = _random_rows(rng, k, VOCAB)
    # a mix of sampled nodes (with their rows) and deterministic ones (None)
    p_draft = [row if rng.random() < 0.5 else None for row in draft_rows]
    draft = [int(rng.choice(VOCAB, p=row)) if row is not None else int(rng.integers(VOCAB)) for row in p_draft]
    chain_verdict = verify_sampled(draft, p_target, p_draft, np.random.default_rng(seed))
    tree_verdict = verify_tree_sampled(TokenTree.chain(draft), p_target, p_draft, np.random.default_rng(seed))
    assert tree_verdict.path == tuple(range(chain_verdict.n_accepted))
    assert tree_verdict.next_token == chain_verdict.next_token


# ---- greedy on branches ---------------------------------------------------------------------


def test_greedy_follows_the_matching_sibling():
    # root ─┬─ 0 (5) ── 2 (7)
    #       └─ 1 (6) ── 3 (8) ── 4 (9)
    tree = TokenTree((5, 6, 7, 8, 9), (-1, -1, 0, 1, 3))
    argmax = [6, 7, 8, 0, 9, 3]  # after root, node 0, 1, 2, 3, 4
    assert verify_tree_greedy(tree, argmax) == specrun.verify.TreeVerdict((1, 3, 4), 3)
    argmax = [5, 7, 8, 2, 9, 3]
    assert verify_tree_greedy(tree, argmax) == specrun.verify.TreeVerdict((0, 2), 2)
    argmax = [4, 7, 8, 2, 9, 3]
    assert verify_tree_greedy(tree, argmax) == specrun.verify.TreeVerdict((), 4)


def test_greedy_takes_the_deepest_of_equal_siblings():
    # two drafters proposed the same first token; only the second's continuation matches
    tree = TokenTree((5, 5, 7, 8), (-1, -1, 0, 1))
    argmax = [5, 1, 8, 2, 9]  # after root, node 0, 1, 2, 3
    verdict = verify_tree_greedy(tree, argmax)
    assert verdict.path == (1, 3) and verdict.next_token == 9 and verdict.n_accepted == 2
    # equally deep: the first in index order
    assert verify_tree_greedy(tree, [5, 6, 6, 2, 9]).path == (0,)


# ---- sampled trees: chi-square against the target ---------------------------------------------


@functools.cache
def _table(kind: str, context: tuple[int, ...]) -> np.ndarray:
    """A fixed (VOCAB,) distribution per context: the target's or the draft's."""
    return np.random.default_rng([kind == "target", *context]).dirichlet(np.full(VOCAB, 0.8))


def _draw(row: np.ndarray, rng: np.random.Generator) -> int:
    """One token from ``row`` by its cumulative sums (a plain loop: 4 entries)."""
    u, total = rng.random(), 0.0
    for token, probability in enumerate(row.tolist()):
        total += probability
        if u < total:
            return token
    return VOCAB - 1


def _siblings(rng, context, n_sampled: int, replacement: bool):
    """``n_sampled`` children drawn from the draft (with or without replacement), each with the
    row it was drawn from, plus one deterministic child (one-hot, None)."""
    row = _table("draft", context)
    tokens, rows = [], []
    for _ in range(n_sampled):
        token = _draw(row, rng)
        tokens.append(token)
        rows.append(row)
        if not replacement:
            row = row.copy()
            row[token] = 0.0
            row /= row.sum()
    tokens.append((sum(context) + 1) % VOCAB)
    rows.append(None)
    return tokens, rows


def _sample_tree(rng, context: tuple[int, ...], root_drafts: int = 2, replacement_below: bool = False):
    """Depth 2: children at the root (``root_drafts`` drafted with replacement, one
    deterministic), below each two drafted (without replacement unless ``replacement_below``)
    and one deterministic."""
    tokens, parents, p_draft = [], [], []
    first, rows = _siblings(rng, context, root_drafts, replacement=True)
    tokens += first
    parents += [-1] * len(first)
    p_draft += rows
    for node, token in enumerate(first):
        second, rows = _siblings(rng, (*context, token), 2, replacement=replacement_below)
        tokens += second
        parents += [node] * len(second)
        p_draft += rows
    tree = TokenTree(tokens, parents)
    p_target = np.stack([_table("target", context)] + [
        _table("target", (*context, *(tree.tokens[i] for i in path))) for path in map(tree.path_to, range(len(tree)))
    ])  # (1 + n, VOCAB)
    return tree, p_target, p_draft


def _two_token_counts(seed: int, grow=None) -> np.ndarray:
    """How often each (first, second) pair of emitted tokens came out: (VOCAB, VOCAB), over
    trees from ``grow`` (``_sample_tree``). A verdict of one token is continued by sampling the
    target itself."""
    rng = np.random.default_rng(seed)
    context = (1, 2)
    counts = np.zeros((VOCAB, VOCAB), dtype=np.int64)
    for _ in range(SAMPLES):
        tree, p_target, p_draft = (grow or _sample_tree)(rng, context)
        verdict = verify_tree_sampled(tree, p_target, p_draft, rng)
        emitted = [tree.tokens[node] for node in verdict.path] + [verdict.next_token]
        if len(emitted) == 1:
            emitted.append(_draw(_table("target", (*context, emitted[0])), rng))
        counts[emitted[0], emitted[1]] += 1
    return counts


def _chi_square_p(counts: np.ndarray) -> float:
    context = (1, 2)
    first = _table("target", context)
    expected = np.stack([first[a] * _table("target", (*context, a)) for a in range(VOCAB)])  # (V, V)
    return float(scipy_stats.chisquare(counts.ravel(), expected.ravel() * counts.sum()).pvalue)


def test_tree_sampling_emits_the_target_distribution():
    counts = _two_token_counts(seed=0)
    assert counts.sum() == SAMPLES
    assert _chi_square_p(counts) > ALPHA


def _residual_without_the_update(token, p_target_row, p_draft_row):
    """The mutant: after a rejection only the rejected token is removed, as if every proposal
    were one-hot; the draft's distribution is never subtracted."""
    residual = p_target_row.copy()
    residual[token] = 0.0
    return residual / residual.sum()


def test_a_wrong_residual_fails_the_same_chi_square(monkeypatch):
    monkeypatch.setattr(specrun.verify, "_residual", _residual_without_the_update)
    assert _chi_square_p(_two_token_counts(seed=0)) < ALPHA


# ---- independent siblings: SpecTr's k-sequential selection ------------------------------------


def _independent_tree(rng, context: tuple[int, ...]):
    """2 to 4 children drawn with replacement at the root (and a deterministic one), two drawn
    with replacement below each (and a deterministic one): k-sequential selection at every
    node, the deterministic sibling tried after it."""
    return _sample_tree(rng, context, root_drafts=int(rng.integers(2, 5)), replacement_below=True)


def test_k_sequential_selection_emits_the_target_distribution():
    assert _chi_square_p(_two_token_counts(seed=1, grow=_independent_tree)) > ALPHA


def test_k_sequential_selection_without_its_rho_fails_the_same_chi_square(monkeypatch):
    """The mutant: rho fixed at 1, so each draft is tested as if it were alone while the residual
    is taken as for several: the residual goes negative and is cut."""
    rho = specrun.verify.k_sequential_rho
    monkeypatch.setattr(specrun.verify, "k_sequential_rho", lambda p, q, n: (1.0, rho(p, q, 1)[1]))
    assert _chi_square_p(_two_token_counts(seed=1, grow=_independent_tree)) < ALPHA


def test_only_siblings_drawn_from_one_row_are_independent():
    row, other = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.3, 0.5])
    assert specrun.verify.independent_run([0, 1, 2], [row, row.copy(), other]) == 2
    assert specrun.verify.independent_run([0, 1], [row, sibling_row(row, [0])]) == 1  # without replacement
    assert specrun.verify.independent_run([0, 1], [None, None]) == 0  # deterministic
    assert specrun.verify.independent_run([], []) == 0


def test_k_sequential_rho_solves_spectr_s_equation():
    """rho in [1, k] where 1 - (1 - beta)^k = rho beta: 1 for one draft, and the residual left
    non-negative with its mass where the selection's is missing."""
    rng = np.random.default_rng(3)
    for index in range(50):  # supports of 6 (summed in Python floats) and of 12 (in NumPy)
        p_target, p_draft = _random_rows(rng, 2, 6 if index % 2 else 12)
        for n_drafts in (1, 2, 3, 4):
            rho, beta = specrun.verify.k_sequential_rho(p_target, p_draft, n_drafts)
            assert n_drafts >= rho >= 1.0
            assert rho * beta == pytest.approx(1.0 - (1.0 - beta) ** n_drafts, abs=1e-9)
            emitted = np.minimum(p_draft, p_target / rho) * (1.0 - (1.0 - beta) ** n_drafts) / beta
            assert np.all(p_target - emitted >= -1e-9)


def _node_acceptance(p_target: np.ndarray, p_draft: np.ndarray, n_drafts: int) -> tuple[float, float]:
    """The exact chance that one of ``n_drafts`` independent draws from ``p_draft`` is accepted:
    by k-sequential selection, 1 - (1 - beta)^k; by multi-round rejection, where a rejection
    leaves norm(max(0, p - p_draft)) whatever the token, 1 - prod(1 - sum(min(p_j, p_draft)))."""
    _, beta = specrun.verify.k_sequential_rho(p_target, p_draft, n_drafts)
    rejected, p_row = 1.0, p_target
    for _ in range(n_drafts):
        rejected *= 1.0 - np.minimum(p_row, p_draft).sum()
        left = np.maximum(p_row - p_draft, 0.0)
        p_row = left / left.sum() if left.sum() > 0.0 else p_row
    return 1.0 - (1.0 - beta) ** n_drafts, 1.0 - rejected


def test_k_sequential_selection_accepts_more_than_multi_round_rejection_of_independent_drafts():
    """Why it is the rule for independent siblings: over random rows it accepts more on average
    (docs/design.md gives the figures on real rows)."""
    rng = np.random.default_rng(4)
    for n_drafts in (2, 3, 4):
        pairs = [_random_rows(rng, 2, 8) for _ in range(200)]
        k_sequential, rejection = np.mean([_node_acceptance(p, q, n_drafts) for p, q in pairs], axis=0)
        assert k_sequential > rejection + 0.005, (n_drafts, k_sequential, rejection)
