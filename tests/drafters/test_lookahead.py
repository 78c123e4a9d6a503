"""Lookahead decoding: the window's layout as a tree, the Jacobi step, the pool and its candidates.

Losslessness (greedy and sampled, fixed and adaptive) runs through the harness with every other
method (tests/engine/test_acceptance.py, tests/drafters/test_drafters.py on both real backends,
tests/sessions/test_real_model.py); these tests pin what the drafter itself does.
"""

from __future__ import annotations

import numpy as np
import pytest

from fake_models import hashed_logits
from lossless_harness import run_scenario
from specrun.backends.fake import FakeBackend
from specrun.drafters.base import Proposal
from specrun.drafters.lookahead import LookaheadDrafter, LookaheadSizes
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.sampling import SamplingSettings

GREEDY = SamplingSettings()
RNG = np.random.default_rng(0)


def drafter_with_window(levels: list[list[int]], candidates: int = 3) -> LookaheadDrafter:
    """A drafter whose window holds ``levels`` (distinct tokens make every cell its own node)."""
    drafter = LookaheadDrafter(LookaheadSizes(len(levels[0]), len(levels) + 1, candidates))
    context = [90, 91, 92]
    drafter.prefill(context)
    drafter.levels = [list(level) for level in levels]
    return drafter


def cell_of(proposal: Proposal, drafter: LookaheadDrafter) -> dict[int, tuple[int, int]]:
    """Node index -> (level, column) of the window cell it holds."""
    return {node: (level, column) for level, row in enumerate(drafter._cell_nodes)
            for column, node in enumerate(row) if node >= 0}


def test_the_window_is_the_tree_of_llama_lookahead_s_sequence_layout():
    """llama-lookahead puts level-0 column i in sequences i+1..W and level j>0 column i in
    sequence i+1 alone (the last token in all): a cell sees exactly the cells that share a
    sequence with it and sit earlier. Written from that layout, not from the drafter."""
    window, levels = 4, 3
    grid = [[10 * (level + 1) + column for column in range(window)] for level in range(levels)]
    drafter = drafter_with_window(grid, candidates=0)
    proposal = drafter.propose([90, 91, 92], 16, GREEDY, RNG)
    cells = cell_of(proposal, drafter)
    assert len(proposal) == (window - 1) + window * (levels - 1) == LookaheadSizes(window, levels + 1, 0).max_nodes

    def sequences(level: int, column: int) -> set[int]:
        return set(range(column + 1, window + 1)) if level == 0 else {column + 1}

    def position(level: int, column: int) -> int:
        return level + column

    tree = proposal.tree
    for node, (level, column) in cells.items():
        assert proposal.tokens[node] == grid[level][column]
        assert tree.depth[node] + 1 == position(level, column)  # the root, the last token, sits at 0
        seen = {other for other, (lv, col) in cells.items()
                if sequences(lv, col) & sequences(level, column) and position(lv, col) < position(level, column)}
        assert set(np.flatnonzero(tree.ancestor_mask[node])) == seen | {node}


def test_candidates_come_first_newest_first_and_share_nodes_with_the_window():
    drafter = drafter_with_window([[1, 2, 3], [4, 5, 6]])
    drafter.pool[92] = [(7, 8), (2, 3), (7, 9)]  # oldest first
    proposal = drafter.propose([90, 91, 92], 16, GREEDY, RNG)
    assert proposal.main_chain.tokens == (7, 9)  # the newest candidate
    assert proposal.tokens[:4] == (7, 9, 2, 3)
    eight = proposal.tokens.index(8)
    assert proposal.parents[eight] == 0  # (7, 8) shares its first node with (7, 9)
    siblings = [proposal.tokens[child] for child in proposal.tree.children_of(-1)]
    assert len(siblings) == len(set(siblings))  # a trie: no token twice among siblings
    # the candidate (2, 3) is level 0's chain: one path, not two
    level0 = drafter._cell_nodes[0]
    assert proposal.tokens[level0[1]] == 2 and proposal.parents[level0[2]] == level0[1]
    assert sum(1 for node in range(len(proposal)) if proposal.parents[node] == -1 and proposal.tokens[node] == 2) == 1


