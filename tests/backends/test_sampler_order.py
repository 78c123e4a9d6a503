"""The samplers' order against the tools users compare with: specrun's rows under each order are
the distributions llama.cpp's own sampler chain (llama-cpp-python's bindings of it) and mlx-lm's
``make_sampler`` chain draw from, row for row.

llama.cpp's default chain (top-n-sigma, top-k, typical-p, top-p, min-p on the model's own
distribution, then the temperature) is specrun's default: `--temp 0.7 --top-p 0.9` samples what llama-cli, llama-server
and llama-cpp-python's Llama sample. mlx-lm applies top-p, min-p, then top-k, the temperature last:
``--samplers 'top_p;min_p;top_k;temperature'`` is its order. Rows are compared to float32's
rounding (both tools work in it); a fixed seed keeps every row away from a cut that rounding moves.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools

import numpy as np
import pytest

from specrun.sampling import SAMPLER_ORDER, SamplingSettings, probabilities

ROWS = 200
CORE = ("top_k", "top_p", "min_p", "temperature")
TEMPERATURE_FIRST = ("temperature", "top_k", "top_p", "min_p")  # specrun's order until 2026-12


def _random_settings(rng: np.random.Generator, order: tuple[str, ...], typical: bool = False,
                     dynatemp: bool = False) -> tuple[np.ndarray, SamplingSettings]:
    row = (rng.normal(size=300) * rng.choice([0.5, 2.0, 5.0])).astype(np.float32)
    settings = SamplingSettings(temperature=float(rng.choice([0.3, 0.7, 1.5])), top_k=int(rng.choice([0, 5, 40])),
                                top_p=float(rng.choice([1.0, 0.9, 0.5])), min_p=float(rng.choice([0.0, 0.05, 0.2])),
                                order=order)
    if typical:  # llama.cpp's typical-p, top-n-sigma and XTC too (XTC where it always drops: its coin's
        # other side leaves the row as it was; test_xtc_drops_with_its_probability_as_llama_cpp_s)
        settings = dataclasses.replace(settings, typical_p=float(rng.choice([1.0, 0.9, 0.5])),
                                       top_n_sigma=float(rng.choice([0.0, 1.0, 2.5])),
                                       xtc_probability=float(rng.choice([0.0, 1.0, 1.0])),
                                       xtc_threshold=float(rng.choice([0.02, 0.1, 0.3])))
    elif rng.random() < 0.3:  # tokens a grammar or a bias forbids (llama.cpp's typical-p reads them as NaN)
        row[rng.integers(len(row), size=30)] = -np.inf
    if dynatemp:  # ranges under and over the temperature (then down to 0), flatter and sharper maps
        settings = dataclasses.replace(settings, dynatemp_range=float(rng.choice([0.25, 0.6, 2.0])),
                                       dynatemp_exponent=float(rng.choice([0.5, 1.0, 2.5])))
        if not typical and rng.random() < 0.3:  # fewer tokens left than top-k's k: still k candidates
            row[rng.permutation(len(row))[12:]] = -np.inf
    return row, settings


def _llama_chain_row(llama_cpp, row: np.ndarray, settings: SamplingSettings, chain=None) -> np.ndarray:
    """The distribution llama.cpp's chain of ``settings``' samplers, in their order, leaves for its
    ``dist`` sampler: the softmax of the candidates' logits after the chain (``chain``: one made
    before, applied again; its samplers' random state goes on)."""
    if chain is not None:
        return _applied(llama_cpp, chain, row)
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    made = {"top_k": lambda: llama_cpp.llama_sampler_init_top_k(settings.top_k),
            "top_p": lambda: llama_cpp.llama_sampler_init_top_p(settings.top_p, 1),
            "min_p": lambda: llama_cpp.llama_sampler_init_min_p(settings.min_p, 1),
            "typ_p": lambda: llama_cpp.llama_sampler_init_typical(settings.typical_p, 1),
            "top_n_sigma": lambda: llama_cpp.llama_sampler_init_top_n_sigma(settings.top_n_sigma),
            "xtc": lambda: llama_cpp.llama_sampler_init_xtc(settings.xtc_probability, settings.xtc_threshold, 1, 0),
            "temperature": lambda: llama_cpp.llama_sampler_init_temp_ext(
                settings.temperature, settings.dynatemp_range, settings.dynatemp_exponent)}
    try:
        for name in settings.samplers:  # each off sampler as llama.cpp's is at that setting: no change
            llama_cpp.llama_sampler_chain_add(chain, made[name]())
        return _applied(llama_cpp, chain, row)
    finally:
        llama_cpp.llama_sampler_free(chain)


def _applied(llama_cpp, chain, row: np.ndarray) -> np.ndarray:
    """llama.cpp's ``chain`` applied once to ``row``: the softmax of the candidates left."""
    data = (llama_cpp.llama_token_data * len(row))(
        *[llama_cpp.llama_token_data(token, float(logit), 0.0) for token, logit in enumerate(row)])
    candidates = llama_cpp.llama_token_data_array(data, len(row), -1, False)
    llama_cpp.llama_sampler_apply(chain, ctypes.byref(candidates))
    ids = [candidates.data[i].id for i in range(candidates.size)]
    logits = np.array([candidates.data[i].logit for i in range(candidates.size)], dtype=np.float64)
    out = np.zeros(len(row))
    weights = np.exp(logits - logits.max())
    out[ids] = weights / weights.sum()
    return out


def _typical_first(order: list[str]) -> tuple[str, ...]:
    """``order`` with typical-p before top-n-sigma: llama.cpp's typical-p after it reads the tokens
    top-n-sigma set to -inf (0 · log 0 makes its entropy NaN, and its sort's order undefined), as
    after a grammar's or a bias's -inf; specrun's reads the tokens kept, as wherever llama.cpp's is
    defined."""
    typical, sigma = order.index("typ_p"), order.index("top_n_sigma")
    if typical > sigma:
        order[typical], order[sigma] = order[sigma], order[typical]
    return tuple(order)


