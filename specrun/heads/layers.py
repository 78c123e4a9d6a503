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
    cos, sin = llama_turns(x.shape[-1], theta, positions, x.dtype)
    if inverse:
        sin = -sin
    return rotate_halves(x, cos, sin)


def rotate_halves(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """``x`` (N, heads, d) turned on pairs of halves (NeoX's layout) by ``turns``' cos and sin."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)


# A drafting step rotates a few positions, the same ones for its queries and keys, and the next
# step mostly the same again: their cos and sin are kept (bounded), as computed the first time.
_TURNS: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
_TURNS_KEPT = 4096
_TURNS_POSITIONS = 16  # longer runs of positions (a prompt's, a training batch's) are worked out each time


def turns(frequencies: np.ndarray, positions, dtype, magnitude: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (N, 1, F) in ``dtype`` of each rotated pair's angle (``frequencies`` (F,)
    float64, a position's) at ``positions`` (N,), each scaled by ``magnitude``."""
    positions = np.asarray(positions)
    if len(positions) > _TURNS_POSITIONS:
        return _turns(frequencies, positions, dtype, magnitude)
    key = (frequencies.tobytes(), tuple(positions.tolist()), np.dtype(dtype).str, magnitude)
    found = _TURNS.get(key)
    if found is None:
        if len(_TURNS) >= _TURNS_KEPT:
            _TURNS.clear()
        found = _TURNS[key] = _turns(frequencies, positions, dtype, magnitude)
        for part in found:
            part.setflags(write=False)  # shared by every call
    return found


def _turns(frequencies, positions, dtype, magnitude):
    angles = np.asarray(positions, np.float64)[:, None] * frequencies  # (N, F)
    cos, sin = np.cos(angles), np.sin(angles)
    if magnitude != 1.0:
        cos, sin = cos * magnitude, sin * magnitude
    return cos.astype(dtype)[:, None, :], sin.astype(dtype)[:, None, :]


def llama_turns(head_dim: int, theta: float, positions, dtype) -> tuple[np.ndarray, np.ndarray]:
    """``turns`` for ``rope``'s frequencies (heads of ``head_dim``, base ``theta``)."""
    return turns(_rope_frequencies(head_dim // 2, theta), positions, dtype)


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


def cross_entropy(probabilities: np.ndarray, picked: np.ndarray,
                  soft: np.ndarray | None = None) -> tuple[float, np.ndarray]:
    """The summed cross-entropy of rows of probabilities (n, V) against the labels ``picked``
    (n,) or, where ``soft`` (n, V) is given, against those distributions (the target's own: soft
    labels); and its gradient with respect to the rows' logits, written over ``probabilities``."""
    if soft is None:
        rows = np.arange(len(probabilities))
        loss = float(-np.log(probabilities[rows, picked] + 1e-30).sum())
        probabilities[rows, picked] -= 1.0
        return loss, probabilities
    loss = float(-(soft * np.log(probabilities + 1e-30)).sum())
    probabilities -= soft
    return loss, probabilities


def teacher_distributions(states: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """(n, V) the target's distributions at final-normed ``states`` (n, H) over the vocabulary
    whose output-head rows are ``rows`` (V, H): its soft labels over a draft vocabulary."""
    return softmax(states @ rows.T)


def zero_padded(array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``array`` in the leading corner of a zero array of ``shape`` (heads for a target widened
    with zeros: modelkit/widen.py)."""
    padded = np.zeros(shape, array.dtype)
    padded[tuple(slice(0, n) for n in array.shape)] = array
    return padded


def widened_columns(weight: np.ndarray, hidden: int, wide: int) -> np.ndarray:
    """``weight`` (R, hidden + extra), whose first ``hidden`` columns read the target's state, with
    those columns at the front of ``wide`` ones (zeros after them) and the rest after."""
    padded = np.zeros((weight.shape[0], wide + weight.shape[1] - hidden), weight.dtype)
    padded[:, :hidden] = weight[:, :hidden]
    padded[:, wide:] = weight[:, hidden:]
    return padded
