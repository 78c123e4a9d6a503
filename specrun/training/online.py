"""Heads that keep learning while they draft: online speculative decoding (OSD, Liu et al. 2024).

A heads drafter (drafters/heads/base.py) hands its learner, every few verify passes and at a
text's end, what the target verified: its hidden states at the positions it generated and the
tokens it chose. The learner cuts them into windows of WINDOW_POSITIONS consecutive positions
(what `specrun heads train` trains on: training/run.py); the worker (training/learner.py, with its
budget, buffer and swaps) takes small AdamW steps on batches drawn from them, the projections over
the draft vocabulary left as they are (their update was most of a step's cost). The labels are
the tokens the target chose; with --learn-labels distributions, heads that read the state the
target's output head reads (Medusa, Hydra, EAGLE) learn its distribution behind each instead
(soft labels, as OSD and DistillSpec distil): the state times the target's output rows over the
draft vocabulary (``teacher_rows``) is the distribution that chose the label, computed for a
step's batch only. EAGLE-3 heads read other layers and learn the tokens. A draft model's learner
is training/online_draft.py's; ``Learning`` keeps a command's learners of both.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specrun.fileio import interrupts_held
from specrun.heads.kinds import kind_of, TRAINABLE_KINDS
from specrun.heads.layers import teacher_distributions
from specrun.training.learner import BATCH_POSITIONS, LearnReport, LearnSettings, Learner
from specrun.training.online_draft import DraftLearner, draft_cannot_learn, load_adapters, save_adapters
from specrun.training.run import next_tokens, target_labels, trainer_class

WINDOW_POSITIONS = 64  # positions per window, as the buffer keeps them and the report scores them
BATCH_WINDOWS = 1  # windows per step (EAGLE, EAGLE-3)
# The target's output rows kept for soft labels at most (SmolLM2's whole vocabulary at 576 wide is
# 108 MiB; specrun's heads draft over 4,096 tokens): past it, heads learn the target's tokens.
TEACHER_MAX_BYTES = 128 << 20
# What heads may learn of the target's (--learn-labels): the tokens it chose (the default: measured
# here, its distributions raised acceptance no more, at ~1.4x a Medusa step: docs/perf.md 3(t)).
LEARN_LABELS = ("tokens", "distributions")


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


class _Reader:
    """One text's run of positions read (its drafter's), cut into windows for a learner's worker."""

    def __init__(self, learner: OnlineLearner) -> None:
        self.learner = learner
        self.run = _Run()

    def observe(self, first: int, states: np.ndarray | None, context: Sequence[int]) -> None:
        learner = self.learner
        learner._active(learner._clock())
        if learner._stopped:
            return
        if states is None or len(states) == 0:
            if states is None:
                self.flush()
            return
        if self.run.count and first != self.run.end:
            self.flush()
        run = self.run
        if not run.count:
            run.first = first
            run.tokens = [int(context[first])]
        run.states.append(np.asarray(states, np.float32))
        run.tokens.extend(int(token) for token in context[run.end + 1 : run.end + len(states) + 1])
        run.count += len(states)
        while self.run.count >= learner.window:
            self._cut(learner.window)
        if learner._inline:
            learner._work_inline()

    def _cut(self, count: int) -> None:
        """The run's first ``count`` positions as a window, to the worker."""
        from specrun.training.eagle import EagleWindow

        run = self.run
        states = np.concatenate(run.states)
        tokens = np.asarray(run.tokens, np.int64)
        if len(tokens) > count:
            self.learner._hand(EagleWindow(states[:count], tokens[:count], tokens[1 : count + 1]))
        rest = states[count:]
        self.run = _Run(run.first + count, [rest] if len(rest) else [], len(rest), run.tokens[count:])

    def flush(self) -> None:
        run, self.run = self.run, _Run()  # taken first: a slot's thread and the closing one may both flush
        if run.count >= 2:
            self.run = run
            self._cut(run.count)
            self.run = _Run()


