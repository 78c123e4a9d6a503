"""An MLX model opened with slots: one cache for every slot's cells, one model call a batch
(backends/slots.py).

mlx-lm's caches hold one sequence, or a left-padded batch that rewinds as a whole; slots rewind
each on its own. So the slots share one ``KVCache`` per layer, as llama.cpp's unified cache does:
a batch appends every pass's tokens, each cell remembers its sequence and position, and one call
runs the batch as a single row, a packed pass (backends/mlx_common.py, the tree pass's way): the
mask shows each token the cells of its own sequence at or before its position (a sliding-window
layer's, the last ``window`` of them: its cache is a plain one here), and RoPE places it at its
own position. The weights are read once for every slot's tokens.

A removed cell leaves a hole. Before the next batch the cells after the first hole move down over
it: mostly the last batch's rejected drafts, so a short move at the end of the cache; a slot
emptied for its next request moves the cells after it once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specrun.backends.mlx_common import MODEL_CALLS, packed_pass, packed_problem
from specrun.backends.slots import SlotPass
from specrun.errors import ContextFullError, ModelFileError

SLOTS_FIX = "serve it with --parallel 1"


# A sliding-window layer's cache (RotatingKVCache) becomes a plain one here, its window kept by
# the mask: each token sees its sequence's last ``max_size`` positions (and the first ``keep``).
SLOT_CACHES = ("KVCache", "RotatingKVCache")


def slots_problem(parent) -> str | None:
    """Why the model of ``parent`` (an MlxBackend) cannot decode several sequences together."""
    return packed_problem(parent.model, parent._cache, "several sequences", SLOT_CACHES)


class MlxSlots:
    """``n_slots`` sequences of ``slot_ctx`` tokens on the model of ``parent`` (an MlxBackend)."""

    def __init__(self, parent, n_slots: int, slot_ctx: int | None = None) -> None:
        problem = slots_problem(parent)
        if problem:
            raise ModelFileError(f"{parent.path.name}: {problem}", SLOTS_FIX)
        self._mx = parent._mx
        self.parent = parent
        self.n_slots = n_slots
        self.slot_ctx = slot_ctx or parent.n_ctx
        self.n_vocab = parent.vocab.size
        self._cache = [parent._lm_cache.KVCache() for _ in parent._cache]
        # per layer: (window, kept first positions) of a sliding-window layer, None for a full one
        self._windows = [(layer.max_size, layer.keep) if type(layer).__name__ == "RotatingKVCache" else None
                         for layer in parent._cache]
        self._seqs = np.zeros(0, np.int64)  # per cell: its sequence, -1 once removed
        self._positions = np.zeros(0, np.int64)  # per cell: its position in its sequence
        # A first pass here, on the thread opening the slots: arrays the model computes lazily
        # (Llama 3 RoPE's frequencies) are evaluated on it, not first on the slots' runner thread.
        probe = SlotPass(0, 0, [0], [0])
        self.run([probe])
        self.remove(0, 0)

    @property
    def cells(self) -> int:
        """Cells the cache holds, holes included (until the next batch closes them)."""
        return len(self._seqs)

    def run(self, passes: Sequence[SlotPass]) -> None:
        """Every pass in one model call: their tokens one after another in one row (none: the
        holes closed only)."""
        for slot_pass in passes:
            if slot_pass.start + len(slot_pass.tokens) > self.slot_ctx:
                raise ContextFullError(f"the context of {self.slot_ctx} tokens is full", "shorten the prompt or raise --ctx")
        self._close_holes()
        for slot_pass in passes:
            held = int(np.count_nonzero(self._seqs == slot_pass.seq))
            if slot_pass.start != held:  # its tokens would sit beside cells it did not drop, or after a gap
                raise ValueError(f"sequence {slot_pass.seq} holds {held} tokens, not the {slot_pass.start} its pass "
                                 "continues from")
        if not passes:
            return
        mx, parent = self._mx, self.parent
        seqs = np.concatenate([np.full(len(p.tokens), p.seq, np.int64) for p in passes])
        positions = np.concatenate([p.start + np.arange(len(p.tokens), dtype=np.int64) for p in passes])
        all_seqs = np.concatenate([self._seqs, seqs])
        all_positions = np.concatenate([self._positions, positions])
        visible = (all_seqs[None, :] == seqs[:, None]) & (all_positions[None, :] <= positions[:, None])  # (L, cells + L)
        masks = {None: mx.array(visible)}
        for window in set(self._windows) - {None}:
            size, keep = window
            recent = positions[:, None] - all_positions[None, :] < size
            masks[window] = mx.array(visible & (recent | (all_positions[None, :] < keep)))
        ids = [int(token) for p in passes for token in p.tokens]
        firsts = np.cumsum([0] + [len(p.tokens) for p in passes])
        wanted = [int(first + row) for p, first in zip(passes, firsts) for row in p.rows]
        n_cells = self.cells
        try:
            with packed_pass(parent.model, self._cache, [masks[window] for window in self._windows], mx.array(positions)):
                logits = parent.model(mx.array(ids)[None], cache=self._cache)  # (1, L, V)
            picked = parent._fit_vocab(logits[0, mx.array(wanted)]).astype(mx.float32) if wanted else None
            mx.eval([layer.state for layer in self._cache] + ([picked] if picked is not None else []))
        except BaseException:  # a failure mid-pass: the cells as before it (what the pass wrote lies past
            # each layer's offset; a graph left unevaluated only rewrites those columns)
            for layer in self._cache:
                layer.trim(layer.offset - n_cells)
            raise
        self._seqs, self._positions = all_seqs, all_positions
        outputs = np.array(picked) if picked is not None else np.zeros((0, self.n_vocab), np.float32)
        first_row = 0
        for slot_pass in passes:
            slot_pass.logits = outputs[first_row : first_row + len(slot_pass.rows)]
            first_row += len(slot_pass.rows)

    def remove(self, seq: int, n_keep: int) -> None:
        self._seqs[(self._seqs == seq) & (self._positions >= n_keep)] = -1

    def _close_holes(self) -> None:
        """Move the cells after the first removed one down over the holes."""
        holes = np.flatnonzero(self._seqs < 0)
        if not len(holes):
            return
        first = int(holes[0])
        kept = first + np.flatnonzero(self._seqs[first:] >= 0)
        mx = self._mx
        moved = mx.array(kept)
        with MODEL_CALLS:
            for layer in self._cache:
                if len(kept):
                    layer.keys[..., first : first + len(kept), :] = layer.keys[..., moved, :]
                    layer.values[..., first : first + len(kept), :] = layer.values[..., moved, :]
                layer.offset = first + len(kept)
            # the cells' tags follow the arrays' graph at once: an evaluation that fails here is
            # retried by the next one, never a second move over cells already moved
            self._seqs = np.concatenate([self._seqs[:first], self._seqs[kept]])
            self._positions = np.concatenate([self._positions[:first], self._positions[kept]])
            mx.eval([layer.state for layer in self._cache])

    def close(self) -> None:
        self._cache = []
        self._seqs = self._positions = np.zeros(0, np.int64)
