"""Tiny models that carry their own MTP layers, built in the tests from small configs.

``glm_mtp``: GLM-4.5's layout (llama.cpp's ``glm4moe``): two dense decoder blocks with biased
q/k/v, partial rotary embeddings and a post-attention norm, then one MTP (``nextn``) block whose
MLP is routed experts (sigmoid gate, selection bias, a shared expert), sharing the target's
embedding and output head. Random weights, rounded to float16 once so that the F16 GGUF holds
exactly the numbers the NumPy reference reads.

``deepseek_mtp``: DeepSeek's latent attention (llama.cpp's ``deepseek2``, the layout GLM-4.7-Flash
converts to): MLA blocks (a query down- and up-projection, one latent key/value a position, k_b and
v_b split as current conversions write them), a dense first block, then routed experts with a
shared one, and one MTP block of the same attention over routed experts.
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
    mtp_layers: int = 1  # MTP blocks after the trunk (several: one per draft depth, chained)
    dense_layers: int | None = None  # leading trunk blocks with a dense MLP, routed experts after (None: all)

    @property
    def dense_blocks(self) -> int:
        return self.trunk_layers if self.dense_layers is None else self.dense_layers


def _block_shapes(shape: GlmShape, index: int, mtp: bool) -> dict[str, tuple[int, ...]]:
    """GGUF names and NumPy (out, in) shapes of one block's tensors."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    b = f"blk.{index}"
    shapes = {
        f"{b}.attn_norm.weight": (h,), f"{b}.attn_q.weight": (q, h), f"{b}.attn_q.bias": (q,),
        f"{b}.attn_k.weight": (kv, h), f"{b}.attn_k.bias": (kv,), f"{b}.attn_v.weight": (kv, h),
        f"{b}.attn_v.bias": (kv,), f"{b}.attn_output.weight": (h, q), f"{b}.post_attention_norm.weight": (h,),
    }
    if index < shape.dense_blocks:
        shapes.update({f"{b}.ffn_gate.weight": (shape.dense_ffn, h), f"{b}.ffn_up.weight": (shape.dense_ffn, h),
                       f"{b}.ffn_down.weight": (h, shape.dense_ffn)})
        return shapes
    e, f = shape.experts, shape.expert_ffn
    shapes.update({
        f"{b}.ffn_gate_inp.weight": (e, h), f"{b}.exp_probs_b.bias": (e,),
        f"{b}.ffn_gate_exps.weight": (e, f, h), f"{b}.ffn_up_exps.weight": (e, f, h),
        f"{b}.ffn_down_exps.weight": (e, h, f),
        f"{b}.ffn_gate_shexp.weight": (f, h), f"{b}.ffn_up_shexp.weight": (f, h), f"{b}.ffn_down_shexp.weight": (h, f),
    })
    if mtp:
        shapes.update({f"{b}.nextn.eh_proj.weight": (h, 2 * h), f"{b}.nextn.enorm.weight": (h,),
                       f"{b}.nextn.hnorm.weight": (h,), f"{b}.nextn.shared_head_norm.weight": (h,)})
    return shapes


def glm_shapes(shape: GlmShape) -> dict[str, tuple[int, ...]]:
    shapes = {"token_embd.weight": (VOCAB_SIZE, shape.hidden), "output_norm.weight": (shape.hidden,),
              "output.weight": (VOCAB_SIZE, shape.hidden)}
    for index in range(shape.trunk_layers + shape.mtp_layers):
        shapes.update(_block_shapes(shape, index, mtp=index >= shape.trunk_layers))
    return shapes


