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
    zero (silu(0) = 0), each projection reads the original columns. They draft exactly what they
    drafted for the original, at the wider state's cost."""
    width = target_hidden
    blocks = tuple(tuple((zero_padded(weight, (width, width)), zero_padded(bias, (width,))) for weight, bias in head)
                   for head in heads.blocks)
    shared = {}  # a projection the heads share stays shared
    lm_heads = tuple(shared.setdefault(id(p), zero_padded(p, (p.shape[0], width))) for p in heads.lm_heads)
    config = dataclasses.replace(heads.config, hidden_size=width, target_name=target_name)
    return dataclasses.replace(heads, config=config, blocks=blocks, lm_heads=lm_heads)

