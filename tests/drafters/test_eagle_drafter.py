"""The EAGLE drafter on a fake target with hidden states: its drafts are what the layer drafts
from the target's own features (heads.eagle.chain_guesses, checked there against the layer
step by step) however the context grows, shrinks or starts; its trees and sampled rows are
well formed. Losslessness is the harness's (tests/engine/test_acceptance.py)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from fake_models import COPYING_VOCAB, copying_logits
from heads_factory import FAKE_LAYERS, eagle3_heads, random_eagle
from specrun.backends.fake import FakeBackend
from specrun.backends.kv import sequence_for
from specrun.drafters.heads.eagle import EagleDrafter
from specrun.drafters.methods import DrafterOptions, build_drafter
from specrun.errors import UsageError
from specrun.heads.eagle import chain_guesses
from specrun.sampling import SamplingSettings

TABLE = copying_logits(salt=4)
SIZE = 12
GREEDY = SamplingSettings()


def random_state(context: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(zlib.crc32(repr(context).encode())).normal(0, 1, SIZE).astype(np.float32)


def fake_target() -> FakeBackend:
    return FakeBackend(TABLE, COPYING_VOCAB, hidden_table=random_state, hidden_size=SIZE)


def features_of(context: list[int]) -> np.ndarray:
    return np.stack([random_state(tuple(context[: p + 1])) for p in range(len(context))])


def expected_chain(heads, context: list[int], depth: int) -> list[int]:
    """What the layer drafts after ``context`` from the target's features (the last column)."""
    return list(chain_guesses(heads, features_of(context), np.array(context), depth)[:, -1])


def propose(drafter: EagleDrafter, target: FakeBackend, context: list[int], depth: int, sampling=GREEDY, seed=0):
    """The drafter's proposal with the target's cache holding the context but its last token."""
    sequence = sequence_for(target)
    sequence.sync(context[:-1])
    return drafter.propose(context, depth, sampling, np.random.default_rng(seed))


@pytest.mark.parametrize("window", [128, 5])
def test_chains_follow_the_context_as_it_grows_is_cut_back_and_starts_again(window):
    heads = random_eagle(SIZE, COPYING_VOCAB, depth=4, window=window, draft_vocab=[3, 1, 4, 15, 9, 2, 6, 5, 7])
    target = fake_target()
    drafter = EagleDrafter(heads)
    drafter.bind(sequence_for(target), lambda: 0.0)
    rng = np.random.default_rng(0)
    context = [int(token) for token in rng.integers(0, COPYING_VOCAB, 6)]
    for step in range(30):
        proposal = propose(drafter, target, context, 4)
        assert list(proposal.tokens) == expected_chain(heads, context, 4), step
        if step % 7 == 6:
            context = context[: len(context) - 3]  # a rejection: the context is cut back
        elif step == 20:
            context = [int(token) for token in rng.integers(0, COPYING_VOCAB, 4)]  # another prompt
        else:
            context += [int(token) for token in rng.integers(0, COPYING_VOCAB, int(rng.integers(1, 4)))]
    drafter.close()


def test_a_long_prompt_drafts_from_the_features_the_target_kept():
    """A pass longer than the tail the drafter asked for keeps its last positions' features only:
    the layer reads those (a short window: every position it reads is among them)."""
    heads = random_eagle(SIZE, COPYING_VOCAB, depth=3, window=8)
    target = fake_target()
    drafter = EagleDrafter(heads)
    drafter.bind(sequence_for(target), lambda: 0.0)
    context = [int(token) for token in np.random.default_rng(1).integers(0, COPYING_VOCAB, 200)]
    sequence = sequence_for(target)
    assert sequence.hidden(0, 10) is None  # the prompt's head is unknown ...
    proposal = propose(drafter, target, context, 3)
    assert sequence.hidden(0, 10) is None
    assert list(proposal.tokens) == expected_chain(heads, context, 3)  # ... and not needed


