"""The files of self-drafting heads (Medusa, Hydra, EAGLE, EAGLE-3): each kind's reader and
writer, and the check that heads fit a target. The arrays they fill are heads/<kind>.py's.

Heads draft from the target's own hidden state (the output head's input, after the final norm,
``Backend.hidden_support``) instead of a second model. A hidden state h_p at position p is what
the target's own head turns into its guess for token p + 1.

Medusa (Cai et al. 2024; specrun.heads.medusa): head i (0-based) reads h_p alone and guesses
token p + 2 + i. Each head is ``num_layers`` residual blocks, h <- h + silu(W h + b), then a
projection over the draft vocabulary. Heads here project over a draft vocabulary (``d2t``: the
target id of each draft id; None where it is the target's whole vocabulary), as EAGLE-3 does,
since a projection over a 50k vocabulary costs as much as a small target's pass on a CPU.

EAGLE (specrun.heads.eagle): one decoder layer over the feature and the next token's embedding,
drafting one token at a time from its own predicted features.

Hydra (specrun.heads.hydra): Medusa's heads, each also reading the embeddings of the tokens
drafted before its own, so drafts depend on the ones before them.

Files. specrun's own heads (Medusa, Hydra or EAGLE) are ``NAME.safetensors`` (float16 weights, loaded as float32) beside
``NAME.json`` (what the heads are, the target they were made for, how they were trained, and the
SHA-256 of the tensors file, so a torn save or a swapped file is caught). Published heads are read
as their projects write them: a Medusa-1 folder (FasterDecoding/Medusa) and an EAGLE-3 draft folder
(SpecForge's export, as SGLang serves it). Every problem with a file is one ModelFileError line
naming the file; nothing half-checked is returned.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrun.errors import ModelFileError
from specrun.fileio import MiB, is_special, json_problem, read_limited, write_atomically
from specrun.heads.config import HeadsConfig
from specrun.heads.eagle import PARAMETER_NAMES, EagleHeads, EagleLayout, eagle_shapes
from specrun.heads.eagle3 import Eagle3Heads, check_rope_scaling
from specrun.heads.hydra import HydraHeads, hydra_shapes
from specrun.heads.kinds import FILE_KINDS, kind_of
from specrun.heads.medusa import MedusaHeads



HEADS_FORMAT = "specrun-heads"
HEADS_VERSION = 1
# SpecForge's default --ttt-length (specforge/config/schema.py): the depth EAGLE-3 heads are
# trained to, which their files do not record.
EAGLE3_TRAINED_DEPTH = 7

# Far above any real model: a count past these is a corrupt or hostile file, refused before
# anything that size is allocated.
MAX_HEADS = 64
MAX_LAYERS = 1024
MAX_HIDDEN_SIZE = 1 << 16
MAX_VOCAB_SIZE = 1 << 22
MAX_ATTENTION_HEADS = 1024
MAX_CONFIG_BYTES = MiB
_MAX_HEADER_BYTES = 100 * MiB  # safetensors' own limit on its JSON header
_FLOAT16_MAX = float(np.finfo(np.float16).max)

_AGAIN = "download or save the heads again"
_PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl")
_PUBLISHED_NAMES = ("config.json", "medusa_lm_head.safetensors", "model.safetensors")
_SPECRUN_KEYS = frozenset(
    ("format", "version", "kind", "num_heads", "num_layers", "hidden_size", "vocab_size")
    + ("draft_vocab_size", "target", "training", "tensors_sha256")
)
_TARGET_KEYS = frozenset(("name", "vocabulary", "num_layers"))
_LAYOUT_KEYS = frozenset(("num_attention_heads", "head_dim", "intermediate_size", "window", "rope_theta", "rms_norm_eps"))
_HYDRA_LAYOUT_KEYS = frozenset(("embedding_size",))
_WITH_LAYOUT = ("eagle", "hydra")  # the kinds whose config says more of their shape, in "layout"
# EAGLE heads' tensors in specrun's files, in heads.eagle.PARAMETER_NAMES' order.
EAGLE_TENSORS = tuple(f"eagle.{name}" for name in (
    "embed", "fc", "fc_bias", "attn_norm", "q_proj", "k_proj", "v_proj", "o_proj",
    "mlp_norm", "gate_proj", "up_proj", "down_proj", "lm_head",
))


def _refuse(path: Path, problem: str, fix: str = _AGAIN) -> ModelFileError:
    return ModelFileError(f"{path} {problem}", fix)


# ---------------------------------------------------------------------------------------------
# specrun's own format


def _medusa_tensors(heads: MedusaHeads, path: Path) -> tuple[dict[str, np.ndarray], None]:
    config = heads.config
    if not len(heads.blocks) == len(heads.lm_heads) == config.num_heads:
        raise ValueError("save_heads writes medusa heads whose config counts their blocks and projections")
    tensors = {}
    for i, blocks in enumerate(heads.blocks):
        for j, (weight, bias) in enumerate(blocks):
            tensors[f"heads.{i}.blocks.{j}.weight"] = _half(weight, path)
            tensors[f"heads.{i}.blocks.{j}.bias"] = _half(bias, path)
    if all(projection is heads.lm_heads[0] for projection in heads.lm_heads):
        tensors["lm_head.weight"] = _half(heads.lm_heads[0], path)
    else:
        for i, projection in enumerate(heads.lm_heads):
            tensors[f"heads.{i}.lm_head.weight"] = _half(projection, path)
    return tensors, None


def _hydra_tensors(heads: HydraHeads, path: Path) -> tuple[dict[str, np.ndarray], dict]:
    tensors = {f"hydra.{name}": _half(array, path) for name, array in heads.arrays().items()}
    return tensors, {"embedding_size": heads.embedding_size}


def _eagle_tensors(heads: EagleHeads, path: Path) -> tuple[dict[str, np.ndarray], dict]:
    tensors = {name: _half(array, path) for name, array in zip(EAGLE_TENSORS, heads.arrays())}
    return tensors, heads.layout.to_dict()


def save_heads(heads: MedusaHeads | EagleHeads | HydraHeads | Eagle3Heads, path: Path,
               metadata: dict | None = None) -> None:
    """Write ``heads`` to ``path`` (a .safetensors file) and its config to ``path.with_suffix(".json")``;
    EAGLE-3 heads to ``path`` as a folder (:func:`save_eagle3`).

    Weights are stored as float16; a projection every head shares (the same array object) is
    stored once. ``metadata`` (free-form, JSON-serialisable: steps, loss, held-out acceptance)
    becomes the config's "training"; None keeps ``heads.config.training``. Both files are
    written atomically, the tensors first: a failure leaves the previous pair or a pair whose
    checksum disagrees, which :func:`load_heads` refuses. Raises ModelFileError for weights
    float16 cannot hold (NaN, infinite, beyond 65504) or a file that cannot be written.
    """
    from safetensors.numpy import save

    path = Path(path)
    kind = kind_of(heads)
    if kind.stored == "folder":
        FOLDER_WRITERS[kind.name](heads, path, metadata)
        return
    if path.suffix != ".safetensors":
        raise ValueError(f"heads are saved to a .safetensors path, got {path}")
    config = heads.config
    tensors, layout = TENSOR_WRITERS[kind_of(heads).name](heads, path)
    if heads.d2t is not None:
        tensors["d2t"] = np.ascontiguousarray(heads.d2t, dtype=np.int64)
    payload = save(tensors, metadata={"format": HEADS_FORMAT})
    document = {
        "format": HEADS_FORMAT,
        "version": HEADS_VERSION,
        "kind": config.kind,
        "num_heads": config.num_heads,
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target": {
            "name": config.target_name,
            "vocabulary": config.target_vocabulary,
            "num_layers": config.target_layers,
        },
        "training": dict(config.training if metadata is None else metadata),
        "tensors_sha256": hashlib.sha256(payload).hexdigest(),
    }
    if layout is not None:
        document["layout"] = layout
    # Serialised before anything is written, so metadata JSON cannot hold fails with no file touched.
    text = json.dumps(document, indent=2, allow_nan=False) + "\n"
    write_atomically(path, payload, "heads file", error=ModelFileError)
    write_atomically(path.with_suffix(".json"), text, "heads config", error=ModelFileError)


def save_eagle3(heads: Eagle3Heads, folder: Path, metadata: dict | None = None) -> None:
    """Write EAGLE-3 ``heads`` to ``folder`` as SpecForge exports them for SGLang (config.json and
    model.safetensors in float16: ``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t`` as offsets
    beside ``t2d``; the embedding only where the heads hold their own), plus a "specrun" entry in the
    config: the target they were made for, the depth trained, ``metadata`` as "training" (None: the
    config's) and the tensors' checksum. Tensors first, then the config, each atomically: a failure
    leaves the previous pair or one whose checksum disagrees, which :func:`load_heads` refuses."""
    from safetensors.numpy import save

    folder = Path(folder)
    config = heads.config
    arrays = {key: getattr(heads, name) for name, key in _EAGLE3_LAYER.items()}
    arrays |= {"fc.weight": heads.fc, "norm.weight": heads.norm, "lm_head.weight": heads.lm_head}
    if heads.embed_tokens is not None:
        arrays["embed_tokens.weight"] = heads.embed_tokens
    tensors = {key: _half(array, folder) for key, array in arrays.items()}
    if heads.d2t is not None:
        tensors["d2t"] = np.ascontiguousarray(heads.d2t - np.arange(len(heads.d2t)), dtype=np.int64)
        tensors["t2d"] = np.isin(np.arange(config.vocab_size), heads.d2t)
    payload = save(tensors, metadata={"format": "pt"})
    settings = {
        "architectures": [EAGLE3_ARCHITECTURE], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": heads.draft_hidden_size, "intermediate_size": heads.intermediate_size,
        "num_attention_heads": heads.num_attention_heads, "num_key_value_heads": heads.num_key_value_heads,
        "head_dim": heads.head_dim, "num_hidden_layers": 1, "rms_norm_eps": heads.rms_norm_eps,
        "rope_theta": heads.rope_theta, "rope_scaling": heads.rope_scaling, "tie_word_embeddings": False,
        "torch_dtype": "float16", "vocab_size": config.vocab_size, "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.hidden_size, "norm_before_residual": heads.norm_before_residual,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(heads.aux_layer_ids), "use_aux_hidden_state": True},
        **({"max_position_embeddings": heads.max_position_embeddings} if heads.max_position_embeddings else {}),
        "specrun": {
            "num_heads": config.num_heads,
            "target": {"name": config.target_name, "vocabulary": config.target_vocabulary,
                       "num_layers": config.target_layers},
            "training": dict(config.training if metadata is None else metadata),
            "tensors_sha256": hashlib.sha256(payload).hexdigest(),
        },
    }
    text = json.dumps(settings, indent=2, allow_nan=False) + "\n"
    folder.mkdir(parents=True, exist_ok=True)  # once nothing can refuse the heads: no empty folder left behind
    write_atomically(folder / "model.safetensors", payload, "heads file", error=ModelFileError)
    write_atomically(folder / "config.json", text, "heads config", error=ModelFileError)


def _specrun_record(settings: dict, path: Path, stored: _TensorsFile) -> dict:
    """The "specrun" entry save_eagle3 writes into an EAGLE-3 config, checked (and the tensors'
    checksum against it); {} where the folder is another project's."""
    record = settings.get("specrun")
    if record is None:
        return {}
    target = record.get("target") if isinstance(record, dict) else None
    if (not isinstance(record, dict) or set(record) != {"num_heads", "target", "training", "tensors_sha256"}
            or not isinstance(target, dict) or set(target) != _TARGET_KEYS
            or not isinstance(target["name"], str) or not isinstance(target["vocabulary"], str)
            or not _whole_numbers([target["num_layers"]]) or not isinstance(record["training"], dict)):
        raise _refuse(path, "has a malformed specrun entry")
    _count(record, "num_heads", path, 1, MAX_HEADS)
    if stored.sha256() != record["tensors_sha256"]:
        problem = f"does not match {stored.path.name} (a torn save, or one of them was changed)"
        raise _refuse(path, problem, "save the heads again")
    return record


def _half(weights: np.ndarray, path: Path) -> np.ndarray:
    """``weights`` as contiguous float16, refused when float16 would not hold them."""
    weights = np.asarray(weights, dtype=np.float32)
    if not np.isfinite(weights).all() or float(np.abs(weights).max(initial=0.0)) > _FLOAT16_MAX:
        raise ModelFileError(
            f"cannot save heads to {path}: they hold NaN, infinite or beyond-float16 weights",
            "train them again (a lower learning rate usually helps)",
        )
    return np.ascontiguousarray(weights.astype(np.float16))


def _load_specrun(tensors_path: Path) -> MedusaHeads | EagleHeads | HydraHeads:
    config_path = tensors_path.with_suffix(".json")
    if not config_path.exists():
        fix = "keep the .json saved with it, or save the heads again"
        raise _refuse(tensors_path, f"has no config beside it ({config_path.name})", fix)
    stored = _TensorsFile(tensors_path)
    settings = _read_json(config_path)
    config, checksum = _specrun_config(settings, config_path)
    if stored.sha256() != checksum:
        problem = f"does not match {config_path.name} (a torn save, or one of them was changed)"
        raise _refuse(tensors_path, problem, "save the heads again")
    return TENSOR_READERS[config.kind](stored, config, settings, config_path)


def _load_specrun_medusa(stored: _TensorsFile, config: HeadsConfig, settings: dict, config_path: Path) -> MedusaHeads:
    shared = "lm_head.weight" in stored.tensors
    projections = ["lm_head.weight"] if shared else [f"heads.{i}.lm_head.weight" for i in range(config.num_heads)]
    _check_hidden_size(stored, projections[0], config.hidden_size, config_path)
    blocks = _block_keys(config, "heads.{i}.blocks.{j}.weight", "heads.{i}.blocks.{j}.bias")
    stored.refuse_others(_flat(blocks) + projections + (["d2t"] if "d2t" in stored.tensors else []))
    lm_heads = [stored.floats(name, (config.draft_vocab_size, config.hidden_size)) for name in projections]
    return MedusaHeads(
        config=config,
        blocks=_medusa_blocks(stored, blocks, config.hidden_size),
        lm_heads=tuple(lm_heads * config.num_heads if shared else lm_heads),
        d2t=_draft_ids(stored, config.draft_vocab_size, config.vocab_size, offsets=False),
    )


def _specrun_config(settings: dict, path: Path) -> tuple[HeadsConfig, str]:
    """The HeadsConfig a specrun heads config describes, and the tensors file's checksum."""
    if settings.get("format") != HEADS_FORMAT:
        raise _refuse(path, f"is not a specrun heads config (its format is {settings.get('format')!r})")
    if settings.get("version") != HEADS_VERSION:
        raise _refuse(
            path,
            f"is of heads format version {settings.get('version')!r}; this specrun reads version {HEADS_VERSION}",
            "upgrade specrun, or save the heads again with this one",
        )
    kind = settings.get("kind")
    if kind not in FILE_KINDS:
        raise _refuse(path, f"holds heads of kind {kind!r}; specrun's own heads files hold {', '.join(FILE_KINDS)} heads")
    expected = _SPECRUN_KEYS | {"layout"} if kind in _WITH_LAYOUT else _SPECRUN_KEYS
    unknown, missing = sorted(set(settings) - expected), sorted(expected - set(settings))
    if unknown or missing:
        problem = f"has unknown keys ({', '.join(unknown)})" if unknown else f"lacks the keys {', '.join(missing)}"
        raise _refuse(path, problem)
    target = settings["target"]
    if not isinstance(target, dict) or set(target) != _TARGET_KEYS:
        raise _refuse(path, f"has a malformed target (expected the keys {', '.join(sorted(_TARGET_KEYS))})")
    if not isinstance(target["name"], str) or not isinstance(target["vocabulary"], str):
        raise _refuse(path, "has a malformed target (its name and vocabulary are not text)")
    if not isinstance(settings["training"], dict):
        raise _refuse(path, "has a malformed training record (not a JSON object)")
    checksum = settings["tensors_sha256"]
    if not isinstance(checksum, str) or not re.fullmatch(r"[0-9a-f]{64}", checksum):
        raise _refuse(path, "has a malformed tensors_sha256")
    vocab_size = _count(settings, "vocab_size", path, 1, MAX_VOCAB_SIZE)
    config = HeadsConfig(
        kind=kind,
        num_heads=_count(settings, "num_heads", path, 1, MAX_HEADS),
        num_layers=_count(settings, "num_layers", path, 0, MAX_LAYERS),
        hidden_size=_count(settings, "hidden_size", path, 1, MAX_HIDDEN_SIZE),
        vocab_size=vocab_size,
        draft_vocab_size=_count(settings, "draft_vocab_size", path, 1, vocab_size),
        target_name=target["name"],
        target_vocabulary=target["vocabulary"],
        target_layers=_count(target, "num_layers", path, 0, MAX_LAYERS),
        training=settings["training"],
    )
    return config, checksum


def _eagle_layout(settings: dict, path: Path):
    """The EagleLayout an eagle heads config gives, each count checked."""
    layout = settings["layout"]
    if not isinstance(layout, dict) or set(layout) != _LAYOUT_KEYS:
        raise _refuse(path, f"has a malformed layout (expected the keys {', '.join(sorted(_LAYOUT_KEYS))})")
    head_dim = _count(layout, "head_dim", path, 2, MAX_HIDDEN_SIZE)
    if head_dim % 2:
        raise _refuse(path, f"says head_dim is {head_dim}, expected an even number (rotary embeddings turn pairs)")
    return EagleLayout(
        num_attention_heads=_count(layout, "num_attention_heads", path, 1, MAX_ATTENTION_HEADS),
        head_dim=head_dim,
        intermediate_size=_count(layout, "intermediate_size", path, 1, 16 * MAX_HIDDEN_SIZE),
        window=_count(layout, "window", path, 1, 1 << 20),
        rope_theta=_positive(layout, "rope_theta", path, 10000.0),
        rms_norm_eps=_positive(layout, "rms_norm_eps", path, 1e-6),
    )


def _load_specrun_eagle(stored: _TensorsFile, config: HeadsConfig, settings: dict, config_path: Path) -> EagleHeads:
    layout = _eagle_layout(settings, config_path)
    if config.num_layers != 1:
        raise _refuse(config_path, f"says num_layers is {config.num_layers}; specrun's EAGLE heads have one layer")
    _check_hidden_size(stored, "eagle.fc_bias", config.hidden_size, config_path)
    stored.refuse_others(list(EAGLE_TENSORS) + (["d2t"] if "d2t" in stored.tensors else []))
    shapes = eagle_shapes(config, layout)
    arrays = {name: stored.floats(key, shapes[name]) for name, key in zip(PARAMETER_NAMES, EAGLE_TENSORS)}
    d2t = _draft_ids(stored, config.draft_vocab_size, config.vocab_size, offsets=False)
    return EagleHeads(config, layout, d2t=d2t, **arrays)


def _load_specrun_hydra(stored: _TensorsFile, config: HeadsConfig, settings: dict, config_path: Path) -> HydraHeads:
    layout = settings["layout"]
    if not isinstance(layout, dict) or set(layout) != _HYDRA_LAYOUT_KEYS:
        raise _refuse(config_path, "has a malformed layout (expected the key embedding_size)")
    embedding_size = _count(layout, "embedding_size", config_path, 1, MAX_HIDDEN_SIZE)
    if config.num_layers < 1:
        raise _refuse(config_path, "says num_layers is 0; a Hydra head has at least its first layer")
    _check_hidden_size(stored, "hydra.0.lm_head", config.hidden_size, config_path)
    shapes = hydra_shapes(config, embedding_size)
    stored.refuse_others([f"hydra.{name}" for name in shapes] + (["d2t"] if "d2t" in stored.tensors else []))
    arrays = {name: stored.floats(f"hydra.{name}", shape) for name, shape in shapes.items()}
    d2t = _draft_ids(stored, config.draft_vocab_size, config.vocab_size, offsets=False)
    return HydraHeads.from_arrays(config, arrays, d2t)


# ---------------------------------------------------------------------------------------------
# Published formats


def _load_medusa1(folder: Path) -> MedusaHeads:
    """A Medusa-1 folder as FasterDecoding/Medusa writes it.

    medusa/model/medusa_model.py builds ``medusa_head = nn.ModuleList([nn.Sequential(
    *([ResBlock(H)] * medusa_num_layers), nn.Linear(H, V, bias=False))])``, ResBlock holding
    ``self.linear = nn.Linear(H, H)`` (x + silu(linear(x))), and medusa/train/train_legacy.py
    saves ``medusa_head.state_dict()`` with safetensors' save_file to medusa_lm_head.safetensors
    (older releases: torch.save to medusa_lm_head.pt) beside MedusaConfig's config.json
    (medusa_num_heads, medusa_num_layers, base_model_name_or_path). So the keys are
    ``{i}.{j}.linear.weight`` (H, H) and ``{i}.{j}.linear.bias`` (H,) for j < L, and
    ``{i}.{L}.weight`` (V, H), head i's own projection over the whole vocabulary.
    """
    config_path, tensors_path = folder / "config.json", folder / "medusa_lm_head.safetensors"
    if not tensors_path.exists():
        problem = "has a Medusa config.json but no medusa_lm_head.safetensors"
        raise _refuse(folder, problem, "download the heads file published with it")
    if not config_path.exists():
        problem = "has medusa_lm_head.safetensors but no config.json"
        raise _refuse(folder, problem, "download the config.json published with it")
    settings = _read_json(config_path)
    num_layers = _count(settings, "medusa_num_layers", config_path, 0, MAX_LAYERS)
    said_heads = _count(settings, "medusa_num_heads", config_path, 1, MAX_HEADS)
    stored = _TensorsFile(tensors_path)
    # The tensors decide when they hold more heads than the config says: Medusa's own loader
    # overrides the uploaded configs' count ("TODO: fix the uploaded config (only include 2 heads)").
    in_file = 0
    while f"{in_file}.{num_layers}.weight" in stored.tensors:
        in_file += 1
    num_heads = max(said_heads, in_file)
    if num_heads > MAX_HEADS:
        raise _refuse(tensors_path, f"holds more than {MAX_HEADS} heads")
    projection = stored.tensors.get(f"0.{num_layers}.weight")
    if projection is None or len(projection.shape) != 2:
        problem = f"lacks the tensor 0.{num_layers}.weight (head 0's projection after {num_layers} blocks)"
        raise _refuse(tensors_path, problem)
    vocab_size, hidden_size = projection.shape
    for key, found in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
        if key in settings and settings[key] != found:
            problem = f"holds tensors of {key.replace('_', ' ')} {found}, {config_path.name} says {settings[key]}"
            raise _refuse(tensors_path, problem)
    if not (1 <= hidden_size <= MAX_HIDDEN_SIZE and 1 <= vocab_size <= MAX_VOCAB_SIZE):
        raise _refuse(tensors_path, f"holds a projection of absurd shape {list(projection.shape)}")
    config = HeadsConfig(
        kind="medusa",
        num_heads=num_heads,
        num_layers=num_layers,
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        draft_vocab_size=vocab_size,
        target_name=_text(settings.get("base_model_name_or_path")),
    )
    projections = [f"{i}.{num_layers}.weight" for i in range(num_heads)]
    blocks = _block_keys(config, "{i}.{j}.linear.weight", "{i}.{j}.linear.bias")
    stored.refuse_others(_flat(blocks) + projections)
    return MedusaHeads(
        config=config,
        blocks=_medusa_blocks(stored, blocks, hidden_size),
        lm_heads=tuple(stored.floats(name, (vocab_size, hidden_size)) for name in projections),
    )


# The keys SpecForge's LlamaForCausalLMEagle3 (specforge/modeling/draft/llama3_eagle.py) gives its
# draft, which specforge/export/to_sglang.py writes unrenamed (embeddings dropped) with
# save_pretrained, and SGLang's models/llama_eagle3.py reads: midlayer.* is one LlamaDecoderLayer
# whose q/k/v projections read 2D (embedding and fused state side by side), hidden_norm the extra
# RMSNorm on the fused state; d2t holds offsets (SGLang: hot_token_id = d2t + arange(Vd)).
_EAGLE3_LAYER = {
    "q_proj": "midlayer.self_attn.q_proj.weight",
    "k_proj": "midlayer.self_attn.k_proj.weight",
    "v_proj": "midlayer.self_attn.v_proj.weight",
    "o_proj": "midlayer.self_attn.o_proj.weight",
    "gate_proj": "midlayer.mlp.gate_proj.weight",
    "up_proj": "midlayer.mlp.up_proj.weight",
    "down_proj": "midlayer.mlp.down_proj.weight",
    "input_layernorm": "midlayer.input_layernorm.weight",
    "hidden_norm": "midlayer.hidden_norm.weight",
    "post_attention_layernorm": "midlayer.post_attention_layernorm.weight",
}
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


def _load_eagle3(folder: Path) -> Eagle3Heads:
    """An EAGLE-3 draft folder (config.json, model.safetensors) as SpecForge exports it for SGLang."""

    config_path, tensors_path = folder / "config.json", folder / "model.safetensors"
    settings = _read_json(config_path)
    if not tensors_path.exists():
        if (folder / "model.safetensors.index.json").exists():
            raise _refuse(folder, "holds its EAGLE-3 weights in shards", "merge them into one model.safetensors")
        problem = "has an EAGLE-3 config.json but no model.safetensors"
        raise _refuse(folder, problem, "download the weights published with it")
    draft_hidden = _count(settings, "hidden_size", config_path, 1, MAX_HIDDEN_SIZE)
    num_heads = _count(settings, "num_attention_heads", config_path, 1, MAX_ATTENTION_HEADS)
    num_kv_heads = _count(settings, "num_key_value_heads", config_path, 1, num_heads)
    if num_heads % num_kv_heads:
        problem = f"has {num_heads} attention heads, not a multiple of its {num_kv_heads} key-value heads"
        raise _refuse(config_path, problem)
    head_dim = _count(settings, "head_dim", config_path, 1, MAX_HIDDEN_SIZE, draft_hidden // num_heads)
    if head_dim < 1:
        raise _refuse(config_path, f"has more attention heads ({num_heads}) than hidden units ({draft_hidden})")
    intermediate = _count(settings, "intermediate_size", config_path, 1, 16 * MAX_HIDDEN_SIZE)
    vocab_size = _count(settings, "vocab_size", config_path, 1, MAX_VOCAB_SIZE)
    draft_vocab = _count(settings, "draft_vocab_size", config_path, 1, vocab_size, vocab_size)
    if settings.get("num_hidden_layers", 1) != 1:
        problem = f"has {settings['num_hidden_layers']!r} decoder layers; EAGLE-3 drafts have one"
        raise _refuse(config_path, problem)
    target_hidden = _count(settings, "target_hidden_size", config_path, 1, MAX_HIDDEN_SIZE, draft_hidden)
    aux_layer_ids = _aux_layer_ids(settings, config_path)
    rope_problem = check_rope_scaling(settings.get("rope_scaling"))
    if rope_problem:
        raise _refuse(config_path, rope_problem)
    norm_before_residual = settings.get("norm_before_residual", False)
    if not isinstance(norm_before_residual, bool):
        raise _refuse(config_path, f"says norm_before_residual is {norm_before_residual!r}, not true or false")
    width = len(aux_layer_ids or (0, 0, 0)) * target_hidden
    stored = _TensorsFile(tensors_path)
    _check_hidden_size(stored, "norm.weight", draft_hidden, config_path)
    layer_shapes = {
        "q_proj": (num_heads * head_dim, 2 * draft_hidden),
        "k_proj": (num_kv_heads * head_dim, 2 * draft_hidden),
        "v_proj": (num_kv_heads * head_dim, 2 * draft_hidden),
        "o_proj": (draft_hidden, num_heads * head_dim),
        "gate_proj": (intermediate, draft_hidden),
        "up_proj": (intermediate, draft_hidden),
        "down_proj": (draft_hidden, intermediate),
        "input_layernorm": (draft_hidden,),
        "hidden_norm": (draft_hidden,),
        "post_attention_layernorm": (draft_hidden,),
    }
    optional = [name for name in ("d2t", "t2d", "embed_tokens.weight") if name in stored.tensors]
    stored.refuse_others(["fc.weight", "norm.weight", "lm_head.weight", *_EAGLE3_LAYER.values(), *optional])
    has_embedding = "embed_tokens.weight" in stored.tensors
    record = _specrun_record(settings, config_path, stored)
    target = record.get("target", {})
    return Eagle3Heads(
        config=HeadsConfig(
            kind="eagle",
            num_heads=record.get("num_heads", EAGLE3_TRAINED_DEPTH),
            num_layers=1,
            hidden_size=target_hidden,
            vocab_size=vocab_size,
            draft_vocab_size=draft_vocab,
            target_name=target.get("name", ""),
            target_vocabulary=target.get("vocabulary", ""),
            target_layers=target.get("num_layers", 0),
            training=record.get("training", {}),
        ),
        draft_hidden_size=draft_hidden,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        rms_norm_eps=_positive(settings, "rms_norm_eps", config_path, 1e-6),
        rope_theta=_positive(settings, "rope_theta", config_path, 10000.0),
        aux_layer_ids=aux_layer_ids,
        fc=stored.floats("fc.weight", (draft_hidden, width)),
        **{field_name: stored.floats(_EAGLE3_LAYER[field_name], shape) for field_name, shape in layer_shapes.items()},
        norm=stored.floats("norm.weight", (draft_hidden,)),
        lm_head=stored.floats("lm_head.weight", (draft_vocab, draft_hidden)),
        d2t=_draft_ids(stored, draft_vocab, vocab_size, offsets=True),
        embed_tokens=stored.halves("embed_tokens.weight", (vocab_size, draft_hidden)) if has_embedding else None,
        norm_before_residual=norm_before_residual,
        rope_scaling=settings.get("rope_scaling"),
        max_position_embeddings=_count(settings, "max_position_embeddings", config_path, 1, 1 << 30, 0),
    )


def _aux_layer_ids(settings: dict, path: Path) -> tuple[int, ...]:
    """The target layers fc reads: SGLang's eagle_config.eagle_aux_hidden_state_layer_ids, or the
    same key at the top level (where vLLM's speculators configs put it); () when neither says."""
    eagle_config = settings.get("eagle_config") or {}
    if not isinstance(eagle_config, dict):
        raise _refuse(path, "has a malformed eagle_config (not a JSON object)")
    key = "eagle_aux_hidden_state_layer_ids"
    ids = eagle_config.get(key) or settings.get(key) or []
    if not _whole_numbers(ids) or len(ids) > 16 or max(ids, default=0) >= MAX_LAYERS or len(set(ids)) != len(ids):
        raise _refuse(path, f"names malformed eagle_aux_hidden_state_layer_ids ({ids!r})")
    return tuple(ids)


# ---------------------------------------------------------------------------------------------
# Loading, whatever the format


def is_specrun_heads_file(path: Path) -> bool:
    """Is ``path`` one of a heads pair specrun wrote: the .json config (its "format"), or the
    .safetensors file (its header's metadata)? False for anything else, or unreadable (a FIFO is
    not opened: reading one nobody writes would wait for good)."""
    path = Path(path)
    if is_special(path):
        return False
    try:
        with open(path, "rb") as file:
            if path.suffix == ".json":
                config = json.loads(file.read(16 * MiB))
                return isinstance(config, dict) and config.get("format") == HEADS_FORMAT
            size = int.from_bytes(file.read(8), "little")
            header = json.loads(file.read(size)) if 0 < size <= 16 * MiB else None
        metadata = header.get("__metadata__") if isinstance(header, dict) else None
        return isinstance(metadata, dict) and metadata.get("format") == HEADS_FORMAT
    except (OSError, ValueError, RecursionError):
        return False


def load_heads(path: Path) -> MedusaHeads | EagleHeads | HydraHeads | Eagle3Heads:
    """The heads at ``path``: specrun's own (MedusaHeads, HydraHeads or EagleHeads: the .safetensors file, its
    .json, or a folder holding one such pair), a published Medusa-1 folder (MedusaHeads) or an EAGLE-3 draft folder
    (Eagle3Heads); a file inside a published folder names the folder.

    Raises ModelFileError, one line naming the file and the problem, for a missing, truncated
    or corrupt file, a missing or malformed config, absurd counts, missing, unexpected or
    misshapen tensors, NaN or infinite weights, draft ids out of range or repeated, a PyTorch
    pickle (.pt, .bin) and an unknown format version.
    """
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path} does not exist", "check the path")
    if path.is_dir():
        return _load_folder(path)
    if path.suffix in _PICKLE_SUFFIXES:
        raise _pickle_refusal(path)
    if path.suffix == ".safetensors" and path.with_suffix(".json").exists():
        return _load_specrun(path)
    if path.name in _PUBLISHED_NAMES:
        return _load_folder(path.parent)
    if path.suffix in (".safetensors", ".json"):
        return _load_specrun(path.with_suffix(".safetensors"))
    raise _refuse(path, "is not a heads file", "name a .safetensors heads file, its .json, or a folder of heads")


def _load_folder(folder: Path) -> MedusaHeads | EagleHeads | HydraHeads | Eagle3Heads:
    """Published heads by their files, else the one specrun heads pair in the folder (which may be
    the target's own model folder, its config.json and model.safetensors beside the pair)."""
    if (folder / "medusa_lm_head.safetensors").exists():
        return _load_medusa1(folder)
    pairs = sorted(p for p in folder.glob("*.safetensors") if p.with_suffix(".json").is_file())
    if len(pairs) > 1:
        raise _refuse(folder, f"holds several heads files ({', '.join(p.name for p in pairs)})", "name one of them")
    if pairs:
        return _load_specrun(pairs[0])
    for pickled in ("medusa_lm_head.pt", "pytorch_model.bin"):
        if (folder / pickled).exists() and not (folder / "model.safetensors").exists():
            raise _pickle_refusal(folder / pickled)
    if (folder / "config.json").exists():
        settings = _read_json(folder / "config.json")
        if "medusa_num_heads" in settings:
            return _load_medusa1(folder)
        architectures = settings.get("architectures")
        named = architectures if isinstance(architectures, list) else []
        published = [FOLDER_ARCHITECTURES[name] for name in named if isinstance(name, str) and name in FOLDER_ARCHITECTURES]
        if published:
            return FOLDER_READERS[published[0]](folder)
        raise _refuse(
            folder / "config.json",
            f"describes {architectures!r}, neither Medusa heads nor an EAGLE-3 draft ({EAGLE3_ARCHITECTURE})",
            "name a folder of Medusa or EAGLE-3 heads, or specrun's own heads file",
        )
    raise _refuse(
        folder,
        "holds no heads (NAME.safetensors with NAME.json, medusa_lm_head.safetensors, or an EAGLE-3 config.json)",
        "name the heads file or the folder the heads were published in",
    )


def _pickle_refusal(path: Path) -> ModelFileError:
    return ModelFileError(
        f"{path} is a PyTorch pickle, which specrun does not load (unpickling can run code)",
        "convert it to safetensors (torch.load, then safetensors.torch.save_file) and name that",
    )


def check_heads_for_target(
    heads: MedusaHeads | EagleHeads | HydraHeads | Eagle3Heads,
    *,
    hidden_size: int,
    vocab_size: int,
    num_layers: int = 0,
    vocabulary: str | tuple[str, ...] = "",
    path: Path,
) -> None:
    """Raise ModelFileError (one line naming ``path``, both sides and the fix) when ``heads`` were
    made for another target: hidden size, vocabulary size, vocabulary (when both are known),
    layer count (when both are known), or target layers an EAGLE-3 head reads that it lacks."""
    config = heads.config
    fix = "use heads made for this target, or train heads for it"

    def mismatch(made_for: str, target_has: str) -> ModelFileError:
        return ModelFileError(f"{path} was made for {made_for}, the target has {target_has}", fix)

    if config.hidden_size != hidden_size:
        raise mismatch(f"hidden size {config.hidden_size}", str(hidden_size))
    if config.vocab_size != vocab_size:
        raise mismatch(f"a vocabulary of {config.vocab_size} tokens", f"{vocab_size}")
    accepted = (vocabulary,) if isinstance(vocabulary, str) else tuple(vocabulary)  # the fingerprint and older ones
    if config.target_vocabulary and any(accepted) and config.target_vocabulary not in accepted:
        raise mismatch(f"the vocabulary {config.target_vocabulary}", f"{accepted[0]}")
    if config.target_layers and num_layers and config.target_layers != num_layers:
        raise mismatch(f"a target of {config.target_layers} layers", f"{num_layers}")
    deepest_read = max(getattr(heads, "aux_layer_ids", ()), default=0)  # EAGLE-3's
    if num_layers and deepest_read >= num_layers:
        raise mismatch(f"a target with a layer {deepest_read} to read", f"{num_layers} layers")


# ---------------------------------------------------------------------------------------------
# Reading files


def _block_keys(config: HeadsConfig, weight: str, bias: str) -> list[list[tuple[str, str]]]:
    """The (weight, bias) keys of head i's block j, spelled by patterns with {i} and {j}."""
    return [
        [(weight.format(i=i, j=j), bias.format(i=i, j=j)) for j in range(config.num_layers)]
        for i in range(config.num_heads)
    ]


def _flat(keys: list[list[tuple[str, str]]]) -> list[str]:
    return [key for head in keys for pair in head for key in pair]


def _medusa_blocks(stored: _TensorsFile, keys: list[list[tuple[str, str]]], size: int) -> tuple:
    """Every head's residual blocks: weight (size, size) and bias (size,) under ``keys``."""
    return tuple(
        tuple((stored.floats(weight, (size, size)), stored.floats(bias, (size,))) for weight, bias in head)
        for head in keys
    )


def _draft_ids(stored: _TensorsFile, draft_vocab: int, vocab_size: int, *, offsets: bool) -> np.ndarray | None:
    """The target id of each draft id from the tensor d2t (``offsets``: stored as target - draft,
    as EAGLE-3 files hold it), checked in range and distinct, and against t2d where there is one;
    None where there is no draft vocabulary."""
    path = stored.path
    if "d2t" not in stored.tensors:
        if draft_vocab < vocab_size:
            raise _refuse(path, f"lacks the tensor d2t (the target ids of its {draft_vocab} draft ids)")
        return None
    target_ids = stored.ints("d2t", (draft_vocab,))
    if offsets:
        target_ids = target_ids + np.arange(draft_vocab, dtype=np.int64)
    outside = np.flatnonzero((target_ids < 0) | (target_ids >= vocab_size))
    if outside.size:
        draft_id = int(outside[0])
        target_id = int(target_ids[draft_id])
        problem = f"maps draft id {draft_id} to target id {target_id}, outside the vocabulary of {vocab_size}"
        raise _refuse(path, problem)
    values, counts = np.unique(target_ids, return_counts=True)
    if (counts > 1).any():
        raise _refuse(path, f"maps several draft ids to the target id {int(values[counts > 1][0])}")
    if "t2d" in stored.tensors:
        in_draft = stored.bools("t2d", (vocab_size,))
        if int(in_draft.sum()) != draft_vocab or not in_draft[target_ids].all():
            raise _refuse(path, "has a t2d that disagrees with its d2t")
    return target_ids


def _check_hidden_size(stored: _TensorsFile, name: str, hidden_size: int, config_path: Path) -> None:
    """Say which side is which when the config's hidden size is not the tensors' (read off ``name``)."""
    entry = stored.tensors.get(name)
    if entry is None:
        raise _refuse(stored.path, f"lacks the tensor {name}")
    if entry.shape and entry.shape[-1] != hidden_size:
        problem = f"holds tensors of hidden size {entry.shape[-1]}, {config_path.name} says {hidden_size}"
        raise _refuse(stored.path, problem)


def _read_json(path: Path) -> dict:
    data = read_limited(path, MAX_CONFIG_BYTES, "heads config", _AGAIN, error=ModelFileError)
    try:
        settings = json.loads(data)
    except (ValueError, RecursionError) as exc:  # decoding, syntax, 4300-digit numbers; nesting
        raise _refuse(path, f"is not valid JSON ({json_problem(exc)})") from exc
    if not isinstance(settings, dict):
        raise _refuse(path, "is not a JSON object")
    return settings


def _count(settings: dict, key: str, path: Path, low: int, high: int, default: int | None = None) -> int:
    """``settings[key]`` as a whole number from ``low`` to ``high``, or the file refused; a key that
    is absent or null is ``default`` where there is one."""
    value = settings.get(key)
    if value is None and default is not None:
        return default
    if key not in settings:
        raise _refuse(path, f"does not say {key}")
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _refuse(path, f"says {key} is {value!r}, expected a whole number from {low} to {high}")
    return value


def _positive(settings: dict, key: str, path: Path, default: float) -> float:
    value = settings.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise _refuse(path, f"says {key} is {value!r}, expected a positive number")
    return float(value)


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


@dataclass(frozen=True)
class _StoredTensor:
    dtype: str
    shape: tuple[int, ...]
    start: int  # byte offsets in the file
    end: int


# Little-endian, as safetensors stores them. numpy has no bfloat16: BF16 is read as its 16 bits.
_STORED_DTYPES = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "BF16": "<u2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U8": "u1",
    "U32": "<u4",  # the packed words of a matrix mlx-lm quantized (a model folder's, modelkit/folder_tensors.py)
    "BOOL": "u1",
}
_FLOATS, _INTS = ("F64", "F32", "F16", "BF16"), ("I64", "I32", "I16", "I8", "U8")


