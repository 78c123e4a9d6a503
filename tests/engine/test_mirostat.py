"""llama.cpp's mirostat (1 and 2): each row cut at the μ its text reached, as llama.cpp's own
sampler cuts it along the same text; the oracle's plain-Python rows; μ carried from step to step
and along each path of drafts (the lossless sweep's "draft mirostat" scenarios check the joint)."""

from __future__ import annotations

import ctypes
import dataclasses
import math

import numpy as np
import pytest

from fake_models import hashed_logits
from oracle import mirostat_distribution, mirostat_moved, state_rows
from specrun.backends.fake import FakeBackend
from specrun.drafters.base import Proposal
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.engine.passes import TargetPasses
from specrun.engine.stats import Stats
from specrun.mirostat import Mirostat, moved
from specrun.sampling import SamplingSettings, probabilities
from specrun.verify import TreeVerdict

VOCAB = 300


def _llama_mirostat(llama_cpp, settings: SamplingSettings, vocab: int):
    """llama.cpp's chain under mirostat, as common/sampling.cpp builds it: the temperature, then it."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(settings.temperature))
    mirostat = settings.mirostat
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_mirostat(
        vocab, 7, mirostat.tau, mirostat.eta, 100) if mirostat.version == 1 else
        llama_cpp.llama_sampler_init_mirostat_v2(7, mirostat.tau, mirostat.eta))
    return chain


@pytest.mark.parametrize("temperature", [0.8, 0.15])
@pytest.mark.parametrize("version", [1, 2])
def test_each_row_keeps_the_tokens_llama_cpp_s_mirostat_keeps_along_the_same_text(version, temperature):
    """llama.cpp's sampler draws each token and moves its own μ; specrun, given the same tokens,
    cuts every row to the same tokens with the same probabilities (float32's rounding apart): rows
    with forbidden tokens among them, and at 0.15 rows whose tail float32 holds as 0 (mirostat 1's
    fit is undefined there: its k is 1). Mirostat 1 aims at 1.5 bits: at 3 its μ climbs on these
    random rows until k passes 2^31, where llama.cpp's cast to int is undefined (1 on x86; every
    token, specrun's, where it saturates)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    settings = SamplingSettings(temperature=temperature, mirostat=Mirostat(version, tau=1.5 if version == 1 else 4.0,
                                                                            eta=0.3))
    rng = np.random.default_rng(version)
    chain = _llama_mirostat(llama_cpp, settings, VOCAB)
    mu, sizes = settings.mirostat.start, set()
    try:
        for _ in range(80):
            row = (rng.normal(size=VOCAB) * rng.choice([0.5, 2.0, 4.0])).astype(np.float32)
            if rng.random() < 0.25:  # a grammar's or a bias's -inf: fewer tokens than mirostat 1 fits over, at times
                row[rng.permutation(VOCAB)[rng.integers(3, 250):]] = -np.inf
            data = (llama_cpp.llama_token_data * VOCAB)(
                *[llama_cpp.llama_token_data(token, float(logit), 0.0) for token, logit in enumerate(row)])
            candidates = llama_cpp.llama_token_data_array(data, VOCAB, -1, False)
            llama_cpp.llama_sampler_apply(chain, ctypes.byref(candidates))
            kept = {candidates.data[i].id: candidates.data[i].p for i in range(candidates.size)
                    if candidates.data[i].p > 0.0}  # a forbidden token stays in llama.cpp's array at 0
            token = candidates.data[candidates.selected].id
            ours = probabilities(row, settings, state=mu)
            assert set(np.flatnonzero(ours)) == set(kept)
            assert np.allclose([ours[t] for t in kept], list(kept.values()), atol=1e-5)
            sizes.add(len(kept))
            mu = moved(mu, settings.mirostat, ours, token)
    finally:
        llama_cpp.llama_sampler_free(chain)
    assert len(sizes) >= 5  # rows cut to many sizes: μ moved


