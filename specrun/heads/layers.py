"""The layer math every head kind shares (NumPy, in the arrays' own dtype: float32 drafting,
float64 in gradient tests; constants are Python floats, since a NumPy float64 scalar would turn
float32 arrays float64), and the embedding rows of heads with a draft vocabulary."""

from __future__ import annotations

import functools

import numpy as np

from specrun.heads.config import HeadsConfig


class EmbeddingRows:
    """For heads with an embedding over a draft vocabulary and one shared last row (EagleHeads,
    HydraHeads: ``config`` and ``d2t``), the row each target id reads."""

    def draft_ids(self, token_ids: np.ndarray) -> np.ndarray:
        """The embedding row of each target id: its draft id, or the last row for any other (ids
        past the heads' vocabulary too: a target's padded rows)."""
        ids = np.asarray(token_ids, dtype=np.int64)
        rows = self._rows_of_target_ids
        return np.where(ids < len(rows), rows[np.minimum(ids, len(rows) - 1)], self.config.draft_vocab_size)

    @functools.cached_property
    def _rows_of_target_ids(self) -> np.ndarray:
        """draft_id_map, built once (a vocabulary-sized array: drafting asks for it every step)."""
        return draft_id_map(self.config, self.d2t)


def draft_id_map(config: HeadsConfig, d2t: np.ndarray | None) -> np.ndarray:
    """(V,) each target id's embedding row: its draft id, or Vd (the shared row) outside the draft
    vocabulary."""
    if d2t is None:
        return np.arange(config.vocab_size, dtype=np.int64)
    rows = np.full(config.vocab_size, config.draft_vocab_size, np.int64)
    rows[d2t] = np.arange(len(d2t))
    return rows


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    # np.mean's own sum and division, without its dispatch: 2.4x faster on a drafting step's
    # few rows, the same bits
    mean_square = (x * x).sum(axis=-1, keepdims=True)
    mean_square /= x.shape[-1]
    mean_square += eps
    return x / np.sqrt(mean_square) * weight


def rope(x: np.ndarray, positions: np.ndarray, theta: float, inverse: bool = False) -> np.ndarray:
    """Rotary embedding of ``x`` (N, nh, hd) at ``positions`` (N,), the halves rotated together
    (Llama's layout); ``inverse`` rotates back (the transpose, for gradients)."""
    half = x.shape[-1] // 2
    frequencies = _rope_frequencies(half, theta)  # (hd/2,)
    angles = np.asarray(positions, np.float64)[:, None] * frequencies  # (N, hd/2)
    cos = np.cos(angles).astype(x.dtype)[:, None, :]
    sin = np.sin(angles).astype(x.dtype)[:, None, :]
    if inverse:
        sin = -sin
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)


@functools.lru_cache(maxsize=16)
def _rope_frequencies(half: int, theta: float) -> np.ndarray:
    frequencies = theta ** (-np.arange(half, dtype=np.float64) / half)
    frequencies.setflags(write=False)  # shared by every call
    return frequencies


def silu(z: np.ndarray) -> np.ndarray:
    return z * (0.5 * (1.0 + np.tanh(0.5 * z)))


def softmax(scores: np.ndarray) -> np.ndarray:
    scores = scores - scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    return weights / weights.sum(axis=-1, keepdims=True)
