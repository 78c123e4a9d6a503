"""Block verification (specrun.verify.verify_block): exact, never accepting less than token by
token, and equal to the greedy rule at temperature 0.

The chi-square draws chains of 2 to 6 drafts (sampled rows and one-hot proposals mixed) over a
3-token vocabulary, verifies them, continues the text from the target and compares the window
with its exact joint distribution; the kept lengths are compared with their exact chances
(lossless_harness.kept_lengths, written apart from specrun.verify) by a z-score. Wrong variants
fail the same checks, here and through the engine's scenarios.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter

import numpy as np
import pytest

import specrun.engine.passes
import specrun.verify
from lossless_harness import ALPHA, MAX_Z, SCENARIOS, chi_square_p, impossible, kept_lengths, run_scenario
from specrun.sampling import sample
from specrun.verify import Verdict, verify_block, verify_greedy, verify_sampled

VOCAB = 3
SAMPLES = 50_000
CONTEXT = (2, 0)


@functools.cache
def _row(kind: str, context: tuple[int, ...]) -> np.ndarray:
    """A fixed (VOCAB,) distribution per context, the target's or the draft's; a third of the
    target's rows lose their least likely token (as top-k leaves them)."""
    rng = np.random.default_rng([kind == "target", *context])
    row = rng.dirichlet(np.full(VOCAB, 0.8))
    if kind == "target" and rng.random() < 1 / 3:
        row[row.argmin()] = 0.0
        row /= row.sum()
    return row


def _draft_chain(rng: np.random.Generator, k: int) -> tuple[list[int], list[np.ndarray | None]]:
    """``k`` drafts after CONTEXT: each drawn from the draft's row, or a fourth of them a
    deterministic guess (one-hot, None) as prompt lookup makes."""
    tokens, rows = [], []
    for _ in range(k):
        context = (*CONTEXT, *tokens)
        if rng.random() < 0.25:
            tokens.append((sum(context) + 1) % VOCAB)
            rows.append(None)
        else:
            row = _row("draft", context)
            tokens.append(sample(row, rng))
            rows.append(row)
    return tokens, rows


def _target_rows(tokens) -> np.ndarray:
    return np.stack([_row("target", (*CONTEXT, *tokens[:i])) for i in range(len(tokens) + 1)])  # (k+1, V)


@functools.cache
def _joint(window: int) -> dict[tuple[int, ...], float]:
    """The target's exact distribution of ``window`` tokens after CONTEXT."""
    return {
        text: math.prod(_row("target", (*CONTEXT, *text[:i]))[text[i]] for i in range(window))
        for text in itertools.product(range(VOCAB), repeat=window)
    }


def _block_problems(verify, k: int, samples: int = SAMPLES, seed: int = 0) -> list[str]:
    """``samples`` chains of ``k`` drafts through ``verify``, the text continued from the target
    to k + 1 tokens: chi-square against the exact joint, and the kept lengths against their
    exact chances (z-score)."""
    rng = np.random.default_rng(seed)
    window = k + 1
    counts: Counter = Counter()
    accepted = expected = variance = 0.0
    for _ in range(samples):
        tokens, rows = _draft_chain(rng, k)
        p_target = _target_rows(tokens)
        verdict = verify(tokens, p_target, rows, rng)
        text = [*tokens[: verdict.n_accepted], verdict.next_token]
        while len(text) < window:
            text.append(sample(_row("target", (*CONTEXT, *text)), rng))
        counts[tuple(text)] += 1
        chances = kept_lengths(tokens, p_target, rows)
        mean = sum(t * chance for t, chance in enumerate(chances))
        accepted += verdict.n_accepted
        expected += mean
        variance += sum(t * t * chance for t, chance in enumerate(chances)) - mean * mean
    joint = _joint(window)
    never = impossible(counts, joint)
    problems = [f"{len(never)} impossible texts, e.g. {never[0]}"] if never else []
    p_value = chi_square_p(counts, joint, samples)
    if p_value < ALPHA:
        problems.append(f"chi-square against the exact joint: p = {p_value:.3g}")
    z = (accepted - expected) / math.sqrt(variance)
    if abs(z) > MAX_Z:
        problems.append(f"kept {accepted:.0f} drafts, {expected:.0f} expected (z = {z:.1f})")
    return problems


@pytest.mark.parametrize("k", [2, 3, 4, 5, 6])
def test_block_verification_emits_the_target_distribution(k):
    assert _block_problems(verify_block, k) == []


# ---- wrong variants: the same checks must fail them ------------------------------------------


def _weight_forgotten(monkeypatch):
    """The residual mass and the correction computed from the target's own row, the weight of
    the prefix forgotten (max(0, p_target - p_draft) where max(0, p_i p_target - p_draft) is due)."""
    shortfall = specrun.verify._shortfall
    monkeypatch.setattr(specrun.verify, "_shortfall", lambda token, p_row, q_row, weight=1.0: shortfall(token, p_row, q_row))


def _one_more(monkeypatch):
    """One more draft kept than decided, where one was rejected, the token after it from the target."""
    def verify(draft_tokens, p_target, p_draft, rng):
        verdict = verify_block(draft_tokens, p_target, p_draft, rng)
        if verdict.n_accepted == len(draft_tokens):
            return verdict
        return Verdict(verdict.n_accepted + 1, sample(p_target[verdict.n_accepted + 1], rng))

    monkeypatch.setattr(specrun.verify, "verify_block", verify)
    monkeypatch.setattr(specrun.engine.passes, "verify_block", verify)