def glm_weights(shape: GlmShape, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded weights scaled so states stay O(1) and logits spread by a few units, float16-exact."""
    return _random_weights(glm_shapes(shape), shape.hidden, seed)


def _random_weights(shapes: dict[str, tuple[int, ...]], hidden: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    weights = {}
    for name, dims in shapes.items():
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * rng.standard_normal(dims)
        elif name.endswith("exp_probs_b.bias"):
            value = 0.05 * rng.standard_normal(dims)
        elif name.endswith(".bias"):
            value = 0.1 * rng.standard_normal(dims)
        elif name == "token_embd.weight":
            value = rng.standard_normal(dims)
        elif name == "output.weight":
            value = 4.0 / np.sqrt(hidden) * rng.standard_normal(dims)
        else:
            value = 1.5 / np.sqrt(dims[-1]) * rng.standard_normal(dims)
        weights[name] = value.astype(np.float16).astype(np.float32)
    return weights


def write_glm_gguf(path: Path, shape: GlmShape, weights: dict[str, np.ndarray], dtype: str = "F16",
                   mtp_layers: int | None = None, arch: str = "glm4moe", split_tensors: int = 0,
                   keys: dict | None = None, quantized: dict | None = None) -> Path:
    """The model as llama.cpp's ``glm4moe`` GGUF with the shape's MTP blocks; ``mtp_layers=0``
    writes the trunk alone; ``arch``
    another architecture's name on the same keys and tensors (a layout specrun does not read);
    ``split_tensors``: split into parts of that many tensors as gguf-split names them
    (NAME-00001-of-0000N.gguf: the path returned is the first part); ``keys``: more keys by name,
    the arch's prefix implied (rotary scaling's); ``quantized``: GGML types by tensor name, those
    tensors stored in them (gguf-py's quantize: Q8_0, Q4_0, Q4_1, Q5_0...)."""
    mtp_layers = shape.mtp_layers if mtp_layers is None else mtp_layers
    writer = gguf.GGUFWriter(path, arch, split_max_tensors=split_tensors)
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
    writer.add_leading_dense_block_count(shape.dense_blocks)
    writer.add_expert_weights_scale(shape.weights_scale)
    writer.add_expert_weights_norm(True)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if mtp_layers:
        writer.add_nextn_predict_layers(mtp_layers)
    _add_keys(writer, arch, keys or {})
    _finish_gguf(writer, shape, shape.kv_heads, weights, mtp_layers, all_float32=dtype == "F32", quantized=quantized)
    if split_tensors:
        return sorted(path.parent.glob(f"{path.stem}-00001-of-*.gguf"))[0]
    return path


@dataclass(frozen=True)
class DeepseekShape:
    hidden: int = 128
    heads: int = 4
    q_rank: int = 48
    kv_rank: int = 32
    nope: int = 16
    rope_dims: int = 8
    v_dim: int = 16
    dense_ffn: int = 256
    trunk_layers: int = 2
    dense_layers: int = 1
    experts: int = 4
    experts_used: int = 2
    expert_ffn: int = 64
    weights_scale: float = 2.5
    rope_theta: float = 10000.0
    eps: float = 1e-5
    context: int = 512


def deepseek_shapes(shape: DeepseekShape) -> dict[str, tuple[int, ...]]:
    """GGUF names and NumPy shapes (llama.cpp's dims reversed) of every tensor, the MTP block last."""
    h, e, f = shape.hidden, shape.experts, shape.expert_ffn
    shapes = {"token_embd.weight": (VOCAB_SIZE, h), "output_norm.weight": (h,), "output.weight": (VOCAB_SIZE, h)}
    for index in range(shape.trunk_layers + 1):
        b = f"blk.{index}"
        shapes.update({
            f"{b}.attn_norm.weight": (h,), f"{b}.attn_q_a.weight": (shape.q_rank, h),
            f"{b}.attn_q_a_norm.weight": (shape.q_rank,),
            f"{b}.attn_q_b.weight": (shape.heads * (shape.nope + shape.rope_dims), shape.q_rank),
            f"{b}.attn_kv_a_mqa.weight": (shape.kv_rank + shape.rope_dims, h),
            f"{b}.attn_kv_a_norm.weight": (shape.kv_rank,),
            f"{b}.attn_k_b.weight": (shape.heads, shape.kv_rank, shape.nope),
            f"{b}.attn_v_b.weight": (shape.heads, shape.v_dim, shape.kv_rank),
            f"{b}.attn_output.weight": (h, shape.heads * shape.v_dim), f"{b}.ffn_norm.weight": (h,),
        })
        if index < shape.dense_layers:
            shapes.update({f"{b}.ffn_gate.weight": (shape.dense_ffn, h), f"{b}.ffn_up.weight": (shape.dense_ffn, h),
                           f"{b}.ffn_down.weight": (h, shape.dense_ffn)})
            continue
        shapes.update({
            f"{b}.ffn_gate_inp.weight": (e, h), f"{b}.exp_probs_b.bias": (e,),
            f"{b}.ffn_gate_exps.weight": (e, f, h), f"{b}.ffn_up_exps.weight": (e, f, h),
            f"{b}.ffn_down_exps.weight": (e, h, f), f"{b}.ffn_gate_shexp.weight": (f, h),
            f"{b}.ffn_up_shexp.weight": (f, h), f"{b}.ffn_down_shexp.weight": (h, f),
        })
    b = f"blk.{shape.trunk_layers}"
    shapes.update({f"{b}.nextn.eh_proj.weight": (h, 2 * h), f"{b}.nextn.enorm.weight": (h,),
                   f"{b}.nextn.hnorm.weight": (h,), f"{b}.nextn.shared_head_norm.weight": (h,)})
    return shapes


def deepseek_weights(shape: DeepseekShape, seed: int = 0) -> dict[str, np.ndarray]:
    return _random_weights(deepseek_shapes(shape), shape.hidden, seed)


def write_deepseek_gguf(path: Path, shape: DeepseekShape, weights: dict[str, np.ndarray], mtp_layers: int = 1,
                        keys: dict | None = None, quantized: dict | None = None) -> Path:
    """The model as llama.cpp's ``deepseek2`` GGUF (float16 matrices), as a current conversion of
    GLM-4.7-Flash writes its keys; ``keys``: more keys by name, the arch's prefix implied (the
    gating function's in place of sigmoid's); ``quantized`` as write_glm_gguf's."""
    writer = gguf.GGUFWriter(path, "deepseek2")
    writer.add_name("specrun-tiny-deepseek-mtp")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_vocab_size(VOCAB_SIZE)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.trunk_layers + mtp_layers)
    writer.add_feed_forward_length(shape.dense_ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(1)
    writer.add_key_length(shape.kv_rank + shape.rope_dims)
    writer.add_value_length(shape.kv_rank)
    writer.add_key_length_mla(shape.nope + shape.rope_dims)
    writer.add_value_length_mla(shape.v_dim)
    writer.add_q_lora_rank(shape.q_rank)
    writer.add_kv_lora_rank(shape.kv_rank)
    writer.add_rope_dimension_count(shape.rope_dims)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.eps)
    writer.add_leading_dense_block_count(shape.dense_layers)
    writer.add_expert_count(shape.experts)
    writer.add_expert_used_count(shape.experts_used)
    writer.add_expert_feed_forward_length(shape.expert_ffn)
    writer.add_expert_shared_count(1)
    writer.add_expert_weights_scale(shape.weights_scale)
    writer.add_expert_weights_norm(True)
    keys = dict(keys or {})
    if "expert_gating_func" not in keys:
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if mtp_layers:
        writer.add_nextn_predict_layers(mtp_layers)
    _add_keys(writer, "deepseek2", keys)
    _finish_gguf(writer, shape, 1, weights, mtp_layers, quantized=quantized)
    return path


