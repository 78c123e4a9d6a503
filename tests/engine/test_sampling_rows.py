"""specrun.sampling.probabilities without sorting a whole vocabulary: top-p sorts a row's likeliest
candidates only, and top-k takes exp only where it keeps a token. The rows must be bit for bit
what sorting each whole row (and exp over the masked row) gives, since plain decoding and every
verify pass draw from them."""

import numpy as np
import pytest

import specrun.sampling
from oracle import distribution
from specrun.sampling import SAMPLER_ORDER, SamplingSettings, probabilities, token_logprobs


def whole_row_probabilities(logits: np.ndarray, settings: SamplingSettings) -> np.ndarray:
    """The reference: the samplers in the settings' order, every row sorted whole (stable,
    likeliest first) for top-p, exp over the whole masked row; a temperature after truncation
    brings the rows to it as probabilities does (sampling._tempered)."""
    logits = np.asarray(logits, dtype=np.float64)
    rows = np.atleast_2d(logits)
    kept = np.ones(rows.shape, dtype=bool)
    temperature, probs = 1.0, None  # probs: the distribution so far, where a sampler made one

    def softmax() -> np.ndarray:
        scaled = np.where(kept, rows / temperature, -np.inf)
        weights = np.exp(scaled - np.maximum.reduce(scaled, axis=-1, keepdims=True))
        return weights / np.add.reduce(weights, axis=-1, keepdims=True)

    def renormalised(kept_now: np.ndarray) -> np.ndarray:
        cut = np.where(kept_now, probs, 0.0)
        return cut / np.add.reduce(cut, axis=-1, keepdims=True)

    for name in settings.chain:
        if name == "temperature":
            if probs is None:
                temperature = settings.temperature
            else:  # its own arithmetic (the oracle's tests hold it to softmax(logits / T) over the kept)
                specrun.sampling._tempered(probs, settings.temperature)
        elif name == "top_k":
            vocab = rows.shape[-1]
            if settings.top_k < vocab:
                alive = kept if probs is None else probs > 0.0
                candidates = np.where(alive, rows, -np.inf)
                kth = np.partition(candidates, vocab - settings.top_k, axis=-1)[:, vocab - settings.top_k]
                chosen = (candidates >= kth[:, None]) & alive
                if probs is None:
                    kept = kept & chosen
                else:
                    probs = renormalised(chosen)
        elif name == "top_n_sigma":  # on the logits: the finite ones kept, their standard deviation
            before = kept if probs is None else probs > 0.0
            chosen = before.copy()
            for row, alive, chosen_row in zip(rows, before & np.isfinite(rows), chosen):
                if alive.sum() > 1:
                    chosen_row[:] = alive & (row >= row[alive].max() - settings.top_n_sigma * np.std(row[alive]))
            if probs is None:
                kept = chosen
            else:
                probs = renormalised(chosen)
        elif name == "min_p" and probs is None:  # on the logits, as llama.cpp reads it
            scaled = np.where(kept, rows / temperature, -np.inf)
            kept = kept & (scaled - scaled.max(axis=-1, keepdims=True) >= np.log(settings.min_p))
        else:
            probs = softmax() if probs is None else probs
            if name == "top_p":
                order = np.argsort(-probs, axis=-1, kind="stable")
                ranked = np.take_along_axis(probs, order, axis=-1)
                keep = np.zeros(probs.shape, dtype=bool)
                np.put_along_axis(keep, order, np.cumsum(ranked, axis=-1) - ranked < settings.top_p, axis=-1)
                probs = renormalised(keep)
            elif name == "typ_p":  # every row sorted whole by its distance from the entropy, zeros last
                keep = np.zeros(probs.shape, dtype=bool)
                for row, kept_row in zip(probs, keep):
                    positive = row > 0.0
                    surprise = -np.log(row[positive])
                    score = np.full(row.shape, np.inf)
                    score[positive] = np.abs(surprise - np.dot(row[positive], surprise))
                    order = np.argsort(score, kind="stable")
                    taken = np.cumsum(row[order])
                    kept_row[order[:int(np.searchsorted(taken, settings.typical_p, side="right")) + 1]] = True
                probs = renormalised(keep)
            else:
                probs = renormalised(probs >= settings.min_p * np.maximum.reduce(probs, axis=-1, keepdims=True))
    probs = softmax() if probs is None else probs
    return probs[0] if logits.ndim == 1 else probs


