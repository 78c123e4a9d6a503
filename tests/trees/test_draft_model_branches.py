"""The draft model's token trees. Greedy, where the draft reads trees itself, an EAGLE-2 dynamic
tree grown by the draft's own path probabilities (issue 28, item 4); sampled, or where the draft
reads chains only, second guesses beside its chain where it was least sure of its first guess:
its runner-up at temperature 0, a draw without the first guess above it."""

from __future__ import annotations

import numpy as np
import pytest

from specrun.backends.base import TreeSupport
from specrun.backends.fake import FakeBackend
from specrun.backends.kv import sequence_for
from specrun.drafters.draft_model import WIDE_TREE_BRANCHES, DraftModelDrafter, PassTiming
from specrun.drafters.dynamic_tree import TOP_K, DraftTree
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


def bound(drafter: DraftModelDrafter, clock=None) -> DraftModelDrafter:
    """``drafter`` bound to a target that verifies trees (the engine binds it so)."""
    target = type("Target", (), {"backend": FakeBackend(lambda context: np.zeros(12, np.float32), 12)})()
    drafter.bind(target, clock if clock is not None else (lambda: 0.0))
    return drafter


def chains_only(logits_fn, vocab: int = VOCAB) -> FakeBackend:
    """A fake draft that reads chains only (as a llama.cpp context that could not be re-created)."""
    backend = FakeBackend(logits_fn, vocab)
    backend.tree_support = TreeSupport(False, "this test's draft reads chains only")
    return backend


def test_greedy_second_guesses_are_the_runner_ups_where_the_draft_was_torn():
    drafter = DraftModelDrafter(chains_only(confident_then_torn), branches=2)
    proposal = drafter.propose([0, 0], 4, SamplingSettings(), np.random.default_rng(0))
    assert proposal.main_chain.tokens == (1, 2, 1, 2)
    # torn at positions 2 and 4 (depths 1 and 3): 3 beside each 2, the deeper reached less often
    assert proposal.tokens[4:] == (3, 3) and proposal.parents[4:] == (0, 2)
    assert proposal.p_draft == (None,) * 6  # greedy: deterministic nodes


def test_one_branch_goes_where_it_is_worth_most():
    drafter = DraftModelDrafter(chains_only(confident_then_torn), branches=1)
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


# ---- the dynamic tree (greedy, a draft that reads trees) ------------------------------------
def hashed(context) -> np.ndarray:
    """Logits that depend on the whole context, so every path reads its own."""
    rng = np.random.default_rng(abs(hash(tuple(context))) % (2**32))
    return rng.normal(0.0, 2.0, 12).astype(np.float32)


def reference_tree(logits_fn, context: list[int], depth: int, branches: int,
                   top_k: int = TOP_K) -> tuple[tuple, tuple]:
    """EAGLE-2's rule computed without the draft's cache: each node's children from the logits
    of the context followed by the node's own path."""
    tree = DraftTree()
    tree.add_children(-1, logits_fn(context), top_k)
    for level in range(1, depth):
        for node in tree.to_expand(level, top_k):
            tree.add_children(node, logits_fn([*context, *tree.path(node)]), top_k)
    nodes = tree.proposal_order(depth, branches)
    index = {node: i for i, node in enumerate(nodes)}
    return (tuple(tree.drafts[n] for n in nodes),
            tuple(-1 if tree.parents[n] < 0 else index[tree.parents[n]] for n in nodes))


@pytest.mark.parametrize("depth, branches", [(1, 2), (3, 2), (5, 4), (8, 6), (4, 20), (6, 40)])
def test_a_greedy_draft_that_reads_trees_grows_eagle_2_s_tree_by_its_own_path_probabilities(depth, branches):
    """Up to 15 second guesses from 4 nodes expanded a level by 4 children each (EAGLE-2's);
    from 16 on, twice as wide (8 by 8), else the budget goes to the unlikeliest of 16 candidates."""
    context = [3, 1, 4, 1, 5]
    drafter = bound(DraftModelDrafter(FakeBackend(hashed, 12), branches=branches))
    assert drafter.top_k == (TOP_K if branches < WIDE_TREE_BRANCHES else 2 * TOP_K)
    drafter.prefill(context)
    proposal = drafter.propose(context, depth, SamplingSettings(), np.random.default_rng(0))
    assert (proposal.tokens, proposal.parents) == reference_tree(hashed, context, depth, branches, drafter.top_k)
    assert len(proposal.main_chain.tokens) == depth and proposal.p_draft == (None,) * len(proposal.tokens)


