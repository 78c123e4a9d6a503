"""Sampled plain steps on MLX read one token ahead, each token drawn on the device
(backends/mlx.drawn_on_device) by the Gumbel-max trick, its noise keyed by one uniform of the
run's generator a step (sampling.AheadSampling): temperature, top-k and min-p there. The draws
follow the host's distribution (chi-square over many keys, rows with ties, forbidden tokens and
top-k cuts), never a token the settings leave out; a seed gives one text."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.penalties import Penalties
from specrun.sampling import SAMPLER_ORDER, SamplingSettings, probabilities

pytest.importorskip("mlx_lm", reason="the mlx backend is not installed")

DRAWS = 6000
ALPHA = 1e-3


def test_tokens_drawn_on_the_device_follow_the_host_s_distribution():
    import mlx.core as mx

    from specrun.backends.mlx import drawn_on_device

    rng = np.random.default_rng(5)
    for case in range(6):
        vocab = int(rng.integers(4, 24))
        temperature = float(rng.choice([0.5, 1.0, 1.6]))
        # min-p on the model's own distribution (llama.cpp's order), or on the tempered one
        order = ("temperature", "top_k") if case == 3 else SAMPLER_ORDER  # min-p after the samplers named
        settings = SamplingSettings(temperature=0.5 if case == 3 else temperature, top_k=[0, 3, 5, 0, 2, 40][case],
                                    min_p=[0.0, 0.0, 0.05, 0.2, 0.0, 0.1][case], order=order)
        row = rng.normal(0.0, 1.5, vocab).astype(np.float32)
        row[rng.integers(vocab, size=2)] = row.max()  # a tie at the top (and at a top-k cut)
        row[rng.integers(vocab)] = -math.inf  # forbidden by a bias
        p = probabilities(row, settings)
        rows = mx.array(row[None])
        uniforms = rng.random(DRAWS)
        drawn = np.array([int(np.array(drawn_on_device(mx, rows, settings, float(u)))[0]) for u in uniforms])
        counts = np.bincount(drawn, minlength=vocab)
        assert counts[p == 0].sum() == 0, (settings, counts, p)  # never a token the settings leave out
        kept = p > 0
        assert scipy_stats.chisquare(counts[kept], p[kept] * DRAWS).pvalue > ALPHA, (settings, counts, p)


@pytest.mark.parametrize("settings", [SamplingSettings(temperature=0.9, seed=3),
                                      SamplingSettings(temperature=1.2, top_k=20, min_p=0.02, seed=4),
                                      SamplingSettings(temperature=0.8, seed=5, penalties=Penalties(repeat=1.5, last_n=8))],
                         ids=["temperature", "top-k and min-p", "under penalties"])
def test_mlx_sampled_plain_decoding_reads_ahead_and_a_seed_gives_one_text(looping_llama, settings, monkeypatch):
    """A seeded plain run draws every step's token on the device, reading ahead; the seed gives
    the same text again, another seed another."""
    from specrun.backends.mlx import MlxBackend

    target = MlxBackend(looping_llama["mlx"], n_ctx=512)
    drawn = []
    real = target.forward_argmax_ahead
    monkeypatch.setattr(target, "forward_argmax_ahead",
                        lambda token, ahead=True, shaping=None, **named: drawn.append(
                            named.get("drawn") is not None) or real(token, ahead, shaping, named.get("drawn")))
    try:
        prompt = target.tokenize("for i in range(10):\n    print(i)\n")
        params = GenerationParams(64, 0, sampling=settings, stop_at_eos=False)
        ahead = list(SpeculativeEngine(target).run(prompt, params, complete_cache=False).token_ids)
        assert len(drawn) >= 62 and all(drawn)
        again = list(SpeculativeEngine(target).run(prompt, params, complete_cache=False).token_ids)
        other = dataclasses.replace(params, sampling=dataclasses.replace(settings, seed=settings.seed + 100))
        another = list(SpeculativeEngine(target).run(prompt, other, complete_cache=False).token_ids)
        greedy = list(SpeculativeEngine(target).run(prompt, GenerationParams(64, 0, stop_at_eos=False),
                                                    complete_cache=False).token_ids)
    finally:
        target.close()
    assert ahead == again and ahead != another and ahead != greedy
