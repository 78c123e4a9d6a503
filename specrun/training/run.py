"""`specrun heads train`: Medusa, Hydra or EAGLE heads for a target, trained on this machine within a time budget.

The run: gather data (a share of the budget), pick the draft vocabulary, train, report on the
held-out windows, write the heads. Data are windows of the target's own tokens with its hidden
state at every position (training/data.py says where they come from); a head's label at position p
is the target's own token at p + 2 + i, its greedy next token after p + 1 + i, so what a head is
scored on is what a verify pass would accept; in a continued prompt only the generated tokens are
labels. The draft vocabulary is the target's most frequent next tokens in the training windows.
Medusa trains on shuffled positions; Hydra (training/hydra.py) too, each position with the
tokens after it that its heads read, and is reported on the chains it drafts by itself; EAGLE
(training/eagle.py) on whole windows, its layer reading the positions before each, and is
reported on its own chains too.

Checkpoints (every ~30 s) go to ``<out>.ckpt/``: the heads through the same writer as the final
file, the optimizer's state and the data's tokens. A second run with the same settings resumes
there: the budget counts the seconds already spent, and a larger --minutes trains on. A Ctrl-C
keeps the last checkpoint (TrainingInterrupted says where); a finished run removes it.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import platform
import shutil
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specrun.errors import FileAccessError, SpecrunError, UsageError
from specrun.fileio import check_writable_folder, in_use, interrupts_held, is_special, write_atomically
from specrun.heads.config import HeadsConfig, training_layer_ids
from specrun.heads.kinds import BY_NAME, TRAINABLE_KINDS, WINDOW_KINDS
from specrun.sampling import MAX_SEED
from specrun.training.data import (
    builtin_python_prompts,
    builtin_questions,
    cut_windows,
    read_prompts_file,
    read_text_folder,
    text_pieces,
)

DATA_SHARE = 0.4  # of the budget, at most, for gathering data: generation is the slow part
CHECKPOINT_SECONDS = 30.0
MAX_MINUTES = 7 * 24 * 60  # --minutes: a week (inf ran for ever, whatever --max-steps said)
MAX_RECORD_SECONDS = 60.0 * MAX_MINUTES  # a checkpoint's record claiming more was edited
HELD_OUT_SHARE = 0.1  # of the windows, kept out of training for the report
TEXT_WINDOW_TOKENS = 128
SHORTEST_WINDOW = 8
TEXT_PIECE_CHARS = 256  # text is tokenized in pieces of lines: a tokenizer warns about long inputs, and is slow on them
CONTINUATION_TOKENS = 96  # new tokens per prompt when the target continues it
MAX_PROMPT_TOKENS = 320  # a longer prompt keeps its last tokens (a chat prompt ends in the assistant's turn)
GENERATION_BATCH = 32  # prompts continued together (one left-padded batch)
STATES_BATCH = 8  # text windows per hidden-state pass
BATCH_POSITIONS = 128  # positions per training step (Medusa, Hydra)
BATCH_WINDOWS = 4  # windows per training step (EAGLE)
BUILTIN_PROMPTS = 4096
MAX_EVAL_PROMPTS = 256  # --eval-prompts continued for the report on unlike prompts, at most
LOSS_WINDOW = 20  # steps the reported loss is averaged over


@dataclass(frozen=True)
class HeadsTrainRequest:
    """What to train. ``out``: the heads file (None: specrun's cache for the target).
    ``text_dir`` or ``prompts_file``: the data (neither: built-in prompts). ``eval_prompts_file``:
    prompts unlike the data, never trained on, the finished heads are also reported on (the
    target's continuations of them): what auto then expects of the heads."""

    target: str
    kind: str = "medusa"
    out: Path | None = None
    num_heads: int = 4
    num_layers: int = 1
    draft_vocab: int = 4096
    minutes: float = 10.0
    text_dir: Path | None = None
    prompts_file: Path | None = None
    eval_prompts_file: Path | None = None
    learning_rate: float = 1e-3
    seed: int = 0
    registry: Path | None = None
    backend: str = "auto"  # llama: llama.cpp's hidden states, NumPy training; mlx: both in MLX
    threads: int | None = None  # llama.cpp's threads while gathering data


@dataclass(frozen=True)
class TrainProgress:
    """Where a run is: gathering data (``phase`` "data", ``tokens`` so far) or training."""

    phase: str
    elapsed: float  # seconds of the budget spent, earlier runs of a resumed training included
    budget: float
    tokens: int = 0
    step: int = 0
    loss: float | None = None
    max_steps: int | None = None


@dataclass(frozen=True)
class HeldOutReport:
    """How the heads guess the target's own tokens on held-out windows.

    head_accuracy[i]: head i's top-1 accuracy against the target's token at p + 2 + i.
    chain_accuracy[i]: the same, counted only where heads 0..i-1 were all right (a chain of
    top-1 guesses reaches head i only then). tokens_per_pass: 1 + the mean number of leading
    right guesses, the tokens a verify pass of that chain yields.
    """

    head_accuracy: tuple[float, ...]
    chain_accuracy: tuple[float, ...]
    tokens_per_pass: float
    positions: int

    def to_dict(self) -> dict:
        return {
            "head_accuracy": [round(value, 4) for value in self.head_accuracy],
            "chain_accuracy": [round(value, 4) for value in self.chain_accuracy],
            "tokens_per_pass": round(self.tokens_per_pass, 4),
            "positions": self.positions,
        }


@dataclass(frozen=True)
class HeadsTrainResult:
    path: Path
    steps: int
    seconds: float
    final_loss: float
    report: HeldOutReport
    source: str
    resumed_at: int | None = None  # the checkpoint's step when the run resumed
    other: HeldOutReport | None = None  # on the eval prompts, where given


def no_step_taken(minutes: float, elapsed: float, checkpoints: Path) -> SpecrunError:
    """The refusal of a budget that ran out before the first training step: what it would write
    never trained (the checkpoint stays, so a larger --minutes resumes past the work done)."""
    return SpecrunError(
        f"--minutes {minutes:g} ran out before the first training step ({elapsed:.0f} s went to preparing it): "
        "nothing written",
        f"pass a larger --minutes, e.g. --minutes {max(10, math.ceil(2 * elapsed / 60))}; the same command resumes "
        f"from {checkpoints}")


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during training: ``checkpoint`` (None before the first) is kept, at ``step``."""

    def __init__(self, checkpoint: Path | None, step: int) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.step = step

    def where(self) -> str:
        if self.checkpoint is None:
            return "no checkpoint had been written yet"
        return f"the checkpoint at step {self.step} is kept in {self.checkpoint}; run the same command to resume"


@dataclass
class _Data:
    """Windows of target tokens, each with its hidden states (T, H) and the target's next tokens
    (T,), -1 before ``label_from``: a prompt's own tokens are no labels, since heads draft what the
    target generates (and chat prompts share a long template a head would learn instead)."""

    tokens: list[list[int]] = field(default_factory=list)
    states: list[np.ndarray] = field(default_factory=list)
    following: list[np.ndarray] = field(default_factory=list)
    label_from: list[int] = field(default_factory=list)

    def add(self, tokens: list[int], states: np.ndarray, following: np.ndarray, label_from: int = 0) -> None:
        if len(tokens) - label_from >= 2:
            self.tokens.append(list(tokens))
            self.states.append(states)
            self.following.append(np.where(np.arange(len(following)) < label_from, -1, following))
            self.label_from.append(label_from)

    @property
    def token_count(self) -> int:
        return sum(len(tokens) for tokens in self.tokens)


def check_request(request: HeadsTrainRequest) -> None:
    """Usage errors, before anything is read or loaded."""
    if request.kind not in TRAINABLE_KINDS:
        raise UsageError(f"unknown --kind {request.kind!r}", f"use one of: {', '.join(TRAINABLE_KINDS)}")
    if request.kind in WINDOW_KINDS and request.num_layers != 1:
        raise UsageError(f"EAGLE heads are one layer, got --num-layers {request.num_layers}", "leave --num-layers out")
    if request.text_dir is not None and request.prompts_file is not None:
        raise UsageError("--text and --prompts are two data sources", "pass one of them")
    if not 0 < request.minutes <= MAX_MINUTES:
        raise UsageError(f"--minutes must be more than 0 and at most {MAX_MINUTES} (a week), got {request.minutes:g}",
                         "pass a budget, e.g. --minutes 10")
    checks = (("--num-heads", request.num_heads, 1, 16), ("--num-layers", request.num_layers, 1, 8),
              ("--draft-vocab", request.draft_vocab, 2, 1 << 22))
    for name, value, low, high in checks:
        if not low <= value <= high:
            raise UsageError(f"{name} must be between {low} and {high}, got {value}", f"pass a valid {name}")
    if not 0 < request.learning_rate <= 1:
        raise UsageError(f"--lr must be more than 0 and at most 1, got {request.learning_rate:g}", "pass e.g. --lr 1e-3")
    if not 0 <= request.seed <= MAX_SEED:
        raise UsageError(f"--seed must be a non-negative 64-bit integer, got {request.seed}", "pass e.g. --seed 0")
    if request.threads is not None and not 1 <= request.threads <= 1024:
        raise UsageError(f"--threads must be between 1 and 1024, got {request.threads}", "pass a valid --threads")
    if request.out is not None:
        out = Path(request.out).expanduser()
        if BY_NAME[request.kind].stored == "file" and out.suffix != ".safetensors":
            raise UsageError(f"--heads-out {out} does not end in .safetensors: {request.kind} heads are a "
                             ".safetensors file (and a .json beside it)", "name a .safetensors file")
        if checkpoint_folder(out) == out:
            raise UsageError(f"--heads-out {out} ends in .ckpt, the name of the run's checkpoint folder",
                             "name the heads otherwise")


EAGLE3_FILES = ("config.json", "model.safetensors")


def check_eagle3_folder(out: Path) -> None:
    """EAGLE-3 heads are a folder (heads.files.save_eagle3): fail now where ``out`` is a file,
    holds anything but earlier heads' two files (a model's own folder would lose its config.json),
    or cannot be written."""
    fix = "name a new folder (or one that holds EAGLE-3 heads) for --heads-out"
    if out.exists() and not out.is_dir():
        raise FileAccessError(f"the heads folder {out} is a file", fix)
    others = sorted(path.name for path in out.iterdir() if path.name not in EAGLE3_FILES) if out.is_dir() else []
    if others:
        raise FileAccessError(f"{out} holds files of its own ({_first_of(others)}); EAGLE-3 heads are written there "
                              f"as {' and '.join(EAGLE3_FILES)}", fix)
    # Where the folder is yet to be made, its parent is what must take it (nothing made before the run is).
    check_writable_folder(out / EAGLE3_FILES[0] if out.is_dir() else out, "heads folder")


def default_heads_path(target: str, kind: str) -> Path:
    from specrun.registry.heads import heads_cache_path

    return heads_cache_path(target, kind)


def checkpoint_folder(out: Path) -> Path:
    return Path(out).with_suffix(".ckpt")


# What a checkpoint folder holds (_Run._checkpoint, _write_data): a folder holding anything else
# is not one, and is neither resumed from nor removed.
CHECKPOINT_FILES = ("data.npz", "optimizer.safetensors", "heads.safetensors", "heads.json", "heads")


def check_checkpoint_folder(folder: Path, files: tuple[str, ...] = CHECKPOINT_FILES,
                            fix: str = "move it away, or name the heads otherwise with --heads-out") -> None:
    """Fail where the checkpoint's place is taken by something a run did not write: a file, or a
    folder with other ``files`` in it (a run removes its checkpoint when it ends)."""
    if folder.exists() and not folder.is_dir():
        raise FileAccessError(f"{folder}, where the run keeps its checkpoint, is a file", fix)
    if folder.is_dir():  # hidden files are a killed save's scratch (.data.npz.1a2b.tmp) or the desktop's
        others = sorted(path.name for path in folder.iterdir()
                        if path.name not in files and not path.name.startswith("."))
        if others:
            raise FileAccessError(f"{folder}, where the run keeps its checkpoint, holds files of its own "
                                  f"({_first_of(others)})", fix)


def check_heads_file(out: Path, instead: str = "name a new file (or earlier heads) for --heads-out") -> None:
    """Fail where ``out`` or the .json beside it exists and is not specrun heads': a run would
    write over another file (a model's weights, a project's package.json). The fix ends in
    ``instead``; where the file is in specrun's cache (a damaged copy of specrun's own, which no
    message told how to get rid of) it says to delete that file first."""
    from specrun.heads.files import is_specrun_heads_file

    for path in (out, out.with_suffix(".json")):
        if path.exists() and not is_specrun_heads_file(path):
            raise FileAccessError(f"{path} exists and is not specrun heads: training would write over it",
                                  f"{_delete_if_cached(path)}{instead}")


def _delete_if_cached(path: Path) -> str:
    """"delete PATH ..., or " where the file ``path`` is in specrun's cache, else ""."""
    from specrun.modelkit.demo import cache_dir

    try:
        cached = path.resolve().is_relative_to(cache_dir().resolve())
    except OSError:
        return ""
    return f"delete {path} (a damaged file in specrun's cache), or " if cached else ""


