"""The MTP layers a model carries in its own files, read as heads.mtp.MtpHeads: a GGUF, or a
Hugging Face / MLX folder (``read_mtp_folder``: the layer as ``model.layers.N``, N the trunk's
depth, as GLM-4.5's checkpoints hold it; mlx-lm drops it when it loads the model, specrun reads
it from the safetensors beside what mlx-lm loads).

llama.cpp stores them as the last ``{arch}.nextn_predict_layers`` of ``{arch}.block_count``
blocks: an ordinary decoder block (``blk.N.attn_*``, ``blk.N.ffn_*``) plus ``blk.N.nextn.eh_proj``,
``enorm``, ``hnorm`` and optionally its own ``embed_tokens``, ``shared_head_head`` and
``shared_head_norm`` (else the target's embedding, output head and final norm). The GGUF's matrices
are (out, in) as NumPy reads them, the layout heads.mtp computes in; rotary embeddings are NeoX's
for these architectures, so no rows are reordered.
"""

from __future__ import annotations

from pathlib import Path

import dataclasses
import json
import math
import re
from collections.abc import Mapping

import gguf
import numpy as np

from specrun.errors import ModelFileError, UsageError
from specrun.fileio import MiB, read_limited
from specrun.heads.config import HeadsConfig
from specrun.heads.mtp import DEFAULT_DEPTH, GATINGS, MtpHeads, MtpLayout
from specrun.modelkit.gguf_header import header_values
from specrun.modelkit.folder_tensors import Deferred, DeferredArrays, FolderTensors, StoredMatrix, deferred_matrix, tables
from specrun.modelkit.gguf_convert_qwen35 import MTP_FILE as QWEN_MTP_FILE
from specrun.modelkit.gguf_io import read_fields

# Architectures whose MTP layers specrun reads (those llama.cpp runs its draft-mtp with, too, are
# named in the refusal: a user with one of them learns it is the layout, not the file).
READABLE = ("deepseek2", "glm4moe", "qwen35", "qwen35moe", "qwen3next")
_LATENT_ATTENTION = ("deepseek2",)  # DeepSeek's MLA (GLM-4.7-Flash converts to it), rotary on consecutive pairs
_GATED_ATTENTION = ("qwen35", "qwen35moe", "qwen3next")  # q_proj gives each head's queries and its gate
# The nextn tensors Qwen's MTP layers share (mtp.fc, mtp.pre_fc_norm_*, mtp.norm), kept in the first block
_QWEN_SHARED_NEXTN = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head_norm.weight")
# Architectures whose MTP block's experts llama.cpp routes by softmax with weights summed to one,
# whatever the file says (its graph_mtp hard-codes them), and whose shared expert is gated.
_SOFTMAX_ROUTED = ("qwen35moe", "qwen3next")
CARRIERS = ("deepseek2", "glm4moe", "qwen35", "qwen35moe", "qwen3next", "mimo2", "step35")
_GATINGS = {1: "softmax", 2: "sigmoid"}  # llama.cpp's expert_gating_func values
_PLAIN_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)


class LazyGgufTensors(Mapping):
    """An MTP layer's arrays by name, each read from the GGUF (dequantized where stored quantized)
    when first asked for: llama.cpp runs the layer natively for chains, and a real model's output
    head alone is gigabytes as float32. The embedding and output head stay float16 where stored so."""

    def __init__(self, infos: dict, vocab: int, hidden: int, read: dict[str, np.ndarray] | None = None) -> None:
        """``infos``: by array name, (the file holding it, its tensor name, its tensor info); ``read``:
        the arrays read so far by tensor name, shared by the layers of one file (their tables are
        the target's, read once)."""
        self._infos, self._vocab, self._hidden = infos, vocab, hidden
        self._read: dict[str, np.ndarray] = {} if read is None else read
        self._tensors: dict[Path, dict] = {}  # each file's tensors by name, once one of it is read

    def __getitem__(self, key: str) -> np.ndarray:
        name = self._name(key)
        if name not in self._read:
            data = self._data(key)
            big = data.shape == (self._vocab, self._hidden) and data.dtype == np.float16
            self._read[name] = data if big else data.astype(np.float32)
        return self._read[name]

    def _name(self, key: str) -> str:
        if key not in self._infos:
            raise KeyError(key)
        return self._infos[key][1]

    def _data(self, key: str) -> np.ndarray:
        """The tensor as stored (F32 or F16), or dequantized to float32; not held here."""
        if key not in self._infos:
            raise KeyError(key)
        path, name, _ = self._infos[key]
        if path not in self._tensors:
            self._tensors[path] = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
        found = self._tensors[path][name]
        data = np.asarray(found.data)
        if found.tensor_type not in _PLAIN_TYPES:
            data = gguf.quants.dequantize(data, found.tensor_type)
        return data

    def loaded(self, key: str) -> bool:
        return key in self._infos and self._name(key) in self._read

    def stored(self, key: str) -> StoredMatrix:
        """The tensor as the GGUF stores it where that is float (F32, F16), read afresh (not held
        here: a float16 matrix read into NumPy already is held there as float32, twice the bytes),
        else dequantized to float32 (llama.cpp's block quantizations are not MLX's): the NumPy copy
        where there is one, the same numbers without dequantizing again."""
        if self._infos[key][2].tensor_type not in _PLAIN_TYPES and self.loaded(key):  # KeyError: none by that name
            return StoredMatrix(self._read[self._name(key)])
        return StoredMatrix(np.asarray(self._data(key)))  # the file's mapped bytes: the backend copies them

    def __iter__(self):
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    def nbytes(self, key: str) -> int:
        """What the tensor weighs in the file (0 where the layer has none)."""
        info = self._infos.get(key)
        return 0 if info is None else int(info[2].n_bytes)


def expert_gating(arch: str, fields: dict, trunk_layers: int, vocab: int) -> str:
    """How a block's experts are scored (the MTP block's, and a converted trunk's): as the file
    says, else as llama.cpp defaults (sigmoid; deepseek2's softmax, but for GLM-4.7-Flash's 47
    layers over 154,880 tokens)."""
    func = int(fields.get(f"{arch}.expert_gating_func", 0) or 0)
    if not func:
        func = 1 if arch == "deepseek2" and not (trunk_layers in (47, 48) and vocab == 154880) else 2
    return _GATINGS[func]


def _refuse_routing_unread(name: str, arch: str, fields: dict) -> None:
    """One line for routed experts scored in a way the layer does not reproduce: a gating
    function other than softmax and sigmoid (llama.cpp aborts on unknown ones)."""
    func = int(fields.get(f"{arch}.expert_gating_func", 0) or 0)
    if func and func not in _GATINGS:
        raise ModelFileError(f"{name}: specrun cannot draft with this {arch} model's MTP layer: its experts' "
                             f"gating function {func} (specrun reads softmax, 1, and sigmoid, 2)",
                             "use another method with this model")


