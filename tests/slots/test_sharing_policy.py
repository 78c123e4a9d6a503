"""Speculation yields to the batch: a controller whose passes carry other sequences weighs a
draft's tokens against the whole batch's (TargetCosts.sharing), and drafts less as the batch fills
on a machine where each token fed costs more time (a compute-bound pass)."""

from __future__ import annotations

from specrun.control.costs import TargetCosts
from specrun.control.draft_length import DraftLengthController


def controller_on(costs_per_token: float, sharing: int) -> DraftLengthController:
    """A draft right 70% of the time at each position (a prior held fixed), free to make, on passes costing one unit plus
    ``costs_per_token`` per token fed, the batch's other sequences' tokens included."""
    costs = TargetCosts()
    for n in range(1, 10):
        for _ in range(8):
            costs.observe(n, 1.0 + costs_per_token * (n - 1 + sharing))
    controller = DraftLengthController(max_draft_len=8, target_costs=costs, prior_accept=0.7, prior_weight=1e6,
                                       sunk_draft_cost=True)
    costs.sharing = sharing
    return controller


def test_alone_a_cheap_pass_drafts_and_a_shared_one_drafts_less_then_none():
    """Worked out: alone, tokens per pass cost (1 - 0.7^(k+1)) / 0.3 / (1 + 0.15 k), best at k = 3;
    with 7 others (7 + that) / (1 + 0.15 (k + 7)), best at k = 1; with 15 others at k = 0."""
    chosen = [controller_on(0.15, others).choose(8) for others in (0, 1, 7, 15)]
    assert chosen == [3, 3, 1, 0]


def test_a_pass_whose_cost_does_not_grow_with_its_tokens_drafts_as_long_shared_as_alone():
    """Memory-bound (a big model on a GPU): drafts cost the batch nothing, so they stay."""
    assert controller_on(0.0, 7).choose(8) == controller_on(0.0, 0).choose(8) > 0


def test_the_rates_follow_a_change_in_sharing():
    controller = controller_on(0.15, 0)
    before = controller.choose(8)
    controller.target_costs.sharing = 7
    assert controller.choose(8) < before  # the memoised rates were not reused
