"""The EAGLE layer's math: the trainer's hand-written gradients against finite differences, its
forward pass against the drafter's (heads.eagle.layer), and the chain the report measures
against drafting one position at a time."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from specrun.heads.eagle import PARAMETER_NAMES, EagleLayout, causal_window, chain_guesses, fuse, layer, no_entries
from specrun.heads.config import HeadsConfig
from specrun.training.eagle import EagleWindow, NumpyEagleTrainer, batch_forward, batch_loss

SIZE, VOCAB, DRAFT_VOCAB = 8, 12, 7


def small_heads(seed: int = 0, window: int = 4, dtype=np.float64):
    """Random heads of width 8 (two attention heads of 4) over a draft vocabulary of 7 of 12 tokens,
    every array random (a fresh trainer's zeros would hide gradients)."""
    config = HeadsConfig("eagle", 3, 1, SIZE, VOCAB, DRAFT_VOCAB, target_name="test")
    layout = EagleLayout(num_attention_heads=2, head_dim=4, intermediate_size=10, window=window)
    rng = np.random.default_rng(seed)
    d2t = np.array([3, 0, 7, 11, 5, 2, 9])
    trainer = NumpyEagleTrainer.fresh(config, rng.normal(0, 1, (DRAFT_VOCAB, SIZE)),
                                      rng.normal(0, 1, (DRAFT_VOCAB, SIZE)), d2t, 1e-3, seed, layout)
    heads = trainer.heads()
    arrays = {name: rng.normal(0, 0.5, getattr(heads, name).shape).astype(dtype) for name in PARAMETER_NAMES}
    arrays["attn_norm"] += 1.0
    arrays["mlp_norm"] += 1.0
    return dataclasses.replace(heads, **arrays)


def small_window(seed: int = 1, length: int = 7) -> EagleWindow:
    rng = np.random.default_rng(seed)
    following = rng.integers(0, VOCAB, length)
    following[:2] = -1  # a prompt's positions: no labels
    return EagleWindow(rng.normal(0, 1.5, (length, SIZE)), rng.integers(0, VOCAB, length), following)


@pytest.mark.parametrize("soft", [False, True], ids=["labels", "soft-labels"])
@pytest.mark.parametrize("name", PARAMETER_NAMES)
def test_every_gradient_matches_finite_differences(name, soft):
    """Two windows of different lengths in one padded batch: the padding adds nothing. Against
    labels, and against the distributions a teacher's output rows give the target features
    (soft labels)."""
    heads, windows = small_heads(), [small_window(), small_window(seed=4, length=5)]
    rng = np.random.default_rng(2)
    noise = [rng.normal(0, 0.1, (len(window.tokens) - 1, SIZE)) for window in windows]
    teacher = rng.normal(0, 1, (DRAFT_VOCAB, SIZE)) if soft else None
    _, grads = batch_loss(heads, windows, noise, teacher)
    array = getattr(heads, name)
    for flat_index in np.random.default_rng(3).choice(array.size, size=min(6, array.size), replace=False):
        index = np.unravel_index(flat_index, array.shape)
        step = 1e-6
        values = []
        for sign in (1, -1):
            changed = array.copy()
            changed[index] += sign * step
            values.append(batch_loss(dataclasses.replace(heads, **{name: changed}), windows, noise, teacher)[0])
        numeric = (values[0] - values[1]) / (2 * step)
        assert grads[name][index] == pytest.approx(numeric, rel=1e-4, abs=1e-8), (name, index)


def test_a_padded_window_predicts_as_it_does_alone():
    heads, short, long = small_heads(), small_window(seed=4, length=5), small_window()
    together = batch_forward(heads, [long, short]).out.reshape(2, len(long.tokens) - 1, SIZE)
    assert np.allclose(together[1, : len(short.tokens) - 1], batch_forward(heads, [short]).out, atol=1e-12)


def test_with_a_teacher_each_label_is_the_targets_distribution_at_the_feature_that_chose_it():
    """The loss with a teacher's output rows is the one with labels but for the token term: the
    cross-entropy against softmax(feature at p + 1 times the rows), the distribution that chose
    the label at p (the token after p + 1)."""
    from specrun.heads.layers import softmax
    from specrun.training.eagle import CE_WEIGHT

    heads, window = small_heads(), small_window()
    teacher = np.random.default_rng(5).normal(0, 1, (DRAFT_VOCAB, SIZE))
    out = batch_forward(heads, [window]).out
    log_probs = np.log(softmax(out @ heads.lm_head.T))
    labels = heads.draft_ids(np.maximum(window.following[1:], 0))
    rows = np.flatnonzero((window.following[1:] >= 0) & (labels < DRAFT_VOCAB))
    hard = -log_probs[rows, labels[rows]].mean()
    soft = -(softmax(window.features[1:][rows] @ teacher.T) * log_probs[rows]).sum(axis=1).mean()
    with_labels, with_teacher = batch_loss(heads, [window])[0], batch_loss(heads, [window], None, teacher)[0]
    assert with_teacher - with_labels == pytest.approx(CE_WEIGHT * (soft - hard), rel=1e-9)
    assert abs(soft - hard) > 0.1


def test_a_training_step_lowers_the_loss_it_is_taken_on():
    heads, window = small_heads(dtype=np.float32), small_window()
    trainer = NumpyEagleTrainer(heads, learning_rate=1e-2, seed=0)
    first = trainer.step_windows([window])
    for _ in range(20):
        last = trainer.step_windows([window])
    assert last < 0.8 * first


def test_the_drafters_layer_reads_what_the_trainer_scores():
    """Teacher-forced, heads.eagle.layer over the window gives the features the trainer scores."""
    heads, window = small_heads(), small_window()
    count = len(window.tokens) - 1
    fused = fuse(heads, window.features[:count], heads.draft_ids(window.tokens[1:]))
    out, _, _ = layer(heads, fused, np.arange(count), no_entries(heads, np.float64), no_entries(heads, np.float64),
                      causal_window(count, heads.layout.window))
    assert np.allclose(batch_forward(heads, [window]).out, out, rtol=1e-12, atol=1e-12)


def test_the_chain_report_drafts_as_one_position_at_a_time_would():
    """chain_guesses' column p equals drafting from p with the layer step by step: the context's
    real entries inside the window, then the chain's own."""
    heads, window = small_heads(window=4), small_window(length=9)
    depth = 3
    columns = chain_guesses(heads, window.features, window.tokens, depth)
    d2t = heads.d2t
    for p in range(len(window.tokens) - 1):
        fused = fuse(heads, window.features[: p + 1], heads.draft_ids(window.tokens[1 : p + 2]))
        out, keys, values = layer(heads, fused, np.arange(p + 1), no_entries(heads, np.float64),
                                  no_entries(heads, np.float64), causal_window(p + 1, heads.layout.window))
        feature, position = out[-1:], p
        guesses = []
        for _ in range(depth):
            draft = int((feature @ heads.lm_head.T).argmax())
            guesses.append(int(d2t[draft]))
            position += 1
            step_in = fuse(heads, feature, np.array([draft]))
            reads = np.array([[position - j < heads.layout.window for j in range(len(keys))] + [True]])
            feature, key, value = layer(heads, step_in, np.array([position]), keys, values, reads)
            keys, values = np.concatenate([keys, key]), np.concatenate([values, value])
        assert list(columns[:, p]) == guesses, p


def test_float32_heads_stay_float32_in_drafting_and_training():
    """A NumPy float64 scalar among the constants would turn every array after it float64
    (2-5x slower drafting and training, as measured once)."""
    heads, window = small_heads(dtype=np.float32), small_window()
    count = len(window.tokens) - 1
    features = window.features.astype(np.float32)
    fused = fuse(heads, features[:count], heads.draft_ids(window.tokens[1:]))
    out, keys, _ = layer(heads, fused, np.arange(count), no_entries(heads, np.float32), no_entries(heads, np.float32),
                         causal_window(count, heads.layout.window))
    assert fused.dtype == out.dtype == keys.dtype == np.float32
    assert chain_guesses(heads, features, window.tokens, 3).shape == (3, count)
    float32_window = EagleWindow(features, window.tokens, window.following)
    assert batch_forward(heads, [float32_window]).out.dtype == np.float32
    assert all(grad.dtype == np.float32 for grad in batch_loss(heads, [float32_window])[1].values())