def _add_keys(writer, arch: str, keys: dict) -> None:
    for key, value in keys.items():
        (writer.add_float32 if isinstance(value, float) else
         writer.add_string if isinstance(value, str) else writer.add_uint32)(f"{arch}.{key}", value)


def _tokenizer_config(shape, kv_heads: int) -> ModelConfig:
    """The tiny tokenizer's settings for a model of ``shape`` (as add_tokenizer and the folders read them)."""
    return ModelConfig(arch="llama", vocab_size=VOCAB_SIZE, hidden_size=shape.hidden, intermediate_size=shape.dense_ffn,
                       num_layers=shape.trunk_layers, num_heads=shape.heads, num_kv_heads=kv_heads,
                       rope_theta=shape.rope_theta, rms_norm_eps=shape.eps, context_length=shape.context,
                       tie_embeddings=False)


def quantized_blocks(value: np.ndarray, qtype) -> np.ndarray:
    """``value`` as GGML blocks of ``qtype`` along each row (gguf-py's quantize); zero blocks for a
    type gguf-py neither writes nor reads (Q8_1)."""
    try:
        return gguf.quants.quantize(value.astype(np.float32), qtype)
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        return np.zeros((*value.shape[:-1], value.shape[-1] // block * size), np.uint8)


def _finish_gguf(writer, shape, kv_heads: int, weights: dict[str, np.ndarray], mtp_layers: int,
                 all_float32: bool = False, quantized: dict | None = None) -> None:
    """The tiny tokenizer and ``weights`` (norms and biases float32, matrices float16 unless
    ``all_float32``, or of the GGML type ``quantized`` gives by name, blocks along each row; the
    MTP blocks, blk.{trunk_layers} on, only with ``mtp_layers``), then the file."""
    add_tokenizer(writer, _tokenizer_config(shape, kv_heads), parse_tokenizer_json(tiny_tokenizer_json(VOCAB_SIZE)),
                  DEMO_CHAT_TEMPLATE, "gpt-2")
    for name, value in weights.items():
        if name.startswith("blk.") and int(name.split(".")[1]) >= shape.trunk_layers + mtp_layers:
            continue
        if name in (quantized or {}):
            writer.add_tensor(name, quantized_blocks(value, quantized[name]), raw_dtype=quantized[name])
            continue
        plain = name.endswith("norm.weight") or name.endswith(".bias") or all_float32
        writer.add_tensor(name, value.astype(np.float32 if plain else np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


_MLX_LATENT_BLOCK = {  # GGUF name within a block -> mlx-lm's glm4_moe_lite name (the trunk as mlx-lm holds it)
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight", "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight", "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight", "attn_k_b.weight": "self_attn.embed_q.weight",
    "attn_v_b.weight": "self_attn.unembed_out.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias", "ffn_gate_exps.weight": "mlp.switch_mlp.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.switch_mlp.up_proj.weight", "ffn_down_exps.weight": "mlp.switch_mlp.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "nextn.eh_proj.weight": "eh_proj.weight", "nextn.enorm.weight": "enorm.weight",
    "nextn.hnorm.weight": "hnorm.weight", "nextn.shared_head_norm.weight": "shared_head.norm.weight",
    "nextn.shared_head_head.weight": "shared_head.head.weight", "nextn.embed_tokens.weight": "embed_tokens.weight",
}


def write_deepseek_mlx_folder(folder: Path, shape: DeepseekShape, weights: dict[str, np.ndarray],
                              settings: dict | None = None, mtp_layers: int = 1) -> Path:
    """The same model as a folder mlx-lm loads (``glm4_moe_lite``, GLM-4.7-Flash's type), as the
    checkpoint holds it: every block's k_b and v_b joined into kv_b_proj per head (the trunk's
    split again by mlx-lm's own sanitize), the trunk's experts stacked as mlx-lm stacks them, the
    MTP block's one by one (model.layers.N, which mlx-lm drops as it loads); ``settings``:
    config.json's entries replaced (a rope_scaling, DeepSeek-V3's expert groups); ``mtp_layers``: the
    MTP blocks ``weights`` hold (mlx-lm loads a folder with one: drop the others to load it)."""
    from specrun.modelkit.hf_io import tokenizer_config_dict, write_model_files

    tensors = {"model.embed_tokens.weight": weights["token_embd.weight"],
               "model.norm.weight": weights["output_norm.weight"], "lm_head.weight": weights["output.weight"]}
    for name, value in weights.items():
        if not name.startswith("blk."):
            continue
        index, rest = name[4:].split(".", 1)
        target = f"model.layers.{index}."
        if rest in ("attn_k_b.weight", "attn_v_b.weight"):
            continue
        if int(index) >= shape.trunk_layers and rest.endswith("_exps.weight"):
            part = rest.split("_")[1]  # gate, up, down
            for expert in range(shape.experts):
                tensors[f"{target}mlp.experts.{expert}.{part}_proj.weight"] = value[expert]
            continue
        tensors[target + _MLX_LATENT_BLOCK[rest]] = value
    for index in range(shape.trunk_layers + mtp_layers):
        k_b, v_b = weights[f"blk.{index}.attn_k_b.weight"], weights[f"blk.{index}.attn_v_b.weight"]  # (nh, r, nope), (nh, v, r)
        joined = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)  # per head: nope rows, then v rows
        tensors[f"model.layers.{index}.self_attn.kv_b_proj.weight"] = joined.reshape(-1, shape.kv_rank)
    config = {
        "architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite", "vocab_size": VOCAB_SIZE,
        "hidden_size": shape.hidden, "intermediate_size": shape.dense_ffn, "moe_intermediate_size": shape.expert_ffn,
        "num_hidden_layers": shape.trunk_layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.heads, "n_shared_experts": 1, "n_routed_experts": shape.experts,
        "routed_scaling_factor": shape.weights_scale, "kv_lora_rank": shape.kv_rank, "q_lora_rank": shape.q_rank,
        "qk_rope_head_dim": shape.rope_dims, "qk_nope_head_dim": shape.nope, "v_head_dim": shape.v_dim,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
        "num_experts_per_tok": shape.experts_used, "first_k_dense_replace": shape.dense_layers,
        "max_position_embeddings": shape.context, "rms_norm_eps": shape.eps, "rope_theta": shape.rope_theta,
        "rope_scaling": None, "tie_word_embeddings": False, "num_nextn_predict_layers": mtp_layers,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32", **(settings or {}),
    }
    tokenizer_json = tiny_tokenizer_json(VOCAB_SIZE)
    tensors = {name: np.ascontiguousarray(value, np.float32) for name, value in tensors.items()}
    return write_model_files(folder, tensors, config, tokenizer_json,
                             tokenizer_config_dict(_tokenizer_config(shape, 1), tokenizer_json, DEMO_CHAT_TEMPLATE))


# What the MTP layer is trained on: the target's greedy continuations of these (the tests draft
# after them, as a model's MTP layers draft on text like their training's).
TRAINING_PROMPTS = ("def hello(world):", "Ελληνικά: Καλημέρα κόσμε.", "import os\nimport sys\n", "Grüße aus München!")


def fitted_on_continuations(trunk: Path, n_new: int = 160):
    """An MTP layer (heads_factory.fitted_mtp's ridge fit) for the model at ``trunk`` (a GGUF),
    trained on its own greedy continuations of TRAINING_PROMPTS."""
    from heads_factory import fitted_mtp
    from specrun.backends.llama import LlamaCppBackend
    from specrun.engine.loop import GenerationParams, SpeculativeEngine

    target = LlamaCppBackend(trunk, n_ctx=1024, n_threads=1)
    try:
        engine = SpeculativeEngine(target, None)
        sequences = []
        for prompt in TRAINING_PROMPTS:
            prompt_ids = target.tokenize(prompt)
            sequences.append(prompt_ids + list(engine.run(prompt_ids, GenerationParams(n_new, 0)).token_ids))
        return fitted_mtp(target, sequences)
    finally:
        target.close()


def write_fitted_glm(path: Path, glm: dict, n_new: int = 160, hf_folder: Path | None = None) -> Path:
    """``glm`` (the conftest's glm_mtp) with its MTP layer trained on the target's own greedy
    continuations of a few prompts: heads_factory.fitted_mtp's ridge regression written into the
    nextn block (eh_proj, its own embed_tokens and shared_head_head; attention's output and the
    experts' down projections zero, so they add nothing), so that its drafts are accepted often.
    ``hf_folder``: the same model as a Hugging Face folder there too."""
    shape = glm["shape"]
    weights = _with_fitted_block(glm["weights"], glm["trunk"], shape.trunk_layers, shape.hidden, n_new)
    if hf_folder is not None:
        write_glm_hf_folder(hf_folder, shape, weights)
    return write_glm_gguf(path, shape, weights)


def _with_fitted_block(weights: dict[str, np.ndarray], trunk: Path, block_index: int, hidden: int,
                       n_new: int) -> dict[str, np.ndarray]:
    """``weights`` with their MTP block (blk.``block_index``) fitted on the continuations of the
    model at ``trunk`` (its GGUF without the block): eh_proj, its own embed_tokens and
    shared_head_head from the ridge fit, unit norms, attention's output and the experts' down
    projections zero (adding nothing); float16-exact."""
    fitted = fitted_on_continuations(trunk, n_new)
    block = f"blk.{block_index}"
    weights = dict(weights)
    weights.update({
        f"{block}.nextn.eh_proj.weight": fitted.eh_proj, f"{block}.nextn.embed_tokens.weight": fitted.embed,
        f"{block}.nextn.shared_head_head.weight": fitted.lm_head,
        **{f"{block}.nextn.{norm}.weight": np.ones(hidden, np.float32) for norm in ("shared_head_norm", "enorm", "hnorm")},
    })
    for name in (f"{block}.attn_output.weight", f"{block}.ffn_down_exps.weight", f"{block}.ffn_down_shexp.weight"):
        weights[name] = np.zeros_like(weights[name])
    return {name: value.astype(np.float16).astype(np.float32) for name, value in weights.items()}


def write_fitted_deepseek(folder: Path, shape: DeepseekShape, n_new: int = 160) -> dict[str, Path]:
    """The deepseek2 model: {"random": with its random MTP block, "trained": with the block fitted
    on the target's continuations (drafts accepted well above chance), "mlx" and "mlx_random": the
    trained and the random model as folders mlx-lm loads}."""
    weights = deepseek_weights(shape)
    random = write_deepseek_gguf(folder / "deepseek-mtp.gguf", shape, weights)
    trunk = write_deepseek_gguf(folder / "deepseek-trunk.gguf", shape, weights, mtp_layers=0)
    fitted = _with_fitted_block(weights, trunk, shape.trunk_layers, shape.hidden, n_new)
    return {"random": random, "trained": write_deepseek_gguf(folder / "deepseek-mtp-trained.gguf", shape, fitted),
            "mlx": write_deepseek_mlx_folder(folder / "deepseek-mtp-trained-mlx", shape, fitted),
            "mlx_random": write_deepseek_mlx_folder(folder / "deepseek-mtp-mlx", shape, weights)}


_HF_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight", "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "nextn.eh_proj.weight": "eh_proj.weight", "nextn.enorm.weight": "enorm.weight",
    "nextn.hnorm.weight": "hnorm.weight", "nextn.shared_head_norm.weight": "shared_head.norm.weight",
    "nextn.shared_head_head.weight": "shared_head.head.weight", "nextn.embed_tokens.weight": "embed_tokens.weight",
}
_HF_EXPERTS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
               "ffn_down_exps.weight": "down_proj"}


def hf_glm_tensors(shape: GlmShape, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same weights in GLM-4.5's Hugging Face names (the MTP block as model.layers.N, N the
    trunk's depth; experts one by one), the layout published checkpoints hold (NeoX rotary: q and k
    rows as in the GGUF)."""
    tensors = {"model.embed_tokens.weight": weights["token_embd.weight"],
               "model.norm.weight": weights["output_norm.weight"], "lm_head.weight": weights["output.weight"]}
    for name, value in weights.items():
        if not name.startswith("blk."):
            continue
        _, index, rest = name.split(".", 2)
        if rest in _HF_EXPERTS:
            for expert in range(value.shape[0]):
                tensors[f"model.layers.{index}.mlp.experts.{expert}.{_HF_EXPERTS[rest]}.weight"] = value[expert]
        else:
            tensors[f"model.layers.{index}.{_HF_BLOCK[rest]}"] = value
    return tensors


def write_glm_hf_folder(folder: Path, shape: GlmShape, weights: dict[str, np.ndarray], dtype: str = "float32",
                        settings: dict | None = None) -> Path:
    """The model as a Hugging Face folder mlx-lm's glm4_moe loads (its MTP layer stays in the file;
    mlx-lm drops it as it loads); ``settings``: config.json's entries replaced (a rope_scaling)."""
    from specrun.modelkit.hf_io import tokenizer_config_dict, write_model_files

    tensors = {name: np.ascontiguousarray(value, dtype=dtype) for name, value in hf_glm_tensors(shape, weights).items()}
    config = {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": VOCAB_SIZE,
        "hidden_size": shape.hidden, "intermediate_size": shape.dense_ffn, "max_position_embeddings": shape.context,
        "moe_intermediate_size": shape.expert_ffn, "norm_topk_prob": True, "num_attention_heads": shape.heads,
        "n_group": 1, "topk_group": 1, "head_dim": shape.head_dim, "n_shared_experts": 1,
        "n_routed_experts": shape.experts, "routed_scaling_factor": shape.weights_scale,
        "num_experts_per_tok": shape.experts_used, "first_k_dense_replace": shape.dense_blocks,
        "num_hidden_layers": shape.trunk_layers, "num_key_value_heads": shape.kv_heads, "rms_norm_eps": shape.eps,
        "rope_theta": shape.rope_theta, "rope_scaling": None, "use_qk_norm": False, "tie_word_embeddings": False,
        "attention_bias": True, "partial_rotary_factor": shape.rope_dims / shape.head_dim,
        "num_nextn_predict_layers": shape.mtp_layers, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": dtype, **(settings or {}),
    }
    tokenizer_json = tiny_tokenizer_json(VOCAB_SIZE)
    return write_model_files(folder, tensors, config, tokenizer_json,
                             tokenizer_config_dict(_tokenizer_config(shape, shape.kv_heads), tokenizer_json,
                                                   DEMO_CHAT_TEMPLATE))


