"""Passes run apart from the calling thread, on a thread that ends with them.

llama.cpp's CPU threads (an OpenMP team) belong to the thread that decodes and stay with it for
that thread's life. A server decodes its slots' batches on one thread of its own
(backends/slots.Rendezvous); a pass made on any other thread left a second team beside that one,
and a second team, even idle, slows every pass (session 52: a 1-token pass 40 → 56-95 ms). So
what a server measures while loading (flash attention's cost, auto's probe of pass costs) runs
here: the thread and its team end with the passes. MLX's streams made on the thread go with it
(mlx_common.release_thread_streams).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from specrun.backends.mlx_common import release_thread_streams

T = TypeVar("T")


def run_apart(work: Callable[[threading.Event], T]) -> T:
    """``work(stop)`` on a thread of its own, its result or its exception handed back. On an
    interrupt (Ctrl-C reaches the calling thread only) ``stop`` is set, for ``work`` to end at its
    next pass, and the caller waits for it (the models must outlive their passes), then raises."""
    stop, began, finished = threading.Event(), threading.Event(), threading.Event()
    outcome: list[tuple[bool, object]] = []

    def body() -> None:
        began.set()
        try:
            outcome.append((True, work(stop)))
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            outcome.append((False, exc))
        finally:
            release_thread_streams()
            finished.set()

    thread = threading.Thread(target=body, name="specrun-passes-apart", daemon=True)
    try:
        thread.start()
        thread.join()
    except BaseException:
        stop.set()
        waited = 0.0
        while not finished.is_set():  # a second Ctrl-C waits out the pass in flight too
            try:
                finished.wait(0.05)
            except BaseException:  # noqa: BLE001 - the first interrupt is the one raised
                pass
            waited += 0.05
            if not began.is_set() and waited > 1.0:  # interrupted before the thread ever ran
                break
        raise
    done, value = outcome[0]
    if not done:
        raise value
    return value
