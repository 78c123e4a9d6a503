"""`specrun distill`: DistillSpec for a draft model, on MLX, within a time budget.

The student is an existing draft (a GGUF: its weights are read dequantized to float32) or a copy
of the target with only some of its layers (``--student self:layers=N``, or ``self:layers=0-5,9``).
Each step the student continues a batch of prompts itself, greedily by default (on-policy data,
which DistillSpec found best; ``--temperature`` samples instead), the target scores those sequences
in one pass, and the student takes an AdamW step on the divergence between the two distributions at
the generated positions: total variation by default (one minus the acceptance rate of rejection
sampling at T = 1), forward KL or Jensen-Shannon.

Prompts come from ``--prompts`` or are built in (training/data.py: questions in the target's chat
template, or Python snippets for a completion model). A batch's prompts are cut to the shortest
among them (their last tokens kept: a chat prompt ends in the assistant's turn), so that a batch
needs no padding. ``--held-out`` prompts never train: the target continues them greedily once,
and the report gives, before and after, how often the student's top token is the target's there
(the greedy acceptance rate) and the mean of sum_x min(p, q) (the acceptance rate at T = 1).

Checkpoints (every ~30 s) go to ``<out>.ckpt/``: the student, the optimizer's moments, the
held-out sequences and a record of the step, the seconds spent and the report before training.
A second run with the same settings resumes there (the budget counts the seconds spent; a larger
--minutes trains on); a Ctrl-C keeps the last checkpoint. The result is written once, at the end:
an F16 GGUF (through the writer every derived model uses), the MLX folder ``<out>`` converted from
it, so both compute the same function, and the GGUF at ``<out>.gguf`` as it is or quantized from it
by llama.cpp (``--gguf-type Q8_0`` or ``Q4_0``: then the GGUF computes it up to that rounding).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrun.errors import FileAccessError, ModelFileError, RegistryError, SpecrunError, UsageError
from specrun.fileio import check_writable_folder, interrupts_held, is_special, write_atomically
from specrun.modelkit.config import ModelConfig
from specrun.training.data import builtin_python_prompts, builtin_questions, read_prompts_file
from specrun.training.run import (
    MAX_MINUTES,
    TrainingInterrupted,
    TrainProgress,
    check_checkpoint_folder,
    no_step_taken,
    remove_checkpoint,
)

DIVERGENCES = ("fkl", "tvd", "jsd")
GGUF_TYPES = ("F16", "Q8_0", "Q4_0")
TEACHER_CHUNK = 256  # tokens a llama.cpp teacher's pass feeds at once (within its n_batch)
CHECKPOINT_SECONDS = 30.0
BUILTIN_PROMPTS = 2048
LOSS_WINDOW = 20  # steps the reported loss is averaged over
MAX_BATCH = 256
MAX_TOKENS = 4096  # --prompt-tokens, --sample-tokens
CHECKPOINT_FILES = ("student.safetensors", "optimizer.safetensors", "held_out.npz", "state.json")


@dataclass(frozen=True)
class DistillRequest:
    target: str
    student: str
    out: Path
    minutes: float = 10.0
    prompts_file: Path | None = None
    batch: int = 8
    prompt_tokens: int = 64  # a longer prompt keeps its last tokens
    sample_tokens: int = 64  # tokens the student writes per prompt, each step
    temperature: float = 0.0  # the student's sampling temperature for its own data (0: its greedy text)
    divergence: str = "tvd"
    learning_rate: float = 1e-4
    held_out: int = 32  # prompts kept out of training for the report
    seed: int = 0
    registry: Path | None = None
    gguf_type: str = "F16"  # the GGUF's: F16, or Q8_0 / Q4_0 by llama.cpp's quantizer (the MLX folder: float16)
    backend: str = "auto"  # where the target scores: MLX, or llama.cpp (the student always trains in MLX)
    threads: int | None = None

    @property
    def gguf_out(self) -> Path:
        return gguf_path(self.out)


@dataclass(frozen=True)
class AcceptanceReport:
    """The student against the target on the held-out continuations."""

    positions: int
    greedy: float  # how often the student's top token is the target's
    sampled: float  # mean sum_x min(p(x), q(x)): the acceptance rate of rejection sampling at T = 1

    def to_dict(self) -> dict:
        return {"positions": self.positions, "greedy": round(self.greedy, 4), "sampled": round(self.sampled, 4)}

    @classmethod
    def from_dict(cls, raw: dict) -> AcceptanceReport:
        report = cls(int(raw["positions"]), float(raw["greedy"]), float(raw["sampled"]))
        if report.positions < 1 or not (0 <= report.greedy <= 1 and 0 <= report.sampled <= 1.0001):
            raise ValueError("its report before training is not one a run writes")
        return report


@dataclass(frozen=True)
class DistillResult:
    out: Path
    gguf: Path
    steps: int
    seconds: float
    final_loss: float
    before: AcceptanceReport
    after: AcceptanceReport
    student: str  # what the student was, in words
    resumed_at: int | None = None


def gguf_path(out: Path) -> Path:
    return Path(out).with_name(Path(out).name + ".gguf")


def checkpoint_folder(out: Path) -> Path:
    return Path(out).with_name(Path(out).name + ".ckpt")


def check_request(request: DistillRequest) -> None:
    """Every option in range and both outputs free, before any model loads."""
    def positive_int(value: int, flag: str, largest: int, example: str) -> None:
        if isinstance(value, bool) or not 1 <= value <= largest:
            raise UsageError(f"{flag} must be between 1 and {largest}, got {value}", f"pass e.g. {flag} {example}")

    if not (math.isfinite(request.minutes) and 0 < request.minutes <= MAX_MINUTES):
        raise UsageError(f"--minutes must be a positive number of minutes (at most a week), got {request.minutes}",
                         "pass e.g. --minutes 30")
    positive_int(request.batch, "--batch", MAX_BATCH, "8")
    positive_int(request.prompt_tokens, "--prompt-tokens", MAX_TOKENS, "64")
    positive_int(request.sample_tokens, "--sample-tokens", MAX_TOKENS, "64")
    positive_int(request.held_out, "--held-out", 4096, "32")
    if request.threads is not None:
        positive_int(request.threads, "--threads", 1024, "2")
    if not (math.isfinite(request.temperature) and 0 <= request.temperature <= 10):
        raise UsageError(f"--temperature must be between 0 and 10, got {request.temperature}",
                         "pass e.g. --temperature 1 (the student's own samples), or 0 for its greedy ones")
    if not (math.isfinite(request.learning_rate) and 0 < request.learning_rate <= 1):
        raise UsageError(f"--lr must be in (0, 1], got {request.learning_rate}", "pass e.g. --lr 1e-4")
    if isinstance(request.seed, bool) or not 0 <= request.seed < 2**32:
        raise UsageError(f"--seed must be between 0 and {2**32 - 1}, got {request.seed}", "pass e.g. --seed 0")
    from specrun.registry.loading import BACKENDS

    if request.backend not in BACKENDS:
        raise UsageError(f"unknown backend {request.backend!r}", f"use one of: {', '.join(BACKENDS)}")
    if request.gguf_type not in GGUF_TYPES:
        raise UsageError(f"unknown --gguf-type {request.gguf_type!r}", f"use one of: {', '.join(GGUF_TYPES)}")
    if request.divergence not in DIVERGENCES:
        raise UsageError(f"unknown --divergence {request.divergence!r}", f"use one of: {', '.join(DIVERGENCES)}")
    out = Path(request.out).expanduser()
    for path in (out, gguf_path(out)):
        if path.exists() or path.is_symlink():
            raise UsageError(f"--out: a {'folder' if path.is_dir() else 'file'} {path} already exists",
                             "remove it, or pass another --out")
    check_writable_folder(out, "output folder", "pass another --out")
    check_checkpoint_folder(checkpoint_folder(out), CHECKPOINT_FILES, "move it away, or pass another --out")


# ---- the student ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Student:
    config: ModelConfig
    weights: dict[str, np.ndarray]
    tokenizer_json: str
    chat_template: str | None
    described: str
    source: Path | None  # the draft's own GGUF; None for a copy of the target's layers

    @property
    def parameters(self) -> int:
        return int(sum(weight.size for weight in self.weights.values()))


def _student_fix(fix: str) -> str:
    """A self-draft's fix, said of --student (where the tuned layers are no choice)."""
    return fix.replace("--draft", "--student").replace(" or self:layers (the tuned ones)", "")


