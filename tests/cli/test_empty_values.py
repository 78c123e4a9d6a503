"""An option naming a file or a model given an empty value (an unset shell variable: `--trace "$T"`)
is a usage error naming it: Typer read an empty path as the working folder ("the trace . is a
folder", `distill --out ''` an internal error), and an empty -d went unnoticed as no draft."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specrun.cli.app import empty_option

CASES = {
    ("generate", "--trace", "", "hi"): "--trace is empty; give it a path, or leave the option out",
    ("generate", "-t", " ", "hi"): "-t is empty; name a model (an alias, a .gguf path or an MLX folder), or leave the option out",
    ("chat", "--draft", ""): "--draft is empty; name a model (an alias, a .gguf path or an MLX folder), or leave the option out",
    ("bench", "--json="): "--json is empty; give it a path, or leave the option out",
    ("distill", "--out", ""): "--out is empty; give it a path",  # required: no leaving it out
    ("heads", "train", "--heads-out", ""): "--heads-out is empty; give it a path, or leave the option out",
    ("models", "convert", "x.gguf", "--to", "mlx", "--out", ""): "--out is empty; give it a path, or leave the option out",
    ("serve", "--ngram-cache", ""): "--ngram-cache is empty; give it a path, or leave the option out",
}


@pytest.mark.parametrize("argv", CASES, ids=[" ".join(argv) for argv in CASES])
def test_an_empty_file_or_model_option_is_named(argv):
    assert empty_option(list(argv)) == CASES[argv]


def test_heads_are_told_what_they_name():
    assert empty_option(["generate", "--heads", ""]) == "--heads is empty; name the heads' file or folder, or leave the option out"


def test_every_command_s_options_are_read():
    """The scan reads every command's options (a hint it cannot resolve would have it say nothing)."""
    import typing

    from specrun.cli.app import _named_options, app

    def commands(group):
        for info in group.registered_commands:
            yield info.callback
        for sub in group.registered_groups:
            yield from commands(sub.typer_instance)

    found = {callback.__name__: _named_options(callback) for callback in commands(app)}
    assert len(found) >= 15 and all(typing.get_type_hints(callback, include_extras=True) for callback in commands(app))
    assert "--trace" in found["generate"] and "--out" in found["distill_command"] and "--heads-out" in found["train"]


@pytest.mark.parametrize("argv", [
    ("generate", "--", "--trace", ""),  # after --: the prompt's words
    ("generate", "--trace", "t.jsonl", "hi"),  # given
    ("generate", ""),  # an empty prompt: the prompt's own check says so
    ("generate", "-m", "", "hi"),  # no file: --method's own check names the methods
    ("chat", "--system", ""),  # an empty system prompt is none
    ("chat", "--system", "-t", ""),  # -t is the system prompt (it was read as an empty -t)
    ("generate", "-m", "--trace", ""),  # --trace is the method given (its own check), the prompt empty
    ("bench", "--json"),  # the option's value missing: Typer's usage error
    ("nosuch", "--trace", ""),  # no such command: Typer's
    ("models",),
    (),
])
def test_what_is_no_empty_file_or_model_option_is_left_to_its_own_check(argv):
    assert empty_option(list(argv)) is None


def test_the_command_line_says_it_in_one_line_exit_2():
    done = subprocess.run([sys.executable, "-m", "specrun", "generate", "--trace", "", "hi"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "error: --trace is empty; give it a path, or leave the option out"]
