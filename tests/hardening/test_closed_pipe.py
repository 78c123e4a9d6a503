"""Issue 32, item 9: a reader that goes away (`specrun … | head`) ends the run quietly.

The status is 141 (128 + SIGPIPE), what a shell reports for any tool a closed pipe stops,
and stderr holds no error and no traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cli_checks import ROOT, error_lines

BROKEN_PIPE_STATUS = 141


@pytest.fixture(scope="module")
def model(tiny_llama) -> str:
    pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")
    return str(tiny_llama.gguf_path)


def run_with_closed_stdout(*args: str, input: bytes = b"") -> tuple[int, list[str]]:
    """Run specrun with stdout a pipe whose reader has already gone: every write fails (EPIPE)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        process = subprocess.run(
            [sys.executable, "-m", "specrun", *args], stdout=write_end, stderr=subprocess.PIPE, input=input,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120,
        )
    finally:
        os.close(write_end)
    return process.returncode, error_lines(process.stderr)


def assert_quiet(status: int, stderr: list[str]) -> None:
    assert status == BROKEN_PIPE_STATUS, stderr
    noisy = [line for line in stderr if "error" in line.lower() or "Traceback" in line or "Exception" in line]
    assert not noisy, stderr


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "def f():", "-n", "16"],
        ["generate", "def f():", "-n", "16", "--json"],
        ["bench", "--methods", "none", "--categories", "chat", "--per-category", "1", "-n", "4"],
        ["chat", "-n", "8"],
    ],
    ids=["generate", "generate --json", "bench", "chat"],
)
def test_a_closed_stdout_ends_the_run_quietly(model, command):
    assert_quiet(*run_with_closed_stdout(*command, "-t", model, "-d", model, "--backend", "llama",
                                         input=b"Say something.\n"))


def test_demo_into_a_closed_pipe(model):
    assert_quiet(*run_with_closed_stdout("demo", "-t", model, "-d", model, "--methods", "none,lookup",
                                         "--prompts", "1", "-n", "8", "--backend", "llama"))


def test_models_list_into_a_closed_pipe():
    assert_quiet(*run_with_closed_stdout("models", "list"))


@pytest.mark.parametrize("command", [["--help"], ["generate", "--help"], ["models", "--help"]])
def test_help_into_a_closed_pipe(command):
    """Typer prints help through a Rich console of its own, which exited 1 on a closed pipe."""
    assert_quiet(*run_with_closed_stdout(*command))


@pytest.mark.parametrize("command", [["generate", "def f():", "-n", "4"], ["models", "list"]])
def test_a_stdout_closed_from_the_start_reads_as_dev_null(model, command, tmp_path):
    """`specrun generate ... >&-`: Python starts with sys.stdout None, and every command's first
    print was an internal error; the free descriptor would also have gone to the next file opened
    (a trace), taking what native code prints. Now the run goes as with >/dev/null, and the trace
    holds only the trace."""
    trace = tmp_path / "t.jsonl"
    extra = ["-t", model, "--backend", "llama", "--trace", str(trace)] if command[0] == "generate" else []
    process = subprocess.run(
        [sys.executable, "-m", "specrun", *command, *extra], stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120, preexec_fn=lambda: os.close(1),
    )
    assert process.returncode == 0, process.stderr.decode()
    assert b"error" not in process.stderr and b"Traceback" not in process.stderr, process.stderr.decode()
    if extra:
        lines = trace.read_text().splitlines()
        assert lines and all(line.startswith("{") for line in lines)
