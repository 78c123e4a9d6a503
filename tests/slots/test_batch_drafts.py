"""One draft length for the draft model of slots decoding together (control/batch.py): the
batch priced as a whole, every slot drafting alike in the same rounds, by costs the batches
themselves timed (by their sequences as well as their tokens), so that a batch where one slot's
long drafts made everyone's look free (each slot pricing its own step against the others' drafts)
goes plain where plain batching is faster, and drafts in step where drafting is."""

from __future__ import annotations

import math

import pytest

from specrun.backends.fake import FakeBackend
from specrun.control.batch import BatchDrafts
from specrun.control.costs import TargetCosts
from specrun.control.draft_length import expected_tokens
from specrun.drafters.methods import DrafterOptions, build_drafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from tests.fake_models import COPYING_VOCAB, REPEATING_PROMPT, copying_logits, noisy_copy
from tests.slots.test_sharing_policy import CostClock, CostedFake


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


HALF_RIGHT = expected_tokens([1.0] + [0.5] * 8, 8)  # each draft right half the time, at every position
MOSTLY_RIGHT = expected_tokens([1.0] + [0.9] * 8, 8)


def timed_batch(fixed: float, per_token: float, round_fixed: float, round_per_sequence: float,
                clock: Clock | None = None, sequences=(1, 2, 3, 4)) -> BatchDrafts:
    """A batch as the rendezvous times it: verify passes over m sequences of t tokens each cost
    ``fixed + per_token * m t``; draft rounds over m sequences ``round_fixed + round_per_sequence
    * m``."""
    batch = BatchDrafts(clock or Clock())
    for _ in range(4):
        for m in sequences:
            for t in range(1, 6):
                batch.timed(True, [t] * m, fixed + per_token * m * t)
            batch.timed(False, [1] * m, round_fixed + round_per_sequence * m)
    return batch


def test_expected_tokens_multiply_the_acceptances_along_the_draft():
    assert expected_tokens([1.0, 0.5, 0.5, 1.0], 3) == [1.0, 1.5, 1.75, 2.0]


def test_a_worked_batch_drafts_the_length_that_yields_most_tokens_a_second():
    """2 slots, passes 10 + n for n tokens of the batch, a round over both 2: k = 0: 2 / 12 =
    0.167; k = 1: 2 * 1.5 / (2 + 14) = 0.1875; k = 2: 2 * 1.75 / (4 + 16) = 0.175;
    k = 3: 2 * 1.875 / (6 + 18) = 0.156: 1."""
    batch = timed_batch(10.0, 1.0, 0.0, 1.0)
    batch.post(1, HALF_RIGHT)
    assert batch.length(2, 8) == 1
    assert batch.length(2, 8) == 1 and batch.length(2, 0) is None
    chosen, gains = batch.choices()  # for /metrics: each choice counted, the latest's predicted gain
    assert chosen == [((2, 1), 2)] and gains == [(2, pytest.approx(0.1875 / (2 / 12)))]
    # for a trace: the latest choice for as many slots, none for a count never chosen for
    assert batch.describe(2) == {"sequences": 2, "length": 1, "gain": round(0.1875 / (2 / 12), 4)}
    assert batch.describe(3) is None


def test_a_compute_bound_batch_of_four_goes_plain_where_a_memory_bound_one_drafts():
    """Costs like the bench-scale pair's at 4 slots on a 2-core CPU (docs/perf.md 3(r)): a pass
    23 + 15.7 n ms, a round over 4 sequences 31 ms, drafts right 90% of the time. Four slots plain:
    4 / 85.8 ms = 46.6 tokens/s; drafting 1: 4 * 1.9 / (31 + 148.6) ms = 42.3; longer lose more:
    0. Memory-bound (a pass 40 + 0.5 n ms, a round 8 + 0.1 m ms) the same batch drafts long."""
    compute_bound = timed_batch(0.023, 0.0157, 0.005, 0.0065)
    compute_bound.post(1, MOSTLY_RIGHT)
    assert compute_bound.round_seconds(4) == pytest.approx(0.031)
    assert compute_bound.length(4, 8) == 0
    assert compute_bound.choices() == ([((4, 0), 1)], [(4, 1.0)])
    memory_bound = timed_batch(0.040, 0.0005, 0.008, 0.0001)
    memory_bound.post(1, MOSTLY_RIGHT)
    assert memory_bound.length(4, 8) >= 4