class SlotReader:
    """A server slot's drafter's view of a learner its slots share (OnlineLearner.reader): what
    it reads goes to the one worker through a run of its own; the weights it drafts with are the
    learner's latest; each slot's cache counts towards the generation the budget is a share of."""

    def __init__(self, learner: OnlineLearner, reader: _Reader) -> None:
        self._learner, self._reader = learner, reader
        self.source = learner.source

    def observe(self, first: int, states: np.ndarray | None, context: Sequence[int]) -> None:
        self._reader.observe(first, states, context)

    def start_text(self) -> None:
        self._reader.flush()

    def watch(self, progress: Callable[[], int]) -> None:
        self._watched = progress
        self._learner.watch_also(progress)

    def release(self) -> None:
        """Its slot is closed: what it read last goes to the worker, and the learner lets go of
        it (its run, and the cache it watched)."""
        self._reader.flush()
        self._learner.let_go(self._reader, getattr(self, "_watched", None))

    def latest(self, version: int):
        return self._learner.latest(version)

    def fail(self, why: str) -> None:
        self._learner.fail(why)


class OnlineLearner(Learner):
    """One heads object learning from what the target verifies (see the module's docstring): its
    drafter hands it the target's states (``observe``)."""

    def __init__(self, heads, settings: LearnSettings = LearnSettings(), *, embedding: np.ndarray | None = None,
                 teacher: np.ndarray | None = None,
                 seed: int = 0, window: int = WINDOW_POSITIONS, inline: bool = False, inline_steps: int = 1,
                 clock: Callable[[], float] = time.monotonic, cpu_clock: Callable[[], float] = time.thread_time) -> None:
        kind = kind_of(heads)
        if not_learnable(heads):
            raise ValueError(f"these {kind.name} heads do not learn online: {not_learnable(heads)}")
        super().__init__(settings, heads.config.num_heads, seed=seed, inline=inline, inline_steps=inline_steps,
                         clock=clock, cpu_clock=cpu_clock)
        self.kind = kind.name
        self.source = heads
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
        if teacher is not None and kind.reads != "hidden":
            raise ValueError(f"{kind.name} heads read the target's layers, not the state its output head reads: "
                             "they learn its tokens")
        self._teacher = None if teacher is None else np.asarray(teacher, np.float32)
        if self._teacher is not None:
            self.labels = "distributions"
        self.window = window
        self._windows_kind = kind.trains_on == "windows"
        self._buffer: deque = deque()  # EAGLE's windows (EagleWindow), oldest first
        self._positions = _Positions(settings.buffer_tokens)  # Medusa's and Hydra's positions
        self._buffered = 0
        self._t2d = None
        if heads.d2t is not None:  # a target id (and -1, last) to its draft id, -1 outside the draft vocabulary
            self._t2d = np.full(int(heads.config.vocab_size) + 1, -1, np.int64)
            self._t2d[heads.d2t] = np.arange(len(heads.d2t))
        self._reader = _Reader(self)  # its own drafter's (observe)
        self._readers: list[_Reader] = []  # the slots' drafters' (reader)
        self._start()

    # ---- the drafter's side ------------------------------------------------------------------
    def observe(self, first: int, states: np.ndarray | None, context: Sequence[int]) -> None:
        """The target's states (n, H) at the positions first .. first + n - 1 of ``context``, all
        of them verified (the target's own tokens follow each); None where they could not be read.
        Called between verify passes."""
        self._reader.observe(first, states, context)

    def reader(self) -> SlotReader:
        """What one more drafter of these heads hands its text's states through (a server's slot:
        each reads a text of its own, all of them teach these weights)."""
        reader = _Reader(self)
        with self._lock:
            self._readers.append(reader)
        return SlotReader(self, reader)

    @property
    def buffered_positions(self) -> int:
        return self._buffered if self._windows_kind else self._positions.size

    def _flush(self) -> None:
        self._reader.flush()

    def let_go(self, reader: _Reader, progress: Callable[[], int] | None) -> None:
        """A slot's reader, and the cache it watched, no longer held (its slot closed)."""
        with self._lock:
            self._readers = [each for each in self._readers if each is not reader]
            self._also = [each for each in self._also if each is not progress]

    def _flush_all(self) -> None:
        """Every reader's unfinished run to the worker (the learner closes)."""
        for reader in [self._reader, *self._readers]:
            reader.flush()

    # ---- the worker's ----------------------------------------------------------------------------
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

    def _labels(self, window) -> np.ndarray:
        return target_labels([window.following], self.depth)

    def _snapshot(self):
        return self.trainer.heads()

    def _take_step(self) -> float:
        if self._windows_kind:
            windows = self._buffer
            chosen = [windows[i] for i in self._rng.choice(len(windows), min(BATCH_WINDOWS, len(windows)), replace=False)]
            self._trained += sum(len(window.tokens) for window in chosen)
            if self._teacher is None:
                return float(self.trainer.step_windows(chosen))
            return float(self.trainer.step_windows(chosen, self._teacher))
        buffer = self._positions
        labelled = buffer.labelled()
        if not len(labelled):
            self._trained += BATCH_POSITIONS
            return 0.0
        rows = self._rng.choice(labelled, min(BATCH_POSITIONS, len(labelled)), replace=False)
        self._trained += len(rows)
        soft = self._soft_labels(rows)
        if self.kind == "hydra":
            return float(self.trainer.step(buffer.states[rows], buffer.labels[:, rows], buffer.following[rows], soft))
        return float(self.trainer.step(buffer.states[rows], buffer.labels[:, rows], soft))

    def _soft_labels(self, rows: np.ndarray) -> np.ndarray | None:
        """(depth, len(rows), Vd): head i's soft label at each of the buffer's ``rows``, the
        target's distribution at position p + 1 + i (the state that chose its label: the row 1 + i
        on in the ring, as a window's rows are kept in order and each while an older one is; taken
        modulo the arrays' length, which is the ring's once full and past every labelled row's
        before; what it gives where a head has no label goes unread); None without a teacher."""
        if self._teacher is None:
            return None
        buffer = self._positions
        rows_kept = len(buffer.states)
        return np.stack([teacher_distributions(buffer.states[(rows + 1 + i) % rows_kept], self._teacher)
                         for i in range(self.depth)])

    def learned_heads(self):
        """The heads as learned, their training record noting this run; None before a step."""
        if not self._steps:
            return None
        record = dict(self.source.config.training or {})
        online = list(record.get("online", []))
        online.append(self.report().to_dict())
        record["online"] = online
        return self.trainer.heads(record)


