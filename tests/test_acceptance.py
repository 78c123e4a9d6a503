"""Losslessness of the acceptance rules, proved statistically on tabulated fake models."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from scipy import stats as scipy_stats

import specrun.engine
from fake_models import exact_joint, make_pair
from specrun.drafters.base import Proposal
from specrun.drafters.draft_model import DraftModelDrafter
from specrun.engine import GenerationParams, SpeculativeEngine
from specrun.sampling import SamplingSettings, probabilities, sample
from specrun.stats import Stats
from specrun.verify import Verdict, acceptance_probability, verify_greedy, verify_sampled

VOCAB = 5
PROMPT = (0, 3)
N_TOKENS = 4  # the first token from the prefill, then the first verify pass drafts from it
RUNS = 50_000  # the main harness; variants use fewer runs to keep the suite fast
VARIANT_RUNS = 20_000
NEGATIVE_RUNS = 5_000


def chi_square_p(counts: Counter, joint: dict, runs: int) -> float:
    """p-value of observed continuation counts against the exact joint distribution."""
    impossible = [seq for seq, prob in joint.items() if prob == 0.0 and counts.get(seq)]
    assert not impossible, f"sequences with zero probability were produced: {impossible[:3]}"
    cells = sorted(joint, key=joint.get)
    observed, expected = [], []
    pooled_obs = pooled_exp = 0.0
    for seq in cells:  # pool the rare cells so every expected count is >= 5
        if joint[seq] * runs < 5:
            pooled_obs += counts.get(seq, 0)
            pooled_exp += joint[seq] * runs
        else:
            observed.append(counts.get(seq, 0))
            expected.append(joint[seq] * runs)
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    expected = np.array(expected) * (sum(observed) / sum(expected))
    return float(scipy_stats.chisquare(observed, expected).pvalue)


def sample_first_tokens(engine: SpeculativeEngine, sampling: SamplingSettings, draft_len: int, runs: int):
    """Run the engine ``runs`` times with seeds 0..runs-1.

    Returns counts of the first N_TOKENS sequences, and for each run whether the first
    draft (drafted right after the first token) was accepted.
    """
    counts: Counter = Counter()
    first_drafted: list[bool] = []
    for seed in range(runs):
        params = GenerationParams(
            max_new_tokens=N_TOKENS,
            draft_len=draft_len,
            sampling=SamplingSettings(
                temperature=sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                min_p=sampling.min_p,
                seed=seed,
            ),
        )
        steps = list(engine.steps(PROMPT, params, Stats()))
        context = engine.last_context
        counts[tuple(context[len(PROMPT) : len(PROMPT) + N_TOKENS])] += 1
        assert steps[0].n_drafted == 0  # the first token comes from the prefill pass
        assert steps[1].n_drafted > 0  # the first verify pass drafts right after it
        first_drafted.append(steps[1].n_accepted >= 1)
    return counts, first_drafted


def expected_first_acceptance(target_table, accept_probability, sampling: SamplingSettings) -> float:
    """Acceptance at the first drafted position: the one after the prompt and the first
    token, which the target samples from the prefill's distribution."""
    first = probabilities(target_table(PROMPT), sampling)
    return float(sum(first[token] * accept_probability((*PROMPT, token)) for token in range(VOCAB)))


def measured_rate(first_drafted: list[bool]) -> float:
    return sum(first_drafted) / len(first_drafted)


@pytest.mark.parametrize(
    ("sampling", "runs"),
    [
        (SamplingSettings(temperature=1.0), RUNS),
        (SamplingSettings(temperature=0.7, top_k=4, top_p=0.9), VARIANT_RUNS),
    ],
    ids=["temp1", "temp0.7-topk4-topp0.9"],
)
def test_draft_model_sampling_is_lossless(sampling, runs):
    target, draft = make_pair(VOCAB)
    engine = SpeculativeEngine(target, DraftModelDrafter(draft))
    counts, first_drafted = sample_first_tokens(engine, sampling, draft_len=2, runs=runs)

    joint = exact_joint(target.table, PROMPT, N_TOKENS, VOCAB, sampling)
    assert chi_square_p(counts, joint, runs) > 0.001

    def sum_min(context):
        return acceptance_probability(
            probabilities(target.table(context), sampling), probabilities(draft.table(context), sampling)
        )

    expected_rate = expected_first_acceptance(target.table, sum_min, sampling)
    assert abs(measured_rate(first_drafted) - expected_rate) < 0.01, (measured_rate(first_drafted), expected_rate)


class FixedDrafter:
    """A deterministic drafter (like prompt lookup): always proposes the same tokens."""

    name = "fixed"

    def __init__(self, tokens):
        self.tokens = tuple(tokens)

    def propose(self, context, draft_len, sampling, rng):
        return Proposal(self.tokens[:draft_len], source=self.name)

    def finish(self, context):
        pass

    def close(self):
        pass