def test_a_count_of_sequences_timed_only_plain_is_priced_by_what_a_token_costs_elsewhere():
    """Eight slots that opened plain have one length timed over them, 8 tokens: 23 + 15.7 * 8 =
    148.6 ms, compute-bound as the 2-core CPU's passes (docs/perf.md 3(r)); a round over 8 costs
    31 ms over 4 scaled as the target's pass (148.6 / 85.8). Priced as memory-bound (10% of the
    pass a sequence's token; rounds 54 ms) drafting 3 read 1.44x plain batching, and the batch drafted;
    at the 15.7 ms a token that passes over 4 sequences (or, before any, the prompts' reads)
    measured, drafting 1 yields 8 * 1.9 / (274 + 53.7) ms = 46 tokens/s against 53.8: plain."""
    batch = timed_batch(0.023, 0.0157, 0.005, 0.0065)  # 1-4 sequences, 1-5 tokens each
    for _ in range(4):
        batch.timed(True, [1] * 8, 0.023 + 0.0157 * 8)
    batch.post(1, MOSTLY_RIGHT)
    assert batch._token_slope(8) == pytest.approx(0.0157)
    assert batch.length(8, 8) == 0
    # nothing else timed: the memory-bound guess, and the same batch drafts long
    guessed = BatchDrafts(Clock())
    for _ in range(4):
        guessed.timed(True, [1] * 8, 0.023 + 0.0157 * 8)
        guessed.timed(False, [1] * 8, 0.054)
    guessed.post(1, MOSTLY_RIGHT)
    assert guessed._token_slope(8) is None
    assert guessed.length(8, 8) == 3
    assert guessed.choices()[1] == [(8, pytest.approx(8 * 3.439 / (0.1486 * 1.3 + 3 * 0.054) / (8 / 0.1486)))]
    assert guessed.verify[8].batch_table(16)[16] == pytest.approx(0.1486 * 1.1)
    # no other count timed: the prompts' reads, each token 15.7 ms, from the first batch of them
    alone = BatchDrafts(Clock())
    alone.timed(True, [100] * 8, 0.0157 * 800)  # the eight prompts, read in one batch
    for _ in range(4):
        alone.timed(True, [1] * 8, 0.023 + 0.0157 * 8)
        alone.timed(False, [1] * 8, 0.054)
    alone.post(1, MOSTLY_RIGHT)
    assert alone._token_slope(8) == pytest.approx(0.0157)
    assert alone.length(8, 8) == 0
    assert alone.verify[8].batch_table(16)[16] == pytest.approx(0.1486 + 8 * 0.0157)


def test_the_token_slope_borrowed_is_the_nearest_count_s_the_more_on_a_tie():
    """Counts 2, 4 and 6 timed at slopes of 1, 2 and 3 ms a token: 5 slots borrow 6's (as near
    as 4's, more sequences), 3 slots 4's (as near as 2's), 8 slots 6's; a count's own timed
    lengths are never borrowed for itself."""
    batch = BatchDrafts(Clock())
    for _ in range(4):
        for m, slope in ((2, 0.001), (4, 0.002), (6, 0.003)):
            for t in (1, 3, 5):
                batch.timed(True, [t] * m, 0.02 + slope * m * t)
        batch.timed(True, [1] * 5, 0.03)
    assert [batch._token_slope(m) for m in (5, 3, 8, 2)] == [
        pytest.approx(0.003), pytest.approx(0.002), pytest.approx(0.003), pytest.approx(0.002)]


def test_a_round_is_priced_by_its_sequences_not_its_tokens():
    """A round over 4 sequences 31 ms, one sequence's 4-token read 19 ms (its tokens batch, the
    sequences' do not: llama.cpp on a CPU); passes 30 + 5 n ms, drafts right 90% of the time.
    Plain: 4 / 50 ms = 80 tokens/s; drafting 1 in rounds of 31 ms, 7.6 / (31 + 70) = 75.2: 0;
    priced as a 4-token read, 7.6 / (19 + 70) = 85.4 would have drafted."""
    batch = BatchDrafts(Clock())
    for _ in range(4):
        for m in (1, 4):
            for t in range(1, 6):
                batch.timed(True, [t] * m, 0.030 + 0.005 * m * t)
        batch.timed(False, [1], 0.010)
        batch.timed(False, [1] * 4, 0.031)
        batch.timed(False, [4], 0.019)
    batch.post(1, MOSTLY_RIGHT)
    assert batch.round_seconds(4) == pytest.approx(0.031)
    assert batch.length(4, 8) == 0


def test_a_length_within_the_margin_of_plain_batching_leaves_the_batch_plain():
    """Passes 10 + n over 2 sequences, rounds 2, every draft right 60% of the time: drafting 1
    yields 2 * 1.6 / 16 = 0.2 against plain's 2 / 12 = 0.167 (20% more): 1. Rounds of 3.5:
    3.2 / 17.5 = 0.183, 9.7% more: still 1; of 4.5: 3.2 / 18.5 = 0.173, 3.8% more, within
    SHARED_MARGIN: 0."""
    for round_seconds, length in ((2.0, 1), (3.5, 1), (4.5, 0)):
        batch = timed_batch(10.0, 1.0, round_seconds, 0.0)
        batch.post(1, expected_tokens([1.0] + [0.6] * 8, 8))
        assert batch.length(2, 1) == length, round_seconds
    assert batch.choices() == ([((2, 0), 1)], [(2, 1.0)])  # what was chosen, not the best rate


def test_a_round_never_timed_over_the_batch_scales_as_the_target_s_passes_do():
    """Rounds timed over one sequence only (10 ms): over 4, what the target's decoding pass costs
    more over 4 sequences than one (60 against 30 ms): 20 ms. Once a round over 2 is timed, from
    that one, as the target's pass over 4 costs more than over 2."""
    batch = BatchDrafts(Clock())
    for _ in range(4):
        batch.timed(True, [1], 0.030)
        batch.timed(True, [1] * 4, 0.060)
        batch.timed(False, [1], 0.010)
    assert batch.round_seconds(4) == pytest.approx(0.020)
    for _ in range(4):  # rounds over 2 (22 ms) beside passes over 2 (40 ms): over 4, 22 * 60 / 40
        batch.timed(False, [1, 1], 0.022)
        batch.timed(True, [1, 1], 0.040)
    assert batch.round_seconds(2) == pytest.approx(0.022) and batch.round_seconds(4) == pytest.approx(0.033)