def _refuse_latent_unread(name: str, arch: str, fields: dict, routed: bool) -> None:
    """One line for a latent-attention (``deepseek2``) MTP block whose layout specrun and llama.cpp's
    MTP context do not run (llama.cpp's graph asserts on each): an older conversion without the
    split kv_b, no query down-projection (DeepSeek-V2-Lite's), attention temperature scaling, or a
    dense MLP there. Several MTP layers are drafted in NumPy or MLX, one a depth (llama.cpp's MTP
    context runs one block: backends/llama._native_mtp_arch makes none for them)."""
    problem = (
        "an older conversion (its attention's kv_b not split into k_b and v_b)"
        if not all(fields.get(f"{arch}.attention.{key}") for key in ("key_length_mla", "value_length_mla",
                                                                       "kv_lora_rank")) else
        "attention without a query down-projection (q_lora_rank: DeepSeek-V2-Lite's layout)"
        if not fields.get(f"{arch}.attention.q_lora_rank") else
        "attention temperature scaling" if float(fields.get(f"{arch}.attention.temperature_scale", 0) or 0) else
        "a dense MLP in its MTP block (llama.cpp runs routed experts there)" if not routed else "")
    if problem:
        fix = ("convert the model again with a current llama.cpp" if problem.startswith("an older")
               else "use another method with this model")
        raise ModelFileError(f"{name}: specrun cannot draft with this {arch} model's MTP layer: {problem}", fix)


# YaRN's bounds on the rotations a context trained for: llama.cpp's and transformers' defaults.
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0
_ROTARY_SCALINGS = ("linear", "yarn")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for a context ``factor`` times the trained one (1 at or below it)."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_corr_dims(rope_dims: int, original: int, theta: float, fast: float, slow: float,
                    truncate: bool = True) -> tuple[float, float]:
    """The rotated pairs YaRN blends between (ggml_rope_yarn_corr_dims): a pair before the first
    turns more than ``fast`` times over the trained context and is kept as trained; one from the
    second on turns fewer than ``slow`` times and is interpolated."""
    def pair(turns: float) -> float:
        return rope_dims * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair(fast), pair(slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return float(max(0.0, low)), float(min(rope_dims - 1, high))


def _refuse_scaling(name: str, arch: str, kind: str) -> ModelFileError:
    return ModelFileError(f"{name}: specrun cannot draft with this {arch} model's MTP layer: its rotary scaling "
                          f"{kind!r} (it reads {', '.join(_ROTARY_SCALINGS)})", "use another method with this model")


def gguf_rope_scaling(name: str, arch: str, fields: dict, rope_dims: int, theta: float) -> dict:
    """The MtpLayout fields of a GGUF's rotary scaling, as llama.cpp computes them for the layer
    (llama_context's yarn_attn_factor, ggml's rope_yarn, deepseek2's kq_scale): {} for none."""
    kind = str(fields.get(f"{arch}.rope.scaling.type", "linear") or "linear")  # llama.cpp's default
    if kind not in ("none", *_ROTARY_SCALINGS):
        raise _refuse_scaling(name, arch, kind)
    stated = float(fields.get(f"{arch}.rope.scaling.factor", 0) or fields.get(f"{arch}.rope.scale_linear", 0) or 0)
    factor = 1.0 if kind == "none" or stated == 0 else stated
    stated_attention = fields.get(f"{arch}.rope.scaling.attn_factor")
    attention = 1.0 if stated_attention is None else float(stated_attention)
    # written as 0.1 * mscale_all_dim by the converter; llama.cpp reads it for deepseek2 alone
    log_multiplier = float(fields.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0) or 0) / 0.1 \
        if arch in _LATENT_ATTENTION else 0.0
    if factor == 1.0 and attention == 1.0:
        return {}
    yarn = kind == "yarn"
    magnitude = attention
    fields_out = {"rope_factor": factor, "rope_magnitude": magnitude}
    if yarn:
        # with a log multiplier (deepseek2's alone) llama.cpp takes mscale as mscale_all_dim: a ratio of 1
        magnitude = fields_out["rope_magnitude"] = (1.0 if log_multiplier else _yarn_mscale(factor)) * attention
        original = int(fields.get(f"{arch}.rope.scaling.original_context_length", 0) or
                       fields.get(f"{arch}.context_length", 0) or 0)
        if original <= 0:
            raise ModelFileError(f"{name}: its YaRN rotary scaling names no trained context length",
                                 "convert the model again, or use another method")
        fields_out["yarn_corr_dims"] = _yarn_corr_dims(rope_dims, original, theta, YARN_BETA_FAST, YARN_BETA_SLOW)
    if arch in _LATENT_ATTENTION:  # deepseek2's kq_scale: its attention factor times log_multiplier's
        grown = math.log(factor)
        mscale = (magnitude if yarn else attention * (1.0 + 0.1 * grown)) * (1.0 + 0.1 * log_multiplier * grown)
        fields_out["score_scale"] = mscale * mscale
    return fields_out


def folder_rope_scaling(name: str, arch: str, config: dict, rope_dims: int, theta: float) -> dict:
    """The MtpLayout fields of a model folder's ``rope_scaling`` (or ``rope_parameters``) as
    transformers computes them (_compute_yarn_parameters; DeepSeek's yarn_apply_mscale): {} for none."""
    rope = _rope_config(config)
    kind = str(rope.get("rope_type", rope.get("type", "default")) or "default")
    if kind in ("default", "none"):
        return {}
    if kind not in _ROTARY_SCALINGS:
        raise _refuse_scaling(name, arch, kind)
    try:
        # a top-level original_max_position_embeddings wins (Phi-3's), as transformers standardizes it
        original = int(config.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
                       or config.get("max_position_embeddings") or 0)
        factor = rope.get("factor")
        if factor is None and kind == "yarn" and original:  # DeepSeek's: the context over the trained one
            factor = int(config.get("max_position_embeddings") or 0) / original
        factor = float(1.0 if factor is None else factor)
        if not 0 < factor < 1e6:
            raise ValueError(f"factor {factor}")
        fields_out = {"rope_factor": factor} if factor != 1.0 else {}
        if kind == "yarn":
            if original <= 0:
                raise ValueError("no original_max_position_embeddings")
            fast, slow = float(rope.get("beta_fast") or YARN_BETA_FAST), float(rope.get("beta_slow") or YARN_BETA_SLOW)
            mscale, all_dims = rope.get("mscale"), rope.get("mscale_all_dim")
            magnitude = rope.get("attention_factor")
            if magnitude is None:
                magnitude = (_yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(all_dims))
                             if mscale and all_dims else _yarn_mscale(factor))
            fields_out.update(rope_magnitude=float(magnitude), yarn_corr_dims=_yarn_corr_dims(
                rope_dims, original, theta, fast, slow, bool(rope.get("truncate", True))))
        all_dims = rope.get("mscale_all_dim")
        if arch in _LATENT_ATTENTION and all_dims:  # DeepSeek's softmax scale, under any scaling
            fields_out["score_scale"] = _yarn_mscale(factor, float(all_dims)) ** 2
    except (TypeError, ValueError) as error:
        raise ModelFileError(f"{name}/config.json has a rope_scaling specrun cannot read ({error})",
                             "check the model folder") from None
    return fields_out


