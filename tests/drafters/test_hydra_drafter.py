"""The Hydra drafter on a fake target with hidden states: each draft is what its head says given
the hidden state and the tokens before it (checked against the heads' formula written out in
full here), trees grow each node's children from that node's own path, sampled drafts are drawn
from the rows they report given the draws before them. Losslessness is the harness's
(tests/engine/test_acceptance.py)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from fake_models import COPYING_VOCAB, copying_logits
from heads_factory import oracle_heads, oracle_hidden, oracle_hydra, random_hydra
from specrun.backends.fake import FakeBackend
from specrun.backends.kv import sequence_for
from specrun.drafters.heads.hydra import HydraDrafter
from specrun.drafters.methods import DrafterOptions, build_drafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.errors import UsageError
from specrun.heads.hydra import chain_guesses
from specrun.sampling import SamplingSettings

TABLE = copying_logits(salt=4)
SIZE = 12
GREEDY = SamplingSettings()
CONTEXT = [1, 2, 3, 4, 5, 6, 1, 2]


def random_state(context: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(zlib.crc32(repr(context).encode())).normal(0, 1, SIZE).astype(np.float32)


def bound(heads, context: list[int], branches: int = 0) -> HydraDrafter:
    """The drafter bound to a fake target whose cache holds ``context`` but its last token."""
    target = FakeBackend(TABLE, COPYING_VOCAB, hidden_table=random_state, hidden_size=SIZE)
    sequence = sequence_for(target)
    drafter = HydraDrafter(heads, branches=branches)
    drafter.bind(sequence, lambda: 0.0)
    sequence.sync(context[:-1])
    return drafter


def written_out(heads, head: int, hidden: np.ndarray, tokens: list[int]) -> np.ndarray:
    """Head ``head``'s logits (Vd,) after the target ids ``tokens`` (the context's last, then the
    drafts), as the module's docstring writes it: one matrix over [h ; e(t_1) ; ... ; e(t_i+1)]."""
    weight, bias = heads.inputs[head]
    joined = np.concatenate([hidden, *heads.embed[heads.draft_ids(np.array(tokens))]])
    z = weight @ joined + bias
    x = hidden + z / (1.0 + np.exp(-z))
    for block_weight, block_bias in heads.blocks[head]:
        y = block_weight @ x + block_bias
        x = x + y / (1.0 + np.exp(-y))
    return heads.lm_heads[head] @ x


def greedy_chain(heads, context: list[int], depth: int) -> list[int]:
    hidden = random_state(tuple(context[:-1]))
    tokens = [context[-1]]
    d2t = heads.d2t if heads.d2t is not None else np.arange(heads.config.vocab_size)
    for head in range(depth):
        tokens.append(int(d2t[written_out(heads, head, hidden, tokens).argmax()]))
    return tokens[1:]


@pytest.mark.parametrize("num_layers", [1, 2])
def test_greedy_drafts_read_the_hidden_state_and_every_token_before_them(num_layers):
    heads = random_hydra(SIZE, COPYING_VOCAB, num_heads=5, num_layers=num_layers, draft_vocab=[3, 1, 4, 15, 9, 2, 6])
    drafter = bound(heads, CONTEXT)
    proposal = drafter.propose(CONTEXT, 5, GREEDY, np.random.default_rng(0))
    expected = greedy_chain(heads, CONTEXT, 5)
    assert list(proposal.tokens) == expected and proposal.is_chain
    # The report's chain (heads.hydra.chain_guesses) drafts alike, many positions at once.
    hidden = random_state(tuple(CONTEXT[:-1]))[None, :]
    assert list(chain_guesses(heads, hidden, np.array([CONTEXT[-1]]), 5)[:, 0]) == expected
    assert len(drafter.propose(CONTEXT, 16, GREEDY, np.random.default_rng(0))) == 5  # one per head


def test_a_tree_grows_each_node_s_children_from_its_own_path():
    heads = random_hydra(SIZE, COPYING_VOCAB, num_heads=4, seed=2)
    drafter = bound(heads, CONTEXT, branches=8)
    tree = drafter.propose(CONTEXT, 4, GREEDY, np.random.default_rng(0))
    assert list(tree.main_chain.tokens) == greedy_chain(heads, CONTEXT, 4)
    assert len(tree) == 4 + 8 and not tree.is_chain
    assert all(parent < node for node, parent in enumerate(tree.parents))
    hidden = random_state(tuple(CONTEXT[:-1]))
    children_seen = {}
    for node in range(len(tree)):
        path, parent = [], tree.parents[node]
        while parent >= 0:
            path.insert(0, tree.tokens[parent])
            parent = tree.parents[parent]
        siblings = [tree.tokens[i] for i in range(len(tree)) if tree.parents[i] == tree.parents[node]]
        assert len(set(siblings)) == len(siblings)
        # A node is among the top 4 of its depth's head reading its own path.
        logits = written_out(heads, len(path), hidden, [CONTEXT[-1], *path])
        assert tree.tokens[node] in np.argsort(-logits)[:4], node
        children_seen.setdefault(len(path), {})[tuple(path)] = int(logits.argmax())
    # Two paths of one depth get different first guesses: the heads read the path, not the depth alone.
    assert any(len(set(guesses.values())) > 1 for guesses in children_seen.values())