def test_passes_reading_text_do_not_price_decoding():
    """A verify pass beside another slot's prompt chunk, a draft pass catching up: never priced as
    a decoding pass or a round."""
    batch = BatchDrafts(Clock())
    batch.timed(True, [1, 256], 2.0)
    batch.timed(False, [1, 40], 0.2)
    assert batch.verify == {} and not batch.rounds.seconds
    batch.timed(True, [5, 17], 0.3)
    assert batch.verify[2].known(22)


def test_an_ended_text_leaves_the_batch_s_mean_at_once():
    """AdaptivePolicy.end_text (the engine's last step, or an interruption): the slot's curve goes."""
    from specrun.control.policy import AdaptivePolicy

    batch = BatchDrafts(Clock())
    policy = AdaptivePolicy()
    policy.batch = batch
    batch.post(id(policy), HALF_RIGHT)
    batch.post(0, MOSTLY_RIGHT)
    policy.end_text()
    assert batch.mean_curve(2) == MOSTLY_RIGHT[:3]


def test_no_length_alone_before_a_curve_or_before_the_batches_are_timed():
    timed = timed_batch(10.0, 1.0, 0.0, 1.0, sequences=(1, 2))
    assert timed.length(2, 8) is None  # no slot has posted
    timed.post(1, HALF_RIGHT)
    assert timed.length(1, 8) is None  # alone: the slot's own rule
    assert timed.length(3, 8) is None  # no decoding pass over 3 sequences timed
    assert timed.length(2, 8) is not None
    untimed = BatchDrafts(Clock())
    untimed.post(1, HALF_RIGHT)
    assert untimed.length(2, 8) is None  # nothing timed
    untimed.timed(True, [1, 1], 12.0)
    assert untimed.length(2, 8) is None  # no draft round timed
    untimed.timed(False, [1, 1], 2.0)
    assert untimed.length(2, 8) is not None


def test_the_batch_reads_the_mean_of_its_fresh_curves():
    """A slot right every time and one never right: their mean, 1 + k / 2, on passes costing only
    their fixed part and free rounds, drafts the longest; once the sure slot's curve goes stale
    (not posted for FRESH_SECONDS) only the never-right curve counts, and with rounds that cost
    something: 0. A dropped curve counts no more."""
    clock = Clock()
    free = timed_batch(1.0, 0.0, 0.0, 0.0, clock)
    free.post(1, expected_tokens([1.0] * 9, 8))
    free.post(2, expected_tokens([1.0] + [0.0] * 8, 8))
    assert free.mean_curve(2) == [1.0, 1.5, 2.0]
    assert free.length(2, 8) == 8
    dear = timed_batch(1.0, 0.0, 0.05, 0.0, clock)
    dear.post(1, expected_tokens([1.0] * 9, 8))
    dear.post(2, expected_tokens([1.0] + [0.0] * 8, 8))
    assert dear.length(2, 8) == 8  # (1 + 8 / 2) / (1 + 0.4) against 1 / 1
    clock.now = 2.0
    dear.post(2, expected_tokens([1.0] + [0.0] * 8, 8))
    clock.now = BatchDrafts.FRESH_SECONDS + 1.0
    assert dear.mean_curve(2) == [1.0, 1.0, 1.0]
    assert dear.length(2, 8) == 0
    dear.drop(2)
    assert dear.mean_curve(2) is None


def test_a_slot_s_costs_are_read_by_every_sequence_s_tokens_as_a_batch():
    costs = TargetCosts()
    for n in range(1, 40):
        costs.observe(n, 10.0 + n)
    costs.share(7)  # read by this slot's tokens, 7 of the others' beside them
    assert costs(1) == pytest.approx(18.0)
    assert costs.batch_table(12)[4] == pytest.approx(14.0) and len(costs.batch_table(12)) == 13


class SlotFake(CostedFake):
    """A slot's model: ``others`` other sequences in each pass, each feeding ``per_other`` tokens,
    a pass costing ``fixed + per_token`` a token of the batch; each pass reported to ``batch`` as
    the rendezvous reports the batches it runs (``verifying``: the target's)."""

    def __init__(self, table, clock, fixed, per_token, others: int, per_other: int,
                 batch: BatchDrafts | None, verifying: bool) -> None:
        super().__init__(table, clock, fixed, per_token)
        self.others_in_pass = others
        self.per_other = per_other
        self.others_tokens_in_pass = others * per_other
        self.batch, self.verifying = batch, verifying

    def forward(self, tokens, logit_rows):
        seconds = self.fixed + self.per_token * (len(tokens) + self.others_tokens_in_pass)
        self.clock.now += seconds
        if self.batch is not None:
            self.batch.timed(self.verifying, [len(tokens)] + [self.per_other] * self.others_in_pass, seconds)
        return FakeBackend.forward(self, tokens, logit_rows)


PROMPTS = [REPEATING_PROMPT, REPEATING_PROMPT[::-1] + [20, 21, 22], [7, 8, 9, 7, 8] * 3, REPEATING_PROMPT[3:]]


