"""`specrun chat` in a pseudo-terminal: streaming, marked drafts, Ctrl-C, slash commands, exits."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specrun.cli.app import app

pexpect = pytest.importorskip("pexpect", reason="pexpect drives the REPL")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

SPECRUN = Path(sys.executable).with_name("specrun")
TIMEOUT = 180  # seconds per expectation: generous, because CI machines may be busy
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# new tokens, method, prompt tokens, prompt tokens from the cache
STATS = re.compile(r"(\d+) tokens, [\d.]+ tok/s, method ([a-z+]+)[^\r\n]*; prompt (\d+) tokens, (\d+) from the cache")
DRAFTED = "\x1b[32m"  # the green of text the drafter got right


def terminal_signals() -> None:
    """Ctrl-C as a terminal's shell hands it to a foreground job. A test run launched in the
    background (`cmd &` from a script) inherits SIGINT ignored, and exec keeps that, so the
    REPL would never see the interrupt the test sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def spawn(model, tmp_path, *args: str):
    """The REPL on a terminal, waiting at its first prompt."""
    path = str(model.gguf_path)
    env = {**os.environ, "TERM": "xterm", "SPECRUN_CACHE": str(tmp_path), "SPECRUN_THREADS": "1"}
    env.pop("NO_COLOR", None)
    child = pexpect.spawn(str(SPECRUN), ["chat", "-t", path, "-d", path, *args], env=env, encoding="utf-8",
                          timeout=TIMEOUT, dimensions=(24, 200), preexec_fn=terminal_signals)
    child.expect_exact("Ctrl-D exits.")
    child.banner = child.before
    child.expect_exact("> ")
    return child


def ask(child, *lines: str) -> tuple[str, re.Match]:
    """Type a message; return the answer as the terminal showed it and the stats line's match."""
    for line in lines:
        child.sendline(line)
    child.expect_exact(lines[-1] + "\r\n")
    child.expect(STATS)
    shown, stats = child.before, child.match
    child.expect_exact("> ")
    return shown, stats


def command(child, line: str, reply: str) -> None:
    child.sendline(line)
    child.expect_exact(reply)
    child.expect_exact("> ")


def plain(shown: str) -> str:
    return ANSI.sub("", shown)


def exits_cleanly(child) -> None:
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_answers_stream_with_drafts_marked_and_every_command_works(tiny_llama, tmp_path):
    # A fixed draft length (auto's cap): whether a chosen length pays is timing, and under a
    # busy suite the draft alone could choose to draft nothing.
    child = spawn(tiny_llama, tmp_path, "-n", "24", "-k", "4")
    # the target as named (a path: its file's name), then the backend (it said "specrun chat on llama")
    assert f"specrun chat with {tiny_llama.gguf_path.name} on llama: method auto" in plain(child.banner)
    shown, stats = ask(child, "hello there")
    assert stats.group(1, 2, 4) == ("24", "auto", "0")  # auto: the default method
    assert DRAFTED in shown and plain(shown).strip()

    command(child, "/stats", "last answer: 24 tokens")
    command(child, "/help", "Start a message with //")
    command(child, "/system Be terse.", "system prompt set")
    command(child, "/system", "system prompt: Be terse.")
    command(child, "/method none", "method none")
    shown, stats = ask(child, "hello there")
    assert stats.group(2) == "none" and DRAFTED not in shown
    command(child, "/method draft", "method draft")
    shown, stats = ask(child, "hello there")
    assert stats.group(2) == "draft" and DRAFTED in shown
    command(child, "/reset", "new conversation")
    shown, stats = ask(child, "hello there")
    assert stats.group(4) == "0"  # a new conversation starts from empty caches
    command(child, "/bogus", "unknown command /bogus")
    child.sendline("/exit")
    exits_cleanly(child)


def test_multi_line_messages(tiny_llama, tmp_path):
    child = spawn(tiny_llama, tmp_path, "-n", "24")
    block, block_stats = ask(child, '"""first', 'second"""')
    command(child, "/reset", "new conversation")
    continued, continued_stats = ask(child, "first\\", "second")
    assert plain(block) == plain(continued)
    assert block_stats.group(1, 3) == continued_stats.group(1, 3)
    child.sendline("unfinished\\")
    child.expect_exact("... ")
    child.sendeof()  # inside the open message: leaves, as at the prompt (it only cancelled the message)
    child.expect_exact("the unfinished message was not sent")
    exits_cleanly(child)

    path = str(tiny_llama.gguf_path)
    piped = CliRunner().invoke(app, ["chat", "-t", path, "-d", path, "-n", "24", "--json"], input="first\nsecond\n")
    assert piped.exit_code == 0, piped.output
    assert str(json.loads(piped.stdout)["prompt_tokens"]) == block_stats.group(3)  # the same two-line message


def test_ctrl_c_stops_the_answer_and_the_next_turn_equals_a_fresh_run(tiny_llama, tmp_path):
    # Answers run until the context is full, and must stream long enough for Ctrl-C to land
    # inside one. With draft == target, auto verifies up to 9 tokens a pass and fills a
    # 256-token context in a few tens of milliseconds; one draft token a pass and a 512-token
    # context give the interrupt ~10x more time (a longer context lets the random model end
    # on EOS first).
    args = ("-n", "8000", "--ctx", "512", "-m", "draft", "-k", "1")
    child = spawn(tiny_llama, tmp_path, *args)
    child.sendline("tell me a long story")
    child.expect_exact("tell me a long story\r\n")
    child.expect_exact(DRAFTED)  # the answer is streaming
    child.sendintr()
    child.expect_exact("interrupted: the answer and its question are dropped")
    child.expect_exact("> ")
    after_interrupt, stats = ask(child, "what happened next")
    assert "the context of 512 tokens is full" in after_interrupt
    child.sendeof()
    exits_cleanly(child)

    fresh = spawn(tiny_llama, tmp_path, *args)
    fresh_answer, fresh_stats = ask(fresh, "what happened next")
    assert plain(after_interrupt) == plain(fresh_answer)
    assert stats.group(1) == fresh_stats.group(1)
    fresh.sendintr()  # Ctrl-C at an empty prompt leaves
    exits_cleanly(fresh)
