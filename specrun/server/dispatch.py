"""Which slot answers which request: ``Jobs``, the queue the server's slots take jobs from.

Requests wait first come, first served. A job goes to an idle slot, and where several are idle,
to the one whose cache already holds the longest start of the job's prompt (``affinity``: an
agent's or a chat's next turn returns to the slot that holds its conversation, and prefills only
what is new), else to the slot idle longest (whose cache is the least recent), as llama-server
picks its slots by prompt similarity. A slot counts as idle from the moment its answer is
complete (``answered``), before its client is told: a client sending its next turn the moment the
last answer arrives finds its conversation's slot idle, not still closing the answer on its thread.
With one slot this is a plain FIFO queue.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

Job = TypeVar("Job")


class Jobs(Generic[Job]):
    """Jobs waiting for ``n_slots`` slots. ``affinity(slot, job)``: how many tokens of the job's
    prompt the idle slot's cache holds (asked under the queue's lock: it must be quick);
    ``prepare(job)``: what affinity needs of a job (its prompt tokenized), done by a slot's thread
    outside the lock before the job is handed out (the submitter, the server's event loop, takes
    the lock too and must not wait on it)."""

    def __init__(self, n_slots: int, affinity: Callable[[int, Job], int] | None = None,
                 prepare: Callable[[Job], None] | None = None) -> None:
        self._affinity, self._prepare = affinity, prepare
        self._preparing: set[int] = set()  # ids of waiting jobs a slot's thread is preparing
        self._prepared: set[int] = set()  # ids of waiting jobs prepared
        self._lock = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._idle: dict[int, int] = {}  # slot -> when it became idle (a count: earlier is smaller)
        self._given: dict[int, Job] = {}  # slot -> the job handed to it, not yet taken
        self._ticks = itertools.count()
        self._closed = False
        self.n_slots = n_slots

    def qsize(self) -> int:
        """How many jobs wait for a slot."""
        with self._lock:
            return len(self._waiting)

    def put(self, job: Job) -> None:
        with self._lock:
            self._waiting.append(job)
            self._lock.notify_all()

    def take_all(self) -> list[Job]:
        """Every job still waiting (and any handed to a slot that has not taken it), taken out;
        such a slot is idle again."""
        with self._lock:
            taken = list(self._given.values()) + list(self._waiting)
            self._prepared.clear()
            for slot in self._given:
                self._idle[slot] = next(self._ticks)
            self._given.clear()
            self._waiting.clear()
            return taken

    def answered(self, slot: int) -> None:
        """``slot``'s answer is complete (what its thread does after only trims its cache back to
        the text): it is idle from now on, and takes what is handed to it once its thread next
        asks (``get``), busy from then."""
        with self._lock:
            if slot in self._idle or slot in self._given:
                return
            self._idle[slot] = next(self._ticks)
            self._lock.notify_all()  # a slot waiting in get prepares what waits and hands it out

    def close(self) -> None:
        """Slots asking for a job from now on get None (stop), once what was handed them is taken."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    def get(self, slot: int) -> Job | None:
        """The next job for ``slot`` (blocks until there is one); None once closed."""
        with self._lock:
            if slot not in self._given:  # handed a job since its answer was complete: busy once it takes it
                self._idle.setdefault(slot, next(self._ticks))
        while True:
            with self._lock:
                if slot in self._given:
                    return self._given.pop(slot)
                if self._closed:
                    self._idle.pop(slot, None)
                    return None
                job = self._to_prepare()
                if job is None:
                    if self._waiting:
                        self._hand_out()
                        if slot in self._given:
                            continue
                    self._lock.wait()
                    continue
                self._preparing.add(id(job))
            try:
                self._prepare(job)
            except Exception:  # noqa: BLE001 - unprepared, it goes to any slot; answering it says what failed
                pass
            finally:
                with self._lock:
                    self._preparing.discard(id(job))
                    self._prepared.add(id(job))
                    self._lock.notify_all()

    def _to_prepare(self) -> Job | None:
        """A waiting job nobody has prepared yet, where a choice among idle slots will need it."""
        if self._prepare is None or len(self._idle) < 2:
            return None
        return next((job for job in self._waiting
                     if id(job) not in self._prepared and id(job) not in self._preparing), None)

    def _hand_out(self) -> None:
        """The waiting jobs, oldest first, each to the idle slot it suits best (under the lock)."""
        while self._waiting and self._idle and id(self._waiting[0]) not in self._preparing:
            job = self._waiting.popleft()
            self._prepared.discard(id(job))
            slots = sorted(self._idle, key=self._idle.__getitem__)  # idle longest first
            best = slots[0]
            if self._affinity is not None and len(slots) > 1:
                held = {slot: self._held(slot, job) for slot in slots}
                best = max(slots, key=lambda slot: held[slot])  # ties: idle longest (max keeps the first)
            del self._idle[best]
            self._given[best] = job
            self._lock.notify_all()

    def _held(self, slot: int, job: Job) -> int:
        """``affinity(slot, job)``, 0 where it fails: a job is never lost to the choice of its slot."""
        try:
            return int(self._affinity(slot, job))
        except Exception:  # noqa: BLE001 - any slot will do
            return 0