@pytest.mark.parametrize("version", [1, 2])
def test_the_rows_are_the_oracle_s(version):
    rng = np.random.default_rng(10 + version)
    for _ in range(60):
        vocab = int(rng.choice([3, 8, 150]))
        logits = rng.normal(size=vocab) * rng.choice([0.3, 1.0, 3.0])
        settings = SamplingSettings(temperature=float(rng.choice([0.5, 1.0, 1.4])),
                                    mirostat=Mirostat(version, tau=float(rng.choice([0.5, 2.0, 5.0])), eta=0.1))
        mu = float(rng.uniform(-1.0, 8.0))
        assert np.allclose(probabilities(logits, settings, state=mu), mirostat_distribution(logits, settings, mu),
                           atol=1e-12)
        row = probabilities(logits, settings, state=mu)
        token = int(row.argmax())
        assert moved(mu, settings.mirostat, row, token) == pytest.approx(
            mirostat_moved(mu, settings, row.tolist(), token))


def test_hand_values():
    """Mirostat 2 at temperature 1 on probabilities 0.5, 0.3, 0.2 (surprises 1, 1.74, 2.32 bits)."""
    logits = np.log([0.5, 0.3, 0.2])
    settings = SamplingSettings(temperature=1.0, mirostat=Mirostat(2, tau=1.0, eta=0.5))
    assert probabilities(logits, settings, state=2.0) == pytest.approx([0.625, 0.375, 0.0])  # 2.32 > 2
    assert probabilities(logits, settings, state=3.0) == pytest.approx([0.5, 0.3, 0.2])
    assert probabilities(logits, settings, state=0.5) == pytest.approx([1.0, 0.0, 0.0])  # none: the likeliest
    assert probabilities(logits, settings) == pytest.approx([0.625, 0.375, 0.0])  # μ's start: 2τ = 2 bits
    row = probabilities(logits, settings, state=2.0)
    # the token drawn at 0.375 (1.415 bits) moves μ by 0.5 (1 - 1.415)
    assert moved(2.0, settings.mirostat, row, 1) == pytest.approx(2.0 - 0.5 * (-math.log2(0.375) - 1.0))
    assert moved(2.0, settings.mirostat, row, 2) == -math.inf  # a token the row gave nothing
    assert probabilities(logits, settings, state=-math.inf) == pytest.approx([1.0, 0.0, 0.0])
    # mirostat 1 on an even row: its Zipf exponent is 0 and k undefined, so k is 1, and the tokens tied
    # with the likeliest stay (top-k's ties, as specrun's top-k keeps them): every one here
    even = SamplingSettings(temperature=1.0, mirostat=Mirostat(1, tau=3.0, eta=0.1))
    assert probabilities(np.zeros(4), even, state=6.0) == pytest.approx([0.25] * 4)
    # and on 0.5, 0.3, 0.2: s = 0.804 from the two ratios (log 5/3 on log 2, log 1.5 on log 1.5), ε = s - 1,
    # k = (ε 2^μ / (1 - 3^-ε))^(1/s): 0.78 at μ 0 (1 kept), 2.83 at 1.5, 10.3 at 3 (every token)
    s_hat = ((math.log(2) * math.log(5 / 3) + math.log(1.5) ** 2) / (math.log(2) ** 2 + math.log(1.5) ** 2))
    k_at = lambda mu: ((s_hat - 1) * 2**mu / (1 - 3 ** -(s_hat - 1))) ** (1 / s_hat)  # noqa: E731
    assert s_hat == pytest.approx(0.804, abs=1e-3)
    assert int(k_at(0.0)) == 0 and int(k_at(1.5)) == 2 and k_at(3.0) > 3
    assert probabilities(logits, even, state=0.0) == pytest.approx([1.0, 0.0, 0.0])
    assert probabilities(logits, even, state=1.5) == pytest.approx([0.625, 0.375, 0.0])
    assert probabilities(logits, even, state=3.0) == pytest.approx([0.5, 0.3, 0.2])
    # greedy settings stay the argmax
    assert probabilities(logits, SamplingSettings(temperature=0.0, mirostat=Mirostat(2))) == pytest.approx([1, 0, 0])