def test_no_node_sits_deeper_than_the_draft_length():
    drafter = drafter_with_window([[1, 2, 3, 4, 5], [11, 12, 13, 14, 15], [21, 22, 23, 24, 25]])
    drafter.pool[92] = [(31, 32, 33)]
    proposal = drafter.propose([90, 91, 92], 2, GREEDY, RNG)
    assert proposal.tree.max_depth == 2
    assert (31, 32) == proposal.main_chain.tokens
    assert drafter.propose([90, 91, 92], 0, GREEDY, RNG) == Proposal()


def test_a_pass_moves_the_window_up_and_the_target_s_choices_fill_the_last_level():
    grid = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    drafter = drafter_with_window(grid)
    context = [90, 91, 92]
    proposal = drafter.propose(context, 16, GREEDY, RNG)
    choices = np.full(1 + len(proposal), 50)  # (1 + n,): the target's choice after each node
    for column, node in enumerate(drafter._cell_nodes[-1]):
        choices[1 + node] = 60 + column
    drafter.observe_pass(proposal, choices)
    drafter.propose([*context, 50], 16, GREEDY, RNG)  # one token emitted: one Jacobi step
    assert drafter.levels == [[50, 5, 6], [7, 8, 9], [60, 61, 62]]  # level 0 starts at the new last token
    # each column, down from the token that left level 0, is an n-gram of the pool; column 0's
    # starts at the last token (level 0's column 0 is the root)
    assert drafter.pool == {92: [(4, 7, 60)], 2: [(5, 8, 61)], 3: [(6, 9, 62)]}


def test_more_tokens_emitted_move_the_window_on_refilled_from_level_0():
    drafter = drafter_with_window([[1, 2], [3, 4], [5, 6]])
    proposal = drafter.propose([90, 91, 92], 16, GREEDY, RNG)
    choices = np.zeros(1 + len(proposal), dtype=np.int64)
    for column, node in enumerate(drafter._cell_nodes[-1]):
        choices[1 + node] = 70 + column
    drafter.observe_pass(proposal, choices)
    drafter.propose([90, 91, 92, 40, 41, 42], 16, GREEDY, RNG)  # three emitted
    # step 1: [[3,4],[5,6],[70,71]]; then twice more with level 0 copied to the last level
    assert drafter.levels == [[42, 71], [5, 6], [70, 71]]


def test_cells_the_pass_did_not_hold_are_refilled_from_level_0():
    """The engine may verify part of a proposal (its node cap): cells it left out learn nothing."""
    drafter = drafter_with_window([[1, 2, 3], [4, 5, 6]])  # an empty pool: the window alone
    proposal = drafter.propose([90, 91, 92], 16, GREEDY, RNG)
    last = drafter._cell_nodes[-1]
    kept = proposal.prefix(max(last[:2]) + 1)  # the first two columns' last level only
    choices = np.arange(100, 101 + len(kept))
    drafter.observe_pass(kept, choices)
    drafter.propose([90, 91, 92, 7], 16, GREEDY, RNG)
    assert drafter.levels[-1] == [100 + 1 + last[0], 100 + 1 + last[1], 6]
    assert sorted(drafter.pool) == [2, 92]  # the third column's refill is no n-gram


def test_after_more_plain_steps_than_levels_the_window_restarts_from_the_context_s_tail():
    drafter = drafter_with_window([[1, 2], [3, 4]])
    drafter.propose([90, 91, 92], 16, GREEDY, RNG)
    drafter.propose([90, 91, 92, 93, 94, 95, 96], 16, GREEDY, RNG)  # four tokens, no pass seen
    assert drafter.levels == [[96, 94], [95, 96]]  # the tail [93, 94, 95, 96], column 0 the last token


def test_a_context_it_did_not_follow_restarts_the_window_from_its_tail():
    drafter = drafter_with_window([[1, 2], [3, 4]])
    drafter.pool[5] = [(6, 7)]
    drafter.propose([9, 8, 7, 6, 5], 16, GREEDY, RNG)
    assert drafter.levels == [[5, 7], [6, 5]]  # column 0 of level 0: the last token
    assert drafter.pool == {5: [(6, 7)]}  # the pool outlives runs


