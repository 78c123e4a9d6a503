"""Speculation yields to the batch: a controller whose passes carry other sequences weighs a
draft's tokens against the whole batch's (TargetCosts.sharing), and drafts less as the batch fills
on a machine where each token fed costs more time (a compute-bound pass)."""

from __future__ import annotations

import pytest

from specrun.backends.fake import FakeBackend
from specrun.drafters.methods import DrafterOptions, build_drafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from tests.fake_models import COPYING_VOCAB, REPEATING_PROMPT, copying_logits, noisy_copy
from specrun.control.costs import DraftCosts, TargetCosts
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
    with 3 others (3 + that) / (1 + 0.15 (k + 3)), best at k = 2 (7.5% over plain); with 7 others
    best at k = 1 by 1.4%, within the margin a shared pass asks (costs.SHARED_MARGIN): 0; with 15
    others at k = 0."""
    chosen = [controller_on(0.15, others).choose(8) for others in (0, 1, 3, 7, 15)]
    assert chosen == [3, 3, 2, 0, 0]
    # a trace says what was chosen: the length within the margin is no best length
    assert [controller_on(0.15, others).describe()["best_length"] for others in (0, 1, 3, 7, 15)] == chosen


def test_no_probe_in_a_shared_pass_where_even_a_draft_always_right_is_within_the_margin():
    """A cheap drafter switched off in a shared pass probes only where a draft always right could
    beat plain decoding by the margin its choice must clear (costs.SHARED_MARGIN): with 15 others on
    passes costing 0.3 a token more, the longest draft always right (k = 8, the best) brings 24 / 7.9
    tokens a unit against plain's 16 / 5.5, 4.4% more."""
    controller = controller_on(0.3, 15)
    assert controller.choose(8) == 0 and not controller.could_pay()
    controller.sunk_draft_cost = False  # a paid drafter's probe asks any gain: its estimates learn from drafting
    assert controller.could_pay()


def test_alone_a_cheap_draft_is_taken_on_a_gain_within_the_shared_margin():
    """The margin is a shared pass's (the test above: 1.4% with 7 others, held plain). Alone a probe
    is cheap and the gate catches a loss, so a small gain is taken: passes 1 + 0.66 (n - 1), a draft
    right 70% of the time: k = 1 brings 1.7 / 1.66, 2.4% over plain; k = 2 2.19 / 2.32, less."""
    costs = TargetCosts()
    for n in range(1, 10):
        for _ in range(8):
            costs.observe(n, 1.0 + 0.66 * (n - 1))
    controller = DraftLengthController(max_draft_len=8, target_costs=costs, prior_accept=0.7, prior_weight=1e6,
                                       sunk_draft_cost=True)
    assert controller.choose(8) == 1


def test_a_pass_whose_cost_does_not_grow_with_its_tokens_drafts_as_long_shared_as_alone():
    """Memory-bound (a big model on a GPU): drafts cost the batch nothing, so they stay."""
    assert controller_on(0.0, 7).choose(8) == controller_on(0.0, 0).choose(8) > 0


def test_the_rates_follow_a_change_in_sharing():
    controller = controller_on(0.15, 0)
    before = controller.choose(8)
    controller.target_costs.sharing = 7
    assert controller.choose(8) < before  # the memoised rates were not reused


def paid_controller_off(costs_per_token: float, sharing: int, draft_per_token: float) -> DraftLengthController:
    """A draft model's controller switched off (probed every 4 steps), on passes costing one unit plus
    ``costs_per_token`` per token fed and drafts costing ``draft_per_token`` a token."""
    costs = TargetCosts()
    for n in range(1, 10):
        for _ in range(8):
            costs.observe(n, 1.0 + costs_per_token * (n - 1 + sharing))
    draft_costs = DraftCosts()
    for k in range(1, 9):
        draft_costs.observe(k, draft_per_token * k)
    controller = DraftLengthController(max_draft_len=8, target_costs=costs, draft_costs=draft_costs,
                                       prior_accept=0.7, prior_weight=1e6)
    costs.sharing = sharing
    controller.start_off(4)
    return controller


def lengths_over(controller: DraftLengthController, steps: int) -> list[int]:
    return [controller.choose(8) for _ in range(steps)]


