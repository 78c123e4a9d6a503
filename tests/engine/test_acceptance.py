"""Losslessness of the acceptance rules and the sampler, on tabulated fake models.

Every method (and each adaptive, as `specrun generate` runs it without -k), the sampling
options and the draft model's confidence stop run through one harness
(lossless_harness.py): a window of 8 tokens (draft positions 1-4, and a pass right after a
full accept), chi-square against the exact joint distribution from an independent oracle
(oracle.py), and the acceptance count against its exact conditional expectation.
test_mutations.py runs deliberately wrong verifiers and samplers through the same
scenarios and checks each one fails them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from lossless_harness import (
    CHAINS, DRAFT_LEN, SCENARIOS, SWEPT_LONGER, WINDOW, branches_taken, greedy_scenario, long_tail_sibling_problems,
    run_scenario,
)
from oracle import distribution
from specrun.drafters.methods import METHODS, is_adaptive, resolve_method
from specrun.sampling import SAMPLER_ORDER, SamplingSettings, probabilities, sample
from specrun.verify import Verdict, verify_greedy, verify_sampled

# ---- probabilities(): each option against values computed by hand -----------------------------
LOGITS = [2.0, 1.0, 0.0, -1.0]
HAND_COMPUTED = [
    # softmax: (e^2, e, 1, 1/e) / 11.475217
    (SamplingSettings(temperature=1.0), [0.643914, 0.236883, 0.087144, 0.032059]),
    # temperature 2: softmax of (1, 0.5, 0, -0.5)
    (SamplingSettings(temperature=2.0), [0.455054, 0.276004, 0.167405, 0.101536]),
    # top-k 2: (e^2, e) / (e^2 + e)
    (SamplingSettings(temperature=1.0, top_k=2), [0.731059, 0.268941, 0.0, 0.0]),
    # top-p 0.9: mass before the third token 0.880797 < 0.9, kept; before the fourth 0.967941, cut
    (SamplingSettings(temperature=1.0, top_p=0.9), [0.665241, 0.244728, 0.090031, 0.0]),
    # top-p 0.6: the first token alone (0.643914) crosses 0.6
    (SamplingSettings(temperature=1.0, top_p=0.6), [1.0, 0.0, 0.0, 0.0]),
    # min-p 0.1: floor 0.0643914 cuts the last token (0.032059)
    (SamplingSettings(temperature=1.0, min_p=0.1), [0.665241, 0.244728, 0.090031, 0.0]),
    # min-p 0.2: floor 0.128783 cuts the last two
    (SamplingSettings(temperature=1.0, min_p=0.2), [0.731059, 0.268941, 0.0, 0.0]),
    # llama.cpp's order: top-k, top-p, min-p on the model's own distribution, then the temperature.
    # Temperature 2, top-p 0.8: at temperature 1 the mass before the third token is 0.880797, cut;
    # then temperature 2 over the two kept: softmax(1, 0.5) (temperature first would keep three)
    (SamplingSettings(temperature=2.0, top_p=0.8), [0.622459, 0.377541, 0.0, 0.0]),
    # temperature 0.5, min-p 0.2: floor 0.128783 at temperature 1 keeps two; softmax(4, 2) over them
    # (temperature first: softmax(4, 2, 0, -2) = (0.864962, 0.117061, ...), floor 0.172992 keeps one)
    (SamplingSettings(temperature=0.5, min_p=0.2), [0.880797, 0.119203, 0.0, 0.0]),
    # temperature 2, top-k 3 -> (e^2, e, 1) / 11.107 = (0.665241, 0.244728, 0.090031); top-p 0.95
    # keeps all three (mass before the third 0.909969); min-p 0.3 (floor 0.199572) cuts the third;
    # temperature 2 over the two: softmax(1, 0.5) (temperature first keeps all three)
    (SamplingSettings(temperature=2.0, top_k=3, top_p=0.95, min_p=0.3), [0.622459, 0.377541, 0.0, 0.0]),
    # an order of the run's own, temperature first: top-k 3 -> (e, e^0.5, 1) / 5.367003 =
    # (0.506480, 0.307196, 0.186324); top-p 0.8 cuts the third (mass before it 0.813676); min-p 0.5
    # (floor 0.311230) keeps both
    (SamplingSettings(temperature=2.0, top_k=3, top_p=0.8, min_p=0.5, order=("temperature", "top_k", "top_p", "min_p")),
     [0.622459, 0.377541, 0.0, 0.0]),
    # min-p 0.65 on that: floor 0.404598 cuts the second
    (SamplingSettings(temperature=2.0, top_k=3, top_p=0.8, min_p=0.65, order=("temperature", "top_k", "top_p", "min_p")),
     [1.0, 0.0, 0.0, 0.0]),
    # top-k 2, top-p 0.7: top-k first leaves (0.731059, 0.268941), whose first crosses 0.7 alone;
    # top-p first keeps two of the whole row (mass before the second 0.643914), top-k 2 both
    (SamplingSettings(temperature=1.0, top_k=2, top_p=0.7), [1.0, 0.0, 0.0, 0.0]),
    (SamplingSettings(temperature=1.0, top_k=2, top_p=0.7, order=("top_p", "top_k", "min_p", "temperature")),
     [0.731059, 0.268941, 0.0, 0.0]),
    # top-n-sigma 1: the logits' mean 0.5, standard deviation sqrt(1.25) = 1.118034 (over their
    # count); floor 2 - 1.118034 = 0.881966 keeps two; at temperature 0.5: softmax(4, 2)
    (SamplingSettings(temperature=1.0, top_n_sigma=1.0), [0.731059, 0.268941, 0.0, 0.0]),
    (SamplingSettings(temperature=0.5, top_n_sigma=1.0), [0.880797, 0.119203, 0.0, 0.0]),
    # typical-p: entropy 0.947551; surprises -log p = 0.440202, 1.440202, 2.440202, 3.440202 lie
    # 0.507349, 0.492651, 1.492651, 2.492651 from it, so the second token comes first: at 0.2 its
    # mass (0.236883) passes it alone; at 0.5 the first joins it (0.880797), then temperature 0.5
    (SamplingSettings(temperature=1.0, typical_p=0.2), [0.0, 1.0, 0.0, 0.0]),
    (SamplingSettings(temperature=0.5, typical_p=0.5), [0.880797, 0.119203, 0.0, 0.0]),
    # XTC at threshold 0.2: two tokens reach it (0.643914, 0.236883): the likelier is dropped, the
    # rest renormalised, softmax(1, 0, -1); at probability 0.5 half that, half the row as it was;
    # temperature 0.5 after it: softmax(2, 0, -2); temperature first, softmax(4, 2, 0, -2) leaves one
    # token at 0.2 (0.117059 the second): nothing dropped; over threshold 0.5 XTC is off
    (SamplingSettings(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.2), [0.0, 0.665241, 0.244728, 0.090031]),
    (SamplingSettings(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.2),
     [0.321957, 0.451062, 0.165936, 0.061045]),
    (SamplingSettings(temperature=0.5, xtc_probability=1.0, xtc_threshold=0.2), [0.0, 0.866813, 0.117310, 0.015876]),
    (SamplingSettings(temperature=0.5, xtc_probability=1.0, xtc_threshold=0.2, order=("temperature", "xtc")),
     [0.864955, 0.117059, 0.015842, 0.002144]),
    (SamplingSettings(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.6), [0.643914, 0.236883, 0.087144, 0.032059]),
    # a low temperature: each half tempered by its own top token (scaled by the dropped one, the
    # cut half underflowed to 0 / 0: NaN rows, found in review)
    (SamplingSettings(temperature=0.002, xtc_probability=0.5, xtc_threshold=0.2), [0.5, 0.5, 0.0, 0.0]),
    (SamplingSettings(temperature=0.002, top_p=0.99, xtc_probability=0.5, xtc_threshold=0.2), [0.5, 0.5, 0.0, 0.0]),
    # dynamic temperature: the row's entropy at temperature 1, 0.947537, over log 4 (its four
    # candidates) is 0.683503; range 0.5 about 1: 0.5 + 1.0 · 0.683503 = 1.183503, softmax(L / that)
    (SamplingSettings(temperature=1.0, dynatemp_range=0.5), [0.590531, 0.253680, 0.108976, 0.046814]),
    # exponent 2, range 1 about 0.5 (from 0, not -0.5): 1.5 · 0.683503^2 = 0.700765
    (SamplingSettings(temperature=0.5, dynatemp_range=1.0, dynatemp_exponent=2.0),
     [0.762506, 0.183021, 0.043930, 0.010544]),
    # top-k 2 first: two candidates (0.731059, 0.268941), entropy 0.582203 over log 2: 0.839941, so
    # 1.339941 over the two; temperature first: 1.183503 over the four, then top-k keeps two
    (SamplingSettings(temperature=1.0, top_k=2, dynatemp_range=0.5), [0.678372, 0.321628, 0.0, 0.0]),
    (SamplingSettings(temperature=1.0, top_k=2, dynatemp_range=0.5, order=("temperature", "top_k")),
     [0.699507, 0.300494, 0.0, 0.0]),
    # greedy: one-hot at the argmax
    (SamplingSettings(), [1.0, 0.0, 0.0, 0.0]),
]


@pytest.mark.parametrize(("settings", "expected"), HAND_COMPUTED, ids=lambda value: str(value))
def test_probabilities_match_hand_computed_values(settings, expected):
    np.testing.assert_allclose(probabilities(np.array(LOGITS, np.float32), settings), expected, atol=2e-6)
    rows = probabilities(np.array([LOGITS, LOGITS[::-1]], np.float32), settings)  # (2, V): row by row
    np.testing.assert_allclose(rows, [expected, expected[::-1]], atol=2e-6)
    np.testing.assert_allclose(distribution(LOGITS, settings), expected, atol=2e-6)  # the oracle too


@pytest.mark.parametrize("settings", [SamplingSettings(temperature=0.5, dynatemp_range=1.0),
                                      SamplingSettings(temperature=0.5, top_p=0.9, dynatemp_range=1.0),
                                      SamplingSettings(temperature=0.5, dynatemp_range=1.0, order=("temperature",))],
                         ids=str)
def test_a_dynamic_temperature_of_0_keeps_the_one_token_left(settings):
    """One finite logit (a grammar's or a reasoning budget's forced token): the entropy is 0, the
    range reaches 0, and the row is that token alone, drawn at LEAST_TEMPERATURE (at 0: 0 / 0)."""
    row = np.array([-np.inf, 1.5, -np.inf, -np.inf])
    expected = [0.0, 1.0, 0.0, 0.0]
    np.testing.assert_array_equal(probabilities(row, settings), expected)
    np.testing.assert_array_equal(probabilities(np.stack([row, row[::-1]]), settings), [expected, expected[::-1]])
    assert distribution(row, settings) == expected  # the oracle too


def test_oracle_and_probabilities_agree_on_random_rows():
    rng = np.random.default_rng(0)
    settings = [
        SamplingSettings(temperature=t, top_k=k, top_p=p, min_p=m, order=order)
        for t in (0.5, 1.0, 1.7) for k in (0, 1, 5) for p in (1.0, 0.9, 0.3) for m in (0.0, 0.05, 0.4)
        for order in (SAMPLER_ORDER, ("temperature", "top_k", "top_p", "min_p"), ("min_p", "temperature", "top_p", "top_k"))
    ] + [
        SamplingSettings(temperature=t, top_k=k, top_p=p, typical_p=y, top_n_sigma=n, order=order)
        for t in (0.5, 1.7) for k in (0, 5) for p in (1.0, 0.9) for y in (1.0, 0.9, 0.3) for n in (0.0, 0.5, 1.5)
        for order in (SAMPLER_ORDER, ("temperature", "typ_p", "top_n_sigma"), ("top_p", "typ_p", "top_k", "temperature"))
    ] + [
        SamplingSettings(temperature=t, top_k=k, min_p=m, xtc_probability=x, xtc_threshold=h, order=order)
        for t in (0.5, 1.7) for k in (0, 5) for m in (0.0, 0.1) for x in (0.3, 1.0) for h in (0.05, 0.15, 0.3)
        for order in (SAMPLER_ORDER, ("xtc", "top_k", "temperature"), ("temperature", "xtc", "min_p"))
    ] + [
        SamplingSettings(temperature=t, top_k=k, top_p=p, xtc_probability=x, xtc_threshold=0.15, dynatemp_range=r,
                         dynatemp_exponent=e, order=order)
        for t in (0.5, 1.7) for k in (0, 5) for p in (1.0, 0.8) for x in (0.0, 0.5) for r in (0.3, 1.0) for e in (0.5, 2.0)
        for order in (SAMPLER_ORDER, ("temperature", "top_k", "top_p", "xtc"), ("top_k", "xtc", "temperature", "top_p"))
    ]
    for row in rng.normal(0.0, 2.0, (20, 12)).astype(np.float32):
        for each in settings:
            np.testing.assert_allclose(probabilities(row, each), distribution(row, each), atol=1e-9)


# ---- the acceptance rules on their own --------------------------------------------------------
def test_verify_greedy_counts_matches_and_bonus():
    assert verify_greedy([5, 6, 7], [5, 6, 9, 1]) == Verdict(2, 9)
    assert verify_greedy([5, 6, 7], [5, 6, 7, 1]) == Verdict(3, 1)  # all accepted: bonus token
    assert verify_greedy([], [4]) == Verdict(0, 4)  # plain decoding
    assert verify_greedy([3], [4, 0]) == Verdict(0, 4)


def test_verify_sampled_one_hot_accepts_with_p_target_and_never_emits_the_rejected_token():
    rng = np.random.default_rng(0)
    p_target = np.array([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    verdicts = [verify_sampled([0], p_target, [None], rng) for _ in range(4000)]
    rejected = [verdict for verdict in verdicts if verdict.n_accepted == 0]
    # Accepted with probability p_target(0) = 0.5: 2000 +- 4 standard deviations (32).
    assert abs(len(rejected) - 2000) < 4 * math.sqrt(4000 * 0.25)
    assert {verdict.next_token for verdict in rejected} == {1}  # the residual excludes token 0
    accepted = [verdict.next_token for verdict in verdicts if verdict.n_accepted == 1]
    assert set(accepted) == {0, 1, 2}  # the bonus token from the second row


def test_identical_draft_is_always_accepted_when_sampling():
    rng = np.random.default_rng(0)
    p = np.array([0.2, 0.3, 0.5])
    p_target = np.stack([p, p, p])
    for _ in range(500):
        tokens = [sample(p, rng), sample(p, rng)]
        assert verify_sampled(tokens, p_target, [p, p], rng).n_accepted == 2


# ---- every method, sampled and greedy, through the harness -------------------------------------
@pytest.mark.parametrize("name", [name for name in SCENARIOS if name not in SWEPT_LONGER])
def test_sampling_is_lossless(name):
    """Chi-square against the oracle's exact joint, acceptance against its expectation, and the
    window long enough to matter: drafts verified at position 4 or deeper, and passes that
    drafted right after a full accept."""
    sampled, problems = run_scenario(name)
    assert problems == []
    seen = sampled.verified
    if SCENARIOS[name].method != "none":
        if SCENARIOS[name].window >= WINDOW and SCENARIOS[name].reaches_deep:  # a long-tail window is shorter
            assert seen.deepest >= DRAFT_LEN and seen.after_full_accept > 0, seen
        assert 0 < sampled.accepted < sampled.drafted
    if SCENARIOS[name].branches:  # siblings tried after a rejection: the residual's turn was checked
        assert seen.siblings_tested > 0, seen
    if SCENARIOS[name].draft_min_prob:  # the confidence stop cut some first passes short, not all
        assert seen.first_lengths[DRAFT_LEN] > 0 and sum(seen.first_lengths[k] for k in range(DRAFT_LEN)) > 0


def test_second_guesses_over_a_long_tail_emit_the_target_s_distribution():
    assert long_tail_sibling_problems() == []


def test_every_method_has_a_sampled_scenario():
    """A method added to specrun.drafters.methods joins the scenarios by itself, fixed and
    adaptive, and with trees where its drafter takes branches; the greedy cases likewise."""
    assert {scenario.method for scenario in SCENARIOS.values()} == set(METHODS) | set(CHAINS)
    branching = {method for method in METHODS if branches_taken(method)}
    assert "ngram" in branching  # the n-gram pool branches (specrun/drafters/ngram.py)
    assert {scenario.method for scenario in SCENARIOS.values() if scenario.branches} == branching
    assert {method for method, _, branches in GREEDY_CASES if branches} == branching
    assert {method for method, _, _ in GREEDY_CASES} == set(METHODS) | set(CHAINS)
    adaptive = {
        resolve_method(scenario.method)
        for scenario in SCENARIOS.values()
        if scenario.adaptive or is_adaptive(scenario.method)
    }
    assert adaptive == {resolve_method(method) for method in METHODS} - {"none"}


# Every method at -k 4, each adaptive as the CLI runs it, and the tree scenarios greedy.
GREEDY_CASES = (
    [(method, False, 0) for method in METHODS]
    + [(method, True, 0) for method in METHODS if method != "none" and not is_adaptive(method)]
    + [(scenario.method, scenario.adaptive, scenario.branches) for scenario in SCENARIOS.values() if scenario.branches]
    + [(chain, adaptive, 0) for chain in CHAINS for adaptive in (False, True)]
)


@pytest.mark.parametrize(("method", "adaptive", "branches"), GREEDY_CASES)
def test_greedy_output_equals_plain_decoding(method, adaptive, branches):
    problems, drafted, accepted = greedy_scenario(method, adaptive, branches)
    assert problems == []
    if method != "none":
        assert 0 < accepted < drafted  # both accepts and rejections happened