def drafted_by_text(batch: BatchDrafts | None) -> tuple[list[int], list[int], list[list[int]]]:
    """A slot among 4 whose others draft 8 a step (9 tokens each in every pass, one each in every
    draft round), on a CPU where a pass costs 1 + 1 a token of the batch and a draft round 2, in
    a batch that once decoded with every slot alike (passes of 4, 8 and 12 tokens timed). Alone, pricing its step
    against the others' 27 tokens, drafting 8 always right yields (4 + 8) / (37 + 16) = 0.23
    tokens a unit against plain's 4 / 29 = 0.14, so it drafts; the batch drafting alike yields at
    most 4 (1 + k) / (5 + 6 k) against plain batching's 4 / 5: 0. Drafted tokens by text, tokens
    the draft model read by text, and every output."""
    clock = CostClock()
    if batch is not None:
        for _ in range(4):
            for t in (1, 2, 3):
                batch.timed(True, [t] * 4, 1.0 + 4 * t)
            batch.timed(False, [1, 1, 1, 1], 2.0)
    target = SlotFake(copying_logits(salt=4), clock, 1.0, 1.0, others=3, per_other=9, batch=batch, verifying=True)
    draft = SlotFake(noisy_copy(4), clock, 2.0, 0.0, others=3, per_other=1, batch=batch, verifying=False)
    engine = SpeculativeEngine(target, build_drafter("draft", draft, DrafterOptions()), method="draft", clock=clock)
    engine.policy.batch = batch
    params = GenerationParams(40, draft_len=8, stop_at_eos=False, adaptive=True)
    drafted, read, outputs = [], [], []
    for prompt in PROMPTS:
        engine.policy.forget_acceptance()  # a server's next request (ChatSession.new_text)
        before = draft.forwarded_tokens
        result = engine.run(prompt, params)
        drafted.append(result.stats.drafted)
        read.append(draft.forwarded_tokens - before)
        outputs.append(result.token_ids)
    engine.drafter.close()
    return drafted, read, outputs


def test_a_slot_whose_batch_gains_nothing_by_drafting_drafts_nothing_where_alone_it_would():
    """…and its draft model reads no prompt (AdaptivePolicy.reads_prompt): a prompt read is a
    draft pass the other slots' passes wait for; read when first asked to draft, if ever. Every
    output is plain decoding's."""
    plain = SpeculativeEngine(FakeBackend(copying_logits(salt=4), COPYING_VOCAB))
    alone_drafted, alone_read, alone_outputs = drafted_by_text(None)
    batch_drafted, batch_read, batch_outputs = drafted_by_text(BatchDrafts(CostClock()))
    assert all(count > 20 for count in alone_drafted) and all(count > 20 for count in alone_read)
    assert batch_drafted == [0, 0, 0, 0] and batch_read == [0, 0, 0, 0]
    expected = [plain.run(prompt, GenerationParams(40, draft_len=0, stop_at_eos=False)).token_ids
                for prompt in PROMPTS]
    assert alone_outputs == expected and batch_outputs == expected


def test_a_slot_among_slots_held_plain_drafts_nothing_and_its_tokens_are_counted():
    """Engine level: a slot among 4 held plain (the rates' choice measured slower) on passes where
    drafting is cheap and its rates would draft long; alone in its passes (the others reading)
    and sharing them alike, it drafts nothing, its tokens reach the batch's measurement and its
    output is plain decoding's."""
    from collections import deque

    from specrun.control.batch import PLAIN, _Arms

    plain = SpeculativeEngine(FakeBackend(copying_logits(salt=4), COPYING_VOCAB))
    for others in (0, 3):
        clock = CostClock()
        batch = BatchDrafts(clock, occupancy=lambda: 4)
        for _ in range(4):  # memory-bound: drafting is cheap
            for m in (1, 4):
                for t in (1, 5, 9):
                    batch.timed(True, [t] * m, 0.040 + 0.0001 * m * t)
                batch.timed(False, [1] * m, 0.001)
        realised = batch.realised
        realised._arms[4] = _Arms(rates=deque([(10, 1.0)] * 2), plain=deque([(20, 1.0)] * 2), held=True,
                                  gap=64, decided=True, opened=True)
        realised._last_arm, realised._last_sequences = PLAIN, 4
        target = SlotFake(copying_logits(salt=4), clock, 40.0, 0.1, others=others, per_other=1, batch=batch,
                          verifying=True)
        draft = SlotFake(noisy_copy(4), clock, 1.0, 0.0, others=others, per_other=1, batch=batch, verifying=False)
        engine = SpeculativeEngine(target, build_drafter("draft", draft, DrafterOptions()), method="draft", clock=clock)
        engine.policy.batch = batch
        result = engine.run(PROMPTS[0], GenerationParams(40, draft_len=8, stop_at_eos=False, adaptive=True))
        engine.drafter.close()
        expected = plain.run(PROMPTS[0], GenerationParams(40, draft_len=0, stop_at_eos=False)).token_ids
        assert result.stats.drafted == 0 and result.token_ids == expected, others
        assert sum(tokens for tokens, _ in realised._arms[4].plain) > 40 or realised._epoch.tokens > 0, others


