"""Convert a llama-family GGUF file into a model folder that mlx-lm loads (mlx-lm cannot read GGUF);
Qwen3.5's hybrids in modelkit.gguf_convert_qwen35, GLM-4.5's and DeepSeek's latent attention with
their MTP layers in modelkit.gguf_convert_glm.

Weights are written as float16, or as MLX affine quantized groups of 32 (``q4``). A
GGML Q4_1 block (32 values, ``x = d * q + m``) is exactly an MLX 4-bit group
(``w = scale * q + bias``), so Q4_1 tensors are repacked without loss; Q4_0 and Q8_0
blocks are likewise exact (Q8_0 as MLX 8-bit, which keeps the embedding llama.cpp's
Q4_1 files store as Q8_0 as exact as it is there). Any other type is dequantized and
quantized afresh to 4 bits.

The tokenizer is rebuilt from the GGUF vocabulary as a ``tokenizer.json`` whose
pre-tokenizer is the one llama.cpp selects by ``tokenizer.ggml.pre``, so both backends
split text into the same tokens. One exception outside the folder's control:
transformers 5 builds the tokenizer of every ``qwen2`` folder with Qwen2's own regex
and NFC normalization, whatever tokenizer.json says; that matches llama.cpp for qwen2
GGUFs with the ``qwen2`` pre-tokenizer (real Qwen2 files) on NFC text.
"""

from __future__ import annotations

import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from specrun.errors import ModelFileError
from specrun.fileio import with_new_file_mode

from .config import ARCHITECTURES, ModelConfig, weight_names
from .gguf_check import READABLE_TYPES, check_fields, check_tensors, read_layout
from .gguf_convert_glm import ARCHS as GLM_ARCHS
from .gguf_convert_glm import SELECTION_BIAS, check_glm, check_glm_shapes, glm_config, glm_tensor_plan
from .gguf_header import header_values
from .gguf_convert_qwen35 import ARCHS as QWEN35_ARCHS
from .gguf_convert_qwen35 import (MTP_FILE, check_qwen35, check_qwen35_shapes, is_next, next_qkvz, qwen35_config,
                                  qwen35_tensor_plan, text_config, token_ids)
from .gguf_io import from_gguf_layout, gguf_tensor_name, read_config, read_vocab
from .hf_io import hf_config_dict, vocab_tokenizer_config, write_json, write_model_files
from .tokenizer import GPT2_PRE_TOKENIZER, ByteBpeVocab, build_tokenizer_json

