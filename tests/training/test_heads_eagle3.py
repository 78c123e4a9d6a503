"""EAGLE-3's trainer (training/eagle3.py): the training-time test's gradient against finite
differences, its chains against what the drafter drafts from the same heads, and a few steps that
lower the loss."""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest

from fake_models import COPYING_VOCAB, copying_logits
from heads_factory import FAKE_LAYERS
from specrun.backends.fake import FakeBackend
from specrun.backends.kv import sequence_for
from specrun.drafters.heads.eagle import EagleDrafter
from specrun.heads.config import HeadsConfig
from specrun.sampling import SamplingSettings
from specrun.training.eagle import EagleWindow
from specrun.training.eagle3 import PARAMETER_NAMES, Eagle3Math, NumpyEagle3Trainer

SIZE, VOCAB, AUX = 8, 10, (1, 3)


def tiny_trainer(d2t=(0, 2, 3, 5, 7, 8, 9), seed: int = 0) -> NumpyEagle3Trainer:
    rng = np.random.default_rng(seed)
    config = HeadsConfig("eagle", 3, 1, SIZE, VOCAB, len(d2t))
    trainer = NumpyEagle3Trainer.fresh(config, rng.normal(0, 1, (len(d2t), SIZE)), rng.normal(0, 1, (VOCAB, SIZE)),
                                       np.asarray(d2t), 1e-3, seed, AUX)
    for name, array in trainer.params.items():  # away from the start's near-identities: every path matters
        array += rng.normal(0, 0.3, array.shape).astype(np.float32)
    return trainer


def grouped_trainer(seed: int = 0) -> NumpyEagle3Trainer:
    """Four query heads reading two key-value heads (grouped-query attention, as published heads have)."""
    from heads_factory import eagle3_heads

    rng = np.random.default_rng(seed)
    heads = eagle3_heads(SIZE, VOCAB, depth=3, draft_vocab=(0, 2, 3, 5, 7, 8, 9), aux=AUX, heads=4, kv_heads=2,
                         head_dim=4, intermediate=16, seed=seed)
    trainer = NumpyEagle3Trainer(heads, 1e-3, seed, rng.normal(0, 1, (VOCAB, SIZE)))
    for name, array in trainer.params.items():
        array += rng.normal(0, 0.3, array.shape).astype(np.float32)
    return trainer


def windows(rng: np.random.Generator, lengths=(7, 5)) -> list[EagleWindow]:
    made = []
    for length in lengths:
        following = rng.integers(0, VOCAB, length)
        following[:2] = -1  # a prompt's own tokens: no labels
        made.append(EagleWindow(rng.normal(0, 1, (length, len(AUX) * SIZE)), rng.integers(0, VOCAB, length),
                                following))
    return made


@pytest.mark.parametrize(("steps", "eps"), [(1, 1e-6), (3, 1e-6), (3, 0.5)])
def test_the_gradient_is_the_losss_by_finite_differences(steps, eps):
    """At specrun's norm epsilon and at a large one (published heads bring their own)."""
    trainer = tiny_trainer()
    params = {name: array.astype(np.float64) for name, array in trainer.params.items()}
    math_ = Eagle3Math(params, trainer.num_heads, trainer.head_dim, trainer.rope_theta,
                       trainer.embedding.astype(np.float64), eps=eps)
    data = math_.batch(windows(np.random.default_rng(1)), trainer.t2d)
    data.layers = data.layers.astype(np.float64)
    loss, grads = math_.loss_and_grads(data, steps)
    assert loss > 0
    rng = np.random.default_rng(2)
    for name in PARAMETER_NAMES:
        array = params[name]
        for _ in range(4):
            index = tuple(int(rng.integers(0, n)) for n in array.shape)
            saved = array[index]
            array[index] = saved + 1e-6
            above = math_.loss_and_grads(data, steps)[0]
            array[index] = saved - 1e-6
            below = math_.loss_and_grads(data, steps)[0]
            array[index] = saved
            numeric = (above - below) / 2e-6
            assert grads[name][index] == pytest.approx(numeric, rel=1e-4, abs=1e-8), (name, index)


