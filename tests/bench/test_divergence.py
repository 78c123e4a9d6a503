"""Locating where an output leaves plain decoding's, and judging the gap there (fake backend)."""

from __future__ import annotations

import numpy as np
import pytest

from specrun.backends.fake import FakeBackend
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.sessions.divergence import END_OF_OUTPUT, NEAR_TIE, difference_line, find_mismatch

VOCAB = 8
PROMPT = [0, 1]
TIE_AT = 3  # the output position where the target's top two nearly tie
TIE_GAP = 5e-4  # below NEAR_TIE
CLEAR = 5.0


def counting_table(context: tuple[int, ...]) -> np.ndarray:
    """The next token is the last one plus one (logit 5, the rest 0); at output position
    TIE_AT the one after that scores TIE_GAP less."""
    logits = np.zeros(VOCAB, np.float32)
    logits[(context[-1] + 1) % VOCAB] = CLEAR
    if len(context) == len(PROMPT) + TIE_AT:
        logits[(context[-1] + 2) % VOCAB] = CLEAR - TIE_GAP
    return logits


@pytest.fixture
def target() -> FakeBackend:
    return FakeBackend(counting_table, VOCAB)


@pytest.fixture
def plain(target) -> list[int]:
    ids = SpeculativeEngine(target).run(PROMPT, GenerationParams(8, 0)).token_ids
    assert ids == [2, 3, 4, 5, 6, 7, 0, 1]
    return ids


def test_the_runner_up_at_a_near_tie_is_a_near_tie(target, plain):
    other = plain[:TIE_AT] + [6, 7, 0, 1, 2]  # the runner-up, then counting on from it
    mismatch = find_mismatch(target, 4, PROMPT, plain, other)
    assert (mismatch.prompt_index, mismatch.position) == (4, TIE_AT)
    assert (mismatch.plain_token, mismatch.other_token) == (5, 6)
    assert (mismatch.plain_text, mismatch.other_text) == ("\x05", "\x06")
    assert mismatch.token_gap == pytest.approx(TIE_GAP, rel=1e-3)
    assert mismatch.top2_gap == pytest.approx(TIE_GAP, rel=1e-3)
    assert mismatch.batch_rounding == 0.0  # a fake's logits do not depend on batching
    assert mismatch.near_tie and not mismatch.is_defect()
    assert mismatch.verdict() == "near-tie"
    assert mismatch.verdict(exact=True) == "DEFECT"  # --exact promised identical output


def test_under_exact_a_difference_within_measured_batch_rounding_is_no_defect():
    """--exact promises bit-identity where the kernels keep it; where reading the context in a
    batch was measured to move the logits (an AVX2-only CPU), rounding is weighed as without it."""
    from specrun.sessions.divergence import Mismatch

    rounded = Mismatch(0, 3, top2_gap=0.02, batch_rounding=0.015, plain_token=5, other_token=6, token_gap=0.02)
    assert not rounded.near_tie and rounded.within_rounding
    assert not rounded.is_defect(exact=True) and rounded.verdict(exact=True) == "near-tie"
    assert difference_line("draft", "code-1", rounded, exact=True).endswith(
        ": near-tie (--exact cannot hold here: this machine's batched kernels round otherwise)")
    beyond = Mismatch(0, 3, top2_gap=0.05, batch_rounding=0.015, plain_token=5, other_token=6, token_gap=0.05)
    assert beyond.is_defect(exact=True) and beyond.is_defect()


def test_a_token_far_below_the_top_is_a_defect_even_where_the_top_two_tie(target, plain):
    other = plain[:TIE_AT] + [1]  # not the runner-up: the tie between 5 and 6 does not excuse it
    mismatch = find_mismatch(target, 0, PROMPT, plain, other)
    assert mismatch.position == TIE_AT and mismatch.other_token == 1
    assert mismatch.top2_gap < NEAR_TIE
    assert mismatch.token_gap == pytest.approx(CLEAR)
    assert mismatch.is_defect() and mismatch.verdict() == "DEFECT"


def test_a_difference_where_the_target_had_a_clear_choice_is_a_defect(target, plain):
    other = plain[:1] + [7, 0, 1]
    mismatch = find_mismatch(target, 0, PROMPT, plain, other)
    assert (mismatch.position, mismatch.plain_token, mismatch.other_token) == (1, 3, 7)
    assert mismatch.top2_gap == pytest.approx(CLEAR) and mismatch.token_gap == pytest.approx(CLEAR)
    assert mismatch.verdict() == "DEFECT"


def test_a_difference_at_the_first_token_is_measured_after_the_prompt(target, plain):
    mismatch = find_mismatch(target, 0, PROMPT, plain, [4, 5])
    assert (mismatch.position, mismatch.plain_token, mismatch.other_token) == (0, 2, 4)
    assert mismatch.token_gap == pytest.approx(CLEAR)


def test_an_output_that_ends_early_is_judged_on_the_top_two(target, plain):
    mismatch = find_mismatch(target, 0, PROMPT, plain, plain[:TIE_AT])
    assert mismatch.position == TIE_AT
    assert (mismatch.plain_token, mismatch.other_token) == (5, None)
    assert mismatch.other_text == END_OF_OUTPUT and mismatch.token_gap is None
    assert mismatch.gap == mismatch.top2_gap and mismatch.verdict() == "near-tie"


def test_the_line_names_method_prompt_position_tokens_gap_and_verdict(target, plain):
    near_tie = find_mismatch(target, 0, PROMPT, plain, plain[:TIE_AT] + [6])
    line = difference_line("lookup", "code-1", near_tie)
    assert line.startswith("lookup on code-1: differs from plain decoding at token 3: plain '\\x05' (#5) vs '\\x06' (#6)")
    assert "logit gap 0.0005" in line and line.endswith(": near-tie")
    assert difference_line("lookup", "code-1", near_tie, exact=True).endswith(
        ": DEFECT (--exact promises identical output)"
    )
    defect = find_mismatch(target, 0, PROMPT, plain, plain[:1] + [7])
    assert difference_line("draft", "code-2", defect).endswith(": DEFECT (the target had a clear choice)")
    ended = find_mismatch(target, 0, PROMPT, plain, plain[:TIE_AT])
    assert f"vs {END_OF_OUTPUT} (top-2 gap 0.0005): near-tie" in difference_line("draft", "code-2", ended)


def test_the_gap_is_measured_on_the_rows_the_penalties_shaped(target):
    """Under penalties the greedy choice is made on shaped rows: there the gap is measured. A bias
    of -CLEAR + 2 * TIE_GAP on the token counting goes on to at TIE_AT leaves it TIE_GAP behind
    the runner-up, which plain decoding under the bias then takes."""
    from specrun.penalties import Penalties
    from specrun.sampling import SamplingSettings

    sampling = SamplingSettings(penalties=Penalties(repeat=1.0, presence=0.0), logit_bias=((5, -TIE_GAP * 2),))
    shaped = SpeculativeEngine(target).run(PROMPT, GenerationParams(4, 0, sampling)).token_ids
    assert shaped[TIE_AT] == 6  # the bias turned the near-tie
    mismatch = find_mismatch(target, 0, PROMPT, shaped, shaped[:TIE_AT] + [5], sampling)
    assert mismatch.token_gap == pytest.approx(TIE_GAP, rel=1e-2) and mismatch.near_tie
    unshaped = find_mismatch(target, 0, PROMPT, shaped, shaped[:TIE_AT] + [5])
    assert unshaped.token_gap == pytest.approx(-TIE_GAP, rel=1e-2)  # raw logits say the other way round
