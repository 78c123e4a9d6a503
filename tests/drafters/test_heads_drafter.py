"""The Medusa drafter on a fake target with hidden states: what it proposes from them, and
what it refuses. Losslessness is the harness's (tests/engine/test_acceptance.py)."""

from __future__ import annotations

import numpy as np
import pytest

from fake_models import COPYING_VOCAB, copying_logits
from heads_factory import oracle_heads, oracle_hidden, random_heads
from specrun.backends.fake import FakeBackend
from specrun.backends.kv import sequence_for
from specrun.drafters.heads.medusa import MedusaDrafter
from specrun.drafters.methods import DrafterOptions, build_drafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.errors import UsageError
from specrun.sampling import SamplingSettings

TABLE = copying_logits(salt=4)
PROMPT = [1, 2, 3, 4, 5, 6, 1, 2, 3]


def fake_target(wrong: float = 0.0) -> FakeBackend:
    hidden = oracle_hidden(TABLE, COPYING_VOCAB, wrong=wrong)
    return FakeBackend(TABLE, COPYING_VOCAB, hidden_table=hidden, hidden_size=5 * COPYING_VOCAB)


def bound(drafter: MedusaDrafter, target: FakeBackend, context: list[int]):
    """The drafter bound to ``target`` whose cache holds ``context`` but its last token, as
    between verify passes."""
    sequence = sequence_for(target)
    drafter.bind(sequence, lambda: 0.0)
    sequence.sync(context[:-1])
    return drafter


def greedy_future(context: list[int], n: int) -> list[int]:
    rolled = list(context)
    for _ in range(n):
        rolled.append(int(np.argmax(TABLE(tuple(rolled)))))
    return rolled[len(context):]


def test_greedy_heads_guess_from_the_last_cached_hidden_state():
    """Head i reads the state after the context's second-to-last token: its guess is the token
    i + 1 places after the context's end (oracle heads, never wrong: the target's own future)."""
    context = [*PROMPT, *greedy_future(PROMPT, 1)]
    drafter = bound(MedusaDrafter(oracle_heads(COPYING_VOCAB)), fake_target(), context)
    proposal = drafter.propose(context, 3, SamplingSettings(), np.random.default_rng(0))
    assert proposal.tokens == tuple(greedy_future(context, 3))
    assert proposal.is_chain and proposal.p_draft == (None, None, None)
    assert len(drafter.propose(context, 16, SamplingSettings(), np.random.default_rng(0))) == 4  # one per head


def test_a_draft_vocabulary_maps_back_to_target_ids():
    draft_vocab = [7, 3, 11, 40]
    heads = random_heads(5 * COPYING_VOCAB, COPYING_VOCAB, num_heads=2, draft_vocab=draft_vocab)
    drafter = bound(MedusaDrafter(heads), fake_target(), PROMPT)
    greedy = drafter.propose(PROMPT, 2, SamplingSettings(), np.random.default_rng(0))
    assert set(greedy.tokens) <= set(draft_vocab)
    sampled = drafter.propose(PROMPT, 2, SamplingSettings(temperature=1.0), np.random.default_rng(0))
    for token, row in zip(sampled.tokens, sampled.p_draft):
        assert row.shape == (COPYING_VOCAB,) and row.sum() == pytest.approx(1.0)
        assert set(np.flatnonzero(row)) <= set(draft_vocab) and row[token] > 0


def test_sampled_drafts_are_drawn_from_the_rows_they_report():
    heads = random_heads(5 * COPYING_VOCAB, COPYING_VOCAB, num_heads=1, seed=3)
    drafter = bound(MedusaDrafter(heads), fake_target(), PROMPT)
    settings = SamplingSettings(temperature=1.0)
    rng = np.random.default_rng(0)
    draws = [drafter.propose(PROMPT, 1, settings, rng) for _ in range(3000)]
    row = draws[0].p_draft[0]
    counts = np.bincount([proposal.tokens[0] for proposal in draws], minlength=COPYING_VOCAB)
    likely = row > 0.02
    assert np.abs(counts[likely] / 3000 - row[likely]).max() < 0.03