class Learning:
    """A command's online learning: a learner for the heads each run drafts with (one per heads
    object, so a chat's turns and a server's requests keep teaching the same one) and for its draft
    model where that can learn (``draft``: training/online_draft.py), and at the end the learners
    stopped, the learned heads written where ``keep_path`` says and a draft model's adapters where
    ``draft_keep_path`` says (with ``settings.keep``: a draft then starts from the adapters it kept
    before), and their reports. ``explicit``: the user asked for learning
    (--learn), so a run with nothing to learn says why in a note; chat and serve learn by default
    and say nothing then. ``soft_labels``: heads learn the target's distributions where they can
    (--learn-labels distributions; False, the default: its tokens; benchmarks/online_learning.py
    compares the two), and a draft model where its passes bring them (online_draft.py)."""

    def __init__(self, settings: LearnSettings, keep_path: Callable[[object], Path] | None = None,
                 on_note: Callable[[str], None] | None = None, explicit: bool = False,
                 draft_keep_path: Callable[[object], Path] | None = None, soft_labels: bool = False,
                 **learner_options) -> None:
        self.settings = settings
        self._soft_labels = soft_labels
        self._learner_options = learner_options  # OnlineLearner's own (tests: inline, window)
        self._keep_path = keep_path
        self._draft_keep_path = draft_keep_path
        self._on_note = on_note
        self._explicit = explicit
        self._learners: dict[int, tuple[object, Learner, Path | None]] = {}
        self._noted = False

    @property
    def explicit(self) -> bool:
        """Did the user ask for learning (--learn, --keep-learned), rather than take the default?"""
        return self._explicit

    def __call__(self, heads, target) -> OnlineLearner | None:
        """The learner of ``heads`` (None: the method drafts with none) on ``target`` (a Backend)."""
        if heads is None:
            self._note("nothing learns: the method drafts with no heads and no draft model, and only those learn online")
            return None
        kind = kind_of(heads)
        if not_learnable(heads):
            drafts = any(isinstance(learner, DraftLearner) for _, learner, _ in self._learners.values())
            self._note(f"{'the heads do not learn' if drafts else 'nothing learns'}: {not_learnable(heads)}")
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
        teacher = None
        if self._soft_labels:  # asked for (--learn-labels distributions): where it cannot be, a note says why
            teacher, why = teacher_rows(heads, target) if kind.reads == "hidden" else (
                None, f"{kind.name} heads read the target's layers, not the state its output head reads")
            if teacher is None and self._on_note is not None:
                self._on_note(f"--learn-labels distributions: the {kind.name} heads learn the target's tokens: {why}")
        learner = OnlineLearner(heads, self.settings, embedding=embedding, teacher=teacher, **self._learner_options)
        self._learners[id(heads)] = (heads, learner, path)  # the heads kept alive: their id stays theirs
        return learner

    def reader_for(self, heads, target) -> SlotReader | None:
        """A server slot's reader of the learner of ``heads`` (made once, as ``self(heads, target)``
        makes it), through which its drafter's text teaches the same weights; None (and no note)
        where the heads do not learn."""
        if heads is None or not_learnable(heads):
            return None
        learner = self(heads, target)
        return learner.reader() if learner is not None else None

    def draft(self, draft, alone: bool = True):
        """The learner of ``draft`` (a Backend: the draft model), None where it cannot learn (a
        note says why: "nothing learns" where it is ``alone`` in learning, no heads beside it)."""
        problem = draft_cannot_learn(draft)
        if problem:
            self._note(f"nothing learns: {problem}" if alone else f"the draft model does not learn: {problem}")
            return None
        found = self._learners.get(id(draft))
        if found is not None:
            return found[1]
        path = None
        if self.settings.keep and self._draft_keep_path is not None:
            path = self._draft_keep_path(draft)
            check_adapters_path(path)
        options = {key: value for key, value in self._learner_options.items() if key != "embedding"}
        try:
            learner = DraftLearner(draft, self.settings, soft_labels=self._soft_labels, **options)
        except Exception as error:  # noqa: BLE001 — a model mlx-lm cannot put adapters on still drafts
            self._note(f"the draft model does not learn: {error}")
            return None
        if path is not None and path.exists():
            self._start_from_kept(draft, learner, path)
        self._learners[id(draft)] = (draft, learner, path)
        return learner

    def _start_from_kept(self, draft, learner: DraftLearner, path: Path) -> None:
        """The draft drafts, and goes on learning, from the adapters an earlier run kept at
        ``path``; where they cannot be used, from none (a note says why; the end writes the file anew)."""
        say = self._on_note or (lambda _: None)
        try:
            learner.trainer.load_adapter_arrays(load_adapters(path, draft_name(draft)))
        except ValueError as error:
            say(f"--keep-learned: the draft's adapters in {path} cannot be used ({error}); it learns afresh, "
                "and what it learns is written there at the end")
            return
        try:
            draft.adapt(learner.trainer.weights())
        except Exception as error:  # noqa: BLE001 - weights the drafting model cannot take: it drafts as shipped
            learner.fail(f"the draft model could not take the kept adapters ({error})")
            say(f"--keep-learned: the draft model could not take the adapters in {path} ({error}); it drafts "
                "as shipped and learns nothing this run")
            return
        say(f"--keep-learned: the draft model drafts with the adapters it learned in earlier runs ({path})")

    @property
    def learners(self) -> list[Learner]:
        return [learner for _, learner, _ in self._learners.values()]

    def _note(self, text: str) -> None:
        if self._explicit and not self._noted and self._on_note is not None:
            self._noted = True
            self._on_note(f"--learn: {text}")

    def finish(self) -> list[LearnReport]:
        """Stop every learner; write the learned heads (``settings.keep``), an interrupt held back
        until both files are written; their reports."""
        from specrun.heads.files import save_heads

        reports, failures = [], []
        with interrupts_held():  # every learner stopped (a step applied whole) and written, then Ctrl-C
            for model, learner, path in self._learners.values():
                learner.close()
                kept = None
                try:  # one file that cannot be written leaves the others' to be
                    if isinstance(learner, DraftLearner):
                        adapters = learner.learned_adapters() if path is not None else None
                        if adapters is not None:
                            save_adapters(path, adapters, draft_name(model))
                            kept = path
                    else:
                        learned = learner.learned_heads() if path is not None else None
                        if learned is not None:
                            save_heads(learned, path, learned.config.training)
                            kept = path
                except Exception as error:  # noqa: BLE001 - raised once every learner is done
                    failures.append(error)
                reports.append(learner.report(kept))
                said = reports[-1]
                if (isinstance(learner, DraftLearner) and learner.soft and said.seen and not said.stopped
                        and not learner.rows_offered and self._on_note is not None):
                    self._on_note("--learn-labels distributions: the draft model had the target's tokens only: no "
                                  "pass brought its distributions to the host (greedy passes keep them on the "
                                  "device; sampling with --temp above 0 brings them)")
            self._learners.clear()
        if failures:
            raise failures[0]
        return reports