def test_the_time_a_slot_s_token_saves_the_batch_is_its_share_of_a_pass_s_gain():
    """The worked batch above: 2 slots drafting 1 gain 0.1875 / (2 / 12) = 1.125 on a plain pass of
    12: a slot's token adds 1 - 1 / 1.125 tokens, worth 12 (1 - 1 / 1.125) / 2 of the batch's time."""
    batch = timed_batch(10.0, 1.0, 0.0, 1.0)
    assert batch.saving(2) is None  # no length chosen yet
    batch.post(1, HALF_RIGHT)
    assert batch.length(2, 8) == 1
    assert batch.saving(2) == pytest.approx(12.0 * (1.0 - 1.0 / 1.125) / 2)
    compute_bound = timed_batch(0.023, 0.0157, 0.005, 0.0065)
    compute_bound.post(1, MOSTLY_RIGHT)
    assert compute_bound.length(4, 8) == 0 and compute_bound.saving(4) == 0.0


@pytest.mark.parametrize("timed_by", ["drafter", "batch"])
@pytest.mark.parametrize("read_seconds, drafts", [(1e-6, True), (1.0, False)])
def test_a_slot_whose_draft_would_read_more_than_the_rest_of_its_text_saves_drafts_nothing(read_seconds, drafts,
                                                                                           timed_by):
    """Slots sharing a memory-bound batch that drafts: a slot's draft model, its prompt left unread
    (the others share the pass), reads it at its first draft, a pass every slot waits for. Where
    reading costs a second a token, the 40 tokens left of the text save the batch less than that:
    it drafts nothing and reads nothing; where a read is nearly free it reads (timing it) and
    drafts. The cost is what the batch timed of the draft model's long batches where it timed
    them (every slot's reads, no slot's wait for the others), else the drafter's own catch-ups':
    each time the other says the opposite. Each output is plain decoding's."""
    from specrun.drafters.draft_model import PassTiming

    plain = SpeculativeEngine(FakeBackend(copying_logits(salt=4), COPYING_VOCAB))
    clock = CostClock()
    batch = BatchDrafts(clock)
    for _ in range(4):  # memory-bound: drafting pays
        for t in (1, 5, 9):
            batch.timed(True, [t] * 4, 0.040 + 0.0001 * 4 * t)
        batch.timed(False, [1] * 4, 0.001)
    target = SlotFake(copying_logits(salt=4), clock, 40.0, 0.1, others=3, per_other=1, batch=batch, verifying=True)
    draft = SlotFake(noisy_copy(4), clock, 1.0, 0.0, others=3, per_other=1, batch=batch, verifying=False)
    drafter = build_drafter("draft", draft, DrafterOptions())
    drafter.read_timing = PassTiming()
    opposite = 1.0 if read_seconds < 1.0 else 1e-6
    for _ in range(4):  # as its earlier catch-ups timed it, and the batch every slot's reads
        drafter.read_timing.add(read_seconds if timed_by == "drafter" else opposite)
        if timed_by == "batch":
            batch.timed(False, [1, 300, 1], 302 * read_seconds)
    assert (batch.read_seconds() == pytest.approx(read_seconds)) == (timed_by == "batch")
    engine = SpeculativeEngine(target, drafter, method="draft", clock=clock)
    engine.policy.batch = batch
    result = engine.run(PROMPTS[0], GenerationParams(40, draft_len=8, stop_at_eos=False, adaptive=True))
    engine.drafter.close()
    expected = plain.run(PROMPTS[0], GenerationParams(40, draft_len=0, stop_at_eos=False)).token_ids
    assert result.token_ids == expected
    assert (result.stats.drafted > 0) == drafts and (draft.forwarded_tokens > 0) == drafts
    assert drafter.read_timing.passes == (5 if drafts else 4)  # the prompt read at the first draft: timed
    assert batch.read_seconds() is None if timed_by == "drafter" else batch.reads.passes == 4 + drafts


# ---- what the batch gets, measured (control/batch.Realised) --------------------------------

STEP = 0.125  # a step of the simulated batch, in seconds (exact in binary: stretches end on a step)


def decode(batch: BatchDrafts, clock: Clock, stretches: float, drafting_tokens: int, plain_tokens: int,
           sequences: int = 4, curve=MOSTLY_RIGHT) -> list[bool]:
    """``sequences`` slots decode together for ``stretches`` times EPOCH_SECONDS: each STEP the
    batch is asked its length and gets ``drafting_tokens`` where it drafted, ``plain_tokens``
    where plain. Whether each stretch drafted (all its steps alike, or the test fails)."""
    from specrun.control.batch import EPOCH_SECONDS

    per_stretch = round(EPOCH_SECONDS / STEP)
    drafted = []
    for _ in range(round(stretches * per_stretch)):
        batch.post(1, curve)  # as each slot does before asking
        length = batch.length(sequences, 8)
        drafted.append(bool(length))
        clock.now += STEP
        batch.emitted(sequences, drafting_tokens if length else plain_tokens)
    parts = [drafted[i:i + per_stretch] for i in range(0, len(drafted), per_stretch)]
    assert all(len(set(part)) == 1 for part in parts), parts
    return [part[0] for part in parts]


def opening() -> list[bool]:
    """The first stretches at an occupancy: the rates' choice, then plain batching, each first
    stretch settling (every slot's prompt read; steps begun under the other arm), MIN_KEPT kept
    of each before they are compared."""
    from specrun.control.batch import MIN_KEPT

    return [True] * (1 + MIN_KEPT) + [False] * (1 + MIN_KEPT)