def test_sampled_drafts_are_drawn_from_their_rows_given_the_draws_before_them():
    heads = random_hydra(SIZE, COPYING_VOCAB, num_heads=2, seed=3, draft_vocab=[7, 3, 11, 2, 5])
    drafter = bound(heads, CONTEXT)
    settings = SamplingSettings(temperature=1.0)
    rng = np.random.default_rng(0)
    draws = [drafter.propose(CONTEXT, 2, settings, rng) for _ in range(4000)]
    for proposal in draws[:5]:
        for token, row in zip(proposal.tokens, proposal.p_draft):
            assert token in (7, 3, 11, 2, 5) and row[token] > 0 and row.sum() == pytest.approx(1.0)
    first_row = draws[0].p_draft[0]
    firsts = np.array([proposal.tokens[0] for proposal in draws])
    assert np.abs(np.bincount(firsts, minlength=COPYING_VOCAB) / len(draws) - first_row).max() < 0.03
    # The second draw's row is the second head's given the first draw: rows differ with it.
    common = int(np.bincount(firsts).argmax())
    given = [proposal for proposal in draws if proposal.tokens[0] == common]
    second_row = given[0].p_draft[1]
    assert all(np.allclose(proposal.p_draft[1], second_row) for proposal in given)
    seconds = np.bincount([proposal.tokens[1] for proposal in given], minlength=COPYING_VOCAB) / len(given)
    assert np.abs(seconds - second_row).max() < 0.05
    other = next(proposal for proposal in draws if proposal.tokens[0] != common)
    assert not np.allclose(other.p_draft[1], second_row)


def test_sampled_with_branches_adds_second_guesses_beside_the_chain():
    drafter = bound(random_hydra(SIZE, COPYING_VOCAB, num_heads=3, seed=1), CONTEXT, branches=2)
    proposal = drafter.propose(CONTEXT, 3, SamplingSettings(temperature=0.8), np.random.default_rng(0))
    assert len(proposal.main_chain) == 3 and len(proposal) == 5
    for node in (3, 4):  # another token for a chain position, from the same row
        sibling = proposal.parents[node] + 1
        assert proposal.tokens[node] != proposal.tokens[sibling]


def test_no_hidden_state_for_the_last_position_means_no_proposal():
    target = FakeBackend(TABLE, COPYING_VOCAB, hidden_table=random_state, hidden_size=SIZE)
    sequence = sequence_for(target)
    sequence.sync(CONTEXT[:-1])  # fed with tracking off
    drafter = HydraDrafter(random_hydra(SIZE, COPYING_VOCAB))
    drafter.bind(sequence, lambda: 0.0)
    assert drafter.propose(CONTEXT, 4, GREEDY, np.random.default_rng(0)).tokens == ()


def test_the_method_builds_from_hydra_heads_only_and_refuses_other_targets():
    assert isinstance(build_drafter("hydra", None, DrafterOptions(heads=random_hydra(SIZE, COPYING_VOCAB))),
                      HydraDrafter)
    with pytest.raises(UsageError, match="needs heads"):
        build_drafter("hydra", None, DrafterOptions())
    with pytest.raises(UsageError, match="drafts with hydra heads, not medusa heads"):
        build_drafter("hydra", None, DrafterOptions(heads=oracle_heads(COPYING_VOCAB)))
    with pytest.raises(UsageError, match="drafts with medusa heads, not hydra heads"):
        build_drafter("medusa", None, DrafterOptions(heads=random_hydra(SIZE, COPYING_VOCAB)))
    drafter = HydraDrafter(random_hydra(SIZE, COPYING_VOCAB))
    with pytest.raises(UsageError, match="needs the target's hidden states"):
        drafter.bind(sequence_for(FakeBackend(TABLE, COPYING_VOCAB)), lambda: 0.0)
    other = FakeBackend(TABLE, COPYING_VOCAB, hidden_table=lambda context: np.zeros(SIZE + 1), hidden_size=SIZE + 1)
    with pytest.raises(UsageError, match="hidden size 12"):
        drafter.bind(sequence_for(other), lambda: 0.0)


@pytest.mark.parametrize("branches", [0, 4])
def test_greedy_generation_with_oracle_heads_is_plain_decoding_and_drafts_several_deep(branches):
    hidden = oracle_hidden(TABLE, COPYING_VOCAB, wrong=0.2)
    target = FakeBackend(TABLE, COPYING_VOCAB, hidden_table=hidden, hidden_size=5 * COPYING_VOCAB)
    drafter = build_drafter("hydra", None, DrafterOptions(heads=oracle_hydra(COPYING_VOCAB), branches=branches))
    engine = SpeculativeEngine(target, drafter, method="hydra")
    prompt = [*CONTEXT, 3]
    plain = SpeculativeEngine(FakeBackend(TABLE, COPYING_VOCAB)).run(prompt, GenerationParams(60, 0, stop_at_eos=False))
    result = engine.run(prompt, GenerationParams(60, 4, stop_at_eos=False))
    drafter.close()
    assert result.token_ids == plain.token_ids
    assert result.stats.accepted / result.stats.drafted > (0.25 if branches else 0.4)  # heads right ~80% a position
    assert len(result.token_ids) / result.stats.steps > 2.0