MLX_DTYPES = ("float16", "q4")
CONVERTIBLE = ARCHITECTURES + QWEN35_ARCHS + GLM_ARCHS  # what `models convert` turns into an MLX folder
# Control tokens llama.cpp ends generation on by their text whatever the metadata says
# (llama-vocab.cpp): listed as EOS in the folder too, so MLX stops where llama.cpp stops.
_EOG_TEXTS = frozenset(
    ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_text|>", "<EOT>")
)
GROUP_SIZE = 32  # GGML's Q4_0/Q4_1/Q8_0 block length, and MLX's group size here


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text before BPE for one ``tokenizer.ggml.pre``, in ``tokenizer.json`` form."""

    spec: dict
    ignore_merges: bool = False  # a word that is itself a token stays one token (Llama 3)
    add_bos_default: bool = False  # llama.cpp's add_bos when the file does not say


def _split_then_bytes(*patterns: str) -> dict:
    """Regex splits (matches kept as pieces, as llama.cpp does; each regex splitting the pieces the
    one before made, as llama.cpp applies several) followed by the byte mapping."""
    return {
        "type": "Sequence",
        "pretokenizers": [
            *({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
              for pattern in patterns),
            {**GPT2_PRE_TOKENIZER, "use_regex": False},
        ],
    }


# The regexes of llama.cpp's llama-vocab.cpp (llm_tokenizer_bpe), in the case-spelled-out
# form llama.cpp uses: Hugging Face's (?i:'s) would also match the long s "ſ".
_QWEN2_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_REGEX = _QWEN2_REGEX.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
# Qwen3.5's: combining marks join the letters of a word
_QWEN35_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek-V3's three, applied in turn: digits in threes, CJK runs, then a GPT-4-like split
_DEEPSEEK3_REGEXES = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_GPT2 = PreTokenizer(GPT2_PRE_TOKENIZER)
_DIGITS_THEN_GPT2 = PreTokenizer(
    {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, GPT2_PRE_TOKENIZER]}
)
_QWEN2 = PreTokenizer(_split_then_bytes(_QWEN2_REGEX))
_LLAMA3 = PreTokenizer(_split_then_bytes(_LLAMA3_REGEX), ignore_merges=True, add_bos_default=True)
PRE_TOKENIZERS = {
    "gpt-2": _GPT2,
    "smollm": _DIGITS_THEN_GPT2,  # each digit alone, then GPT-2's regex
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "qwen35": PreTokenizer(_split_then_bytes(_QWEN35_REGEX)),
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    # GLM-4.5's and GLM-4.7-Flash's (llama.cpp's CHATGLM4: Llama 3's regex, merges kept, no BOS of
    # its own: the chat template writes [gMASK]<sop>)
    "glm4": PreTokenizer(_split_then_bytes(_LLAMA3_REGEX)),
    "chatglm-bpe": PreTokenizer(_split_then_bytes(_LLAMA3_REGEX)),
    "deepseek-v3": PreTokenizer(_split_then_bytes(*_DEEPSEEK3_REGEXES)),
}


def convert_gguf_to_mlx(source: Path, out: Path, *, mlx_dtype: str = "float16") -> None:
    """Write an mlx-lm model folder at ``out`` (which must not exist) from the GGUF ``source``:
    a llama or qwen2 model, Qwen3.5's or Qwen3-Next's hybrid (qwen35, qwen35moe, qwen3next; its
    MTP layers carried along, modelkit.gguf_convert_qwen35), or GLM-4.5's or DeepSeek's latent
    attention (glm4moe, deepseek2; their MTP layers carried along, modelkit.gguf_convert_glm).

    ``mlx_dtype``: ``float16``, or ``q4`` (MLX affine 4-bit, group size 32; exact for
    Q4_1 tensors). The folder holds config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json (with the chat template) and generation_config.json.
    Raises :class:`ModelFileError` for a file that is not a GGUF or describes an
    architecture or tokenizer this converter does not handle.
    """
    from specrun.backends.llama import check_gguf_file

    if mlx_dtype not in MLX_DTYPES:
        raise ValueError(f"mlx_dtype must be one of {MLX_DTYPES}, got {mlx_dtype!r}")
    source = Path(source)
    check_gguf_file(source)
    arch = _header_architecture(source)
    if arch is not None:  # a header that does not parse is named by read_layout below
        _check_architecture(source, arch)  # before a whole vocabulary is parsed
    damaged = "download or convert the file again"
    try:
        fields, infos = read_layout(source)  # every count, length and offset against the file, first
    except (ValueError, struct.error) as exc:
        raise ModelFileError(f"{source} is damaged: {exc}", damaged) from None
    try:
        _check_supported(source, fields, {info.name for info in infos})
    except (TypeError, ValueError) as exc:  # a field of the wrong type (an embedding length given as text)
        raise ModelFileError(f"{source} cannot be converted: {exc}", damaged) from None
    try:
        reader = gguf.GGUFReader(str(source))
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"cannot read {source} as GGUF: {exc}", damaged) from exc
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    pre = PRE_TOKENIZERS[fields[gguf.Keys.Tokenizer.PRE]]
    hybrid = fields[gguf.Keys.General.ARCHITECTURE] in QWEN35_ARCHS
    glm = fields[gguf.Keys.General.ARCHITECTURE] in GLM_ARCHS
    shapes = {name: tuple(int(n) for n in reversed(tensor.shape.tolist())) for name, tensor in tensors.items()}
    try:
        vocab = read_vocab(fields, add_bos_default=pre.add_bos_default)
        if hybrid:
            config_json = qwen35_config(fields, tensors, len(vocab.tokens))
            check_qwen35_shapes(config_json, shapes)  # before anything is written
            _check_readable(infos)
        elif glm:
            config_json = glm_config(fields, tensors, len(vocab.tokens))
            check_glm_shapes(config_json, shapes)  # before anything is written
            _check_readable(infos)
        else:
            ids = config = read_config(fields, vocab, tie_embeddings="output.weight" not in tensors)
            check_tensors(infos, config)  # before anything is written
        if hybrid or glm:
            ids = token_ids(fields.get(gguf.Keys.Tokenizer.BOS_ID, 1), fields.get(gguf.Keys.Tokenizer.EOS_ID, 2),
                            text_config(config_json)["max_position_embeddings"])
    except (ValueError, TypeError, KeyError) as exc:
        raise ModelFileError(f"{source} cannot be converted: {exc}", damaged) from None

    if hybrid:
        weights, per_layer_bits = _qwen35_weights(tensors, config_json, mlx_dtype)
    elif glm:
        weights, per_layer_bits = _glm_weights(tensors, config_json, mlx_dtype)
    else:
        weights, per_layer_bits = {}, {}
        for hf_name in weight_names(config):
            tensor = tensors.get(gguf_tensor_name(hf_name))
            if tensor is None:
                raise ModelFileError(f"{source} lacks the tensor {gguf_tensor_name(hf_name)}", "convert the model again")
            converted, bits = _mlx_tensors(config, hf_name, tensor, mlx_dtype)
            weights.update(converted)
            if bits not in (None, 4):
                per_layer_bits[hf_name.removesuffix(".weight")] = {"group_size": GROUP_SIZE, "bits": bits}
        config_json = hf_config_dict(config, "float16")

    keys = gguf.Keys.Tokenizer
    eos_ids = _eos_ids(fields, vocab)
    if eos_ids:
        config_json["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if mlx_dtype == "q4":
        quantization = {"group_size": GROUP_SIZE, "bits": 4, "mode": "affine", **per_layer_bits}
        config_json["quantization"] = config_json["quantization_config"] = quantization
    tokenizer_json = build_tokenizer_json(vocab, pre.spec, pre.ignore_merges)
    chat_template = fields.get(keys.CHAT_TEMPLATE)
    tokenizer_config = vocab_tokenizer_config(ids, vocab, fields.get(keys.PAD_ID), chat_template)
    beside = {}
    if hybrid and is_next(config_json):  # the MTP layers in a file of their own (gguf_convert_qwen35.MTP_FILE)
        beside = {name: weights.pop(name) for name in list(weights) if name.startswith("mtp.")}
    write_model_files(out, weights, config_json, tokenizer_json, tokenizer_config)
    if beside:
        from safetensors.numpy import save_file

        save_file({name: np.ascontiguousarray(array) for name, array in beside.items()}, str(Path(out) / MTP_FILE),
                  metadata={"format": "pt"})
        with_new_file_mode(Path(out) / MTP_FILE)
    generation = {"bos_token_id": ids.bos_token_id, "eos_token_id": config_json.get("eos_token_id", ids.eos_token_id)}
    write_json(Path(out) / "generation_config.json", generation)


def _eos_ids(fields: dict, vocab: ByteBpeVocab) -> list[int]:
    """The ids that end generation: the declared EOS/EOT/EOM first, then llama.cpp's by-text ones."""
    keys = gguf.Keys.Tokenizer
    declared = [fields[key] for key in (keys.EOS_ID, keys.EOT_ID, keys.EOM_ID) if key in fields]
    by_text = [i for i in sorted(vocab.special_ids) if vocab.tokens[i] in _EOG_TEXTS]
    return list(dict.fromkeys(declared + by_text))


