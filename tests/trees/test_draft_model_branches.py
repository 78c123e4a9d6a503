"""The draft model's token trees: second guesses beside its chain where it was least sure of its
first guess, its runner-up at temperature 0 and a draw without the first guess above it."""

from __future__ import annotations

import numpy as np

from specrun.backends.fake import FakeBackend
from specrun.drafters.draft_model import DraftModelDrafter
from specrun.sampling import SamplingSettings

VOCAB = 6


def confident_then_torn(context):
    """Sure of token 1 after an even-length context; torn between 2 and 3 after an odd one."""
    logits = np.full(VOCAB, -5.0, dtype=np.float32)
    if len(context) % 2 == 0:
        logits[1] = 5.0
    else:
        logits[2], logits[3] = 1.0, 0.9
    return logits


def test_greedy_second_guesses_are_the_runner_ups_where_the_draft_was_torn():
    drafter = DraftModelDrafter(FakeBackend(confident_then_torn, VOCAB), branches=2)
    proposal = drafter.propose([0, 0], 4, SamplingSettings(), np.random.default_rng(0))
    assert proposal.main_chain.tokens == (1, 2, 1, 2)
    # torn at positions 2 and 4 (depths 1 and 3): 3 beside each 2, the deeper reached less often
    assert proposal.tokens[4:] == (3, 3) and proposal.parents[4:] == (0, 2)
    assert proposal.p_draft == (None,) * 6  # greedy: deterministic nodes


def test_one_branch_goes_where_it_is_worth_most():
    drafter = DraftModelDrafter(FakeBackend(confident_then_torn, VOCAB), branches=1)
    proposal = drafter.propose([0, 0], 4, SamplingSettings(), np.random.default_rng(0))
    assert proposal.tokens[4:] == (3,) and proposal.parents[4:] == (0,)


def test_a_sampled_second_guess_is_drawn_without_the_first_and_carries_that_row():
    drafter = DraftModelDrafter(FakeBackend(confident_then_torn, VOCAB), branches=1)
    proposal = drafter.propose([0, 0], 2, SamplingSettings(temperature=1.0, seed=0), np.random.default_rng(3))
    chain, guess, row = proposal.tokens[1], proposal.tokens[2], proposal.p_draft[2]
    assert proposal.parents[2] == 0 and guess != chain
    assert row[chain] == 0.0 and np.isclose(row.sum(), 1.0) and row[guess] > 0.0


def test_without_branches_the_draft_stays_a_chain():
    drafter = DraftModelDrafter(FakeBackend(confident_then_torn, VOCAB))
    assert drafter.propose([0, 0], 4, SamplingSettings(), np.random.default_rng(0)).is_chain
