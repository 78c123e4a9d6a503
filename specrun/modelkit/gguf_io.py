"""Write and read GGUF files for llama.cpp from HF-layout weights.

llama.cpp's ``llama`` architecture applies RoPE to adjacent pairs (dims 2i, 2i+1),
while HF Llama checkpoints rotate the two halves of each head (dims i, i+hd/2).
llama.cpp's own converter reorders the q/k rows of every head to bridge the two;
:func:`write_gguf` does the same and :func:`read_gguf` undoes it. ``qwen2`` uses
NEOX-style RoPE (halves, like HF) and needs no reordering.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from pathlib import Path

import gguf
import numpy as np

from .config import ModelConfig, weight_names, weight_shapes
from .tokenizer import ByteBpeVocab, build_tokenizer_json, parse_tokenizer_json

DTYPES = ("F32", "F16", "Q8_0")

_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_LAYER_PATTERN = re.compile(r"model\.layers\.(?P<layer>\d+)\.(?P<rest>.+)")
_Q8_0_BLOCK = 32


def gguf_tensor_name(hf_name: str) -> str:
    """The GGUF name of an HF tensor name (``model.layers.3.mlp.up_proj.weight`` -> ``blk.3.ffn_up.weight``)."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    match = _LAYER_PATTERN.fullmatch(hf_name)
    if match and match["rest"] in _LAYER_NAMES:
        return f"blk.{match['layer']}.{_LAYER_NAMES[match['rest']]}"
    raise KeyError(f"no GGUF name for tensor {hf_name!r}")


def to_interleaved_rope(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder q/k projection rows from HF's half-split RoPE layout to adjacent-pair layout.

    Within each head, HF row ``half * hd/2 + i`` becomes row ``2 * i + half``.
    """
    rows = weight.shape[0]
    head_dim = rows // n_heads
    # (n_heads, 2 halves, hd/2, ...) -> (n_heads, hd/2, 2, ...)
    split = weight.reshape(n_heads, 2, head_dim // 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def from_interleaved_rope(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of :func:`to_interleaved_rope`."""
    rows = weight.shape[0]
    head_dim = rows // n_heads
    # (n_heads, hd/2, 2, ...) -> (n_heads, 2 halves, hd/2, ...)
    paired = weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:])
    return paired.swapaxes(1, 2).reshape(weight.shape)


