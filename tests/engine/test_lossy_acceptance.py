"""Lossy acceptance (--accept typical, --accept margin): the rules' decisions on hand-made rows,
the engine running them (and labelling them), the exact default left as it was."""

from __future__ import annotations

import numpy as np
import pytest

from fake_models import hashed_logits
from specrun.backends.fake import FakeBackend
from specrun.drafters.draft_model import DraftModelDrafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.engine.passes import Verification
from specrun.engine.stats import Stats
from specrun.sampling import SamplingSettings
from specrun.tree import TokenTree
from specrun.verify import (
    LossyAcceptance, margin_accepts, typical_accepts, verify_lossy, verify_tree_greedy, verify_tree_lossy,
)

VOCAB = 50
TYPICAL = LossyAcceptance("typical")
PROMPT = [1, 2, 3]


# ---- the rules on hand-made rows ------------------------------------------------------------
def test_typical_acceptance_takes_the_smaller_threshold():
    peaked = [0.9, 0.08, 0.02]  # H = 0.375 nats: 0.3 exp(-H) = 0.206, so epsilon (0.09) decides
    flat = [0.05] * 20  # H = ln 20: 0.3 exp(-H) = 0.015 decides, below epsilon
    assert typical_accepts([0, 1, 2], np.array([peaked] * 3), 0.09, 0.3).tolist() == [True, False, False]
    assert typical_accepts([7], np.array([flat]), 0.09, 0.3).tolist() == [True]
    # the same probability on a peaked row (H = 0.394: epsilon decides) is refused
    assert typical_accepts([1], np.array([[0.9, 0.05, 0.05]]), 0.09, 0.3).tolist() == [False]


def test_typical_acceptance_is_strict_and_never_takes_an_impossible_token():
    row = [0.5, 0.25, 0.25, 0.0]  # 0.9 exp(-H) = 0.318 > epsilon 0.25: the threshold is 0.25 itself
    assert typical_accepts([1, 0, 3], np.array([row] * 3), 0.25, 0.9).tolist() == [False, True, False]


def test_margin_acceptance_compares_with_the_top_token():
    row = [0.5, 0.25, 0.2, 0.05, 0.0]
    rows = np.array([row] * 5)
    assert margin_accepts([0, 1, 2, 3, 4], rows, 2.0).tolist() == [True, True, False, False, False]
    assert margin_accepts([0, 1, 2, 3, 4], rows, 1.0).tolist() == [True, False, False, False, False]
    assert margin_accepts([0, 1, 2, 3, 4], rows, 1e9).tolist() == [True, True, True, True, False]


def test_a_chain_keeps_drafts_until_the_first_the_rule_refuses():
    p_target = np.array([
        [0.6, 0.3, 0.1],  # draft 1: 0.3 >= 0.6 / 2
        [0.2, 0.7, 0.1],  # draft 0: 0.2 < 0.7 / 2, refused
        [0.1, 0.1, 0.8],  # draft 2 would pass, after a refusal it is not looked at
        [0.3, 0.3, 0.4],
    ])
    margin = LossyAcceptance("margin", factor=2.0)
    verdict = verify_lossy([1, 0, 2], p_target, margin)
    assert (verdict.n_accepted, verdict.next_token) == (1, 1)  # T = 0: the argmax of the row after
    everything = verify_lossy([1, 1, 2], p_target, margin)
    assert (everything.n_accepted, everything.next_token) == (3, 2)  # the bonus token from the last row
    # T > 0: the token after is drawn from that row (here one-hot, so certain)
    one_hot = p_target.copy()
    one_hot[1] = [0.0, 1.0, 0.0]
    sampled = verify_lossy([1, 0, 2], one_hot, margin, np.random.default_rng(0))
    assert (sampled.n_accepted, sampled.next_token) == (1, 1)


def test_a_tree_keeps_the_deepest_path_the_rule_accepts():
    # root -> 0 (token 1) -> 2 (token 2); root -> 1 (token 0) -> 3 (token 1) -> 4 (token 2)
    tree = TokenTree((1, 0, 2, 1, 2), (-1, -1, 0, 1, 3))
    p_target = np.array([
        [0.45, 0.55, 0.0],  # the root's row: both children pass a margin of 2
        [0.0, 0.1, 0.9],  # after node 0: token 2 passes
        [0.0, 0.6, 0.4],  # after node 1: token 1 passes
        [1.0, 0.0, 0.0],
        [0.3, 0.0, 0.7],  # after node 3: token 2 passes
        [0.0, 0.0, 1.0],
    ])
    verdict = verify_tree_lossy(tree, p_target, LossyAcceptance("margin", factor=2.0))
    assert (verdict.path, verdict.next_token) == ((1, 3, 4), 2)
    # the greedy rule, which shares the search, takes only argmax children: node 0, then node 2
    assert verify_tree_greedy(tree, p_target.argmax(axis=-1)).path == (0, 2)


