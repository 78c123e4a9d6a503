"""An MLX model's second, small KV cache for a windowed draft (backends/window.py).

The cache is mlx-lm's own ``KVCache`` per layer, made for the model already loaded (a target
drafting for itself shares its weights). mlx-lm applies RoPE to keys as they enter the cache, so
moving positions [start, stop) by ``delta`` rotates those keys by ``delta`` more: RoPE's rotations
compose, R(p + delta) = R(delta) R(p), for the plain and Llama-3 kinds whose rotation is all they
do (YaRN's and Su's scale the rotated vector too, so a second rotation would scale it twice: those
models keep their full cache). Only KVCache layers can drop positions; sliding-window and
recurrent layers refuse a window.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specrun.backends.mlx_common import MODEL_CALLS, PREFILL_CHUNK, RowRope
from specrun.errors import ContextFullError, ModelFileError

# RoPE modules whose rotation composes: mlx's own and mlx-lm's Llama-3 frequency scaling
COMPOSING_ROPES = ("RoPE", "Llama3RoPE")


class MlxWindowCache:
    """``cells`` positions of mlx-lm caches on the model of ``parent`` (an MlxBackend)."""

    def __init__(self, parent, cells: int) -> None:
        self.parent = parent
        self.cells = cells
        self._mx = parent._mx
        fix = "drop --window (the draft reads its full cache)"
        name = getattr(getattr(parent, "path", None), "name", None) or "this model"
        self._cache = parent._lm_cache.make_prompt_cache(parent.model)
        kinds = {type(layer).__name__ for layer in self._cache}
        if kinds != {"KVCache"}:
            raise ModelFileError(f"{name} keeps {', '.join(sorted(kinds - {'KVCache'}))} layers, whose cache "
                                 "a window cannot move", fix)
        try:
            self._ropes = [layer.self_attn.rope for layer in parent.model.layers]
        except AttributeError:
            raise ModelFileError(f"{name}: mlx-lm's model keeps no rope per attention layer to move keys "
                                 "with", fix) from None
        self._gap = (0, 0)  # the positions the last remove closed up, until shift moves the rest
        kinds = {type(rope).__name__ for rope in self._ropes}
        if not kinds <= set(COMPOSING_ROPES):
            raise ModelFileError(f"{name} places positions with {', '.join(sorted(kinds))}, whose keys cannot "
                                 "be moved by a second rotation", fix)

    @property
    def held(self) -> int:
        return self._cache[0].offset

    def decode(self, tokens: Sequence[int], start: int, rows: Sequence[int]) -> np.ndarray:
        mx = self._mx
        tokens, rows = [int(t) for t in tokens], list(rows)
        if start != self.held:
            raise ValueError(f"positions must continue at {self.held}, got {start}")
        if start + len(tokens) > self.cells:
            raise ContextFullError(f"the window cache of {self.cells} tokens is full", "lower --window")
        last_start = (len(tokens) - 1) // PREFILL_CHUNK * PREFILL_CHUNK
        if rows and min(rows) < last_start:
            raise ValueError(f"logit rows must fall in the last {PREFILL_CHUNK} tokens of a window feed")
        out = None
        for offset in range(0, len(tokens), PREFILL_CHUNK):
            with MODEL_CALLS:  # no packed pass may swap the model's RoPE modules meanwhile
                logits = self.parent.model(mx.array(tokens[offset : offset + PREFILL_CHUNK])[None], cache=self._cache)
            if offset == last_start and rows:
                out = self.parent._fit_vocab(logits[0, mx.array([row - offset for row in rows])])  # (R, V)
            mx.eval([layer.state for layer in self._cache] + ([out] if out is not None else []))
        if out is None:
            return np.zeros((0, self.parent.vocab.size), np.float32)
        return np.array(out.astype(mx.float32))

    def remove(self, start: int, stop: int) -> None:
        """Drop positions [start, stop). The arrays close up at once, but the positions after the
        gap keep their numbers until ``shift`` moves them (llama.cpp's way, the protocol's):
        ``_gap`` maps them to where they now lie."""
        mx = self._mx
        for layer in self._cache:
            held = layer.offset
            stop_at = held if stop < 0 else min(stop, held)
            if start >= stop_at:
                continue
            if stop_at == held:  # the tail
                layer.trim(held - start)
                continue
            layer.keys = mx.concatenate([layer.keys[..., :start, :], layer.keys[..., stop_at:held, :]], axis=2)
            layer.values = mx.concatenate([layer.values[..., :start, :], layer.values[..., stop_at:held, :]], axis=2)
            layer.offset = held - (stop_at - start)
            self._gap = (start, stop_at)
        mx.eval([layer.state for layer in self._cache])

    def shift(self, start: int, stop: int, delta: int) -> None:
        mx = self._mx
        gap_start, gap_stop = self._gap
        if start >= gap_stop:  # positions after a gap ``remove`` closed: where they lie now
            start, stop = start - (gap_stop - gap_start), stop - (gap_stop - gap_start)
        self._gap = (0, 0)
        offsets = mx.full((stop - start,), delta, dtype=mx.int32)
        for layer, rope in zip(self._cache, self._ropes):
            layer.keys[..., start:stop, :] = RowRope(rope, offsets)(layer.keys[..., start:stop, :])
        mx.eval([layer.state for layer in self._cache])

    def close(self) -> None:
        self._cache = []