def train_heads(
    request: HeadsTrainRequest,
    on_progress: Callable[[TrainProgress], None] | None = None,
    on_note: Callable[[str], None] | None = None,
    *,
    max_steps: int | None = None,
    checkpoint_seconds: float = CHECKPOINT_SECONDS,
) -> HeadsTrainResult:
    """Train heads as ``request`` says and write them; ``max_steps`` (tests) stops training early."""
    check_request(request)
    texts = read_text_folder(request.text_dir) if request.text_dir is not None else None
    prompts = read_prompts_file(request.prompts_file) if request.prompts_file is not None else None
    evaluated = (read_prompts_file(request.eval_prompts_file, "--eval-prompts") if request.eval_prompts_file is not None
                 else None)
    out = Path(request.out).expanduser() if request.out is not None else default_heads_path(request.target, request.kind)
    if BY_NAME[request.kind].stored == "folder":
        check_eagle3_folder(out)
    else:
        check_heads_file(out)
        check_writable_folder(out, "heads file", "pass another --heads-out")
    with in_use(out, "--heads-out", "wait for that run to end, or pass another --heads-out"):
        check_checkpoint_folder(checkpoint_folder(out))
        target, trainer_class = open_heads_target(request)
        try:
            run = _Run(request, target, out, on_progress or (lambda progress: None), on_note or (lambda note: None),
                       max_steps, checkpoint_seconds, trainer_class)
            return run.train(texts, prompts, evaluated)
        finally:
            target.close()