class _TensorsFile:
    """A safetensors file whose header is checked (every tensor inside the file, the data covered
    exactly once) before any tensor is read. Read here rather than through safetensors.numpy:
    published heads are mostly bfloat16, which numpy cannot hold, and a memory map reads only
    the tensors asked for."""

    def __init__(self, path: Path) -> None:
        self.path = path
        size = _regular_file_size(path)
        try:
            with open(path, "rb") as stream:
                header_size = int.from_bytes(stream.read(8), "little")
                if size < 8 or header_size > min(_MAX_HEADER_BYTES, size - 8):
                    raise _refuse(path, f"is cut short or not a safetensors file ({size} bytes, no complete header)")
                header_bytes = stream.read(header_size)
            self._data = np.memmap(path, dtype=np.uint8, mode="r", shape=(size,))
        except OSError as exc:
            raise _refuse(path, f"cannot be read ({exc.strerror or exc})", "check its permissions") from exc
        try:
            header = json.loads(header_bytes)
        except (ValueError, RecursionError) as exc:
            raise _refuse(path, "is corrupt or not a safetensors file (its header is not JSON)") from exc
        if not isinstance(header, dict):
            raise _refuse(path, "is corrupt or not a safetensors file (its header is not a JSON object)")
        header.pop("__metadata__", None)
        data_start = 8 + header_size
        self.tensors = {name: self._entry(name, entry, data_start) for name, entry in header.items()}
        covered = data_start
        for entry in sorted(self.tensors.values(), key=lambda e: (e.start, e.end)):
            if entry.start != covered:
                raise _refuse(path, "is corrupt (its tensors overlap or leave gaps)")
            covered = entry.end
        if covered > size:
            raise _refuse(path, f"is cut short ({size} bytes, its header needs {covered})")
        if covered < size:
            raise _refuse(path, f"is corrupt ({size - covered} stray bytes after its last tensor)")

    def _entry(self, name: str, entry: object, data_start: int) -> _StoredTensor:
        if isinstance(entry, dict):
            dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
            if dtype in _STORED_DTYPES and _whole_numbers(shape) and _whole_numbers(offsets) and len(offsets) == 2:
                begin, end = offsets
                if end - begin == math.prod(shape) * np.dtype(_STORED_DTYPES[dtype]).itemsize:
                    return _StoredTensor(dtype, tuple(shape), data_start + begin, data_start + end)
        raise _refuse(self.path, f"is corrupt (its header entry for {name} is malformed)")

    def sha256(self) -> str:
        return hashlib.sha256(self._data).hexdigest()

    def refuse_others(self, expected: list[str]) -> None:
        """Refuse a file holding tensors besides ``expected`` (another format, or another layout)."""
        others = sorted(set(self.tensors) - set(expected))
        if others:
            more = f" and {len(others) - 1} more" if len(others) > 1 else ""
            raise _refuse(self.path, f"holds a tensor this format does not have ({others[0]}{more})")

    def _raw(self, name: str, shape: tuple[int, ...], dtypes: tuple[str, ...], kind: str) -> tuple[str, np.ndarray]:
        """The stored dtype of ``name`` and its values as stored (a view of the file)."""
        entry = self.tensors.get(name)
        if entry is None:
            raise _refuse(self.path, f"lacks the tensor {name}")
        if entry.dtype not in dtypes:
            raise _refuse(self.path, f"holds {name} as {entry.dtype}, not {kind}")
        if entry.shape != shape:
            raise _refuse(self.path, f"holds {name} of shape {list(entry.shape)}, expected {list(shape)}")
        return entry.dtype, self._data[entry.start : entry.end].view(_STORED_DTYPES[entry.dtype]).reshape(shape)

    def floats(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor ``name`` as float32, refused when missing, misshapen, not floating point or not finite."""
        dtype, raw = self._raw(name, shape, _FLOATS, "floating point")
        if dtype == "BF16":
            values = (np.array(raw, dtype=np.uint32) << 16).view(np.float32)
        else:
            values = np.array(raw, dtype=np.float32)
        if not np.isfinite(values).all():
            raise _refuse(self.path, f"holds NaN or infinite weights in {name}", "train or download the heads again")
        return values

    def float_view(self, name: str, shape: tuple[int, ...]) -> tuple[str, np.ndarray]:
        """The stored dtype of the floating-point tensor ``name`` and its values as stored (a view
        of the file: BF16 as its 16 bits), refused as ``floats`` refuses but for its values."""
        return self._raw(name, shape, _FLOATS, "floating point")

    def halves(self, name: str, shape: tuple[int, ...], rows: int = 4096) -> np.ndarray:
        """The tensor ``name`` as float16, converted ``rows`` at a time (a large table, read a few
        rows a step, at half float32's memory and without a float32 copy of it whole); refused as
        ``floats`` refuses, and where float16 cannot hold a value."""
        dtype, raw = self._raw(name, shape, _FLOATS, "floating point")
        values = np.empty(shape, np.float16)
        for start in range(0, shape[0], rows):
            part = raw[start : start + rows]
            part = (np.array(part, dtype=np.uint32) << 16).view(np.float32) if dtype == "BF16" else part
            with np.errstate(over="ignore"):
                values[start : start + rows] = part
        if not np.isfinite(values).all():
            problem = f"holds NaN, infinite or beyond-float16 weights in {name}"
            raise _refuse(self.path, problem, "train or download the heads again")
        return values

    def words(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The packed 32-bit words of a quantized matrix ``name`` as stored (a view of the file)."""
        return self._raw(name, shape, ("U32",), "packed 32-bit words")[1]

    def ints(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        return np.array(self._raw(name, shape, _INTS, "integers")[1], dtype=np.int64)

    def bools(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        return np.array(self._raw(name, shape, ("BOOL",), "booleans")[1] != 0)


TensorsFile = _TensorsFile  # what readers of other layouts (a model's own MTP layers: modelkit/mtp.py) read through


def _whole_numbers(values: object) -> bool:
    """A JSON list of non-negative whole numbers (not booleans)."""
    return isinstance(values, list) and all(type(value) is int and value >= 0 for value in values)


def _regular_file_size(path: Path) -> int:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ModelFileError(f"{path} does not exist", "check the path") from None
    except OSError as exc:
        raise _refuse(path, f"cannot be read ({exc.strerror or exc})", "check its permissions") from exc
    if not stat.S_ISREG(info.st_mode):
        raise _refuse(path, "is not a regular file", "name the heads file itself")
    return info.st_size


# Every kind's reader and writer (heads.kinds.KINDS): specrun's own files by the tensors of each
# kind in them, published folders whole.
TENSOR_WRITERS = {"medusa": _medusa_tensors, "hydra": _hydra_tensors, "eagle": _eagle_tensors}
TENSOR_READERS = {"medusa": _load_specrun_medusa, "hydra": _load_specrun_hydra, "eagle": _load_specrun_eagle}
FOLDER_WRITERS = {"eagle3": save_eagle3}
FOLDER_READERS = {"eagle3": _load_eagle3}
FOLDER_ARCHITECTURES = {EAGLE3_ARCHITECTURE: "eagle3"}  # the kind a published folder holds, by its config
