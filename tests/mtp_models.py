"""Tiny models that carry their own MTP layers, built in the tests from small configs.

``glm_mtp``: GLM-4.5's layout (llama.cpp's ``glm4moe``): two dense decoder blocks with biased
q/k/v, partial rotary embeddings and a post-attention norm, then one MTP (``nextn``) block whose
MLP is routed experts (sigmoid gate, selection bias, a shared expert), sharing the target's
embedding and output head. Random weights, rounded to float16 once so that the F16 GGUF holds
exactly the numbers the NumPy reference reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from model_factory import VOCAB_SIZE, tiny_tokenizer_json
from specrun.modelkit.config import ModelConfig
from specrun.modelkit.gguf_io import add_tokenizer
from specrun.modelkit.tokenizer import DEMO_CHAT_TEMPLATE, parse_tokenizer_json


@dataclass(frozen=True)
class GlmShape:
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    rope_dims: int = 16
    dense_ffn: int = 256
    trunk_layers: int = 2
    experts: int = 4
    experts_used: int = 2
    expert_ffn: int = 64
    weights_scale: float = 2.5
    rope_theta: float = 10000.0
    eps: float = 1e-5
    context: int = 512


def _block_shapes(shape: GlmShape, index: int, mtp: bool) -> dict[str, tuple[int, ...]]:
    """GGUF names and NumPy (out, in) shapes of one block's tensors."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    b = f"blk.{index}"
    shapes = {
        f"{b}.attn_norm.weight": (h,), f"{b}.attn_q.weight": (q, h), f"{b}.attn_q.bias": (q,),
        f"{b}.attn_k.weight": (kv, h), f"{b}.attn_k.bias": (kv,), f"{b}.attn_v.weight": (kv, h),
        f"{b}.attn_v.bias": (kv,), f"{b}.attn_output.weight": (h, q), f"{b}.post_attention_norm.weight": (h,),
    }
    if not mtp:
        shapes.update({f"{b}.ffn_gate.weight": (shape.dense_ffn, h), f"{b}.ffn_up.weight": (shape.dense_ffn, h),
                       f"{b}.ffn_down.weight": (h, shape.dense_ffn)})
        return shapes
    e, f = shape.experts, shape.expert_ffn
    shapes.update({
        f"{b}.ffn_gate_inp.weight": (e, h), f"{b}.exp_probs_b.bias": (e,),
        f"{b}.ffn_gate_exps.weight": (e, f, h), f"{b}.ffn_up_exps.weight": (e, f, h),
        f"{b}.ffn_down_exps.weight": (e, h, f),
        f"{b}.ffn_gate_shexp.weight": (f, h), f"{b}.ffn_up_shexp.weight": (f, h), f"{b}.ffn_down_shexp.weight": (h, f),
        f"{b}.nextn.eh_proj.weight": (h, 2 * h), f"{b}.nextn.enorm.weight": (h,), f"{b}.nextn.hnorm.weight": (h,),
        f"{b}.nextn.shared_head_norm.weight": (h,),
    })
    return shapes


def glm_shapes(shape: GlmShape) -> dict[str, tuple[int, ...]]:
    shapes = {"token_embd.weight": (VOCAB_SIZE, shape.hidden), "output_norm.weight": (shape.hidden,),
              "output.weight": (VOCAB_SIZE, shape.hidden)}
    for index in range(shape.trunk_layers + 1):
        shapes.update(_block_shapes(shape, index, mtp=index == shape.trunk_layers))
    return shapes


