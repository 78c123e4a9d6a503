"""Write a Hugging Face style model folder that ``mlx_lm.load`` (and transformers) can open."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from specrun.fileio import with_new_file_mode

from .config import ModelConfig, weight_names
from .gguf_io import pad_token_id
from .tokenizer import ByteBpeVocab, parse_tokenizer_json

DTYPES = ("float32", "float16")

_ARCHITECTURE_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def hf_config_dict(config: ModelConfig, dtype: str = "float16") -> dict:
    """The ``config.json`` contents for ``config`` (every field mlx_lm's llama/qwen2 need)."""
    return {
        "architectures": [_ARCHITECTURE_CLASSES[config.arch]],
        "model_type": config.arch,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_traditional": False,
        "max_position_embeddings": config.context_length,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": config.attention_bias,
        "mlp_bias": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "torch_dtype": dtype,
    }


def tokenizer_config_dict(config: ModelConfig, tokenizer_json: str, chat_template: str | None) -> dict:
    """The ``tokenizer_config.json`` contents: special tokens, template and fast-tokenizer class."""
    vocab = parse_tokenizer_json(tokenizer_json)
    return vocab_tokenizer_config(config, vocab, pad_token_id(vocab, config), chat_template)


def vocab_tokenizer_config(
    config: ModelConfig, vocab: ByteBpeVocab, pad_id: int | None, chat_template: str | None
) -> dict:
    """:func:`tokenizer_config_dict` for a vocabulary already parsed, with its padding id."""
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": vocab.tokens[config.bos_token_id],
        "eos_token": vocab.tokens[config.eos_token_id],
        "pad_token": vocab.tokens[pad_id] if pad_id is not None else None,
        # Explicitly none: otherwise transformers' Qwen2Tokenizer adds its own <|endoftext|>.
        "unk_token": None,
        "add_bos_token": vocab.add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.context_length,
    }
    if chat_template is not None:
        settings["chat_template"] = chat_template
    return settings


def write_hf_folder(
    path: str | Path,
    config: ModelConfig,
    weights: dict[str, np.ndarray],
    tokenizer_json: str,
    chat_template: str | None = None,
    dtype: str = "float16",
) -> Path:
    """Write ``config.json``, ``model.safetensors``, ``tokenizer.json`` and ``tokenizer_config.json``.

    ``dtype`` is ``float16`` or ``float32`` for every tensor. Returns the folder.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    tensors = {name: np.ascontiguousarray(weights[name], dtype=dtype) for name in weight_names(config)}
    return write_model_files(
        path,
        tensors,
        hf_config_dict(config, dtype),
        tokenizer_json,
        tokenizer_config_dict(config, tokenizer_json, chat_template),
    )


def write_model_files(
    path: str | Path, tensors: dict[str, np.ndarray], config_json: dict, tokenizer_json: str, tokenizer_config: dict
) -> Path:
    """Write ``tensors`` (as stored, any dtype) and the three JSON files of a model folder; returns it."""
    from safetensors.numpy import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    # safetensors writes an array's buffer as it lies: one not in C order (a transposed view)
    # would be stored scrambled without a word.
    stored = {name: np.ascontiguousarray(array) for name, array in tensors.items()}
    save_file(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with_new_file_mode(folder / "model.safetensors")
    write_json(folder / "config.json", config_json)
    (folder / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    write_json(folder / "tokenizer_config.json", tokenizer_config)
    return folder


def write_json(path: Path, content: dict) -> None:
    """``content`` as indented UTF-8 JSON, as Hugging Face writes its config files."""
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
