"""What every online learner shares (training/online.py's heads, online_draft.py's draft models):
the worker thread, its budget, the buffer's bound, the swaps and the report.

The drafter hands its learner windows of verified text; a worker thread scores each new window
with the weights as they are (prequentially: tested before trained on, so the acceptance by depth
reported is on text the weights had not seen), keeps the latest ``buffer_tokens`` positions, and
takes small steps on batches drawn from them. Every PUBLISH_SECONDS it publishes a copy of the
weights, which the drafter takes between two verify passes.

The budget: while text is being generated (the target's cache grows: ``watch``), the worker's
time, scoring included, stays within ``share`` of the time generation has taken (its ``cpu_clock``
against the wall); while nothing is generated (a chat between turns, a server between requests)
it trains freely, but no position is trained on more than EPOCHS times on average, so it stops
soon after the text runs out.

Learning never changes an answer: every draft is verified by the target (exactly at temperature
0, by rejection sampling above it, with the distributions of the weights that drew it), so the
weights decide only how much is accepted. It stays on for --exact runs.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrun.backends.mlx_common import release_thread_streams
from specrun.errors import UsageError
from specrun.training.run import held_out_report
from specrun.wording import count_of

BATCH_POSITIONS = 64  # positions per step (Medusa, Hydra), about what a step trains on for the others
PUBLISH_SECONDS = 2.0  # a copy of the weights for the drafter, at most this often (Medusa's: ~38 MB)
IDLE_AFTER = 1.0  # seconds without a pass: generation is idle, the worker trains freely (at least; see _idle_after)
MAX_IDLE_AFTER = 60.0
EPOCHS = 4.0  # steps stop once the positions trained on reach this many times those seen
WAIT_SECONDS = 0.05  # the worker's nap when it may not step
REPORT_TOKENS = 256  # acceptance by depth over the first and the latest this many positions
SCORE_EVERY = 4  # past the first REPORT_TOKENS, one window in this many is scored (a third of a step's cost each)
STEP_PER_SCORE = 3.0  # a step over a window against scoring it, where no step was timed yet (close)
LEARNING_RATE = 5e-4  # heads' AdamW's, a half of `heads train`'s: small batches of one domain, noisier steps
DEFAULT_SHARE = 0.02
DEFAULT_BUFFER = 4096
MIN_BUFFER, MAX_BUFFER = 64, 1 << 17  # a window of positions; the most: 2 GiB of states of a 4,096-wide target


@dataclass(frozen=True)
class LearnSettings:
    """How heads learn online: ``share`` of generation time for the worker's CPU, the
    ``buffer_tokens`` latest positions kept, and where the learned heads are written at the end
    (``keep``: True for the file they came from, or the cache; False: not written)."""

    share: float = DEFAULT_SHARE
    buffer_tokens: int = DEFAULT_BUFFER
    keep: bool = False
    learning_rate: float = LEARNING_RATE
    idle: bool = True  # train between answers too (benchmarks that compare lines side by side: off)


def check_learn_settings(share: float, buffer_tokens: int) -> None:
    """Usage errors for --learn-budget and --learn-buffer."""
    if not 0.0 < share <= 1.0:
        raise UsageError(f"--learn-budget must be more than 0 and at most 1 (a share of generation time), got {share:g}",
                         f"pass e.g. --learn-budget {DEFAULT_SHARE}")
    if not MIN_BUFFER <= buffer_tokens <= MAX_BUFFER:
        raise UsageError(f"--learn-buffer must be between {MIN_BUFFER} and {MAX_BUFFER} tokens, got {buffer_tokens}",
                         f"pass e.g. --learn-buffer {DEFAULT_BUFFER}")


@dataclass(frozen=True)
class LearnReport:
    """What one learner did: its steps, the positions it saw and trained on, its CPU seconds while
    text was generated (``busy_cpu``, against ``busy_seconds`` of generation), while idle, and at
    its close (``closing_cpu``: the last windows, after the text, charged to generation's budget), the
    weights the drafter took (``swaps``), and the heads' acceptance by depth (each depth's given
    the depths before it were right, as `heads train` reports it) over the first and the latest
    REPORT_TOKENS positions seen, each scored before it was trained on. ``stopped``: why learning
    stopped early, "" where it did not."""

    kind: str
    steps: int
    seen: int
    trained: int
    busy_cpu: float
    busy_seconds: float
    idle_cpu: float
    swaps: int
    first: tuple[float, ...]
    latest: tuple[float, ...]
    first_positions: int
    latest_positions: int
    stopped: str = ""
    kept: Path | None = None
    labels: str = "tokens"  # what it learned: the target's "tokens" or its "distributions" (soft labels)
    closing_cpu: float = 0.0

    @property
    def overhead(self) -> float:
        """The worker's CPU while generating, as a share of generation time."""
        return self.busy_cpu / self.busy_seconds if self.busy_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "kind": self.kind, "steps": self.steps, "positions_seen": self.seen, "positions_trained": self.trained,
            "busy_cpu_seconds": round(self.busy_cpu, 3), "generation_seconds": round(self.busy_seconds, 3),
            "idle_cpu_seconds": round(self.idle_cpu, 3), "closing_cpu_seconds": round(self.closing_cpu, 3),
            "overhead": round(self.overhead, 4), "swaps": self.swaps,
            "acceptance_first": [round(value, 4) for value in self.first], "first_positions": self.first_positions,
            "acceptance_latest": [round(value, 4) for value in self.latest], "latest_positions": self.latest_positions,
            "stopped": self.stopped, "kept": str(self.kept) if self.kept is not None else None,
            "labels": self.labels,
        }

    def summary(self) -> str:
        """One line for the stats."""
        def depths(values: tuple[float, ...]) -> str:
            return "/".join(f"{value:.2f}" for value in values) if values else "-"

        # a share of a generation shorter than its printed tenth says nothing (a 4-token answer's
        # first window read 6,500% of "0.0 s")
        share = (f"{100 * self.overhead:.1f}% of {self.busy_seconds:.1f} s" if self.busy_seconds >= 0.05
                 else "a generation under 0.1 s")
        line = (f"learning ({self.kind}): {self.steps} steps on {self.seen} positions (labels: the target's "
                f"{self.labels}), "
                f"{self.busy_cpu:.2f} s CPU while generating ({share}), "
                f"{self.idle_cpu:.2f} s idle and {self.closing_cpu:.2f} s after it, "
                f"new weights taken by the drafter {count_of(self.swaps, 'time')}; "
                f"on the verified text, each position scored before it was learned from, the "
                f"{'draft model' if self.kind == 'draft' else 'heads'} guessed right by depth (each depth "
                f"given the ones before it right; not the run's acceptance, which counts only what was drafted) "
                f"{depths(self.first)} over the first {self.first_positions} positions, "
                f"{depths(self.latest)} over the latest {self.latest_positions}")
        if self.stopped:
            line += f"; stopped: {self.stopped}"
        if self.kept is not None:
            line += f"; kept in {self.kept}"
        return line