def glm_weights(shape: GlmShape, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded weights scaled so states stay O(1) and logits spread by a few units, float16-exact."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, dims in glm_shapes(shape).items():
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * rng.standard_normal(dims)
        elif name.endswith("exp_probs_b.bias"):
            value = 0.05 * rng.standard_normal(dims)
        elif name.endswith(".bias"):
            value = 0.1 * rng.standard_normal(dims)
        elif name == "token_embd.weight":
            value = rng.standard_normal(dims)
        elif name == "output.weight":
            value = 4.0 / np.sqrt(shape.hidden) * rng.standard_normal(dims)
        else:
            value = 1.5 / np.sqrt(dims[-1]) * rng.standard_normal(dims)
        weights[name] = value.astype(np.float16).astype(np.float32)
    return weights


def write_glm_gguf(path: Path, shape: GlmShape, weights: dict[str, np.ndarray], dtype: str = "F16",
                   mtp_layers: int = 1, arch: str = "glm4moe") -> Path:
    """The model as llama.cpp's ``glm4moe`` GGUF; ``mtp_layers=0`` writes the trunk alone; ``arch``
    another architecture's name on the same keys and tensors (a layout specrun does not read)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("specrun-tiny-glm-mtp")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "F16" else gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(VOCAB_SIZE)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.trunk_layers + mtp_layers)
    writer.add_feed_forward_length(shape.dense_ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.rope_dims)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.eps)
    writer.add_expert_count(shape.experts)
    writer.add_expert_used_count(shape.experts_used)
    writer.add_expert_feed_forward_length(shape.expert_ffn)
    writer.add_expert_shared_count(1)
    writer.add_leading_dense_block_count(shape.trunk_layers)
    writer.add_expert_weights_scale(shape.weights_scale)
    writer.add_expert_weights_norm(True)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if mtp_layers:
        writer.add_nextn_predict_layers(mtp_layers)
    tokenizer_json = tiny_tokenizer_json(VOCAB_SIZE)
    vocab = parse_tokenizer_json(tokenizer_json)
    ids = ModelConfig(arch="llama", vocab_size=VOCAB_SIZE, hidden_size=shape.hidden, intermediate_size=shape.dense_ffn,
                      num_layers=shape.trunk_layers, num_heads=shape.heads, num_kv_heads=shape.kv_heads,
                      rope_theta=shape.rope_theta, rms_norm_eps=shape.eps, context_length=shape.context,
                      tie_embeddings=False)
    add_tokenizer(writer, ids, vocab, DEMO_CHAT_TEMPLATE, "gpt-2")
    for name, value in weights.items():
        if not mtp_layers and name.startswith(f"blk.{shape.trunk_layers}."):
            continue
        plain = name.endswith("norm.weight") or name.endswith(".bias") or dtype == "F32"
        writer.add_tensor(name, value.astype(np.float32 if plain else np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# What the MTP layer is trained on: the target's greedy continuations of these (the tests draft
# after them, as a model's MTP layers draft on text like their training's).
TRAINING_PROMPTS = ("def hello(world):", "Ελληνικά: Καλημέρα κόσμε.", "import os\nimport sys\n", "Grüße aus München!")


def write_fitted_glm(path: Path, glm: dict, n_new: int = 160) -> Path:
    """``glm`` (the conftest's glm_mtp) with its MTP layer trained on the target's own greedy
    continuations of a few prompts: heads_factory.fitted_mtp's ridge regression written into the
    nextn block (eh_proj, its own embed_tokens and shared_head_head; attention's output and the
    experts' down projections zero, so they add nothing), so that its drafts are accepted often."""
    from heads_factory import fitted_mtp
    from specrun.backends.llama import LlamaCppBackend
    from specrun.engine.loop import GenerationParams, SpeculativeEngine

    shape = glm["shape"]
    target = LlamaCppBackend(glm["trunk"], n_ctx=1024, n_threads=1)
    try:
        engine = SpeculativeEngine(target, None)
        sequences = []
        for prompt in TRAINING_PROMPTS:
            prompt_ids = target.tokenize(prompt)
            sequences.append(prompt_ids + list(engine.run(prompt_ids, GenerationParams(n_new, 0)).token_ids))
        fitted = fitted_mtp(target, sequences)
    finally:
        target.close()
    block = f"blk.{shape.trunk_layers}"
    weights = dict(glm["weights"])
    weights.update({
        f"{block}.nextn.eh_proj.weight": fitted.eh_proj, f"{block}.nextn.embed_tokens.weight": fitted.embed,
        f"{block}.nextn.shared_head_head.weight": fitted.lm_head,
        f"{block}.nextn.shared_head_norm.weight": np.ones(shape.hidden, np.float32),
        f"{block}.nextn.enorm.weight": np.ones(shape.hidden, np.float32),
        f"{block}.nextn.hnorm.weight": np.ones(shape.hidden, np.float32),
    })
    for name in (f"{block}.attn_output.weight", f"{block}.ffn_down_exps.weight", f"{block}.ffn_down_shexp.weight"):
        weights[name] = np.zeros_like(weights[name])
    return write_glm_gguf(path, shape, weights)