def open_heads_target(request: HeadsTrainRequest):
    """The target to gather data from (a ``specrun.backends.heads_target.HeadsTarget``) and the
    trainer class of ``request.kind`` (``TRAINERS``), on the backend the target runs on here
    (``choose_backend``: MLX on Apple Silicon, llama.cpp for a GGUF elsewhere, where MLX's CPU
    build multiplies matrices ~10x slower than llama.cpp and NumPy; training/medusa.py)."""
    from specrun.registry.catalog import load_registry
    from specrun.registry.loading import choose_backend, resolve_gguf, resolve_mlx

    entries = load_registry(request.registry)
    backend = choose_backend(request.backend, request.target, entries)
    if backend == "llama":
        from specrun.backends.heads_llama import LlamaHeadsTarget

        target = LlamaHeadsTarget(resolve_gguf(request.target, entries), request.threads)
    else:
        from specrun.backends.heads_mlx import MlxHeadsTarget

        target = MlxHeadsTarget(resolve_mlx(request.target, entries))
    if BY_NAME[request.kind].reads == "layers":  # the outputs of three of the target's layers
        try:
            target.use_layers(training_layer_ids(target.num_layers))
        except BaseException:
            target.close()
            raise
    return target, trainer_class(request.kind, backend)


# The trainer of each trainable kind (heads.kinds.TRAINABLE_KINDS), as "module:class", imported
# when asked for: every kind trains in NumPy, beside whichever backend gives the data; on MLX,
# Medusa's trains in MLX itself (MLX_TRAINERS).
TRAINERS = {
    "medusa": "specrun.training.medusa:NumpyHeadsTrainer",
    "hydra": "specrun.training.hydra:NumpyHydraTrainer",
    "eagle": "specrun.training.eagle:NumpyEagleTrainer",
    "eagle3": "specrun.training.eagle3:NumpyEagle3Trainer",
}
MLX_TRAINERS = {"medusa": "specrun.backends.heads_mlx:MlxHeadsTrainer"}


def trainer_class(kind: str, backend: str) -> type:
    """The class that trains ``kind`` heads on data from ``backend`` ("llama" or "mlx")."""
    import importlib

    module, name = ((MLX_TRAINERS if backend == "mlx" else {}).get(kind) or TRAINERS[kind]).split(":")
    return getattr(importlib.import_module(module), name)


