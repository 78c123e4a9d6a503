"""An option naming a file or a model given an empty value (an unset shell variable: `--trace "$T"`)
is a usage error naming it: Typer read an empty path as the working folder ("the trace . is a
folder", `distill --out ''` an internal error), and an empty -d went unnoticed as no draft."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specrun.cli.app import empty_option

CASES = {
    ("generate", "--trace", "", "hi"): "--trace is empty; give it a file name, or leave the option out",
    ("generate", "-t", " ", "hi"): "-t is empty; name a model (an alias, a .gguf path or an MLX folder), or leave the option out",
    ("chat", "--draft", ""): "--draft is empty; name a model (an alias, a .gguf path or an MLX folder), or leave the option out",
    ("bench", "--json="): "--json is empty; give it a file name, or leave the option out",
    ("distill", "--out", ""): "--out is empty; give it a file name",  # required: no leaving it out
    ("heads", "train", "--heads-out", ""): "--heads-out is empty; give it a file name, or leave the option out",
    ("models", "convert", "x.gguf", "--to", "mlx", "--out", ""): "--out is empty; give it a file name, or leave the option out",
    ("serve", "--ngram-cache", ""): "--ngram-cache is empty; give it a file name, or leave the option out",
}


@pytest.mark.parametrize("argv", CASES, ids=[" ".join(argv) for argv in CASES])
def test_an_empty_file_or_model_option_is_named(argv):
    assert empty_option(list(argv)) == CASES[argv]


@pytest.mark.parametrize("argv", [
    ("generate", "--trace", "t.jsonl", "hi"),  # given
    ("generate", ""),  # an empty prompt: the prompt's own check says so
    ("generate", "-m", "", "hi"),  # no file: --method's own check names the methods
    ("chat", "--system", ""),  # an empty system prompt is none
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
        "error: --trace is empty; give it a file name, or leave the option out"]