def _of_student(exc: UsageError, fix: str) -> UsageError:
    """A self-draft's refusal (said of --draft, where the spec is usually given) said of --student."""
    return UsageError(exc.problem.replace("--draft", "--student"), _student_fix(fix))


def load_student(spec: str, target: str, entries: dict) -> Student:
    """The student's float32 weights: a draft model's GGUF, or ``self:layers=...`` of the target's."""
    from specrun.modelkit.cut import keep_layers
    from specrun.modelkit.gguf_io import read_gguf
    from specrun.modelkit.selfdraft import LAYERS_FIX, LayerDraft, is_self_draft, parse_self_draft
    from specrun.registry.loading import resolve_gguf

    layers = None
    if is_self_draft(spec):
        try:
            layers = parse_self_draft(spec)
        except UsageError as exc:  # its fix names the other self-drafts too: the layers' alone
            raise _of_student(exc, LAYERS_FIX) from None
        if not isinstance(layers, LayerDraft) or layers.tuned:
            raise UsageError(f"--student {spec}: a distilled student is a copy of some of the target's layers",
                             _student_fix(LAYERS_FIX))
    try:
        source = resolve_gguf(target if layers is not None else spec, entries)
    except RegistryError as exc:
        if layers is None:
            raise
        raise RegistryError(f"--student {spec} copies the target's layers from its GGUF, and {target!r} has none "
                            f"({exc})", "register the target's GGUF (gguf_file in models.toml) or pass it as a "
                            ".gguf path") from None
    from specrun.backends.llama import check_gguf_file

    check_gguf_file(source)  # a missing file, or one that is no GGUF: one line
    kept: tuple[int, ...] = ()

    def kept_layers(num_layers: int) -> tuple[int, ...]:
        nonlocal kept
        try:
            kept = layers.kept(num_layers)  # a UsageError where they are out of range
        except UsageError as exc:
            raise _of_student(exc, exc.fix) from None
        return kept

    try:
        config, weights, tokenizer_json, chat_template = read_gguf(source, kept_layers if layers else None)
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelFileError(f"cannot distill into {source}: {exc}",
                             "distill a Llama or Qwen2 model (a byte-level BPE vocabulary, no RoPE scaling); a "
                             "damaged file: download or convert it again") from None
    if layers is None:
        return Student(config, weights, tokenizer_json, chat_template, f"{source.name} ({config.num_layers} layers)",
                       source)
    config, weights = keep_layers(config, weights, kept)
    return Student(config, weights, tokenizer_json, chat_template,
                   f"{len(kept)} of the target's layers ({_ranges(kept)})", None)


