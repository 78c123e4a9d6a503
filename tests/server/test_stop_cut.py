"""Stop strings over streamed text: cut before the first match, whatever the chunking."""

from __future__ import annotations

import pytest

from specrun.server.worker import StopCut


def streamed(stops: list[str], chunks: list[str]) -> tuple[list[str], bool]:
    cut = StopCut(stops)
    out = []
    for chunk in chunks:
        out.append(cut.feed(chunk))
        if cut.stopped:
            return out, True
    out.append(cut.flush())
    return out, False


@pytest.mark.parametrize("size", [1, 2, 3, 5, 100])
def test_the_cut_does_not_depend_on_the_chunking(size):
    text = "def f():\n    return 1\n\ndef g():\n"
    chunks = [text[i:i + size] for i in range(0, len(text), size)]
    out, stopped = streamed(["\n\n", "return 2"], chunks)
    assert stopped and "".join(out) == "def f():\n    return 1"


def test_text_that_only_begins_a_stop_string_is_held_back_then_released():
    cut = StopCut(["END"])
    assert cut.feed("abc E") == "abc "  # "E" may begin END
    assert cut.feed("N") == ""
    assert cut.feed("x") == "ENx"  # it did not
    assert cut.feed("EN") == ""
    assert not cut.stopped and cut.flush() == "EN"


def test_the_earliest_of_several_stop_strings_wins():
    out, stopped = streamed(["later", "soon"], ["we stop soon, not later"])
    assert stopped and out == ["we stop "]


def test_no_stop_strings_pass_everything_through():
    out, stopped = streamed([], ["a", "b\n"])
    assert not stopped and "".join(out) == "ab\n"