class Learner:
    """What every online learner shares (see the module's docstring): the drafter hands it windows
    of verified text (``_hand``), a worker thread scores each with the weights as they are, keeps
    it, takes steps within the budget and publishes copies of the weights, which the drafter takes
    between two verify passes (``latest``).

    The drafter's side (any thread that drafts, one at a time): ``start_text``, the kind's
    ``observe``, ``latest``. The worker's: everything the trainer does. ``inline`` (tests): no
    thread; each window the drafter completes is scored and trained on at once, ``inline_steps``
    steps, and the weights published after each, so a run is reproducible.

    A kind of learner says what a window is and how it is trained on: ``_flush`` (the drafter's
    unfinished window, handed as it is), ``_size`` (its positions), ``_keep``, ``_guesses`` and
    ``_labels`` ((depth, T) target ids, -1: none), ``_take_step`` and ``_snapshot`` (the weights
    published); it calls ``_start`` last in its constructor."""

    kind = ""
    labels = "tokens"  # what it learns of the target's: its "tokens", or its "distributions"
    step_positions = BATCH_POSITIONS  # about what a step trains on (``caught_up``)
    # At ``close``, the windows still waiting are scored (all, or within the budget:
    # ``scores_all_at_close``), trained on within the budget and, where ``publishes_at_close``, the
    # weights published once more (heads: cheap, and they may be kept). False: they are only
    # counted (a draft model's unless its adapters are kept: each step costs seconds on a CPU).
    finish_at_close = True
    publishes_at_close = True  # False: nothing takes the weights after close (a draft's adapters are kept apart)
    # The windows waiting at close are all scored, for the report (heads: cheap); False: only
    # within the budget (a draft model's: a pass each, which would leave no budget for a step)
    scores_all_at_close = True
    windows_a_step = 1  # windows a step trains on, against the one a score reads

    def __init__(self, settings: LearnSettings, depth: int, *, seed: int = 0, inline: bool = False,
                 inline_steps: int = 1, clock: Callable[[], float] = time.monotonic,
                 cpu_clock: Callable[[], float] = time.thread_time) -> None:
        self.settings = settings
        self.depth = depth
        self._rng = np.random.default_rng(seed)
        self._clock, self._cpu_clock = clock, cpu_clock
        self._inline, self._inline_steps = inline, inline_steps
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._inbox: deque = deque()
        self._waiting = 0  # positions in the inbox
        self._windows_seen = 0
        self._last_seen: float | None = None  # the last sign of generation
        self._progress: Callable[[], int] | None = None
        self._also: list[Callable[[], int]] = []  # slots' caches (watch_also)
        self._last_progress: int | None = None
        self._gaps: deque = deque(maxlen=8)  # seconds between the latest signs of generation
        self._busy_seconds = 0.0
        self._busy_cpu = 0.0
        self._idle_cpu = 0.0
        self._closing_cpu = 0.0  # close's: after the text, within generation's budget
        # the drafter's, on the generating thread (a draft model's soft labels read from the target's
        # rows: ``charge``), within generation's budget and reported with the worker's while generating
        self._drafter_cpu = 0.0
        self._steps = 0
        self._seen = 0
        self._trained = 0
        self._swaps = 0
        self._version = 0
        self._published: tuple[int, object] | None = None
        self._published_steps = 0
        self._published_at = clock()
        self._first: list[tuple[np.ndarray, np.ndarray]] = []  # (guesses, labels) of the first windows
        self._first_count = 0
        self._latest: deque = deque()
        self._latest_count = 0
        self._stopped = ""
        self._costs: dict[str, float] = {}  # the latest busy cost of a window scored, a step, a publish
        self._thread: threading.Thread | None = None
        self._closed = False

    def _start(self) -> None:
        if not self._inline:
            self._thread = threading.Thread(target=self._work, name=f"specrun-learn-{self.kind}", daemon=True)
            self._thread.start()

    # ---- the kind's own ------------------------------------------------------------------------
    def _flush(self) -> None:
        raise NotImplementedError

    def _flush_all(self) -> None:
        """At close: what every drafter handing it windows read last (a kind whose slots' drafters
        read too says so)."""
        self._flush()

    def _size(self, window) -> int:
        return len(window.tokens)

    def _keep(self, window) -> None:
        raise NotImplementedError

    def _guesses(self, window) -> np.ndarray:
        raise NotImplementedError

    def _labels(self, window) -> np.ndarray:
        raise NotImplementedError

    def _take_step(self) -> float:
        raise NotImplementedError

    def _snapshot(self):
        raise NotImplementedError

    # ---- the drafter's side ------------------------------------------------------------------
    def start_text(self) -> None:
        """A new text begins: what was read of the last one goes to the worker as it is."""
        self._flush()
        if self._inline:
            self._work_inline()

    def charge(self, seconds: float) -> None:
        """Work for learning the drafter's thread did while generating (``cpu_clock`` seconds):
        within generation's budget, as the worker's is. Only the drafter's thread calls it."""
        self._drafter_cpu += seconds

    def _hand(self, window) -> None:
        """A window the drafter completed, to the worker."""
        with self._lock:
            self._inbox.append(window)
            self._waiting += self._size(window)
            # windows wait while the budget is spent; past a buffer's worth the oldest would be dropped anyway
            while self._waiting - self._size(self._inbox[0]) >= self.settings.buffer_tokens:
                self._waiting -= self._size(self._inbox.popleft())
        self._wake.set()

    @property
    def caught_up(self) -> bool:
        """Nothing to learn until more text comes: each position seen trained on EPOCHS times (or
        learning stopped)."""
        return bool(self._stopped) or (not self._inbox and self._trained + self.step_positions > EPOCHS * self._seen)

    def watch(self, progress: Callable[[], int]) -> None:
        """``progress()``: the target's cached tokens, which every pass changes: the worker reads
        it to tell generation (busy: the budget applies) from idle, whether or not its drafter drafts."""
        self._progress = progress

    def watch_also(self, progress: Callable[[], int]) -> None:
        """One more cache whose passes count as generation (a server slot's drafter's)."""
        with self._lock:
            self._also = [*self._also, progress]

    def _active(self, now: float) -> None:
        """Generation went on at ``now``: the time since the last sign counts as generation's
        (the drafter's thread and the worker both tell, so once under the lock)."""
        with self._lock:
            if self._last_seen is None:
                self._last_seen = now
            elif self._last_seen < now:
                gap = now - self._last_seen
                if gap < self._idle_after():
                    self._busy_seconds += gap
                self._gaps.append(gap)
                self._last_seen = now

    def _idle_after(self) -> float:
        """No pass for this long and generation is idle: IDLE_AFTER, or three times the typical gap
        between passes where passes are slower (a large model on a CPU, a long prompt's chunks),
        at most MAX_IDLE_AFTER."""
        if not self._gaps:
            return IDLE_AFTER
        typical = sorted(self._gaps)[len(self._gaps) // 2]
        return min(max(IDLE_AFTER, 3.0 * typical), MAX_IDLE_AFTER)

    def _tick(self) -> None:
        watched = [each for each in (self._progress, *self._also) if each is not None]
        progress = sum(each() for each in watched) if watched else None
        if progress is not None and progress != self._last_progress:
            self._last_progress = progress
            self._active(self._clock())

    def latest(self, version: int) -> tuple[int, object] | None:
        """Weights newer than ``version`` (the drafter's), with their version; None if there are none."""
        published = self._published
        if published is None or published[0] <= version:
            return None
        with self._lock:  # a server's slots swap from their own threads
            self._swaps += 1
        return published

    # ---- the worker ----------------------------------------------------------------------------
    def _work(self) -> None:
        try:
            self._work_until_stopped()
        finally:
            release_thread_streams()  # this thread ends: the MLX streams it made go with it

    def _work_until_stopped(self) -> None:
        while not self._stop.is_set():
            idle, did = True, False
            try:
                self._tick()
                idle = self._idle()
                # a window at a time, so that a stop or a new answer is seen between any two
                if self._within_budget(idle, "score" if self._next_scored() else None):
                    did = self._charged(idle, None, lambda: self._take_windows(limit=1))
                if self._steps > self._published_steps and self._within_budget(idle, "publish"):
                    self._charged(idle, "publish", self._maybe_publish)  # a copy of the weights: charged too
                if self._may_step(idle):
                    did = self._charged(idle, "step", self._step) or did
            except Exception as error:  # noqa: BLE001 — learning must never end a generation
                self._stop_learning(f"the worker failed: {error}")
            if self._stopped:
                return
            if not did:
                self._wake.wait(WAIT_SECONDS)
                self._wake.clear()

    def _charged(self, idle: bool, kind: str | None, work: Callable[[], bool]) -> bool:
        """``work()``, its ``cpu_clock`` time charged to generation (busy) or to idle time; while
        busy, what it cost when it did something is what the budget expects of the next of its
        ``kind`` (a window's scoring: timed in ``_take_windows``, windows not scored being free)."""
        started = self._cpu_clock()
        did = work()
        spent = self._cpu_clock() - started
        if idle:
            self._idle_cpu += spent
        else:
            self._busy_cpu += spent
            if did and kind is not None:
                self._expect(kind, spent)
        return did

    def _expect(self, kind: str, spent: float) -> None:
        """What the budget expects the next ``kind`` of work to cost: the mean of the last and
        what came before, so one slow step does not hold the next ones off for long."""
        before = self._costs.get(kind)
        self._costs[kind] = spent if before is None else 0.5 * (before + spent)

    def _next_scored(self) -> bool:
        return self._first_count < REPORT_TOKENS or self._windows_seen % SCORE_EVERY == 0

    def _work_inline(self) -> None:
        started = self._cpu_clock()
        if self._take_windows():
            for _ in range(self._inline_steps):
                if self._trained < EPOCHS * self._seen:
                    self._step()
            self._publish()
        self._busy_cpu += self._cpu_clock() - started

    def _idle(self) -> bool:
        return self._last_seen is None or self._clock() - self._last_seen >= self._idle_after()

    def _may_step(self, idle: bool) -> bool:
        if self._stopped or not self._seen or self._trained >= EPOCHS * self._seen:
            return False
        return self._within_budget(idle, "step")

    def _within_budget(self, idle: bool, kind: str | None = None) -> bool:
        """May the worker score a window, take a step or publish (``kind``; None: anything) now?
        Idle: if it trains between answers. Busy: if what it spent and what the last one of this
        kind cost stay within ``share`` of generation's time (a draft model's step costs seconds
        on a CPU: checked after the fact, one would overshoot the budget by a whole step)."""
        if idle:
            return self.settings.idle
        expected = self._costs.get(kind, 0.0) if kind is not None else 0.0
        spent = self._busy_cpu + self._drafter_cpu + self._closing_cpu
        return spent + expected < self.settings.share * self._busy_seconds

    def _take_windows(self, limit: int | None = None, score: bool = True, within_budget: bool = False) -> bool:
        """Score the windows the drafter completed (the oldest ``limit``; None: all; ``score``
        False: none is; ``within_budget``: only while generation's budget allows, as at close),
        then buffer them; whether there were any."""
        with self._lock:
            windows = [self._inbox.popleft() for _ in range(len(self._inbox) if limit is None
                                                             else min(limit, len(self._inbox)))]
            self._waiting -= sum(self._size(window) for window in windows)
        for window in windows:
            if self._stopped:
                break
            try:
                if score and self._next_scored() and (not within_budget or self._within_budget(False, "score")):
                    started = self._cpu_clock()
                    self._score(window)
                    self._expect("score", self._cpu_clock() - started)
                self._keep(window)
            except Exception as error:  # noqa: BLE001 — learning must never end a generation
                self._stop_learning(f"scoring failed: {error}")
                break
            self._windows_seen += 1
            self._seen += self._size(window)
        return bool(windows)

    def _score(self, window) -> None:
        guesses = self._guesses(window)
        labels = self._labels(window)
        if self._first_count < REPORT_TOKENS:
            self._first.append((guesses, labels))
            self._first_count += guesses.shape[1]
        self._latest.append((guesses, labels))
        self._latest_count += guesses.shape[1]
        while self._latest_count - self._latest[0][0].shape[1] >= REPORT_TOKENS:
            self._latest_count -= self._latest.popleft()[0].shape[1]

    def _step(self) -> bool:
        try:
            loss = self._take_step()
        except Exception as error:  # noqa: BLE001
            self._stop_learning(f"a step failed: {error}")
            return False
        if not np.isfinite(loss):
            self._stop_learning(f"the loss became {loss}; the last finite weights are kept")
            return False
        self._steps += 1
        return True

    def _maybe_publish(self) -> bool:
        if self._steps and self._clock() - self._published_at >= PUBLISH_SECONDS:
            self._publish()
            return True
        return False

    def _publish(self) -> None:
        if self._steps == self._published_steps or self._stopped:  # nothing new
            return
        try:
            snapshot = self._snapshot()
        except Exception as error:  # noqa: BLE001 — learning must never end a generation
            self._stop_learning(f"publishing failed: {error}")
            return
        self._published_steps = self._steps
        self._version += 1
        self._published = (self._version, snapshot)
        self._published_at = self._clock()

    def _stop_learning(self, why: str) -> None:
        self._stopped = why

    def fail(self, why: str) -> None:
        """The drafter could not use the weights (``why``): learning stops, generation goes on."""
        self._stop_learning(why)

    # ---- the end -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the worker (its current step ends first), then take in what the drafter read last
        (a text's unfinished window) and train on it while the budget of the generation allows
        (charged to that budget, reported apart: the text is done by now)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._closed:
            return
        self._closed = True
        self._flush_all()
        finish = self.finish_at_close or self._inline  # the class attribute's comment says why not
        within_budget = not (self.scores_all_at_close or self._inline)
        while True:  # a window at a time, each one's scoring charged before the next is weighed
            started = self._cpu_clock()
            taken = self._take_windows(limit=1, score=finish, within_budget=within_budget)
            self._closing_cpu += self._cpu_clock() - started
            if not taken:
                break
        if finish and "step" not in self._costs and "score" in self._costs:  # no step timed yet: a score says
            self._costs["step"] = STEP_PER_SCORE * self.windows_a_step * self._costs["score"]
        while finish and self._may_step(idle=False):  # each step expected to cost what the ones before did
            started = self._cpu_clock()
            stepped = self._step()
            spent = self._cpu_clock() - started
            self._closing_cpu += spent
            if not stepped:
                break
            self._expect("step", spent)
        if finish and (self.publishes_at_close or self._inline):
            started = self._cpu_clock()
            self._publish()
            self._closing_cpu += self._cpu_clock() - started

    def report(self, kept: Path | None = None) -> LearnReport:
        def chain(pairs) -> tuple[tuple[float, ...], int]:
            if not pairs:
                return (), 0
            report = held_out_report(np.concatenate([guesses for guesses, _ in pairs], axis=1),
                                     np.concatenate([labels for _, labels in pairs], axis=1))
            return (report.chain_accuracy, report.positions) if report.positions else ((), 0)

        first, first_positions = chain(self._first)
        latest, latest_positions = chain(list(self._latest))
        return LearnReport(self.kind, self._steps, self._seen, self._trained, self._busy_cpu + self._drafter_cpu,
                           self._busy_seconds,
                           self._idle_cpu, self._swaps, first, latest, first_positions, latest_positions,
                           self._stopped, kept, self.labels, self._closing_cpu)