def _check_architecture(source: Path, arch: str | None) -> None:
    if arch not in CONVERTIBLE:
        raise ModelFileError(
            f"{source}: architecture {arch!r} cannot be converted to MLX",
            f"supported architectures: {', '.join(CONVERTIBLE)}",
        )


def _header_architecture(source: Path) -> str | None:
    """``general.architecture`` from the header alone (GGUFReader takes ~15 s over Gemma 3's
    262k-token vocabulary: too long to wait for a refusal); None where the header does not parse."""
    try:
        return next((value for key, value in header_values(source) if key == gguf.Keys.General.ARCHITECTURE), None)
    except ValueError:
        return None  # GGUFReader names the problem


def _check_supported(source: Path, fields: dict, tensors: Collection[str]) -> None:
    """One ModelFileError naming what the file uses that the conversion cannot express; a
    ValueError or TypeError naming a damaged field."""
    arch = fields.get(gguf.Keys.General.ARCHITECTURE)
    _check_architecture(source, arch)
    tokenizer_model = fields.get(gguf.Keys.Tokenizer.MODEL)
    if tokenizer_model != "gpt2":
        raise ModelFileError(
            f"{source}: tokenizer type {tokenizer_model!r} cannot be converted to MLX",
            "supported: byte-level BPE (tokenizer.ggml.model gpt2)",
        )
    pre = fields.get(gguf.Keys.Tokenizer.PRE)
    if pre not in PRE_TOKENIZERS:
        raise ModelFileError(
            f"{source}: pre-tokenizer {pre!r} cannot be converted to MLX",
            f"supported tokenizer.ggml.pre: {', '.join(PRE_TOKENIZERS)}",
        )
    check_fields(fields, arch)  # before the sizes below are read from them (an embedding length of -128)
    if arch in QWEN35_ARCHS:
        check_qwen35(source, fields, tensors)
        return
    if arch in GLM_ARCHS:
        check_glm(source, fields, tensors)
        return
    heads = fields.get(gguf.Keys.Attention.HEAD_COUNT.format(arch=arch))
    head_dim = fields.get(gguf.Keys.LLM.EMBEDDING_LENGTH.format(arch=arch), 0) // (heads or 1)
    unsupported = {
        "RoPE scaling": fields.get(gguf.Keys.Rope.SCALING_TYPE.format(arch=arch), "none") != "none"
        or "rope_freqs.weight" in tensors,
        "mixture of experts": bool(fields.get(gguf.Keys.LLM.EXPERT_COUNT.format(arch=arch))),
        "a head size other than embedding / heads": fields.get(
            gguf.Keys.Attention.KEY_LENGTH.format(arch=arch), head_dim
        ) != head_dim,
        "partial RoPE": fields.get(gguf.Keys.Rope.DIMENSION_COUNT.format(arch=arch), head_dim) != head_dim,
    }
    found = [feature for feature, present in unsupported.items() if present]
    if found:
        raise ModelFileError(
            f"{source}: this {arch} model uses {found[0]}, which the MLX conversion does not handle",
            f"supported: plain {', '.join(ARCHITECTURES)} models (full RoPE, no scaling, no experts)",
        )


