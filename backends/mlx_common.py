"""What the MLX backend, its window cache and its slots (backends/mlx.py, mlx_window.py,
mlx_slots.py) share."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

PREFILL_CHUNK = 512  # tokens per forward when no logits are wanted (bounds activation memory)
# RoPE modules that hand their offset straight to mx.fast.rope, which takes one per batch row:
# a packed pass (a tree's nodes, several slots' sequences) gives every row its own position.
ROW_OFFSET_ROPES = ("RoPE", "SuScaledRoPE", "Llama3RoPE", "YarnRoPE", "ProportionalRoPE")
# Held while a model call builds its graph: a packed pass swaps the model's RoPE modules for its
# call, and no other thread's call on the same modules (a slot's, the lone sequence's) may see them.
MODEL_CALLS = threading.RLock()


def release_thread_streams() -> None:
    """MLX's advice for a thread that used MLX and is about to end, the main thread before the
    process exits included (mx.clear_streams): the streams it made go now. Left to process exit,
    they aborted a server's stop now and then ("terminate called without an active exception").
    Nothing where MLX was never imported."""
    core = sys.modules.get("mlx.core")
    if core is not None and hasattr(core, "clear_streams"):
        core.clear_streams()


class RowRope:
    """A RoPE module applied with one position per row: rows go onto the batch axis, where
    mx.fast.rope takes one offset each. Replaces an attention's ``rope`` for one pass."""

    def __init__(self, rope, offsets) -> None:
        self.rope = rope
        self.offsets = offsets  # (L,)

    def __call__(self, x, offset=0):  # noqa: ARG002 - the cache's scalar offset, replaced by the rows'
        rows_first = x.transpose(2, 1, 0, 3)  # (1, H, L, D) -> (L, H, 1, D)
        return self.rope(rows_first, offset=self.offsets).transpose(2, 1, 0, 3)  # (1, H, L, D)


def packed_problem(model, caches, what: str, kinds: tuple[str, ...] = ("KVCache",),
                   apart: frozenset[int] = frozenset()) -> str | None:
    """Why ``model`` cannot run a packed pass over ``caches`` (layers whose cache is of ``kinds``,
    plain KVCache where not said, their mask from ``make_mask``, and RoPE modules that take one
    offset per row) holding ``what`` (a tree, several sequences); None where it can. Layers in
    ``apart`` (a recurrent mixer run sequence by sequence: backends/mlx_slots.py) are not asked."""
    for index, layer_cache in enumerate(caches):
        if index not in apart and type(layer_cache).__name__ not in kinds:
            return (f"its {type(layer_cache).__name__} cache (sliding-window, quantized or recurrent state) "
                    f"cannot hold {what}")
    layers = getattr(model, "layers", ())
    attentions = [getattr(layer, "self_attn", None) for index, layer in enumerate(layers) if index not in apart]
    if not attentions or any(type(getattr(a, "rope", None)).__name__ not in ROW_OFFSET_ROPES for a in attentions):
        return "its attention does not use a standard RoPE call"
    return None


@contextmanager
def packed_pass(model, caches, mask, offsets) -> Iterator[None]:
    """During one model call, under MODEL_CALLS: every cache's ``make_mask`` returns ``mask``
    (L, cells + L; or a list, one mask per cache) and every attention's RoPE places row i at
    ``offsets[i]`` (an (L,) array)."""
    masks = mask if isinstance(mask, list) else [mask] * len(caches)
    with MODEL_CALLS:
        attentions = [layer.self_attn for layer in model.layers if hasattr(layer, "self_attn")]  # a hybrid's
        ropes = [attention.rope for attention in attentions]
        try:
            for layer_cache, layer_mask in zip(caches, masks):
                layer_cache.make_mask = lambda *args, layer_mask=layer_mask, **kwargs: layer_mask
            for attention, rope in zip(attentions, ropes):
                attention.rope = RowRope(rope, offsets)
            yield
        finally:
            for layer_cache in caches:
                layer_cache.__dict__.pop("make_mask", None)
            for attention, rope in zip(attentions, ropes):
                attention.rope = rope  # a Module: mlx's __setattr__ puts it back in the module's dict


class _LayerRecorder:
    """A layer of an mlx-lm body that, called, also hands its output to ``sink`` (index, output);
    anything else asked of it is the layer's own."""

    def __init__(self, layer, index: int, sink: list) -> None:
        self._layer, self._index, self._sink = layer, index, sink

    def __call__(self, *args, **kwargs):
        out = self._layer(*args, **kwargs)
        self._sink.append((self._index, out))
        return out

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "_layer":  # copy's probes of a bare instance: no recursion
            raise AttributeError(name)
        return getattr(self._layer, name)


def recording_body(body, layers: Sequence[int], sink: list):
    """A view of an mlx-lm body (a shallow copy, its layers this body's objects) whose ``layers``
    hand their outputs to ``sink`` as it runs."""
    import copy

    view = copy.copy(body)
    view.layers = [_LayerRecorder(layer, index, sink) if index in layers else layer
                   for index, layer in enumerate(body.layers)]
    return view
