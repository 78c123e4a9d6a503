"""Every command's --help reads as prose: its docstring's paragraphs are reflowed, so a sentence
is not broken wherever the source wrapped it (Typer's rich help keeps a docstring's line breaks)."""

from __future__ import annotations

import pytest
import typer.main
from typer.testing import CliRunner

from specrun.cli.app import app


def commands(group=None, path=()):
    group = group or typer.main.get_command(app)
    for name, command in sorted(getattr(group, "commands", {}).items()):
        yield (*path, name), command
        yield from commands(command, (*path, name))


@pytest.mark.parametrize(("path", "command"), list(commands()),
                         ids=lambda each: " ".join(each) if isinstance(each, tuple) else "")
def test_a_command_s_help_paragraphs_are_each_one_line(path, command):
    paragraphs = (command.help or "").split("\n\n")
    assert paragraphs[0], path  # every command says what it does
    assert all("\n" not in paragraph for paragraph in paragraphs), (path, paragraphs)


def test_serve_s_help_wraps_its_paragraphs_where_the_terminal_ends_not_where_the_source_did():
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": None})
    assert result.exit_code == 0
    lines = [line.strip() for line in result.output.splitlines()]
    # the paragraph fills the 80 columns: its source's break after "--top-k," is gone
    assert "/metrics. --temp, --top-k, --top-p, --min-p and -n are the defaults of" in lines


@pytest.mark.parametrize(("path", "command"), [(path, command) for path, command in commands()
                                               if not getattr(command, "commands", None)],
                         ids=lambda each: " ".join(each) if isinstance(each, tuple) else "")
def test_a_flag_shows_no_value_in_the_help(path, command):
    """Typer showed `--exact <bool>`, `--help <bool>`: a value the flag refuses."""
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    flags = [line for line in result.output.splitlines() if "--help" in line or "<bool>" in line]
    assert flags and all("<bool>" not in line for line in flags), (path, flags)
    if "--threads" in result.output:  # an option taking a value still shows its type
        assert any("--threads" in line and "<int>" in line for line in result.output.splitlines()), path