def _mlx_tensors(
    config: ModelConfig, hf_name: str, tensor: gguf.ReaderTensor, mlx_dtype: str
) -> tuple[dict[str, np.ndarray], int | None]:
    """The MLX tensors for one GGUF tensor, and the bits it was quantized to (None: float16)."""
    data = np.asarray(tensor.data)
    if mlx_dtype == "q4" and data.ndim == 2:
        groups = _exact_groups(data, tensor.tensor_type) or _quantize_groups(_dequantize(tensor), bits=4)
        if groups is not None:
            packed = _packed(hf_name, groups)
            return {name: from_gguf_layout(config, hf_name, array) for name, array in packed.items()}, groups[3]
    return {hf_name: from_gguf_layout(config, hf_name, _dequantize(tensor)).astype(np.float16)}, None


def _qwen35_weights(tensors: dict, config_json: dict, mlx_dtype: str) -> tuple[dict[str, np.ndarray], dict]:
    """The folder's tensors from a qwen35/qwen35moe GGUF's (modelkit.gguf_convert_qwen35 says what
    changes), and the per-layer bits of those quantized to other than 4. With ``q4`` the matrices
    are MLX 4-bit groups (GGML's own blocks where a tensor is stored unchanged and they are exact);
    the routers, the convolution and the vectors stay float16 (A_log float32, as mlx-lm keeps it)."""
    weights: dict[str, np.ndarray] = {}
    per_layer_bits: dict[str, dict] = {}
    joining: dict[str, np.ndarray] = {}  # Qwen3-Next: a layer's qkv rows until its z rows come, or the reverse
    for gguf_name, (name, change) in sorted(qwen35_tensor_plan(config_json, tensors).items()):
        tensor = tensors[gguf_name]
        quantized = mlx_dtype == "q4" and name.endswith(".weight") and not name.endswith(
            ("conv1d.weight", "mlp.gate.weight", "shared_expert_gate.weight", "norm.weight"))
        joined = is_next(config_json) and name.endswith(("in_proj_qkv.weight", "in_proj_z.weight"))
        groups = None
        if quantized and change is None and len(tensor.shape) == 2 and not joined:
            groups = _exact_groups(np.asarray(tensor.data), tensor.tensor_type)
        array = _dequantize(tensor) if groups is None else None
        if array is not None and change is not None:
            try:
                array = change(array)
            except ValueError as exc:  # a shape the header's head counts cannot regroup
                raise ModelFileError(f"its tensor {gguf_name} {array.shape} does not fit the header's head counts "
                                     f"({exc})", "convert the model again") from None
        if joined:
            module = name.rsplit(".", 2)[0]
            if module not in joining:
                joining[module] = array
                continue
            qkv, z = (joining.pop(module), array) if name.endswith("in_proj_z.weight") else (array, joining.pop(module))
            try:
                array, name = next_qkvz(config_json, qkv, z), f"{module}.in_proj_qkvz.weight"
            except ValueError as exc:
                raise ModelFileError(f"its tensor {gguf_name} {array.shape} does not fit the header's head counts "
                                     f"({exc})", "convert the model again") from None
        if quantized and groups is None and array.ndim in (2, 3):
            groups = _quantize_groups(array, bits=4)
        if groups is None:
            weights[name] = array if name.endswith("A_log") else array.astype(np.float16)
            continue
        weights.update(_packed(name, groups))
        if groups[3] != 4:
            per_layer_bits[name.removesuffix(".weight")] = {"group_size": GROUP_SIZE, "bits": groups[3]}
    return weights, per_layer_bits


