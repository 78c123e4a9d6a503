"""Engine behaviour on fake backends: greedy equality, rewinds, statistics, limits."""

from __future__ import annotations

import numpy as np
import pytest

from fake_models import hashed_logits
from specrun.backends.fake import FakeBackend
from specrun.drafters.draft_model import DraftModelDrafter
from specrun.engine.events import Finished, TextChunk
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.errors import ContextFullError, UsageError
from specrun.backends.kv import KVSequence, common_prefix_len
from specrun.sampling import SamplingSettings
from specrun.engine.stats import Stats

VOCAB = 50


def fake(salt: int, **kwargs) -> FakeBackend:
    return FakeBackend(hashed_logits(VOCAB, salt=salt, spread=2.0), VOCAB, **kwargs)


def mostly_agreeing(salt_target: int, salt_noise: int, noise: float):
    """A draft table: the target's logits plus noise, so it agrees often but not always."""
    target_table = hashed_logits(VOCAB, salt_target, spread=2.0)
    noise_table = hashed_logits(VOCAB, salt_noise, spread=noise)
    return lambda context: target_table(context) + noise_table(context)


def plain_run(target: FakeBackend, prompt, n: int) -> list[int]:
    return SpeculativeEngine(target).run(prompt, GenerationParams(max_new_tokens=n, draft_len=0)).token_ids


@pytest.mark.parametrize("draft_len", [1, 3, 4, 8])
def test_greedy_speculation_equals_plain_decoding(draft_len):
    prompt = [1, 2, 3]
    expected = plain_run(fake(1), prompt, 200)
    draft = FakeBackend(mostly_agreeing(1, 7, noise=1.5), VOCAB)
    result = SpeculativeEngine(fake(1), DraftModelDrafter(draft)).run(
        prompt, GenerationParams(max_new_tokens=200, draft_len=draft_len)
    )
    assert result.token_ids == expected
    assert 0.0 < result.stats.acceptance_rate < 1.0  # the test exercises both accepts and rejections


def test_draft_equal_to_target_accepts_everything():
    """The 'every draft accepted' case: the drafter never fed its last draft; it must catch up."""
    target, draft = fake(3), fake(3)
    result = SpeculativeEngine(target, DraftModelDrafter(draft)).run(
        [5], GenerationParams(max_new_tokens=101, draft_len=4)
    )
    assert result.token_ids == plain_run(fake(3), [5], 101)
    assert result.stats.acceptance_rate == 1.0
    # 20 steps accept all 4 drafts (+1 bonus each); the 101st token comes from a plain step.
    assert result.stats.accepted_hist == [1, 0, 0, 0, 20]
    assert result.stats.mean_tokens_per_step == pytest.approx(101 / 21)


def test_caches_hold_exactly_prompt_plus_output_after_a_long_run():
    prompt = [1, 2, 3, 4]
    target = fake(5)
    draft = FakeBackend(mostly_agreeing(5, 9, noise=2.0), VOCAB)
    engine = SpeculativeEngine(target, DraftModelDrafter(draft))
    result = engine.run(prompt, GenerationParams(max_new_tokens=1200, draft_len=5))
    full = prompt + result.token_ids
    forwarded_before = target.forwarded_tokens
    assert len(result.token_ids) == 1200
    assert target.cache == full
    assert draft.cache == full
    # Continuing with plain decoding from the kept cache equals a fresh plain run.
    continued = engine.run(full, GenerationParams(max_new_tokens=40, draft_len=0))
    # Nothing re-prefilled: 40 one-token passes plus feeding the final token to complete the cache.
    assert target.forwarded_tokens - forwarded_before == 41
    assert continued.token_ids == plain_run(fake(5), full, 40)


def test_interrupted_stream_leaves_no_rejected_drafts_in_the_cache():
    prompt = [1, 2]
    target = fake(11)
    draft = FakeBackend(mostly_agreeing(11, 4, noise=3.0), VOCAB)
    engine = SpeculativeEngine(target, DraftModelDrafter(draft))
    stream = engine.stream(prompt, GenerationParams(max_new_tokens=500, draft_len=6))
    emitted: list[int] = []
    for event in stream:
        emitted.extend(event.token_ids)
        if len(emitted) > 37:
            break
    stream.close()  # what Ctrl-C does to a generator in flight
    context = prompt + emitted
    assert target.cache == context[: len(target.cache)]
    assert len(target.cache) == len(context) - 1
    # The next turn reuses the cache and equals a fresh run.
    again = engine.run(context, GenerationParams(max_new_tokens=30, draft_len=6))
    assert again.token_ids == plain_run(fake(11), context, 30)