def test_branches_grow_medusa_s_sparse_tree_with_guesses_under_second_guesses_too():
    """Greedy with branches: the chain, then the likeliest other nodes by the product of the
    heads' probabilities along their path; a second guess at depth 1 carries head 2's guesses."""
    heads = random_heads(5 * COPYING_VOCAB, COPYING_VOCAB, num_heads=4, seed=1)
    drafter = bound(MedusaDrafter(heads, branches=8), fake_target(), PROMPT)
    proposal = drafter.propose(PROMPT, 4, SamplingSettings(), np.random.default_rng(0))
    logits = drafter.head_logits(drafter.target.hidden(len(PROMPT) - 2, len(PROMPT) - 1)[0], 4)
    chain = tuple(int(i) for i in logits.argmax(axis=1))
    assert proposal.main_chain.tokens == chain and len(proposal) == 12
    depth = {}
    for node, parent in enumerate(proposal.parents):
        depth[node] = 1 if parent < 0 else depth[parent] + 1
        # every node is one of its head's top-4 guesses, whatever its parent: no head reads the drafts before it
        assert proposal.tokens[node] in np.argsort(-logits[depth[node] - 1])[:4]
    on_second_guesses = [node for node, parent in enumerate(proposal.parents)
                         if parent >= 0 and proposal.parents[parent] < 0 and parent != 0]
    assert on_second_guesses, proposal  # a child under a first-position runner-up
    # the likeliest path under a runner-up takes each later head's first guess, as the chain does
    child = on_second_guesses[0]
    assert proposal.tokens[child] == chain[1]


def test_no_hidden_state_for_the_last_position_means_no_proposal():
    """A cache filled before the heads were in use has no hidden states: nothing to draft from."""
    target = fake_target()
    sequence = sequence_for(target)
    sequence.sync(PROMPT[:-1])  # fed with tracking off
    drafter = MedusaDrafter(oracle_heads(COPYING_VOCAB))
    drafter.bind(sequence, lambda: 0.0)
    assert drafter.propose(PROMPT, 4, SamplingSettings(), np.random.default_rng(0)).tokens == ()


def test_closing_the_drafter_stops_the_hidden_states():
    target = fake_target()
    drafter = bound(MedusaDrafter(oracle_heads(COPYING_VOCAB)), fake_target(), PROMPT)
    drafter.close()
    sequence = sequence_for(target)
    sequence.sync(PROMPT)
    assert sequence.hidden(0, 1) is None


def test_a_target_without_hidden_states_or_of_another_size_is_refused():
    plain = FakeBackend(TABLE, COPYING_VOCAB)
    with pytest.raises(UsageError, match="hidden states"):
        MedusaDrafter(oracle_heads(COPYING_VOCAB)).bind(sequence_for(plain), lambda: 0.0)
    other = random_heads(64, COPYING_VOCAB)
    with pytest.raises(UsageError, match="hidden size 64"):
        MedusaDrafter(other).bind(sequence_for(fake_target()), lambda: 0.0)


def test_medusa_needs_heads():
    with pytest.raises(UsageError, match="needs heads"):
        build_drafter("medusa", None, DrafterOptions())


def test_greedy_generation_with_oracle_heads_is_plain_decoding_and_drafts_several_deep():
    target = fake_target(wrong=0.2)
    drafter = build_drafter("medusa", None, DrafterOptions(heads=oracle_heads(COPYING_VOCAB)))
    engine = SpeculativeEngine(target, drafter, method="medusa")
    plain = SpeculativeEngine(FakeBackend(TABLE, COPYING_VOCAB)).run(PROMPT, GenerationParams(60, 0, stop_at_eos=False))
    result = engine.run(PROMPT, GenerationParams(60, 4, stop_at_eos=False))
    assert result.token_ids == plain.token_ids
    assert result.stats.accepted / result.stats.drafted > 0.4  # heads right ~80% a position
    assert len(result.token_ids) / result.stats.steps > 2.0