def write_gguf(
    path: str | Path,
    config: ModelConfig,
    weights: dict[str, np.ndarray],
    tokenizer_json: str,
    chat_template: str | None = None,
    dtype: str = "F16",
    tokenizer_pre: str = "gpt-2",
) -> Path:
    """Write a llama.cpp GGUF file for ``config`` and HF-layout ``weights``.

    ``dtype`` (F32, F16 or Q8_0) applies to the matrices; norm weights and biases
    are always F32, and Q8_0 falls back to F16 for rows not a multiple of 32 long.
    The tokenizer must be byte-level BPE (see :mod:`specrun.modelkit.tokenizer`);
    ``tokenizer_pre`` names the pre-tokenizer llama.cpp applies (``tokenizer.ggml.pre``),
    which only ``gpt-2`` makes match ``tokenizer_json``.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    _check_weights(config, weights)
    vocab = parse_tokenizer_json(tokenizer_json)
    if len(vocab.tokens) != config.vocab_size:
        raise ValueError(
            f"tokenizer has {len(vocab.tokens)} tokens but the model's vocab_size is {config.vocab_size}"
        )
    if vocab.add_bos and vocab.bos_token_id != config.bos_token_id:
        raise ValueError(
            f"tokenizer prepends id {vocab.bos_token_id} but the model's bos_token_id is {config.bos_token_id}"
        )

    path = Path(path)
    writer = gguf.GGUFWriter(path, config.arch)
    _add_hparams(writer, config, dtype)
    add_tokenizer(writer, config, vocab, chat_template, tokenizer_pre)
    for hf_name in weight_names(config):
        data, raw_dtype = _encode_tensor(_to_gguf_layout(config, hf_name, weights[hf_name]), dtype)
        writer.add_tensor(gguf_tensor_name(hf_name), data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read_gguf(
    path: str | Path, layers: Callable[[int], Collection[int]] | None = None
) -> tuple[ModelConfig, dict[str, np.ndarray], str, str | None]:
    """Read a GGUF written by :func:`write_gguf` (or an equivalent converter).

    Returns ``(config, weights, tokenizer_json, chat_template)`` with the weights
    dequantized to float32 in HF naming and layout. ``layers(num_layers)``: the decoder layers
    whose weights are read (the others' are left out: a few layers of a large model fit in memory).
    """
    import struct

    from .gguf_check import check_fields, check_tensors, read_layout

    try:  # every count, length and offset against the file, and the fields read_config reads, first
        checked, infos = read_layout(path)
    except (ValueError, struct.error) as exc:
        raise ValueError(f"the file is damaged: {exc}") from None
    if checked.get(gguf.Keys.Tokenizer.MODEL) != "gpt2":
        raise ValueError(f"{path}: only byte-level BPE vocabularies (tokenizer.ggml.model gpt2) can be read")
    check_fields(checked, checked.get(gguf.Keys.General.ARCHITECTURE))
    reader = gguf.GGUFReader(str(path))
    fields = read_fields(reader)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    arch = checked.get(gguf.Keys.General.ARCHITECTURE)
    scaling = checked.get(f"{arch}.rope.scaling.type", "none") or "none"
    if scaling != "none" or "rope_freqs.weight" in tensors:  # Llama 3.1's: the copy would compute without it
        raise ValueError(f"it uses RoPE scaling ({scaling if scaling != 'none' else 'rope_freqs'}), which "
                         "specrun's copy of a model does not keep")
    vocab = read_vocab(fields)
    config = read_config(fields, vocab, tie_embeddings="output.weight" not in tensors)
    check_tensors(infos, config)  # each tensor there, of its shape and a type this reads
    wanted = set(layers(config.num_layers)) if layers is not None else None
    weights = {}
    for hf_name in weight_names(config):
        number = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
        if wanted is not None and number is not None and int(number) not in wanted:
            continue
        tensor = tensors[gguf_tensor_name(hf_name)]
        data = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float32)
        weights[hf_name] = from_gguf_layout(config, hf_name, data)
    return config, weights, build_tokenizer_json(vocab), fields.get(gguf.Keys.Tokenizer.CHAT_TEMPLATE)


def gguf_parameter_count(path: str | Path) -> int:
    """Every tensor's element count in a GGUF file, summed (a quantized tensor at its unquantized size)."""
    return int(sum(int(np.prod(tensor.shape)) for tensor in gguf.GGUFReader(str(path)).tensors))


def read_gguf_tensor(path: str | Path, name: str) -> np.ndarray:
    """One tensor of a GGUF file by its GGUF name (``output.weight``), dequantized to float32 in
    the file's layout: (rows, columns) for a matrix. KeyError if the file has no such tensor."""
    for tensor in gguf.GGUFReader(str(path)).tensors:
        if tensor.name == name:
            return gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float32)
    raise KeyError(f"{path} has no tensor {name!r}")


def read_fields(reader: gguf.GGUFReader) -> dict:
    """Every metadata field of an open GGUF as a plain Python value, by key."""
    return {name: _field_value(field) for name, field in reader.fields.items()}


def read_vocab(fields: dict, add_bos_default: bool = False) -> ByteBpeVocab:
    """The byte-level BPE vocabulary of a GGUF's metadata (``tokenizer.ggml.model`` gpt2).

    ``add_bos_default`` is what llama.cpp assumes when the file does not say.
    """
    keys = gguf.Keys.Tokenizer
    token_types = fields[keys.TOKEN_TYPE]

    def ids_of(kind: gguf.TokenType) -> frozenset[int]:
        return frozenset(i for i, token_type in enumerate(token_types) if token_type == kind)

    return ByteBpeVocab(
        tokens=tuple(fields[keys.LIST]),
        merges=tuple(fields.get(keys.MERGES, ())),
        special_ids=ids_of(gguf.TokenType.CONTROL),
        add_bos=bool(fields.get(keys.ADD_BOS, add_bos_default)),
        bos_token_id=fields.get(keys.BOS_ID),
        user_defined_ids=ids_of(gguf.TokenType.USER_DEFINED),
    )


def read_config(fields: dict, vocab: ByteBpeVocab, tie_embeddings: bool) -> ModelConfig:
    """The model description in a GGUF's metadata (``fields`` as :func:`read_fields` gives them)."""
    keys = gguf.Keys
    arch = fields[keys.General.ARCHITECTURE]

    def hparam(template: str, default=None):
        value = fields.get(template.format(arch=arch), default)
        if value is None:
            raise ValueError(f"the GGUF file lacks the key {template.format(arch=arch)}")
        return value

    num_heads = hparam(keys.Attention.HEAD_COUNT)
    return ModelConfig(
        arch=arch,
        vocab_size=len(vocab.tokens),
        hidden_size=hparam(keys.LLM.EMBEDDING_LENGTH),
        intermediate_size=hparam(keys.LLM.FEED_FORWARD_LENGTH),
        num_layers=hparam(keys.LLM.BLOCK_COUNT),
        num_heads=num_heads,
        num_kv_heads=hparam(keys.Attention.HEAD_COUNT_KV, num_heads),
        rope_theta=hparam(keys.Rope.FREQ_BASE, 10000.0),
        rms_norm_eps=hparam(keys.Attention.LAYERNORM_RMS_EPS),
        context_length=hparam(keys.LLM.CONTEXT_LENGTH),
        tie_embeddings=tie_embeddings,
        bos_token_id=fields.get(keys.Tokenizer.BOS_ID, 1),
        eos_token_id=fields.get(keys.Tokenizer.EOS_ID, 2),
    )