def _expert_groups(name: str, groups: int, used: int, layout: MtpLayout, fix: str) -> dict:
    """The MtpLayout fields of group-limited routing (none for one group, or no routed experts)."""
    experts = layout.experts
    if groups <= 1 or not experts:
        return {}
    if experts % groups or not 0 < used <= groups or experts // groups < 2 or \
            used * (experts // groups) < layout.experts_used:
        raise ModelFileError(f"{name}: its {experts} experts cannot be routed {layout.experts_used} at a time "
                             f"in {used} of {groups} groups", fix)
    return {"expert_groups": groups, "expert_groups_used": used}


_SPLIT_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def _split_tensors(path: Path, reader, fields: dict) -> tuple[dict, dict[str, Path]]:
    """Every tensor info of the model by name, and the file holding each: ``path`` alone, or every
    part of a split GGUF (gguf-split's NAME-0000i-of-0000N.gguf; ``path`` any of them), whose MTP
    block often lies in the last part."""
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    files = dict.fromkeys(tensors, path)
    count = fields.get("split.count", 1)
    named = _SPLIT_PART.search(path.name)
    if not isinstance(count, int) or count <= 1 or named is None:
        return tensors, files
    stem = path.name[: named.start()]
    for index in range(1, count + 1):
        part = path.with_name(f"{stem}-{index:05d}-of-{count:05d}.gguf")
        if part == path:
            continue
        if not part.is_file():
            raise ModelFileError(f"{path.name} is part of a {count}-part GGUF whose part {part.name} is missing",
                                 "download every part into the same folder")
        for tensor in gguf.GGUFReader(str(part)).tensors:
            tensors[tensor.name], files[tensor.name] = tensor, part
    return tensors, files


def carriers_refusal(target: str, detail: str = "") -> UsageError:
    """The one line for a target that carries no MTP layers: which models do."""
    return UsageError(f"{target} carries no MTP layers{detail}; models that do: DeepSeek-V3, GLM-4.5, Qwen3-Next, "
                      f"Qwen3.5/3.6, MiMo, Step-3.5 (llama.cpp architectures {', '.join(CARRIERS)})",
                      "use another method, or a GGUF converted with its MTP (nextn) layers")


def no_layers_refusal(target: str, candidates=(), detail: str = ""):
    """The one line for a target whose files hold no MTP layers: a folder mlx-lm converted from a
    model that carries them (Qwen3-Next's config names none, so only the weights could tell) says
    the conversion dropped them; anything else gets ``carriers_refusal``."""
    for folder in (Path(candidate) for candidate in candidates):
        try:
            config = _folder_config(folder) if folder.is_dir() else None
        except (ModelFileError, ValueError, RecursionError):
            config = None
        if (isinstance(config, dict) and config.get("model_type") == "qwen3_next" and config.get("quantization")
                and "mtp_num_hidden_layers" not in config):  # specrun's conversion says how many it kept
            return _dropped(folder, "Qwen3-Next carries one")
    return carriers_refusal(target, detail)


def _dropped(folder: Path, said: str) -> ModelFileError:
    return ModelFileError(f"{folder.name}: {said} MTP layer but the folder's weights hold none (mlx-lm drops them "
                          f"when it converts a model)",
                          "pass the model's original checkpoint folder (or a GGUF that kept it) with --heads, "
                          "or use another method")


def mtp_layer_count(path: str | Path) -> int:
    """How many MTP layers the GGUF at ``path`` says it carries (0: none), from its metadata alone
    (auto asks it of every target it opens)."""
    values = dict(header_values(Path(path)))
    count = values.get(f"{values.get('general.architecture', '')}.nextn_predict_layers", 0)
    return count if isinstance(count, int) else 0


def read_mtp_gguf(path: str | Path, depth: int = DEFAULT_DEPTH) -> MtpHeads:
    """The MTP layers of the GGUF at ``path`` as heads drafting ``depth`` deep (several: one a
    depth, ``chain_layers``). UsageError where the model carries none; ModelFileError where its layout cannot be read (an architecture
    specrun does not read, a tensor missing or mis-shaped)."""
    path = Path(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as exc:  # not a GGUF ("GGUF magic invalid"), cut short, unreadable
        raise ModelFileError(f"{path} is not a readable GGUF file: {exc}",
                             "pass a .gguf model that carries MTP layers, or download it again") from None
    fields = read_fields(reader)
    arch = fields.get(gguf.Keys.General.ARCHITECTURE, "")
    count = int(fields.get(f"{arch}.nextn_predict_layers", 0) or 0)
    if count <= 0:
        raise carriers_refusal(str(path), f" ({arch})")
    if arch not in READABLE:
        raise ModelFileError(f"{path.name}: specrun cannot read the MTP layers of architecture {arch!r} yet "
                             f"(it reads {', '.join(READABLE)})", "use another method with this model")
    tensors, files = _split_tensors(path, reader, fields)
    first = int(fields[f"{arch}.block_count"]) - count  # the first MTP block
    read: dict[str, np.ndarray] = {}  # the arrays read, by tensor: the layers share the target's tables
    layers = [_gguf_layer(path, fields, tensors, files, first + index, count, depth, read) for index in range(count)]
    return chain_layers(layers, depth)


def chain_layers(layers: list[MtpHeads], depth: int) -> MtpHeads:
    """The first of ``layers`` (one a draft depth) holding the others as ``chained``, drafting at
    most as deep as there are layers (as llama.cpp's draft-mtp chains them)."""
    if len(layers) == 1:
        return layers[0]
    config = dataclasses.replace(layers[0].config, num_heads=min(depth, len(layers)))
    return dataclasses.replace(layers[0], config=config, chained=tuple(layers[1:]))


def _gguf_layer(path: Path, fields: dict, tensors: dict, files: dict, block: int, count: int, depth: int,
                read: dict[str, np.ndarray]) -> MtpHeads:
    """The MTP layer in block ``block`` of the GGUF at ``path`` (``read_mtp_gguf``'s refusals)."""
    arch = fields[gguf.Keys.General.ARCHITECTURE]
    trunk = int(fields[f"{arch}.block_count"]) - count  # the target's own layers
    hidden = int(fields[f"{arch}.embedding_length"])
    heads_count = int(fields[f"{arch}.attention.head_count"])
    kv_count = int(fields.get(f"{arch}.attention.head_count_kv", heads_count))
    head_dim = int(fields.get(f"{arch}.attention.key_length", hidden // heads_count))

    def tensor(name: str, shape: tuple[int, ...], required: bool = True) -> str | None:
        """``name`` checked against the file's tensor infos (present, ``shape``); its data is read
        only when the layer first runs in NumPy (LazyGgufTensors)."""
        found = tensors.get(name)
        if found is None:
            if required:
                raise ModelFileError(f"{path.name} says it carries MTP layers but lacks {name}",
                                     "convert the model again with its MTP layers, or use another method")
            return None
        stored = tuple(int(n) for n in reversed(found.shape.tolist()))
        if stored != shape:
            raise ModelFileError(f"{path.name}: {name} is {stored}, the layout needs {shape}",
                                 "convert the model again, or use another method")
        return name

    vocab = len(fields[gguf.Keys.Tokenizer.LIST])
    mtp = f"blk.{block}"
    experts = int(fields.get(f"{arch}.expert_count", 0) or 0)
    latent = arch in _LATENT_ATTENTION
    if latent:
        _refuse_latent_unread(path.name, arch, fields, f"{mtp}.ffn_gate_inp.weight" in tensors)
        head_dim = int(fields[f"{arch}.attention.key_length_mla"])  # a query head's nope + rope dims
        kv_count = 1  # one latent key and value a position, as llama.cpp's MLA reads them
    if f"{mtp}.ffn_gate_inp.weight" in tensors:
        _refuse_routing_unread(path.name, arch, fields)
    layout = MtpLayout(
        arch=arch, num_attention_heads=heads_count, num_key_value_heads=kv_count, head_dim=head_dim,
        rope_dims=int(fields.get(f"{arch}.rope.dimension_count", head_dim)),
        rope_theta=float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(fields[f"{arch}.attention.layer_norm_rms_epsilon"]),
        experts=experts if f"{mtp}.ffn_gate_inp.weight" in tensors else 0,
        experts_used=int(fields.get(f"{arch}.expert_used_count", 0) or 0),
        gating="softmax" if arch in _SOFTMAX_ROUTED else expert_gating(arch, fields, trunk, vocab),
        normalize_weights=arch in _SOFTMAX_ROUTED or bool(fields.get(f"{arch}.expert_weights_norm", False)),
        weights_scale=float(fields.get(f"{arch}.expert_weights_scale", 1.0) or 1.0),
        gated_attention=arch in _GATED_ATTENTION,
        kv_lora_rank=int(fields[f"{arch}.attention.kv_lora_rank"]) if latent else 0, rope_pairs=latent,
    )
    layout = dataclasses.replace(
        layout, **gguf_rope_scaling(path.name, arch, fields, layout.rope_dims, layout.rope_theta),
        **_expert_groups(path.name, int(fields.get(f"{arch}.expert_group_count", 0) or 0),
                         int(fields.get(f"{arch}.expert_group_used_count", 0) or 0), layout,
                         "convert the model again, or use another method"))
    def nextn(part: str, shape: tuple[int, ...], required: bool = True) -> str | None:
        """The block's ``nextn.`` tensor ``part``; a later MTP block of Qwen's without its fc or
        norms reads the first block's (its several MTP layers share them: llama.cpp's converter
        writes them in the first MTP block alone). Anything else missing is missing."""
        found = tensor(f"{mtp}.nextn.{part}", shape, required=False)
        if found is None and block != trunk and arch in _GATED_ATTENTION and part in _QWEN_SHARED_NEXTN:
            found = tensor(f"blk.{trunk}.nextn.{part}", shape, required=False)
        return found if found is not None or not required else tensor(f"{mtp}.nextn.{part}", shape)

    embed = nextn("embed_tokens.weight", (vocab, hidden), required=False)
    if embed is None:
        embed = tensor("token_embd.weight", (vocab, hidden))
    lm_head = nextn("shared_head_head.weight", (vocab, hidden), required=False)
    if lm_head is None:
        lm_head = tensor("output.weight", (vocab, hidden), required=False)
    if lm_head is None:
        lm_head = embed
    head_norm = nextn("shared_head_norm.weight", (hidden,), required=False)
    if head_norm is None:
        head_norm = tensor("output_norm.weight", (hidden,))
    q_width, kv_width = heads_count * head_dim, kv_count * head_dim
    arrays = dict(
        embed=embed, lm_head=lm_head, head_norm=head_norm,
        enorm=nextn("enorm.weight", (hidden,)), hnorm=nextn("hnorm.weight", (hidden,)),
        eh_proj=nextn("eh_proj.weight", (hidden, 2 * hidden)),
        attn_norm=tensor(f"{mtp}.attn_norm.weight", (hidden,)),
    )
    if latent:
        q_rank, kv_rank, rope_dims = (int(fields[f"{arch}.attention.q_lora_rank"]), layout.kv_lora_rank,
                                      layout.rope_dims)
        nope, v_width = head_dim - rope_dims, int(fields[f"{arch}.attention.value_length_mla"])
        arrays.update(
            q_a=tensor(f"{mtp}.attn_q_a.weight", (q_rank, hidden)),
            q_a_norm=tensor(f"{mtp}.attn_q_a_norm.weight", (q_rank,)),
            q_b=tensor(f"{mtp}.attn_q_b.weight", (q_width, q_rank)),
            kv_a=tensor(f"{mtp}.attn_kv_a_mqa.weight", (kv_rank + rope_dims, hidden)),
            kv_a_norm=tensor(f"{mtp}.attn_kv_a_norm.weight", (kv_rank,)),
            k_b=tensor(f"{mtp}.attn_k_b.weight", (heads_count, kv_rank, nope)),
            v_b=tensor(f"{mtp}.attn_v_b.weight", (heads_count, v_width, kv_rank)),
            o_proj=tensor(f"{mtp}.attn_output.weight", (hidden, heads_count * v_width)),
            post_norm=tensor(f"{mtp}.ffn_norm.weight", (hidden,)),
        )
    else:
        arrays.update(
            q_proj=tensor(f"{mtp}.attn_q.weight", (2 * q_width if layout.gated_attention else q_width, hidden)),
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
        shared = int(fields.get(f"{arch}.expert_shared_feed_forward_length", 0) or 0) or \
            int(fields.get(f"{arch}.expert_shared_count", 0) or 0) * expert_width
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
                          down_proj=tensor(f"{mtp}.ffn_down_shexp.weight", (hidden, shared)),
                          shared_gate=tensor(f"{mtp}.ffn_gate_inp_shexp.weight", (hidden,),
                                             required=arch in _SOFTMAX_ROUTED))
    else:
        width = int(fields[f"{arch}.feed_forward_length"])
        arrays.update(gate_proj=tensor(f"{mtp}.ffn_gate.weight", (width, hidden)),
                      up_proj=tensor(f"{mtp}.ffn_up.weight", (width, hidden)),
                      down_proj=tensor(f"{mtp}.ffn_down.weight", (hidden, width)))
    config = HeadsConfig(kind="mtp", num_heads=depth, num_layers=count, hidden_size=hidden, vocab_size=vocab,
                         draft_vocab_size=vocab, target_name=path.name, target_layers=trunk)
    named = {key: name for key, name in arrays.items() if name is not None}
    target_tables = {"token_embd.weight", "output.weight"}
    return MtpHeads(config, layout, LazyGgufTensors({key: (files[name], name, tensors[name]) for key, name in named.items()},
                                                    vocab, hidden, read),
                    target_arrays=frozenset(key for key in ("embed", "lm_head") if named[key] in target_tables),
                    source=gguf_model_key(path))


def gguf_model_key(path: str | Path) -> str:
    """Which model a GGUF is, whichever part of a split one ``path`` names: the first part's
    resolved path (the part number read as the first's before links are followed: in the Hugging
    Face cache each part is a link to a blob named by its hash)."""
    path = Path(path).absolute()
    return str(path.with_name(_SPLIT_PART.sub(lambda m: f"-00001-of-{m.group(2)}.gguf", path.name)).resolve())



# Hugging Face model types whose MTP layers specrun reads from a folder, and the GGUF architecture
# each is (the refusals name the same models).
FOLDER_TYPES = {"glm4_moe": "glm4moe", "glm4_moe_lite": "deepseek2", "deepseek_v3": "deepseek2", "qwen3_5": "qwen35",
                "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}
# Those whose MTP block sits under ``mtp.*`` (Qwen's checkpoints) rather than as model.layers.N.
_QWEN_MTP = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
_QWEN_PREFIXES = ("", "model.", "language_model.")  # before "mtp.": checkpoints', llama.cpp's converter's, mlx-lm's
_QWEN_MTP_NAME = re.compile(r"^(?:model\.|language_model\.)?mtp\.")
_QWEN_MTP_LAYER = re.compile(r"^(?:model\.|language_model\.)?mtp\.layers\.(\d+)\.")
MAX_FOLDER_CONFIG_BYTES = 16 * MiB


def text_config_of(config: dict) -> dict:
    """A multimodal config's text model's settings (Qwen3.5's ``text_config``), else the config."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _folder_config(folder: Path):
    """The folder's config.json as JSON, read only where it is a regular file (a FIFO there hung
    the run) of at most MAX_FOLDER_CONFIG_BYTES; ModelFileError where it is not."""
    return json.loads(read_limited(folder / "config.json", MAX_FOLDER_CONFIG_BYTES, "model config",
                                   "check the model folder", error=ModelFileError))


def folder_mtp_layers(folder: str | Path) -> int:
    """How many MTP layers the model folder's config.json says it carries (0: none, or no config):
    GLM's ``num_nextn_predict_layers``, Qwen3.5's ``mtp_num_hidden_layers``."""
    try:
        config = _folder_config(Path(folder))
    except (ModelFileError, ValueError, RecursionError):
        return 0
    if not isinstance(config, dict):
        return 0
    text = text_config_of(config)
    count = text.get("num_nextn_predict_layers") or text.get("mtp_num_hidden_layers") or 0
    if not count and config.get("model_type") == "qwen3_next":
        count = _counted_mtp_layers(Path(folder))
    return count if isinstance(count, int) and count > 0 else 0


def _counted_mtp_layers(folder: Path) -> int:
    """How many ``mtp.layers.N`` blocks the folder's safetensors hold (Qwen3-Next's config names
    none; llama.cpp's converter counts them the same way); 0 where they cannot be listed."""
    try:
        names = tensor_files(folder)
    except (ModelFileError, OSError, ValueError):
        return 0
    found = [int(match.group(1)) for match in map(_QWEN_MTP_LAYER.match, names) if match]
    return max(found) + 1 if found else 0


def read_mtp_folder(folder: str | Path, depth: int = DEFAULT_DEPTH) -> MtpHeads:
    """The MTP layers of the model folder ``folder`` (config.json and safetensors: a float
    checkpoint, or an MLX folder mlx-lm quantized whose MTP tensors were kept) as heads drafting
    ``depth`` deep (several: one a depth, ``chain_layers``); refused in one line as ``read_mtp_gguf`` refuses, and where the folder's
    conversion dropped the layers its config still names."""
    folder = Path(folder)
    try:
        config = _folder_config(folder)
    except (ValueError, RecursionError) as error:
        raise ModelFileError(f"{folder}/config.json cannot be read ({error})", "check the model folder") from None
    model_type = config.get("model_type", "")
    count = folder_mtp_layers(folder)
    if count <= 0:
        raise no_layers_refusal(str(folder), (folder,), f" ({model_type})")
    if model_type not in FOLDER_TYPES:
        raise ModelFileError(f"{folder.name}: specrun cannot read the MTP layers of model type {model_type!r} yet "
                             f"(it reads {', '.join(FOLDER_TYPES)})", "use another method with this model")
    if config.get("quantization_config") and not config.get("quantization"):  # mlx-lm writes both
        raise ModelFileError(f"{folder.name} is quantized for transformers ({_quant_method(config)}): specrun reads "
                             f"the MTP layers of float checkpoints and of mlx-lm's quantized folders",
                             "use the model's float checkpoint, or another method")
    files = tensor_files(folder)
    reader = FolderTensors(folder, files, config.get("quantization"))
    qwen = model_type in _QWEN_MTP
    block = None if qwen else int(config["num_hidden_layers"])
    if not any(_QWEN_MTP_NAME.match(name) if qwen else name.startswith(f"model.layers.{block}.") for name in files):
        raise _dropped(folder, f"its config says it carries {count}")
    reads: dict = {}  # the tables read, by tensor: the layers share the target's
    if qwen:
        return chain_layers([_qwen_folder(folder, text_config_of(config), FOLDER_TYPES[model_type], reader, count, depth,
                                          index, reads) for index in range(count)], depth)
    return chain_layers([_folder_layer(folder, config, reader, count, depth, block + index, reads)
                         for index in range(count)], depth)


def _folder_layer(folder: Path, config: dict, reader: FolderTensors, count: int, depth: int, block: int,
                  reads: dict) -> MtpHeads:
    """The MTP layer ``model.layers.{block}`` of a GLM-4.5 or DeepSeek-V3 folder (``read_mtp_folder``)."""
    model_type = config.get("model_type", "")
    trunk = int(config["num_hidden_layers"])
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    mtp = f"model.layers.{block}"

    def tensor(name: str, shape: tuple[int, ...], required: bool = True) -> np.ndarray | Deferred | None:
        return _matrix(reader, (name,), shape, required) if len(shape) > 1 else reader.first((name,), shape, required)

    heads_count = int(config["num_attention_heads"])
    kv_count = int(config.get("num_key_value_heads", heads_count))
    head_dim = int(config.get("head_dim") or hidden // heads_count)
    rope_dims = int(head_dim * float(config.get("partial_rotary_factor", 1.0)))
    experts = int(config.get("n_routed_experts") or 0)
    routed = experts and block >= int(config.get("first_k_dense_replace", 0))
    if routed:
        _refuse_routing_unread(folder.name, "deepseek2", _folder_fields(config))
        if config.get("scoring_func", "sigmoid") not in GATINGS:
            raise ModelFileError(f"{folder.name}: specrun cannot draft with this model's MTP layer: its experts' "
                                 f"scoring function {config['scoring_func']!r} (it reads {', '.join(GATINGS)})",
                                 "use another method with this model")
    latent = FOLDER_TYPES[model_type] in _LATENT_ATTENTION
    if latent:  # one latent key and value a position: MQA over the latent, as llama.cpp's converter makes it
        _refuse_latent_unread(folder.name, "deepseek2", _folder_fields(config), bool(routed))
        rope_dims, kv_count = int(config["qk_rope_head_dim"]), 1
        head_dim = int(config["qk_nope_head_dim"]) + rope_dims
    layout = MtpLayout(
        arch=FOLDER_TYPES[model_type], num_attention_heads=heads_count, num_key_value_heads=kv_count,
        head_dim=head_dim, rope_dims=rope_dims,
        rope_theta=float(config.get("rope_theta") or _rope_config(config).get("rope_theta") or
                         (1e6 if latent else 10000.0)),  # mlx-lm's defaults
        rms_norm_eps=float(config["rms_norm_eps"]),
        experts=experts if routed else 0, experts_used=int(config.get("num_experts_per_tok") or 0),
        gating=config.get("scoring_func", "sigmoid"), normalize_weights=bool(config.get("norm_topk_prob", latent)),
        weights_scale=float(config.get("routed_scaling_factor", 1.0) or 1.0),
        kv_lora_rank=int(config["kv_lora_rank"]) if latent else 0, rope_pairs=latent,
    )
    method = config.get("topk_method") or "noaux_tc"  # greedy: the best experts, whatever their group
    if routed and method not in ("noaux_tc", "greedy") and int(config.get("n_group") or 0) > 1:
        raise ModelFileError(f"{folder.name}: specrun cannot draft with this model's MTP layer: its experts' "
                             f"{method} routing (it reads DeepSeek-V3's noaux_tc)", "use another method with this model")
    layout = dataclasses.replace(
        layout, **folder_rope_scaling(folder.name, layout.arch, config, layout.rope_dims, layout.rope_theta),
        **_expert_groups(folder.name, int(config.get("n_group") or 0) if method == "noaux_tc" else 0,
                         int(config.get("topk_group") or 0), layout, "check the folder's config.json"))
    own_embed, own_head = f"{mtp}.embed_tokens.weight", f"{mtp}.shared_head.head.weight"
    embed_names = (own_embed, "model.embed_tokens.weight")
    head_names = (own_head, "lm_head.weight", *embed_names)
    deferred = tables(reader, {"embed": embed_names, "lm_head": head_names}, (vocab, hidden), reads)
    lacking = "model.embed_tokens.weight" if "embed" not in deferred else "lm_head.weight" if not (
        own_head in reader or "lm_head.weight" in reader or config.get("tie_word_embeddings")) else None
    if lacking:
        raise ModelFileError(f"{folder.name} says it carries MTP layers but lacks {lacking}",
                             "download the model again with its MTP layers, or use another method")
    target_arrays = {"embed"} if own_embed not in reader else set()
    if own_head not in reader and ("lm_head.weight" in reader or own_embed not in reader):
        target_arrays.add("lm_head")  # the target's head, or its embedding tied to it
    head_norm = tensor(f"{mtp}.shared_head.norm.weight", (hidden,), required=False)
    if head_norm is None:
        head_norm = tensor("model.norm.weight", (hidden,))
    q_width, kv_width = heads_count * head_dim, kv_count * head_dim
    attention = f"{mtp}.self_attn"
    arrays = dict(
        head_norm=head_norm,
        enorm=tensor(f"{mtp}.enorm.weight", (hidden,)), hnorm=tensor(f"{mtp}.hnorm.weight", (hidden,)),
        eh_proj=tensor(f"{mtp}.eh_proj.weight", (hidden, 2 * hidden)),
        attn_norm=tensor(f"{mtp}.input_layernorm.weight", (hidden,)),
        post_norm=tensor(f"{mtp}.post_attention_layernorm.weight", (hidden,)),
    )
    if latent:
        arrays.update(_latent_folder_arrays(reader, tensor, attention, config, hidden))
    else:
        arrays.update(
            q_proj=tensor(f"{attention}.q_proj.weight", (q_width, hidden)),
            k_proj=tensor(f"{attention}.k_proj.weight", (kv_width, hidden)),
            v_proj=tensor(f"{attention}.v_proj.weight", (kv_width, hidden)),
            o_proj=tensor(f"{attention}.o_proj.weight", (hidden, q_width)),
            q_bias=tensor(f"{attention}.q_proj.bias", (q_width,), required=False),
            k_bias=tensor(f"{attention}.k_proj.bias", (kv_width,), required=False),
            v_bias=tensor(f"{attention}.v_proj.bias", (kv_width,), required=False),
            q_norm=tensor(f"{attention}.q_norm.weight", (head_dim,), required=False),
            k_norm=tensor(f"{attention}.k_norm.weight", (head_dim,), required=False),
        )
    if layout.experts:
        width = int(config["moe_intermediate_size"])
        shared = int(config.get("n_shared_experts") or 0) * width
        arrays.update(
            router=tensor(f"{mtp}.mlp.gate.weight", (experts, hidden)),
            router_bias=tensor(f"{mtp}.mlp.gate.e_score_correction_bias", (experts,), required=False),
            **{f"{part}_exps": tensor(f"{mtp}.mlp.switch_mlp.{part}_proj.weight",
                                      (experts, hidden, width) if part == "down" else (experts, width, hidden))
               if f"{mtp}.mlp.switch_mlp.{part}_proj.weight" in reader else
               _stacked(reader, [f"{mtp}.mlp.experts.{e}.{part}_proj.weight" for e in range(experts)],
                        (hidden, width) if part == "down" else (width, hidden))
               for part in ("gate", "up", "down")},
        )
        if shared:
            arrays.update({f"{part}_proj": tensor(f"{mtp}.mlp.shared_experts.{part}_proj.weight",
                                                  (hidden, shared) if part == "down" else (shared, hidden))
                           for part in ("gate", "up", "down")})
    else:
        width = int(config["intermediate_size"])
        arrays.update({f"{part}_proj": tensor(f"{mtp}.mlp.{part}_proj.weight",
                                              (hidden, width) if part == "down" else (width, hidden))
                       for part in ("gate", "up", "down")})
    heads_config = HeadsConfig(kind="mtp", num_heads=depth, num_layers=count, hidden_size=hidden, vocab_size=vocab,
                               draft_vocab_size=vocab, target_name=folder.name, target_layers=trunk)
    return MtpHeads(heads_config, layout, _held(arrays, deferred), target_arrays=frozenset(target_arrays))


def _rope_config(config: dict) -> dict:
    """The config's rotary settings: ``rope_scaling`` (transformers 4) or ``rope_parameters`` (5)."""
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(config.get(key), dict):
            return config[key]
    return {}


def _folder_fields(config: dict) -> dict:
    """A DeepSeek-style folder's config as the GGUF keys _refuse_latent_unread and
    _refuse_routing_unread read."""
    return {"deepseek2.attention.key_length_mla": (config.get("qk_nope_head_dim") or 0) + (config.get("qk_rope_head_dim") or 0),
            "deepseek2.attention.value_length_mla": config.get("v_head_dim"),
            "deepseek2.attention.kv_lora_rank": config.get("kv_lora_rank"),
            "deepseek2.attention.q_lora_rank": config.get("q_lora_rank")}


def _latent_folder_arrays(reader: FolderTensors, tensor, attention: str, config: dict, hidden: int) -> dict:
    """The latent attention's arrays under a checkpoint's names (q_a_proj, q_a_layernorm, q_b_proj,
    kv_a_proj_with_mqa, kv_a_layernorm, o_proj, and kv_b_proj split per head into k_b, transposed,
    and v_b as llama.cpp's converter splits it), or mlx-lm's (embed_q and unembed_out: k_b, v_b)."""
    heads = int(config["num_attention_heads"])
    nope, rope, v_width = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"]), int(config["v_head_dim"])
    q_rank, kv_rank = int(config["q_lora_rank"]), int(config["kv_lora_rank"])
    arrays = dict(
        q_a=tensor(f"{attention}.q_a_proj.weight", (q_rank, hidden)),
        q_a_norm=tensor(f"{attention}.q_a_layernorm.weight", (q_rank,)),
        q_b=tensor(f"{attention}.q_b_proj.weight", (heads * (nope + rope), q_rank)),
        kv_a=tensor(f"{attention}.kv_a_proj_with_mqa.weight", (kv_rank + rope, hidden)),
        kv_a_norm=tensor(f"{attention}.kv_a_layernorm.weight", (kv_rank,)),
        o_proj=tensor(f"{attention}.o_proj.weight", (hidden, heads * v_width)),
    )
    if f"{attention}.embed_q.weight" in reader:
        return dict(arrays, k_b=tensor(f"{attention}.embed_q.weight", (heads, kv_rank, nope)),
                    v_b=tensor(f"{attention}.unembed_out.weight", (heads, v_width, kv_rank)))
    both = reader.first((f"{attention}.kv_b_proj.weight",), (heads * (nope + v_width), kv_rank))
    both = both.reshape(heads, nope + v_width, kv_rank)
    return dict(arrays, k_b=np.ascontiguousarray(both[:, :nope].transpose(0, 2, 1)),
                v_b=np.ascontiguousarray(both[:, nope:]))


def _matrix(reader: FolderTensors, names: tuple[str, ...], shape: tuple[int, ...], required: bool = True,
            rows: tuple[int, int] | None = None) -> Deferred | None:
    """The first of ``names`` the folder holds (a matrix: ``rows`` of it where given), checked now
    and read when first asked for, as FolderTensors.first would refuse or pass over it."""
    name = next((name for name in names if name in reader), None)
    if name is None:
        return reader.first(names, shape, required)  # None, or the one-line refusal
    stored_bytes = reader.check(name, shape, values=True)
    if rows is None:
        return deferred_matrix(lambda: reader.stored(name, shape), stored_bytes)
    start, stop = rows
    return deferred_matrix(lambda: reader.stored(name, shape).rows(start, stop),
                           stored_bytes * (stop - start) // shape[-2])


def _stacked(reader: FolderTensors, names: list[str], shape: tuple[int, ...]) -> Deferred:
    """Matrices held one by one (experts) as one (len(names), *shape) array, checked now (one
    line naming the first the folder lacks)."""
    for name in names:
        if name not in reader:
            reader.first((name,), shape)  # the one-line refusal
    stored_bytes = sum(reader.check(name, shape, values=True) for name in names)
    return deferred_matrix(lambda: StoredMatrix.stack([reader.stored(name, shape) for name in names]), stored_bytes)


def _held(arrays: dict, tables: dict[str, Deferred]) -> DeferredArrays:
    """The layer's ``arrays`` (read already, or a Deferred; None: absent) beside the tables."""
    ready = {name: value for name, value in arrays.items() if isinstance(value, np.ndarray)}
    deferred = {name: value for name, value in arrays.items() if isinstance(value, Deferred)}
    return DeferredArrays(ready, {**tables, **deferred})


def _quant_method(config: dict) -> str:
    method = config.get("quantization_config")
    return str(method.get("quant_method", "unknown")) if isinstance(method, dict) else "unknown"


def tensor_files(folder: Path) -> dict[str, Path]:
    """Where each tensor of the folder's safetensors lives: model.safetensors.index.json's map for
    a sharded checkpoint, else every name in model.safetensors (and in the MTP file beside it)."""
    from specrun.heads.files import TensorsFile

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            mapping = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            found = {name: folder / shard for name, shard in mapping.items()}
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ModelFileError(f"{index} cannot be read ({error})", "download the model again") from None
    else:
        single = folder / "model.safetensors"
        found = dict.fromkeys(TensorsFile(single).tensors, single)
    beside = folder / QWEN_MTP_FILE  # a converted Qwen3-Next's MTP layers, kept where mlx-lm does not load them
    if beside.is_file():
        found.update(dict.fromkeys(TensorsFile(beside).tensors, beside))
    return found


def _qwen_folder(folder: Path, config: dict, arch: str, reader: FolderTensors, count: int, depth: int,
                 index: int = 0, reads: dict | None = None) -> MtpHeads:
    """The MTP layer of Qwen3.5, Qwen3.5-MoE or Qwen3-Next (``arch`` qwen35, qwen35moe, qwen3next)
    as their checkpoints hold it (``mtp.*``, or under ``model.`` or mlx-lm's ``language_model.``:
    the names llama.cpp's converter maps: fc the eh_proj, pre_fc_norm_embedding and
    pre_fc_norm_hidden the enorm and hnorm, norm the head norm, layers.0 a gated-attention block
    whose MLP is dense, or routed experts beside a gated shared expert), its norms zero-centred
    (stored as weight - 1) as the model's own are; the target's embedding and head under the text
    model's names (Hugging Face's, or mlx-lm's once converted)."""
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])

    def mtp(name: str, shape: tuple[int, ...], norm: bool = False, rows: tuple[int, int] | None = None):
        names = tuple(f"{prefix}mtp.{name}" for prefix in _QWEN_PREFIXES)
        if len(shape) > 1 and not norm:
            return _matrix(reader, names, shape, rows=rows)
        values = reader.first(names, shape)
        return values + 1.0 if norm else values

    heads_count = int(config["num_attention_heads"])
    kv_count = int(config.get("num_key_value_heads", heads_count))
    head_dim = int(config.get("head_dim") or hidden // heads_count)
    rope = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    partial = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25)))
    experts = int(config.get("num_experts") or 0) if arch != "qwen35" else 0
    layout = MtpLayout(
        arch=arch, num_attention_heads=heads_count, num_key_value_heads=kv_count, head_dim=head_dim,
        rope_dims=int(head_dim * partial), rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 1e7))),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), gated_attention=True,
        experts=experts, experts_used=int(config.get("num_experts_per_tok") or 0) if experts else 0,
        gating="softmax" if experts else "sigmoid", normalize_weights=bool(experts),  # as llama.cpp routes them
    )
    layout = dataclasses.replace(layout, **folder_rope_scaling(folder.name, arch, config, layout.rope_dims,
                                                               layout.rope_theta))
    q_width, kv_width = heads_count * head_dim, kv_count * head_dim
    block = f"layers.{index}"  # the fc and the norms around the layers are the module's, shared
    embed_names = ("model.language_model.embed_tokens.weight", "language_model.model.embed_tokens.weight",
                   "model.embed_tokens.weight")
    head_names = embed_names if config.get("tie_word_embeddings") else ("lm_head.weight", "language_model.lm_head.weight")
    deferred = tables(reader, {"embed": embed_names, "lm_head": head_names}, (vocab, hidden), reads)
    for key, names in (("embed", embed_names), ("lm_head", head_names)):
        if key not in deferred:
            raise ModelFileError(f"{folder.name} says it carries MTP layers but lacks {names[0]}",
                                 "download the model again with its MTP layers, or use another method")
    arrays = dict(
        eh_proj=mtp("fc.weight", (hidden, 2 * hidden)),
        enorm=mtp("pre_fc_norm_embedding.weight", (hidden,), norm=True),
        hnorm=mtp("pre_fc_norm_hidden.weight", (hidden,), norm=True),
        head_norm=mtp("norm.weight", (hidden,), norm=True),
        attn_norm=mtp(f"{block}.input_layernorm.weight", (hidden,), norm=True),
        post_norm=mtp(f"{block}.post_attention_layernorm.weight", (hidden,), norm=True),
        q_proj=mtp(f"{block}.self_attn.q_proj.weight", (2 * q_width, hidden)),
        k_proj=mtp(f"{block}.self_attn.k_proj.weight", (kv_width, hidden)),
        v_proj=mtp(f"{block}.self_attn.v_proj.weight", (kv_width, hidden)),
        o_proj=mtp(f"{block}.self_attn.o_proj.weight", (hidden, q_width)),
        q_norm=mtp(f"{block}.self_attn.q_norm.weight", (head_dim,), norm=True),
        k_norm=mtp(f"{block}.self_attn.k_norm.weight", (head_dim,), norm=True),
    )
    mlp = f"{block}.mlp"
    if experts:
        width, shared = int(config["moe_intermediate_size"]), int(config.get("shared_expert_intermediate_size") or 0)
        arrays.update(router=mtp(f"{mlp}.gate.weight", (experts, hidden)),
                      **_qwen_experts(mtp, reader, mlp, experts, width, hidden))
        if shared:
            arrays.update({f"{part}_proj": mtp(f"{mlp}.shared_expert.{part}_proj.weight",
                                               (hidden, shared) if part == "down" else (shared, hidden))
                           for part in ("gate", "up", "down")},
                          shared_gate=reader.first(tuple(f"{prefix}mtp.{mlp}.shared_expert_gate.weight"
                                                         for prefix in _QWEN_PREFIXES), (1, hidden)).reshape(hidden))
    else:
        width = int(config["intermediate_size"])
        arrays.update({f"{part}_proj": mtp(f"{mlp}.{part}_proj.weight",
                                           (hidden, width) if part == "down" else (width, hidden))
                       for part in ("gate", "up", "down")})
    heads_config = HeadsConfig(kind="mtp", num_heads=depth, num_layers=count, hidden_size=hidden, vocab_size=vocab,
                               draft_vocab_size=vocab, target_name=folder.name,
                               target_layers=int(config["num_hidden_layers"]))
    return MtpHeads(heads_config, layout, _held(arrays, deferred), target_arrays=frozenset(deferred))


