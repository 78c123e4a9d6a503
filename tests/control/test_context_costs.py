"""Pass costs that follow the context (control/costs.py ContextSlope, TargetCosts.at_context):
a slope fitted across the contexts passes were timed at carries each mean to the context of the
pass to come; one answer's few hundred tokens fit none; a run keeps it for the next."""

from __future__ import annotations

import pytest

from specrun.control.costs import ContextSlope, DraftCosts, TargetCosts

BASE, PER_TOKEN = 0.020, 1e-5  # a pass: 20 ms and 10 us a token of context (80 ms more at 8k)


def timed(costs: TargetCosts, contexts, lengths=(1, 5), per_token: float = PER_TOKEN) -> None:
    for context in contexts:
        costs.at_context(context)
        for n in lengths:
            costs.observe(n, BASE * (1 + 0.1 * (n - 1)) + per_token * context)


def plain_report(context_len: int):
    """A plain step's report: one token out, its pass 0.2 s."""
    from specrun.control.policy import PLAIN, StepReport
    from specrun.drafters.base import EMPTY_PROPOSAL

    return StepReport(PLAIN, EMPTY_PROPOSAL, (), 0.0, 0.0, 0.2, list(range(context_len + 1)), context_len)


def test_a_slope_across_prompts_prices_a_longer_context():
    costs = TargetCosts()
    timed(costs, [200 + i for i in range(40)] + [2000 + i for i in range(40)])
    assert costs.slope.per_token == pytest.approx(PER_TOKEN, rel=0.05)
    costs.at_context(8000)
    assert costs(1) == pytest.approx(BASE + PER_TOKEN * 8000, rel=0.05)
    assert costs.plain == pytest.approx(BASE + PER_TOKEN * 8000, rel=0.05)
    assert costs(5) == pytest.approx(1.4 * BASE + PER_TOKEN * 8000, rel=0.05)
    costs.at_context(500)
    assert costs(1) == pytest.approx(BASE + PER_TOKEN * 500, rel=0.05)


def test_one_answer_fits_no_slope_and_the_means_stand_as_before():
    """A 128-token answer spreads its contexts too little to tell a slope from timing noise: the
    costs are the decayed means they always were."""
    with_context, without = TargetCosts(), TargetCosts()
    timed(with_context, range(1000, 1128))
    for context in range(1000, 1128):
        for n in (1, 5):
            without.observe(n, BASE * (1 + 0.1 * (n - 1)) + PER_TOKEN * context)
    assert with_context.slope.per_token == 0.0
    assert with_context.table(8) == without.table(8)


def test_a_cost_that_does_not_grow_fits_no_slope():
    """A windowed draft (or prompt lookup) costs the same at 8k as at 1k: slope 0, never negative."""
    costs = DraftCosts()
    timed(costs, [300 + i for i in range(30)] + [6000 + i for i in range(30)], lengths=(2, 4), per_token=0.0)
    assert costs.slope.per_token == pytest.approx(0.0, abs=1e-9)
    shrinking = ContextSlope()
    for context in (100, 5000) * 40:
        shrinking.observe(1, context, 0.03 - 1e-6 * context)
    assert shrinking.per_token == 0.0


def test_the_table_follows_the_context_once_it_moved_more_than_noise():
    costs = TargetCosts()
    timed(costs, [200 + i for i in range(40)] + [2000 + i for i in range(40)])
    costs.at_context(2040)
    costs(1)  # the table, as the controllers build it each step
    version = costs.version
    costs.at_context(2041)  # 10 us on a ~40 ms pass: the table stands
    assert costs.version == version
    costs.at_context(4000)  # 20 ms more: the rates are redone
    assert costs.version > version


def test_a_slow_pass_at_a_long_context_is_no_spike():
    """The spike cap compares a pass with its mean carried to the pass's context: passes at 8k
    after a slope is known move the mean as fully as any."""
    costs = TargetCosts()
    timed(costs, [200 + i for i in range(40)] + [2000 + i for i in range(40)])
    costs.at_context(8000)
    for _ in range(3):
        costs.observe(1, BASE + PER_TOKEN * 8000)
    assert costs(1) == pytest.approx(BASE + PER_TOKEN * 8000, rel=0.03)


def test_a_snapshot_preloads_the_next_process_at_its_context():
    costs = TargetCosts()
    timed(costs, [200 + i for i in range(40)] + [2000 + i for i in range(40)])
    seconds, context, per_token = costs.snapshot()
    assert context == 2039 and per_token == pytest.approx(PER_TOKEN, rel=0.05)
    later = TargetCosts()
    later.preload(seconds)
    later.timed_at(context, per_token)
    later.at_context(8000)
    assert later(1) == pytest.approx(BASE + PER_TOKEN * 8000, rel=0.05)
    later.at_context(100)
    assert later(1) == pytest.approx(BASE + PER_TOKEN * 100, rel=0.05)


def test_a_text_far_from_where_plain_decoding_was_timed_times_it_again_first():
    """With no slope to carry it, a plain pass timed at 1k tokens does not price one at 4k: the
    text starts with two plain steps (the first after the prompt's pass is not timed); near the
    context it was timed at, or with a slope, it speculates at once."""
    from specrun.control.policy import PLAIN, AdaptivePolicy

    policy = AdaptivePolicy()
    policy.target_costs.at_context(1000)
    for _ in range(4):
        policy.target_costs.observe(1, 0.09)
    assert policy.target_costs.plain_stale_at(1200) is False
    assert policy.target_costs.plain_stale_at(4000) is True
    policy.start_text(4000)
    plans = []
    for step in range(2):
        plans.append(policy.plan())
        policy.observe(plain_report(4000 + step))
    assert plans == [PLAIN, PLAIN]
    assert policy._plain_timing == 0  # then the drafters as ever
    policy.start_text(1100)
    assert policy._plain_timing == 0
    timed(policy.target_costs, [200 + i for i in range(40)] + [2000 + i for i in range(40)])
    policy.start_text(8000)
    assert policy._plain_timing == 0  # the slope carries it
    assert AdaptivePolicy().target_costs.plain_stale_at(4000) is False  # nothing timed: explore as before
