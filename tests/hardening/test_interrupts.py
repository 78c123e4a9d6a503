"""Issue 32, item 3: Ctrl-C at any moment exits 130 without a traceback.

Two moments used to go wrong: while the command's modules import (a traceback), and inside
llama.cpp's log callback while a model loads (Python printed "Exception ignored …
KeyboardInterrupt" and the run went on to exit 0).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from cli_checks import ROOT, error_lines

# A callback from native code that a Ctrl-C interrupts, as llama.cpp's log callback is while a
# model loads: libc's qsort calls the comparison back, and SIGINT arrives during the first call.
CALLBACK_SCRIPT = textwrap.dedent(
    """
    import ctypes, ctypes.util, signal, sys, time
    if sys.argv[1] == "handled":
        from specrun.cli.interrupts import raise_on_interrupt
        raise_on_interrupt()
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    COMPARE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int))
    calls = []
    def compare(a, b):
        calls.append(1)
        if len(calls) == 1:
            signal.raise_signal(signal.SIGINT)  # the handler runs here, inside the callback
        return a[0] - b[0]
    values = (ctypes.c_int * 64)(*range(64, 0, -1))
    try:
        libc.qsort(values, 64, ctypes.sizeof(ctypes.c_int), COMPARE(compare))
        for _ in range(200):  # the work after loading: the interrupt must arrive here
            time.sleep(0.01)
        print("ran to the end")
    except KeyboardInterrupt:
        print("interrupted")
    """
)


def run_script(mode: str) -> subprocess.CompletedProcess:
    """The script with SIGINT at its default on entry: a suite started in the background by a
    non-interactive shell (`make test &`) ignores SIGINT, every child inherits that, and Python
    then installs no KeyboardInterrupt handler at all, so the "plain" case could not happen."""
    return subprocess.run(
        [sys.executable, "-c", CALLBACK_SCRIPT, mode], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def test_an_interrupt_inside_a_native_callback_is_not_lost():
    plain = run_script("plain")  # what happened before: the interrupt is swallowed
    assert plain.stdout.strip() == "ran to the end" and "KeyboardInterrupt" in plain.stderr
    handled = run_script("handled")
    assert handled.stdout.strip() == "interrupted", handled.stderr
    assert handled.stderr == ""


@pytest.mark.parametrize("delay", [0.1, 0.2, 0.3, 0.5, 0.8])
def test_ctrl_c_while_starting_exits_130_without_a_traceback(tiny_llama, delay):
    """Ctrl-C while modules import or the model loads: chat waits on an open stdin, so the
    process is alive whenever the signal comes."""
    model = str(tiny_llama.gguf_path)
    process = subprocess.Popen(
        [sys.executable, "-m", "specrun", "chat", "-t", model, "-d", model, "--backend", "llama"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        time.sleep(delay)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    lines = error_lines(stderr)
    # A shell reports both as status 130: specrun's exit(130), or (rarely, when the interrupt
    # comes while Python unwinds the exit) Python ending itself with SIGINT.
    assert process.returncode in (130, -signal.SIGINT), lines
    assert lines == ["interrupted"], lines


# The console script's first moves: what it imports before the Ctrl-C handler is in, and a Ctrl-C
# that arrives as the first of the command's modules imports.
FIRST_MOVES_SCRIPT = textwrap.dedent(
    """
    import sys
    before = set(sys.modules)  # what the interpreter loaded itself
    import _signal
    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)  # as a shell starts it (see run_script)
    import specrun.cli
    print(sorted(set(sys.modules) - before - {"_signal"}), flush=True)
    import os, signal

    class InterruptAtFirstImport:
        def find_spec(self, name, path=None, target=None):
            if name.startswith("specrun.cli."):
                os.kill(os.getpid(), signal.SIGINT)
            return None

    sys.meta_path.insert(0, InterruptAtFirstImport())
    specrun.cli.main()
    print("ran on", flush=True)
    """
)


def test_the_console_script_handles_ctrl_c_before_importing_anything():
    """Ctrl-C that lands in an import Python runs for the console script printed a traceback:
    importing ``signal`` (and so ``enum``) cost ~3 ms before the handler was in. Now importing
    ``specrun.cli`` brings in nothing else, and the handler is in before main's first import."""
    result = subprocess.run(
        [sys.executable, "-c", FIRST_MOVES_SCRIPT], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    imported, *rest = result.stdout.splitlines()
    assert imported == str(["specrun", "specrun.cli"]), result.stdout
    assert rest == [] and result.stderr == "interrupted\n", (result.stdout, result.stderr)
    assert result.returncode == 130
