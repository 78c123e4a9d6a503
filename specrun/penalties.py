"""Repetition penalties and logit bias: rows shaped by the text they follow, before sampling.

llama.cpp's ``penalties`` sampler and OpenAI's/llama-server's ``logit_bias``, as llama.cpp applies
them (src/llama-sampler.cpp): the bias added to its tokens' logits first; then each token that
occurs in the last ``last_n`` tokens of the text (the prompt's included, as llama-cli and
llama-server count it) has its logit divided by ``repeat`` (multiplied where it is not positive),
then ``frequency`` times its count and ``presence`` once subtracted. The arithmetic is llama.cpp's,
step by step in float32 (a compiler that fuses its multiply-add could part from it by an ulp, at
an exact tie only).

A penalty depends on the text each row follows, so a verify pass's rows are each shaped by their
own: a chain's row i follows the context and the first i drafts, a tree's row the path to its
node. Verification then sees the rows plain decoding under the penalties would sample from, and
stays exact against it (docs/design.md, "Rows shaped by their text"). A draft model's rows and
heads' chains are shaped the same way, so they draft what the target will choose; lookup, n-grams,
lookahead and heads' trees draft unshaped, which costs acceptance, never exactness.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# OpenAI's ranges for its penalties and its bias; llama.cpp takes any float, but a penalty past
# these flattens every row it touches, and clients that send them keep to OpenAI's.
MAX_PENALTY = 2.0  # |frequency|, |presence|
MAX_BIAS = 100.0  # |bias|; a bias of -inf (llama-server's ``false``) forbids its token


@dataclass(frozen=True)
class Penalties:
    """llama.cpp's repetition penalties (module docstring); the defaults change nothing."""

    repeat: float = 1.0  # a repeated token's logit divided by it (multiplied where <= 0); 1: off
    frequency: float = 0.0  # subtracted once for each time the token occurs in the window
    presence: float = 0.0  # subtracted once where it occurs at all
    last_n: int = 64  # the window, in tokens: llama.cpp's default; -1: the whole text; 0: off

    @property
    def on(self) -> bool:
        """Do these penalties change any row? (As llama.cpp's ``is_disabled`` reads them.)"""
        return self.last_n != 0 and (self.repeat != 1.0 or self.frequency != 0.0 or self.presence != 0.0)

    def problems(self) -> list[str]:
        """What is out of range, as option-named messages (empty if fine)."""
        problems = []
        if not 0.0 < self.repeat <= 10.0:
            problems.append(f"--repeat-penalty must be in (0, 10] (1: off), got {self.repeat}")
        for option, value in (("--frequency-penalty", self.frequency), ("--presence-penalty", self.presence)):
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                problems.append(f"{option} must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g} (0: off), got {value}")
        if self.last_n < -1:
            problems.append(f"--repeat-last-n must be -1 (the whole text), 0 (off) or a count of tokens, got {self.last_n}")
        return problems

    def describe(self) -> str:
        """In words, for a footnote (empty when off)."""
        if not self.on:
            return ""
        said = [f"repeat {self.repeat:.10g}"] if self.repeat != 1.0 else []
        said += [f"{name} {value:.10g}" for name, value in (("frequency", self.frequency), ("presence", self.presence))
                 if value != 0.0]
        window = "the whole text" if self.last_n < 0 else f"the last {self.last_n} tokens"
        return f"penalties ({', '.join(said)}) over {window}"


