"""Medusa heads (Cai et al. 2024) as NumPy arrays: head i (0-based) reads the hidden state h_p
alone and guesses token p + 2 + i through ``num_layers`` residual blocks, h <- h + silu(W h + b),
then a projection over the draft vocabulary (``d2t``: the target id of each draft id)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specrun.heads.config import HeadsConfig


@dataclass(frozen=True)
class MedusaHeads:
    """Medusa heads as NumPy arrays (float32).

    blocks[i][j]: (weight (H, H), bias (H,)) of head i's residual block j.
    lm_heads[i]: (Vd, H) head i's projection over the draft vocabulary (heads may share one).
    d2t: (Vd,) int64, the target id of each draft id; None when Vd is the target's vocabulary.
    """

    config: HeadsConfig
    blocks: tuple[tuple[tuple[np.ndarray, np.ndarray], ...], ...]
    lm_heads: tuple[np.ndarray, ...]
    d2t: np.ndarray | None = None

    @property
    def depth_bytes(self) -> float:
        """Bytes of weights drafting one depth reads, on average over the heads (each its blocks
        and its projection)."""
        per_head = [sum(w.nbytes + b.nbytes for w, b in blocks) + projection.nbytes
                    for blocks, projection in zip(self.blocks, self.lm_heads)]
        return sum(per_head) / len(per_head)