def _glm_weights(tensors: dict, config_json: dict, mlx_dtype: str) -> tuple[dict[str, np.ndarray], dict]:
    """The folder's tensors from a glm4moe/deepseek2 GGUF's, each renamed (modelkit.gguf_convert_glm),
    and the per-layer bits of those quantized to other than 4. float16 but the experts' selection
    bias, float32 as the checkpoints hold it. With ``q4`` every matrix whose rows divide into groups
    of 32 is MLX groups as mlx-lm's quantize would make them (its rule: a module whose input width
    the group divides), GGML's own blocks where they are exact (``_exact_groups``), else 4 bits
    afresh: the stacked experts (experts, rows, columns) expert by expert as mlx-lm's
    QuantizedSwitchLinear holds them, k_b and v_b head by head as its QuantizedMultiLinear, the
    embedding and output head, and the MTP block's matrices (modelkit.mtp.read_mtp_folder reads
    them as stored, and MLX's MTP layer computes with them quantized). The norms and the router
    (a module mlx-lm does not quantize) stay as the float16 folder holds them."""
    weights: dict[str, np.ndarray] = {}
    per_layer_bits: dict[str, dict] = {}
    for gguf_name, name in sorted(glm_tensor_plan(config_json, tensors).items()):
        tensor = tensors[gguf_name]
        data = np.asarray(tensor.data)
        groups = None
        if mlx_dtype == "q4" and len(tensor.shape) in (2, 3) and name.endswith(".weight") and not name.endswith(
                ("norm.weight", "mlp.gate.weight")):
            groups = _stacked_exact_groups(data, tensor.tensor_type) or _each_expert_quantized(tensor)
        if groups is None:
            weights[name] = (_dequantize(tensor) if name.endswith(SELECTION_BIAS)
                             else _each_expert_dequantized(tensor, np.float16))
            continue
        weights.update(_packed(name, groups))
        if groups[3] != 4:
            per_layer_bits[name.removesuffix(".weight")] = {"group_size": GROUP_SIZE, "bits": groups[3]}
    return weights, per_layer_bits