def shaped_rows(logits: np.ndarray, penalties: Penalties, bias: Sequence[tuple[int, float]],
                context: Sequence[int], paths: Sequence[Sequence[int]]) -> np.ndarray:
    """A pass's logits (n, V) with ``bias`` added and ``penalties`` applied, row i as the text
    ``context`` then ``paths[i]`` shapes it (module docstring). A new array; the pass's own is
    left as it was."""
    rows = np.array(logits, dtype=np.float32)  # a copy, in llama.cpp's precision
    if bias:
        tokens = np.fromiter((token for token, _ in bias), dtype=np.int64, count=len(bias))
        amounts = np.fromiter((amount for _, amount in bias), dtype=np.float32, count=len(bias))
        np.add.at(rows, (slice(None), tokens), amounts)  # a token named twice gets both, as llama.cpp adds them
    if not penalties.on:
        return rows
    repeat = np.float32(penalties.repeat)
    frequency, presence = np.float32(penalties.frequency), np.float32(penalties.presence)
    window = penalties.last_n
    before = np.asarray(context if window < 0 else context[max(0, len(context) - window):], dtype=np.int64)
    # the root row's window counted once; a later row's is it less what its path pushes out, plus
    # the path (a window of the whole text at 32k tokens: 17 ms a pass counted row by row)
    base_tokens, base_counts = np.unique(before, return_counts=True)
    for row, path in zip(rows, paths):
        path = np.asarray(path, dtype=np.int64)
        if not len(path):
            tokens, counts = base_tokens, base_counts
        elif 0 <= window <= len(path):  # the path fills the window alone
            tokens, counts = np.unique(path[len(path) - window:], return_counts=True)
        else:
            pushed = before[: max(0, len(before) + len(path) - window)] if window >= 0 else before[:0]
            merged, where = np.unique(np.concatenate([base_tokens, pushed, path]), return_inverse=True)
            weights = np.concatenate([base_counts, -np.ones(len(pushed)), np.ones(len(path))])
            totals = np.bincount(where, weights=weights).astype(np.int64)
            tokens, counts = merged[totals > 0], totals[totals > 0]
        if not len(tokens):
            continue
        values = row[tokens]
        values = np.where(values <= 0, values * repeat, values / repeat)
        row[tokens] = values - (counts.astype(np.float32) * frequency + presence)
    return rows


@dataclass(frozen=True)
class AheadShaping:
    """What shapes a plain greedy step's row by its text where the target reads ahead and shapes
    rows on its own device (MLX's ``forward_argmax_ahead``): the step's row follows ``context``
    (read during the call, never kept), the row it queues follows ``context`` and the id the step
    picks, which the host does not know yet. ``shaped_rows``'s arithmetic either way; ``takes``
    says where a device cannot repeat it exactly."""

    penalties: Penalties
    bias: tuple[tuple[int, float], ...]
    context: Sequence[int]

    @staticmethod
    def takes(bias: Sequence[tuple[int, float]]) -> bool:
        """Can a device shape rows under ``bias``? Not where a token is biased twice: ``shaped_rows``
        adds its amounts one after the other, which a device's one add of their sum would round
        otherwise."""
        return len({token for token, _ in bias}) == len(bias)

    @property
    def window(self) -> Sequence[int]:
        """The tokens the penalties count for the row after ``context`` (none where they are off)."""
        if not self.penalties.on:
            return ()
        last_n = self.penalties.last_n
        return self.context if last_n < 0 else self.context[max(0, len(self.context) - last_n):]

    @property
    def leaving(self) -> int | None:
        """The token the window loses when one more follows ``context`` (None: it loses none)."""
        last_n = self.penalties.last_n
        if not self.penalties.on or last_n < 0 or len(self.context) < last_n:
            return None
        return int(self.context[len(self.context) - last_n])

    def row(self, logits: np.ndarray, picked: int | None = None) -> np.ndarray:
        """``logits`` (V,) shaped as the row after ``context`` (and ``picked``, where given), on
        the host: the reference a device's shaping must equal."""
        text = self.context if picked is None else [*self.context, picked]
        return shaped_rows(np.asarray(logits)[None], self.penalties, self.bias, text, [()])[0]


def chain_paths(drafts: Sequence[int]) -> list[tuple[int, ...]]:
    """The text after the context each row of a chain's pass follows: none, then each draft's prefix."""
    return [tuple(drafts[:i]) for i in range(len(drafts) + 1)]


def tree_paths(tokens: Sequence[int], parents: Sequence[int]) -> list[tuple[int, ...]]:
    """The same for a tree's pass (the root's row, then one per node): the path to each node."""
    paths: list[tuple[int, ...]] = [()]
    for token, parent in zip(tokens, parents):
        paths.append((*paths[parent + 1], token))  # a parent precedes its children
    return paths
