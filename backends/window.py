"""A draft that reads a sparse KV cache: the first few tokens and a recent window (StreamingLLM).

As a context grows, reading its KV cache costs a model as much as reading its weights, the
draft's cache as much as the target's; a draft whose cache keeps only the "attention sink"
tokens (the first ``sinks``) and the latest ``window`` costs the same at 8k tokens as at 1k
(MagicDec). Only the draft is approximate: the target verifies with its full cache, so the
output is the target's own.

``WindowedBackend`` is a Backend of the context's full length (``n_past`` counts every token fed,
``rewind`` takes positions in it) over a model's second, small cache (``WindowCache``) that holds:

    cache positions 0 .. sinks-1         the context's first tokens (the sinks)
    cache positions sinks .. sinks+R-1   the context's last R tokens (the run), R <= window + block

Positions are the cache's, not the context's, as StreamingLLM has them: when the run outgrows
its window by a ``block`` of tokens, the oldest are dropped down to ``window`` and the rest move
down (llama.cpp re-rotates their keys: its context shift), so the model never sees a gap and a
feed always continues at the next position (llama.cpp insists on that). Dropping a block at a
time keeps the shifts rare. A long feed (a prompt) skips what would be dropped at once: the
draft reads the sinks and the last ``window`` tokens of an 8k prompt, not all of it.

A rewind within the run drops the run's tail (a rejected draft); one into what was dropped
rebuilds the run from the kept tokens, as a cache built afresh from them would hold it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from specrun.backends.base import ArgmaxFromLogits, HiddenSupport, ParentsModel, TreeSupport
from specrun.errors import ContextFullError

SINKS = 4  # StreamingLLM's: four initial tokens keep attention stable
DEFAULT_WINDOW = 512  # recent tokens; `specrun tune` measures its own where asked
MIN_BLOCK = 16
WINDOW_REASON = "a windowed draft drafts chains"


def block_for(window: int) -> int:
    """Tokens the run may outgrow its window by before the oldest are dropped: an eighth of it,
    at least MIN_BLOCK (a shift costs a pass over the cache's keys; one a token would add up)."""
    return max(MIN_BLOCK, window // 8)


class WindowCache(Protocol):
    """A model's second KV cache of ``cells`` positions, for one sequence."""

    cells: int

    def decode(self, tokens: Sequence[int], start: int, rows: Sequence[int]) -> np.ndarray:
        """Feed ``tokens`` at positions start, start+1, ...; logits (len(rows), V) of the rows asked."""
        ...

    def remove(self, start: int, stop: int) -> None:
        """Drop positions [start, stop); stop -1: to the end."""
        ...

    def shift(self, start: int, stop: int, delta: int) -> None:
        """Move positions [start, stop) by ``delta`` (keys re-rotated to their new positions)."""
        ...

    def close(self) -> None: ...


class WindowedBackend(ParentsModel, ArgmaxFromLogits):
    """``parent``'s model drafting from a cache of its sinks and a recent window of the context,
    ``make_cache(cells)`` (made again by ``reopen``, after the model's settings change).

    ``parent`` answers everything about the model (vocabulary, template, tokenizing); ``owns``:
    close it with this backend (a draft model opened for the window; not the target itself).
    """

    tree_support = TreeSupport(False, WINDOW_REASON)
    hidden_support = HiddenSupport(False, reason=WINDOW_REASON)

    def __init__(self, parent, make_cache: Callable[[int], WindowCache], sinks: int = SINKS,
                 window: int = DEFAULT_WINDOW, owns: bool = False, block: int | None = None) -> None:
        if sinks < 0 or window < 1 or (block is not None and block < 1):
            raise ValueError(f"a window needs sinks >= 0, window >= 1 and block >= 1, got {sinks}, {window}, {block}")
        self.parent = parent
        self.sinks = sinks
        self.window = window
        self.block = block if block is not None else block_for(window)
        self.cells = sinks + window + self.block
        self._make_cache = make_cache
        self.cache = make_cache(self.cells)
        self.owns = owns
        self.name = parent.name
        self.vocab = parent.vocab
        self.n_ctx = parent.n_ctx
        self.path = getattr(parent, "path", None)
        parent_variant = getattr(parent, "variant", "")
        setting = f"window={window}+{sinks}"
        self.variant = f"{parent_variant};{setting}" if parent_variant else setting
        self.tokens: list[int] = []  # every token of the context fed, held or dropped
        self.run_start = sinks  # the context position of the run's first token
        self._last_logits = np.zeros((0, self.vocab.size), np.float32)
        # Counters for the stats and the tests: times the run moved on (tokens dropped), of them those
        # that moved kept tokens down (a shift), and runs rebuilt after a deep rewind.
        self.moves = 0
        self.shifts = 0
        self.rebuilds = 0

    @property
    def online_trainer(self):
        """A draft model's own trainer (training/online_draft.py), where it learns: its adapters
        change the model this window's passes run. None for the target itself (not ``owns``)."""
        return getattr(self.parent, "online_trainer", None) if self.owns else None

    def adapt(self, weights) -> None:
        if not self.owns:
            raise ValueError("the target drafting from a windowed cache must not change")
        self.parent.adapt(weights)

    def reopen(self) -> None:
        """Make the cache again, empty, with the model's current settings (flash attention)."""
        if self.tokens:
            raise RuntimeError("a window cache is made again only while empty")
        cache, self.cache = self.cache, None
        cache.close()
        self.cache = self._make_cache(self.cells)

    # ---- what the cache holds ----------------------------------------------------------
    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def held(self) -> list[int]:
        """The context positions the cache holds, in cache order: the sinks, then the run."""
        length = len(self.tokens)
        return list(range(min(self.sinks, length))) + list(range(max(self.run_start, self.sinks), length))

    def held_tokens(self) -> list[int]:
        return [self.tokens[i] for i in self.held()]

    def _cell(self, position: int) -> int:
        """The cache position of the context's ``position`` (a sink or in the run)."""
        return position if position < self.sinks else self.sinks + position - self.run_start

    # ---- the sequence -----------------------------------------------------------------
    def forward(self, tokens: Sequence[int], logit_rows: Sequence[int]) -> np.ndarray:
        tokens = [int(t) for t in tokens]
        rows = list(logit_rows)
        length, total = len(self.tokens), len(self.tokens) + len(tokens)
        if total > self.n_ctx:
            raise ContextFullError(f"the context of {self.n_ctx} tokens is full", "shorten the prompt or raise --ctx")
        start = self.run_start
        if total - start > self.window + self.block:  # the run outgrows its window: drop down to it
            start = max(self.sinks, total - self.window)
        run_from = max(length, start)  # context position of the first run token fed
        if any(self.sinks <= length + row < run_from for row in rows):
            raise ValueError(f"a windowed cache gives logits only within its last {self.window} tokens")
        self._drop_until(start)
        sink_part = tokens[: max(0, min(self.sinks, total) - length)]
        fed = sink_part + tokens[max(run_from, self.sinks) - length:]
        first = length if length < self.sinks else self.sinks + run_from - self.run_start

        def fed_row(row: int) -> int:
            position = length + row
            return position - length if position < self.sinks else len(sink_part) + position - max(run_from, self.sinks)

        logits = self.cache.decode(fed, first, [fed_row(row) for row in rows]) if fed else \
            np.zeros((0, self.vocab.size), np.float32)
        self.tokens.extend(tokens)
        return logits

    def _drop_until(self, start: int) -> None:
        """Drop the run's tokens before context position ``start`` and move the rest down."""
        if start <= self.run_start:
            return
        length = len(self.tokens)
        held_end = self.sinks + max(length - self.run_start, 0)  # cache positions in use
        drop = min(start, max(length, self.run_start)) - self.run_start
        self.moves += 1
        if drop > 0:
            self.cache.remove(self.sinks, self.sinks + drop)
            if held_end > self.sinks + drop:
                self.cache.shift(self.sinks + drop, held_end, -drop)
                self.shifts += 1
        self.run_start = start

    def rewind(self, n_keep: int) -> None:
        n_keep = max(n_keep, 0)
        if n_keep <= self.sinks or n_keep >= self.run_start:
            # Always clear from the kept end on, even at n_past: a decode cut short may have left cells.
            self.cache.remove(n_keep if n_keep <= self.sinks else self._cell(n_keep), -1)
            if n_keep <= self.sinks:
                self.run_start = self.sinks
            del self.tokens[n_keep:]
            return
        # Into what was dropped: the run is built again from the kept tokens, as afresh.
        kept = self.tokens[self.sinks : n_keep]
        self.cache.remove(self.sinks, -1)
        del self.tokens[self.sinks :]
        self.run_start = self.sinks
        self.rebuilds += 1
        self.forward(kept, [])

    def forward_tree(self, tokens, tree, logit_rows):
        raise ValueError(f"this backend cannot verify trees: {WINDOW_REASON}")

    forward_tree_argmax = forward_tree

    def keep_path(self, path) -> None:
        raise ValueError(f"this backend holds no tree: {WINDOW_REASON}")

    def track_hidden(self, on: bool) -> None:
        if on:
            raise ValueError(f"{self.name} gives no hidden states: {WINDOW_REASON}")

    def hidden_layers(self, layers) -> None:
        if layers:
            raise ValueError(f"{self.name} gives no layer outputs: {WINDOW_REASON}")

    def hidden_rows(self, rows):
        raise ValueError(f"{self.name} gives no hidden states: {WINDOW_REASON}")

    def token_embeddings(self, ids):
        return self.parent.token_embeddings(ids)

    def output_rows(self, ids):
        return self.parent.output_rows(ids)

    def logits_beyond_rows(self) -> str:
        return self.parent.logits_beyond_rows()

    def close(self) -> None:
        cache, self.cache = self.cache, None
        if cache is not None:
            cache.close()
        if self.owns:
            self.parent.close()
