"""Draft models that keep learning while they draft: adapters trained online on the target's
verified tokens (online speculative decoding, Liu et al. 2024, for a draft model).

A draft model's drafter (drafters/draft_model.py) hands its learner, at every proposal and at a
text's end, the positions of the text the target generated: each holds the target's own choice
given the tokens before it, which is what the draft should have drafted there. The learner cuts
them into windows of ``window`` such positions, each with up to ``window`` tokens of the text
before them to read (the prompt's among them, never trained on), and its worker
(training/learner.py's Learner: the same budget, buffer, idle rule and swaps as heads') scores each
window before it trains on it, takes AdamW steps on the cross-entropy of those tokens through the
backend's trainer (MLX: LoRA adapters on every linear map of the draft, backends/mlx_lora.py) and
publishes what the drafting model takes between two passes (MLX: float maps with their adapters
fused in, quantized maps' adapters). The draft's cache keeps what it read with the weights before;
a draft is a proposal, so that costs acceptance at most, never an answer.

The labels are the target's tokens; with --learn-labels distributions (``soft_labels``), also its
distributions where its verify pass brought them to the host: every pass at temperature > 0, and
greedy ones whose rows are kept for --logprobs, masked by a grammar or judged by a lossy rule; not
other greedy passes, whose argmax stays on the device. The engine hands the drafter each pass's rows at the positions it kept
(``observe_rows``); the learner keeps the SOFT_TOP likeliest tokens of each (the draft's vocabulary's,
at temperature 1, renormalised over them: their cost, on the generating thread, is charged to
generation's budget, and none is read past it), and the trainer's loss is the cross-entropy against them (DistillSpec's
forward KL, up to the target's entropy); positions without rows keep their token. The
acceptance by depth reported scores greedy chains as the draft would draft them from the window's
context: a chain's token at depth d is the draft's guess given the text so far only where the d
before it were right, so teacher-forced guesses score it (the score of the depth given those
before it, as `heads train` reports). The window's context is shorter than the text's.

On MLX the worker's own thread waits while its stream computes, so its budget is kept in wall
seconds of the worker's work (``cpu_clock`` is the wall clock), not in its thread's CPU time,
which would miss the computing; the report's "CPU" seconds are those.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrun.training.learner import LearnSettings, Learner

WINDOW_TOKENS = 64  # labelled positions a window, and the most context before them it reads
BATCH_WINDOWS = 2  # windows a step
REPORT_DEPTH = 4  # acceptance by depth reported to this depth
# AdamW's on the adapters: mlx-lm's LoRA default. On the demo pair (built-in suite, 3,200 tokens,
# docs/perf.md 3(t)) no rate raised acceptance (Adam 3e-6 to 1e-4, SGD 0.01 to 1); 3e-5 and up lowered it.
LEARNING_RATE = 1e-5
SOFT_TOP = 32  # the target's likeliest tokens a position's soft label keeps
# soft labels held for positions not yet handed over, at most (the draft not asked for a long stretch:
# auto drafting with others, or plain; a text cut short)
ROWS_HELD = 4 * WINDOW_TOKENS

# Why a draft model cannot learn online, by its backend's name (the rest: it has no trainer).
CANNOT_LEARN = {
    "llama": "llama.cpp's draft models cannot learn online (its weights are fixed in the GGUF)",
}


def draft_cannot_learn(draft) -> str:
    """Why ``draft`` (a Backend) cannot learn online, "" where it can. A draft that runs the
    target's own weights (a layer draft, the target reading a windowed cache) never learns: its
    weights are the target's, and changing them would change the answer."""
    if getattr(draft, "shares_layers", False):
        return "a layer draft (self:layers) runs the target's own layers, which must not change"
    if getattr(draft, "owns", True) is False:
        return "the target drafting from a windowed cache (self:window) is the target itself, which must not change"
    if getattr(draft, "online_trainer", None) is not None:
        return ""
    name = getattr(draft, "name", "")
    return CANNOT_LEARN.get(name, f"this draft model ({name or type(draft).__name__}) cannot learn online")


@dataclass(frozen=True)
class TokenWindow:
    """Tokens of a text, those from ``first`` on (``first`` >= 1) the target's verified choices."""

    tokens: np.ndarray
    first: int
    # the target's distributions at the labelled positions where its rows were read: (size, K) token
    # ids and their probabilities, a position without one holding its token at probability 1; None: tokens
    soft: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def size(self) -> int:
        return len(self.tokens) - self.first


