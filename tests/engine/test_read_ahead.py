"""Plain greedy steps that read one token ahead (KVSequence.feed_argmax_ahead): each step queues
the next one's pass on its own token, as mlx-lm's loop does, so the host's work between steps
overlaps the model's. The fake here reads ahead as MLX does (each pass run at once); what must
hold is that nothing about the output or the cache changes, and that no pass is wasted on a run
that ends where it was asked to."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from fake_models import hashed_logits, hidden_table
from lossless_harness import window_problems
from oracle import distribution, joint_of
from specrun.backends.fake import FakeBackend
from specrun.backends.kv import sequence_for
from specrun.drafters.methods import DrafterOptions, build_drafter
from specrun.engine.events import Finished
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.penalties import AheadShaping, Penalties
from specrun.reasoning_budget import ReasoningBudget
from specrun.sampling import SamplingSettings, text_shaped_rows

VOCAB = 12
EOS = 11


def fake(reads_ahead: bool, n_ctx: int = 4096, eos: bool = False, salt: int = 1) -> FakeBackend:
    return FakeBackend(hashed_logits(VOCAB, salt=salt, spread=2.0), VOCAB, n_ctx=n_ctx,
                       eos_ids=(EOS,) if eos else (), reads_ahead=reads_ahead)


def prompts(count: int = 6) -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [[int(t) for t in rng.integers(0, EOS, size=int(rng.integers(3, 12)))] for _ in range(count)]


def test_plain_steps_read_ahead_with_the_same_output_the_same_cache_and_no_extra_pass():
    for prompt in prompts():
        for eos in (False, True):
            plain, ahead = fake(False, eos=eos), fake(True, eos=eos)
            expected = SpeculativeEngine(plain).run(prompt, GenerationParams(40, 0))
            result = SpeculativeEngine(ahead).run(prompt, GenerationParams(40, 0))
            assert list(result.token_ids) == list(expected.token_ids) and result.text == expected.text
            assert ahead.cache == plain.cache == [*prompt, *result.token_ids]  # the next turn's cache
            assert len(sequence_for(ahead)) == len(ahead.cache) and not sequence_for(ahead).reading_ahead
            assert ahead.ahead_passes == max(len(result.token_ids) - 2 + eos, 0)  # all but the prefill's and the last
            # a run that stops at its length queues nothing past it; one that stops at EOS queued
            # one pass on the EOS, which the next turn's cache keeps instead of feeding it again
            assert ahead.forwarded_tokens == plain.forwarded_tokens and ahead.ahead_dropped == 0


def test_a_chat_s_turns_continue_the_cache_read_ahead():
    plain, ahead = fake(False), fake(True)
    engines = SpeculativeEngine(plain), SpeculativeEngine(ahead)
    history = [[], []]
    for turn, said in enumerate(([3, 4, 5], [6, 7], [8])):
        outputs = []
        for index, engine in enumerate(engines):
            history[index] += said
            result = engine.run(history[index], GenerationParams(9 + turn, 0), complete_cache=turn % 2 == 0)
            history[index] += list(result.token_ids)
            outputs.append(list(result.token_ids))
        assert outputs[0] == outputs[1]
    assert ahead.forwarded_tokens <= plain.forwarded_tokens


def test_a_stream_left_midway_keeps_no_token_beyond_the_text_and_the_next_run_is_plain_s():
    plain, ahead = fake(False), fake(True)
    engine = SpeculativeEngine(ahead)
    stream = engine.stream([1, 2, 3], GenerationParams(30, 0))
    for _ in range(5):
        next(stream)
    stream.close()  # a client that left, or a stop string found
    sequence = sequence_for(ahead)
    assert ahead.cache[: len(sequence.tokens)] == sequence.tokens
    assert ahead.n_past == len(sequence.tokens) + sequence.reading_ahead  # in step, ahead or not
    result = engine.run([4, 5, 6, 7], GenerationParams(20, 0))
    expected = SpeculativeEngine(plain).run([4, 5, 6, 7], GenerationParams(20, 0))
    assert list(result.token_ids) == list(expected.token_ids)
    assert ahead.cache == [4, 5, 6, 7, *result.token_ids]


@pytest.mark.parametrize("n_ctx", [20, 21, 22])
def test_a_context_filling_up_reads_no_further_than_it_holds(n_ctx):
    prompt = [1, 2, 3, 4, 5]
    expected = SpeculativeEngine(fake(False, n_ctx=n_ctx)).run(prompt, GenerationParams(100, 0))
    ahead = fake(True, n_ctx=n_ctx)
    result = SpeculativeEngine(ahead).run(prompt, GenerationParams(100, 0))
    assert list(result.token_ids) == list(expected.token_ids)
    assert result.finish_reason == expected.finish_reason == "context"
    assert len(ahead.cache) <= n_ctx


def test_logprobs_top_p_and_the_infill_rule_step_plainly_without_reading_ahead():
    ahead = fake(True)
    engine = SpeculativeEngine(ahead)
    engine.run([1, 2, 3], GenerationParams(20, 0, sampling=SamplingSettings(temperature=0.8, top_p=0.9, seed=3)))
    engine.run([1, 2, 3], GenerationParams(20, 0, sampling=SamplingSettings(temperature=0.8, infill=True, seed=3)))
    engine.run([1, 2, 3], GenerationParams(20, 0, logprobs=2))
    assert ahead.ahead_passes == 0
    engine.run([1, 2, 3], GenerationParams(20, 0))
    assert ahead.ahead_passes > 0


SAMPLED = {
    "temperature": SamplingSettings(temperature=0.8),
    "top-k": SamplingSettings(temperature=1.3, top_k=3),
    "min-p": SamplingSettings(temperature=0.7, min_p=0.1),
    "under penalties": SamplingSettings(temperature=1.0, top_k=5, penalties=Penalties(repeat=1.5, last_n=4),
                                        logit_bias=((2, 1.0),)),
}


SAMPLED_VOCAB = 6
SAMPLED_PROMPT = (1, 4, 2, 1)
SAMPLED_WINDOW = 4
SAMPLED_RUNS = 2000


@pytest.mark.parametrize("settings", SAMPLED.values(), ids=SAMPLED.keys())
def test_sampled_plain_steps_read_ahead_drawing_from_plain_decoding_s_distribution(settings):
    """A sampled plain step's token is drawn where its row is (the queued one's too, after a token
    the host has not read), by Gumbel noise keyed by one uniform of the run's generator: 2,000
    seeded windows of four tokens are distributed as plain decoding's exact joint (chi-square),
    every step after the first two read ahead, and a seed gives one text."""
    table = hashed_logits(SAMPLED_VOCAB, salt=7, spread=1.5)

    def row(text: tuple[int, ...]) -> list[float]:
        return distribution(text_shaped_rows(table(text)[None], settings, text, [()])[0], settings)

    ahead = FakeBackend(table, SAMPLED_VOCAB, reads_ahead=True)
    engine = SpeculativeEngine(ahead)
    problems, _, _ = window_problems(engine, settings, SAMPLED_PROMPT, SAMPLED_WINDOW,
                                     joint_of(row, SAMPLED_PROMPT, SAMPLED_WINDOW), SAMPLED_RUNS, draft_len=0)
    assert problems == []
    assert ahead.ahead_passes == SAMPLED_RUNS * (SAMPLED_WINDOW - 2)
    seeded = GenerationParams(30, 0, sampling=dataclasses.replace(settings, seed=9))
    assert engine.run(list(SAMPLED_PROMPT), seeded).token_ids == engine.run(list(SAMPLED_PROMPT), seeded).token_ids


def test_a_sequence_keeping_hidden_states_reads_ahead_with_every_state_a_plain_feed_keeps():
    """A head drafter keeps the state of every position: steps read ahead keep the same ones
    (the queued pass's, read with its id); turning tracking on or off drops an id read ahead."""
    def backend() -> FakeBackend:
        return FakeBackend(hashed_logits(VOCAB, salt=1), VOCAB, hidden_table=hidden_table(VOCAB), hidden_size=8,
                           reads_ahead=True)

    ahead, plain = backend(), backend()
    tracked, stepwise = sequence_for(ahead), sequence_for(plain)
    for sequence in (tracked, stepwise):
        sequence.track_hidden(True)
        sequence.feed([1, 2])
    assert tracked.can_read_ahead
    token, queued = tracked.feed_argmax_ahead(3)
    assert not queued and tracked.reading_ahead and ahead.n_past == 4
    expected = [3]
    for _ in range(6):
        expected.append(int(stepwise.feed_argmax(expected[-1:], [0])[0]))
    for _ in range(5):
        token, queued = tracked.feed_argmax_ahead(token)
        assert queued
    assert tracked.tokens == stepwise.tokens == [1, 2, *expected[:-1]] and token == expected[-1]
    assert tracked.hidden(0, len(tracked)) is not None
    np.testing.assert_array_equal(tracked.hidden(0, len(tracked)), stepwise.hidden(0, len(stepwise)))
    assert ahead.ahead_passes == 6 and ahead.ahead_dropped == 0
    expected.append(int(stepwise.feed_argmax(expected[-1:], [0])[0]))
    # a text that goes on with the id read ahead (a chat's next turn) keeps it, with its state
    assert tracked.rewind_to_prefix_of(stepwise.tokens) == len(stepwise.tokens)
    assert not tracked.reading_ahead and ahead.cache == tracked.tokens and ahead.ahead_dropped == 0
    np.testing.assert_array_equal(tracked.hidden(0, len(tracked)), stepwise.hidden(0, len(stepwise)))
    tracked.feed_argmax_ahead(expected[-1])
    tracked.track_hidden(False)  # a queued pass was built tracked: it does not outlive the change
    assert not tracked.reading_ahead and ahead.cache == tracked.tokens and ahead.ahead_dropped == 1


def test_the_sequence_drops_an_id_read_ahead_before_any_other_pass_and_keeps_one_the_text_continues():
    ahead = fake(True)
    sequence = sequence_for(ahead)
    sequence.feed([1, 2])
    first, queued = sequence.feed_argmax_ahead(3)
    assert not queued and ahead.cache == [1, 2, 3, first] and sequence.tokens == [1, 2, 3]
    second, queued = sequence.feed_argmax_ahead(first)  # the pass was queued by the call before
    assert queued and sequence.tokens == [1, 2, 3, first] and ahead.cache == [1, 2, 3, first, second]
    sequence.rewind(4)  # keeping every token keeps the id read ahead
    assert sequence.reading_ahead
    assert sequence.rewind_to_prefix_of([1, 2, 3, first, second, 9]) == 5  # the text goes on with it
    assert sequence.tokens == [1, 2, 3, first, second] and not sequence.reading_ahead
    third, _ = sequence.feed_argmax_ahead(7)
    sequence.feed([5, 6], [1])  # another pass: the id read ahead leaves the cache first
    assert ahead.cache == [1, 2, 3, first, second, 7, 5, 6] and sequence.tokens == ahead.cache
    sequence.feed_argmax_ahead(4)
    sequence.rewind(3)
    assert ahead.cache == sequence.tokens == [1, 2, 3]
    sequence.feed_argmax_ahead(4)
    assert sequence.rewind_to_prefix_of([1, 2, 3, 4, 99], limit=4) == 4  # the limit leaves it out
    sequence.feed([8])
    assert ahead.cache == sequence.tokens == [1, 2, 3, 4, 8]


def test_a_pass_failing_while_reading_ahead_leaves_the_sequence_in_step():
    ahead = fake(True)
    sequence = sequence_for(ahead)
    sequence.feed([1, 2])
    first, _ = sequence.feed_argmax_ahead(3)
    real_forward = ahead.forward

    def interrupted(tokens, rows):
        real_forward(tokens, rows)
        raise KeyboardInterrupt

    ahead.forward = interrupted
    with pytest.raises(KeyboardInterrupt):
        sequence.feed_argmax_ahead(first)
    ahead.forward = real_forward
    assert ahead.cache == sequence.tokens and not sequence.reading_ahead
    sequence.feed([5], [0])  # in step: no "two sequences" error
    assert ahead.cache == sequence.tokens


def test_auto_reads_ahead_within_the_gate_s_plain_stretch_only_and_stays_lossless():
    """A draft that never agrees: started off by the gate for 12 steps (and off again after each
    retry), each plain stretch reads ahead except on its last step: the next one drafts, and no
    queued pass is thrown away. No queued pass is timed as a plain pass's cost."""
    plain = fake(False)
    expected = SpeculativeEngine(plain).run([1, 2, 3], GenerationParams(60, 0))
    target, draft = fake(True), fake(False, salt=2)
    engine = SpeculativeEngine(target, build_drafter("draft", draft, DrafterOptions()), method="auto")
    engine.policy.start_gate_off(12)
    observed = []
    real_observe = engine.policy.target_costs.observe

    def watch(n_tokens, seconds):
        observed.append(n_tokens)
        real_observe(n_tokens, seconds)

    engine.policy.target_costs.observe = watch
    result = engine.run([1, 2, 3], GenerationParams(60, 4, adaptive=True))
    assert list(result.token_ids) == list(expected.token_ids)
    assert target.ahead_passes >= 11 and target.ahead_dropped == 0
    assert result.stats.by_source["none"].steps >= 12 and result.stats.by_source["draft"].steps >= 1
    plain_steps = result.stats.by_source["none"].steps
    assert observed.count(1) <= plain_steps - target.ahead_passes  # queued passes are not timed


def test_a_fixed_draft_length_never_reads_ahead():
    target, draft = fake(True), fake(False, salt=2)
    engine = SpeculativeEngine(target, build_drafter("draft", draft, DrafterOptions()), method="draft")
    result = engine.run([1, 2, 3], GenerationParams(30, 3))
    expected = SpeculativeEngine(fake(False)).run([1, 2, 3], GenerationParams(30, 0))
    assert list(result.token_ids) == list(expected.token_ids) and target.ahead_passes == 0


def test_stream_finishes_with_the_cache_whole_after_reading_ahead():
    ahead = fake(True, eos=True)
    events = list(SpeculativeEngine(ahead).stream([1, 2, 3], GenerationParams(25, 0)))
    finished = events[-1]
    assert isinstance(finished, Finished)
    assert ahead.cache == [1, 2, 3, *finished.result.token_ids]


def test_steps_the_idle_lookup_skips_read_ahead_and_none_is_thrown_away():
    """Prompt lookup on a text that never repeats itself: after its empty asks it is asked every
    few steps (IdleBackoff), and the steps in between read ahead; a queued pass is never dropped,
    because the step before an ask queues none."""
    size = 200
    table = hashed_logits(size, salt=4, spread=3.0)
    plain = FakeBackend(table, size)
    prompt = list(range(0, 120, 7))
    expected = SpeculativeEngine(plain).run(prompt, GenerationParams(80, 0))
    target = FakeBackend(table, size, reads_ahead=True)
    engine = SpeculativeEngine(target, build_drafter("lookup", None, DrafterOptions()), method="lookup")
    result = engine.run(prompt, GenerationParams(80, 8, adaptive=True))
    assert list(result.token_ids) == list(expected.token_ids)
    assert target.ahead_passes >= 20 and target.ahead_dropped == 0


def test_a_head_drafter_s_plain_stretch_reads_ahead_and_its_retry_drafts_from_every_state():
    """Heads read the target's states: while the gate keeps them off, the plain steps read ahead
    with each state kept, so the retry drafts from the state just before it, and the output
    stays plain decoding's."""
    from fake_models import COPYING_VOCAB, copying_logits
    from heads_factory import oracle_heads, oracle_hidden

    table, hidden = copying_logits(salt=4), oracle_hidden(copying_logits(salt=4), COPYING_VOCAB)
    prompt = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    expected = SpeculativeEngine(FakeBackend(table, COPYING_VOCAB)).run(prompt, GenerationParams(40, 0))
    target = FakeBackend(table, COPYING_VOCAB, hidden_table=hidden, hidden_size=5 * COPYING_VOCAB, reads_ahead=True)
    drafter = build_drafter("medusa", None, DrafterOptions(heads=oracle_heads(COPYING_VOCAB)))
    asked = []  # at each ask: the state the heads read, and the target's own there
    propose = drafter.propose

    def watched(context, draft_len, *args):
        if draft_len:
            asked.append((drafter.target.hidden(len(context) - 2, len(context) - 1), hidden(tuple(context[:-1]))))
        return propose(context, draft_len, *args)

    drafter.propose = watched
    engine = SpeculativeEngine(target, drafter, method="auto")
    engine.policy.start_gate_off(12)
    result = engine.run(prompt, GenerationParams(40, 4, adaptive=True))
    assert list(result.token_ids) == list(expected.token_ids)
    assert target.ahead_passes >= 10 and target.ahead_dropped == 0
    assert result.stats.by_source["none"].steps >= 12 and result.stats.by_source["medusa"].drafted > 0
    assert asked and all(state is not None and np.allclose(state[0], own) for state, own in asked)
    sequence = sequence_for(target)
    assert sequence.hidden(0, len(sequence)) is not None  # no position's state went unkept


def test_where_plain_steps_read_ahead_every_step_is_timed_as_a_whole_cycle(monkeypatch):
    """A queued plain step's pass runs while the caller has the step before's tokens, so the gate
    times it from that step's yield; speculative steps are timed alike, the caller's time in both
    (timed from their own start, a slow caller made speculating look faster than plain decoding)."""
    from specrun.control.gate import SpeculationGate

    now = [0.0]

    def clock() -> float:  # each reading a millisecond on: the engine's own work
        now[0] += 0.001
        return now[0]

    target, draft = fake(True), fake(False, salt=2)
    engine = SpeculativeEngine(target, build_drafter("draft", draft, DrafterOptions()), method="auto", clock=clock)
    engine.policy.start_gate_off(6)
    recorded = []
    record = SpeculationGate.record

    def watched(gate, tokens, seconds, engaged, plain):
        recorded.append((engaged, seconds))
        record(gate, tokens, seconds, engaged, plain)

    monkeypatch.setattr(SpeculationGate, "record", watched)
    for _ in engine.stream([1, 2, 3], GenerationParams(30, 4, adaptive=True)):
        now[0] += 1.0  # the caller's time with each step's tokens
    assert target.ahead_passes > 0 and {engaged for engaged, _ in recorded} == {True, False}
    assert all(1.0 < seconds < 1.1 for _, seconds in recorded)  # every step: the caller's second and its own


# ---- rows shaped by their text: penalties and a bias, on the device that reads ahead ----------------
SHAPINGS = {
    "repeat, a window of 3": SamplingSettings(penalties=Penalties(repeat=1.6, last_n=3)),
    "frequency and presence, the whole text": SamplingSettings(penalties=Penalties(frequency=0.7, presence=0.4,
                                                                                   last_n=-1)),
    "a repeat below 1": SamplingSettings(penalties=Penalties(repeat=0.6, frequency=-0.2, last_n=64)),
    "a bias": SamplingSettings(logit_bias=((2, 2.5), (4, -math.inf))),
    "all of them": SamplingSettings(penalties=Penalties(repeat=1.3, frequency=0.2, presence=0.3, last_n=5),
                                    logit_bias=((6, 1.0), (0, -math.inf))),
}


@pytest.mark.parametrize("settings", SHAPINGS.values(), ids=SHAPINGS.keys())
def test_plain_steps_under_penalties_and_a_bias_read_ahead_with_plain_decoding_s_output(settings):
    """Each step's row and the row it queues (after an id the host has not read) are shaped by
    their own text: the output is that of steps that do not read ahead."""
    for prompt in prompts():
        plain, ahead = fake(False), fake(True)
        expected = SpeculativeEngine(plain).run(prompt, GenerationParams(40, 0, sampling=settings))
        result = SpeculativeEngine(ahead).run(prompt, GenerationParams(40, 0, sampling=settings))
        assert list(result.token_ids) == list(expected.token_ids)
        assert ahead.cache == plain.cache and ahead.ahead_passes == len(result.token_ids) - 2
        unshaped = SpeculativeEngine(fake(False)).run(prompt, GenerationParams(40, 0))
        assert list(unshaped.token_ids) != list(expected.token_ids)  # the settings change the text


def test_a_token_biased_twice_or_a_reasoning_budget_steps_without_reading_ahead():
    """A device adds a token's two amounts as one sum, which rounds otherwise than adding them in
    turn (penalties.AheadShaping.takes); a budget forces rows by their text on the host."""
    twice = SamplingSettings(logit_bias=((2, 0.1), (2, 0.2)))
    budget = SamplingSettings(reasoning_budget=ReasoningBudget(starts=((3,),), ends=((4,),), forced=(4,), budget=2))
    for settings in (twice, budget):
        plain, ahead = fake(False), fake(True)
        expected = SpeculativeEngine(plain).run([1, 2, 3], GenerationParams(20, 0, sampling=settings))
        result = SpeculativeEngine(ahead).run([1, 2, 3], GenerationParams(20, 0, sampling=settings))
        assert list(result.token_ids) == list(expected.token_ids) and ahead.ahead_passes == 0


def test_the_window_a_queued_row_counts_is_the_step_s_with_the_id_picked_in_and_one_pushed_out():
    rng = np.random.default_rng(3)
    for _ in range(300):
        last_n = int(rng.choice([-1, 1, 2, 5, 64]))
        penalties = Penalties(repeat=1.2, last_n=last_n)
        context = [int(t) for t in rng.integers(0, 6, int(rng.integers(1, 12)))]
        picked = int(rng.integers(0, 6))
        shaping = AheadShaping(penalties, (), context)
        counts = np.bincount(np.asarray(shaping.window, np.int64), minlength=6)
        counts[picked] += 1
        if shaping.leaving is not None:
            counts[shaping.leaving] -= 1
        after = AheadShaping(penalties, (), [*context, picked])
        assert np.array_equal(counts, np.bincount(np.asarray(after.window, np.int64), minlength=6)), (context, last_n)