def _ranges(kept: tuple[int, ...]) -> str:
    from specrun.modelkit.layer_choice import layer_ranges

    return layer_ranges(kept)


def check_student(student: Student, teacher, student_spec: str) -> None:
    """The student must read the target's vocabulary (its end-of-generation ids aside: the target
    decides where an answer ends) and cost less than it."""
    if student.source is not None:
        from specrun.registry.compat import vocabulary_differences
        from specrun.registry.hub import read_gguf_vocabulary, read_tokenizer_vocabulary

        target_file = Path(teacher.backend.path)  # an MLX folder, or a GGUF
        target = read_tokenizer_vocabulary(target_file) if target_file.is_dir() else read_gguf_vocabulary(target_file)
        problems = [problem for problem in vocabulary_differences(target, read_gguf_vocabulary(student.source))
                    if not problem.startswith("EOS ids")]
        if problems:
            raise UsageError(f"--student {student_spec} reads another vocabulary than the target ({problems[0]})",
                             "distill a draft of the target's family, or self:layers=N")
    teacher_parameters = teacher.parameters()
    if student.parameters >= teacher_parameters:
        raise UsageError(f"--student {student_spec} has {student.parameters / 1e6:.1f}M parameters, not fewer than "
                         f"the target's {teacher_parameters / 1e6:.1f}M: it could never pay as a draft",
                         "distill a smaller draft, or self:layers=N with fewer layers")