def test_one_hot_proposals_are_lossless():
    target, _ = make_pair(VOCAB)
    engine = SpeculativeEngine(target, FixedDrafter([1, 1, 2]))
    sampling = SamplingSettings(temperature=1.0)
    counts, first_drafted = sample_first_tokens(engine, sampling, draft_len=3, runs=VARIANT_RUNS)
    joint = exact_joint(target.table, PROMPT, N_TOKENS, VOCAB, sampling)
    assert chi_square_p(counts, joint, VARIANT_RUNS) > 0.001
    # A one-hot proposal x is accepted with probability p_target(x).
    expected_rate = expected_first_acceptance(
        target.table, lambda context: probabilities(target.table(context), sampling)[1], sampling
    )
    assert abs(measured_rate(first_drafted) - expected_rate) < 0.01


def accept_everything(draft_tokens, p_target, p_draft, rng):
    return Verdict(len(draft_tokens), sample(p_target[len(draft_tokens)], rng))


def resample_from_target(draft_tokens, p_target, p_draft, rng):
    """Wrong on purpose: rejects correctly but resamples from p_target, not the residual."""
    for i, token in enumerate(draft_tokens):
        if p_draft[i] is None or rng.random() * p_draft[i][token] >= p_target[i][token]:
            return Verdict(i, sample(p_target[i], rng))
    return Verdict(len(draft_tokens), sample(p_target[len(draft_tokens)], rng))


@pytest.mark.parametrize("wrong_verifier", [accept_everything, resample_from_target])
def test_harness_rejects_a_wrong_verifier(monkeypatch, wrong_verifier):
    monkeypatch.setattr(specrun.engine, "verify_sampled", wrong_verifier)
    target, draft = make_pair(VOCAB)
    engine = SpeculativeEngine(target, DraftModelDrafter(draft))
    sampling = SamplingSettings(temperature=1.0)
    counts, _ = sample_first_tokens(engine, sampling, draft_len=2, runs=NEGATIVE_RUNS)
    joint = exact_joint(target.table, PROMPT, N_TOKENS, VOCAB, sampling)
    assert chi_square_p(counts, joint, NEGATIVE_RUNS) < 0.001


def test_verify_greedy_counts_matches_and_bonus():
    assert verify_greedy([5, 6, 7], [5, 6, 9, 1]) == Verdict(2, 9)
    assert verify_greedy([5, 6, 7], [5, 6, 7, 1]) == Verdict(3, 1)  # all accepted: bonus token
    assert verify_greedy([], [4]) == Verdict(0, 4)  # plain decoding
    assert verify_greedy([3], [4, 0]) == Verdict(0, 4)


def test_verify_sampled_never_emits_a_rejected_one_hot_token():
    rng = np.random.default_rng(0)
    p_target = np.array([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    for _ in range(2000):
        verdict = verify_sampled([0], p_target, [None], rng)
        if verdict.n_accepted == 0:
            assert verdict.next_token == 1  # the residual excludes the rejected token 0


def test_identical_draft_is_always_accepted_when_sampling():
    rng = np.random.default_rng(0)
    p = np.array([0.2, 0.3, 0.5])
    p_target = np.stack([p, p, p])
    for _ in range(500):
        tokens = [sample(p, rng), sample(p, rng)]
        assert verify_sampled(tokens, p_target, [p, p], rng).n_accepted == 2


def test_adaptive_draft_lengths_keep_sampling_lossless():
    """As `specrun generate` runs a draft model without -k: each step's length and the gate's
    plain stretches are chosen from earlier steps only (acceptance learned over the runs
    before), never from the step's own samples, so the output's distribution is the target's."""
    from test_adaptive import CostedFake, SimClock

    runs = VARIANT_RUNS
    clock = SimClock()
    target, draft = make_pair(VOCAB)
    target = CostedFake(target.table, clock, 1.0, 0.02, vocab_size=VOCAB)
    draft = CostedFake(draft.table, clock, 0.02, 0.02, vocab_size=VOCAB)
    engine = SpeculativeEngine(target, DraftModelDrafter(draft), clock=clock)
    sampling = SamplingSettings(temperature=1.0)
    counts: Counter = Counter()
    lengths: Counter = Counter()
    for seed in range(runs):
        params = GenerationParams(N_TOKENS, draft_len=8, sampling=SamplingSettings(temperature=1.0, seed=seed),
                                  adaptive=True)
        steps = list(engine.steps(PROMPT, params, Stats()))
        counts[tuple(engine.last_context[len(PROMPT) : len(PROMPT) + N_TOKENS])] += 1
        lengths.update(step.n_drafted for step in steps[1:])
    assert len([k for k in lengths if k > 0]) >= 2, lengths  # the controller drafted more than one length
    joint = exact_joint(target.table, PROMPT, N_TOKENS, VOCAB, sampling)
    assert chi_square_p(counts, joint, runs) > 0.001
