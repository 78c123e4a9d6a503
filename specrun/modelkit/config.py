"""The architecture description shared by the model writers, the trainer and the tests."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

ARCHITECTURES = ("llama", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder. ``qwen2`` adds q/k/v biases (and usually grouped-query attention)."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    context_length: int = 2048
    tie_embeddings: bool = False
    bos_token_id: int = 1
    eos_token_id: int = 2

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.arch!r}; expected one of {ARCHITECTURES}")
        if min(self.num_heads, self.num_kv_heads, self.hidden_size, self.num_layers, self.vocab_size) < 1:
            raise ValueError("a model needs at least one layer, head, key/value head, dimension and token")
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def attention_bias(self) -> bool:
        return self.arch == "qwen2"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        return cls(**json.loads(text))


def weight_names(config: ModelConfig) -> list[str]:
    """Every tensor a model of this config has, in HF naming."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        names += [prefix + "input_layernorm.weight", prefix + "post_attention_layernorm.weight"]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names.append(prefix + f"self_attn.{proj}.weight")
        if config.attention_bias:
            for proj in ("q_proj", "k_proj", "v_proj"):
                names.append(prefix + f"self_attn.{proj}.bias")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names.append(prefix + f"mlp.{proj}.weight")
    return names


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes in HF layout: a Linear weight is (out_features, in_features)."""
    h, m, v = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    for name in weight_names(config):
        if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            shapes[name] = (v, h)
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            shapes[name] = (h,)
        elif ".q_proj." in name or ".o_proj." in name:
            shapes[name] = (h, h) if name.endswith("weight") else (h,)
        elif ".k_proj." in name or ".v_proj." in name:
            shapes[name] = (kv, h) if name.endswith("weight") else (kv,)
        elif ".gate_proj." in name or ".up_proj." in name:
            shapes[name] = (m, h)
        elif ".down_proj." in name:
            shapes[name] = (h, m)
    return shapes