WRONG = {"the prefix's weight forgotten": _weight_forgotten, "one draft more kept": _one_more}


@pytest.mark.parametrize("name", list(WRONG))
def test_a_wrong_block_rule_fails_the_same_checks(name, monkeypatch):
    WRONG[name](monkeypatch)
    assert _block_problems(specrun.verify.verify_block, 4)


@pytest.mark.parametrize("name", list(WRONG))
@pytest.mark.parametrize("scenario", ["draft", "lookup"])
def test_the_engine_scenarios_catch_a_wrong_block_rule(name, scenario, monkeypatch):
    """The losslessness scenarios (lossless_harness), where the engine verifies chains by block."""
    assert SCENARIOS[scenario].chain_rule == "block"
    WRONG[name](monkeypatch)
    _, problems = run_scenario(scenario)
    assert problems, f"{name!r} passed the {scenario!r} scenario"


# ---- greedy, and never less than token by token -----------------------------------------------


def _one_hot(token: int, vocab: int) -> np.ndarray:
    row = np.zeros(vocab)
    row[token] = 1.0
    return row


@pytest.mark.parametrize("seed", range(200))
def test_block_verification_at_temperature_0_is_the_greedy_rule(seed):
    """One-hot rows (the target's argmax, the draft's greedy guesses): the verdict is the greedy
    rule's, so the text is plain decoding's."""
    rng = np.random.default_rng(seed)
    vocab = 5
    k = int(rng.integers(0, 7))
    argmax = rng.integers(0, vocab, size=k + 1)
    # drafts that match the argmax for a while, then maybe not
    draft = [int(argmax[i]) if rng.random() < 0.7 else int(rng.integers(vocab)) for i in range(k)]
    p_target = np.stack([_one_hot(int(token), vocab) for token in argmax])  # (k+1, vocab)
    p_draft = [None if rng.random() < 0.5 else _one_hot(token, vocab) for token in draft]
    assert verify_block(draft, p_target, p_draft, rng) == verify_greedy(draft, argmax.tolist())


def _expected_lengths(k: int, seed: int, deterministic: bool) -> tuple[float, float]:
    """Exact expected drafts kept by block and by token-by-token verification, over every
    chain of ``k`` drafts from random context-dependent rows (4 tokens): drawn from the draft's
    rows, or (``deterministic``) one fixed guess per context, one-hot."""
    vocab = 4

    @functools.cache
    def row(kind: str, context: tuple[int, ...]) -> np.ndarray:
        return np.random.default_rng([seed, kind == "target", *context]).dirichlet(np.full(vocab, 0.6))

    block = token_by_token = 0.0
    for tokens in itertools.product(range(vocab), repeat=k):
        if deterministic:
            if any(tokens[i] != int(row("draft", tokens[:i]).argmax()) for i in range(k)):
                continue
            chance, rows = 1.0, [None] * k
        else:
            rows = [row("draft", tokens[:i]) for i in range(k)]
            chance = math.prod(rows[i][tokens[i]] for i in range(k))
        p_target = [row("target", tokens[:i]) for i in range(k + 1)]
        block += chance * sum(t * c for t, c in enumerate(kept_lengths(tokens, p_target, rows)))
        reach = 1.0
        for i in range(k):
            q = 1.0 if rows[i] is None else rows[i][tokens[i]]
            reach *= min(1.0, p_target[i][tokens[i]] / q)
            token_by_token += chance * reach
    return block, token_by_token


def test_block_verification_keeps_at_least_as_many_drafts_as_token_by_token():
    """The paper's theorem, exactly, on 24 random pairs of tables and chains of 2 to 5: never
    fewer in expectation, more on some."""
    gains = []
    for seed, k in itertools.product(range(6), range(2, 6)):
        block, token_by_token = _expected_lengths(k, seed, deterministic=False)
        assert block >= token_by_token - 1e-12, (seed, k, block, token_by_token)
        gains.append(block - token_by_token)
    assert max(gains) > 0.01


def test_block_verification_keeps_as_many_deterministic_drafts_as_token_by_token():
    """One-hot proposals (prompt lookup, the n-gram pool): the prefix's weight is the product of
    p_target over its drafts and only falls, so nothing later makes up for a draft the target
    doubts and block verification keeps exactly as many as token by token."""
    for seed, k in itertools.product(range(6), range(2, 6)):
        block, token_by_token = _expected_lengths(k, seed, deterministic=True)
        assert block == pytest.approx(token_by_token, abs=1e-12), (seed, k)


def test_the_chances_of_kept_lengths_match_verify_block_and_token_by_token_at_one_draft():
    """kept_lengths, the reference of the checks above, against the one-draft case where both
    rules are the same: keep with min(1, p_target(x) / p_draft(x))."""
    p_target = np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    q = np.array([0.2, 0.6, 0.2])
    assert kept_lengths([1], p_target, [q]) == pytest.approx([0.5, 0.5])
    assert kept_lengths([0], p_target, [None]) == pytest.approx([0.5, 0.5])
    rng = np.random.default_rng(0)
    kept = sum(verify_block([1], p_target, [q], rng).n_accepted for _ in range(20_000))
    sampled = sum(verify_sampled([1], p_target, [q], rng).n_accepted for _ in range(20_000))
    assert abs(kept - 10_000) < 4 * 71 and abs(sampled - 10_000) < 4 * 71  # sd sqrt(20000/4)
