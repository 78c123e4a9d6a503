"""Heads for a target widened with zeros (modelkit/widen.py: the original's function, its states the
original's with zeros after them) draft exactly what the original's heads drafted, every kind;
a save and a load keep them so."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from heads_factory import eagle3_heads, random_eagle, random_heads, random_hydra
from specrun.drafters.heads.medusa import MedusaDrafter
from specrun.heads import eagle, hydra
from specrun.heads.files import load_heads, save_heads
from specrun.heads.kinds import BY_NAME, KINDS, kind_of

NARROW, WIDE, VOCAB = 24, 96, 50  # 4x: the norms' scale, 1/2, is exact in float16 too
DRAFT_VOCAB = range(3, 43)


def _wide(states: np.ndarray) -> np.ndarray:
    return np.concatenate([states, np.zeros((*states.shape[:-1], WIDE - NARROW), states.dtype)], axis=-1)


def _widen(heads):
    return kind_of(heads).widen(heads, WIDE, "wide-target", None)


def test_medusa_heads_widened_give_the_same_logits_on_the_padded_state():
    heads = random_heads(NARROW, VOCAB, num_heads=3, seed=1, draft_vocab=DRAFT_VOCAB)
    wide = _widen(heads)
    assert wide.config.hidden_size == WIDE and wide.config.target_name == "wide-target"
    assert wide.config.vocab_size == heads.config.vocab_size and wide.d2t is heads.d2t
    rng = np.random.default_rng(0)
    for _ in range(5):
        state = rng.normal(0, 1, NARROW).astype(np.float32)
        narrow_logits = MedusaDrafter.head_logits(SimpleNamespace(heads=heads), state, 3)
        wide_logits = MedusaDrafter.head_logits(SimpleNamespace(heads=wide), _wide(state), 3)
        np.testing.assert_allclose(wide_logits, narrow_logits, rtol=1e-5, atol=1e-4)


def test_medusa_heads_sharing_a_projection_still_share_it_widened():
    heads = random_heads(NARROW, VOCAB, num_heads=3, seed=1)
    shared = heads.lm_heads[0]
    heads = type(heads)(heads.config, heads.blocks, (shared, shared, shared), heads.d2t)
    wide = _widen(heads)
    assert wide.lm_heads[0] is wide.lm_heads[1] is wide.lm_heads[2]


def test_hydra_heads_widened_draft_the_same_chains_with_the_same_logits():
    heads = random_hydra(NARROW, VOCAB, num_heads=3, seed=2, draft_vocab=DRAFT_VOCAB, num_layers=2, embedding_size=4)
    wide = _widen(heads)
    rng = np.random.default_rng(1)
    states = rng.normal(0, 1, (16, NARROW)).astype(np.float32)
    tokens = rng.integers(0, VOCAB, 16)
    np.testing.assert_array_equal(hydra.chain_guesses(wide, _wide(states), tokens, 3),
                                  hydra.chain_guesses(heads, states, tokens, 3))
    paths = np.concatenate([heads.draft_ids(tokens)[:, None], rng.integers(0, len(DRAFT_VOCAB), (16, 2))], axis=1)
    for head in range(3):  # each head over its path: the token after the state and the drafts before its own
        rows = paths[:, : head + 1]
        narrow = hydra.head_logits(heads, head, states, hydra.root_terms(heads, head, states), rows)
        widened = hydra.head_logits(wide, head, _wide(states), hydra.root_terms(wide, head, _wide(states)), rows)
        np.testing.assert_allclose(widened, narrow, rtol=1e-5, atol=1e-4)


def test_eagle_heads_widened_predict_the_padded_features_and_draft_the_same_chains():
    heads = random_eagle(NARROW, VOCAB, depth=4, seed=3, draft_vocab=DRAFT_VOCAB, window=8)
    heads = dataclasses.replace(heads, layout=dataclasses.replace(heads.layout, rms_norm_eps=0.5))  # an epsilon that counts
    wide = _widen(heads)
    assert wide.layout.num_attention_heads == heads.layout.num_attention_heads
    rng = np.random.default_rng(2)
    features = rng.normal(0, 1, (20, NARROW)).astype(np.float32)
    tokens = rng.integers(0, VOCAB, 20)
    np.testing.assert_array_equal(eagle.chain_guesses(wide, _wide(features), tokens, 4),
                                  eagle.chain_guesses(heads, features, tokens, 4))
    positions = np.arange(19)
    reads = eagle.causal_window(19, 8)
    none = eagle.no_entries(heads, np.float32)
    out, keys, _ = eagle.layer(heads, eagle.fuse(heads, features[:19], heads.draft_ids(tokens[1:])), positions,
                               none, none, reads)
    wide_out, wide_keys, _ = eagle.layer(wide, eagle.fuse(wide, _wide(features[:19]), wide.draft_ids(tokens[1:])),
                                         positions, none, none, reads)
    np.testing.assert_allclose(wide_out, _wide(out), rtol=1e-4, atol=1e-4)  # the zeros stay zero
    np.testing.assert_allclose(wide_keys, keys, rtol=1e-4, atol=1e-4)


def test_eagle3_heads_widened_read_the_leading_columns_with_the_original_s_embedding():
    heads = eagle3_heads(NARROW, VOCAB, draft_vocab=DRAFT_VOCAB, aux=(0, 1, 2), embed_tokens=None)
    embedding = np.random.default_rng(4).normal(0, 1, (VOCAB, NARROW)).astype(np.float32)
    wide = BY_NAME["eagle3"].widen(heads, WIDE, "wide-target", embedding)
    assert wide.config.hidden_size == WIDE and wide.fc.shape == (heads.draft_hidden_size, 3 * WIDE)
    np.testing.assert_array_equal(wide.embed_tokens, embedding)


@pytest.mark.parametrize("make", [
    lambda: random_heads(NARROW, VOCAB, num_heads=3, seed=1, draft_vocab=DRAFT_VOCAB),
    lambda: random_hydra(NARROW, VOCAB, num_heads=3, seed=2, draft_vocab=DRAFT_VOCAB),
    lambda: random_eagle(NARROW, VOCAB, depth=4, seed=3, draft_vocab=DRAFT_VOCAB),
], ids=["medusa", "hydra", "eagle"])
def test_widened_heads_are_saved_and_loaded_as_heads_for_the_wider_target(make, tmp_path):
    """Stored in float16 as every heads file is: widened from the stored original, saved and loaded,
    they draft what the original loaded drafts."""
    save_heads(make(), tmp_path / "narrow.safetensors")
    narrow = load_heads(tmp_path / "narrow.safetensors")
    wide = _widen(narrow)
    path = tmp_path / "wide.safetensors"
    save_heads(wide, path)
    loaded = load_heads(path)
    assert kind_of(loaded) is kind_of(wide)
    assert loaded.config.hidden_size == WIDE and loaded.config.target_name == "wide-target"
    rng = np.random.default_rng(5)
    states, tokens = rng.normal(0, 1, (20, NARROW)).astype(np.float32), rng.integers(0, VOCAB, 20)
    if kind_of(loaded).name == "medusa":
        for state in states:
            np.testing.assert_array_equal(MedusaDrafter.head_logits(SimpleNamespace(heads=loaded), _wide(state), 3),
                                          MedusaDrafter.head_logits(SimpleNamespace(heads=narrow), state, 3))
    else:
        module = hydra if kind_of(loaded).name == "hydra" else eagle
        np.testing.assert_array_equal(module.chain_guesses(loaded, _wide(states), tokens, 3),
                                      module.chain_guesses(narrow, states, tokens, 3))
    folder = tmp_path / "folder"
    folder.mkdir()
    save_heads(wide, folder / f"{kind_of(wide).name}.safetensors")
    assert kind_of(load_heads(folder)) is kind_of(wide)  # a derived folder holds one pair


def test_every_kind_stored_as_heads_can_be_widened():
    assert all((kind.widen is None) == (kind.stored == "model") for kind in KINDS)