ORDERS = (SAMPLER_ORDER, ("temperature", "top_k", "top_p", "min_p"), ("top_p", "min_p", "temperature", "top_k"),
          ("min_p", "top_k", "temperature", "top_p"), ("temperature", "typ_p", "top_p", "top_n_sigma"),
          ("top_p", "typ_p", "min_p", "top_n_sigma", "top_k"))


def random_rows(rng: np.random.Generator, vocab: int, rows: int) -> np.ndarray:
    logits = rng.normal(size=(rows, vocab)) * rng.choice([0.1, 1.0, 3.0, 10.0])
    if rng.random() < 0.4:  # ties, at the candidates' edge too
        logits = np.round(logits, int(rng.integers(0, 2)))
    if rng.random() < 0.2:  # a grammar's mask
        logits[:, rng.integers(0, vocab, size=vocab // 2)] = -np.inf
        logits[:, 0] = 1.0
    return logits


@pytest.mark.parametrize("vocab", [3, 8, 100, 2000, 20_000])
def test_rows_equal_whole_row_sorting_bit_for_bit(vocab):
    rng = np.random.default_rng(vocab)
    for _ in range(150 if vocab < 20_000 else 25):
        logits = random_rows(rng, vocab, int(rng.integers(1, 4)))
        settings = SamplingSettings(
            temperature=float(rng.choice([0.3, 0.7, 1.0, 1.5])),
            top_k=int(rng.choice([0, 0, 2, 40, vocab])),
            top_p=float(rng.choice([0.1, 0.5, 0.9, 0.95, 0.999, 1.0])),
            min_p=float(rng.choice([0.0, 0.0, 0.05])),
            typical_p=float(rng.choice([1.0, 1.0, 0.95, 0.5])),
            top_n_sigma=float(rng.choice([0.0, 0.0, 1.0, 3.0])),
            order=ORDERS[int(rng.integers(len(ORDERS)))],
        )
        given = logits.copy()
        assert np.array_equal(probabilities(logits, settings), whole_row_probabilities(logits, settings)), settings
        assert np.array_equal(probabilities(logits[0], settings), whole_row_probabilities(logits[0], settings))
        assert np.array_equal(logits, given)  # the caller's logits untouched (the work is done in place)
        as_float32 = logits.astype(np.float32)  # as llama.cpp hands them over
        assert np.array_equal(probabilities(as_float32, settings), whole_row_probabilities(as_float32, settings))


@pytest.mark.parametrize("spread", [0.05, 0.3, 8.0])
def test_a_row_that_needs_many_candidates_widens_them_and_keeps_what_sorting_keeps(spread, monkeypatch):
    """Flat rows keep thousands of tokens: the candidates widen (64, 512, 4,096, then the whole
    row) and each round's cut must agree; a peaked row stops at the first."""
    widths = []
    partition = np.partition

    def counted(values, kth, *args, **kwargs):
        widths.append(len(values) - kth)
        return partition(values, kth, *args, **kwargs)

    monkeypatch.setattr(specrun.sampling.np, "partition", counted)
    logits = np.random.default_rng(7).normal(size=(2, 49_152)) * spread
    settings = SamplingSettings(temperature=1.0, top_p=0.95)
    assert np.array_equal(probabilities(logits, settings), whole_row_probabilities(logits, settings))
    if spread < 1.0:
        assert max(widths) >= 512, widths  # rounds beyond the first ran
    else:
        assert set(widths) == {specrun.sampling.TOP_P_CANDIDATES}, widths


def test_ties_at_the_candidates_edge_come_in_whole():
    """The 64th likeliest token tied with hundreds more: every tied token is a candidate, so the
    candidates stay a prefix of the stable order and top-p keeps the tied tokens with the lowest
    ids (an arbitrary 64 of them, as a partition leaves them, kept others)."""
    logits = np.zeros(1_000)
    logits[:30] = 5.0  # 57% of the mass
    logits[30:400] = 2.0  # ties across the 64th place, 0.1% each
    for top_p in (0.58, 0.7, 0.95):
        settings = SamplingSettings(temperature=1.0, top_p=top_p)
        assert np.array_equal(probabilities(logits, settings), whole_row_probabilities(logits, settings))


def test_a_small_row_s_tie_at_exactly_top_p_stops_where_sorting_stops():
    """Eight equal tokens, top-p 0.5: the mass before the 5th is exactly 0.5, so the first four
    (lowest ids, the stable order) are kept and the rest are not, on the small rows' path too."""
    settings = SamplingSettings(temperature=1.0, top_p=0.5)
    rows = np.zeros((3, 8))
    expected = np.array([0.25] * 4 + [0.0] * 4)
    for got in (probabilities(rows[0], settings), *probabilities(rows, settings)):
        assert np.array_equal(got, expected)
    assert np.array_equal(probabilities(rows, settings), whole_row_probabilities(rows, settings))


def test_a_temperature_after_truncation_is_the_softmax_of_the_scaled_logits_over_the_tokens_kept():
    """sampling._tempered, at temperatures far from 1 (where a power of a probability could
    underflow or lose precision): what softmax(logits / T) over the kept tokens gives."""
    rng = np.random.default_rng(6)
    logits = rng.normal(0.0, 3.0, (4, 500))
    kept = logits >= np.sort(logits, axis=-1)[:, -40:-39]  # the 40 likeliest of each row
    for temperature in (0.01, 0.3, 1.7, 100.0):
        probs = probabilities(np.where(kept, logits, -np.inf), SamplingSettings(temperature=1.0))
        specrun.sampling._tempered(probs, temperature)
        scaled = np.where(kept, logits / temperature, -np.inf)
        expected = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
        np.testing.assert_allclose(probs, expected / expected.sum(axis=-1, keepdims=True), rtol=1e-10, atol=1e-300)


def test_rows_follow_the_oracle_s_definition():
    rng = np.random.default_rng(3)
    for _ in range(40):
        logits = random_rows(rng, 300, 1)[0]
        settings = SamplingSettings(temperature=0.8, top_k=int(rng.choice([0, 20])), top_p=0.9, min_p=0.02)
        assert np.allclose(probabilities(logits, settings), distribution(logits, settings), atol=1e-12)


def test_top_logprobs_are_the_whole_row_s_likeliest_in_its_stable_order():
    """token_logprobs' ``top`` alternatives without sorting the vocabulary: the first ``top`` of a
    stable descending sort of the whole row, ties (lower id first) and a grammar's -inf included."""
    rng = np.random.default_rng(11)
    for _ in range(300):
        vocab = int(rng.choice([5, 50, 3_000]))
        logits = random_rows(rng, vocab, 1)[0]
        token, top = int(rng.integers(0, vocab)), int(rng.choice([0, 1, 5, 20]))
        logprob, alternatives = token_logprobs(logits, token, top)
        finite = logits[np.isfinite(logits)].max()
        log_probs = logits - (finite + np.log(np.exp(logits - finite).sum()))
        whole = np.argsort(-log_probs, kind="stable")[:top]
        assert [t for t, _ in alternatives] == whole.tolist()
        assert [v for _, v in alternatives] == log_probs[whole].tolist() and logprob == log_probs[token]
