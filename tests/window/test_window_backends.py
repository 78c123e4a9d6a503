"""A windowed draft cache on both real backends (backends/llama_window.py, backends/mlx_window.py):
SmolLM2 drafting for itself (MagicDec's set-up) and its Q4_1 file drafting with a window on
llama.cpp; on MLX the demo pair, whose tokens cost a twelfth of SmolLM2's there (the window's
code is the same whatever the weights: mlx-lm's caches and RoPE modules), across contexts several
windows long.
The target verifies with its full cache, so greedy output is plain decoding's; keys moved down as
the window moves on still mean what they meant."""

from __future__ import annotations

import numpy as np
import pytest

from specrun.backends.kv import sequence_for
from specrun.drafters.draft_model import DraftModelDrafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine

EXACT = dict(kv_type="f32", flash_attn=False)  # greedy speculation bit-identical to plain decoding
SINKS, WINDOW = 4, 32
TEXT = ("The Roman Empire was the post-Republican state of ancient Rome. It is generally understood to mean "
        "the period and territory ruled by the Romans following Octavian's assumption of sole rule under the "
        "Principate in 27 BC. It included territories in Europe, North Africa, and Western Asia, and was ruled "
        "by emperors. The fall of the Western Roman Empire in AD 476 conventionally marks the end of classical "
        "antiquity and the beginning of the Middle Ages. Summarise the text above in three sentences:")


def cache_positions(windowed) -> tuple[int, int]:
    lib, memory = windowed.cache._lib, windowed.cache._memory
    return lib.llama_memory_seq_pos_min(memory, 0), lib.llama_memory_seq_pos_max(memory, 0)


@pytest.fixture(scope="module")
def llama_pair(smollm2):
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from specrun.backends.llama import LlamaCppBackend

    target = LlamaCppBackend(smollm2["smollm2-135m-f16"], n_ctx=1024, n_threads=1, **EXACT)
    draft = LlamaCppBackend(smollm2["smollm2-135m"], n_ctx=1024, n_threads=1, **EXACT)
    yield target, draft
    draft.close()
    target.close()


@pytest.fixture(scope="module")
def mlx_demo_pair():
    """The demo pair on MLX (float32 copies): a target token ~12 ms here against SmolLM2's 147 ms."""
    pytest.importorskip("mlx_lm", reason="the mlx backend is not installed")
    from specrun.backends.mlx import MlxBackend
    from specrun.modelkit.demo import demo_mlx_dir

    target = MlxBackend(demo_mlx_dir("demo-target"), n_ctx=1024)
    draft = MlxBackend(demo_mlx_dir("demo-draft"), n_ctx=1024)
    yield target, draft
    draft.close()
    target.close()


# SmolLM2 (the F16 file) and its Q4_1 draft on llama.cpp, and the demo pair on MLX, where each
# case would spend most of a minute on SmolLM2 (a float32 token 147 ms, a 4-bit draft token 171 ms).
PAIRS = {"llama": "llama_pair", "mlx-demo": "mlx_demo_pair"}


@pytest.fixture
def pair(request):
    return request.getfixturevalue(PAIRS[request.param])


@pytest.fixture(scope="module")
def plain_answer():
    """Plain decoding's 64 tokens after a prompt on a target, decoded once per target and prompt
    for the module (its tests share their prompt), as a function of both."""
    answers: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    targets = []  # held, so no id is reused while the module runs

    def answer(target, prompt: list[int]) -> list[int]:
        key = (id(target), tuple(prompt))
        if key not in answers:
            targets.append(target)
            params = GenerationParams(64, draft_len=0, stop_at_eos=False)
            answers[key] = SpeculativeEngine(target).run(prompt, params).token_ids
            sequence_for(target).reset()
        return answers[key]

    return answer


@pytest.mark.parametrize(("pair", "who"), [("llama", "self"), ("llama", "draft model"), ("mlx-demo", "self"),
                                           ("mlx-demo", "draft model")], indirect=["pair"])
def test_greedy_output_with_a_windowed_draft_equals_plain_decoding(pair, who, plain_answer):
    """Windows of 32: the window moves on over the prompt and again over the answer (which copies
    the prompt's first sentences, beyond the window), and the answer is plain decoding's."""
    target, draft_model = pair
    model = target if who == "self" else draft_model
    windowed = model.open_window(SINKS, WINDOW)
    prompt = target.tokenize(TEXT)
    assert len(prompt) > 3 * WINDOW  # the window moves on over the prompt and again over the answer
    params = GenerationParams(64, draft_len=4, stop_at_eos=False)
    plain = plain_answer(target, prompt)
    try:
        result = SpeculativeEngine(target, DraftModelDrafter(windowed), method="draft").run(prompt, params)
        assert result.token_ids == plain
        assert result.stats.accepted > 0
        assert windowed.moves >= 3 and windowed.shifts >= 3
    finally:
        windowed.close()
        sequence_for(target).reset()