def test_a_greedy_tree_is_the_chain_then_the_likeliest_other_nodes():
    heads = random_eagle(SIZE, COPYING_VOCAB, depth=5)
    target = fake_target()
    drafter = EagleDrafter(heads, branches=6)
    drafter.bind(sequence_for(target), lambda: 0.0)
    context = [1, 2, 3, 4, 5, 6, 1, 2]
    tree = propose(drafter, target, context, 5)
    assert list(tree.main_chain.tokens) == expected_chain(heads, context, 5)
    assert len(tree) == 5 + 6 and not tree.is_chain
    assert all(parent < node for node, parent in enumerate(tree.parents))
    for node in range(len(tree)):  # siblings are other tokens for one position
        siblings = [tree.tokens[i] for i in range(len(tree)) if tree.parents[i] == tree.parents[node]]
        assert len(set(siblings)) == len(siblings)


@pytest.mark.parametrize("eagle3", [False, True])
def test_sampled_drafts_come_with_their_rows_over_the_draft_vocabulary(eagle3):
    draft_vocab = [7, 3, 11, 2, 5]
    heads = (eagle3_heads if eagle3 else random_eagle)(SIZE, COPYING_VOCAB, depth=3, draft_vocab=draft_vocab)
    target = FakeBackend(TABLE, COPYING_VOCAB, hidden_table=random_state, hidden_size=SIZE, n_layers=FAKE_LAYERS)
    drafter = EagleDrafter(heads, branches=2)
    drafter.bind(sequence_for(target), lambda: 0.0)
    proposal = propose(drafter, target, [1, 2, 3, 4], 3, SamplingSettings(temperature=0.8))
    assert len(proposal) == 5 and len(proposal.main_chain) == 3
    for token, row in zip(proposal.tokens, proposal.p_draft):
        assert token in draft_vocab and row[token] > 0
        assert row.sum() == pytest.approx(1.0) and row[np.setdiff1d(np.arange(COPYING_VOCAB), draft_vocab)].sum() == 0


def test_the_method_builds_from_eagle_heads_only():
    from heads_factory import oracle_heads

    assert isinstance(build_drafter("eagle", None, DrafterOptions(heads=random_eagle(SIZE, COPYING_VOCAB))),
                      EagleDrafter)
    with pytest.raises(UsageError, match="drafts with eagle heads, not medusa heads"):
        build_drafter("eagle", None, DrafterOptions(heads=oracle_heads(COPYING_VOCAB)))
    with pytest.raises(UsageError, match="drafts with medusa heads, not eagle heads"):
        build_drafter("medusa", None, DrafterOptions(heads=random_eagle(SIZE, COPYING_VOCAB)))


def test_a_target_without_hidden_states_or_of_another_width_is_refused():
    drafter = EagleDrafter(random_eagle(SIZE, COPYING_VOCAB))
    with pytest.raises(UsageError, match="needs the target's hidden states"):
        drafter.bind(sequence_for(FakeBackend(TABLE, COPYING_VOCAB)), lambda: 0.0)
    other = FakeBackend(TABLE, COPYING_VOCAB, hidden_table=lambda context: np.zeros(SIZE + 1), hidden_size=SIZE + 1)
    with pytest.raises(UsageError, match="hidden size 12"):
        drafter.bind(sequence_for(other), lambda: 0.0)


def test_two_head_drafters_on_one_target_keep_the_longer_tail():
    """A bench binds every variant's drafter to the one cache view: Medusa's tail (65) after
    EAGLE's (its window, 128) must not cut what EAGLE reads."""
    from heads_factory import oracle_heads
    from specrun.drafters.heads.medusa import MedusaDrafter

    target = FakeBackend(TABLE, COPYING_VOCAB, hidden_table=lambda context: np.zeros(5 * COPYING_VOCAB),
                         hidden_size=5 * COPYING_VOCAB)
    sequence = sequence_for(target)
    EagleDrafter(random_eagle(5 * COPYING_VOCAB, COPYING_VOCAB)).bind(sequence, lambda: 0.0)
    MedusaDrafter(oracle_heads(COPYING_VOCAB)).bind(sequence, lambda: 0.0)
    sequence.feed([int(token) for token in np.random.default_rng(0).integers(0, COPYING_VOCAB, 200)])
    assert sequence.hidden(200 - 128, 200) is not None and sequence.hidden(200 - 129, 200) is None