def test_stops_at_eos_and_truncates_at_max_tokens():
    table = hashed_logits(VOCAB, salt=2, spread=2.0)

    def with_eos(context):
        logits = table(context).copy()
        if len(context) == 9:
            logits[0] = 100.0  # token 0 is EOS at the 9th position
        return logits

    target = FakeBackend(with_eos, VOCAB, eos_ids=[0])
    draft = FakeBackend(with_eos, VOCAB, eos_ids=[0])
    result = SpeculativeEngine(target, DraftModelDrafter(draft)).run([3, 4], GenerationParams(50, 4))
    assert result.finish_reason == "eos"
    assert result.token_ids[-1] == 0 and len(result.token_ids) == 8

    result = SpeculativeEngine(fake(2), DraftModelDrafter(fake(2))).run([3, 4], GenerationParams(10, 4))
    assert result.finish_reason == "length" and len(result.token_ids) == 10


def test_context_limits():
    with pytest.raises(ContextFullError, match="prompt has 20 tokens"):
        SpeculativeEngine(fake(1, n_ctx=20)).run(list(range(20)), GenerationParams(5, 0))
    with pytest.raises(UsageError):
        SpeculativeEngine(fake(1)).run([], GenerationParams(5, 0))
    # A generation that reaches the end of the context stops there, cleanly.
    target, draft = fake(1, n_ctx=30), fake(1, n_ctx=30)
    result = SpeculativeEngine(target, DraftModelDrafter(draft)).run(list(range(10)), GenerationParams(100, 4))
    assert result.finish_reason == "context"
    assert len(result.token_ids) == 20
    assert target.cache == list(range(10)) + result.token_ids


def test_stream_events_mark_drafted_tokens_and_carry_statistics():
    target, draft = fake(8), FakeBackend(mostly_agreeing(8, 3, noise=1.0), VOCAB)
    events = list(SpeculativeEngine(target, DraftModelDrafter(draft)).stream([1], GenerationParams(60, 3)))
    chunks = [e for e in events if isinstance(e, TextChunk)]
    finished = events[-1]
    assert isinstance(finished, Finished)
    stats = finished.result.stats
    assert sum(len(c.token_ids) for c in chunks) == stats.new_tokens == 60
    assert sum(sum(c.from_draft) for c in chunks) == stats.accepted
    assert sum(stats.accepted_hist) == stats.steps
    assert sum(n * count for n, count in enumerate(stats.accepted_hist)) == stats.accepted
    assert stats.mean_tokens_per_step == pytest.approx(60 / stats.steps)
    assert stats.generation_seconds >= stats.draft_seconds + stats.verify_seconds * 0.99
    # every step is put down to the drafter that proposed it, or to none
    assert sum(c.steps for c in stats.by_source.values()) == stats.steps
    assert stats.by_source["draft"].accepted == stats.accepted
    assert stats.to_dict()["by_source"]["draft"]["drafted"] == stats.drafted


def test_statistics_of_a_chain_say_which_drafter_drafted():
    from specrun.drafters.chain import ChainDrafter
    from specrun.drafters.lookup import PromptLookupDrafter

    random_text = hashed_logits(VOCAB, salt=8, spread=2.0)

    def cycle_then_random(context):
        """The prompt's cycle 1..8 goes on for 8 tokens (lookup copies it), then random text."""
        if len(context) >= 32:
            return random_text(context)
        logits = np.zeros(VOCAB, dtype=np.float32)
        logits[context[-1] % 8 + 1] = 5.0
        return logits

    target = FakeBackend(cycle_then_random, VOCAB)
    draft = FakeBackend(lambda context: cycle_then_random(context) + random_text((3, *context)), VOCAB)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 3  # lookup finds this repeated
    chain = ChainDrafter([PromptLookupDrafter(), DraftModelDrafter(draft)])
    first = SpeculativeEngine(target, chain, method="lookup+draft").run(prompt, GenerationParams(40, 4))
    stats = first.stats
    # none: the first token (from the prefill) and the plain steps while the draft is gated off
    assert {"lookup", "draft", "none"} <= set(stats.by_source)
    assert sum(c.drafted for c in stats.by_source.values()) == stats.drafted
    assert "steps by drafter: " in stats.summary() and "lookup " in stats.summary()
    total = Stats()
    total.add(stats)
    total.add(stats)
    assert total.by_source["lookup"].steps == 2 * stats.by_source["lookup"].steps
    assert (total.steps, total.new_tokens, total.accepted_hist) == (
        2 * stats.steps, 80, [2 * n for n in stats.accepted_hist]
    )