def test_a_draft_that_could_not_pay_were_it_always_right_is_not_probed_in_a_full_batch():
    """Worked out: 7 others, passes 1 + (n - 1 + 7) (a token fed costs what the pass costs: the
    machine is full), drafts 0.5 a token: every token accepted, k drafts bring (8 + k) / (8 + 1.5 k)
    against plain decoding's 8 / 8, never more. The probes (every 4 steps) are skipped."""
    shared = paid_controller_off(1.0, 7, 0.5)
    assert not shared.could_pay()
    assert lengths_over(shared, 16) == [0] * 16


def test_at_the_longest_gap_a_draft_that_could_not_pay_is_probed_all_the_same():
    """The costs it is judged by are what probes time: each skipped probe doubles the gap (4, 8, ...
    128 steps), and at 128 a probe goes ahead, re-timing costs a changed batch may have left stale."""
    lengths = lengths_over(paid_controller_off(1.0, 7, 0.5), 260)
    assert lengths.count(2) == 1 and lengths.index(2) == 4 + 8 + 16 + 32 + 64 + 128 - 1


def test_alone_or_where_a_right_draft_would_pay_the_probes_go_on():
    alone = paid_controller_off(1.0, 0, 0.5)  # alone: probed whatever the costs (they drift with the context)
    assert alone.could_pay()
    assert lengths_over(alone, 8) == [0, 0, 0, 2, 0, 0, 0, 2]
    cheap = paid_controller_off(0.05, 7, 0.1)  # a memory-bound pass: 8 right drafts would pay
    assert cheap.could_pay()
    assert lengths_over(cheap, 4) == [0, 0, 0, 2]


def test_the_probes_come_back_when_the_batch_empties():
    controller = paid_controller_off(1.0, 7, 0.5)
    assert lengths_over(controller, 8) == [0] * 8
    controller.target_costs.sharing = 0
    assert 2 in lengths_over(controller, 4)


class CostClock:
    """Seconds that pass only in the fakes' passes (``CostedFake``), in milliseconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now * 1e-3


class CostedFake(FakeBackend):
    """A fake whose pass of n tokens takes ``fixed + per_token * (n + others_in_pass)`` ms of ``clock``:
    the target a model whose weights cost 4 a pass and each token fed, its own or another
    sequence's, 1 (a CPU); ``others_in_pass`` other sequences in each pass (as a slot's)."""

    def __init__(self, table, clock: CostClock, fixed: float, per_token: float) -> None:
        super().__init__(table, COPYING_VOCAB)
        self.clock, self.fixed, self.per_token = clock, fixed, per_token
        self.others_in_pass = 0

    def forward(self, tokens, logit_rows):
        self.clock.now += self.fixed + self.per_token * (len(tokens) + self.others_in_pass)
        return super().forward(tokens, logit_rows)


def test_a_draft_model_kept_off_by_a_full_batch_reads_no_text_and_the_output_stays_plain():
    """Engine level, as a server's slot runs it (each request a text of its own). With 7 others
    in every pass a draft of k tokens, even always right, brings (8 + k) / (12 + 2 k) against
    plain decoding's 8 / 12: after the first text has timed the costs, the draft model reads no
    prompt (AdaptivePolicy.reads_prompt), drafts nothing and leaves the answer unread at the end
    (DraftModelDrafter.finish). Alone again it drafts, catching up on the text it skipped. Every
    output is plain decoding's."""
    table = copying_logits(salt=4)
    clock = CostClock()
    target = CostedFake(table, clock, fixed=4.0, per_token=1.0)
    target.others_in_pass = 7
    draft = CostedFake(noisy_copy(4), clock, fixed=1.0, per_token=0.0)
    engine = SpeculativeEngine(target, build_drafter("draft", draft, DrafterOptions()), method="draft", clock=clock)
    plain = SpeculativeEngine(FakeBackend(table, COPYING_VOCAB))
    params = GenerationParams(60, draft_len=16, stop_at_eos=False, adaptive=True)
    prompts = [REPEATING_PROMPT, REPEATING_PROMPT[::-1] + [20, 21, 22], [7, 8, 9, 7, 8] * 3, REPEATING_PROMPT[3:]]
    fed_by_text, drafted_by_text = [], []
    for index, prompt in enumerate(prompts):
        if index == 3:
            target.others_in_pass = 0  # the batch empties
        before = draft.forwarded_tokens
        engine.policy.forget_acceptance()  # a server's next request: a text of its own (ChatSession.new_text)
        result = engine.run(prompt, params)
        assert result.token_ids == plain.run(prompt, GenerationParams(60, draft_len=0, stop_at_eos=False)).token_ids
        fed_by_text.append(draft.forwarded_tokens - before)
        drafted_by_text.append(result.stats.drafted)
    assert fed_by_text[0] > 0 and drafted_by_text[0] > 0  # the first text times the costs
    assert fed_by_text[1:3] == [0, 0] and drafted_by_text[1:3] == [0, 0]
    assert drafted_by_text[3] > 0 and fed_by_text[3] >= len(prompts[3])  # the prompt read on the way
    engine.drafter.close()


