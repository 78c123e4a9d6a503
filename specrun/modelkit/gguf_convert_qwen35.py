"""Qwen3.5's hybrid layout (llama.cpp's ``qwen35`` and ``qwen35moe``) from a GGUF into the folder
mlx-lm's ``qwen3_5`` model loads (Qwen3-Next's, ``qwen3next``, into its ``qwen3_next``: below), the model's MTP layer carried along under the names Qwen's
checkpoints give it (``mtp.*``; several as ``mtp.layers.N`` under the first block's fc and norms,
where llama.cpp's converter put them): mlx-lm ignores it, specrun's MTP drafter reads it
(modelkit.mtp.read_mtp_folder). mlx-lm cannot read GGUF, and the folders mlx-lm converts from a
checkpoint drop the MTP layer, so a GGUF that kept it is the way to an MLX model that drafts
with its own layer.

llama.cpp's converter (conversion/qwen.py, Qwen3NextModel and _LinearAttentionVReorderBase)
changed the checkpoint's tensors on the way in; each change is undone here, into mlx-lm's own
(sanitized) layout:

- every norm but the linear attention's was stored as 1 + w: mlx-lm's folders hold the same, so
  the trunk's are kept; the MTP block's are written as w, as Qwen's checkpoints store them;
- A was stored as -exp(A_log): A_log = log(-A);
- the convolution's kernel was squeezed to (channels, K): mlx-lm's is (channels, K, 1);
- where key heads are fewer than value heads, the value heads were reordered from grouped by key
  head ([k0: v0 v1, k1: v0 v1]) to tiled ([v0: k0 k1, v1: k0 k1]): grouped again here (the
  value rows of in_proj_qkv, in_proj_z, in_proj_a/b, A_log, dt_bias, the value channels of the
  convolution, the columns of out_proj).

Qwen3-Next (``qwen3next``): the same changes but the value heads' reorder (llama.cpp keeps them
grouped there), and two more: the checkpoint's in_proj_qkvz, key head by key head its q, k and the
value heads' v and z, was split into attn_qkv (all q, all k, all v) and attn_gate (z), joined again
here (``next_qkvz``); its in_proj_ba is stored as it was (ssm_ba). Its config is flat, and the MTP
layers go to ``MTP_FILE``: mlx-lm's qwen3_next drops ``mtp.*`` only from unstacked experts.

With ``q4``, GGML blocks are carried over exactly only where a matrix is stored unchanged (the
reordered and the 3-D expert matrices are quantized afresh). transformers builds the tokenizer of a
``qwen3_5`` folder as Qwen's own (NFC, its regex) whatever tokenizer.json says, as it does qwen2's
(modelkit.gguf_convert); mlx-lm's generation splits text with it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from types import SimpleNamespace

import gguf
import numpy as np

from specrun.errors import ModelFileError

ARCHS = ("qwen35", "qwen35moe", "qwen3next")
_TEXT = "language_model.model."  # where mlx-lm's qwen3_5 holds the text model
# Where Qwen3-Next's MTP layers go: a file mlx-lm does not load (it loads model*.safetensors), as
# its qwen3_next, unlike qwen3_5, drops ``mtp.*`` only from a checkpoint's unstacked layout.
MTP_FILE = "mtp.safetensors"


def text_config(config: dict) -> dict:
    """The text model's settings of a config.json: qwen3_5's ``text_config``, or Qwen3-Next's own."""
    return config.get("text_config", config)


def is_next(config: dict) -> bool:
    return config.get("model_type") == "qwen3_next"


