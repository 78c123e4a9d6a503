"""The MTP layers a model carries in its own GGUF file, read as heads.mtp.MtpHeads.

llama.cpp stores them as the last ``{arch}.nextn_predict_layers`` of ``{arch}.block_count``
blocks: an ordinary decoder block (``blk.N.attn_*``, ``blk.N.ffn_*``) plus ``blk.N.nextn.eh_proj``,
``enorm``, ``hnorm`` and optionally its own ``embed_tokens``, ``shared_head_head`` and
``shared_head_norm`` (else the target's embedding, output head and final norm). The GGUF's matrices
are (out, in) as NumPy reads them, the layout heads.mtp computes in; rotary embeddings are NeoX's
for these architectures, so no rows are reordered.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from specrun.errors import ModelFileError, UsageError
from specrun.heads.config import HeadsConfig
from specrun.heads.mtp import DEFAULT_DEPTH, MtpHeads, MtpLayout
from specrun.modelkit.gguf_header import header_values
from specrun.modelkit.gguf_io import read_fields

# Architectures whose MTP layers specrun reads (those llama.cpp runs its draft-mtp with, too, are
# named in the refusal: a user with one of them learns it is the layout, not the file).
READABLE = ("glm4moe",)
CARRIERS = ("deepseek2", "glm4moe", "qwen35", "qwen35moe", "qwen3next", "mimo2", "step35")
_GATINGS = {1: "softmax", 2: "sigmoid"}  # llama.cpp's expert_gating_func values
_PLAIN_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)


def carriers_refusal(target: str, detail: str = "") -> UsageError:
    """The one line for a target that carries no MTP layers: which models do."""
    return UsageError(f"{target} carries no MTP layers{detail}; models that do: DeepSeek-V3, GLM-4.5, Qwen3.5/3.6, "
                      f"MiMo, Step-3.5 (llama.cpp architectures {', '.join(CARRIERS)})",
                      "use another method, or a GGUF converted with its MTP (nextn) layers")


def mtp_layer_count(path: str | Path) -> int:
    """How many MTP layers the GGUF at ``path`` says it carries (0: none), from its metadata alone
    (auto asks it of every target it opens)."""
    values = dict(header_values(Path(path)))
    count = values.get(f"{values.get('general.architecture', '')}.nextn_predict_layers", 0)
    return count if isinstance(count, int) else 0


def read_mtp_gguf(path: str | Path, depth: int = DEFAULT_DEPTH) -> MtpHeads:
    """The first MTP layer of the GGUF at ``path`` as heads drafting ``depth`` deep. UsageError
    where the model carries none; ModelFileError where its layout cannot be read (an architecture
    specrun does not read, a tensor missing or mis-shaped)."""
    path = Path(path)
    reader = gguf.GGUFReader(str(path))
    fields = read_fields(reader)
    arch = fields.get(gguf.Keys.General.ARCHITECTURE, "")
    count = int(fields.get(f"{arch}.nextn_predict_layers", 0) or 0)
    if count <= 0:
        raise carriers_refusal(str(path), f" ({arch})")
    if arch not in READABLE:
        raise ModelFileError(f"{path.name}: specrun cannot read the MTP layers of architecture {arch!r} yet "
                             f"(it reads {', '.join(READABLE)})", "use another method with this model")
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    block = int(fields[f"{arch}.block_count"]) - count  # the first MTP block
    hidden = int(fields[f"{arch}.embedding_length"])
    heads_count = int(fields[f"{arch}.attention.head_count"])
    kv_count = int(fields.get(f"{arch}.attention.head_count_kv", heads_count))
    head_dim = int(fields.get(f"{arch}.attention.key_length", hidden // heads_count))

    def tensor(name: str, shape: tuple[int, ...], required: bool = True) -> np.ndarray | None:
        found = tensors.get(name)
        if found is None:
            if required:
                raise ModelFileError(f"{path.name} says it carries MTP layers but lacks {name}",
                                     "convert the model again with its MTP layers, or use another method")
            return None
        data = np.asarray(found.data)
        if found.tensor_type not in _PLAIN_TYPES:
            data = gguf.quants.dequantize(data, found.tensor_type)
        if tuple(data.shape) != shape:
            raise ModelFileError(f"{path.name}: {name} is {tuple(data.shape)}, the layout needs {shape}",
                                 "convert the model again, or use another method")
        # The embedding and output head stay as stored (memory-mapped F16 rows: a real vocabulary's
        # would be gigabytes as float32); the layer's arrays are float32, the dtype it computes in.
        return data if shape == (vocab, hidden) and data.dtype == np.float16 else data.astype(np.float32)

    vocab = len(fields[gguf.Keys.Tokenizer.LIST])
    mtp = f"blk.{block}"
    experts = int(fields.get(f"{arch}.expert_count", 0) or 0)
    layout = MtpLayout(
        arch=arch, num_attention_heads=heads_count, num_key_value_heads=kv_count, head_dim=head_dim,
        rope_dims=int(fields.get(f"{arch}.rope.dimension_count", head_dim)),
        rope_theta=float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(fields[f"{arch}.attention.layer_norm_rms_epsilon"]),
        experts=experts if f"{mtp}.ffn_gate_inp.weight" in tensors else 0,
        experts_used=int(fields.get(f"{arch}.expert_used_count", 0) or 0),
        gating=_GATINGS.get(int(fields.get(f"{arch}.expert_gating_func", 2) or 2), "sigmoid"),
        normalize_weights=bool(fields.get(f"{arch}.expert_weights_norm", False)),
        weights_scale=float(fields.get(f"{arch}.expert_weights_scale", 1.0) or 1.0),
    )
    embed = tensor(f"{mtp}.nextn.embed_tokens.weight", (vocab, hidden), required=False)
    if embed is None:
        embed = tensor("token_embd.weight", (vocab, hidden))
    lm_head = tensor(f"{mtp}.nextn.shared_head_head.weight", (vocab, hidden), required=False)
    if lm_head is None:
        lm_head = tensor("output.weight", (vocab, hidden), required=False)
    if lm_head is None:
        lm_head = embed
    head_norm = tensor(f"{mtp}.nextn.shared_head_norm.weight", (hidden,), required=False)
    if head_norm is None:
        head_norm = tensor("output_norm.weight", (hidden,))
    q_width, kv_width = heads_count * head_dim, kv_count * head_dim
    arrays = dict(
        embed=embed, lm_head=lm_head, head_norm=head_norm,
        enorm=tensor(f"{mtp}.nextn.enorm.weight", (hidden,)),
        hnorm=tensor(f"{mtp}.nextn.hnorm.weight", (hidden,)),
        eh_proj=tensor(f"{mtp}.nextn.eh_proj.weight", (hidden, 2 * hidden)),
        attn_norm=tensor(f"{mtp}.attn_norm.weight", (hidden,)),
        q_proj=tensor(f"{mtp}.attn_q.weight", (q_width, hidden)),
        k_proj=tensor(f"{mtp}.attn_k.weight", (kv_width, hidden)),
        v_proj=tensor(f"{mtp}.attn_v.weight", (kv_width, hidden)),
        o_proj=tensor(f"{mtp}.attn_output.weight", (hidden, q_width)),
        q_bias=tensor(f"{mtp}.attn_q.bias", (q_width,), required=False),
        k_bias=tensor(f"{mtp}.attn_k.bias", (kv_width,), required=False),
        v_bias=tensor(f"{mtp}.attn_v.bias", (kv_width,), required=False),
        q_norm=tensor(f"{mtp}.attn_q_norm.weight", (head_dim,), required=False),
        k_norm=tensor(f"{mtp}.attn_k_norm.weight", (head_dim,), required=False),
        post_norm=tensor(f"{mtp}.post_attention_norm.weight", (hidden,)),
    )
    if layout.experts:
        expert_width = int(fields[f"{arch}.expert_feed_forward_length"])
        shared = int(fields.get(f"{arch}.expert_shared_count", 0) or 0) * expert_width
        arrays.update(
            router=tensor(f"{mtp}.ffn_gate_inp.weight", (experts, hidden)),
            router_bias=tensor(f"{mtp}.exp_probs_b.bias", (experts,), required=False),
            gate_exps=tensor(f"{mtp}.ffn_gate_exps.weight", (experts, expert_width, hidden)),
            up_exps=tensor(f"{mtp}.ffn_up_exps.weight", (experts, expert_width, hidden)),
            down_exps=tensor(f"{mtp}.ffn_down_exps.weight", (experts, hidden, expert_width)),
        )
        if shared:
            arrays.update(gate_proj=tensor(f"{mtp}.ffn_gate_shexp.weight", (shared, hidden)),
                          up_proj=tensor(f"{mtp}.ffn_up_shexp.weight", (shared, hidden)),
                          down_proj=tensor(f"{mtp}.ffn_down_shexp.weight", (hidden, shared)))
    else:
        width = int(fields[f"{arch}.feed_forward_length"])
        arrays.update(gate_proj=tensor(f"{mtp}.ffn_gate.weight", (width, hidden)),
                      up_proj=tensor(f"{mtp}.ffn_up.weight", (width, hidden)),
                      down_proj=tensor(f"{mtp}.ffn_down.weight", (hidden, width)))
    config = HeadsConfig(kind="mtp", num_heads=depth, num_layers=count, hidden_size=hidden, vocab_size=vocab,
                         draft_vocab_size=vocab, target_name=path.name, target_layers=block)
    return MtpHeads(config=config, layout=layout, **arrays)