def test_an_answer_the_draft_did_not_draft_is_read_at_its_end_alone_and_left_unread_in_a_shared_pass():
    """DraftModelDrafter.finish: alone (a chat), the draft reads the answer between turns, so the next
    turn's prompt costs it only what follows; beside other slots' sequences it leaves it unread."""
    from specrun.backends.kv import sequence_for

    context = REPEATING_PROMPT + [5, 6, 7, 8, 9]
    for others, fed in ((0, len(context)), (7, 0)):
        target = CostedFake(copying_logits(salt=4), CostClock(), fixed=1.0, per_token=0.0)
        target.others_in_pass = others
        draft = FakeBackend(noisy_copy(4), COPYING_VOCAB)
        drafter = build_drafter("draft", draft, DrafterOptions())
        drafter.bind(sequence_for(target), CostClock())
        drafter.finish(context)
        assert draft.forwarded_tokens == fed


def test_a_shared_pass_is_timed_and_read_by_the_batch_s_tokens():
    """TargetCosts.others_tokens: a pass this sequence fed n tokens of, beside the others' m, is
    timed as a pass of n + m; read with m' others, T(n) is the batch of n + m'."""
    costs = TargetCosts()
    costs.share(3)
    for _ in range(4):
        costs.observe(2, 5.0)  # 2 of its own, 3 of the others': a 5-token pass
        costs.observe(1, 4.0)
    assert costs.known(2) and set(costs.seconds) == {4, 5}
    assert costs.table(2)[1:] == [4.0, 5.0] and costs.plain == 4.0
    costs.share(2)
    assert costs(3) == 5.0 and costs(2) == 4.0 and not costs.known(1)
    costs.share(0)
    assert costs.known(4) and costs(5) == 5.0


def test_costs_timed_while_the_other_slot_drafted_do_not_keep_a_right_draft_off_once_both_are_plain():
    """Two slots on a CPU where a pass costs 1 + 0.5 a token of the batch. While the other slot drafted
    8 a pass, this one timed its own lengths 1..9 in batches of 10..18 tokens; then both went plain
    (batches of 2). Every draft right, 4 drafts bring (2 + 4) / T(6) = 1.5 tokens a unit against
    plain decoding's 2 / T(2) = 1: the draft could pay. Read by its own tokens (the others' left in
    the cost), T(5) said 8 against T(1)'s 2, no draft could pay and the probes were skipped: two
    clients on the bench-scale pair drafted 0.6 tokens a step in one round, 6 to 7 in another."""
    costs = TargetCosts()
    costs.sharing = 1
    costs.share(9)  # the other slot: a token and 8 drafts
    for n in range(1, 10):
        for _ in range(8):
            costs.observe(n, 1.0 + 0.5 * (n + 9))
    costs.share(1)  # both plain
    for _ in range(30):
        costs.observe(1, 1.0 + 0.5 * 2)
    draft_costs = DraftCosts()
    for k in range(1, 9):
        draft_costs.observe(k, 0.01 * k)
    controller = DraftLengthController(max_draft_len=8, target_costs=costs, draft_costs=draft_costs,
                                       prior_accept=0.7, prior_weight=1e6)
    controller.start_off(4)
    assert costs(5) == pytest.approx(1.0 + 0.5 * 6) and costs.plain == 2.0
    assert controller.could_pay()
    assert 2 in lengths_over(controller, 4)  # probed again
