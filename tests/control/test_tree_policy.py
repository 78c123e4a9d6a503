"""The policy's token trees (control/trees.py): second guesses scored against the output, each
node valued by its chance of acceptance, and kept only where it raises tokens per second of
the pass: trees where one more token in a pass is cheap (a GPU), chains where it costs most
of a plain step (this CPU)."""

from __future__ import annotations

import pytest

import specrun.engine.passes
from fake_models import VOCAB, CostedFake, SimClock, agreeing_draft, hashed_logits
from specrun.control.trees import BranchRates, TreeScores, node_values, shape_tree
from specrun.drafters.base import Drafter, Proposal
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.tree import TokenTree

# a chain of three, a second guess beside its first and its second node
CHAIN_AND_SIBLINGS = Proposal((10, 11, 12, 20, 21), parents=(-1, 0, 1, -1, 0))


def test_a_second_guess_is_scored_where_the_output_leaves_the_first():
    rates, scores = BranchRates(), TreeScores()
    scores.add(rates, 5, CHAIN_AND_SIBLINGS.tree)
    scores.score([0] * 5 + [10])  # the first guess right so far: nothing settled
    assert rates.offered[1] == 0.0
    scores.score([0] * 5 + [10, 21])  # the output took the second guess at position 2
    assert (rates.offered[1], rates.right[1]) == (1.0, 1.0)
    scores.add(rates, 0, CHAIN_AND_SIBLINGS.tree)
    scores.score([30])  # neither guess at position 1
    assert rates.offered[1] == pytest.approx(0.95 + 1.0) and rates.right[1] == pytest.approx(0.95)


def test_a_chain_is_never_scored_for_second_guesses():
    rates, scores = BranchRates(), TreeScores()
    scores.add(rates, 0, TokenTree.chain((1, 2)))
    scores.score([9, 9])
    assert rates.offered == [0.0] * len(rates.offered)


def test_node_values_by_hand():
    rates = BranchRates(prior=0.4)  # no evidence: s_r = 0.4 for every rank
    accept = [1.0, 0.8, 0.5, 0.5]  # a_1, a_2, a_3
    values = node_values(CHAIN_AND_SIBLINGS.tree, accept, rates)
    assert values == pytest.approx([0.8, 0.8 * 0.5, 0.8 * 0.5 * 0.5, 0.2 * 0.4, 0.8 * 0.5 * 0.4])
    two_siblings = TokenTree((1, 2, 3), (-1, -1, -1))
    assert node_values(two_siblings, accept, rates) == pytest.approx([0.8, 0.2 * 0.4, 0.2 * 0.6 * 0.4])


def shaped(costs, max_nodes=24, max_paths=0, chain_len=3):
    values = node_values(CHAIN_AND_SIBLINGS.tree, [1.0, 0.8, 0.5, 0.5], BranchRates(prior=0.4))
    return shape_tree(CHAIN_AND_SIBLINGS, chain_len, values, costs, 0.0, max_nodes, max_paths)


def test_cheap_passes_keep_the_second_guesses_and_dear_ones_a_chain():
    flat = [None, 1.0, *(1.0 + 0.01 * n for n in range(2, 10))]  # a GPU: one more token costs 1%
    linear = [None, 1.0, *(0.3 + 0.9 * n for n in range(2, 10))]  # this CPU: most of a plain step
    assert shaped(flat) == CHAIN_AND_SIBLINGS
    assert shaped(linear) == CHAIN_AND_SIBLINGS.prefix(3)


def test_the_caps_on_nodes_and_paths_hold_and_no_guess_lies_deeper_than_the_chain():
    flat = [None, 1.0, *(1.0 + 0.01 * n for n in range(2, 10))]
    assert shaped(flat, max_nodes=4) == Proposal((10, 11, 12, 21), parents=(-1, 0, 1, 0))  # the likelier guess
    assert shaped(flat, max_paths=2) == Proposal((10, 11, 12, 21), parents=(-1, 0, 1, 0))
    assert shaped(flat, chain_len=1) == Proposal((10, 20), parents=(-1, -1))  # 21 sits at position 2


def test_unknown_pass_costs_verify_the_chain():
    assert shaped([None] * 10) == CHAIN_AND_SIBLINGS.prefix(3)


class SecondGuessDrafter(Drafter):
    """A cheap drafter whose chain is a draft that agrees with the target half the time, with a
    second guess beside each draft token it gets wrong: the target's own choice ``second_right``
    of the time (decided per context, as the draft's agreement is), else another wrong token."""

    name = "guesses"

    def __init__(self, target_table, draft_table, second_right: float) -> None:
        self.target_table, self.draft_table = target_table, draft_table
        self.second_right = agreeing_draft(target_table, second_right)

    def propose(self, context, draft_len, sampling, rng) -> Proposal:
        chain, siblings = [], []
        for depth in range(draft_len):
            seen = (*context, *chain)
            guess, right = int(self.draft_table(seen).argmax()), int(self.target_table(seen).argmax())
            if guess != right:
                second = int(self.second_right(seen).argmax())
                siblings.append((depth, second if second != guess else (guess + 1) % VOCAB))
            chain.append(guess)
        parents = (*range(-1, len(chain) - 1), *(depth - 1 for depth, _ in siblings))
        return Proposal((*chain, *(token for _, token in siblings)), source=self.name, parents=parents)


def run_guesses(monkeypatch, per_token: float, second_right: float, tree_nodes: int = 24):
    """Adaptive runs on a simulated clock; the tree passes' node counts and the tokens a pass."""
    sizes: list[int] = []
    verify = specrun.engine.passes.verify_tree_greedy
    monkeypatch.setattr(specrun.engine.passes, "verify_tree_greedy",
                        lambda tree, argmax: sizes.append(len(tree)) or verify(tree, argmax))
    clock, table = SimClock(), hashed_logits(VOCAB, salt=5)
    target = CostedFake(table, clock, 1.0, per_token)
    drafter = SecondGuessDrafter(table, agreeing_draft(table, 0.5), second_right)
    engine = SpeculativeEngine(target, drafter, method="guesses", clock=clock)
    plain = SpeculativeEngine(CostedFake(table, SimClock(), 1.0, per_token))
    params = GenerationParams(200, draft_len=8, stop_at_eos=False, adaptive=True, tree_nodes=tree_nodes)
    result = engine.run([1, 2, 3], params)
    assert result.token_ids == plain.run([1, 2, 3], GenerationParams(200, draft_len=0, stop_at_eos=False)).token_ids
    return sizes, len(result.token_ids) / result.stats.steps


def test_the_policy_verifies_trees_where_passes_are_flat_and_chains_where_they_are_not(monkeypatch):
    flat_trees, flat_rate = run_guesses(monkeypatch, per_token=0.01, second_right=0.8)
    _, chain_rate = run_guesses(monkeypatch, per_token=0.01, second_right=0.8, tree_nodes=0)
    assert len(flat_trees) > 50  # most steps verify a tree…
    assert flat_rate > 1.2 * chain_rate  # …and each pass yields more than the chain's
    # A second guess right 40% of the time, where a pass's every token costs 0.9 of a plain one:
    # worth 0.5 * 0.4 = 0.2 tokens for 0.9 plain steps, against the chain's ~0.55 a step.
    dear_trees, _ = run_guesses(monkeypatch, per_token=0.9, second_right=0.4)
    assert len(dear_trees) < 5