def _stacked_exact_groups(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> Groups | None:
    """``_exact_groups`` of a tensor of any rank: GGML stores a stacked tensor's blocks along its
    rows (the last dimension), expert after expert, so each leading index keeps its own groups."""
    groups = _exact_groups(data.reshape(-1, data.shape[-1]), qtype)
    if groups is None:
        return None
    values, scales, biases, bits = groups
    lead = data.shape[:-1]
    return (values.reshape(*lead, -1), scales.reshape(*lead, -1), biases.reshape(*lead, -1), bits)


def _check_readable(infos) -> None:
    """ValueError naming the first tensor of a type gguf-py cannot dequantize (Q8_1, integers)."""
    for info in infos:
        if gguf.GGMLQuantizationType(info.kind) not in READABLE_TYPES:
            raise ValueError(f"the tensor {info.name} is of type {gguf.GGMLQuantizationType(info.kind).name}, "
                             "which the conversion cannot read")


def _packed(name: str, groups: Groups) -> dict[str, np.ndarray]:
    """The weight ``name`` as MLX stores quantized groups: packed words, scales and biases."""
    values, scales, biases, bits = groups
    if name.endswith("embed_tokens.weight"):
        # The embedding's dtype becomes the activations' dtype, and MLX's CPU quantized matmul is
        # ~30x slower on float16 activations than on float32 (measured on Linux); float16 scales
        # widen to float32 exactly.
        scales, biases = scales.astype(np.float32), biases.astype(np.float32)
    module = name.removesuffix(".weight")
    return {name: _pack(values, bits), f"{module}.scales": scales, f"{module}.biases": biases}


def _dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    return gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float32, copy=False)


# A stacked tensor (routed experts: GLM-4.5-Air's hold ~0.5 GB each as Q4_K) is dequantized one
# expert at a time: the whole stack in float32 at once, and its temporaries, was several times
# the file's size in memory.
def _each_expert_dequantized(tensor: gguf.ReaderTensor, dtype) -> np.ndarray:
    data = np.asarray(tensor.data)
    if data.ndim < 3:
        return _dequantize(tensor).astype(dtype, copy=False)
    return np.stack([gguf.quants.dequantize(data[expert], tensor.tensor_type).astype(dtype, copy=False)
                     for expert in range(data.shape[0])])