def drafting_batch(clock: Clock) -> BatchDrafts:
    """A memory-bound batch whose rates choose long drafts at 4 sequences (as above)."""
    batch = timed_batch(0.040, 0.0005, 0.008, 0.0001, clock)
    batch.post(1, MOSTLY_RIGHT)
    return batch


def test_where_the_rates_choice_measures_slower_than_plain_batching_the_batch_holds_plain():
    """The rates choose drafting, but the batch gets 4 tokens a step drafting against 5 plain
    (what the passes' costs do not show: catching up, prompts, uneven finishing). First a stretch
    under the rates' choice, then one plain; from then on plain, the rates' choice tried again
    (its first stretch back settling, not measured) after a gap long enough that its tries, two
    stretches at 0.8x, cost TRY_BUDGET of plain's tokens; still slower, after twice that gap."""
    from specrun.control.batch import FIRST_GAP, TRY_BUDGET

    clock = Clock()
    batch = drafting_batch(clock)
    assert decode(batch, clock, len(opening()), 4, 5) == opening()
    assert batch.describe(4)["held_plain"] is True
    assert batch.describe(4)["realised"] == {"rates": 32.0, "plain": 40.0}
    gap = max(FIRST_GAP, math.ceil(2 * 0.2 / TRY_BUDGET))
    assert decode(batch, clock, gap + 2, 4, 5) == [False] * gap + [True, True]  # settling, measured
    # the gap doubled, counted in kept stretches (the first back under plain settles)
    assert decode(batch, clock, 1 + 2 * gap + 1, 4, 5) == [False] * (1 + 2 * gap) + [True]
    assert batch.held_plain() == [(4, True)]
    assert batch.measured() == [(4, "rates", 32.0), (4, "plain", 40.0)]


def test_a_try_is_priced_at_what_its_switch_cost_not_its_measured_stretch_alone():
    """Held plain (4 tokens a step drafting, 5 plain), where each switch to the rates' choice also
    has every slot's draft model read the text it decoded plainly (8 slots on a 2-core CPU: the
    catch-ups of one switch took seconds every slot waited): its settling stretch yields 1 token a
    step. Priced by its measured stretches alone a try cost 0.4 stretches of plain's tokens and came
    again after 2 * 14; priced at what its settling lost too (0.8 + 0.2, plain settling back as
    plain) it comes after ceil(1.0 / TRY_BUDGET) = 34."""
    from specrun.control.batch import EPOCH_SECONDS, FIRST_GAP, TRY_BUDGET

    clock = Clock()
    batch = drafting_batch(clock)
    per_stretch = round(EPOCH_SECONDS / STEP)
    arms: list[bool] = []

    def stretches(count: int) -> list[bool]:
        start = len(arms)
        for step in range(count * per_stretch):
            batch.post(1, MOSTLY_RIGHT)
            drafting = bool(batch.length(4, 8))
            if step % per_stretch == 0:
                arms.append(drafting)
            switched = len(arms) > 1 and arms[-1] and not arms[-2]
            clock.now += STEP
            batch.emitted(4, (1 if switched else 4) if drafting else 5)
        return arms[start:]

    assert stretches(len(opening())) == opening()
    gap = max(FIRST_GAP, math.ceil(2 * 0.2 / TRY_BUDGET))  # nothing settled under the rates yet
    assert stretches(gap + 2) == [False] * gap + [True, True]
    priced = math.ceil((1 - 1 / 5 + 0.2) / TRY_BUDGET)  # settling at 1 token a step against plain's 5
    assert priced > 2 * gap
    assert stretches(1 + priced + 1) == [False] * (1 + priced) + [True]
    assert batch.held_plain() == [(4, True)]


def test_a_try_s_cost_sums_what_each_of_its_stretches_fell_short_of_the_standing_arm():
    """Plain standing at 40 tokens/s, the rates' choice measured at 32: a try costs 0.2 of a stretch
    for each of its two stretches where no switch was measured (the settling back costs nothing);
    a switch to the rates that stalled (0 tokens) costs a whole stretch, and a slow settling back
    its shortfall; nothing where an arm is unmeasured or the standing arm got nothing."""
    from specrun.control.batch import PLAIN, RATES, _Arms

    arms = _Arms()
    assert arms.try_cost(PLAIN) == 0.0  # nothing measured
    arms.plain.append((60, 1.5))
    arms.rates.append((48, 1.5))
    assert arms.try_cost(PLAIN) == pytest.approx(0.4)
    assert arms.try_cost(RATES) == 0.0  # the rates' choice "standing" below plain: no shortfall
    arms.settling[RATES].append((0, 1.5))
    assert arms.try_cost(PLAIN) == pytest.approx(1.2)
    arms.settling[PLAIN].append((30, 1.5))
    assert arms.try_cost(PLAIN) == pytest.approx(1.7)
    stalled = _Arms()
    stalled.plain.append((0, 1.5))
    stalled.rates.append((48, 1.5))
    assert stalled.try_cost(PLAIN) == 0.0