class _Run:
    """One training run's state: the clock, the data, the trainer and the checkpoints."""

    def __init__(self, request, target, out, on_progress, on_note, max_steps, checkpoint_seconds,
                 trainer_class) -> None:
        self.request = request
        self.target = target
        self.trainer_class = trainer_class  # a class of TRAINERS, or of MLX_TRAINERS on MLX
        self.out = out
        self.checkpoints = checkpoint_folder(out)
        self.on_progress = on_progress
        self.on_note = on_note
        self.max_steps = max_steps
        self.checkpoint_seconds = checkpoint_seconds
        self.budget = request.minutes * 60.0
        self.started = time.monotonic()
        self.spent_before = 0.0  # seconds of earlier runs of a resumed training
        self.step = 0
        self.losses: list[float] = []
        self.saved_step: int | None = None  # the checkpoint on disk

    def elapsed(self) -> float:
        return self.spent_before + time.monotonic() - self.started

    def train(self, texts: list[str] | None, prompts: list[str] | None,
              evaluated: list[str] | None = None) -> HeadsTrainResult:
        try:
            return self._train(texts, prompts, evaluated)
        except KeyboardInterrupt:
            kept = self.checkpoints if self.saved_step is not None else None
            raise TrainingInterrupted(kept, self.saved_step or 0) from None

    def _train(self, texts, prompts, evaluated=None) -> HeadsTrainResult:
        source = self._source()
        settings = self._settings(source)
        resumed = self._resume(settings)
        if resumed is not None:
            data, held_out, trainer = resumed
            self.on_note(f"resuming the checkpoint in {self.checkpoints} at step {self.step}")
        else:
            data = self._gather(texts, prompts)
            held_out = self._hold_out(len(data.tokens))
            trainer = self._fresh_trainer(data, held_out)
            with interrupts_held():  # the data and the first checkpoint whole, then Ctrl-C: it resumes there
                # a FIFO or device the last run's files were replaced by (EAGLE-3's heads: a folder of their own)
                remove_special(self.checkpoints, CHECKPOINT_FILES + tuple(f"heads/{name}" for name in EAGLE3_FILES))
                self._write_data(data, held_out)
                self._checkpoint(trainer, settings, source)
        resumed_at = self.step if resumed is not None else None
        train_rows = [i for i in range(len(data.tokens)) if not held_out[i]]
        held_rows = [i for i in range(len(data.tokens)) if held_out[i]]
        if self.request.kind in WINDOW_KINDS:
            self._fit_windows(trainer, [_window(data, i) for i in train_rows], settings, source)
        elif BY_NAME[self.request.kind].embeds == "own":  # each head reads the tokens drafted before its own
            states, labels = self._positions(data, train_rows, trainer.d2t)
            self._fit_positions(trainer, states, labels, settings, source, _next_tokens(data, train_rows, self.request.num_heads))
        else:
            states, labels = self._positions(data, train_rows, trainer.d2t)
            self._fit_positions(trainer, states, labels, settings, source)
        if self.step == 0:
            raise no_step_taken(self.request.minutes, self.elapsed(), self.checkpoints)
        report = self._report_on(trainer, data, held_rows)
        other = self._report_unseen(trainer, evaluated) if evaluated else None
        # The heads' own record names the target's file, not where it lay on this machine (heads
        # are shared, and shipped: the path was the trainer's cache); the checkpoint kept the path.
        spec = self.request.target  # a local model by its name; an alias or a Hub repo as given
        published = {**settings, "target": Path(settings["target"]).name if Path(spec).expanduser().exists() else spec}
        training = self._record(published, source, report, len(data.tokens), data.token_count)
        if other is not None:
            training["other_prompts"] = {**other.to_dict(), "prompts": min(len(evaluated), MAX_EVAL_PROMPTS)}
        from specrun.heads.files import save_heads

        try:
            with interrupts_held():  # the heads and their .json written whole, the checkpoint then removed
                save_heads(trainer.heads(training), self.out, training)
                remove_checkpoint(self.checkpoints)
        except KeyboardInterrupt:
            pass  # Ctrl-C as the finished heads were written: they are whole and the run is done
        return HeadsTrainResult(
            path=self.out, steps=self.step, seconds=self.elapsed(), final_loss=self._final_loss(),
            report=report, source=source, resumed_at=resumed_at, other=other,
        )

    # ---- settings and checkpoints --------------------------------------------------------
    def _source(self) -> str:
        request = self.request
        if request.text_dir is not None:
            return f"text files in {Path(request.text_dir).expanduser().resolve()}"
        if request.prompts_file is not None:
            return f"the target's continuations of the prompts in {Path(request.prompts_file).expanduser().resolve()}"
        kind = "Python snippets" if self._completion() else "requests"
        # made from the standard library, which differs between Python versions: said, and a
        # checkpoint made on another version gathers afresh
        return f"the target's continuations of built-in {kind} (Python {platform.python_version()})"

    def _settings(self, source: str) -> dict:
        """What a checkpoint must match to be resumed (not the budget: a larger one trains on)."""
        request = self.request
        return {
            "target": str(self.target.folder.resolve()), "kind": request.kind, "num_heads": request.num_heads,
            "num_layers": request.num_layers, "draft_vocab": request.draft_vocab, "source": source,
            "learning_rate": request.learning_rate, "seed": request.seed,
            **({"layers": list(self.target.layers)} if BY_NAME[request.kind].reads == "layers" else {}),
        }

    def _completion(self) -> bool:
        from specrun.registry.loading import prompts_as_chat

        return not prompts_as_chat(self.request.target, self.request.registry, self.target.backend, None)

    def _record(self, settings: dict, source: str, report: HeldOutReport | None, windows: int, tokens: int) -> dict:
        final_loss = self._final_loss()
        record = {
            "steps": self.step, "seconds": round(self.elapsed(), 1),
            # a loss that diverged is no number JSON can hold; the heads are still worth keeping
            "final_loss": round(final_loss, 4) if math.isfinite(final_loss) else None,
            "data": {"source": source, "windows": windows, "tokens": tokens},
            "learning_rate": self.request.learning_rate, "seed": self.request.seed, "settings": settings,
        }
        if report is not None:
            record["held_out"] = report.to_dict()
        return record

    def _final_loss(self) -> float:
        recent = self.losses[-LOSS_WINDOW:]
        return float(np.mean(recent)) if recent else float("nan")

    def _checkpoint(self, trainer, settings: dict, source: str) -> None:
        """The optimizer's state, then the heads and their record (which says the step) last."""
        from specrun.heads.files import save_heads

        self.checkpoints.mkdir(parents=True, exist_ok=True)
        trainer.save_optimizer(self.checkpoints / "optimizer.safetensors")
        record = self._record(settings, source, None, 0, 0)
        record["losses"] = [round(loss, 5) for loss in self.losses[-LOSS_WINDOW:] if math.isfinite(loss)]
        save_heads(trainer.heads(record), self._checkpointed_heads(), record)
        self.saved_step = self.step

    def _checkpointed_heads(self) -> Path:
        """Where a checkpoint's heads are: a folder for EAGLE-3's, a .safetensors file (and its .json) else."""
        return self.checkpoints / ("heads" if BY_NAME[self.request.kind].stored == "folder" else "heads.safetensors")

    def _write_data(self, data: _Data, held_out: np.ndarray) -> None:
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        lengths = np.array([len(tokens) for tokens in data.tokens], np.int64)
        flat = np.array([token for tokens in data.tokens for token in tokens], np.int64)
        buffer = io.BytesIO()
        np.savez(buffer, tokens=flat, lengths=lengths, label_from=np.array(data.label_from, np.int64),
                 held_out=held_out)
        write_atomically(self.checkpoints / "data.npz", buffer.getvalue(), "training data checkpoint")

    def _resume(self, settings: dict):
        """(data, held_out, trainer) from a checkpoint made with ``settings``; None without one."""
        heads_path = self._checkpointed_heads()
        data_path = self.checkpoints / "data.npz"
        config_path = heads_path / "config.json" if heads_path.suffix == "" else heads_path.with_suffix(".json")
        if not (heads_path.exists() and config_path.exists() and data_path.exists()):
            return None
        from specrun.heads.files import load_heads

        try:
            _check_plain_files(heads_path, config_path, data_path, self.checkpoints / "optimizer.safetensors")
            heads = load_heads(heads_path)
            record = heads.config.training
            if record.get("settings") != settings:
                self.on_note(f"the checkpoint in {self.checkpoints} was made with other settings: starting afresh")
                return None
            with np.load(data_path) as stored:
                flat, lengths, held_out = stored["tokens"], stored["lengths"], stored["held_out"]
                label_from = stored["label_from"]
            step, seconds, losses = checked_progress(record)
            _check_data(flat, lengths, held_out, label_from, self.target.vocab_size)
        except (SpecrunError, OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as exc:
            return self._unreadable(exc)  # a full disk, a killed run, an edited record: a fresh start
        trainer = self._trainer_for(heads)
        optimizer_path = self.checkpoints / "optimizer.safetensors"
        if optimizer_path.exists():
            try:
                trainer.load_optimizer(optimizer_path)
            except Exception as exc:  # noqa: BLE001 - safetensors' and MLX's readers raise their own
                return self._unreadable(exc)
        self.step, self.spent_before, self.losses = step, seconds, losses
        self.started = time.monotonic()
        self.saved_step = self.step
        data = _Data()
        starts = np.concatenate([[0], np.cumsum(lengths)])
        windows = [flat[starts[i] : starts[i + 1]].tolist() for i in range(len(lengths))]
        for batch, firsts in zip(_batches(windows, STATES_BATCH), _batches(label_from.tolist(), STATES_BATCH)):
            self._add_states(data, batch, firsts)
        return data, held_out.astype(bool), trainer

    def _unreadable(self, exc: Exception) -> None:
        self.on_note(f"the checkpoint in {self.checkpoints} cannot be read ({type(exc).__name__}: {exc}): "
                     "starting afresh")

    # ---- data ------------------------------------------------------------------------------
    def _gather(self, texts: list[str] | None, prompts: list[str] | None) -> _Data:
        deadline = self.started + DATA_SHARE * self.budget
        data = _Data()
        if texts is not None:
            self._gather_text(data, texts, deadline)
        else:
            self._gather_continuations(data, prompts, deadline)
        if len(data.tokens) < 2:
            raise SpecrunError(
                f"only {len(data.tokens)} window(s) of data were gathered, too few to train and report on",
                "give the run more --minutes, or more text or prompts",
            )
        vocab = self.target.vocab_size
        self.on_note(f"data: {len(data.tokens)} windows, {data.token_count} tokens; "
                     f"draft vocabulary {min(self.request.draft_vocab, vocab)} of {vocab} tokens")
        return data

    def _gather_text(self, data: _Data, texts: list[str], deadline: float) -> None:
        backend = self.target.backend
        windows = []
        for text in texts:
            pieces = text_pieces(text, TEXT_PIECE_CHARS)
            tokens = [token for k, piece in enumerate(pieces)
                      for token in backend.tokenize(piece, add_bos=k == 0 and backend.vocab.add_bos)]
            windows.extend(cut_windows(tokens, TEXT_WINDOW_TOKENS, SHORTEST_WINDOW))
        np.random.default_rng(self.request.seed).shuffle(windows)  # a budget that ends early keeps a fair sample
        for batch in _batches(windows, STATES_BATCH):
            if time.monotonic() >= deadline and len(data.tokens) >= 2:
                break
            self._add_states(data, batch)
            self._report_data(data)

    def _add_states(self, data: _Data, windows: list[list[int]], label_from: list[int] | None = None) -> None:
        longest = max(len(window) for window in windows)
        padded = np.array([window + [0] * (longest - len(window)) for window in windows])  # (B, T)
        states, following = self.target.states(padded)
        for row, window in enumerate(windows):
            first = label_from[row] if label_from is not None else 0
            data.add(window, states[row, : len(window)], following[row, : len(window)], first)

    def _gather_continuations(self, data: _Data, prompts: list[str] | None, deadline: float,
                              progress: bool = True) -> None:
        completion = self._completion()
        if prompts is None:
            seed = self.request.seed
            prompts = builtin_python_prompts(BUILTIN_PROMPTS, seed) if completion else builtin_questions(BUILTIN_PROMPTS, seed)
        from specrun.sessions.setup import prompt_token_ids

        backend = self.target.backend
        token_prompts = [prompt_token_ids(backend, prompt, chat=not completion)[-MAX_PROMPT_TOKENS:] for prompt in prompts]
        batch_size = GENERATION_BATCH if self.target.can_batch_prompts() else 1
        for batch in _batches(token_prompts, batch_size):
            if time.monotonic() >= deadline and len(data.tokens) >= 2:
                break
            results = self.target.continue_greedily(batch, CONTINUATION_TOKENS,
                                                    stop=lambda: time.monotonic() >= deadline)
            before = len(data.tokens)
            for prompt, (tokens, states, following) in zip(batch, results):
                data.add(tokens, states, following, label_from=len(prompt) - 1)
            if progress:
                self._report_data(data)
            if time.monotonic() >= deadline and len(data.tokens) == before:
                break  # past the deadline a continuation stops at once: the rest would add nothing either

    def _report_data(self, data: _Data) -> None:
        self.on_progress(TrainProgress("data", self.elapsed(), self.budget, tokens=data.token_count,
                                       max_steps=self.max_steps))

    def _hold_out(self, windows: int) -> np.ndarray:
        """Which windows the report is made on: 10%, at least one, chosen by the seed."""
        held = max(1, round(HELD_OUT_SHARE * windows))
        order = np.random.default_rng(self.request.seed + 1).permutation(windows)
        held_out = np.zeros(windows, bool)
        held_out[order[:held]] = True
        return held_out

    def _trainer_for(self, heads):
        """A trainer resuming ``heads`` (a checkpoint's); EAGLE-3's with the target's embedding beside them."""
        if BY_NAME[self.request.kind].embeds == "target":
            embedding = self.target.input_rows(np.arange(self.target.vocab_size))
            return self.trainer_class(heads, self.request.learning_rate, self.request.seed, embedding)
        return self.trainer_class(heads, self.request.learning_rate, self.request.seed)

    def _fresh_trainer(self, data: _Data, held_out: np.ndarray):
        """Heads over the training windows' most frequent target tokens, started as Medusa starts them."""
        from specrun.drafters.ngram import vocabulary_fingerprint

        vocab = self.target.vocab_size
        size = min(self.request.draft_vocab, vocab)
        counts = np.zeros(vocab, np.int64)
        for following, held in zip(data.following, held_out):
            if not held:
                np.add.at(counts, following[following >= 0], 1)
        # Most frequent first; ties and unseen tokens by id (a stable sort of the negated counts).
        d2t = np.argsort(-counts, kind="stable")[:size].astype(np.int64)
        projection = self.target.output_rows(d2t)
        kept_d2t = None if size == vocab else d2t
        config = HeadsConfig(
            kind=BY_NAME[self.request.kind].method, num_heads=self.request.num_heads,
            num_layers=self.request.num_layers,
            hidden_size=self.target.hidden_size, vocab_size=vocab, draft_vocab_size=size,
            target_name=self.request.target, target_vocabulary=vocabulary_fingerprint(self.target.backend),
            target_layers=self.target.num_layers,
        )
        kind = BY_NAME[self.request.kind]
        if kind.embeds == "target":  # the target's embedding, frozen, and the layers it reads
            return self.trainer_class.fresh(config, projection, self.target.input_rows(np.arange(vocab)), kept_d2t,
                                            self.request.learning_rate, self.request.seed, self.target.layers,
                                            self.target.backend.n_ctx_train)
        if kind.embeds == "own":  # an embedding of their own, started from the target's rows
            return self.trainer_class.fresh(config, projection, self.target.input_rows(d2t), kept_d2t,
                                            self.request.learning_rate, self.request.seed)
        return self.trainer_class.fresh(config, projection, kept_d2t, self.request.learning_rate, self.request.seed)

    def _positions(self, data: _Data, rows: list[int], d2t: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Every position of ``rows``: states (N, H) and each head's label (heads, N) as draft ids,
        -1 where there is none (past the window, or a token outside the draft vocabulary)."""
        labels = target_labels([data.following[i] for i in rows], self.request.num_heads)  # (heads, N)
        if d2t is not None:
            t2d = np.full(self.target.vocab_size + 1, -1, np.int64)  # the last entry maps "none" (-1)
            t2d[d2t] = np.arange(len(d2t))
            labels = t2d[labels]
        states = np.concatenate([data.states[i] for i in rows]) if rows else np.zeros((0, self.target.hidden_size))
        return states, labels

    # ---- training ----------------------------------------------------------------------------
    def _fit(self, trainer, count: int, batch_size: int, take_step: Callable[[np.ndarray], float],
             settings: dict, source: str) -> None:
        """Steps over ``count`` training items, ``batch_size`` at a time in an order shuffled anew
        each pass, until the budget is spent: ``take_step(indices)`` takes one and returns its loss."""
        if count == 0:
            raise SpecrunError("the training windows hold no position a head can learn from",
                               "give the run more text or prompts")
        rng = np.random.default_rng(self.request.seed + self.step)
        order, cursor = rng.permutation(count), 0
        last_checkpoint = time.monotonic()
        with self._blas_threads():
            while not self._done():
                if cursor >= len(order):
                    order, cursor = rng.permutation(count), 0
                batch = order[cursor : cursor + batch_size]
                cursor += len(batch)
                self.losses.append(take_step(batch))
                self.step += 1
                self.on_progress(TrainProgress("train", self.elapsed(), self.budget, step=self.step,
                                               loss=self._final_loss(), max_steps=self.max_steps))
                if time.monotonic() - last_checkpoint >= self.checkpoint_seconds:
                    with interrupts_held():  # a checkpoint written whole, then Ctrl-C
                        self._checkpoint(trainer, settings, source)
                    last_checkpoint = time.monotonic()

    def _blas_threads(self):
        """NumPy's BLAS on every core the run may use while it trains (the target's threads are idle)."""
        from specrun.training.optimizer import blas_threads

        return blas_threads(self.request.threads or os.cpu_count() or 1)

    def _fit_positions(self, trainer, states: np.ndarray, labels: np.ndarray, settings: dict, source: str,
                       next_tokens: np.ndarray | None = None) -> None:
        """Medusa and Hydra: shuffled labelled positions, BATCH_POSITIONS a step; Hydra's with the
        tokens after each (``next_tokens`` (N, heads))."""
        labelled = np.flatnonzero((labels >= 0).any(axis=0))

        def take_step(batch: np.ndarray) -> float:
            rows = labelled[batch]
            if next_tokens is None:
                return trainer.step(states[rows], labels[:, rows])
            return trainer.step(states[rows], labels[:, rows], next_tokens[rows])

        self._fit(trainer, len(labelled), BATCH_POSITIONS, take_step, settings, source)

    def _fit_windows(self, trainer, windows: list, settings: dict, source: str) -> None:
        """EAGLE: whole windows with a label, BATCH_WINDOWS a step."""
        useful = [window for window in windows if (window.following[1:] >= 0).any()]
        self._fit(trainer, len(useful), BATCH_WINDOWS,
                  lambda batch: trainer.step_windows([useful[i] for i in batch]), settings, source)

    def _report_chains(self, trainer, windows: list) -> HeldOutReport:
        """EAGLE: the greedy chain the heads draft from each held-out position, on their own."""
        depth = self.request.num_heads
        guesses, labels = [], []
        for window in windows:
            chain = trainer.predict_chain(window, depth)  # (depth, T - 1); the last position drafts nothing
            guesses.append(np.concatenate([chain, np.full((depth, 1), -1)], axis=1))
            labels.append(target_labels([window.following], depth))
        return held_out_report(np.concatenate(guesses, axis=1), np.concatenate(labels, axis=1))

    def _done(self) -> bool:
        if self.max_steps is not None and self.step >= self.max_steps:
            return True
        return self.elapsed() >= self.budget

    # ---- the report ------------------------------------------------------------------------
    def _report_on(self, trainer, data: _Data, rows: list[int]) -> HeldOutReport:
        """The heads' report on ``rows`` of ``data``, as their kind drafts."""
        if self.request.kind in WINDOW_KINDS:
            return self._report_chains(trainer, [_window(data, i) for i in rows])
        if BY_NAME[self.request.kind].embeds == "own":
            return self._report_hydra(trainer, data, rows)
        return self._report(trainer, data, rows)

    def _report_unseen(self, trainer, prompts: list[str]) -> HeldOutReport | None:
        """The report on the target's continuations of ``prompts`` (--eval-prompts), never trained
        on; None, said in a note, where they are too short for a chain."""
        unseen = _Data()
        self._gather_continuations(unseen, prompts[:MAX_EVAL_PROMPTS], math.inf, progress=False)
        report = self._report_on(trainer, unseen, list(range(len(unseen.tokens)))) if unseen.tokens else None
        if report is None or report.positions == 0:
            self.on_note("the --eval-prompts gave no position to report on (their continuations ended at "
                         "once): auto expects the held-out report")
            return None
        return report

    def _report_hydra(self, trainer, data: _Data, rows: list[int]) -> HeldOutReport:
        """Hydra: the greedy chain the heads draft from each held-out position, on their own."""
        depth = self.request.num_heads
        labels = target_labels([data.following[i] for i in rows], depth)  # (heads, N)
        states = np.concatenate([data.states[i] for i in rows])
        following = _next_tokens(data, rows, 1)[:, 0]  # the token at p + 1 (-1 past a window's end)
        step = BATCH_POSITIONS * 4
        guesses = np.concatenate([trainer.predict_chain(states[start : start + step],
                                                        np.maximum(following[start : start + step], 0), depth)
                                  for start in range(0, len(states), step)], axis=1)
        return held_out_report(guesses, labels)

    def _report(self, trainer, data: _Data, rows: list[int]) -> HeldOutReport:
        labels = target_labels([data.following[i] for i in rows], self.request.num_heads)  # (heads, N)
        states = np.concatenate([data.states[i] for i in rows])
        guesses = np.concatenate([trainer.predict(states[start : start + BATCH_POSITIONS * 4])
                                  for start in range(0, len(states), BATCH_POSITIONS * 4)], axis=1)
        if trainer.d2t is not None:
            guesses = trainer.d2t[guesses]
        return held_out_report(guesses, labels)


def held_out_report(guesses: np.ndarray, labels: np.ndarray) -> HeldOutReport:
    """Accuracies of ``guesses`` (heads, N) against ``labels`` (heads, N; -1: none), both target ids.
    The chain is measured on the positions where every head has a label."""
    right = (guesses == labels) & (labels >= 0)
    head_accuracy = tuple(float(right[i][labels[i] >= 0].mean()) if (labels[i] >= 0).any() else 0.0
                          for i in range(len(labels)))
    complete = (labels >= 0).all(axis=0)
    leading = np.cumprod(right[:, complete], axis=0)  # (heads, M): 1 while every head so far was right
    reached = np.concatenate([[complete.sum()], leading.sum(axis=1)[:-1]])
    chain = tuple(float(leading[i].sum() / reached[i]) if reached[i] else 0.0 for i in range(len(labels)))
    tokens_per_pass = 1.0 + float(leading.sum(axis=0).mean()) if complete.any() else 1.0
    return HeldOutReport(head_accuracy, chain, tokens_per_pass, int(complete.sum()))


def target_labels(following: list[np.ndarray], num_heads: int) -> np.ndarray:
    """(heads, N) over the positions of every window: head i's label at p is the target's token
    after p + 1 + i (-1 past the window's end, and where the window says none: a prompt)."""
    columns = []
    for window in following:
        size = len(window)
        labels = np.full((num_heads, size), -1, np.int64)
        for i in range(num_heads):
            if size > i + 1:
                labels[i, : size - 1 - i] = window[1 + i :]
        columns.append(labels)
    return np.concatenate(columns, axis=1) if columns else np.zeros((num_heads, 0), np.int64)


def _next_tokens(data: _Data, rows: list[int], count: int) -> np.ndarray:
    """(N, count) over the positions of ``rows``' windows: the tokens at p + 1 .. p + count, -1 past
    a window's end."""
    columns = [next_tokens(np.asarray(data.tokens[i], np.int64), count) for i in rows]
    return np.concatenate(columns) if columns else np.zeros((0, count), np.int64)


def next_tokens(tokens: np.ndarray, count: int) -> np.ndarray:
    """(T, count): the tokens at p + 1 .. p + count of one window's positions, -1 past its end."""
    padded = np.concatenate([tokens, np.full(count, -1, np.int64)])
    return np.stack([padded[1 + j : 1 + j + len(tokens)] for j in range(count)], axis=1)


def _window(data: _Data, index: int):
    from specrun.training.eagle import EagleWindow

    return EagleWindow(data.states[index], np.asarray(data.tokens[index], np.int64), data.following[index])


def _batches(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _first_of(names: list[str]) -> str:
    """The first of ``names`` and how many more: "notes.txt and 2 more"."""
    return names[0] + (f" and {len(names) - 1} more" if len(names) > 1 else "")


def remove_checkpoint(folder: Path, files: tuple[str, ...] = CHECKPOINT_FILES) -> None:
    """Remove what a run wrote to its checkpoint folder (``files``), then the folder if that left it
    empty (check_checkpoint_folder refused one with files of its own before the run began)."""
    for path in list(folder.iterdir()) if folder.is_dir() else []:
        scratch = path.name.startswith(".") and (path.name.endswith(".tmp") or ".partial." in path.name)
        if path.name not in files and not scratch:  # write_atomically's, the MLX optimizer's
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()


def remove_special(folder: Path, files: tuple[str, ...]) -> None:
    """Unlink each of ``files`` in the run's own checkpoint folder that is a FIFO, a device or a
    socket (the resume refused it): a fresh start writes its files there, and writing into a FIFO hangs."""
    for name in files:
        if is_special(folder / name):
            (folder / name).unlink()


def _check_plain_files(*paths: Path) -> None:
    """A checkpoint's files must be regular files (a folder for EAGLE-3's heads): a FIFO or a
    device in their place would hang the reader."""
    for path in paths:
        if path.exists() and not (path.is_file() or (path.is_dir() and path.suffix == "")):
            raise ValueError(f"{path.name} is not a regular file")


def checked_progress(record: dict) -> tuple[int, float, list[float]]:
    """The step, the seconds spent and the recent losses a checkpoint's record holds, checked: a
    record edited to a negative step or time, or to NaN, would otherwise never end or be lost at the end."""
    step, seconds, losses = record.get("steps", 0), record.get("seconds", 0.0), record.get("losses", [])
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"its step {step!r} is not a count")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < MAX_RECORD_SECONDS:
        raise ValueError(f"its {seconds!r} seconds spent are not a duration")
    if not isinstance(losses, list) or not all(
            isinstance(loss, (int, float)) and not isinstance(loss, bool) and math.isfinite(loss) for loss in losses):
        raise ValueError("its losses are not all finite numbers")
    return step, float(seconds), [float(loss) for loss in losses]


def _check_data(flat: np.ndarray, lengths: np.ndarray, held_out: np.ndarray, label_from: np.ndarray,
                vocab_size: int) -> None:
    """A checkpoint's training data must be what _write_data wrote: windows whose lengths add up
    to the tokens stored, each with its flags, token ids inside the vocabulary."""
    for name, array in (("tokens", flat), ("lengths", lengths), ("label_from", label_from)):
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"its {name} are not a list of integers")
    if held_out.ndim != 1 or held_out.dtype != np.bool_:
        raise ValueError("its held-out flags are not a list of booleans")
    if not len(lengths) == len(held_out) == len(label_from):
        raise ValueError(f"it has {len(lengths)} windows but {len(held_out)} held-out flags and {len(label_from)} starts")
    if len(lengths) < 2 or held_out.all() or not held_out.any():
        raise ValueError("it has no windows to train on or none held out")
    if (lengths < 1).any() or int(lengths.sum()) != len(flat):
        raise ValueError(f"its window lengths do not add up to its {len(flat)} tokens")
    if len(flat) and (flat.min() < 0 or flat.max() >= vocab_size):
        raise ValueError(f"it holds token ids outside the target's vocabulary of {vocab_size}")
    if (label_from < 0).any() or (label_from >= lengths).any():
        raise ValueError("its windows' first labelled positions lie outside the windows")