@pytest.mark.parametrize(("acceptance", "problem"), [
    (LossyAcceptance("typical", epsilon=0.0), "--epsilon must be in (0, 1), got 0"),
    (LossyAcceptance("typical", epsilon=1.0), "--epsilon must be in (0, 1), got 1"),
    (LossyAcceptance("typical", delta=1.0), "--delta must be in (0, 1), got 1"),
    (LossyAcceptance("margin", factor=0.5), "--margin must be at least 1 and finite, got 0.5"),
    (LossyAcceptance("margin", factor=float("nan")), "--margin must be at least 1 and finite, got nan"),
    (LossyAcceptance("margin", factor=float("inf")), "--margin must be at least 1 and finite, got inf"),
])
def test_settings_out_of_range_are_named(acceptance, problem):
    assert acceptance.validate() == [problem]
    assert LossyAcceptance("typical").validate() == LossyAcceptance("margin").validate() == []


# ---- through the engine ---------------------------------------------------------------------
def target_table():
    return hashed_logits(VOCAB, 1, spread=2.0)


def noisy_draft_table():
    target, noise = target_table(), hashed_logits(VOCAB, 7, spread=1.5)
    return lambda context: target(context) + noise(context)


def run(acceptance: LossyAcceptance | None, temperature: float, draft_table=None, branches: int = 0, n: int = 150):
    target = FakeBackend(target_table(), VOCAB)
    draft = FakeBackend(draft_table or noisy_draft_table(), VOCAB)
    engine = SpeculativeEngine(target, DraftModelDrafter(draft, branches=branches),
                               verification=Verification(acceptance=acceptance))
    params = GenerationParams(n, 4, SamplingSettings(temperature, seed=3), tree_nodes=12 if branches else 0)
    result = engine.run(PROMPT, params)
    assert engine.target.tokens == PROMPT + result.token_ids  # the caches hold exactly the text
    return result


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_typical_acceptance_accepts_more_than_exact_on_a_fake_pair(temperature):
    exact, lossy = run(None, temperature), run(TYPICAL, temperature)
    assert lossy.stats.acceptance_rate > exact.stats.acceptance_rate + 0.15, (lossy.stats, exact.stats)
    assert lossy.stats.mean_tokens_per_step > exact.stats.mean_tokens_per_step
    assert lossy.token_ids != exact.token_ids or temperature > 0  # greedy: the text is not the target's


@pytest.mark.parametrize("acceptance", [TYPICAL, LossyAcceptance("margin", factor=3.0)])
@pytest.mark.parametrize("branches", [0, 2])
def test_greedy_lossy_text_is_accepted_drafts_or_the_targets_argmax(acceptance, branches):
    """At T = 0 every token is either the target's argmax or a draft the rule accepts on the
    target's distribution at temperature 1: judged here on the fake's own table."""
    table = target_table()
    result = run(acceptance, 0.0, branches=branches)
    context, relaxed = list(PROMPT), 0
    for token in result.token_ids:
        logits = table(tuple(context)).astype(np.float64)
        p_target = np.exp(logits - logits.max())
        p_target /= p_target.sum()
        if token != p_target.argmax():
            assert acceptance.accepts([token], p_target[None])[0]
            relaxed += 1
        context.append(token)
    assert relaxed > 0  # the rule let a non-argmax draft through


@pytest.mark.parametrize("acceptance", [TYPICAL, LossyAcceptance("margin", factor=3.0)])
def test_greedy_lossy_with_a_perfect_draft_is_plain_decoding(acceptance):
    """The target's top token always passes either rule (delta < 1), and the token after the
    accepted drafts is the argmax: a draft equal to the target leaves nothing to relax."""
    plain = SpeculativeEngine(FakeBackend(target_table(), VOCAB)).run(PROMPT, GenerationParams(150, 0))
    result = run(acceptance, 0.0, draft_table=target_table())
    assert result.token_ids == plain.token_ids
    assert result.stats.acceptance_rate == 1.0


def test_the_default_is_exact_and_unlabelled():
    result = run(None, 1.0)
    assert result.stats.acceptance == "exact" and not result.stats.lossy
    assert result.stats.to_dict()["acceptance"] == "exact"
    assert "lossy" not in result.stats.summary()
    assert Verification().label == "exact" and Verification("token").label == "exact"
    assert SpeculativeEngine(FakeBackend(target_table(), VOCAB)).passes.acceptance is None


@pytest.mark.parametrize(("acceptance", "label"), [(TYPICAL, "typical (lossy)"),
                                                   (LossyAcceptance("margin"), "margin (lossy)")])
def test_a_lossy_run_says_so_in_its_statistics(acceptance, label):
    stats = run(acceptance, 0.7, n=40).stats
    assert stats.acceptance == label and stats.lossy
    assert stats.to_dict()["acceptance"] == label
    assert stats.summary().endswith(f"; acceptance {label}: not the target's own text")
    summed = Stats()
    summed.add(stats)  # a chat's total over its answers
    assert summed.acceptance == label


def test_sampled_lossy_trees_verify_and_keep_the_caches_exact():
    result = run(TYPICAL, 1.0, branches=2)  # run() checks the caches
    assert result.stats.accepted > 0 and len(result.token_ids) == 150
