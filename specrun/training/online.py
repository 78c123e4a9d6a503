"""Heads that keep learning while they draft: online speculative decoding (OSD, Liu et al. 2024).

A heads drafter (drafters/heads/base.py) hands its learner, every few verify passes and at a
text's end, what the target verified: its hidden states at the positions it generated and the
tokens it chose. The learner cuts them into windows of WINDOW_POSITIONS consecutive positions
(what `specrun heads train` trains on: training/run.py), and a worker thread scores new windows
with the heads as they are (prequentially: tested before trained on, so the acceptance by depth
reported is the heads' on text they had not seen), keeps the latest ``buffer_tokens`` positions,
and takes small AdamW steps on batches drawn from them, the projections over the draft vocabulary
left as they are (their update was most of a step's cost). Every PUBLISH_SECONDS it publishes a
copy of the weights, which the drafter takes between two verify passes.

The budget: while text is being generated (the target's cache grows: ``watch``), the worker's CPU
time, scoring included, stays within ``share`` of the time generation has taken (its thread clock
against the wall); while nothing is generated (a chat between turns, a server between requests)
it trains freely, but no position is trained on more than EPOCHS times on average, so it stops
soon after the text runs out.

Learning never changes an answer: every draft is verified by the target (exactly at temperature
0, by rejection sampling above it, with the distributions of the weights that drew it), so the
heads' weights decide only how much is accepted. It stays on for --exact runs.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specrun.errors import UsageError
from specrun.heads.kinds import BY_NAME, TRAINABLE_KINDS, kind_of
from specrun.training.run import held_out_report, next_tokens, target_labels, trainer_class

WINDOW_POSITIONS = 64  # positions per window, as the buffer keeps them and the report scores them
BATCH_POSITIONS = 64  # positions per step (Medusa, Hydra)
BATCH_WINDOWS = 1  # windows per step (EAGLE, EAGLE-3)
PUBLISH_SECONDS = 2.0  # a copy of the weights for the drafter, at most this often (Medusa's: ~38 MB)
IDLE_AFTER = 1.0  # seconds without a pass: generation is idle, the worker trains freely (at least; see _idle_after)
MAX_IDLE_AFTER = 60.0
EPOCHS = 4.0  # steps stop once the positions trained on reach this many times those seen
WAIT_SECONDS = 0.05  # the worker's nap when it may not step
REPORT_TOKENS = 256  # acceptance by depth over the first and the latest this many positions
SCORE_EVERY = 4  # past the first REPORT_TOKENS, one window in this many is scored (a third of a step's cost each)
LEARNING_RATE = 5e-4  # AdamW's, a half of `heads train`'s: small batches of one domain, noisier steps
DEFAULT_SHARE = 0.02
DEFAULT_BUFFER = 4096
MIN_BUFFER, MAX_BUFFER = WINDOW_POSITIONS, 1 << 17  # the most: 2 GiB of states of a 4,096-wide target


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
    text was generated (``busy_cpu``, against ``busy_seconds`` of generation) and while idle, the
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

    @property
    def overhead(self) -> float:
        """The worker's CPU while generating, as a share of generation time."""
        return self.busy_cpu / self.busy_seconds if self.busy_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "kind": self.kind, "steps": self.steps, "positions_seen": self.seen, "positions_trained": self.trained,
            "busy_cpu_seconds": round(self.busy_cpu, 3), "generation_seconds": round(self.busy_seconds, 3),
            "idle_cpu_seconds": round(self.idle_cpu, 3), "overhead": round(self.overhead, 4), "swaps": self.swaps,
            "acceptance_first": [round(value, 4) for value in self.first], "first_positions": self.first_positions,
            "acceptance_latest": [round(value, 4) for value in self.latest], "latest_positions": self.latest_positions,
            "stopped": self.stopped, "kept": str(self.kept) if self.kept is not None else None,
        }

    def summary(self) -> str:
        """One line for the stats."""
        def depths(values: tuple[float, ...]) -> str:
            return "/".join(f"{value:.2f}" for value in values) if values else "-"

        line = (f"learning ({self.kind}): {self.steps} steps on {self.seen} positions, "
                f"{self.busy_cpu:.2f} s CPU while generating ({100 * self.overhead:.1f}% of "
                f"{self.busy_seconds:.1f} s) and {self.idle_cpu:.2f} s idle, {self.swaps} swaps; "
                f"acceptance by depth {depths(self.first)} over the first {self.first_positions} positions, "
                f"{depths(self.latest)} over the latest {self.latest_positions}")
        if self.stopped:
            line += f"; stopped: {self.stopped}"
        if self.kept is not None:
            line += f"; kept in {self.kept}"
        return line


