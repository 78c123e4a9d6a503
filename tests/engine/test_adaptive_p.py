"""llama.cpp's adaptive-p: each row reshaped towards the tokens near a target the text's average adapts,
as llama.cpp's own sampler reshapes it along the same text; the oracle's plain-Python rows; the
average carried from step to step and along each path of drafts (the lossless sweep's "draft
adaptive-p" scenarios check the joint)."""

from __future__ import annotations

import ctypes
import dataclasses
import math

import numpy as np
import pytest

from fake_models import hashed_logits
from oracle import adaptive_distribution
from specrun.adaptive_p import AdaptiveP, moved
from specrun.backends.fake import FakeBackend
from specrun.drafters.base import Proposal
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.engine.passes import TargetPasses
from specrun.mirostat import Mirostat
from specrun.sampling import SamplingSettings, chain_probabilities, probabilities
from specrun.verify import TreeVerdict

VOCAB = 300


@pytest.mark.parametrize(("min_p", "temperature"), [(0.0, 0.8), (0.05, 0.8), (0.0, 0.01)])
def test_each_row_is_llama_cpp_s_adaptive_p_row_along_the_same_text(min_p, temperature):
    """llama.cpp's chain (min-p where on, the temperature, adaptive-p) draws each token and moves its
    own average when told the token (its accept); specrun, given the same tokens, reshapes every row
    alike (float32's rounding apart). At 0.01 with nothing cutting, most of a row's tokens hold 0
    (in float32, and in float64 too where a logit is 7.5 below the top): every finite logit is a
    candidate all the same, as llama.cpp's."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    settings = SamplingSettings(temperature=temperature, min_p=min_p, adaptive_p=AdaptiveP(0.3, decay=0.7))
    rng = np.random.default_rng(3)
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    if min_p:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_min_p(min_p, 1))
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(settings.temperature))
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_adaptive_p(0.3, 0.7, 11))
    state, targets = settings.adaptive_p.start, set()
    try:
        for _ in range(60):
            row = (rng.normal(size=VOCAB) * rng.choice([1.0, 2.0, 4.0])).astype(np.float32)
            if rng.random() < 0.25:  # a grammar's or a bias's -inf stays out
                row[rng.permutation(VOCAB)[rng.integers(3, 250):]] = -np.inf
            data = (llama_cpp.llama_token_data * VOCAB)(
                *[llama_cpp.llama_token_data(token, float(logit), 0.0) for token, logit in enumerate(row)])
            candidates = llama_cpp.llama_token_data_array(data, VOCAB, -1, False)
            llama_cpp.llama_sampler_apply(chain, ctypes.byref(candidates))
            theirs = np.zeros(VOCAB)
            for i in range(candidates.size):
                theirs[candidates.data[i].id] = candidates.data[i].p
            token = candidates.data[candidates.selected].id
            llama_cpp.llama_sampler_accept(chain, token)
            ours = probabilities(row, settings, state=state)
            assert np.allclose(ours, theirs, atol=1e-5)
            targets.add(round(min(1.0, max(0.0, 2 * 0.3 - state[0] / state[1])), 2))
            state = moved(state, settings.adaptive_p, chain_probabilities(row, settings), token)
    finally:
        llama_cpp.llama_sampler_free(chain)
    assert len(targets) >= 5  # the adapted target moved


def test_the_rows_are_the_oracle_s():
    rng = np.random.default_rng(5)
    for _ in range(60):
        vocab = int(rng.choice([3, 8, 150]))
        logits = rng.normal(size=vocab) * rng.choice([0.3, 1.0, 3.0])
        settings = SamplingSettings(temperature=float(rng.choice([0.5, 1.0, 1.4])), min_p=float(rng.choice([0.0, 0.1])),
                                    adaptive_p=AdaptiveP(float(rng.uniform(0.0, 1.0)), decay=0.8))
        average = (float(rng.uniform(0.0, 5.0)), float(rng.uniform(0.0, 5.0)))
        original, row = adaptive_distribution(logits, settings, average)
        assert np.allclose(probabilities(logits, settings, state=average), row, atol=1e-12)
        assert np.allclose(chain_probabilities(logits, settings), original, atol=1e-12)


def test_hand_values():
    """Target 0.5 on probabilities 0.5, 0.3, 0.2 at its start (the average its target): the token at
    0.5 takes logit 5, the others 5 - 10 d² / (1 + d) at d = 0.2 / 0.3 and 0.3 / 0.3."""
    logits = np.log([0.5, 0.3, 0.2])
    settings = SamplingSettings(temperature=1.0, adaptive_p=AdaptiveP(0.5, decay=0.5))
    d1, d2 = 2 / 3, 1.0
    reshaped = np.exp([5.0, 5.0 - 10 * d1 * d1 / (1 + d1), 5.0 - 10 * d2 * d2 / (1 + d2)])
    assert probabilities(logits, settings) == pytest.approx(reshaped / reshaped.sum())
    assert settings.adaptive_p.start == (1.0, 2.0)  # 0.5 / (1 - 0.5), 1 / (1 - 0.5)
    # the text chose a token at 0.3 (before the reshaping): 0.3 + 0.5 · 1, 1 + 0.5 · 2
    assert moved((1.0, 2.0), settings.adaptive_p, np.array([0.5, 0.3, 0.2]), 1) == pytest.approx((0.8, 2.0))
    # its average 0.4 under the target: the next row aims at 2 · 0.5 - 0.4 = 0.6
    d = np.abs(np.array([0.5, 0.3, 0.2]) - 0.6) / 0.3
    aimed = np.exp(5.0 - 10 * d * d / (1 + d))
    assert probabilities(logits, settings, state=(0.8, 2.0)) == pytest.approx(aimed / aimed.sum())
    # a token the chain left out stays out (min-p 0.5 keeps 0.5 and 0.3, each at least half the likeliest)
    cut = dataclasses.replace(settings, min_p=0.5)
    assert probabilities(logits, cut)[2] == 0.0 and probabilities(logits, cut)[:2].sum() == pytest.approx(1.0)
    assert probabilities(logits, dataclasses.replace(settings, temperature=0.0)) == pytest.approx([1, 0, 0])


def test_on_from_a_target_of_0_its_settings_checked_and_told():
    assert not AdaptiveP().on and AdaptiveP(0.0).on
    assert SamplingSettings(temperature=0.8, adaptive_p=AdaptiveP(-5.0, decay=7.0)).validate() == []  # off: unread
    assert SamplingSettings(temperature=0.8, adaptive_p=AdaptiveP(1.5)).validate() == [
        "--adaptive-target must be at most 1 (below 0: off), got 1.5"]
    assert SamplingSettings(temperature=0.8, adaptive_p=AdaptiveP(0.5, decay=math.nan)).validate() == [
        "--adaptive-decay must be between 0 and 0.99, got nan"]
    beside_xtc = SamplingSettings(temperature=0.8, xtc_probability=0.5, adaptive_p=AdaptiveP(0.5))
    assert beside_xtc.validate()[0].startswith("--adaptive-target beside --xtc-probability")
    settings = SamplingSettings(temperature=0.8, min_p=0.05, adaptive_p=AdaptiveP(0.4, decay=0.9))
    assert settings.describe() == "temperature 0.8, min-p 0.05, adaptive-p 0.4 (decay 0.9)"
    assert settings.fields()["adaptive_p"] == {"target": 0.4, "decay": 0.9}
    assert settings.ahead_sampling(lambda: 0.5) is None  # drawn on the host, each row at its average
    # off under mirostat, as in llama.cpp's chain
    assert not SamplingSettings(temperature=0.8, mirostat=Mirostat(2), adaptive_p=AdaptiveP(0.4)).adaptive_on


def test_a_pass_s_rows_take_the_average_each_path_reaches():
    """A tree's nodes each from their parent's average and draft, before the reshaping; the text's
    average after the verdict from the kept path and the token after it."""
    settings = SamplingSettings(temperature=1.0, adaptive_p=AdaptiveP(0.5, decay=0.5))
    logits = np.log(np.array([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.4, 0.35, 0.25], [0.7, 0.2, 0.1]]))
    tree = Proposal((1, 0, 2), parents=(-1, -1, 0), source="draft")
    passes = TargetPasses(None)
    passes.start_text(settings)
    rows = passes.path_p_target(logits, settings, tree)
    originals = np.exp(logits)
    start = settings.adaptive_p.start
    at_node0 = moved(start, settings.adaptive_p, originals[0], 1)
    at_node1 = moved(start, settings.adaptive_p, originals[0], 0)
    at_node2 = moved(at_node0, settings.adaptive_p, originals[1], 2)
    for row, average in enumerate((start, at_node0, at_node1, at_node2)):
        assert np.allclose(rows[row], adaptive_distribution(logits[row], settings, average)[1])
    passes.took(TreeVerdict((0, 2), 1), settings)  # nodes 0 and 2 kept, then token 1 from node 2's row
    assert passes.text_state == pytest.approx(moved(at_node2, settings.adaptive_p, originals[3], 1))


def test_plain_decoding_carries_the_average_from_token_to_token():
    """An engine without drafts draws each token from its row at the average the text before reached,
    and leaves the text's average where the last token took it; a second run starts over."""
    table = hashed_logits(8, salt=4, spread=1.5)
    settings = SamplingSettings(temperature=1.0, seed=2, adaptive_p=AdaptiveP(0.2, decay=0.6))
    engine = SpeculativeEngine(FakeBackend(table, 8))
    params = GenerationParams(max_new_tokens=40, draft_len=0, sampling=settings, stop_at_eos=False)
    prompt = (1, 2, 3)
    first = list(engine.run(prompt, params).token_ids)
    assert list(engine.run(prompt, params).token_ids) == first
    average = settings.adaptive_p.start
    for at, token in enumerate(first):
        original, row = adaptive_distribution(table(prompt + tuple(first[:at])), settings, average)
        assert row[token] > 0.0
        average = moved(average, settings.adaptive_p, np.array(original), token)
    assert engine.passes.text_state == pytest.approx(average)
