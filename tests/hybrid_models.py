"""A tiny hybrid model llama.cpp runs: Qwen3.5's layout (llama.cpp's ``qwen35``), Gated DeltaNet
(linear attention with a recurrent state) in three of every four layers, gated full attention in
the fourth, written in the tests from a small config with random weights. Its cache cannot drop
positions as a KV cache does: llama.cpp keeps per-token snapshots of the recurrent state of the
last pass (``n_rs_seq``) to roll back a rejected draft."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from model_factory import VOCAB_SIZE, tiny_tokenizer_json
from mtp_models import quantized_blocks
from specrun.modelkit.config import ModelConfig
from specrun.modelkit.gguf_io import add_tokenizer
from specrun.modelkit.tokenizer import DEMO_CHAT_TEMPLATE, parse_tokenizer_json


@dataclass(frozen=True)
class HybridShape:
    hidden: int = 128
    layers: int = 4  # layers 0-2 linear attention, 3 full attention
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    rope_dims: int = 16
    ffn: int = 256
    conv_kernel: int = 4
    state: int = 16  # ssm.state_size: the head dim of the linear attention's keys and values
    k_heads: int = 2  # ssm.group_count
    v_heads: int = 4  # ssm.time_step_rank
    rope_theta: float = 10000000.0
    eps: float = 1e-6
    context: int = 512
    full_attention_interval: int = 4
    experts: int = 0  # Qwen3.5-MoE (``qwen35moe``): every FFN routed experts plus a gated shared expert
    experts_used: int = 2
    expert_ffn: int = 64
    next: bool = False  # Qwen3-Next (``qwen3next``, experts required): beta and alpha in one ssm_ba, no MRoPE

    @property
    def arch(self) -> str:
        return "qwen3next" if self.next else "qwen35moe" if self.experts else "qwen35"


def _ffn_shapes(shape: HybridShape, b: str) -> dict[str, tuple[int, ...]]:
    h = shape.hidden
    if not shape.experts:
        return {f"{b}.ffn_gate.weight": (shape.ffn, h), f"{b}.ffn_up.weight": (shape.ffn, h),
                f"{b}.ffn_down.weight": (h, shape.ffn)}
    e, f = shape.experts, shape.expert_ffn
    return {f"{b}.ffn_gate_inp.weight": (e, h), f"{b}.ffn_gate_exps.weight": (e, f, h),
            f"{b}.ffn_up_exps.weight": (e, f, h), f"{b}.ffn_down_exps.weight": (e, h, f),
            f"{b}.ffn_gate_inp_shexp.weight": (h,), f"{b}.ffn_gate_shexp.weight": (f, h),
            f"{b}.ffn_up_shexp.weight": (f, h), f"{b}.ffn_down_shexp.weight": (h, f)}


def hybrid_shapes(shape: HybridShape, mtp_layers: int = 0) -> dict[str, tuple[int, ...]]:
    """GGUF names and NumPy (out, in) shapes of every tensor; ``mtp_layers``: Qwen3.5's MTP block
    after the trunk (a gated full-attention block with ``nextn`` tensors)."""
    h = shape.hidden
    key_dim, value_dim = shape.state * shape.k_heads, shape.state * shape.v_heads
    shapes = {"token_embd.weight": (VOCAB_SIZE, h), "output_norm.weight": (h,), "output.weight": (VOCAB_SIZE, h)}
    for i in range(shape.layers):
        b = f"blk.{i}"
        shapes.update({f"{b}.attn_norm.weight": (h,), f"{b}.post_attention_norm.weight": (h,),
                       **_ffn_shapes(shape, b)})
        if (i + 1) % shape.full_attention_interval:
            beta_alpha = {f"{b}.ssm_ba.weight": (2 * shape.v_heads, h)} if shape.next else \
                {f"{b}.ssm_beta.weight": (shape.v_heads, h), f"{b}.ssm_alpha.weight": (shape.v_heads, h)}
            shapes.update({
                f"{b}.attn_qkv.weight": (2 * key_dim + value_dim, h), f"{b}.attn_gate.weight": (value_dim, h),
                f"{b}.ssm_conv1d.weight": (2 * key_dim + value_dim, shape.conv_kernel),
                f"{b}.ssm_dt.bias": (shape.v_heads,), f"{b}.ssm_a": (shape.v_heads,), **beta_alpha,
                f"{b}.ssm_norm.weight": (shape.state,), f"{b}.ssm_out.weight": (h, value_dim),
            })
        else:
            q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
            shapes.update({f"{b}.attn_q.weight": (2 * q, h), f"{b}.attn_k.weight": (kv, h),
                           f"{b}.attn_v.weight": (kv, h), f"{b}.attn_output.weight": (h, q),
                           f"{b}.attn_q_norm.weight": (shape.head_dim,), f"{b}.attn_k_norm.weight": (shape.head_dim,)})
    for i in range(shape.layers, shape.layers + mtp_layers):
        b, q, kv = f"blk.{i}", shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        shapes.update({
            f"{b}.attn_norm.weight": (h,), f"{b}.post_attention_norm.weight": (h,), f"{b}.attn_q.weight": (2 * q, h),
            f"{b}.attn_k.weight": (kv, h), f"{b}.attn_v.weight": (kv, h), f"{b}.attn_output.weight": (h, q),
            f"{b}.attn_q_norm.weight": (shape.head_dim,), f"{b}.attn_k_norm.weight": (shape.head_dim,),
            **_ffn_shapes(shape, b), f"{b}.nextn.eh_proj.weight": (h, 2 * h),
            f"{b}.nextn.enorm.weight": (h,), f"{b}.nextn.hnorm.weight": (h,), f"{b}.nextn.shared_head_norm.weight": (h,),
        })
    return shapes


def hybrid_weights(shape: HybridShape, seed: int = 0, mtp_layers: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    weights = {}
    for name, dims in hybrid_shapes(shape, mtp_layers).items():
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * rng.standard_normal(dims)
        elif name.endswith("ffn_gate_inp_shexp.weight"):
            value = 0.3 * rng.standard_normal(dims)
        elif name.endswith(".ssm_a"):
            value = -np.exp(rng.uniform(-1.0, 0.5, dims))  # decays: A = -exp(A_log)
        elif name.endswith("ssm_dt.bias"):
            value = rng.uniform(-1.0, 1.0, dims)
        elif name == "token_embd.weight":
            value = rng.standard_normal(dims)
        elif name == "output.weight":
            value = 4.0 / np.sqrt(shape.hidden) * rng.standard_normal(dims)
        elif name.endswith("ssm_conv1d.weight"):
            value = 0.5 * rng.standard_normal(dims)
        else:
            value = 1.5 / np.sqrt(dims[-1]) * rng.standard_normal(dims)
        weights[name] = value.astype(np.float16).astype(np.float32)
    return weights


def write_hybrid_gguf(path: Path, shape: HybridShape, weights: dict[str, np.ndarray], mtp_layers: int = 0,
                      quantized: dict | None = None) -> Path:
    """The model as llama.cpp's ``qwen35`` GGUF (``qwen35moe`` with experts, ``qwen3next`` for
    Qwen3-Next's); with ``mtp_layers`` its MTP block(s) too (the weights must hold them);
    ``quantized``: GGML types by tensor name, as mtp_models.write_glm_gguf's."""
    assert shape.experts or not shape.next, "Qwen3-Next's layers are MoE layers"
    arch = shape.arch
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("specrun-tiny-hybrid")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_vocab_size(VOCAB_SIZE)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers + mtp_layers)
    if mtp_layers:
        writer.add_nextn_predict_layers(mtp_layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.rope_dims)
    if not shape.next:  # Qwen3.5's interleaved MRoPE (text alone: every section reads the same position)
        writer.add_rope_dimension_sections([shape.rope_dims // 4, shape.rope_dims // 8, shape.rope_dims // 8, 0])
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.eps)
    writer.add_ssm_conv_kernel(shape.conv_kernel)
    writer.add_ssm_inner_size(shape.state * shape.v_heads)
    writer.add_ssm_state_size(shape.state)
    writer.add_ssm_time_step_rank(shape.v_heads)
    writer.add_ssm_group_count(shape.k_heads)
    writer.add_full_attention_interval(shape.full_attention_interval)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_ffn)
        writer.add_expert_shared_feed_forward_length(shape.expert_ffn)
    vocab = parse_tokenizer_json(tiny_tokenizer_json(VOCAB_SIZE))
    ids = ModelConfig(arch="llama", vocab_size=VOCAB_SIZE, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                      num_layers=shape.layers, num_heads=shape.heads, num_kv_heads=shape.kv_heads,
                      rope_theta=shape.rope_theta, rms_norm_eps=shape.eps, context_length=shape.context,
                      tie_embeddings=False)
    add_tokenizer(writer, ids, vocab, DEMO_CHAT_TEMPLATE, "gpt-2")
    for name, value in weights.items():
        if not mtp_layers and int(name.split(".")[1] if name.startswith("blk.") else 0) >= shape.layers:
            continue
        if name in (quantized or {}):
            writer.add_tensor(name, quantized_blocks(value, quantized[name]), raw_dtype=quantized[name])
            continue
        plain = value.ndim == 1 or name.endswith("ssm_conv1d.weight")
        writer.add_tensor(name, value.astype(np.float32 if plain else np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_fitted_hybrid(folder: Path, shape: HybridShape, n_new: int = 160) -> dict[str, Path]:
    """The hybrid model with a Qwen3.5 MTP block trained on the target's own greedy continuations
    (heads_factory.fitted_mtp, as mtp_models.write_fitted_glm does): {"random": its GGUF with a
    random MTP block, "trained": with the fitted one, "trunk": without}."""
    from mtp_models import fitted_on_continuations

    weights = hybrid_weights(shape, mtp_layers=1)
    paths = {"trunk": write_hybrid_gguf(folder / "hybrid.gguf", shape, weights),
             "random": write_hybrid_gguf(folder / "hybrid-mtp.gguf", shape, weights, mtp_layers=1)}
    fitted = fitted_on_continuations(paths["trunk"], n_new)
    block = f"blk.{shape.layers}"
    trained = dict(weights)
    trained.update({f"{block}.nextn.eh_proj.weight": fitted.eh_proj,
                    f"{block}.nextn.embed_tokens.weight": np.asarray(fitted.embed, np.float32),
                    f"{block}.nextn.shared_head_head.weight": np.asarray(fitted.lm_head, np.float32)})
    for name in (f"{block}.nextn.shared_head_norm.weight", f"{block}.nextn.enorm.weight", f"{block}.nextn.hnorm.weight"):
        trained[name] = np.ones(shape.hidden, np.float32)
    for name in (f"{block}.attn_output.weight", f"{block}.ffn_down.weight"):
        trained[name] = np.zeros_like(trained[name])
    trained = {name: value.astype(np.float16).astype(np.float32) for name, value in trained.items()}
    paths["trained"] = write_hybrid_gguf(folder / "hybrid-mtp-trained.gguf", shape, trained, mtp_layers=1)
    return paths


_HF_MTP = {
    "nextn.eh_proj.weight": "mtp.fc.weight", "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
    "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "nextn.shared_head_norm.weight": "mtp.norm.weight",
    "attn_norm.weight": "mtp.layers.0.input_layernorm.weight",
    "post_attention_norm.weight": "mtp.layers.0.post_attention_layernorm.weight",
    "attn_q.weight": "mtp.layers.0.self_attn.q_proj.weight", "attn_k.weight": "mtp.layers.0.self_attn.k_proj.weight",
    "attn_v.weight": "mtp.layers.0.self_attn.v_proj.weight", "attn_output.weight": "mtp.layers.0.self_attn.o_proj.weight",
    "attn_q_norm.weight": "mtp.layers.0.self_attn.q_norm.weight",
    "attn_k_norm.weight": "mtp.layers.0.self_attn.k_norm.weight",
    "ffn_gate.weight": "mtp.layers.0.mlp.gate_proj.weight", "ffn_up.weight": "mtp.layers.0.mlp.up_proj.weight",
    "ffn_down.weight": "mtp.layers.0.mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mtp.layers.0.mlp.gate.weight",
    "ffn_gate_shexp.weight": "mtp.layers.0.mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mtp.layers.0.mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mtp.layers.0.mlp.shared_expert.down_proj.weight",
}
_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight", ".q_norm.weight",
          ".k_norm.weight")


def hf_mtp_tensors(shape: HybridShape, weights: dict[str, np.ndarray], fused_experts: bool) -> dict[str, np.ndarray]:
    """``weights``' MTP block (GGUF names) under Qwen's checkpoint names (``mtp.*``), its norms
    zero-centred (weight - 1) as those checkpoints store them; routed experts fused
    (``experts.gate_up_proj``, ``experts.down_proj``: Qwen3.5-MoE's) or one by one (Qwen3-Next's)."""
    block, experts = f"blk.{shape.layers}.", "mtp.layers.0.mlp.experts"
    tensors = {}
    for name, value in weights.items():
        if not name.startswith(block):
            continue
        rest = name[len(block):]
        if rest == "ffn_gate_inp_shexp.weight":
            tensors["mtp.layers.0.mlp.shared_expert_gate.weight"] = value.reshape(1, -1)
        elif rest.endswith("_exps.weight") and fused_experts:
            if rest.startswith("ffn_down"):
                tensors[f"{experts}.down_proj"] = value
            elif rest.startswith("ffn_gate"):
                tensors[f"{experts}.gate_up_proj"] = np.concatenate([value, weights[f"{block}ffn_up_exps.weight"]], axis=1)
        elif rest.endswith("_exps.weight"):
            part = rest.split("_")[1]
            for index in range(value.shape[0]):
                tensors[f"{experts}.{index}.{part}_proj.weight"] = value[index]
        else:
            tensors[_HF_MTP[rest]] = value - 1.0 if rest.endswith("norm.weight") else value
    return {name: np.ascontiguousarray(value, np.float32) for name, value in tensors.items()}


def write_qwen35_mlx_folder(folder: Path, shape: HybridShape, weights: dict[str, np.ndarray]) -> Path:
    """A Qwen3.5 folder mlx-lm loads (its ``qwen3_5`` model, a text model in a multimodal wrapper;
    ``qwen3_5_moe`` with experts, ``qwen3_next`` for Qwen3-Next's layout: random trunk weights of
    mlx-lm's own layout, seeded; Qwen3-Next's in its checkpoints' layout, experts one by one, as
    mlx-lm's loader reads it) carrying ``weights``' MTP block (GGUF names, as hybrid_weights(...,
    mtp_layers=1) gives it) under Qwen's checkpoint names (``mtp.*``, hf_mtp_tensors)."""
    import json

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_5, qwen3_next

    from specrun.modelkit.hf_io import tokenizer_config_dict

    folder.mkdir(parents=True, exist_ok=True)
    text = dict(model_type="qwen3_5_text", hidden_size=shape.hidden, intermediate_size=shape.ffn,
                num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                head_dim=shape.head_dim, vocab_size=VOCAB_SIZE, rms_norm_eps=shape.eps,
                linear_num_value_heads=shape.v_heads, linear_num_key_heads=shape.k_heads,
                linear_key_head_dim=shape.state, linear_value_head_dim=shape.state,
                linear_conv_kernel_dim=shape.conv_kernel, full_attention_interval=shape.full_attention_interval,
                tie_word_embeddings=False, max_position_embeddings=shape.context, mtp_num_hidden_layers=1,
                rope_parameters={"type": "default", "mrope_section": [2, 1, 1], "rope_theta": shape.rope_theta,
                                 "partial_rotary_factor": shape.rope_dims / shape.head_dim},
                partial_rotary_factor=shape.rope_dims / shape.head_dim, rope_theta=shape.rope_theta)
    if shape.experts:
        text.update(num_experts=shape.experts, num_experts_per_tok=shape.experts_used, decoder_sparse_step=1,
                    moe_intermediate_size=shape.expert_ffn, shared_expert_intermediate_size=shape.expert_ffn,
                    norm_topk_prob=True, mlp_only_layers=[])
    mx.random.seed(0)
    if shape.next:
        del text["rope_parameters"], text["mtp_num_hidden_layers"]  # Qwen3-Next's config names no MTP layers
        config = dict(text, model_type="qwen3_next", bos_token_id=1, eos_token_id=2)
        model = qwen3_next.Model(qwen3_next.ModelArgs.from_dict(config))
    else:
        text["model_type"] = "qwen3_5_moe_text" if shape.experts else "qwen3_5_text"
        config = {"model_type": "qwen3_5_moe" if shape.experts else "qwen3_5", "text_config": text,
                  "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
        model = qwen3_5.Model(qwen3_5.ModelArgs(model_type="qwen3_5", text_config=text))
    trunk = dict(tree_flatten(model.parameters()))
    for name, value in trunk.items():  # mlx's default init leaves the mixers negligible
        if value.ndim >= 2 and "embed" not in name and "conv1d" not in name:
            trunk[name] = 1.5 / value.shape[-1] ** 0.5 * mx.random.normal(value.shape)
    if shape.next:  # the checkpoint's layout mlx-lm's sanitize turns into its own
        for name in list(trunk):
            value = trunk[name]
            if ".switch_mlp." in name:
                del trunk[name]
                for index in range(value.shape[0]):
                    trunk[name.replace(".switch_mlp.", f".experts.{index}.")] = value[index]
            elif "conv1d.weight" in name:
                trunk[name] = value.moveaxis(2, 1)
            elif name.endswith(_NORMS) and value.ndim == 1:
                trunk[name] = value - 1.0
    for name, value in hf_mtp_tensors(shape, weights, fused_experts=not shape.next).items():
        trunk[name] = mx.array(value)
    mx.save_safetensors(str(folder / "model.safetensors"), trunk)
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer_json = tiny_tokenizer_json(VOCAB_SIZE)
    (folder / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    ids = ModelConfig(arch="llama", vocab_size=VOCAB_SIZE, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                      num_layers=shape.layers, num_heads=shape.heads, num_kv_heads=shape.kv_heads,
                      rope_theta=shape.rope_theta, rms_norm_eps=shape.eps, context_length=shape.context,
                      tie_embeddings=False)
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config_dict(ids, tokenizer_json,
                                                                                   DEMO_CHAT_TEMPLATE)))
    return folder


def write_fitted_qwen35_mlx_folder(folder: Path, shape: HybridShape, n_new: int = 160) -> Path:
    """write_qwen35_mlx_folder's model with its MTP block fitted on the MLX model's own greedy
    continuations of mtp_models.TRAINING_PROMPTS, as Qwen's layout allows (the target's embedding
    and output head shared, no head of its own): ``mtp.fc`` a ridge regression from [normed
    embedding of the token at p + 1; normed state at p] to the normed state at p + 1, whose
    direction the target's head reads as the token at p + 2; the block's attention and MLP add
    nothing, its norms one. The trunk is the seeded one either way."""
    import mlx.core as mx

    from mtp_models import TRAINING_PROMPTS

    from specrun.backends.mlx import MlxBackend
    from specrun.engine.loop import GenerationParams, SpeculativeEngine
    from specrun.heads.layers import rms_norm

    weights = hybrid_weights(shape, mtp_layers=1)
    write_qwen35_mlx_folder(folder, shape, weights)
    target = MlxBackend(folder)
    engine = SpeculativeEngine(target, None)
    sequences = []
    for prompt in TRAINING_PROMPTS:
        ids = target.tokenize(prompt)
        sequences.append(ids + list(engine.run(ids, GenerationParams(n_new, 0)).token_ids))
    ones, eps = np.ones(shape.hidden), shape.eps
    stored = mx.load(str(folder / "model.safetensors"))
    head = np.array(next(value for name, value in stored.items() if name.endswith("lm_head.weight")), np.float64)
    head = head / np.linalg.norm(head, axis=1, keepdims=True)  # (V, H)
    joined, following = [], []
    for ids in sequences:
        target.rewind(0)
        target.track_hidden(True)
        target.forward(ids, [len(ids) - 1])
        states = rms_norm(target.hidden_rows(range(len(ids))).astype(np.float64), ones, eps)  # (n, H)
        target.track_hidden(False)
        embedded = rms_norm(target.token_embeddings(ids[1:-1]).astype(np.float64), ones, eps)
        joined.append(np.concatenate([embedded, states[:-2]], axis=1))
        following.append(head[np.asarray(ids[2:])])
    target.close()
    joined, following = np.concatenate(joined), np.concatenate(following)
    ridge = 1e-3 * len(joined)
    eh_proj = np.linalg.solve(joined.T @ joined + ridge * np.eye(2 * shape.hidden), joined.T @ following).T
    block = f"blk.{shape.layers}"
    weights[f"{block}.nextn.eh_proj.weight"] = eh_proj.astype(np.float32)
    for norm in ("enorm", "hnorm", "shared_head_norm"):
        weights[f"{block}.nextn.{norm}.weight"] = np.ones(shape.hidden, np.float32)
    for name in (f"{block}.attn_output.weight", f"{block}.ffn_down.weight"):
        weights[name] = np.zeros_like(weights[name])
    return write_qwen35_mlx_folder(folder, shape, weights)


def quantized_mlx_folder(source: Path, folder: Path, keep_mtp: bool, bits: int = 4, group: int = 64) -> Path:
    """``source`` (a folder write_qwen35_mlx_folder wrote) quantized by mlx-lm's own converter, as
    mlx-community's folders are: its config still names the MTP layer, its weights hold none. With
    ``keep_mtp`` the MTP block is added back quantized the same way (``mtp.*`` matrices as packed
    words, scales and biases; norms as they were) in a file of its own named in the folder's index,
    as tools that graft a model's MTP weights onto such a folder leave it."""
    import json

    import mlx.core as mx
    from mlx_lm import convert

    convert(str(source), str(folder), quantize=True, q_group_size=group, q_bits=bits)
    if keep_mtp:
        grafted = {}
        for name, value in mx.load(str(source / "model.safetensors")).items():
            if not name.startswith("mtp."):
                continue
            if value.ndim >= 2 and name.endswith(".weight") and value.shape[-1] % group == 0:
                words, scales, biases = mx.quantize(value, group_size=group, bits=bits)
                base = name[: -len(".weight")]
                grafted.update({name: words, f"{base}.scales": scales, f"{base}.biases": biases})
            else:
                grafted[name] = value
        mx.save_safetensors(str(folder / "mtp.safetensors"), grafted)
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        index["weight_map"].update(dict.fromkeys(grafted, "mtp.safetensors"))
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder
