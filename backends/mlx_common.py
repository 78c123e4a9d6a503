"""What the MLX backend and its window cache (backends/mlx.py, backends/mlx_window.py) share."""

from __future__ import annotations

PREFILL_CHUNK = 512  # tokens per forward when no logits are wanted (bounds activation memory)


class RowRope:
    """A RoPE module applied with one position per row: rows go onto the batch axis, where
    mx.fast.rope takes one offset each. Replaces an attention's ``rope`` for one pass."""

    def __init__(self, rope, offsets) -> None:
        self.rope = rope
        self.offsets = offsets  # (L,)

    def __call__(self, x, offset=0):  # noqa: ARG002 - the cache's scalar offset, replaced by the rows'
        rows_first = x.transpose(2, 1, 0, 3)  # (1, H, L, D) -> (L, H, 1, D)
        return self.rope(rows_first, offset=self.offsets).transpose(2, 1, 0, 3)  # (1, H, L, D)