def spied_forward_calls(target: FakeBackend) -> list[tuple[int, list[int]]]:
    """Record (tokens fed, logit rows asked for) of every forward the target runs."""
    calls = []
    original = target.forward

    def spy(tokens, rows):
        calls.append((len(tokens), list(rows)))
        return original(tokens, rows)

    target.forward = spy
    target.forward_argmax = lambda tokens, rows: spy(tokens, rows).argmax(axis=-1)
    return calls


def test_target_sees_logit_requests_only_for_verified_rows():
    target = fake(4)
    calls = spied_forward_calls(target)
    SpeculativeEngine(target, DraftModelDrafter(fake(4))).run(list(range(30)), GenerationParams(20, 4))
    prefill = calls[0]
    assert prefill == (30, [29])  # the whole prompt, logits only for the first token
    *verify_passes, completion = calls[1:]
    assert verify_passes[0] == (5, [0, 1, 2, 3, 4])  # the first token and the first 4 drafts
    for n_tokens, rows in verify_passes:
        assert rows == list(range(n_tokens)) and n_tokens <= 5
    assert completion == (1, [])  # the last token fed so the cache holds prompt + output


def test_plain_decoding_takes_its_first_token_from_the_prefill_pass():
    """As llama.cpp does: the same batch as a plain run of llama-cpp-python, token for token."""
    target = fake(4)
    calls = spied_forward_calls(target)
    SpeculativeEngine(target).run(list(range(30)), GenerationParams(3, 4))
    assert calls == [(30, [29]), (1, [0]), (1, [0]), (1, [])]


def test_a_drafter_with_nothing_to_propose_costs_what_plain_decoding_costs():
    """A lookup that finds nothing in the prompt runs exactly plain decoding's passes."""
    from specrun.drafters.lookup import PromptLookupDrafter

    target = fake(4)
    calls = spied_forward_calls(target)
    result = SpeculativeEngine(target, PromptLookupDrafter()).run(list(range(30)), GenerationParams(3, 4))
    assert calls == [(30, [29]), (1, [0]), (1, [0]), (1, [])]  # as plain decoding's
    assert result.token_ids == plain_run(fake(4), list(range(30)), 3)


def test_a_step_s_bookkeeping_after_the_pass_is_timed_as_neither_drafting_nor_verifying():
    """Stats.verify_seconds is the target's passes: the controllers' and the gate's work after
    each pass shows as the rest of the generation time (what a no-match benchmark reads)."""
    from specrun.drafters.lookup import PromptLookupDrafter

    class FindsNothing(PromptLookupDrafter):
        def _match(self):
            return None

    now = [0.0]

    class TimedFake(FakeBackend):
        def forward(self, tokens, logit_rows):
            now[0] += 1.0  # a pass: one simulated second
            return super().forward(tokens, logit_rows)

    engine = SpeculativeEngine(TimedFake(hashed_logits(VOCAB, 4, 2.0), VOCAB), FindsNothing(), clock=lambda: now[0])
    observe = engine.policy.observe

    def slow_observe(report):
        now[0] += 0.25  # after every pass but the prefill's
        observe(report)

    engine.policy.observe = slow_observe
    stats = engine.run(list(range(30)), GenerationParams(12, 4, adaptive=True)).stats
    assert stats.drafted == 0 and stats.steps == 12  # nothing found: plain passes only
    assert stats.verify_seconds == pytest.approx(11.0)  # the first token comes from the prefill
    assert stats.draft_seconds == pytest.approx(0.0)
    assert stats.generation_seconds - stats.draft_seconds - stats.verify_seconds == pytest.approx(11 * 0.25)


def test_with_a_perfect_draft_the_first_token_comes_from_the_prefill_then_k_plus_1_a_pass():
    """The prompt's last token rides in the prefill's batch and yields the first token;
    drafting starts from it, so 11 tokens take the prefill and two verify passes (feeding
    the last prompt token with drafts for the first token instead would yield 10)."""
    target = fake(5)
    calls = spied_forward_calls(target)
    result = SpeculativeEngine(target, DraftModelDrafter(fake(5))).run([7, 8, 9], GenerationParams(11, 4))
    assert result.token_ids == plain_run(fake(5), [7, 8, 9], 11)
    assert result.stats.steps == 3  # 1 (the prefill's) + 5 + 5 tokens
    assert [n for n, _ in calls] == [3, 5, 5, 1]