def test_the_other_samplers_are_off_under_it_as_in_llama_cpp_s_chain():
    settings = SamplingSettings(temperature=0.7, top_k=1, top_p=0.5, min_p=0.4, xtc_probability=1.0,
                                xtc_threshold=0.1, dynatemp_range=0.5, mirostat=Mirostat(2, tau=5.0))
    logits = np.log([0.5, 0.3, 0.2])
    tempered = np.exp(logits / 0.7) / np.exp(logits / 0.7).sum()
    assert probabilities(logits, settings, state=10.0) == pytest.approx(tempered)
    assert settings.chain == ("temperature",) and not settings.xtc_on and not settings.dynatemp_on
    assert settings.ahead_sampling(lambda: 0.5) is None  # drawn on the host, each row at its μ
    assert settings.describe() == "temperature 0.7, mirostat 2 (τ 5, η 0.1)"
    assert settings.fields()["mirostat"] == {"version": 2, "tau": 5.0, "eta": 0.1}


@pytest.mark.parametrize(("mirostat", "problem"), [
    (Mirostat(3), "--mirostat must be 0 (off), 1 or 2, got 3"),
    (Mirostat(2, tau=-1.0), "--mirostat-ent must be between 0 and 100 bits, got -1.0"),
    (Mirostat(1, tau=math.nan), "--mirostat-ent must be between 0 and 100 bits, got nan"),
    (Mirostat(2, eta=1.5), "--mirostat-lr must be between 0 and 1, got 1.5"),
])
def test_settings_out_of_range_are_named(mirostat, problem):
    assert SamplingSettings(temperature=0.8, mirostat=mirostat).validate() == [problem]


def test_off_its_target_and_rate_are_not_read():
    assert SamplingSettings(temperature=0.8, mirostat=Mirostat(0, tau=-1.0, eta=9.0)).validate() == []


def _pass_rows(settings: SamplingSettings, mu: float, proposal: Proposal, logits: np.ndarray):
    passes = TargetPasses(None)
    passes.text_state = mu
    return passes, passes.path_p_target(logits, settings, proposal)


def test_a_pass_s_rows_are_cut_at_the_mu_each_path_reaches_and_the_text_takes_the_kept_one_s():
    """A chain's rows follow one another; a tree's each follow its parent's; after the verdict
    the text's μ is the one its kept path and next token reach."""
    settings = SamplingSettings(temperature=1.0, mirostat=Mirostat(2, tau=1.0, eta=0.5))
    logits = np.log(np.array([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.4, 0.35, 0.25], [0.7, 0.2, 0.1]]))
    # a tree: node 0 (token 1) and node 1 (token 0) under the root, node 2 (token 2) under node 0
    tree = Proposal((1, 0, 2), parents=(-1, -1, 0), source="draft")
    passes, rows = _pass_rows(settings, 2.0, tree, logits)
    mu_node0 = moved(2.0, settings.mirostat, rows[0], 1)
    mu_node1 = moved(2.0, settings.mirostat, rows[0], 0)
    mu_node2 = moved(mu_node0, settings.mirostat, rows[1], 2)
    expected = [mirostat_distribution(logits[i], settings, mu) for i, mu in
                enumerate((2.0, mu_node0, mu_node1, mu_node2))]
    assert np.allclose(rows, expected)
    passes.took(TreeVerdict((0,), 0), settings)  # node 0 kept, then token 0 from its row
    assert passes.text_state == pytest.approx(moved(mu_node0, settings.mirostat, rows[1], 0))
    chain = Proposal((1, 0, 2), source="draft")
    _, rows = _pass_rows(settings, 2.0, chain, logits)
    mu = 2.0
    for i in range(4):
        assert np.allclose(rows[i], mirostat_distribution(logits[i], settings, mu))
        mu = moved(mu, settings.mirostat, rows[i], chain.tokens[i]) if i < 3 else mu