def test_moved_keys_draft_as_well_as_unmoved_ones(llama_pair):
    """The target drafting for itself through a window of 128 that moves on three times (keys
    re-rotated each time) is right about as often as through one that never moves: llama.cpp's
    context shift keeps what the moved keys mean. (A window of 32 is right 22% of the time here,
    without sinks 9%: the answer copies text the window no longer holds.) On MLX the rotation
    itself is checked below."""
    target, _ = llama_pair
    prompt = target.tokenize(TEXT)
    params = GenerationParams(96, draft_len=4, stop_at_eos=False)
    rates = {}
    for window in (128, 512):
        windowed = target.open_window(SINKS, window)
        try:
            stats = SpeculativeEngine(target, DraftModelDrafter(windowed), method="draft").run(prompt, params).stats
            rates[window] = stats.accepted / stats.drafted
            assert (windowed.shifts >= 3) == (window == 128)
        finally:
            windowed.close()
            sequence_for(target).reset()
    assert rates[512] > 0.95 and rates[128] > 0.9


def test_moving_keys_composes_rotations_on_mlx():
    """mlx_window moves a key from position p to p + delta by rotating it delta more: the key a
    RoPE module gives at p + delta, for every delta sign, and back again."""
    mx = pytest.importorskip("mlx.core")
    import mlx.nn as nn

    from specrun.backends.mlx_common import RowRope

    rope = nn.RoPE(64, base=10000.0)
    x = mx.random.normal((1, 3, 7, 64), key=mx.random.key(0))  # (1, heads, rows, dims)
    at_40 = rope(x, offset=40)
    for delta in (-33, 5):
        moved = RowRope(rope, mx.full((7,), delta, dtype=mx.int32))(at_40)
        np.testing.assert_allclose(np.array(moved), np.array(rope(x, offset=40 + delta)), atol=1e-4)


@pytest.mark.parametrize("pair", ["llama", "mlx-demo"], indirect=True)
def test_the_cache_holds_sinks_and_run_at_consecutive_positions_through_rewinds(pair):
    """Drafting a token at a time, a rewind within the run and one into what was dropped: the
    cache holds the sinks and the run at consecutive positions (llama.cpp's cells, MLX's offset),
    and after the rebuild reads as a cache built afresh from the kept tokens."""
    target, _ = pair

    def consecutive(windowed) -> bool:
        if target.name == "llama":
            return cache_positions(windowed) == (0, len(windowed.held()) - 1)
        return windowed.cache.held == len(windowed.held())

    windowed = target.open_window(SINKS, WINDOW)
    try:
        tokens = target.tokenize(TEXT)
        windowed.forward(tokens[:10], [])
        for token in tokens[10:]:
            windowed.forward([token], [0])
            assert consecutive(windowed)
        windowed.rewind(len(tokens) - 3)  # a rejected draft: within the run
        assert consecutive(windowed)
        assert windowed.held_tokens() == [*tokens[:SINKS], *tokens[windowed.run_start : len(tokens) - 3]]
        assert windowed.run_start > 45
        windowed.rewind(45)  # into what was dropped: rebuilt from the kept tokens
        assert windowed.rebuilds == 1
        assert consecutive(windowed)
        rebuilt = windowed.forward(tokens[45:47], [1])[0]
        fresh = target.open_window(SINKS, WINDOW)
        try:
            afresh = fresh.forward(tokens[:47], [46])[0]
            assert fresh.held() == windowed.held() and fresh.held_tokens() == windowed.held_tokens()
        finally:
            fresh.close()
        # what a cache built afresh from the kept tokens gives, up to how batched passes round
        assert int(rebuilt.argmax()) == int(afresh.argmax())
        np.testing.assert_allclose(rebuilt, afresh, atol=0.05)
    finally:
        windowed.close()


@pytest.mark.parametrize("pair", ["llama", "mlx-demo"], indirect=True)
def test_auto_holding_a_window_beside_the_full_cache_answers_as_plain_decoding(pair, plain_answer):
    """auto with the Q4_1 draft's window of 32 held beside its full cache (DrafterOptions.draft_window)
    on a prompt several windows long: the window drafts (first, untimed), and the answer is plain
    decoding's on both backends (on MLX, the demo pair)."""
    from specrun.drafters.draft_model import WINDOW_NAME
    from specrun.drafters.methods import DrafterOptions, build_drafter

    target, draft_model = pair
    prompt = target.tokenize(TEXT)
    view = draft_model.open_window(SINKS, WINDOW)
    drafter = build_drafter("auto", draft_model, DrafterOptions(draft_window=view))
    for member in drafter.members:  # it engages past the window, not from ENGAGE_SPANS of it: a
        if member.name == WINDOW_NAME:  # prompt this short is what keeps the test quick
            member.engages_from = member.alike_below + 1
    plain = plain_answer(target, prompt)
    try:
        result = SpeculativeEngine(target, drafter, method="auto").run(
            prompt, GenerationParams(64, draft_len=8, stop_at_eos=False, adaptive=True))
        assert result.token_ids == plain
        assert any(WINDOW_NAME in source.split("+") for source in result.stats.by_source)
    finally:
        drafter.close()
        sequence_for(target).reset()
        sequence_for(draft_model).reset()
    assert view.cache is None  # closed with the drafter