def test_sampled_generation_is_reproducible_with_a_seed():
    """The same seed gives the same tokens, another seed others, and neither is the greedy
    output (a seed test that would pass with the temperature ignored proves nothing)."""

    def tokens(temperature: float, seed: int | None) -> list[int]:
        params = GenerationParams(40, 3, SamplingSettings(temperature=temperature, seed=seed))
        drafter = DraftModelDrafter(FakeBackend(mostly_agreeing(6, 2, 1.0), VOCAB))
        return SpeculativeEngine(fake(6), drafter).run([1, 2], params).token_ids

    assert tokens(0.8, 42) == tokens(0.8, 42)
    assert tokens(0.8, 42) != tokens(0.8, 43)
    assert tokens(0.8, 42) != tokens(0.0, None) == plain_run(fake(6), [1, 2], 40)


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([1, 2, 3], [1, 9, 3]) == 1
    long_a = list(range(10_000))
    long_b = long_a[:7_777] + [-1] + long_a[7_778:]
    assert common_prefix_len(long_a, long_b) == 7_777
    assert common_prefix_len(np.arange(5).tolist(), [0, 1, 2, 3, 4]) == 5


def test_engines_sharing_a_backend_share_its_cache_view():
    target, draft = fake(1), fake(1)
    plain = SpeculativeEngine(target)
    spec = SpeculativeEngine(target, DraftModelDrafter(draft))
    other_drafter = DraftModelDrafter(draft)
    assert plain.target is spec.target and other_drafter.sequence is spec.drafter.sequence
    first = plain.run([1, 2, 3], GenerationParams(20, 0)).token_ids
    assert spec.run([1, 2, 3], GenerationParams(20, 4)).token_ids == first
    assert plain.run([1, 2, 3], GenerationParams(20, 0)).token_ids == first


def test_a_second_sequence_on_one_backend_is_caught():
    target = fake(1)
    first = KVSequence(target)
    first.feed([1, 2, 3])
    second = KVSequence(target)  # adopts the backend: its unknown cache is dropped
    second.feed([4, 5])
    with pytest.raises(RuntimeError, match="two sequences are driving one backend"):
        first.rewind(1)


def test_an_interrupted_forward_leaves_the_sequence_in_step():
    target = fake(1)
    sequence = KVSequence(target)
    sequence.feed([1, 2, 3])
    original = target.forward

    def interrupted(tokens, rows):
        original(tokens, rows)  # the backend has appended …
        raise KeyboardInterrupt  # … but Ctrl-C arrives before the sequence records it

    target.forward = interrupted
    with pytest.raises(KeyboardInterrupt):
        sequence.feed([4, 5])
    target.forward = original
    assert sequence.tokens == [1, 2, 3] and target.cache == [1, 2, 3]
    sequence.feed([6])
    assert target.cache == [1, 2, 3, 6]


class PaddedFake(FakeBackend):
    """A fake whose ids from ``real`` on are embedding padding, like Qwen2.5's GGUFs."""

    def __init__(self, table, size: int, real: int) -> None:
        super().__init__(table, size)
        self.real = real

    def token_text(self, token: int) -> str:
        return f"[PAD{token}]" if token >= self.real else f"<{token}>"


