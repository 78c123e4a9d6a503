"""The windowed cache (backends/window.py) on the fake model: what it holds as the context grows,
after rewinds, and that a draft reading it leaves every output the target's own."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lossless_harness import greedy_scenario
from specrun.backends.fake import FakeBackend, FakeWindowCache
from specrun.backends.kv import sequence_for
from specrun.backends.window import WindowedBackend
from tests.fake_models import VOCAB, hashed_logits

SINKS, WINDOW, BLOCK = 2, 8, 3


def windowed(sinks: int = SINKS, window: int = WINDOW, block: int = BLOCK, n_ctx: int = 10_000):
    model = FakeBackend(hashed_logits(VOCAB, salt=3), VOCAB, n_ctx=n_ctx)
    backend = WindowedBackend(model, lambda cells: FakeWindowCache(model, cells), sinks, window, block=block)
    return backend, backend.cache


def context(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, VOCAB, n)]


def assert_consistent(backend: WindowedBackend, cache: FakeWindowCache) -> None:
    """The cache holds the sinks and a run ending at the context's last token, at positions
    0, 1, … in that order, and nothing else."""
    held = backend.held()
    length = backend.n_past
    assert held[: min(SINKS, length)] == list(range(min(SINKS, length)))
    run = held[min(SINKS, length):]
    assert run == list(range(length - len(run), length))  # a suffix of the context, unbroken
    assert [position for position, _ in cache.held] == list(range(len(held)))
    assert [token for _, token in cache.held] == backend.held_tokens()


@pytest.mark.parametrize("step", [1, 2, 5, 40])
def test_the_run_stays_between_window_and_window_plus_block(step):
    backend, cache = windowed()
    tokens = context(200)
    for start in range(0, len(tokens), step):
        backend.forward(tokens[start : start + step], [])
        assert_consistent(backend, cache)
        run = len(backend.held()) - SINKS
        if backend.n_past >= SINKS + WINDOW:
            assert WINDOW <= run <= WINDOW + BLOCK
    assert backend.tokens == tokens
    assert backend.moves >= 5  # the window moved on many times
    assert step > WINDOW + BLOCK or backend.shifts == backend.moves  # kept tokens moved down each time


def test_a_long_feed_reads_only_the_sinks_and_the_last_window():
    backend, cache = windowed()
    tokens = context(5000)
    logits = backend.forward(tokens, [len(tokens) - 1])
    assert cache.decoded_tokens == SINKS + WINDOW
    assert backend.held() == [0, 1, *range(5000 - WINDOW, 5000)]
    held = tuple(backend.held_tokens())
    np.testing.assert_array_equal(logits[0], backend.parent.table(held))  # the draft sees sinks + window


def test_logits_of_a_dropped_row_are_refused_and_nothing_changes():
    backend, cache = windowed()
    backend.forward(context(30), [])
    before = (list(backend.tokens), backend.held(), list(cache.held))
    with pytest.raises(ValueError, match="last 8 tokens"):
        backend.forward(context(40, seed=1), [5])
    assert (backend.tokens, backend.held(), cache.held) == before


def fresh_from(tokens: list[int]):
    backend, cache = windowed()
    backend.forward(tokens, [])
    return backend, cache


@pytest.mark.parametrize("n_keep", [0, 1, SINKS, SINKS + 3, 60, 95, 99])
def test_a_rewind_leaves_the_kept_tokens_only(n_keep):
    backend, cache = windowed()
    tokens = context(100)
    for token in tokens:  # one at a time, as drafting feeds them
        backend.forward([token], [0])
    backend.rewind(n_keep)
    assert backend.tokens == tokens[:n_keep]
    assert_consistent(backend, cache)
    fresh, fresh_cache = fresh_from(tokens[:n_keep])
    if n_keep < backend.run_start or n_keep <= SINKS + WINDOW + BLOCK:
        # into what was dropped (or nothing was): built again exactly as afresh
        assert cache.held == fresh_cache.held
    else:  # within the run: its tail dropped; the run the window kept, not a shorter one
        assert len(backend.held()) >= len(fresh.held()) - BLOCK


def test_a_rewind_into_dropped_tokens_rebuilds_the_run_as_afresh():
    backend, cache = windowed()
    tokens = context(100)
    backend.forward(tokens, [])
    backend.rewind(50)
    assert backend.rebuilds == 1
    fresh, fresh_cache = fresh_from(tokens[:50])
    assert cache.held == fresh_cache.held and backend.held() == fresh.held()
    # and it goes on as the fresh one does
    more = context(20, seed=2)
    np.testing.assert_array_equal(backend.forward(more, [19]), fresh.forward(more, [19]))
    assert cache.held == fresh_cache.held


def test_a_sequence_over_it_rewinds_and_repairs_like_any_backend():
    backend, cache = windowed()
    sequence = sequence_for(backend)
    tokens = context(80)
    sequence.sync(tokens)
    sequence.feed([1, 2, 3], [2])
    sequence.rewind_to_prefix_of(tokens + [1, 9])
    assert sequence.tokens == tokens + [1] and backend.tokens == sequence.tokens
    assert_consistent(backend, cache)


def test_a_feed_past_the_context_is_refused():
    backend, _ = windowed(n_ctx=50)
    backend.forward(context(45), [])
    with pytest.raises(Exception, match="context of 50 tokens is full"):
        backend.forward(context(6), [])
    assert backend.n_past == 45


def test_greedy_output_with_a_windowed_draft_equals_plain_decoding():
    """A draft that sees only its first token and its last three or four, on a target that
    repeats itself: outputs of 150 tokens equal plain decoding's, and the draft still helps."""
    problems, drafted, accepted = greedy_scenario("draft", draft_window=(1, 3, 1))
    assert problems == []
    assert accepted > 0 and drafted > accepted
    problems, drafted, accepted = greedy_scenario("auto", adaptive=True, draft_window=(1, 3, 1))
    assert problems == []
    assert accepted > 0


def test_the_sampled_scenarios_move_the_window_on():
    """The harness's window scenarios (tests/engine/test_acceptance.py) really draft from a moving
    window: over one sampled output it drops tokens and rewinds many times."""
    from lossless_harness import PROMPT, SCENARIOS, SETTINGS, WINDOW as OUTPUT, fake_engine
    from specrun.engine.loop import GenerationParams

    for name in ("draft window", "draft window top-p", "auto window"):
        scenario = SCENARIOS[name]
        engine = fake_engine(scenario)
        draft = next(member.backend for member in engine.drafter.members if hasattr(member, "backend"))
        assert isinstance(draft, WindowedBackend)
        sampling = dataclasses.replace(SETTINGS[scenario.setting], seed=1)
        engine.run(list(PROMPT), GenerationParams(OUTPUT, draft_len=scenario.draft_len, stop_at_eos=False,
                                                  sampling=sampling, adaptive=scenario.adaptive))
        assert draft.moves >= 5, name