def test_the_pool_keeps_the_newest_n_grams_at_its_cap_and_none_twice():
    drafter = LookaheadDrafter(LookaheadSizes(2, 3, 2))
    drafter.prefill([1, 2, 3])
    for levels in ([[5, 5], [6, 6]], [[5, 5], [7, 7]], [[5, 5], [8, 8]]):
        drafter.levels = [list(level) for level in levels]
        drafter._learn([1, 1], [0, 1])
    assert drafter.pool == {1: [(5, 7), (5, 8)]}


@pytest.mark.parametrize(("window", "ngram", "candidates"), [(1, 4, 3), (33, 4, 3), (5, 1, 3), (5, 9, 3), (5, 4, -1),
                                                             (5, 4, 33)])
def test_sizes_out_of_range_are_refused(window, ngram, candidates):
    with pytest.raises(ValueError, match="must be"):
        LookaheadSizes(window, ngram, candidates)


def repeating_target(vocab: int = 32, period: int = 7) -> FakeBackend:
    """A target whose greedy output cycles through ``period`` tokens, whatever came before
    (the next token a function of the last): what Jacobi iteration settles on in a few steps."""
    def logits(context):
        row = np.zeros(vocab, dtype=np.float32)
        row[(context[-1] + 1) % period] = 5.0
        return row

    return FakeBackend(logits, vocab)


def test_the_window_learns_n_grams_the_pool_then_gets_right():
    """On a target that repeats a short cycle, the Jacobi window finds its n-grams within a few
    passes and most later passes accept a whole candidate: many tokens a pass, output unchanged."""
    plain = SpeculativeEngine(repeating_target()).run([3], GenerationParams(60, draft_len=0))
    engine = SpeculativeEngine(repeating_target(), LookaheadDrafter())
    result = engine.run([3], GenerationParams(60, draft_len=8))
    assert result.token_ids == plain.token_ids
    assert result.stats.accepted >= 30  # at least 1.5 tokens a pass past the first few


def test_sampled_verification_tries_sibling_candidates_against_the_residual():
    """The tree's siblings (candidates, the window's first cells) each meet the residual their
    rejected elders left: the harness checks every one against SpecInfer's rule."""
    sampled, problems = run_scenario("lookahead")
    assert problems == []
    assert sampled.verified.siblings_tested > 0


def test_a_window_drafter_sees_every_pass_through_a_chain():
    """A chain forwards the pass to the member whose proposal it was, and to no other."""
    from specrun.drafters.chain import ChainDrafter
    from specrun.drafters.lookup import PromptLookupDrafter

    lookahead = drafter_with_window([[1, 2], [3, 4]])
    chain = ChainDrafter([PromptLookupDrafter(), lookahead])
    assert chain.reads_pass
    proposal = lookahead.propose([90, 91, 92], 16, GREEDY, RNG)
    chain.observe_pass(Proposal(proposal.tokens, source="lookup", parents=proposal.parents),
                       np.zeros(1 + len(proposal), dtype=np.int64))
    assert lookahead._choices == [None, None]
    chain.observe_pass(proposal, np.full(1 + len(proposal), 9))
    assert lookahead._choices == [9, 9]


def test_engine_hands_the_pass_to_the_drafter_only_when_it_reads_passes():
    target = FakeBackend(hashed_logits(16, salt=3), 16)
    seen = []

    class Watching(LookaheadDrafter):
        def observe_pass(self, proposal, target_argmax):
            seen.append((len(proposal), target_argmax.shape))
            super().observe_pass(proposal, target_argmax)

    engine = SpeculativeEngine(target, Watching())
    engine.run([1, 2, 3], GenerationParams(12, draft_len=4, sampling=SamplingSettings(temperature=1.0, seed=1)))
    assert seen and all(shape == (1 + n,) for n, shape in seen)  # argmax rows, also when sampling

    class NotReading(Watching):
        reads_pass = False

    seen.clear()
    SpeculativeEngine(target, NotReading()).run([1, 2, 3], GenerationParams(12, draft_len=4))
    assert seen == []