# ---- what the conversion tests compare -------------------------------------------------------
def llama_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """llama.cpp's logits at every position of ``tokens`` on the GGUF ``path``."""
    from specrun.backends.llama import LlamaCppBackend

    backend = LlamaCppBackend(path, n_ctx=256, n_threads=1)
    try:
        return backend.forward(tokens, list(range(len(tokens))))
    finally:
        backend.close()


def mlx_logits(folder: Path, tokens: list[int]) -> np.ndarray:
    """mlx-lm's own model over the folder, in float32 (MLX's CPU gathers experts in float32 only)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    model.set_dtype(mx.float32)
    return np.array(model(mx.array([tokens]))[0].astype(mx.float32))


def greedy_chains(target, heads, prompts) -> list[list[int]]:
    """The MTP drafter's greedy 5-token chain with ``heads`` on ``target`` after each of ``prompts``."""
    from time import perf_counter

    from specrun.backends.kv import KVSequence
    from specrun.drafters.heads.mtp import MtpDrafter
    from specrun.sampling import SamplingSettings

    found = []
    for prompt in prompts:
        context = target.tokenize(prompt)
        sequence = KVSequence(target)
        sequence.reset()
        drafter = MtpDrafter(heads)
        drafter.bind(sequence, perf_counter)
        sequence.feed(context[:-1])
        found.append(list(drafter.propose(context, 5, SamplingSettings(), np.random.default_rng(0)).tokens))
        drafter.close()
    return found
