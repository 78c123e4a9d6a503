"""Cut layers out of a model: a cheaper, less faithful copy of it, to draft with.

A model with some of its decoder layers removed still reads the same vocabulary and writes
the same kind of residual stream (each layer only adds to it), so it predicts the target's next
token often, but far less often than a quantized copy of the whole model does. It is the draft
a benchmark needs beside a near-perfect one, so that no figure rests only on a draft that agrees
with its target almost always (docs/perf.md).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from .config import ModelConfig

LAYER_PREFIX = "model.layers."


def keep_layers(
    config: ModelConfig, weights: dict[str, np.ndarray], kept: tuple[int, ...]
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """``config`` and ``weights`` with only the layers ``kept`` (in that order, renumbered from 0);
    the embeddings, the final norm and the output head unchanged."""
    if not kept:
        raise ValueError("keep at least one layer")
    if len(set(kept)) != len(kept) or list(kept) != sorted(kept):
        raise ValueError(f"the kept layers {kept} must be distinct and in order")
    if kept[0] < 0 or kept[-1] >= config.num_layers:
        raise ValueError(f"layer {kept[-1] if kept[0] >= 0 else kept[0]} is not one of the model's {config.num_layers}")
    new_index = {old: new for new, old in enumerate(kept)}
    cut = {}
    for name, weight in weights.items():
        if not name.startswith(LAYER_PREFIX):
            cut[name] = weight
            continue
        number, _, rest = name[len(LAYER_PREFIX):].partition(".")
        if int(number) in new_index:
            cut[f"{LAYER_PREFIX}{new_index[int(number)]}.{rest}"] = weight
    return dataclasses.replace(config, num_layers=len(kept)), cut


def derive_cut_gguf(src_gguf: str | Path, dst_gguf: str | Path, left_out: tuple[int, ...], dtype: str = "Q8_0") -> ModelConfig:
    """Read ``src_gguf``, leave out the layers ``left_out`` (see :func:`keep_layers`) and write ``dst_gguf``."""
    from .gguf_io import read_gguf, write_gguf

    config, weights, tokenizer_json, chat_template = read_gguf(src_gguf)
    kept = tuple(i for i in range(config.num_layers) if i not in left_out)
    cut_config, cut_weights = keep_layers(config, weights, kept)
    write_gguf(dst_gguf, cut_config, cut_weights, tokenizer_json, chat_template, dtype=dtype)
    return cut_config