def _each_expert_quantized(tensor: gguf.ReaderTensor) -> Groups | None:
    """``_quantize_groups`` of the tensor in 4 bits, a stacked one expert at a time."""
    data = np.asarray(tensor.data)
    if data.ndim < 3:
        return _quantize_groups(_dequantize(tensor), bits=4)
    each = [_quantize_groups(gguf.quants.dequantize(data[expert], tensor.tensor_type).astype(np.float32, copy=False),
                             bits=4) for expert in range(data.shape[0])]
    if any(groups is None for groups in each):
        return None
    return (np.stack([groups[0] for groups in each]), np.stack([groups[1] for groups in each]),
            np.stack([groups[2] for groups in each]), 4)


Groups = tuple[np.ndarray, np.ndarray, np.ndarray, int]
"""(values (..., cols) uint8, scales (..., cols / 32) float16, biases likewise, bits):
weight = scales * values + biases, group by group along each row."""


def _exact_groups(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> Groups | None:
    """The GGML blocks of ``data`` (rows, bytes) as MLX affine groups, where that is exact."""
    rows = data.shape[0]
    if qtype == gguf.GGMLQuantizationType.Q4_1:
        blocks = data.reshape(rows, -1, 20)  # (rows, groups, d: f16 | m: f16 | 16 bytes of nibbles)
        return _nibbles(blocks[..., 4:]), _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4]), 4
    if qtype == gguf.GGMLQuantizationType.Q4_0:
        blocks = data.reshape(rows, -1, 18)  # (rows, groups, d: f16 | 16 bytes of nibbles); x = d * (q - 8)
        scales = _f16(blocks[..., 0:2])
        groups = _nibbles(blocks[..., 2:]), scales, scales * np.float16(-8), 4
    elif qtype == gguf.GGMLQuantizationType.Q8_0:
        blocks = data.reshape(rows, -1, 34)  # (rows, groups, d: f16 | 32 int8); x = d * q = d * (q + 128) - 128 d
        scales = _f16(blocks[..., 0:2])
        values = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8).reshape(rows, -1)
        groups = values, scales, scales * np.float16(-128), 8
    else:
        return None
    # A power-of-two multiple of a float16 is exact unless it overflows (|d| > 511 for Q8_0).
    return groups if np.isfinite(groups[2]).all() else None


def _f16(pairs: np.ndarray) -> np.ndarray:
    """(rows, groups, 2) bytes -> (rows, groups) float16."""
    return np.ascontiguousarray(pairs).view(np.float16)[..., 0]


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """(rows, groups, 16) bytes of a GGML 4-bit block -> (rows, groups * 32) values: the low
    nibbles are elements 0-15 of the block, the high nibbles elements 16-31."""
    rows = packed.shape[0]
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)


def _quantize_groups(weight: np.ndarray, bits: int) -> Groups | None:
    """Min-max affine quantization of (..., cols) float32 in groups of 32 along each row (None: cols
    do not divide)."""
    cols = weight.shape[-1]
    if cols % GROUP_SIZE:
        return None
    groups = weight.reshape(*weight.shape[:-1], -1, GROUP_SIZE)  # (..., groups, 32)
    levels = (1 << bits) - 1
    low, high = groups.min(axis=-1), groups.max(axis=-1)
    scales = ((high - low) / levels).astype(np.float16)
    biases = low.astype(np.float16)
    # Round against the float16 scale and bias actually stored, not the float32 ones.
    step = np.where(scales == 0, 1, scales).astype(np.float32)[..., None]
    values = np.rint((groups - biases.astype(np.float32)[..., None]) / step)
    return np.clip(values, 0, levels).astype(np.uint8).reshape(weight.shape), scales, biases, bits


def _pack(values: np.ndarray, bits: int) -> np.ndarray:
    """(..., cols) values -> (..., cols * bits / 32) uint32, MLX's layout: element j of
    each word in bits [j * bits, (j + 1) * bits)."""
    per_word = 32 // bits
    words = values.reshape(*values.shape[:-1], -1, per_word).astype(np.uint32)
    shifts = np.arange(per_word, dtype=np.uint32) * np.uint32(bits)
    return np.bitwise_or.reduce(words << shifts, axis=-1)
