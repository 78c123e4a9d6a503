"""One ceiling on the draft model's length for slots decoding together (control/batch.py): the
batch priced as a whole, every slot drafting alike in the same rounds, so that a batch where one
slot's long drafts made everyone's look free (each slot pricing its own step against the others'
drafts) goes plain where plain batching is faster."""

from __future__ import annotations

import pytest

from specrun.backends.fake import FakeBackend
from specrun.control.batch import BatchDrafts, expected_tokens
from specrun.control.costs import TargetCosts
from specrun.drafters.methods import DrafterOptions, build_drafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from tests.fake_models import COPYING_VOCAB, REPEATING_PROMPT, copying_logits, noisy_copy
from tests.slots.test_sharing_policy import CostClock, CostedFake


def batch_costs(fixed: float, per_token: float, totals=range(1, 40)) -> TargetCosts:
    """Passes of a batch of n tokens (every sequence's) costing ``fixed + per_token * n``."""
    costs = TargetCosts()
    for n in totals:
        for _ in range(4):
            costs.observe(n, fixed + per_token * n)
    return costs


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_expected_tokens_multiply_the_acceptances_along_the_draft():
    assert expected_tokens([1.0, 0.5, 0.5, 1.0], 3) == [1.0, 1.5, 1.75, 2.0]


def test_a_worked_batch_drafts_the_length_that_yields_most_tokens_a_second():
    """2 slots, passes 10 + n for n tokens of the batch, a draft round 1 a token, each draft
    right half the time at every position: k = 0: 2 / 12 = 0.167; k = 1: 2 * 1.5 / (1 + 14) = 0.2;
    k = 2: 2 * 1.75 / (2 + 16) = 0.194; k = 3: 2 * 1.875 / (3 + 18) = 0.179: 1."""
    batch = BatchDrafts(Clock())
    batch.post(1, expected_tokens([1.0] + [0.5] * 8, 8))
    draft_seconds = [0.0] + [float(k) for k in range(1, 9)]
    assert batch.ceiling(2, 8, batch_costs(10.0, 1.0), draft_seconds) == 1


def test_a_compute_bound_batch_of_four_goes_plain_where_two_draft():
    """The bench-scale pair's costs at 4 slots on a 2-core CPU (docs/perf.md 3(r)): a pass 23 +
    15.7 n ms, a draft round over the slots 35 ms, drafts right 90% of the time. Four slots plain:
    4 / 85.8 ms = 46.6 tokens/s; drafting 1: 4 * 1.9 / (35 + 148.6) ms = 41.4; longer lose more:
    0. On a memory-bound machine (a pass 40 + 0.5 n ms, a round 8 ms) the same batch drafts."""
    batch = BatchDrafts(Clock())
    batch.post(1, expected_tokens([1.0] + [0.9] * 8, 8))
    rounds = [0.0] + [0.035 * k for k in range(1, 9)]
    assert batch.ceiling(4, 8, batch_costs(0.023, 0.0157), rounds) == 0
    assert batch.ceiling(4, 8, batch_costs(0.040, 0.0005), [0.0] + [0.008 * k for k in range(1, 9)]) >= 4


def test_no_ceiling_alone_before_a_curve_or_before_the_costs_are_timed():
    batch = BatchDrafts(Clock())
    rounds = [0.0] + [1.0] * 8
    costs = batch_costs(10.0, 1.0)
    assert batch.ceiling(2, 8, costs, rounds) is None  # no slot has posted
    batch.post(1, expected_tokens([1.0] + [0.5] * 8, 8))
    assert batch.ceiling(1, 8, costs, rounds) is None  # alone: the slot's own rule
    assert batch.ceiling(2, 8, TargetCosts(), rounds) is None  # no pass timed
    assert batch.ceiling(2, 8, costs, [0.0, 1.0, None, None]) is None  # a length not yet drafted
    assert batch.ceiling(2, 8, costs, [0.0] + [1.0] * 8) is not None


def test_the_batch_reads_the_mean_of_its_fresh_curves():
    """A slot right every time and one never right: their mean, 1 + k / 2 (at most... k = 8 here),
    on passes costing nothing but their fixed part and free drafts, drafts the longest; the sure
    slot's curve alone as well; once it goes stale (not posted for FRESH_SECONDS) only the
    never-right curve counts: 0. A dropped curve counts no more."""
    clock = Clock()
    batch = BatchDrafts(clock)
    costs, free = batch_costs(1.0, 0.0), [0.0] * 9
    batch.post(1, expected_tokens([1.0] * 9, 8))
    batch.post(2, expected_tokens([1.0] + [0.0] * 8, 8))
    assert batch.mean_curve(2) == [1.0, 1.5, 2.0]
    assert batch.ceiling(2, 8, costs, free) == 8
    clock.now = BatchDrafts.FRESH_SECONDS / 2
    batch.post(2, expected_tokens([1.0] + [0.0] * 8, 8))
    clock.now = BatchDrafts.FRESH_SECONDS + 1.0
    assert batch.mean_curve(2) == [1.0, 1.0, 1.0]
    assert batch.ceiling(2, 8, costs, [0.0] + [0.1] * 8) == 0
    batch.drop(2)
    assert batch.mean_curve(2) is None