def _check_weights(config: ModelConfig, weights: dict[str, np.ndarray]) -> None:
    expected = weight_shapes(config)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ValueError(f"weights lack {len(missing)} tensors, e.g. {missing[0]}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"{name} has shape {weights[name].shape}, expected {shape}")


def _add_hparams(writer: gguf.GGUFWriter, config: ModelConfig, dtype: str) -> None:
    file_types = {
        "F32": gguf.LlamaFileType.ALL_F32,
        "F16": gguf.LlamaFileType.MOSTLY_F16,
        "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }
    writer.add_name(f"specrun-{config.arch}-{config.hidden_size}x{config.num_layers}")
    writer.add_file_type(file_types[dtype])
    if dtype == "Q8_0":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.context_length)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)


def add_tokenizer(
    writer: gguf.GGUFWriter, config: ModelConfig, vocab: ByteBpeVocab, chat_template: str | None, pre: str
) -> None:
    """The vocabulary, its special ids and ``chat_template`` as llama.cpp reads them (``config``
    gives the BOS and EOS ids)."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(list(vocab.tokens))
    kinds = dict.fromkeys(vocab.user_defined_ids, gguf.TokenType.USER_DEFINED)
    kinds.update(dict.fromkeys(vocab.special_ids, gguf.TokenType.CONTROL))
    writer.add_token_types([kinds.get(i, gguf.TokenType.NORMAL) for i in range(len(vocab.tokens))])
    writer.add_token_merges(list(vocab.merges))
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    pad_id = pad_token_id(vocab, config)
    if pad_id is not None:
        writer.add_pad_token_id(pad_id)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def pad_token_id(vocab: ByteBpeVocab, config: ModelConfig) -> int | None:
    """The first special token that is neither BOS nor EOS (``<|pad|>`` in specrun's tokenizers)."""
    others = [i for i in sorted(vocab.special_ids) if i not in (config.bos_token_id, config.eos_token_id)]
    return others[0] if others else None


def _to_gguf_layout(config: ModelConfig, hf_name: str, weight: np.ndarray) -> np.ndarray:
    """``weight`` as float32, in the row order llama.cpp expects."""
    weight = np.asarray(weight, dtype=np.float32)
    n_heads = _rope_heads(config, hf_name)
    return to_interleaved_rope(weight, n_heads) if n_heads else weight


def from_gguf_layout(config: ModelConfig, hf_name: str, weight: np.ndarray) -> np.ndarray:
    """HF row order for a tensor read from a GGUF: undoes llama's q/k reordering.

    Only whole rows move, so ``weight`` may also be packed quantized rows.
    """
    n_heads = _rope_heads(config, hf_name)
    return from_interleaved_rope(weight, n_heads) if n_heads else weight


def _rope_heads(config: ModelConfig, hf_name: str) -> int:
    """How many heads to reorder in this tensor for llama's adjacent-pair RoPE (0: leave it)."""
    if config.arch != "llama":
        return 0
    if ".self_attn.q_proj." in hf_name:
        return config.num_heads
    if ".self_attn.k_proj." in hf_name:
        return config.num_kv_heads
    return 0


def _encode_tensor(weight: np.ndarray, dtype: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    """(data, raw_dtype) for ``GGUFWriter.add_tensor``: 1-D tensors stay F32."""
    if weight.ndim == 1 or dtype == "F32":
        return weight, None
    if dtype == "Q8_0" and weight.shape[-1] % _Q8_0_BLOCK == 0:
        qtype = gguf.GGMLQuantizationType.Q8_0
        return gguf.quants.quantize(weight, qtype), qtype
    return weight.astype(np.float16, copy=False), None


def _field_value(field: gguf.ReaderField):
    """A reader field as a plain Python value (str, number, bool or list)."""
    value = field.contents()
    if field.types and field.types[0] == gguf.GGUFValueType.FLOAT32:
        # Shortest decimal that round-trips in float32, so 1e-5 reads back as 1e-5.
        return float(str(np.float32(value)))
    return value