# ---- the teacher ----------------------------------------------------------------------------
class BackendTeacher:
    """The target on a specrun backend (llama.cpp's), one sequence at a time: its logits at every
    position of a sequence from one pass over it. Where MLX runs on a CPU (not Apple Silicon) it
    multiplies matrices ~10x slower than llama.cpp, and the target's pass was most of a step."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.vocab = backend.vocab

    def log_probs(self, sequences: np.ndarray) -> np.ndarray:
        rows, length = sequences.shape
        chunk = TEACHER_CHUNK
        out = np.empty((rows, length - 1, self.vocab.size), np.float32)
        for row, sequence in enumerate(sequences.tolist()):
            self.backend.rewind(0)
            fed = sequence[:-1]
            for start in range(0, len(fed), chunk):
                piece = fed[start : start + chunk]
                out[row, start : start + len(piece)] = self.backend.forward(piece, list(range(len(piece))))
        out -= _logsumexp(out)
        return out

    def greedy(self, prompts: np.ndarray, new_tokens: int) -> np.ndarray:
        rows = []
        for prompt in prompts.tolist():
            self.backend.rewind(0)
            tokens = list(prompt)
            logits = self.backend.forward(tokens, [len(tokens) - 1])[0]
            for _ in range(new_tokens):
                tokens.append(int(np.argmax(logits)))
                logits = self.backend.forward(tokens[-1:], [0])[0]
            rows.append(tokens)
        return np.array(rows, dtype=prompts.dtype)

    def parameters(self) -> int:
        from specrun.modelkit.gguf_io import gguf_parameter_count

        return gguf_parameter_count(self.backend.path)

    def close(self) -> None:
        self.backend.close()


def student_width(log_probs: np.ndarray, width: int) -> np.ndarray:
    """The teacher's log-probabilities (…, V) over the student's ``width`` ids: a vocabulary padded
    otherwise (a Qwen2.5 7B target's 152064 rows, a 0.5B draft's 151936) differs only in ids no text
    holds, so the rows past the narrower one are cut and the rest renormalised, or -inf added."""
    have = log_probs.shape[-1]
    if have == width:
        return log_probs
    if have > width:
        cut = log_probs[..., :width]
        return cut - _logsumexp(cut)
    padding = np.full((*log_probs.shape[:-1], width - have), -np.inf, log_probs.dtype)
    return np.concatenate([log_probs, padding], axis=-1)


def _logsumexp(logits: np.ndarray) -> np.ndarray:
    top = logits.max(axis=-1, keepdims=True)
    return top + np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))


def open_teacher(request: DistillRequest, entries: dict):
    """The target on the backend asked for; for auto, llama.cpp for a .gguf path, else where
    generation would load it (``choose_backend``: MLX on Apple Silicon where the model has an MLX
    source, llama.cpp for a GGUF elsewhere)."""
    from specrun.registry.loading import LoadOptions, choose_backend, open_backend

    spec = request.target
    gguf_file = Path(spec).expanduser().suffix == ".gguf"
    backend = "llama" if request.backend == "auto" and gguf_file else choose_backend(request.backend, spec, entries)
    if backend == "mlx":
        from specrun.backends.mlx import MlxBackend
        from specrun.backends.mlx_distill import MlxTeacher

        return MlxTeacher(MlxBackend(teacher_folder(spec, entries)))
    length = request.prompt_tokens + request.sample_tokens
    options = LoadOptions(backend="llama", n_ctx=max(length + 8, 256), threads=request.threads,
                          registry=request.registry)
    return BackendTeacher(open_backend(spec, options, entries))


# ---- data -----------------------------------------------------------------------------------
def token_batches(prompts: list[list[int]], batch: int, seed: int) -> list[np.ndarray]:
    """``prompts`` grouped by length into batches of ``batch`` (B, P), each cut to its shortest
    prompt (the last tokens kept), in an order shuffled by ``seed``."""
    ordered = sorted((p for p in prompts if p), key=len)
    batches = []
    for start in range(0, len(ordered), batch):
        group = ordered[start : start + batch]
        shortest = min(len(p) for p in group)
        batches.append(np.array([p[len(p) - shortest :] for p in group], np.int64))
    order = np.random.default_rng(seed).permutation(len(batches))
    return [batches[i] for i in order]


def generated_mask(sequences: np.ndarray, prompt_length: int, eos_ids: frozenset[int]) -> np.ndarray:
    """(B, L - 1): the positions that predict a generated token, up to and including the first
    end-of-generation token (what follows it is no answer the target would give)."""
    rows, length = sequences.shape
    mask = np.zeros((rows, length - 1), bool)
    mask[:, prompt_length - 1 :] = True
    for row in range(rows):
        for t in range(prompt_length, length):
            if int(sequences[row, t]) in eos_ids:
                mask[row, t:] = False
                break
    return mask


# ---- the run --------------------------------------------------------------------------------
def distill(
    request: DistillRequest,
    on_progress: Callable[[TrainProgress], None] = lambda progress: None,
    on_note: Callable[[str], None] = lambda text: None,
    max_steps: int | None = None,
    checkpoint_seconds: float = CHECKPOINT_SECONDS,
) -> DistillResult:
    check_request(request)
    from specrun.backends.mlx_distill import MlxDistiller
    from specrun.registry.catalog import load_registry

    entries = load_registry(request.registry)
    student = load_student(request.student, request.target, entries)
    teacher = open_teacher(request, entries)
    try:
        check_student(student, teacher, request.student)

        def fresh():
            return MlxDistiller(student.config, student.weights, request.learning_rate, request.divergence)

        run = _Run(request, teacher, fresh, student, on_progress, on_note, max_steps, checkpoint_seconds)
        return run.distill(_prompts(request, teacher.backend))
    finally:
        teacher.close()


def teacher_folder(spec: str, entries: dict) -> str:
    """The target's MLX folder: what the registry names, or for a .gguf path a copy converted once
    into specrun's cache (as the builtins' are)."""
    from specrun.registry.loading import resolve_mlx

    path = Path(spec).expanduser()
    if not (path.is_file() and path.suffix == ".gguf"):
        return resolve_mlx(spec, entries)
    from specrun.backends.llama import check_gguf_file
    from specrun.modelkit.demo import derive_once, derived_path
    from specrun.modelkit.gguf_convert import convert_gguf_to_mlx

    check_gguf_file(path)
    folder = derived_path(path, f"{path.stem}-mlx")
    return str(derive_once(folder, lambda scratch: convert_gguf_to_mlx(path, scratch)))


def _prompts(request: DistillRequest, teacher) -> list[list[int]]:
    from specrun.registry.loading import prompts_as_chat
    from specrun.sessions.setup import prompt_token_ids

    chat = prompts_as_chat(request.target, request.registry, teacher, None)
    if request.prompts_file is not None:
        texts = read_prompts_file(request.prompts_file)
    else:
        count = BUILTIN_PROMPTS + request.held_out
        texts = builtin_questions(count, request.seed) if chat else builtin_python_prompts(count, request.seed)
    prompts = [prompt_token_ids(teacher, text, chat=chat)[-request.prompt_tokens :] for text in texts]
    if len(prompts) <= request.held_out:
        raise UsageError(f"{len(prompts)} prompts leave none to train on beside --held-out {request.held_out}",
                         "pass more prompts, or a smaller --held-out")
    np.random.default_rng(request.seed).shuffle(prompts)
    return prompts


class _Run:
    def __init__(self, request, teacher, fresh, student, on_progress, on_note, max_steps, checkpoint_seconds):
        self.request = request
        self.teacher = teacher
        self.fresh = fresh  # a new distiller: the student as it was before training
        self.distiller = fresh()
        self.student = student
        self.on_progress = on_progress
        self.on_note = on_note
        self.max_steps = max_steps
        self.checkpoint_seconds = checkpoint_seconds
        self.out = Path(request.out).expanduser()
        self.checkpoints = checkpoint_folder(self.out)
        self.budget = request.minutes * 60.0
        self.started = time.monotonic()
        self.spent_before = 0.0
        self.step = 0
        self.losses: list[float] = []
        self.saved_step: int | None = None
        self.held_written = False  # this run's held-out data are in the checkpoint

    def elapsed(self) -> float:
        return self.spent_before + time.monotonic() - self.started

    def distill(self, prompts: list[list[int]]) -> DistillResult:
        try:
            return self._distill(prompts)
        except KeyboardInterrupt:
            kept = self.checkpoints if self.saved_step is not None else None
            raise TrainingInterrupted(kept, self.saved_step or 0) from None

    def _distill(self, prompts: list[list[int]]) -> DistillResult:
        request = self.request
        settings = self._settings()
        held_prompts, train_prompts = prompts[: request.held_out], prompts[request.held_out :]
        resumed = self._resume(settings)
        if resumed is not None:
            held, before = resumed
            self.on_note(f"resuming the checkpoint in {self.checkpoints} at step {self.step}")
        else:
            self.on_note(f"student: {self.student.described}, {self.student.parameters / 1e6:.1f}M parameters")
            held = self._held_out(held_prompts)
            before = self._report(held)
            self.on_note(f"before: the student's top token is the target's at {100 * before.greedy:.1f}% of "
                         f"{before.positions} held-out positions ({100 * before.sampled:.1f}% accepted at T = 1)")
            self._checkpoint(settings, held, before)
        resumed_at = self.step if resumed is not None else None
        batches = token_batches(train_prompts, request.batch, request.seed)
        eos = self.teacher.vocab.eos_ids
        last_checkpoint = time.monotonic()
        while self.elapsed() < self.budget and (self.max_steps is None or self.step < self.max_steps):
            batch = batches[self.step % len(batches)]
            sequences = self.distiller.student_sample(batch, request.sample_tokens, request.temperature,
                                                      seed=request.seed * 1_000_003 + self.step)
            mask = generated_mask(sequences, batch.shape[1], eos)
            loss = self.distiller.step(sequences, mask, self._teacher_log_probs(sequences))
            self.step += 1
            self.losses = [*self.losses[-LOSS_WINDOW + 1 :], loss]
            if not math.isfinite(loss):
                raise SpecrunError(f"the loss diverged at step {self.step} ({loss})", "pass a smaller --lr")
            self.on_progress(TrainProgress("train", self.elapsed(), self.budget, step=self.step, loss=loss,
                                           max_steps=self.max_steps))
            if time.monotonic() - last_checkpoint >= self.checkpoint_seconds:
                self._checkpoint(settings, held, before)
                last_checkpoint = time.monotonic()
        if self.step == 0:
            raise no_step_taken(request.minutes, self.elapsed(), self.checkpoints)
        after = self._report(held)
        record = {"target": request.target, "student": self.student.described, "settings": settings,
                  "steps": self.step, "seconds": round(self.elapsed(), 1),
                  "final_loss": round(self._final_loss(), 5) if self.losses else None,
                  "held_out": {"before": before.to_dict(), "after": after.to_dict()}}
        if self.saved_step != self.step:
            self._checkpoint(settings, held, before)  # kept if the result cannot be written
        try:
            write_outputs(self.out, self.distiller.student_weights(), self.student, record, request.gguf_type)
        except FileAccessError as exc:
            raise FileAccessError(exc.problem, f"{exc.fix}, then run the same command again: it resumes from "
                                  f"{self.checkpoints} at step {self.step}") from None
        remove_checkpoint(self.checkpoints, CHECKPOINT_FILES)
        return DistillResult(self.out, gguf_path(self.out), self.step, self.elapsed(), self._final_loss(), before,
                             after, self.student.described, resumed_at)

    def _teacher_log_probs(self, sequences: np.ndarray) -> np.ndarray:
        return student_width(self.teacher.log_probs(sequences), self.student.config.vocab_size)

    def _final_loss(self) -> float:
        return float(np.mean(self.losses)) if self.losses else float("nan")

    # ---- held out ---------------------------------------------------------------------------
    def _held_out(self, prompts: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """The target's greedy continuations of the held-out prompts, with their masks."""
        held = []
        eos = self.teacher.vocab.eos_ids
        for batch in token_batches(prompts, self.request.batch, self.request.seed + 1):
            sequences = self.teacher.greedy(batch, self.request.sample_tokens)
            held.append((sequences, generated_mask(sequences, batch.shape[1], eos)))
            self.on_progress(TrainProgress("data", self.elapsed(), self.budget,
                                           tokens=sum(int(mask.sum()) for _, mask in held)))
        return held

    def _report(self, held: list[tuple[np.ndarray, np.ndarray]]) -> AcceptanceReport:
        positions = agreed = 0
        shared = 0.0
        for sequences, mask in held:
            n, a, s = self.distiller.agreement(sequences, mask, self._teacher_log_probs(sequences))
            positions, agreed, shared = positions + n, agreed + a, shared + s
        if positions == 0:
            raise SpecrunError("the target ended every held-out continuation at once: nothing to report on",
                               "pass other --prompts")
        return AcceptanceReport(positions, agreed / positions, shared / positions)

    # ---- checkpoints ------------------------------------------------------------------------
    def _settings(self) -> dict:
        request = self.request
        prompts = str(Path(request.prompts_file).expanduser().resolve()) if request.prompts_file else "built-in"
        return {"target": request.target, "student": request.student, "prompts": prompts, "batch": request.batch,
                "teacher": type(self.teacher).__name__,
                "prompt_tokens": request.prompt_tokens, "sample_tokens": request.sample_tokens,
                "temperature": request.temperature, "divergence": request.divergence,
                "learning_rate": request.learning_rate, "held_out": request.held_out, "seed": request.seed,
                "registry": str(Path(request.registry).expanduser().resolve()) if request.registry else None}

    def _checkpoint(self, settings: dict, held, before: AcceptanceReport) -> None:
        """The held-out data and the weights first, the record (which says the step) last; a Ctrl-C
        waits for all of them (a step's weights beside an older step's record resumed wrong)."""
        with interrupts_held():
            self._write_checkpoint(settings, held, before)

    def _write_checkpoint(self, settings: dict, held, before: AcceptanceReport) -> None:
        folder = self.checkpoints
        folder.mkdir(parents=True, exist_ok=True)
        if not self.held_written:  # a fresh start's own, not an older run's left in the folder
            arrays = {f"{kind}{i}": array for i, pair in enumerate(held) for kind, array in zip(("seq", "mask"), pair)}
            buffer = io.BytesIO()
            np.savez(buffer, **arrays)
            write_atomically(folder / "held_out.npz", buffer.getvalue(), "held-out data checkpoint")
            self.held_written = True
        self.distiller.save_state(folder / "student.safetensors", folder / "optimizer.safetensors", self.step)
        state = {"settings": settings, "steps": self.step, "seconds": round(self.elapsed(), 2),
                 "losses": [loss for loss in self.losses if math.isfinite(loss)], "before": dataclasses.asdict(before)}
        write_atomically(folder / "state.json", json.dumps(state).encode(), "distillation checkpoint")
        self.saved_step = self.step

    def _resume(self, settings: dict):
        """(held-out data, report before) from a checkpoint made with ``settings``; None without one."""
        from specrun.training.run import checked_progress, remove_special

        folder = self.checkpoints
        special = [name for name in CHECKPOINT_FILES if is_special(folder / name)]
        if special:  # a FIFO would hang the reader now and the fresh start's writer next
            self.on_note(f"the checkpoint in {folder} cannot be read ({special[0]} is not a regular file): "
                         "starting afresh")
            remove_special(folder, CHECKPOINT_FILES)
            return None
        if not all((folder / name).is_file() for name in CHECKPOINT_FILES):
            return None
        try:
            state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
            if state.get("settings") != settings:
                self.on_note(f"the checkpoint in {folder} was made with other settings: starting afresh")
                return None
            step, seconds, losses = checked_progress(state)
            before = AcceptanceReport.from_dict(state["before"])
            with np.load(folder / "held_out.npz") as stored:
                held = [(stored[f"seq{i}"], stored[f"mask{i}"]) for i in range(len(stored.files) // 2)]
            _check_held_out(held, self.teacher.vocab.size)
            self.distiller.load_state(folder / "student.safetensors", folder / "optimizer.safetensors", step)
        except Exception as exc:  # noqa: BLE001 - a killed save, an edited record, MLX's own reader errors
            self.on_note(f"the checkpoint in {folder} cannot be read ({type(exc).__name__}: {exc}): starting afresh")
            self.distiller = self.fresh()  # a half-loaded state is not kept
            return None
        self.step, self.spent_before, self.losses = step, seconds, losses
        self.started = time.monotonic()
        self.saved_step = step
        self.held_written = True
        return held, before


def _check_held_out(held, vocab_size: int) -> None:
    if not held:
        raise ValueError("it holds no held-out data")
    for sequences, mask in held:
        if sequences.ndim != 2 or mask.shape != (sequences.shape[0], sequences.shape[1] - 1) or mask.dtype != bool:
            raise ValueError("its held-out data are not what a run writes")
        if sequences.size and (sequences.min() < 0 or sequences.max() >= vocab_size):
            raise ValueError("its held-out tokens are outside the vocabulary")


# ---- the result -----------------------------------------------------------------------------
def write_outputs(out: Path, weights: dict, student: Student, record: dict, gguf_type: str = "F16") -> None:
    """The GGUF at ``<out>.gguf`` (F16, or quantized from the F16 one by llama.cpp) and the MLX
    folder ``out`` (float16, converted from the F16 GGUF; the record as ``distill.json``), written in
    a scratch folder beside them and renamed into place, Ctrl-C held back over the two renames: a
    full disk or an interrupt leaves neither, or both."""
    from specrun.backends.llama import quantize_gguf
    from specrun.modelkit.demo import remove_scratch, write_errors_as
    from specrun.modelkit.gguf_convert import convert_gguf_to_mlx
    from specrun.modelkit.gguf_io import write_gguf
    from specrun.modelkit.hf_io import write_json

    out = Path(out)
    scratch = out.parent / f".distilling-{secrets.token_hex(8)}"
    try:
        with write_errors_as(lambda exc: _cannot_write(out, exc)):
            scratch.mkdir(mode=0o700)
            f16_tmp, folder_tmp = scratch / "f16.gguf", scratch / out.name
            write_gguf(f16_tmp, student.config, weights, student.tokenizer_json, student.chat_template, dtype="F16")
            convert_gguf_to_mlx(f16_tmp, folder_tmp)
            write_json(folder_tmp / "distill.json", record)
            gguf_tmp = scratch / gguf_path(out).name
            if gguf_type == "F16":
                os.replace(f16_tmp, gguf_tmp)
            else:
                try:
                    quantize_gguf(f16_tmp, gguf_tmp, gguf_type)
                except ModelFileError as exc:  # llama.cpp's quantizer says only its status: the disk, as a rule
                    raise FileAccessError(f"cannot write the distilled draft in {out.parent}: {exc.problem}",
                                          "free some disk space, or pass another --out") from None
            with interrupts_held():
                os.replace(gguf_tmp, gguf_path(out))
                try:
                    os.replace(folder_tmp, out)
                except OSError:
                    gguf_path(out).unlink(missing_ok=True)  # neither, rather than one
                    raise
    finally:
        remove_scratch(scratch)


def _cannot_write(out: Path, exc: OSError) -> FileAccessError:
    return FileAccessError(f"cannot write the distilled draft in {out.parent}: {exc.strerror or exc}",
                           "free some disk space, or pass another --out")