def test_plain_decoding_carries_mu_from_token_to_token_and_a_new_text_starts_over():
    """An engine without drafts draws each token from its row at the μ the text before reached (the
    oracle's, moved by each token), and leaves the text's μ where the last one took it; a second run
    starts from 2τ again (the same seed, the same text)."""
    table = hashed_logits(8, salt=3, spread=1.5)
    settings = SamplingSettings(temperature=1.0, seed=5, mirostat=Mirostat(2, tau=1.5, eta=0.8))
    engine = SpeculativeEngine(FakeBackend(table, 8))
    params = GenerationParams(max_new_tokens=40, draft_len=0, sampling=settings, stop_at_eos=False)
    prompt = (1, 2, 3)
    first = list(engine.run(prompt, params).token_ids)
    assert list(engine.run(prompt, params).token_ids) == first
    mu, kept = settings.mirostat.start, set()
    for at, token in enumerate(first):
        row = mirostat_distribution(table(prompt + tuple(first[:at])), settings, mu)
        assert row[token] > 0.0
        kept.add(sum(p > 0.0 for p in row))
        mu = mirostat_moved(mu, settings, row, token)
    assert engine.passes.text_state == pytest.approx(mu)
    assert kept >= {1, 2}  # rows cut to one token and to more: μ moved


def test_drafters_draw_at_the_mu_the_text_reached():
    """A draft drawn from any row is exact; drawn at the text's μ, the draft's rows are nearer the target's."""
    settings = SamplingSettings(temperature=1.0, mirostat=Mirostat(2, tau=1.0, eta=0.5))
    engine = SpeculativeEngine(FakeBackend(hashed_logits(3, salt=1), 3))
    engine.passes.text_state = 0.5
    drafting = engine._drafting(settings)
    assert drafting.mirostat == Mirostat(2, 1.0, 0.5, mu=0.5) and drafting.mirostat.fields() == settings.mirostat.fields()
    logits = np.log([0.5, 0.3, 0.2])
    assert probabilities(logits, drafting) == pytest.approx([1.0, 0.0, 0.0])  # at 0.5 bits: the likeliest alone
    assert probabilities(logits, settings) == pytest.approx([0.625, 0.375, 0.0])  # at its start, 2 bits
    assert engine._drafting(SamplingSettings(temperature=1.0)) == SamplingSettings(temperature=1.0)


@pytest.mark.parametrize("scenario", ["draft mirostat", "draft tree mirostat", "draft adaptive-p",
                                      "draft tree adaptive-p"])
def test_sampled_log_probabilities_are_each_token_s_row_at_its_text_s_state(scenario):
    """A request's log-probabilities after the settings (llama-server's post_sampling_probs): each
    emitted token's under its row at the state its text reached (mirostat's μ, adaptive-p's average:
    the oracle's ``state_rows``), the prefill's token's too, drafts kept or not (the sweep's windows
    of three tokens see little of a state the prefill's token did not move)."""
    from lossless_harness import PROMPT, SCENARIOS, SETTINGS, _target_table, fake_engine

    engine, table = fake_engine(SCENARIOS[scenario]), _target_table(SCENARIOS[scenario].vocab)
    settings = SETTINGS[SCENARIOS[scenario].setting]
    along = state_rows(table, PROMPT, settings)
    checked = 0
    for seed in range(12):
        params = GenerationParams(max_new_tokens=8, draft_len=4, sampling=dataclasses.replace(settings, seed=seed),
                                  stop_at_eos=False, logprobs=2, logprobs_sampled=True)
        logprobs = [entry for step in engine.steps(PROMPT, params, Stats()) for entry in step.logprobs]
        output = tuple(engine.last_context[len(PROMPT):])
        for at, token in enumerate(output):
            assert logprobs[at].token == token
            assert math.exp(logprobs[at].logprob) == pytest.approx(along(output[:at])[token])
            checked += 1
    assert checked == 12 * 8