def teacher_rows(heads, target) -> tuple[np.ndarray | None, str]:
    """The target's output rows over the heads' draft vocabulary (Vd, H), from which heads that
    read the state its output head reads learn its distributions (soft labels), and ""; or None
    and why not: the state times them is not the target's logits (``logits_beyond_rows``: a
    soft-cap, a scale, a bias), the backend cannot read them (or there is none), or they would
    weigh more than TEACHER_MAX_BYTES. The heads then learn its tokens."""
    ids = heads.d2t if heads.d2t is not None else np.arange(heads.config.vocab_size)
    weight = len(ids) * heads.config.hidden_size * 4
    if target is None:
        return None, "there is no target to read them from"
    if weight > TEACHER_MAX_BYTES:
        return None, (f"its output rows over the heads' {len(ids)} draft tokens would take {weight >> 20} MiB "
                      f"(at most {TEACHER_MAX_BYTES >> 20})")
    try:
        beyond = target.logits_beyond_rows()
        if beyond:
            return None, beyond
        if int(np.max(ids)) >= target.vocab.size:
            return None, "the heads' vocabulary is larger than the target's"
        rows = np.asarray(target.output_rows(ids), np.float32)
    except Exception as error:  # noqa: BLE001 - rows it cannot read (a quantization gguf cannot undo): tokens
        return None, f"its output rows cannot be read ({error})"
    if rows.shape != (len(ids), heads.config.hidden_size):
        return None, f"its output rows are {rows.shape[-1]} wide, the heads {heads.config.hidden_size}"
    return rows, ""