@dataclass
class _Run:
    """Consecutive positions of the text being generated whose states were read, not yet cut into
    a window: the first's position, the states (n, H) in pieces, and the tokens at those positions
    and the one after the last (n + 1), copied (the engine's context list lives on)."""

    first: int = 0
    states: list[np.ndarray] = field(default_factory=list)
    count: int = 0
    tokens: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.first + self.count


class _Positions:
    """The latest ``capacity`` positions of Medusa's and Hydra's buffer as flat arrays, grown as they
    fill: the states (C, H), each head's label (K, C; draft ids, -1 none) and the tokens after each
    position (C, K; target ids, -1 none: what Hydra's heads read)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size = 0
        self.cursor = 0
        self.states = self.labels = self.following = None

    def add(self, states: np.ndarray, labels: np.ndarray, following: np.ndarray) -> None:
        if self.states is None:
            width, depth = states.shape[1], labels.shape[0]
            rows = min(self.capacity, max(1024, len(states)))
            self.states = np.zeros((rows, width), np.float32)
            self.labels = np.full((depth, rows), -1, np.int64)
            self.following = np.full((rows, depth), -1, np.int64)
        for row in range(len(states)):  # windows are short: a row at a time keeps the ring simple
            if self.cursor == len(self.states):  # only while the arrays are smaller than the ring
                self._grow()
            at = self.cursor
            self.states[at], self.labels[:, at], self.following[at] = states[row], labels[:, row], following[row]
            self.cursor = (at + 1) % self.capacity
            self.size = min(self.size + 1, self.capacity)

    def _grow(self) -> None:
        rows = min(self.capacity, 2 * len(self.states))
        grown = rows - len(self.states)
        self.states = np.concatenate([self.states, np.zeros((grown, self.states.shape[1]), np.float32)])
        self.labels = np.concatenate([self.labels, np.full((self.labels.shape[0], grown), -1, np.int64)], axis=1)
        self.following = np.concatenate([self.following, np.full((grown, self.following.shape[1]), -1, np.int64)])

    def labelled(self) -> np.ndarray:
        return np.flatnonzero((self.labels[:, : self.size] >= 0).any(axis=0))


def not_learnable(heads) -> str:
    """Why ``heads`` cannot learn online ("" where they can)."""
    kind = kind_of(heads)
    if kind.name not in TRAINABLE_KINDS:
        return f"{kind.name} heads are the model's own layers, which specrun does not train"
    if kind.name == "eagle3":
        from specrun.training.eagle3 import untrainable_because

        return untrainable_because(heads)
    return ""


class OnlineLearner:
    """One heads object learning from what the target verifies (see the module's docstring).

    The drafter's side (any thread that drafts, one at a time): ``start_text``, ``observe``,
    ``latest``. The worker's: everything the trainer does. ``inline`` (tests): no thread; each
    window the drafter completes is scored and trained on at once, ``inline_steps`` steps, and the
    weights published after each, so a run is reproducible."""

    def __init__(self, heads, settings: LearnSettings = LearnSettings(), *, embedding: np.ndarray | None = None,
                 seed: int = 0, window: int = WINDOW_POSITIONS, inline: bool = False, inline_steps: int = 1,
                 clock: Callable[[], float] = time.monotonic, cpu_clock: Callable[[], float] = time.thread_time) -> None:
        kind = kind_of(heads)
        if not_learnable(heads):
            raise ValueError(f"these {kind.name} heads do not learn online: {not_learnable(heads)}")
        self.kind = kind.name
        self.source = heads
        self.settings = settings
        cls = trainer_class(kind.name, "llama")  # NumPy's: the target's states arrive as NumPy arrays
        if kind.embeds == "target":  # EAGLE-3: reads the target's embedding, its own copy where it has one
            embedding = embedding if embedding is not None else heads.embed_tokens
            if embedding is None:
                raise ValueError("EAGLE-3 heads without an embedding of their own learn with the target's: "
                                 "pass embedding")
            self.trainer = cls(heads, settings.learning_rate, seed, np.asarray(embedding, np.float32))
        else:
            self.trainer = cls(heads, settings.learning_rate, seed)
        self.trainer.freeze_projections()  # the blocks and layers learn; the big projections stay
        self.depth = heads.config.num_heads
        self.window = window
        self._rng = np.random.default_rng(seed)
        self._clock, self._cpu_clock = clock, cpu_clock
        self._inline, self._inline_steps = inline, inline_steps
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._inbox: deque = deque()
        self._waiting = 0  # positions in the inbox
        self._windows_kind = kind.trains_on == "windows"
        self._buffer: deque = deque()  # EAGLE's windows (EagleWindow), oldest first
        self._positions = _Positions(settings.buffer_tokens)  # Medusa's and Hydra's positions
        self._buffered = 0
        self._windows_seen = 0
        self._t2d = None
        if heads.d2t is not None:  # a target id (and -1, last) to its draft id, -1 outside the draft vocabulary
            self._t2d = np.full(int(heads.config.vocab_size) + 1, -1, np.int64)
            self._t2d[heads.d2t] = np.arange(len(heads.d2t))
        self._run = _Run()
        self._last_seen: float | None = None  # the last sign of generation
        self._progress: Callable[[], int] | None = None
        self._last_progress: int | None = None
        self._gaps: deque = deque(maxlen=8)  # seconds between the latest signs of generation
        self._busy_seconds = 0.0
        self._busy_cpu = 0.0
        self._idle_cpu = 0.0
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
        self._thread: threading.Thread | None = None
        self._closed = False
        if not inline:
            self._thread = threading.Thread(target=self._work, name=f"specrun-learn-{self.kind}", daemon=True)
            self._thread.start()

    # ---- the drafter's side ------------------------------------------------------------------
    def start_text(self) -> None:
        """A new text begins: what was read of the last one goes to the worker as it is."""
        self._flush()
        if self._inline:
            self._work_inline()

    def observe(self, first: int, states: np.ndarray | None, context: Sequence[int]) -> None:
        """The target's states (n, H) at the positions first .. first + n - 1 of ``context``, all
        of them verified (the target's own tokens follow each); None where they could not be read.
        Called between verify passes."""
        self._active(self._clock())
        if self._stopped:
            return
        if states is None or len(states) == 0:
            if states is None:
                self._flush()
            return
        if self._run.count and first != self._run.end:
            self._flush()
        run = self._run
        if not run.count:
            run.first = first
            run.tokens = [int(context[first])]
        run.states.append(np.asarray(states, np.float32))
        run.tokens.extend(int(token) for token in context[run.end + 1 : run.end + len(states) + 1])
        run.count += len(states)
        while self._run.count >= self.window:
            self._cut(self.window)
        if self._inline:
            self._work_inline()

    @property
    def caught_up(self) -> bool:
        """Nothing to learn until more text comes: each position seen trained on EPOCHS times (or
        learning stopped)."""
        return bool(self._stopped) or (not self._inbox and self._trained + BATCH_POSITIONS > EPOCHS * self._seen)

    @property
    def buffered_positions(self) -> int:
        return self._buffered if self._windows_kind else self._positions.size

    def watch(self, progress: Callable[[], int]) -> None:
        """``progress()``: the target's cached tokens, which every pass changes: the worker reads
        it to tell generation (busy: the budget applies) from idle, whether or not the heads draft."""
        self._progress = progress

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
        progress = self._progress() if self._progress is not None else None
        if progress is not None and progress != self._last_progress:
            self._last_progress = progress
            self._active(self._clock())

    def latest(self, version: int) -> tuple[int, object] | None:
        """Weights newer than ``version`` (the drafter's), with their version; None if there are none."""
        published = self._published
        if published is None or published[0] <= version:
            return None
        self._swaps += 1
        return published

    def _cut(self, count: int) -> None:
        """The run's first ``count`` positions as a window, to the worker."""
        from specrun.training.eagle import EagleWindow

        run = self._run
        states = np.concatenate(run.states)
        tokens = np.asarray(run.tokens, np.int64)
        if len(tokens) > count:
            with self._lock:
                self._inbox.append(EagleWindow(states[:count], tokens[:count], tokens[1 : count + 1]))
                self._waiting += count
                # windows wait while the budget is spent; past a buffer's worth the oldest would be dropped anyway
                while self._waiting - len(self._inbox[0].tokens) >= self.settings.buffer_tokens:
                    self._waiting -= len(self._inbox.popleft().tokens)
            self._wake.set()
        rest = states[count:]
        self._run = _Run(run.first + count, [rest] if len(rest) else [], len(rest), run.tokens[count:])

    def _flush(self) -> None:
        if self._run.count >= 2:
            self._cut(self._run.count)
        self._run = _Run()

    # ---- the worker ----------------------------------------------------------------------------
    def _work(self) -> None:
        while not self._stop.is_set():
            started = self._cpu_clock()
            idle = True
            try:
                self._tick()
                idle = self._idle()
                did = False
                if self._within_budget(idle):  # scoring costs too: windows wait meanwhile, one at a time while busy
                    did = self._take_windows(limit=None if idle else 1)
                    if self._may_step(idle):
                        did = self._step() or did
                if did:
                    self._maybe_publish()  # a copy of the weights: charged to the budget too
            except Exception as error:  # noqa: BLE001 — learning must never end a generation
                self._stop_learning(f"the worker failed: {error}")
                did = False
            spent = self._cpu_clock() - started
            if idle:
                self._idle_cpu += spent
            else:
                self._busy_cpu += spent
            if self._stopped:
                return
            if not did:
                self._wake.wait(WAIT_SECONDS)
                self._wake.clear()

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
        return self._within_budget(idle)

    def _within_budget(self, idle: bool) -> bool:
        if idle:
            return self.settings.idle
        return self._busy_cpu < self.settings.share * self._busy_seconds

    def _take_windows(self, limit: int | None = None) -> bool:
        """Score the windows the drafter completed (the oldest ``limit``; None: all), then buffer
        them; whether there were any."""
        with self._lock:
            windows = [self._inbox.popleft() for _ in range(len(self._inbox) if limit is None
                                                             else min(limit, len(self._inbox)))]
            self._waiting -= sum(len(window.tokens) for window in windows)
        for window in windows:
            if self._stopped:
                break
            try:
                if self._first_count < REPORT_TOKENS or self._windows_seen % SCORE_EVERY == 0:
                    self._score(window)
                self._keep(window)
            except Exception as error:  # noqa: BLE001 — learning must never end a generation
                self._stop_learning(f"scoring failed: {error}")
                break
            self._windows_seen += 1
            self._seen += len(window.tokens)
        return bool(windows)

    def _keep(self, window) -> None:
        """Into the buffer, the oldest dropped past ``buffer_tokens``."""
        if self._windows_kind:
            self._buffer.append(window)
            self._buffered += len(window.tokens)
            while self._buffered - len(self._buffer[0].tokens) >= self.settings.buffer_tokens:
                self._buffered -= len(self._buffer.popleft().tokens)
            return
        labels = target_labels([window.following], self.depth)  # (depth, T) target ids
        if self._t2d is not None:
            labels = self._t2d[np.minimum(labels, len(self._t2d) - 1)]
        self._positions.add(window.features, labels, next_tokens(window.tokens, self.depth))

    def _score(self, window) -> None:
        guesses = self._guesses(window)
        labels = target_labels([window.following], self.depth)
        if self._first_count < REPORT_TOKENS:
            self._first.append((guesses, labels))
            self._first_count += guesses.shape[1]
        self._latest.append((guesses, labels))
        self._latest_count += guesses.shape[1]
        while self._latest_count - self._latest[0][0].shape[1] >= REPORT_TOKENS:
            self._latest_count -= self._latest.popleft()[0].shape[1]

    def _guesses(self, window) -> np.ndarray:
        """(depth, T) the heads' guesses at the window's positions, target ids (-1: none), as a
        verify pass would meet them: Medusa's heads each on its own, the others' chains."""
        trainer, depth = self.trainer, self.depth
        if self.kind == "medusa":
            guesses = trainer.predict(window.features)
            return trainer.d2t[guesses] if trainer.d2t is not None else guesses
        if self.kind == "hydra":
            return trainer.predict_chain(window.features, np.maximum(window.following, 0), depth)
        chain = trainer.predict_chain(window, depth)  # (depth, T - 1): the last position drafts nothing
        return np.concatenate([chain, np.full((depth, 1), -1, chain.dtype)], axis=1)

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

    def _take_step(self) -> float:
        if self._windows_kind:
            windows = self._buffer
            chosen = [windows[i] for i in self._rng.choice(len(windows), min(BATCH_WINDOWS, len(windows)), replace=False)]
            self._trained += sum(len(window.tokens) for window in chosen)
            return float(self.trainer.step_windows(chosen))
        buffer = self._positions
        labelled = buffer.labelled()
        if not len(labelled):
            self._trained += BATCH_POSITIONS
            return 0.0
        rows = self._rng.choice(labelled, min(BATCH_POSITIONS, len(labelled)), replace=False)
        self._trained += len(rows)
        if self.kind == "hydra":
            return float(self.trainer.step(buffer.states[rows], buffer.labels[:, rows], buffer.following[rows]))
        return float(self.trainer.step(buffer.states[rows], buffer.labels[:, rows]))

    def _maybe_publish(self) -> None:
        if self._steps and self._clock() - self._published_at >= PUBLISH_SECONDS:
            self._publish()

    def _publish(self) -> None:
        if self._steps == self._published_steps or self._stopped:  # nothing new
            return
        self._published_steps = self._steps
        self._version += 1
        self._published = (self._version, self.trainer.heads())
        self._published_at = self._clock()

    def _stop_learning(self, why: str) -> None:
        self._stopped = why

    # ---- the end -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the worker (its current step ends first), then take in what the drafter read last
        (a text's unfinished window) and train on it while the budget of the generation allows."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._closed:
            return
        self._closed = True
        self._flush()
        started = self._cpu_clock()
        self._take_windows()
        while self._may_step(idle=False) and self._step():
            self._busy_cpu += self._cpu_clock() - started
            started = self._cpu_clock()
        self._busy_cpu += self._cpu_clock() - started
        self._publish()

    def report(self, kept: Path | None = None) -> LearnReport:
        def chain(pairs) -> tuple[tuple[float, ...], int]:
            if not pairs:
                return (), 0
            report = held_out_report(np.concatenate([guesses for guesses, _ in pairs], axis=1),
                                     np.concatenate([labels for _, labels in pairs], axis=1))
            return (report.chain_accuracy, report.positions) if report.positions else ((), 0)

        first, first_positions = chain(self._first)
        latest, latest_positions = chain(list(self._latest))
        return LearnReport(self.kind, self._steps, self._seen, self._trained, self._busy_cpu, self._busy_seconds,
                           self._idle_cpu, self._swaps, first, latest, first_positions, latest_positions,
                           self._stopped, kept)

    def learned_heads(self):
        """The heads as learned, their training record noting this run; None before a step."""
        if not self._steps:
            return None
        record = dict(self.source.config.training or {})
        online = list(record.get("online", []))
        online.append(self.report().to_dict())
        record["online"] = online
        return self.trainer.heads(record)


# Why a run that asked to learn has nothing that learns, by the backend the draft model runs on.
DRAFT_MODELS_DO_NOT_LEARN = {
    "llama": "llama.cpp's draft models cannot learn online (its weights are fixed in the GGUF)",
    "mlx": "MLX draft models do not learn online yet",
}


class Learning:
    """A command's online learning: a learner for the heads each run drafts with (one per heads
    object, so a chat's turns and a server's requests keep teaching the same one), and at the end
    the learners stopped, the learned heads written where ``keep_path`` says (with ``settings.keep``)
    and their reports. ``explicit``: the user asked for learning (--learn), so a run with nothing
    to learn says why in a note; chat and serve learn by default and say nothing then."""

    def __init__(self, settings: LearnSettings, keep_path: Callable[[object], Path] | None = None,
                 on_note: Callable[[str], None] | None = None, explicit: bool = False, **learner_options) -> None:
        self.settings = settings
        self._learner_options = learner_options  # OnlineLearner's own (tests: inline, window)
        self._keep_path = keep_path
        self._on_note = on_note
        self._explicit = explicit
        self._learners: dict[int, tuple[object, OnlineLearner, Path | None]] = {}
        self._noted = False

    def __call__(self, heads, target) -> OnlineLearner | None:
        """The learner of ``heads`` (None: the method drafts with none) on ``target`` (a Backend)."""
        if heads is None:
            self._note(f"nothing learns: the method drafts with no heads, and only heads learn online "
                       f"({DRAFT_MODELS_DO_NOT_LEARN.get(getattr(target, 'name', ''), DRAFT_MODELS_DO_NOT_LEARN['llama'])})")
            return None
        kind = kind_of(heads)
        if not_learnable(heads):
            self._note(f"nothing learns: {not_learnable(heads)}")
            return None
        found = self._learners.get(id(heads))
        if found is not None:
            return found[1]
        path = None
        if self.settings.keep and self._keep_path is not None:
            path = self._keep_path(heads)
            check_keep_path(path, kind.stored)
        embedding = None
        if kind.embeds == "target" and heads.embed_tokens is None:  # EAGLE-3 reading the target's, frozen
            embedding = target.token_embeddings(range(heads.config.vocab_size))
        learner = OnlineLearner(heads, self.settings, embedding=embedding, **self._learner_options)
        self._learners[id(heads)] = (heads, learner, path)  # the heads kept alive: their id stays theirs
        return learner

    @property
    def learners(self) -> list[OnlineLearner]:
        return [learner for _, learner, _ in self._learners.values()]

    def _note(self, text: str) -> None:
        if self._explicit and not self._noted and self._on_note is not None:
            self._noted = True
            self._on_note(f"--learn: {text}")

    def finish(self) -> list[LearnReport]:
        """Stop every learner; write the learned heads (``settings.keep``), an interrupt held back
        until both files are written; their reports."""
        from specrun.heads.files import save_heads

        reports = []
        with interrupts_held():  # every learner stopped (a step applied whole) and written, then Ctrl-C
            for heads, learner, path in self._learners.values():
                learner.close()
                kept = None
                learned = learner.learned_heads() if path is not None else None
                if learned is not None:
                    save_heads(learned, path, learned.config.training)
                    kept = path
                reports.append(learner.report(kept))
            self._learners.clear()
        return reports


def check_keep_path(path: Path, stored: str) -> None:
    """Fail before the run where the learned heads could not be written to ``path``."""
    from specrun.errors import FileAccessError
    from specrun.fileio import check_writable_folder
    from specrun.training.run import check_eagle3_folder, check_heads_file

    try:
        if stored == "folder":
            check_eagle3_folder(path)
        else:
            check_heads_file(path)
            check_writable_folder(path, "heads file")
    except FileAccessError as error:  # heads train's fix names --heads-out, which these commands lack
        raise FileAccessError(f"--keep-learned: {error.problem}",
                              "pass --heads with specrun's own heads file (or none: the cache), or drop --keep-learned") from None


@contextmanager
def interrupts_held():
    """Ctrl-C waits until the block ends (then raises): the heads and their .json are written as a pair."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda *_: caught.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            raise KeyboardInterrupt
