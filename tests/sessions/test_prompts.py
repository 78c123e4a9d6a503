"""The built-in held-out prompts: the same on every Python, never text the demo pair was trained on."""

import sysconfig

import pytest

from specrun.sessions.prompts import HELDOUT_CODE_LINES, heldout_code_prompts


def test_held_out_prompts_do_not_read_the_interpreter_s_files(monkeypatch, tmp_path):
    """Debian's Python ships idlelib/ apart and the files move with the version: the prompts come
    from the frozen openings, whatever standard library the interpreter has (here: an empty one)."""
    before = heldout_code_prompts(20)
    monkeypatch.setattr(sysconfig, "get_paths", lambda *args, **kwargs: {"stdlib": str(tmp_path)})
    assert heldout_code_prompts(20) == before
    assert len(before) == 20 and len(set(before)) == 20
    assert all(len(prompt.splitlines()) == 12 and prompt.endswith("\n") for prompt in before)
    assert all(prompt.startswith(("def ", "class ")) for prompt in before)  # a file's first top-level one


def test_a_shorter_prompt_is_the_longer_one_s_opening():
    longest = heldout_code_prompts(55, lines=HELDOUT_CODE_LINES)
    assert len(longest) == 55  # every file of the 55 is long enough
    for lines in (1, 6, 12):
        assert heldout_code_prompts(55, lines=lines) == [
            "\n".join(prompt.splitlines()[:lines]) + "\n" for prompt in longest]


@pytest.mark.parametrize("lines", [0, HELDOUT_CODE_LINES + 1])
def test_a_length_the_frozen_openings_cannot_give_is_refused(lines):
    with pytest.raises(ValueError, match=f"1 to {HELDOUT_CODE_LINES} lines, not {lines}"):
        heldout_code_prompts(1, lines=lines)