ORDERS = [*itertools.permutations(CORE),  # every order of the four, and orders of all seven
          *(_typical_first(np.random.default_rng(seed).permutation(SAMPLER_ORDER).tolist()) for seed in range(12))]


@pytest.mark.parametrize("order", ORDERS, ids=";".join)
def test_each_order_samples_what_llama_cpp_s_chain_in_that_order_samples(order):
    llama_cpp = pytest.importorskip("llama_cpp")
    rng = np.random.default_rng(0)
    for _ in range(ROWS // 8):
        row, settings = _random_settings(rng, order, typical=len(order) > len(CORE))
        np.testing.assert_allclose(probabilities(row, settings), _llama_chain_row(llama_cpp, row, settings),
                                   rtol=0, atol=1e-5, err_msg=str(settings))


@pytest.mark.parametrize("order", ORDERS, ids=";".join)
def test_dynamic_temperature_in_each_order_is_llama_cpp_s(order):
    """llama.cpp's dynamic temperature reads the entropy of the candidates left where it applies and
    their count: the truncations before it shrink that count (top-k to k), a -inf logit does not
    (a grammar's, a bias's, top-n-sigma's), nor does a truncation after it."""
    llama_cpp = pytest.importorskip("llama_cpp")
    rng = np.random.default_rng(3)
    spreads = []
    for _ in range(ROWS // 8):
        row, settings = _random_settings(rng, order, typical=len(order) > len(CORE), dynatemp=True)
        ours = probabilities(row, settings)
        np.testing.assert_allclose(ours, _llama_chain_row(llama_cpp, row, settings), rtol=0, atol=1e-5,
                                   err_msg=str(settings))
        spreads.append(np.abs(ours - probabilities(row, dataclasses.replace(settings, dynatemp_range=0.0))).max())
    assert max(spreads) > 0.05  # the temperature moved enough to matter somewhere


def test_xtc_drops_with_its_probability_as_llama_cpp_s():
    """llama.cpp's XTC tosses a coin a step and drops where it falls under its probability: its row
    is the row as it was or the row XTC cut, and specrun's distribution is their mixture."""
    llama_cpp = pytest.importorskip("llama_cpp")
    row = np.array([2.0, 1.5, 1.0, 0.0, -1.0, -3.0], dtype=np.float32)
    settings = SamplingSettings(temperature=0.7, xtc_probability=0.3, xtc_threshold=0.15)
    as_is, cut = (probabilities(row, dataclasses.replace(settings, xtc_probability=chance)) for chance in (0.0, 1.0))
    assert not np.allclose(as_is, cut)
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    try:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_xtc(0.3, 0.15, 1, 7))
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(0.7))
        rows = [_llama_chain_row(llama_cpp, row, settings, chain) for _ in range(4000)]
    finally:
        llama_cpp.llama_sampler_free(chain)
    dropped = 0
    for each in rows:
        same_as_cut = np.allclose(each, cut, rtol=0, atol=1e-5)
        assert same_as_cut or np.allclose(each, as_is, rtol=0, atol=1e-5)
        dropped += same_as_cut
    assert abs(dropped - 1200) < 4 * np.sqrt(4000 * 0.3 * 0.7)  # 4 standard deviations: 116
    np.testing.assert_allclose(probabilities(row, settings), 0.7 * as_is + 0.3 * cut, rtol=0, atol=1e-12)


def test_the_default_is_llama_cpp_s_and_temperature_first_is_not():
    llama_cpp = pytest.importorskip("llama_cpp")
    rng = np.random.default_rng(1)
    differ = 0
    for _ in range(ROWS):
        row, settings = _random_settings(rng, SAMPLER_ORDER)
        upstream = _llama_chain_row(llama_cpp, row, settings)
        np.testing.assert_allclose(probabilities(row, SamplingSettings(
            settings.temperature, settings.top_k, settings.top_p, settings.min_p)), upstream, rtol=0, atol=1e-5)
        first = SamplingSettings(settings.temperature, settings.top_k, settings.top_p, settings.min_p,
                                 order=TEMPERATURE_FIRST)
        differ += not np.allclose(probabilities(row, first), upstream, rtol=0, atol=1e-5)
    assert differ > ROWS // 3  # the old order sampled otherwise on most rows with a cut on


def test_mlx_lm_s_order_samples_what_its_make_sampler_chain_samples(monkeypatch):
    mx = pytest.importorskip("mlx.core")
    sample_utils = pytest.importorskip("mlx_lm.sample_utils")
    seen = []  # what make_sampler's chain hands its final draw: the logits left, and the temperature
    monkeypatch.setattr(sample_utils, "categorical_sampling", lambda logits, temp: seen.append((logits, temp)))
    rng = np.random.default_rng(2)
    for _ in range(ROWS):
        row, settings = _random_settings(rng, ("top_p", "min_p", "top_k", "temperature"))
        sampler = sample_utils.make_sampler(temp=settings.temperature, top_p=settings.top_p, min_p=settings.min_p,
                                            top_k=settings.top_k)
        sampler(mx.array(row) - mx.logsumexp(mx.array(row)))  # mlx-lm hands its sampler log-probabilities
        logits, temperature = seen.pop()
        scaled = np.array(logits * (1.0 / temperature), dtype=np.float64)  # categorical_sampling's
        weights = np.exp(scaled - scaled.max())
        np.testing.assert_allclose(probabilities(row, settings), weights / weights.sum(), rtol=0, atol=1e-5,
                                   err_msg=str(settings))