def top_distributions(logits: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Of each row of ``logits`` (n, V): its ``top`` likeliest ids (n, top), in no order, and their
    probabilities at temperature 1 renormalised over them (n, top). Ids a row masks (-inf) get 0."""
    top = min(top, logits.shape[1])
    ids = np.argpartition(-logits, top - 1, axis=1)[:, :top]
    values = np.take_along_axis(logits, ids, axis=1).astype(np.float64)
    with np.errstate(invalid="ignore"):  # a row masked whole (-inf less -inf): NaN, its caller's to leave out
        values -= values.max(axis=1, keepdims=True)
        weights = np.exp(values)
        weights /= weights.sum(axis=1, keepdims=True)
    return ids.astype(np.int64), weights.astype(np.float32)


class DraftLearner(Learner):
    """One draft model learning from what the target verifies (see the module's docstring)."""

    kind = "draft"
    publishes_at_close = False  # no drafter takes its weights then; --keep-learned writes learned_adapters
    scores_all_at_close = False
    windows_a_step = BATCH_WINDOWS

    @property
    def finish_at_close(self) -> bool:
        """Where its adapters are kept (--keep-learned), the last windows are trained on within the
        budget as heads' are; otherwise no drafter takes the weights any more, and nothing keeps them."""
        return self.settings.keep

    def __init__(self, draft, settings: LearnSettings = LearnSettings(), *, learning_rate: float = LEARNING_RATE,
                 seed: int = 0, window: int = WINDOW_TOKENS, inline: bool = False, inline_steps: int = 1,
                 soft_labels: bool = False, clock: Callable[[], float] = time.monotonic,
                 cpu_clock: Callable[[], float] = time.perf_counter) -> None:
        problem = draft_cannot_learn(draft)
        if problem:
            raise ValueError(problem)
        super().__init__(settings, REPORT_DEPTH, seed=seed, inline=inline, inline_steps=inline_steps,
                         clock=clock, cpu_clock=cpu_clock)
        self.source = draft
        self.trainer = draft.online_trainer(learning_rate, seed)
        self.window = window
        self.step_positions = window * BATCH_WINDOWS
        self._buffer: deque = deque()  # TokenWindows, oldest first
        self._buffered = 0
        self._tokens: list[int] = []  # the run: context, then the labelled positions from _label_from
        self._label_from = 0
        self._end = -1  # the text position after the run's last token; -1: no run
        self.soft = soft_labels  # learn the target's distributions where its rows come (observe_rows)
        self._vocab = draft.vocab.size  # the target's ids past the draft's vocabulary are left out
        self._rows_at: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # text position -> (ids, probabilities)
        self.rows_offered = 0  # passes whose rows it was handed (read or, past the budget, not)
        self._start()

    # ---- the drafter's side ------------------------------------------------------------------
    def observe(self, first: int, context: Sequence[int]) -> None:
        """Positions ``first`` .. len(context) - 1 of ``context`` hold the target's verified
        tokens. Called between verify passes."""
        self._active(self._clock())
        if self._stopped:
            return
        first = max(first, 1)  # the first token of a text follows nothing
        if len(context) <= first:
            return
        if first != self._end:
            self._flush()
            for position in [position for position in self._rows_at if position < first]:  # never to be handed over
                del self._rows_at[position]
            self._tokens = [int(token) for token in context[max(0, first - self.window) : first]]
            self._label_from = len(self._tokens)
        self._tokens.extend(int(token) for token in context[first:])
        self._end = len(context)
        while len(self._tokens) - self._label_from >= self.window:
            self._cut(self.window)
        if self._inline:
            self._work_inline()

    def observe_rows(self, first: int, logits: np.ndarray) -> None:
        """The target's logits (n, V) at text positions ``first`` .. first + n - 1, the rows its
        pass verified the tokens there with: their soft labels, kept until ``observe`` hands the
        positions over. Called on the generating thread after a pass; its cost (wall seconds: what
        generation waits) is charged to the budget, and past the budget it reads none."""
        if not self.soft or self._stopped or not len(logits):
            return
        self.rows_offered += 1
        if not self._inline and self._busy_seconds > 0 and not self._within_budget(idle=False):
            return  # past the budget: those positions learn their tokens
        started = self._cpu_clock()
        rows = np.asarray(logits)[:, : self._vocab]
        ids, probabilities = top_distributions(rows, SOFT_TOP)
        finite = np.isfinite(rows.max(axis=1))  # a row masking all the draft's ids (a grammar's) teaches its token
        for offset in np.flatnonzero(finite).tolist():
            self._rows_at[first + offset] = (ids[offset], probabilities[offset])
        if len(self._rows_at) > ROWS_HELD:  # positions never handed over (a text cut short): the oldest go
            for position in sorted(self._rows_at)[: len(self._rows_at) - ROWS_HELD]:
                del self._rows_at[position]
        self.charge(self._cpu_clock() - started)

    def start_text(self) -> None:
        super().start_text()
        self._rows_at.clear()  # positions count from a new text's start

    def _cut(self, count: int) -> None:
        stop = self._label_from + count
        soft = None
        if self._rows_at:
            start = self._end - len(self._tokens)  # the text position of the run's first token
            soft = self._soft_labels(start + self._label_from, self._tokens[self._label_from : stop])
        self._hand(TokenWindow(np.asarray(self._tokens[:stop], np.int64), self._label_from, soft))
        kept = max(0, stop - self.window)
        self._tokens = self._tokens[kept:]
        self._label_from = stop - kept

    def _soft_labels(self, position: int, tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """The soft labels of ``tokens`` at text positions ``position`` on, taken from those held
        (a position without one: its token at probability 1); None where none is held."""
        rows = [self._rows_at.pop(position + offset, None) for offset in range(len(tokens))]
        held = [row for row in rows if row is not None]
        if not held:
            return None
        width = max(len(row_ids) for row_ids, _ in held)
        ids = np.zeros((len(tokens), width), np.int64)
        probabilities = np.zeros((len(tokens), width), np.float32)
        for offset, row in enumerate(rows):
            if row is None:
                ids[offset, 0], probabilities[offset, 0] = tokens[offset], 1.0
            else:
                ids[offset, : len(row[0])], probabilities[offset, : len(row[1])] = row
        return ids, probabilities

    def _flush(self) -> None:
        if len(self._tokens) > self._label_from:
            self._cut(len(self._tokens) - self._label_from)
        self._tokens, self._label_from, self._end = [], 0, -1

    # ---- the worker's ----------------------------------------------------------------------------
    def _size(self, window: TokenWindow) -> int:
        return window.size

    def _keep(self, window: TokenWindow) -> None:
        if window.soft is not None:
            self.labels = "distributions"
        self._buffer.append(window)
        self._buffered += window.size
        while self._buffered - self._buffer[0].size >= self.settings.buffer_tokens:
            self._buffered -= self._buffer.popleft().size

    def _guesses(self, window: TokenWindow) -> np.ndarray:
        """(depth, T): at labelled position t, depth d, the draft's guess of token t + d given the
        text before it (what its chain drafts there where depths < d were right)."""
        return _by_depth(self.trainer.predict(window.tokens), window.first - 1, window.size, self.depth)

    def _labels(self, window: TokenWindow) -> np.ndarray:
        return _by_depth(window.tokens, window.first, window.size, self.depth)

    def _take_step(self) -> float:
        buffer = self._buffer
        chosen = [buffer[i] for i in self._rng.choice(len(buffer), min(BATCH_WINDOWS, len(buffer)), replace=False)]
        self._trained += sum(window.size for window in chosen)
        return float(self.trainer.step([(window.tokens, window.first, window.soft) for window in chosen]))

    def _snapshot(self):
        return self.trainer.weights()

    def learned_adapters(self) -> dict[str, np.ndarray] | None:
        """The adapters as learned, for --keep-learned; None before a step (what a file held stays)
        or where a step left them not finite (a loss that was not: the file keeps its last good ones)."""
        if not self._steps:
            return None
        arrays = self.trainer.adapter_arrays()
        return arrays if all(np.isfinite(array).all() for array in arrays.values()) else None


# ---- adapters kept between runs (--keep-learned) ---------------------------------------------------
ADAPTERS_FORMAT = "specrun-draft-adapters"


def save_adapters(path: Path, arrays: dict[str, np.ndarray], draft_name: str) -> None:
    """Write a draft model's adapters (LoraTrainer.adapter_arrays) to ``path`` atomically, with
    the draft's name and a checksum of the tensors in the file's metadata."""
    from safetensors.numpy import save

    from specrun.errors import ModelFileError
    from specrun.fileio import write_atomically

    tensors = {name: np.ascontiguousarray(array, np.float32) for name, array in arrays.items()}
    payload = save(tensors, metadata={"format": ADAPTERS_FORMAT, "draft": draft_name, "sha256": _digest(tensors)})
    write_atomically(path, payload, "draft adapters", error=ModelFileError)


def load_adapters(path: Path, draft_name: str) -> dict[str, np.ndarray]:
    """What ``save_adapters`` wrote for ``draft_name``; ValueError saying why it cannot be used
    (not such a file, another draft's, a checksum that disagrees)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as opened:
            metadata = opened.metadata() or {}
            if metadata.get("format") != ADAPTERS_FORMAT:
                raise ValueError("not specrun's draft adapters")
            if metadata.get("draft") != draft_name:
                raise ValueError(f"they were learned by {metadata.get('draft')!r}, not {draft_name!r}")
            tensors = {name: opened.get_tensor(name) for name in opened.keys()}
    except OSError as exc:
        raise ValueError(f"it cannot be read ({exc.strerror or exc})") from None
    except (SafetensorError, TypeError) as exc:  # TypeError: a dtype NumPy has not (bfloat16)
        raise ValueError(f"not a safetensors file NumPy reads ({exc})") from None
    if _digest(tensors) != metadata.get("sha256"):
        raise ValueError("their checksum disagrees (the file was changed or cut short)")
    return tensors


def _digest(tensors: dict[str, np.ndarray]) -> str:
    """sha256 over the tensors' names and bytes, in name order."""
    return hashlib.sha256(b"".join(name.encode() + tensors[name].tobytes() for name in sorted(tensors))).hexdigest()


def _by_depth(values: np.ndarray, start: int, count: int, depth: int) -> np.ndarray:
    """(depth, count): row d holds values[start + d : start + d + count], -1 past the end."""
    out = np.full((depth, count), -1, np.int64)
    for d in range(depth):
        row = np.asarray(values[start + d : start + d + count], np.int64)
        out[d, : len(row)] = row
    return out