def _qwen_experts(mtp, reader: FolderTensors, mlp: str, experts: int, width: int, hidden: int) -> dict:
    """The routed experts' gate_exps, up_exps (E, F, H) and down_exps (E, H, F): stored fused
    (``experts.gate_up_proj`` (E, 2F, H), gates first, and ``experts.down_proj``, as Qwen3.5-MoE's
    checkpoints hold them), stacked (mlx-lm's ``switch_mlp``) or one by one
    (``experts.N.gate_proj.weight``..., Qwen3-Next's)."""
    def held(name: str) -> bool:
        return any(f"{prefix}mtp.{name}" in reader for prefix in _QWEN_PREFIXES)

    fused = next((name for name in (f"{mlp}.experts.gate_up_proj", f"{mlp}.experts.gate_up_proj.weight")
                  if held(name)), None)
    if fused is not None:
        down = f"{mlp}.experts.down_proj" + ("" if fused.endswith("proj") else ".weight")
        return dict(gate_exps=mtp(fused, (experts, 2 * width, hidden), rows=(0, width)),
                    up_exps=mtp(fused, (experts, 2 * width, hidden), rows=(width, 2 * width)),
                    down_exps=mtp(down, (experts, hidden, width)))
    if held(f"{mlp}.switch_mlp.gate_proj.weight"):
        return {f"{part}_exps": mtp(f"{mlp}.switch_mlp.{part}_proj.weight",
                                    (experts, hidden, width) if part == "down" else (experts, width, hidden))
                for part in ("gate", "up", "down")}

    def one_by_one(part: str) -> list[str]:  # each expert's name as the folder holds it, refused where none
        names = [tuple(f"{prefix}mtp.{mlp}.experts.{e}.{part}_proj.weight" for prefix in _QWEN_PREFIXES)
                 for e in range(experts)]
        return [next((name for name in these if name in reader), None) or reader.first(these, (0,)) for these in names]

    return {f"{part}_exps": _stacked(reader, one_by_one(part), (hidden, width) if part == "down" else (width, hidden))
            for part in ("gate", "up", "down")}
