"""Issue 32, item 11: Typer's usage errors (an unknown option or command, a value of the wrong
type) are one line, as every other error is, instead of a multi-line box; exit status 2."""

from __future__ import annotations

import pytest

from cli_checks import assert_one_line_error, run_specrun


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["generate", "--bogus"], ["No such option: --bogus", "specrun generate --help"]),
        (["generate", "-n", "abc", "hi"], ["-n", "integer", "specrun generate --help"]),
        (["nosuch"], ["No such command 'nosuch'", "specrun --help"]),
        (["models", "pull"], ["Missing argument", "specrun models pull --help"]),
    ],
    ids=["unknown option", "not an integer", "unknown command", "missing argument"],
)
def test_usage_errors_are_one_line(args, fragments):
    result = run_specrun(*args)
    assert_one_line_error(result.returncode, result.stderr, 2, *fragments)
    assert result.stdout == b""


def test_help_and_no_arguments_still_show_the_help():
    assert run_specrun("--help").returncode == 0
    bare = run_specrun("models")
    assert bare.returncode == 2 and b"Usage:" in bare.stdout + bare.stderr and b"pull" in bare.stdout + bare.stderr
