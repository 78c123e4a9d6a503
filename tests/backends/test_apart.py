"""run_apart (backends/apart.py): passes on a thread that ends with them, as if run in place."""

from __future__ import annotations

import signal
import sys
import threading
import time

import pytest

from specrun.backends.apart import run_apart


def test_the_work_runs_on_another_thread_that_has_ended_when_its_result_comes_back():
    seen = {}

    def work(stop: threading.Event) -> int:
        seen["thread"] = threading.current_thread()
        return 42

    assert run_apart(work) == 42
    assert seen["thread"] is not threading.current_thread() and not seen["thread"].is_alive()


def test_what_the_work_raises_is_raised_to_the_caller():
    def work(stop: threading.Event) -> None:
        raise ValueError("a pass failed")

    with pytest.raises(ValueError, match="a pass failed"):
        run_apart(work)


@pytest.mark.skipif(sys.platform == "win32", reason="signals to a thread: POSIX")
@pytest.mark.parametrize("delay", [0.0, 0.1], ids=["while starting it", "while waiting for it"])
def test_an_interrupt_stops_the_work_at_its_next_pass_and_is_raised_once_it_ended(delay):
    """Ctrl-C reaches the calling thread only: the work is told to stop and waited for (the models
    must outlive its passes), then the interrupt is raised."""
    state = {"passes": 0, "stopped": False}
    caller = threading.main_thread().ident

    def work(stop: threading.Event) -> None:
        time.sleep(delay)
        signal.pthread_kill(caller, signal.SIGINT)  # Ctrl-C, to the caller (the main thread)
        while not stop.wait(0.01):  # a pass at a time, until told to stop
            state["passes"] += 1
            assert state["passes"] < 500, "never told to stop"
        state["stopped"] = True

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a test worker may ignore it
    try:
        with pytest.raises(KeyboardInterrupt):
            run_apart(work)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert state["stopped"]
