"""GLM-4.5's layout (llama.cpp's ``glm4moe``) and DeepSeek's latent attention (``deepseek2``, the
layout GLM-4.7-Flash and DeepSeek-V3 convert to) from a GGUF into the folders mlx-lm's ``glm4_moe``
and ``glm4_moe_lite`` load, the model's MTP (nextn) blocks carried along as the checkpoints hold
them: ``model.layers.N`` past the trunk, which mlx-lm drops as it loads and specrun's MTP drafter
reads (modelkit.mtp.read_mtp_folder).

Unlike Qwen3.5's (modelkit.gguf_convert_qwen35), llama.cpp's converter stored these tensors as the
folder holds them, so every one is carried under a new name, nothing regrouped: the routed experts
stacked (experts, rows, columns) as mlx-lm's SwitchGLU holds them (``switch_mlp``), the latent
attention's k_b and v_b as mlx-lm's ``embed_q`` and ``unembed_out`` (the halves of the checkpoint's
kv_b_proj that mlx-lm's sanitize makes), the q and k rows of GLM-4.5 unpermuted (NeoX rotary on
both sides). The experts' selection bias stays float32: routing compares biased scores, and float16
would move their near ties.

What the conversion does not express is refused in one line: routing other than sigmoid (mlx-lm's
two models route by sigmoid), RoPE scaling (DeepSeek-V3's YaRN is not mapped to a rope_scaling
yet), attention temperature scaling, DeepSeek-V2's layouts (no query down-projection, kv_b not
split), several MTP blocks in glm4_moe (mlx-lm's drops the first alone). The folder is float16
(its float16 experts widened to float32 on the CPU by the MLX backend: MLX's CPU gathers
unquantized experts in float32 only), or with ``--dtype q4`` 4-bit groups (modelkit.gguf_convert's
_glm_weights): the stacked experts quantized expert by expert as mlx-lm's QuantizedSwitchLinear
holds them, k_b and v_b head by head as its QuantizedMultiLinear, both gathered or multiplied
quantized on the CPU too.
"""

from __future__ import annotations

from collections.abc import Collection

import gguf

from specrun.errors import ModelFileError

from .gguf_convert_qwen35 import arch_readers, shortest_decimal
from .mtp import expert_gating

ARCHS = ("glm4moe", "deepseek2")

