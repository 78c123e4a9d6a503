"""Prompt lookup's token trees: every earlier occurrence of the matched n-gram whose
continuation differs from the latest one's becomes a branch from where the two part."""

from __future__ import annotations

import numpy as np

from specrun.drafters.lookup import PromptLookupDrafter
from specrun.sampling import SamplingSettings

GREEDY = SamplingSettings()


def propose(context, draft_len=3, branches=4):
    return PromptLookupDrafter(branches=branches).propose(context, draft_len, GREEDY, np.random.default_rng(0))


def test_an_earlier_occurrence_that_parts_at_once_is_a_sibling_with_its_own_continuation():
    # 1 2 is followed by 3 4 5 first and by 7 8 9 later; the context ends on 1 2 again
    proposal = propose([1, 2, 3, 4, 5, 0, 1, 2, 7, 8, 9, 0, 1, 2])
    assert proposal.tokens == (7, 8, 9, 3, 4, 5)  # the latest continuation is the chain
    assert proposal.parents == (-1, 0, 1, -1, 3, 4)
    assert proposal.main_chain.tokens == (7, 8, 9)


def test_an_occurrence_that_parts_later_branches_from_the_shared_prefix():
    proposal = propose([1, 2, 3, 4, 0, 1, 2, 3, 6, 0, 1, 2])
    assert proposal.tokens == (3, 6, 0, 4, 0)
    assert proposal.parents == (-1, 0, 1, 0, 3)  # 4 beside 6, after the shared 3


def test_the_same_continuation_twice_adds_nothing_and_chains_stay_chains():
    context = [1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2]
    assert propose(context).is_chain
    assert propose([1, 2, 3, 4, 5, 0, 1, 2, 7, 8, 9, 0, 1, 2], branches=0).tokens == (7, 8, 9)


def test_branches_are_capped_and_the_newest_occurrences_come_first():
    context = [1, 2, 10, 0, 1, 2, 11, 0, 1, 2, 12, 0, 1, 2, 13, 0, 1, 2]
    proposal = propose(context, draft_len=1, branches=2)
    assert proposal.tokens == (13, 12, 11) and proposal.parents == (-1, -1, -1)
    assert len(proposal.tree.paths) == 3


def test_branches_follow_a_rewound_context():
    drafter = PromptLookupDrafter(branches=4)
    rng = np.random.default_rng(0)
    context = [1, 2, 3, 4, 5, 0, 1, 2, 7, 8, 9, 0, 1, 2]
    drafter.propose(context, 3, GREEDY, rng)
    rewound = context[:8]  # … 0 1 2: only the first occurrence remains before the last
    assert drafter.propose(rewound, 3, GREEDY, rng).tokens == (3, 4, 5)
    again = drafter.propose([*rewound, 6, 6, 0, 1, 2], 3, GREEDY, rng)
    assert again.tokens == (6, 6, 0, 3, 4, 5) and again.parents == (-1, 0, 1, -1, 3, 4)