def test_a_second_guess_carries_the_draft_s_guesses_after_it():
    """Torn between 2 and 3 at depth 2, sure after either: the likeliest other nodes are the 3
    and the sure guess after it, not a second leaf (what second guesses beside a chain give)."""
    drafter = bound(DraftModelDrafter(FakeBackend(confident_then_torn, VOCAB), branches=2))
    proposal = drafter.propose([0, 0], 4, SamplingSettings(), np.random.default_rng(0))
    assert proposal.tokens == (1, 2, 1, 2, 3, 1)
    assert proposal.parents == (-1, 0, 1, 2, 0, 4)


def test_the_draft_s_cache_keeps_the_context_and_the_main_chain_as_a_chain_s_drafting_does():
    """So that after a full accept the next call reads only the last draft and the bonus token."""
    from fake_models import CostedFake, SimClock

    context = [3, 1, 4, 1, 5]
    clock = SimClock()
    backend = CostedFake(hashed, clock, 1.0, 0.0, vocab_size=12)  # a tree pass as dear as one token: trees
    drafter = bound(DraftModelDrafter(backend, branches=3), clock)
    drafter.prefill(context)
    proposal = drafter.propose(context, 4, SamplingSettings(), np.random.default_rng(0))
    chain = list(proposal.main_chain.tokens)
    assert sequence_for(backend).tokens == [*context, *chain[:-1]]
    following = [*context, *chain, 7]
    again = drafter.propose(following, 4, SamplingSettings(), np.random.default_rng(0))
    assert drafter.catch_up_seconds == 0.0  # two tokens: read in the first drafting pass
    assert (again.tokens, again.parents) == reference_tree(hashed, following, 4, 3)


def test_a_draft_that_cannot_read_trees_keeps_second_guesses_as_leaves():
    drafter = DraftModelDrafter(chains_only(hashed, 12), branches=3)
    proposal = drafter.propose([3, 1, 4], 4, SamplingSettings(), np.random.default_rng(0))
    assert not drafter.grows_trees
    assert all(parent < 4 for parent in proposal.parents)  # every second guess hangs off the chain


@pytest.mark.parametrize("per_token, grows", [(0.0005, True), (0.45, False)])
def test_the_draft_grows_trees_only_while_a_tree_pass_costs_about_a_one_token_pass(per_token, grows):
    """A level of the tree is one tree pass of the draft, a position of a chain one token: where
    a pass's every node costs most of a pass (a CPU), once both kinds of pass are timed (the
    first of each left out: it builds the shape's graph) second guesses turn to leaves beside
    the chain (the chain's own rows, no extra pass); where a node costs next to nothing (a
    memory-bound GPU), it keeps growing trees."""
    from fake_models import CostedFake, SimClock

    clock = SimClock()
    drafter = bound(DraftModelDrafter(CostedFake(hashed, clock, 1.0, per_token, vocab_size=12), branches=3), clock)
    context = [3, 1, 4, 1, 5]
    drafter.prefill(context)
    shapes = []
    for call in range(6):
        proposal = drafter.propose(context, 5, SamplingSettings(), np.random.default_rng(0))
        grown = (proposal.tokens, proposal.parents) == reference_tree(hashed, context, 5, 3)
        leaves = all(parent < 5 for parent in proposal.parents)
        shapes.append("tree" if grown else "leaves" if leaves else "?")
        context = [*context, *proposal.main_chain.tokens, 7]
    untimed = PassTiming.MIN_PASSES + 1  # calls before a one-token pass is timed enough
    assert shapes == ["tree"] * 6 if grows else ["tree"] * untimed + ["leaves"] * (6 - untimed)
    assert drafter.grows_trees is grows


def test_a_draft_beside_a_target_that_verifies_chains_grows_no_tree():
    """A tree the target cannot verify would be cut to its chain: the draft drafts a chain."""
    drafter = DraftModelDrafter(FakeBackend(hashed, 12), branches=3)
    target = type("Target", (), {"backend": chains_only(hashed, 12)})()
    drafter.bind(target, lambda: 0.0)
    assert not drafter.grows_trees


def test_near_the_end_of_the_context_the_draft_grows_no_tree_it_could_not_hold():
    """The widest tree pass feeds up to TOP_K + 1 nodes a level: where they would not fit in
    the draft's context, second guesses are leaves beside the chain (no ContextFullError)."""
    backend = FakeBackend(hashed, 12, n_ctx=24)
    drafter = bound(DraftModelDrafter(backend, branches=3))
    context = list(range(1, 12)) + [3, 1, 4, 1, 5]  # 16 tokens: 8 left, a 4-deep tree needs 15
    drafter.prefill(context)
    proposal = drafter.propose(context, 4, SamplingSettings(), np.random.default_rng(0))
    assert len(proposal.main_chain.tokens) == 4 and all(parent < 4 for parent in proposal.parents)