@pytest.mark.parametrize("make", [tiny_trainer, grouped_trainer])
def test_the_gradient_along_a_random_direction_of_every_array_at_the_trained_depth(make):
    """All arrays at once, TRAINED_STEPS deep: the loss's change along a random direction is the
    gradient's inner product with it (no entry can hide behind a near-zero gradient); with
    grouped-query attention too, each key-value head's gradient summed over the heads it serves."""
    from specrun.training.eagle3 import TRAINED_STEPS

    trainer = make(seed=3)
    params = {name: array.astype(np.float64) for name, array in trainer.params.items()}
    math_ = Eagle3Math(params, trainer.num_heads, trainer.head_dim, trainer.rope_theta,
                       trainer.embedding.astype(np.float64), trainer.num_kv_heads)
    data = math_.batch(windows(np.random.default_rng(5), lengths=(9, 6, 8)), trainer.t2d)
    data.layers = data.layers.astype(np.float64)
    _, grads = math_.loss_and_grads(data, TRAINED_STEPS)
    rng = np.random.default_rng(6)
    direction = {name: rng.normal(0, 1, array.shape) for name, array in params.items()}
    expected = sum(float((grads[name] * direction[name]).sum()) for name in params)
    original = {name: array.copy() for name, array in params.items()}
    losses = []
    for sign in (1, -1):
        for name in params:
            params[name][...] = original[name] + sign * 1e-6 * direction[name]
        losses.append(math_.loss_and_grads(data, TRAINED_STEPS)[0])
    assert (losses[0] - losses[1]) / 2e-6 == pytest.approx(expected, rel=1e-5)


def fake_state(context: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(zlib.crc32(repr(context).encode())).normal(0, 1, SIZE).astype(np.float32)


@pytest.mark.parametrize(("grouped", "eps"), [(False, None), (True, None), (True, 0.5)])
def test_its_chains_are_what_the_drafter_drafts_from_the_same_heads(grouped, eps):
    """The trainer feeds a chain the window's true tokens, the drafter its own drafts: on a window
    that continues a prefix with the drafter's own chain, every guess of that chain is the drafter's
    (``grouped``: four query heads reading two key-value heads; ``eps``: heads whose norms' epsilon
    is another, which the trainer takes from them)."""
    from heads_factory import eagle3_heads

    table = copying_logits(salt=4)
    target = FakeBackend(table, COPYING_VOCAB, hidden_table=fake_state, hidden_size=SIZE, n_layers=FAKE_LAYERS)
    rng = np.random.default_rng(3)
    config = HeadsConfig("eagle", 3, 1, SIZE, COPYING_VOCAB, COPYING_VOCAB)
    embedding = target.token_embeddings(range(COPYING_VOCAB))
    if grouped:
        heads = eagle3_heads(SIZE, COPYING_VOCAB, depth=3, aux=AUX, heads=4, kv_heads=2, head_dim=4, intermediate=16)
        if eps is not None:
            heads = dataclasses.replace(heads, rms_norm_eps=eps)
        trainer = NumpyEagle3Trainer(dataclasses.replace(heads, embed_tokens=None), 1e-3, 0, embedding)
    else:
        trainer = NumpyEagle3Trainer.fresh(config, rng.normal(0, 1, (COPYING_VOCAB, SIZE)), embedding, None, 1e-3,
                                           0, AUX)
    for array in trainer.params.values():
        array += rng.normal(0, 0.3, array.shape).astype(np.float32)
    drafter = EagleDrafter(trainer.heads())  # no embedding of its own: the fake's rows, as in training
    sequence = sequence_for(target)
    drafter.bind(sequence, lambda: 0.0)
    for length in (4, 7, 11):
        prefix = [int(token) for token in rng.integers(0, COPYING_VOCAB, length)]
        sequence.sync(prefix[:-1])
        drafted = list(drafter.propose(prefix, 3, SamplingSettings(), np.random.default_rng(0)).tokens)
        tokens = prefix + drafted + [1]
        sequence.sync(tokens)
        window = EagleWindow(sequence.hidden(0, len(tokens)), np.array(tokens), np.full(len(tokens), -1))
        chains = trainer.predict_chain(window, 3)  # (3, T - 1)
        assert list(chains[:, length - 2]) == drafted
    drafter.close()


@pytest.mark.parametrize("length", [2, 3, 4])
def test_a_window_shorter_than_the_chain_scores_what_it_holds(length):
    """A short answer's only window, scored 6 deep: the chain's steps past its end are -1, none
    raises (a 4-token answer's learning stopped on it: 'could not broadcast')."""
    trainer = tiny_trainer()
    (window,) = windows(np.random.default_rng(5), lengths=(length,))
    chains = trainer.predict_chain(window, 6)
    assert chains.shape == (6, length - 1)
    for k in range(6):
        held = max(length - 1 - k, 0)  # positions whose chain reaches step k within the window
        assert (chains[k, held:] == -1).all() and (chains[k, :held] >= 0).all()


def test_steps_lower_the_loss_on_what_they_train_on():
    trainer = tiny_trainer()
    batch = windows(np.random.default_rng(4), lengths=(16, 12, 9))
    losses = [trainer.step_windows(batch) for _ in range(60)]
    assert losses[-1] < 0.6 * losses[0]


def test_training_runs_numpy_s_blas_on_the_cores_given_then_as_before():
    from specrun.training.optimizer import blas_threads, openblas_threads

    found = openblas_threads()
    if found is None:
        pytest.skip("NumPy's BLAS here is not OpenBLAS")
    _, threads = found
    before = threads()
    with blas_threads(2):
        assert threads() == 2
    assert threads() == before