def draft_name(draft) -> str:
    """The name a draft model's kept adapters are written for and checked against: its folder's
    name and a digest of where it is (two drafts in folders both named ``mlx`` are two drafts)."""
    where = Path(getattr(draft, "path", "") or type(draft).__name__)
    digest = hashlib.sha256(str(where.expanduser().resolve()).encode()).hexdigest()[:8]
    return f"{where.name}-{digest}"


def check_adapters_path(path: Path) -> None:
    """Fail before the run where a draft's learned adapters could not be written to ``path``."""
    from specrun.errors import FileAccessError
    from specrun.fileio import check_writable_folder

    try:
        check_writable_folder(path, "draft adapters file")
    except FileAccessError as error:
        raise FileAccessError(f"--keep-learned: {error.problem}",
                              "free the place in specrun's cache, or drop --keep-learned") from None


def check_keep_path(path: Path, stored: str) -> None:
    """Fail before the run where the learned heads could not be written to ``path``."""
    from specrun.errors import FileAccessError
    from specrun.fileio import check_writable_folder
    from specrun.training.run import check_eagle3_folder, check_heads_file

    instead = "pass --heads with specrun's own heads file (or none: the cache), or drop --keep-learned"
    try:
        if stored == "folder":
            check_eagle3_folder(path)
        else:
            check_heads_file(path, instead)
            check_writable_folder(path, "heads file")
    except FileAccessError as error:  # heads train's fix names --heads-out, which these commands lack
        fix = error.fix if error.fix.endswith(instead) else instead
        raise FileAccessError(f"--keep-learned: {error.problem}", fix) from None