@pytest.mark.parametrize(("target_size", "draft_size"), [(52, 50), (50, 52)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_vocabularies_that_differ_only_by_padding_speculate(target_size, draft_size, temperature):
    from specrun.registry.compat import check_compatible

    def table_for(size, salt):
        base = hashed_logits(VOCAB, salt=salt, spread=2.0)
        return lambda context: np.concatenate([base(context), np.full(size - VOCAB, 50.0 if size > VOCAB else 0.0)])

    # The padding rows get huge logits in the draft: they must never be proposed.
    target = PaddedFake(table_for(target_size, 1), target_size, real=VOCAB)
    draft = PaddedFake(table_for(draft_size, 1), draft_size, real=VOCAB)
    check_compatible(target, draft, "t", "d")
    params = GenerationParams(60, 4, SamplingSettings(temperature=temperature, seed=3))
    result = SpeculativeEngine(target, DraftModelDrafter(draft)).run([1, 2], params)
    assert all(token < target_size for token in result.token_ids)
    if temperature == 0.0 and draft_size > target_size:
        assert result.token_ids == plain_run(fake(1), [1, 2], 60)


def test_a_real_size_difference_is_still_refused():
    from specrun.registry.compat import check_compatible
    from specrun.errors import IncompatibleModelsError

    with pytest.raises(IncompatibleModelsError, match="vocabulary size 50 vs 52"):
        check_compatible(fake(1), FakeBackend(hashed_logits(52, 1), 52), "t", "d")


# ---- near-ties: greedy choices that batched rounding could flip ----------------------------
def tied_every_third(context) -> np.ndarray:
    """Next token last + 1; its runner-up last + 2 is 0.01 behind after a multiple of 3, else 2.0."""
    last = context[-1]
    logits = np.zeros(VOCAB, dtype=np.float32)
    logits[(last + 1) % VOCAB] = 5.0
    logits[(last + 2) % VOCAB] = 5.0 - (0.01 if last % 3 == 0 else 2.0)
    return logits


def ties_in(prompt: list[int], output: list[int], first: int = 0) -> int:
    """How many of ``output``'s tokens from index ``first`` on were chosen at a tied_every_third tie."""
    contexts = [[*prompt, *output][: len(prompt) + i] for i in range(first, len(output))]
    return sum(context[-1] % 3 == 0 for context in contexts)


@pytest.mark.parametrize(("margin", "counted"), [(0.05, True), (0.005, False), (0.0, False)])
def test_near_ties_count_the_tokens_chosen_within_the_margin(margin, counted):
    """Every emitted token whose context ends in a multiple of 3 was chosen 0.01 ahead of the
    runner-up: counted at a margin of 0.05, not at 0.005 or 0 (not watched), once verify
    passes of several rows have written the cache (from the first drafting step on)."""
    target = FakeBackend(tied_every_third, VOCAB)
    drafter = DraftModelDrafter(FakeBackend(tied_every_third, VOCAB))
    prompt = [1, 2]
    result = SpeculativeEngine(target, drafter).run(prompt, GenerationParams(30, 4, tie_margin=margin))
    expected = ties_in(prompt, result.token_ids, first=1)  # the prefill's token is plain decoding's own
    assert expected > 5 and result.stats.near_ties == (expected if counted else 0)
    assert result.stats.accepted > 0  # tokens came from verify passes of several rows


def test_near_ties_are_watched_from_the_first_pass_of_several_tokens():
    """Before any pass of several tokens every pass is plain decoding's own, and nothing can part
    from it: a text decoded plainly counts no near-ties; a text that begins on a cache earlier
    passes wrote (a chat's next turn) counts them from its prefill on."""
    params = GenerationParams(30, 0, tie_margin=0.05)
    engine = SpeculativeEngine(FakeBackend(tied_every_third, VOCAB))
    prompt = [1, 2]
    first = engine.run(prompt, params)  # complete_cache: the cache holds prompt and answer
    assert ties_in(prompt, first.token_ids) > 5 and first.stats.near_ties == 0
    follow_up = [*prompt, *first.token_ids, 4, 5]
    second = engine.run(follow_up, params)
    assert second.stats.near_ties == ties_in(follow_up, second.token_ids) > 5


def test_near_ties_are_watched_from_the_first_pass_shared_with_other_sequences():
    """A server's slot decoding plainly: its passes carry other slots' sequences, whose batch
    shape moves the rounding (a lone plain run may choose otherwise at a near-tie), so near-ties
    are counted from the first shared pass; alone, the same plain text counts none."""
    params = GenerationParams(30, 0, tie_margin=0.05)
    prompt = [1, 2]
    alone = SpeculativeEngine(FakeBackend(tied_every_third, VOCAB)).run(prompt, params)
    assert alone.stats.near_ties == 0 and ties_in(prompt, alone.token_ids) > 5
    shared = FakeBackend(tied_every_third, VOCAB)
    shared.others_in_pass = 2  # as a slot's backend says of its last pass
    beside = SpeculativeEngine(shared).run(prompt, params)
    assert beside.token_ids == alone.token_ids
    assert beside.stats.near_ties == ties_in(prompt, beside.token_ids) > 5


def test_near_ties_are_not_counted_when_sampling():
    target = FakeBackend(tied_every_third, VOCAB)
    params = GenerationParams(20, 4, SamplingSettings(temperature=0.7, seed=1), tie_margin=0.05)
    result = SpeculativeEngine(target, DraftModelDrafter(FakeBackend(tied_every_third, VOCAB))).run([1, 2], params)
    assert result.stats.near_ties == 0