# GGUF name within a block -> the name within ``model.layers.N`` of the folder, for both layouts.
_ATTENTION = {
    "glm4moe": {
        "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    },
    "deepseek2": {
        "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_q_a.weight": "self_attn.q_a_proj.weight", "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
        "attn_q_b.weight": "self_attn.q_b_proj.weight", "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight", "attn_k_b.weight": "self_attn.embed_q.weight",
        "attn_v_b.weight": "self_attn.unembed_out.weight", "attn_output.weight": "self_attn.o_proj.weight",
    },
}
_BIASES = {"attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
           "attn_v.bias": "self_attn.v_proj.bias"}  # GLM-4.5's attention_bias
_QK_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_DENSE = {"ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
          "ffn_down.weight": "mlp.down_proj.weight"}
_ROUTED = {
    "ffn_gate_inp.weight": "mlp.gate.weight", "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_exps.weight": "mlp.switch_mlp.gate_proj.weight", "ffn_up_exps.weight": "mlp.switch_mlp.up_proj.weight",
    "ffn_down_exps.weight": "mlp.switch_mlp.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
_NEXTN = {"nextn.eh_proj.weight": "eh_proj.weight", "nextn.enorm.weight": "enorm.weight",
          "nextn.hnorm.weight": "hnorm.weight", "nextn.shared_head_norm.weight": "shared_head.norm.weight"}
_NEXTN_OWN_TABLES = {"nextn.embed_tokens.weight": "embed_tokens.weight",
                     "nextn.shared_head_head.weight": "shared_head.head.weight"}  # else the target's
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
SELECTION_BIAS = "e_score_correction_bias"


def glm_config(fields: dict, tensors: Collection[str], vocab_size: int) -> dict:
    """mlx-lm's config.json for the GGUF's ``fields``; ValueError naming a key it lacks or holds
    out of range, or what mlx-lm's glm4_moe or glm4_moe_lite cannot express."""
    arch, key, count = arch_readers(fields, tensors)
    mtp_layers = count("nextn_predict_layers", 0, least=0)
    layers = count("block_count") - mtp_layers
    if layers < 1:
        raise ValueError(f"its {mtp_layers} MTP blocks leave no trunk of its {key('block_count')} blocks")
    trunk = {
        "vocab_size": vocab_size, "hidden_size": count("embedding_length"),
        "intermediate_size": count("feed_forward_length"), "max_position_embeddings": count("context_length"),
        "num_hidden_layers": layers, "num_attention_heads": count("attention.head_count"),
        "rms_norm_eps": shortest_decimal(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": shortest_decimal(key("rope.freq_base", 10000.0)), "rope_scaling": None,
        "tie_word_embeddings": "output.weight" not in tensors, "num_nextn_predict_layers": mtp_layers,
    }
    experts = {
        "n_routed_experts": count("expert_count"), "num_experts_per_tok": count("expert_used_count"),
        "moe_intermediate_size": count("expert_feed_forward_length"), "n_shared_experts": count("expert_shared_count"),
        "first_k_dense_replace": count("leading_dense_block_count", 0, least=0),
        "routed_scaling_factor": shortest_decimal(key("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(key("expert_weights_norm", False)),
        "n_group": count("expert_group_count", 1), "topk_group": count("expert_group_used_count", 1),
        "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    }
    gating = expert_gating(arch, fields, layers, vocab_size)
    if gating != "sigmoid":
        raise ValueError(f"its experts are routed by {gating}, where mlx-lm's models of this layout route by sigmoid")
    if experts["num_experts_per_tok"] > experts["n_routed_experts"]:
        raise ValueError(f"it routes to {experts['num_experts_per_tok']} of its {experts['n_routed_experts']} experts")
    if arch == "glm4moe":
        if mtp_layers > 1:
            raise ValueError(f"it holds {mtp_layers} MTP blocks, where mlx-lm's glm4_moe loads a folder with one")
        heads, head_dim = trunk["num_attention_heads"], count("attention.key_length")
        return {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", **trunk, **experts,
                "num_key_value_heads": count("attention.head_count_kv", heads), "head_dim": head_dim,
                "partial_rotary_factor": count("rope.dimension_count", head_dim) / head_dim,
                "attention_bias": "blk.0.attn_q.bias" in tensors, "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors}
    if "blk.0.attn_kv_b.weight" in tensors or "blk.0.attn_k_b.weight" not in tensors:
        raise ValueError("it is an older conversion, its attention's kv_b not split into k_b and v_b "
                         "(convert it again with a current llama.cpp)")
    if "blk.0.attn_q_a.weight" not in tensors:
        raise ValueError("its attention has no query down-projection (DeepSeek-V2-Lite's layout)")
    if float(fields.get(f"{arch}.attention.temperature_scale", 0) or 0):
        raise ValueError("it scales its attention's temperature, which mlx-lm's glm4_moe_lite does not")
    rope_dims = count("rope.dimension_count")
    nope = count("attention.key_length_mla") - rope_dims
    if nope < 1:
        raise ValueError(f"its {arch}.attention.key_length_mla leaves no dimensions beside the {rope_dims} rotary ones")
    return {"architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite", **trunk, **experts,
            "num_key_value_heads": trunk["num_attention_heads"], "kv_lora_rank": count("attention.kv_lora_rank"),
            "q_lora_rank": count("attention.q_lora_rank"), "qk_rope_head_dim": rope_dims, "qk_nope_head_dim": nope,
            "v_head_dim": count("attention.value_length_mla"), "attention_bias": False}


def glm_tensor_plan(config: dict, tensors: Collection[str]) -> dict[str, str]:
    """For every GGUF tensor: its name in the folder. ValueError naming a tensor mlx-lm's model (or,
    past the trunk, the MTP layout) has no place for, or the first one a block of this layout lacks."""
    layers, mtp_layers = config["num_hidden_layers"], config["num_nextn_predict_layers"]
    plan, required = {}, ["token_embd.weight", "output_norm.weight"]
    for index in range(layers + mtp_layers):
        block = {**_ATTENTION["glm4moe" if config["model_type"] == "glm4_moe" else "deepseek2"],
                 **(_ROUTED if index >= config["first_k_dense_replace"] else _DENSE)}
        if config.get("attention_bias"):
            block.update(_BIASES)
        if config.get("use_qk_norm"):
            block.update(_QK_NORMS)
        if index >= layers:
            block.update(_NEXTN)
        required += [f"blk.{index}.{rest}" for rest in block]
        if index >= layers:
            block.update(_NEXTN_OWN_TABLES)
        plan.update({f"blk.{index}.{rest}": f"model.layers.{index}.{name}" for rest, name in block.items()})
    plan.update(_TOP)
    unplaced = sorted(set(tensors) - set(plan))
    if unplaced:
        raise ValueError(f"it holds the tensor {unplaced[0]}, which mlx-lm's {config['model_type']} has no place for")
    missing = [name for name in required if name not in tensors]
    if missing:
        raise ValueError(f"it lacks the tensor {missing[0]}")
    return {name: plan[name] for name in tensors}


def check_glm_shapes(config: dict, shapes: dict[str, tuple[int, ...]]) -> None:
    """ValueError naming the first tensor whose shape (NumPy's order) is not the one the header's
    sizes give it: an expert short of a row, a stack short of an expert."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    experts, width = config["n_routed_experts"], config["moe_intermediate_size"]
    shared, dense = width * config["n_shared_experts"], config["intermediate_size"]
    expected = {
        "token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden), "output_norm.weight": (hidden,),
        "attn_norm.weight": (hidden,), "post_attention_norm.weight": (hidden,), "ffn_norm.weight": (hidden,),
        "ffn_gate.weight": (dense, hidden), "ffn_up.weight": (dense, hidden), "ffn_down.weight": (hidden, dense),
        "ffn_gate_inp.weight": (experts, hidden), "exp_probs_b.bias": (experts,),
        "ffn_gate_exps.weight": (experts, width, hidden), "ffn_up_exps.weight": (experts, width, hidden),
        "ffn_down_exps.weight": (experts, hidden, width), "ffn_gate_shexp.weight": (shared, hidden),
        "ffn_up_shexp.weight": (shared, hidden), "ffn_down_shexp.weight": (hidden, shared),
        "nextn.eh_proj.weight": (hidden, 2 * hidden), "nextn.enorm.weight": (hidden,),
        "nextn.hnorm.weight": (hidden,), "nextn.shared_head_norm.weight": (hidden,),
        "nextn.embed_tokens.weight": (vocab, hidden), "nextn.shared_head_head.weight": (vocab, hidden),
    }
    heads = config["num_attention_heads"]
    if config["model_type"] == "glm4_moe":
        head_dim = config["head_dim"]
        queries, keys = heads * head_dim, config["num_key_value_heads"] * head_dim
        expected.update({
            "attn_q.weight": (queries, hidden), "attn_q.bias": (queries,), "attn_k.weight": (keys, hidden),
            "attn_k.bias": (keys,), "attn_v.weight": (keys, hidden), "attn_v.bias": (keys,),
            "attn_output.weight": (hidden, queries), "attn_q_norm.weight": (head_dim,),
            "attn_k_norm.weight": (head_dim,),
        })
    else:
        q_rank, kv_rank, rope = config["q_lora_rank"], config["kv_lora_rank"], config["qk_rope_head_dim"]
        nope, value = config["qk_nope_head_dim"], config["v_head_dim"]
        expected.update({
            "attn_q_a.weight": (q_rank, hidden), "attn_q_a_norm.weight": (q_rank,),
            "attn_q_b.weight": (heads * (nope + rope), q_rank), "attn_kv_a_mqa.weight": (kv_rank + rope, hidden),
            "attn_kv_a_norm.weight": (kv_rank,), "attn_k_b.weight": (heads, kv_rank, nope),
            "attn_v_b.weight": (heads, value, kv_rank), "attn_output.weight": (hidden, heads * value),
        })
    for name, shape in sorted(shapes.items()):
        parts = name.split(".", 2)
        kind = parts[2] if parts[0] == "blk" and len(parts) == 3 else name
        if kind in expected and tuple(shape) != expected[kind]:
            raise ValueError(f"its tensor {name} is {tuple(shape)}, where the header's sizes give {expected[kind]}")


def check_glm(source, fields: dict, tensors: Collection[str]) -> None:
    """One ModelFileError for a file whose layout the conversion cannot express."""
    try:
        vocab_size = len(fields[gguf.Keys.Tokenizer.LIST])  # GLM-4.7-Flash's routing default goes by it
        glm_tensor_plan(glm_config(fields, tensors, vocab_size), tensors)
    except (KeyError, TypeError, ValueError) as exc:
        message = str(exc).strip("'")
        raise ModelFileError(f"{source} cannot be converted to MLX: {message}",
                             "convert another model, or run this one with --backend llama") from None
