"""Ctrl-C at any moment ends specrun with status 130 and no traceback.

Three moments need care beyond ``cli_errors`` (which turns KeyboardInterrupt into one
line and exit 130 while a command runs):

- while the command's modules import (Typer, Rich, NumPy): nothing is open or written
  yet, so the process leaves at once (``specrun.cli.main`` installs that handler first, with
  nothing imported before it);
- inside a callback from native code, such as llama.cpp's log callback while a model
  loads: a callback cannot raise, so Python prints "Exception ignored … KeyboardInterrupt"
  and the run went on to the end. The interrupt is delivered again until it lands in
  Python code that can raise it;
- Typer turns a KeyboardInterrupt outside the command (while it parses) into exit 130
  silently; ``main`` then says "interrupted" as cli_errors does.

What no package can reach: the few milliseconds of Python's own start-up (``site`` and the
``.pth`` files of the environment) before the console script's first line, where Python prints
its own traceback.
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import time

INTERRUPTED_EXIT = 130
_said = False
_main_thread: int | None = None  # where a redelivered interrupt is sent (raise_on_interrupt)


def raise_on_interrupt() -> None:
    """Ctrl-C raises KeyboardInterrupt again (for cli_errors), also when it lands in a native callback."""
    global _main_thread
    _main_thread = _thread.get_ident()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if not getattr(sys.unraisablehook, "redelivers_interrupts", False):
        sys.unraisablehook = _redelivering(sys.unraisablehook)


def say_interrupted(detail: str = "") -> None:
    """The one line an interrupted run ends with (cli_errors); ``detail``: what was kept, and where."""
    global _said
    _said = True
    print(f"interrupted: {detail}" if detail else "interrupted", file=sys.stderr, flush=True)


def say_interrupted_once() -> None:
    """For an interrupt that reached the top some other way (Typer's own exit 130)."""
    if not _said:
        say_interrupted()


def _interrupt_main_soon() -> None:
    time.sleep(0.001)  # let the callback return to native code first
    # A real signal, not _thread.interrupt_main(): that only sets a flag, which a main thread
    # blocked in a system call (reading stdin) would see only after the call returned, too late.
    signal.pthread_kill(_main_thread, signal.SIGINT)


def _redelivering(previous):
    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            # Sent from another thread, so that it is not raised inside this hook; if it lands
            # in the next native callback, this hook sends it again. No threading.Thread: its
            # start() waits in Python code, where the interrupt could arrive.
            _thread.start_new_thread(_interrupt_main_soon, ())
            return
        previous(unraisable)

    hook.redelivers_interrupts = True
    return hook


@contextlib.contextmanager
def terminate_as_interrupt():
    """SIGTERM inside the block ends the command as Ctrl-C does, through the ``finally`` clauses
    that remove what it was writing (the default action kills the process where it stands, and
    left a conversion's scratch folder behind)."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