def test_where_the_rates_choice_measures_faster_it_stands_and_plain_is_tried_less_and_less():
    from specrun.control.batch import FIRST_GAP, TRY_BUDGET

    clock = Clock()
    batch = drafting_batch(clock)
    assert decode(batch, clock, len(opening()), 7, 5) == opening()
    assert batch.describe(4)["held_plain"] is False
    # back to drafting (its first stretch settling, not kept), for as many kept stretches as a
    # plain try (two stretches at 5/7) may cost TRY_BUDGET of; then plain once more (a stretch
    # settling, one measured); agreeing, the gap doubles
    gap = max(FIRST_GAP, math.ceil(2 * (1 - 5 / 7) / TRY_BUDGET))
    assert decode(batch, clock, 1 + gap + 2, 7, 5) == [True] * (1 + gap) + [False, False]
    assert decode(batch, clock, 1 + 2 * gap + 1, 7, 5) == [True] * (1 + 2 * gap) + [False]
    assert batch.held_plain() == [(4, False)]


def test_the_gaps_between_tries_are_bounded():
    """However much slower the arm left aside, it is tried again within LAST_GAP stretches."""
    from specrun.control.batch import LAST_GAP

    clock = Clock()
    batch = drafting_batch(clock)
    assert decode(batch, clock, len(opening()), 1, 30) == opening()  # 0.97 slower: 2 * 0.97 / TRY_BUDGET > LAST_GAP
    assert decode(batch, clock, LAST_GAP + 1, 1, 30) == [False] * LAST_GAP + [True]


def stretches_until(batch: BatchDrafts, clock: Clock, held: bool, drafting_tokens: int) -> int:
    """Stretches decoded (5 tokens a step plain) until plain batching is ``held`` or not."""
    for count in range(1, 100):
        decode(batch, clock, 1, drafting_tokens, 5)
        if batch.held_plain() == [(4, held)]:
            return count
    raise AssertionError("never")


def test_a_batch_that_turns_slower_under_drafting_goes_plain_and_back_when_it_turns_faster():
    """The measurements follow the machine: drafting faster, then slower (held plain once its kept
    stretches say so), then faster again (drafting at the next try of the rates' choice), each
    within a gap's stretches and the kept ones."""
    from specrun.control.batch import KEPT_EPOCHS, LAST_GAP

    clock = Clock()
    batch = drafting_batch(clock)
    decode(batch, clock, 8, 7, 5)
    assert batch.held_plain() == [(4, False)]
    assert stretches_until(batch, clock, True, 3) <= KEPT_EPOCHS + 3  # a plain try may come between
    assert stretches_until(batch, clock, False, 9) <= 2 * (LAST_GAP + 3)


def test_a_turn_to_plain_waits_its_gap_before_trying_the_rates_again():
    """Drafting stood long (its gap grown), then turned slower: plain is held, and the rates'
    choice is not tried again at once (the count of stretches starts afresh at the turn)."""
    from specrun.control.batch import FIRST_GAP

    clock = Clock()
    batch = drafting_batch(clock)
    decode(batch, clock, 60, 7, 5)
    assert batch.held_plain() == [(4, False)]
    stretches_until(batch, clock, True, 4)  # a little slower: a short gap (its floor 2 * 0.05 / TRY_BUDGET)
    assert decode(batch, clock, 1 + FIRST_GAP, 4, 5) == [False] * (1 + FIRST_GAP)


def test_slots_held_plain_are_plain_whatever_their_pass_held():
    """Held plain at 4 slots: a slot whose pass held 3 sequences (a count never timed) or itself
    alone gets 0, not its own rule."""
    clock = Clock()
    batch = timed_batch(0.040, 0.0005, 0.008, 0.0001, clock, sequences=(1, 4))
    batch.occupancy = lambda: 4
    assert decode(batch, clock, len(opening()), 4, 5) == opening()
    assert batch.held_plain() == [(4, True)]
    batch.post(1, MOSTLY_RIGHT)
    assert batch.length(3, 8) == 0 and batch.length(1, 8) == 0 and batch.length(4, 8) == 0


def test_stretches_where_slots_chose_by_their_own_rule_are_the_rates_arm_s():
    """Where the batch cannot tell a length (nothing timed), each slot's own rule runs and may
    draft: those stretches are measured as the rates' choice's, never as plain batching's."""
    clock = Clock()
    batch = BatchDrafts(clock, occupancy=lambda: 4)
    for _ in range(2 * 12):
        batch.post(1, MOSTLY_RIGHT)
        assert batch.length(4, 8) is None
        clock.now += STEP
        batch.emitted(4, 6)
    assert batch.measured() == [(4, "rates", 48.0)]  # the first stretch settled


def test_a_rates_choice_that_drafts_nothing_is_plain_batching_and_never_tried_against_itself():
    """A compute-bound batch whose rates choose 0: its stretches are measured as plain batching
    and no other arm is ever run."""
    clock = Clock()
    batch = timed_batch(0.023, 0.0157, 0.005, 0.0065, clock)
    batch.post(1, MOSTLY_RIGHT)
    assert decode(batch, clock, 12, 4, 5) == [False] * 12
    assert batch.held_plain() == [(4, False)]
    assert batch.measured() == [(4, "plain", 40.0)]