def test_the_batch_costs_are_read_by_every_sequence_s_tokens():
    costs = batch_costs(10.0, 1.0)
    costs.share(7)  # read by this slot's tokens, 7 of the others' beside them
    assert costs(1) == pytest.approx(18.0)
    assert costs.batch_table(12)[4] == pytest.approx(14.0) and len(costs.batch_table(12)) == 13


class SlotFake(CostedFake):
    """A slot's target: ``others`` other sequences in each pass, each feeding ``per_other`` tokens."""

    def __init__(self, table, clock, fixed, per_token, others: int, per_other: int) -> None:
        super().__init__(table, clock, fixed, per_token)
        self.others_in_pass = others
        self.others_tokens_in_pass = others * per_other
        self.per_other = per_other

    def forward(self, tokens, logit_rows):
        self.clock.now += self.fixed + self.per_token * (len(tokens) + self.others_tokens_in_pass)
        return FakeBackend.forward(self, tokens, logit_rows)


def drafted_by_text(batch: BatchDrafts | None) -> tuple[list[int], list[int], list[list[int]]]:
    """A slot among 4 whose others draft 8 a step (9 tokens each in every pass), on a CPU where a
    pass costs 1 + 1 a token of the batch and the draft model 2 a token: alone, pricing its step
    against the others' 27 tokens, drafting 8 always right yields (4 + 8) / (37 + 16) = 0.23
    tokens a unit against plain's 4 / 29 = 0.14, so it drafts; the batch drafting alike yields at
    most 4 (1 + k) / (5 + 6 k) against plain batching's 4 / 5: it goes plain. Drafted tokens by
    text, tokens the draft model read by text, and every output."""
    clock = CostClock()
    target = SlotFake(copying_logits(salt=4), clock, fixed=1.0, per_token=1.0, others=3, per_other=9)
    draft = CostedFake(noisy_copy(4), clock, fixed=2.0, per_token=0.0)
    engine = SpeculativeEngine(target, build_drafter("draft", draft, DrafterOptions()), method="draft", clock=clock)
    engine.policy.batch = batch
    params = GenerationParams(40, draft_len=8, stop_at_eos=False, adaptive=True)
    prompts = [REPEATING_PROMPT, REPEATING_PROMPT[::-1] + [20, 21, 22], [7, 8, 9, 7, 8] * 3, REPEATING_PROMPT[3:]]
    drafted, read, outputs = [], [], []
    for prompt in prompts:
        engine.policy.forget_acceptance()  # a server's next request (ChatSession.new_text)
        before = draft.forwarded_tokens
        result = engine.run(prompt, params)
        drafted.append(result.stats.drafted)
        read.append(draft.forwarded_tokens - before)
        outputs.append(result.token_ids)
    engine.drafter.close()
    return drafted, read, outputs


def test_a_slot_whose_batch_gains_nothing_by_drafting_stops_drafting_where_alone_it_would_not():
    """…and its draft model reads no prompt (AdaptivePolicy.reads_prompt): a prompt read is a
    draft pass the other slots' passes wait for."""
    plain = SpeculativeEngine(FakeBackend(copying_logits(salt=4), COPYING_VOCAB))
    alone_drafted, alone_read, alone_outputs = drafted_by_text(None)
    batch_drafted, batch_read, batch_outputs = drafted_by_text(BatchDrafts(CostClock()))
    assert all(count > 20 for count in alone_drafted[1:])  # the slot's own rule keeps drafting
    assert all(count > 20 for count in alone_read[1:])
    assert batch_drafted[0] > 0  # the first text times the draft model's costs…
    assert batch_drafted[1:] == [0, 0, 0] and batch_read[1:] == [0, 0, 0]  # …then the batch's ceiling keeps it plain
    prompts = [REPEATING_PROMPT, REPEATING_PROMPT[::-1] + [20, 21, 22], [7, 8, 9, 7, 8] * 3, REPEATING_PROMPT[3:]]
    expected = [plain.run(prompt, GenerationParams(40, draft_len=0, stop_at_eos=False)).token_ids
                for prompt in prompts]
    assert alone_outputs == expected and batch_outputs == expected
