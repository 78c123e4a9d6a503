"""Widen a model with zeros so it computes exactly the same function at a larger cost.

Hidden size h -> H and MLP width m -> M, with more heads of the same head_dim.
Every new row and column is zero, so the extra hidden dimensions, heads and MLP
units stay exactly zero. The only non-zero-preserving step is RMSNorm, whose mean
is now taken over H dimensions: with r = h/H, scaling each norm weight by sqrt(r)
and eps by r gives back the original output, because
sqrt(sum(x^2)/H + eps*r) = sqrt(r) * sqrt(sum(x^2)/h + eps).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np

from specrun.heads.layers import zero_padded

from .config import ModelConfig, weight_shapes


def widened_config(config: ModelConfig, hidden: int, intermediate: int) -> ModelConfig:
    """The config of ``config`` widened to ``hidden`` and ``intermediate`` (same head_dim and GQA ratio)."""
    if hidden < config.hidden_size or intermediate < config.intermediate_size:
        raise ValueError("widening cannot shrink the model")
    if hidden % config.head_dim:
        raise ValueError(f"hidden size {hidden} is not a multiple of head_dim {config.head_dim}")
    num_heads = hidden // config.head_dim
    group = config.num_heads // config.num_kv_heads
    if num_heads % group:
        raise ValueError(f"{num_heads} heads cannot keep {group} query heads per kv head")
    return dataclasses.replace(
        config,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_heads=num_heads,
        num_kv_heads=num_heads // group,
        rms_norm_eps=config.rms_norm_eps * config.hidden_size / hidden,
    )


def widen(
    config: ModelConfig, weights: dict[str, np.ndarray], hidden: int, intermediate: int,
    matrices: type = np.float32,
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Zero-pad ``weights`` to ``hidden``/``intermediate`` so the model's logits are unchanged.

    Original values keep the leading rows and columns. Because head_dim is fixed and
    new heads are appended, each original head (and each kv group) keeps its rows,
    so q/k/v/o stay aligned head by head and the GQA grouping is preserved. Matrices come
    out as ``matrices`` (float16 for a file written in it: the same values, padded in half the
    memory), norms as float32.
    """
    wide_config = widened_config(config, hidden, intermediate)
    norm_scale = math.sqrt(config.hidden_size / hidden)
    wide_weights = {}
    for name, shape in weight_shapes(wide_config).items():
        if _is_norm(name):
            wide_weights[name] = zero_padded(np.asarray(weights[name], dtype=np.float32), shape) * np.float32(norm_scale)
        else:
            wide_weights[name] = zero_padded(np.asarray(weights[name]).astype(matrices, copy=False), shape)
    return wide_config, wide_weights


def derive_xl_gguf(
    src_gguf: str | Path, dst_gguf: str | Path, hidden: int, intermediate: int, dtype: str = "F16"
) -> ModelConfig:
    """Read ``src_gguf``, widen it (see :func:`widen`) and write ``dst_gguf``; returns the wide config."""
    from .gguf_io import read_gguf, write_gguf

    config, weights, tokenizer_json, chat_template = read_gguf(src_gguf)
    matrices = np.float16 if dtype == "F16" else np.float32  # what write_gguf stores them as
    wide_config, wide_weights = widen(config, weights, hidden, intermediate, matrices)
    write_gguf(dst_gguf, wide_config, wide_weights, tokenizer_json, chat_template, dtype=dtype)
    return wide_config


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")