def test_prompt_reads_and_short_stretches_tell_neither_arm():
    """A prompt read (a verify batch with a long pass) is left out of the stretch's seconds by the
    long passes' share of its tokens; a stretch cut short by the occupancy changing is not kept;
    nor one whose slots chose alone (the batch could not tell them a length)."""
    from specrun.control.batch import EPOCH_SECONDS

    clock = Clock()
    batch = drafting_batch(clock)
    assert decode(batch, clock, 1, 4, 5) == [True]  # the first stretch settles: not kept
    assert batch.measured() == []
    batch.length(4, 8)
    batch.timed(True, [1, 1, 1, 97], 1.0)  # 0.97 s of it the read
    clock.now += EPOCH_SECONDS
    batch.emitted(4, 60)  # the stretch ends: 60 tokens over 0.53 s, not 1.5 s
    assert batch.measured() == [(4, "rates", pytest.approx(60 / 0.53))]
    clock.now += 0.125
    batch.emitted(4, 100)
    batch.length(3, 8)  # the occupancy changed after 0.125 s: that stretch is not kept
    assert batch.measured() == [(4, "rates", pytest.approx(60 / 0.53))]
    untold = BatchDrafts(clock)
    untold.post(1, MOSTLY_RIGHT)
    assert untold.length(4, 8) is None  # nothing timed: each slot's own rule
    clock.now += EPOCH_SECONDS
    untold.emitted(4, 100)
    assert untold.measured() == []


def test_stretches_are_kept_by_the_slots_generating_not_by_each_pass_s_sequences():
    """Slots drafting while others verify make passes of 2, 3 and 4 sequences out of 4 slots
    generating: with the rendezvous' count as occupancy a stretch runs its full time (a pass's
    own count would cut it at every change, and nothing would be measured)."""
    from specrun.control.batch import EPOCH_SECONDS

    clock = Clock()
    batch = timed_batch(0.040, 0.0005, 0.008, 0.0001, clock, sequences=(1, 2, 3, 4))
    batch.occupancy = lambda: 4
    for step in range(2 * round(EPOCH_SECONDS / STEP) + 1):  # the first stretch settles
        batch.post(1, MOSTLY_RIGHT)
        batch.length(2 + step % 3, 8)
        clock.now += STEP
        batch.emitted(2 + (step + 1) % 3, 4)
    assert batch.measured() == [(4, "rates", 32.0)]


def test_a_pass_alone_among_slots_held_plain_is_plain_too():
    """Where the slots generating are held plain, a slot whose last pass ran alone (the others were
    drafting or reading) gets 0 rather than its own rule, which, alone, would draft; with one slot
    generating, or the rates' choice standing, its own rule as before."""
    clock = Clock()
    batch = drafting_batch(clock)
    generating = [4]
    batch.occupancy = lambda: generating[0]
    assert batch.length(1, 8) is None  # nothing measured yet: the slot's own rule
    assert decode(batch, clock, len(opening()), 4, 5) == opening()
    assert batch.held_plain() == [(4, True)]
    assert batch.length(1, 8) == 0
    generating[0] = 1
    assert batch.length(1, 8) is None


def test_an_occupancy_passed_through_carries_on_as_before_and_opens_only_once_it_stays():
    """4 slots held plain; a request ends and the next one's prompt is read: 3 slots generate for
    a moment, plainly as before (not the rates' choice, which would read every slot's text); where
    3 slots stay for a whole stretch, their own comparison opens."""
    clock = Clock()
    batch = drafting_batch(clock)
    generating = [4]
    batch.occupancy = lambda: generating[0]
    decode(batch, clock, len(opening()), 4, 5)
    assert batch.held_plain() == [(4, True)]
    for _ in range(3):  # dips of a quarter of a stretch
        generating[0] = 3
        for _ in range(3):
            batch.post(1, MOSTLY_RIGHT)
            assert batch.length(3, 8) == 0
            clock.now += STEP
            batch.emitted(3, 4)
        generating[0] = 4
        assert decode(batch, clock, 1, 4, 5) == [False]
    generating[0] = 3
    # its plain stretches so far (the dips' too) count: the rates' choice runs, settling first,
    # until MIN_KEPT of its own are kept, and, faster there, stands
    from specrun.control.batch import MIN_KEPT

    assert decode(batch, clock, 1 + 1 + MIN_KEPT + 2, 6, 5, sequences=3) == [False] + [True] * (1 + MIN_KEPT + 2)
    assert batch.held_plain() == [(3, False), (4, True)]


@pytest.mark.parametrize("generating, reads", [(1, True), (4, False)])
def test_a_slot_opening_beside_other_slots_leaves_its_prompt_unread_before_any_pass_is_shared(generating, reads):
    """Requests opening together: no pass shared yet (``sharing`` 0), but other slots generating
    (the rendezvous's ``joined``): the draft model leaves the prompt unread, to be read when first
    asked to draft, if ever (8 slots opening so read every prompt before the target's first pass:
    first tokens at 8.2 s against plain batching's 4.5, docs/perf.md 3(r)). A slot alone reads it."""
    batch = BatchDrafts(CostClock(), occupancy=lambda: generating)
    draft = FakeBackend(noisy_copy(4), COPYING_VOCAB)
    engine = SpeculativeEngine(FakeBackend(copying_logits(salt=4), COPYING_VOCAB),
                               build_drafter("draft", draft, DrafterOptions()), method="draft")
    engine.policy.batch = batch
    engine.policy.configure(8, True)
    assert engine.policy.target_costs.sharing == 0
    assert engine.policy.reads_prompt(engine.drafter.members[0]) is reads
