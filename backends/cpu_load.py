"""llama.cpp's CPU threads, fewer while other processes keep cores busy.

llama.cpp's threads meet at a barrier after every operation of a pass and spin there. Where
another process holds a core, the thread it displaced reaches each barrier a scheduler slice
late, and every pass waits for it: SmolLM2 widened (481M), 2 threads on this 2-core machine,
plain decoding 17.6 tokens/s quiet and 1.5 with one core held by a busy loop, against 10.9 on
one thread (session 84; docs/perf.md 4). llama-cpp-python, llama-cli and llama-server keep the
count they started with.

So a backend left at the default thread count asks ``LoadFollower.threads()`` before each pass:
the CPU time other processes took over the last quarter second (/proc/stat's busy time less
this process's own, /proc/self/stat) takes ``ceil(others - SPARE)`` cores, and the pass runs on
the rest (at least one thread, at most the default). Fewer at once; more only after two readings
agree, so a brief burst does not make the count flap. Where /proc cannot be read (macOS), or
the user chose --threads or $SPECRUN_THREADS, the count stays as it is.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from collections.abc import Callable

WINDOW_S = 0.25  # the shortest interval a reading spans: /proc/stat counts in 10 ms jiffies
# Other processes' load a core takes before it counts as taken (threads = cores - ceil(others -
# SPARE)): a process on a third of a core already displaces a thread at many barriers. Chosen from
# the mechanism, not tuned on prompts.
SPARE = 0.3
RAISE_AFTER = 2  # readings in a row that allow more threads before they are given
STALE_S = 4 * WINDOW_S  # a longer window (the machine idle between requests) is no reading


def _allowed_cpus() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _jiffies() -> tuple[int, int] | None:
    """(the busy jiffies of the cores this process may run on, this process's own), or None where
    /proc cannot be read. Only the allowed cores' lines count: under taskset or a container's
    cpuset, a build on the host's other cores takes none of ours."""
    allowed = _allowed_cpus()
    try:
        with open("/proc/stat", "rb") as handle:
            lines = [line.split() for line in handle if line.startswith(b"cpu")]
        with open("/proc/self/stat", "rb") as handle:
            own = handle.read().rsplit(b")", 1)[1].split()
        busy = 0
        for fields in lines:
            name = fields[0]
            if (name == b"cpu") != (allowed is None) or (allowed is not None and int(name[3:]) not in allowed):
                continue
            user, nice, system, _idle, _iowait, irq, softirq = (int(value) for value in fields[1:8])
            busy += user + nice + system + irq + softirq + (int(fields[8]) if len(fields) > 8 else 0)  # steal
        return busy, int(own[11]) + int(own[12])  # utime, stime
    except (OSError, IndexError, ValueError):
        return None


class LoadReading:
    """Cores other processes kept busy, read at most every WINDOW_S (one reading a process: the
    target's and the draft's backends share it)."""

    def __init__(self, read: Callable[[], tuple[int, int] | None] = _jiffies,
                 clock: Callable[[], float] = time.monotonic, hz: int | None = None) -> None:
        self._read, self._clock = read, clock
        self._hz = hz or (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
        self._lock = threading.Lock()
        self._last: tuple[float, int, int] | None = None
        self.others: float | None = None  # the latest reading, None before the first window ends
        self.serial = 0  # counts readings, so a follower takes each once

    def latest(self) -> tuple[float | None, int]:
        """(cores others kept busy, the reading's number), the window read anew where it has ended."""
        with self._lock:
            self._update()
            return self.others, self.serial

    def _update(self) -> float | None:
        now = self._clock()
        if self._last is not None and now - self._last[0] < WINDOW_S:
            return self.others
        counts = self._read()
        if counts is None:
            if self._last is None:  # no /proc here: never again
                self._read = lambda: None
            return self.others  # a read that failed once (no file descriptor left): the next window tries
        if self._last is not None and now - self._last[0] > STALE_S:
            self._last = None  # a window across an idle spell averages what is long over: start afresh
        if self._last is not None:
            seconds = now - self._last[0]
            busy, own = counts[0] - self._last[1], counts[1] - self._last[2]
            self.others = max(0.0, (busy - own) / (self._hz * seconds))
            self.serial += 1
        self._last = (now, *counts)
        return self.others


_READING = LoadReading()


def cpu_count() -> int:
    """The cores this process may run on (its affinity), else the machine's."""
    return len(_allowed_cpus() or ()) or os.cpu_count() or 1


@dataclasses.dataclass(frozen=True)
class ThreadTally:
    """A follower's passes so far, by the thread count each ran on (``by_count``: (count, passes)
    pairs): how many ran on fewer threads than ``most``, the fewest any ran on. ``since(earlier)``
    gives a run's own."""

    by_count: tuple[tuple[int, int], ...] = ()
    most: int = 0

    @property
    def passes(self) -> int:
        return sum(passes for _, passes in self.by_count)

    @property
    def fewer(self) -> int:
        return sum(passes for count, passes in self.by_count if count < self.most)

    @property
    def least(self) -> int:
        return min((count for count, passes in self.by_count if passes), default=self.most)

    def since(self, earlier: ThreadTally) -> ThreadTally:
        before = dict(earlier.by_count)
        return ThreadTally(tuple((count, passes - before.get(count, 0)) for count, passes in self.by_count
                                 if passes > before.get(count, 0)), self.most)


class LoadFollower:
    """The thread count for a backend's next pass: ``most`` where the machine is otherwise idle,
    fewer while other processes keep cores busy (the module's docstring)."""

    def __init__(self, most: int, cores: int | None = None, reading: LoadReading | None = None) -> None:
        self.most = most
        self.cores = cores or cpu_count()
        self.current = most
        self._reading = reading or _READING
        self._seen = -1
        self._higher = 0  # readings in a row that allowed more threads
        self._lock = threading.Lock()  # a backend's own passes, its slots' and its window cache's
        self._by_count: dict[int, int] = {}  # thread count -> passes run on it

    def threads(self) -> int:
        """The count for the pass about to run (counted in ``tally``)."""
        with self._lock:
            self._follow()
            self._by_count[self.current] = self._by_count.get(self.current, 0) + 1
            return self.current

    def busy(self) -> bool:
        """Do other processes hold cores now (the count below the most)? No pass is counted."""
        with self._lock:
            self._follow()
            return self.current < self.most

    def _follow(self) -> None:
        others, serial = self._reading.latest()
        if others is not None and serial != self._seen:
            self._seen = serial
            self._choose(others)

    def tally(self) -> ThreadTally:
        with self._lock:
            return ThreadTally(tuple(sorted(self._by_count.items())), self.most)

    def _choose(self, others: float) -> int:
        wanted = max(1, min(self.most, self.cores - max(0, math.ceil(others - SPARE))))
        if wanted < self.current:
            self.current, self._higher = wanted, 0
        elif wanted > self.current:
            self._higher += 1
            if self._higher >= RAISE_AFTER:
                self.current, self._higher = wanted, 0
        else:
            self._higher = 0
        return self.current
