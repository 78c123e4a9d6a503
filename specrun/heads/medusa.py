"""Medusa heads (Cai et al. 2024) as NumPy arrays: head i (0-based) reads the hidden state h_p
alone and guesses token p + 2 + i through ``num_layers`` residual blocks, h <- h + silu(W h + b),
then a projection over the draft vocabulary (``d2t``: the target id of each draft id)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from specrun.heads.config import HeadsConfig
from specrun.heads.layers import zero_padded


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


def widened_medusa(heads: MedusaHeads, target_hidden: int, target_name: str) -> MedusaHeads:
    """``heads`` for a target widened with zeros (modelkit.widen: its final state is the original's
    with zeros after it, ``target_hidden`` wide), padded with zeros: each block keeps the zeros
    zero (silu(0) = 0), each projection reads the original columns. They draft what they drafted
    for the original (the same arithmetic on the same numbers), at the wider state's cost."""
    wide = target_hidden
    blocks = tuple(tuple((zero_padded(weight, (wide, wide)), zero_padded(bias, (wide,))) for weight, bias in head)
                   for head in heads.blocks)
    padded = {}  # a projection the heads share stays shared
    for projection in heads.lm_heads:
        if id(projection) not in padded:
            padded[id(projection)] = zero_padded(projection, (projection.shape[0], wide))
    lm_heads = tuple(padded[id(projection)] for projection in heads.lm_heads)
    config = dataclasses.replace(heads.config, hidden_size=wide, target_name=target_name)
    return dataclasses.replace(heads, config=config, blocks=blocks, lm_heads=lm_heads)