def arch_readers(fields: dict, tensors: Collection[str]) -> tuple[str, Callable, Callable]:
    """The GGUF's architecture and its readers of the architecture's keys: ``key(name, default)``
    and ``count(name, default, least=1)``, each a ValueError naming a key the file lacks or holds
    out of range. A ValueError first where the file uses RoPE scaling, which no MLX conversion of
    specrun's handles."""
    arch = fields[gguf.Keys.General.ARCHITECTURE]

    def key(name: str, default=None):
        value = fields.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"the GGUF file lacks the key {arch}.{name}")
        return value

    def count(name: str, default=None, least: int = 1) -> int:
        value = key(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{arch}.{name} is {value!r}, not a count of at least {least}")
        return value

    scaling = fields.get(f"{arch}.rope.scaling.type", "none") or "none"
    if scaling != "none" or "rope_freqs.weight" in tensors:
        raise ValueError(f"it uses RoPE scaling ({scaling}), which the MLX conversion does not handle")
    return arch, key, count


def qwen35_config(fields: dict, tensors: Collection[str], vocab_size: int) -> dict:
    """mlx-lm's config.json for the GGUF's ``fields``; ValueError naming a key it lacks or a layout
    mlx-lm's qwen3_5 cannot express (a layer pattern other than every interval-th layer full
    attention)."""
    arch, key, count = arch_readers(fields, tensors)
    mtp_layers = int(key("nextn_predict_layers", 0) or 0)
    layers = count("block_count") - mtp_layers
    interval = count("full_attention_interval", 4)
    linear = [f"blk.{i}.attn_qkv.weight" in tensors for i in range(layers)]
    if interval < 1 or linear != [(i + 1) % interval != 0 for i in range(layers)]:
        raise ValueError(f"its linear-attention layers are not every layer but each {interval}th, "
                         "the only pattern mlx-lm's qwen3_5 builds")
    heads, head_dim = count("attention.head_count"), count("attention.key_length")
    value_heads, key_heads = count("ssm.time_step_rank"), count("ssm.group_count")
    for name in ("ssm.state_size", "ssm.inner_size", "ssm.conv_kernel", "embedding_length", "context_length"):
        count(name)
    if value_heads % key_heads or key("ssm.inner_size") % value_heads:
        raise ValueError(f"its {value_heads} value heads are not a multiple of its {key_heads} key heads, "
                         f"or its ssm.inner_size {key('ssm.inner_size')} not a multiple of them")
    sections = list(key("rope.dimension_sections", [11, 11, 10, 0]))[:3]
    rope = {"type": "default", "mrope_section": sections, "rope_theta": shortest_decimal(key("rope.freq_base", 1e7)),
            "partial_rotary_factor": int(key("rope.dimension_count", head_dim // 4)) / head_dim}
    if arch == "qwen3next":  # one rotary position a token (no MRoPE sections)
        del rope["mrope_section"]
    text = {
        "model_type": "qwen3_5_text", "vocab_size": vocab_size, "hidden_size": int(key("embedding_length")),
        "intermediate_size": int(key("feed_forward_length", 0) or 0), "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim, "rms_norm_eps": shortest_decimal(key("attention.layer_norm_rms_epsilon")),
        "linear_num_value_heads": value_heads, "linear_num_key_heads": key_heads,
        "linear_key_head_dim": int(key("ssm.state_size")),
        "linear_value_head_dim": int(key("ssm.inner_size")) // value_heads,
        "linear_conv_kernel_dim": int(key("ssm.conv_kernel")), "full_attention_interval": interval,
        "tie_word_embeddings": "output.weight" not in tensors, "max_position_embeddings": int(key("context_length")),
        "mtp_num_hidden_layers": mtp_layers, "rope_parameters": rope,
        "partial_rotary_factor": rope["partial_rotary_factor"], "rope_theta": rope["rope_theta"],
    }
    if arch in ("qwen35moe", "qwen3next"):
        text.update(model_type="qwen3_5_moe_text", num_experts=count("expert_count"),
                    num_experts_per_tok=count("expert_used_count"), decoder_sparse_step=1,
                    moe_intermediate_size=count("expert_feed_forward_length"),
                    shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length", 0) or 0),
                    norm_topk_prob=True, mlp_only_layers=[])  # llama.cpp routes by softmax summed to one
    if arch == "qwen3next":  # mlx-lm's qwen3_next: a text model of its own, its settings at the top
        del text["rope_parameters"]
        return {"architectures": ["Qwen3NextForCausalLM"], **text, "model_type": "qwen3_next"}
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration" if arch == "qwen35moe"
                              else "Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5_moe" if arch == "qwen35moe" else "qwen3_5", "text_config": text,
            "tie_word_embeddings": text["tie_word_embeddings"]}


def shortest_decimal(value) -> float:
    """A GGUF's float32 as the shortest decimal that is that float32 (1e-06, not 9.99999997e-07),
    as the checkpoint's config said it."""
    return float(str(np.float32(value)))


# GGUF name within a block -> mlx-lm's name within a text-model layer (the trunk), or Qwen's
# checkpoint name within mtp.layers.0 (the MTP block: its norms as w, not 1 + w).
_SHARED = {
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.switch_mlp.gate_proj.weight", "ffn_up_exps.weight": "mlp.switch_mlp.up_proj.weight",
    "ffn_down_exps.weight": "mlp.switch_mlp.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
_LINEAR = {
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight", "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight", "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias", "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_norm.weight": "linear_attn.norm.weight", "ssm_out.weight": "linear_attn.out_proj.weight",
}
_NEXT_LINEAR = {  # Qwen3-Next's: beta and alpha in one in_proj_ba; q, k, v and z joined (``next_qkvz``)
    **{name: value for name, value in _LINEAR.items() if not name.startswith(("ssm_beta", "ssm_alpha"))},
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
}
_MTP_OWN = {  # the MTP block's own tensors -> Qwen's names under mtp.
    "nextn.eh_proj.weight": "fc.weight", "nextn.enorm.weight": "pre_fc_norm_embedding.weight",
    "nextn.hnorm.weight": "pre_fc_norm_hidden.weight", "nextn.shared_head_norm.weight": "norm.weight",
}
_TOP = {"token_embd.weight": f"{_TEXT}embed_tokens.weight", "output_norm.weight": f"{_TEXT}norm.weight",
        "output.weight": "language_model.lm_head.weight"}
_NEXT_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}

Transform = Callable[[np.ndarray], np.ndarray]


def qwen35_tensor_plan(config: dict, tensors: Collection[str]) -> dict[str, tuple[str, Transform | None]]:
    """For every GGUF tensor the folder holds: (its name there, the change that undoes llama.cpp's,
    or None where it is stored as it is). ValueError naming a tensor the layout has no place for
    (an MTP block's own embedding or output head, which Qwen's checkpoints do not carry)."""
    text, qwen3next = text_config(config), is_next(config)
    layers, mtp_layers = text["num_hidden_layers"], text["mtp_num_hidden_layers"]
    k_heads, v_heads = text["linear_num_key_heads"], text["linear_num_value_heads"]
    key_dim, value_dim = text["linear_key_head_dim"], text["linear_value_head_dim"]
    top, trunk, linear = (_NEXT_TOP, "model.", _NEXT_LINEAR) if qwen3next else (_TOP, _TEXT, _LINEAR)

    def grouped(axis: int, width: int) -> Transform | None:
        """Value heads of ``width`` along ``axis`` back to grouped order (None: nothing was reordered:
        equal counts, or Qwen3-Next's, which llama.cpp keeps grouped)."""
        if k_heads == v_heads or qwen3next:
            return None
        return lambda array: _grouped(array, axis, k_heads, v_heads // k_heads, width)

    def qkv(array: np.ndarray) -> np.ndarray:
        qk = 2 * k_heads * key_dim
        return np.concatenate([array[:qk], _grouped(array[qk:], 0, k_heads, v_heads // k_heads, value_dim)])

    regrouped = k_heads != v_heads and not qwen3next

    def conv(array: np.ndarray) -> np.ndarray:
        return (qkv(array) if regrouped else array)[:, :, None]

    def a_log(array: np.ndarray) -> np.ndarray:
        turned = grouped(0, 1)
        return np.log(-(turned(array) if turned else array)).astype(np.float32)

    linear_changes: dict[str, Transform | None] = {
        "attn_qkv.weight": qkv if regrouped else None, "attn_gate.weight": grouped(0, value_dim),
        "ssm_beta.weight": grouped(0, 1), "ssm_alpha.weight": grouped(0, 1), "ssm_a": a_log,
        "ssm_dt.bias": grouped(0, 1), "ssm_conv1d.weight": conv, "ssm_out.weight": grouped(1, value_dim),
    }
    plan: dict[str, tuple[str, Transform | None]] = {}
    for name in tensors:
        if name in top:
            plan[name] = (top[name], None)
            continue
        parts = name.split(".", 2)
        if parts[0] != "blk" or len(parts) < 3 or not parts[1].isdecimal():
            raise ValueError(f"it holds the tensor {name}, which mlx-lm's qwen3_5 has no place for")
        index, rest = int(parts[1]), parts[2]
        gate_row = (lambda array: array.reshape(1, -1)) if rest == "ffn_gate_inp_shexp.weight" else None
        if index < layers:
            if rest in linear and (index + 1) % text["full_attention_interval"] == 0:
                raise ValueError(f"it holds the tensor {name} in a full-attention layer")
            if rest in linear:
                plan[name] = (f"{trunk}layers.{index}.{linear[rest]}", linear_changes.get(rest))
            elif rest in _SHARED:
                plan[name] = (f"{trunk}layers.{index}.{_SHARED[rest]}", gate_row)
            else:
                raise ValueError(f"it holds the tensor {name}, which mlx-lm's qwen3_5 has no place for")
        elif index < layers + mtp_layers:
            norm = rest.endswith("norm.weight")
            back = (lambda array: array - 1.0) if norm else gate_row
            if rest in _MTP_OWN and index > layers:  # Qwen's layers share the first block's fc and norms
                raise ValueError(f"its MTP block {index} holds {rest} of its own, which Qwen's MTP layout, one fc "
                                 "for every layer, has no place for")
            if rest in _MTP_OWN:
                plan[name] = (f"mtp.{_MTP_OWN[rest]}", back)
            elif rest in _SHARED:  # one layer a draft depth (modelkit.mtp reads them chained)
                plan[name] = (f"mtp.layers.{index - layers}.{_SHARED[rest]}", back)
            else:
                raise ValueError(f"its MTP layer holds {name}, which Qwen's MTP layout has no place for")
        else:
            raise ValueError(f"it holds the tensor {name} past its {layers + mtp_layers} blocks")
    missing = sorted(set(_required(text, linear)) - set(tensors))
    if missing:
        raise ValueError(f"it lacks the tensor {missing[0]}")
    return plan


def check_qwen35_shapes(config: dict, shapes: dict[str, tuple[int, ...]]) -> None:
    """ValueError naming a tensor whose shape (NumPy's order) the layout cannot hold: the
    embedding, output head and final norm against the header's sizes, the MTP block's own
    tensors against the hidden size, and each block tensor against the same tensor of every
    other block (the MTP block's attention and MLP included: a full-attention layer's)."""
    text = text_config(config)
    hidden, vocab = text["hidden_size"], text["vocab_size"]
    expected = {"token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden), "output_norm.weight": (hidden,),
                "nextn.eh_proj.weight": (hidden, 2 * hidden), "nextn.enorm.weight": (hidden,),
                "nextn.hnorm.weight": (hidden,), "nextn.shared_head_norm.weight": (hidden,)}
    seen: dict[str, tuple[str, tuple[int, ...]]] = {}  # a block tensor's kind -> the first one's name and shape
    for name, shape in sorted(shapes.items()):
        parts = name.split(".", 2)
        kind = parts[2] if parts[0] == "blk" and len(parts) == 3 else name
        if kind in expected and tuple(shape) != expected[kind]:
            raise ValueError(f"its tensor {name} is {tuple(shape)}, where the header's sizes give {expected[kind]}")
        first, first_shape = seen.setdefault(kind, (name, tuple(shape)))
        if tuple(shape) != first_shape:
            raise ValueError(f"its tensors {first} {first_shape} and {name} {tuple(shape)} differ in shape")


def _required(text: dict, linear: dict[str, str]) -> list[str]:
    """The GGUF tensors every model of ``text``'s shape holds (an MTP block's aside); ``linear``: the
    linear-attention layers' (Qwen3.5's or Qwen3-Next's)."""
    ffn = (("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
            "ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")
           if text.get("num_experts") else ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"))
    names = ["token_embd.weight", "output_norm.weight"]
    for index in range(text["num_hidden_layers"]):
        mixer = (linear if (index + 1) % text["full_attention_interval"] else
                 ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight"))
        names += [f"blk.{index}.{rest}" for rest in (*mixer, *ffn, "attn_norm.weight", "post_attention_norm.weight")]
    return names


def next_qkvz(config: dict, qkv: np.ndarray, z: np.ndarray) -> np.ndarray:
    """Qwen3-Next's in_proj_qkvz from llama.cpp's attn_qkv (every key head's q, then k, then the
    value heads) and attn_gate (z): the checkpoint's rows again, key head by key head its q, k, and
    the value heads' v and z grouped under it (llama.cpp's converter split them apart)."""
    text = text_config(config)
    k_heads, key_dim = text["linear_num_key_heads"], text["linear_key_head_dim"]
    per_key = text["linear_num_value_heads"] // k_heads * text["linear_value_head_dim"]
    q, k, v = np.split(qkv, [k_heads * key_dim, 2 * k_heads * key_dim])
    parts = [part.reshape(k_heads, -1, *part.shape[1:]) for part in (q, k, v, z)]
    if parts[2].shape[1] != per_key or parts[3].shape[1] != per_key:
        raise ValueError(f"its value rows {v.shape[0]} and gate rows {z.shape[0]} are not {k_heads} key heads' worth")
    return np.concatenate(parts, axis=1).reshape(-1, *qkv.shape[1:])


def _grouped(array: np.ndarray, axis: int, k_heads: int, per_key: int, width: int) -> np.ndarray:
    """Undo llama.cpp's reorder along ``axis``: (per_key, k_heads, width) tiled -> (k_heads, per_key, width)."""
    moved = np.moveaxis(array, axis, 0)
    rest = moved.shape[1:]
    regrouped = moved.reshape(per_key, k_heads, width, *rest).swapaxes(0, 1).reshape(moved.shape)
    return np.ascontiguousarray(np.moveaxis(regrouped, 0, axis))  # as stored: safetensors writes the buffer


def check_qwen35(source, fields: dict, tensors: Collection[str]) -> None:
    """One ModelFileError for a file whose layout the conversion cannot express."""
    try:
        qwen35_tensor_plan(qwen35_config(fields, tensors, 1), tensors)
    except (KeyError, TypeError, ValueError) as exc:
        message = str(exc).strip("'")
        raise ModelFileError(f"{source} cannot be converted to MLX: {message}",
                             "convert another model, or run this one with --backend llama") from None


def token_ids(bos: int, eos: int, context: int) -> SimpleNamespace:
    """What the tokenizer's config reads of a model (hf_io.vocab_tokenizer_config)."""
    return SimpleNamespace(bos_token_id=bos, eos_token_id=eos, context_length=context)
