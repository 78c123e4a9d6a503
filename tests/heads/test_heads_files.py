"""Files of self-drafting heads (issue 29): specrun's own format round trip, the published Medusa-1
and EAGLE-3 layouts written the way those projects write them, and one line for every bad file."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from specrun.errors import ModelFileError
from specrun.heads.eagle3 import Eagle3Heads
from specrun.heads.config import HeadsConfig, default_aux_layer_ids
from specrun.heads.files import EAGLE3_TRAINED_DEPTH, check_heads_for_target, load_heads, save_heads
from specrun.heads.medusa import MedusaHeads

HIDDEN, VOCAB, DRAFT_VOCAB = 64, 512, 128


def medusa_heads(
    num_heads: int = 3,
    num_layers: int = 1,
    hidden: int = HIDDEN,
    vocab: int = VOCAB,
    draft_vocab: int | None = DRAFT_VOCAB,
    shared: bool = True,
    seed: int = 0,
) -> MedusaHeads:
    """Random heads; ``draft_vocab`` None projects over the whole vocabulary."""
    rng = np.random.default_rng(seed)
    rows = vocab if draft_vocab is None else draft_vocab

    def weights(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.05, shape).astype(np.float32)

    projection = weights(rows, hidden)
    return MedusaHeads(
        config=HeadsConfig(
            kind="medusa",
            num_heads=num_heads,
            num_layers=num_layers,
            hidden_size=hidden,
            vocab_size=vocab,
            draft_vocab_size=rows,
            target_name="demo-target",
            target_vocabulary=f"{vocab}:abc",
            target_layers=6,
        ),
        blocks=tuple(
            tuple((weights(hidden, hidden), weights(hidden)) for _ in range(num_layers)) for _ in range(num_heads)
        ),
        lm_heads=tuple(projection if shared else weights(rows, hidden) for _ in range(num_heads)),
        d2t=None if draft_vocab is None else np.sort(rng.choice(vocab, rows, replace=False)).astype(np.int64),
    )


def as_half(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).astype(np.float32)


def one_line(excinfo: pytest.ExceptionInfo[ModelFileError], *fragments: str) -> str:
    """The error's line, checked to be one line holding every fragment."""
    line = excinfo.value.one_line()
    assert "\n" not in line
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    return line


# ---------------------------------------------------------------------------------------------
# specrun's own format


def test_round_trip_keeps_weights_within_float16_rounding_and_the_shared_projection(tmp_path):
    heads = medusa_heads(num_layers=2)
    path = tmp_path / "heads.safetensors"
    save_heads(heads, path, metadata={"steps": 300, "loss": 2.5, "heldout_acceptance": [0.6, 0.4, 0.2]})

    loaded = load_heads(path)
    assert isinstance(loaded, MedusaHeads)
    training = {"steps": 300, "loss": 2.5, "heldout_acceptance": [0.6, 0.4, 0.2]}
    assert loaded.config == dataclasses.replace(heads.config, training=training)
    for loaded_head, head in zip(loaded.blocks, heads.blocks, strict=True):
        for (weight, bias), (saved_weight, saved_bias) in zip(loaded_head, head, strict=True):
            assert weight.dtype == np.float32
            np.testing.assert_array_equal(weight, as_half(saved_weight))
            np.testing.assert_array_equal(bias, as_half(saved_bias))
    np.testing.assert_array_equal(loaded.lm_heads[0], as_half(heads.lm_heads[0]))
    assert all(projection is loaded.lm_heads[0] for projection in loaded.lm_heads)
    np.testing.assert_array_equal(loaded.d2t, heads.d2t)

    from safetensors import safe_open

    with safe_open(str(path), "numpy") as stored:
        names = set(stored.keys())
    assert "lm_head.weight" in names and not any(name.endswith(".lm_head.weight") for name in names)
    config = json.loads(path.with_suffix(".json").read_text())
    assert config["format"] == "specrun-heads" and config["version"] == 1
    assert config["target"] == {"name": "demo-target", "vocabulary": f"{VOCAB}:abc", "num_layers": 6}


def test_heads_with_their_own_projections_keep_them_apart(tmp_path):
    heads = medusa_heads(shared=False, draft_vocab=None)
    save_heads(heads, tmp_path / "own.safetensors")
    loaded = load_heads(tmp_path / "own.json")  # the config's path names the pair too
    assert loaded.d2t is None
    assert loaded.lm_heads[0] is not loaded.lm_heads[1]
    for projection, saved in zip(loaded.lm_heads, heads.lm_heads, strict=True):
        np.testing.assert_array_equal(projection, as_half(saved))


def test_a_folder_with_one_heads_file_names_it(tmp_path):
    """Also a model folder: its config.json and model.safetensors are the target's, not heads."""
    save_heads(medusa_heads(), tmp_path / "heads.safetensors")
    save_file({"model.embed_tokens.weight": np.zeros((4, 4), np.float16)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert isinstance(load_heads(tmp_path), MedusaHeads)
    save_heads(medusa_heads(), tmp_path / "other.safetensors")
    with pytest.raises(ModelFileError) as excinfo:
        load_heads(tmp_path)
    one_line(excinfo, str(tmp_path), "several heads files", "heads.safetensors", "other.safetensors")


def test_demo_sized_heads_take_a_few_megabytes(tmp_path):
    """4 heads over SmolLM2's 384-wide hidden state and a 4096-token draft vocabulary: the shared
    projection stored once in float16 keeps the file at ~4 MB (each head its own: ~14 MB)."""
    heads = medusa_heads(num_heads=4, hidden=384, vocab=49152, draft_vocab=4096)
    path = tmp_path / "demo.safetensors"
    save_heads(heads, path)
    size = path.stat().st_size
    assert 3 * 2**20 < size < 6 * 2**20
    assert path.with_suffix(".json").stat().st_size < 4096


def test_weights_float16_cannot_hold_are_refused_before_anything_is_written(tmp_path):
    heads = medusa_heads()
    heads.blocks[1][0][0][3, 4] = 1e6
    with pytest.raises(ModelFileError) as excinfo:
        save_heads(heads, tmp_path / "heads.safetensors")
    one_line(excinfo, "heads.safetensors", "beyond-float16")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_save_leaves_the_previous_pair(tmp_path):
    path = tmp_path / "heads.safetensors"
    save_heads(medusa_heads(seed=1), path)
    before = path.read_bytes(), path.with_suffix(".json").read_text()
    with pytest.raises(TypeError):
        save_heads(medusa_heads(seed=2), path, metadata={"not json": object()})
    assert (path.read_bytes(), path.with_suffix(".json").read_text()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads.json", "heads.safetensors"]


def test_a_save_torn_between_its_two_files_is_refused(tmp_path, monkeypatch):
    """The tensors written, the config not (a full disk, a crash): the old config's checksum no
    longer matches, so the pair is refused instead of loading new weights under an old config."""
    from specrun.heads import files as heads_module

    path = tmp_path / "heads.safetensors"
    save_heads(medusa_heads(seed=1), path)
    written = heads_module.write_atomically

    def config_write_fails(target, data, *args, **kwargs):
        if Path(target).suffix == ".json":
            raise ModelFileError(f"cannot write the heads config {target}: No space left on device")
        return written(target, data, *args, **kwargs)

    monkeypatch.setattr(heads_module, "write_atomically", config_write_fails)
    with pytest.raises(ModelFileError):
        save_heads(medusa_heads(seed=2), path)
    with pytest.raises(ModelFileError) as excinfo:
        load_heads(path)
    one_line(excinfo, str(path), "does not match heads.json", "save the heads again")


# ---------------------------------------------------------------------------------------------
# Published formats, written the way their projects write them


def write_medusa1(folder: Path, num_heads: int = 3, num_layers: int = 1, dtype=np.float16, seed: int = 0) -> dict:
    """A Medusa-1 folder as FasterDecoding/Medusa's train_legacy.py leaves it: MedusaConfig's
    config.json, and medusa_head.state_dict() (ModuleList of Sequential(ResBlock..., Linear))
    saved with safetensors' save_file."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(num_heads):
        for j in range(num_layers):
            tensors[f"{i}.{j}.linear.weight"] = rng.normal(0, 0.05, (HIDDEN, HIDDEN)).astype(dtype)
            tensors[f"{i}.{j}.linear.bias"] = rng.normal(0, 0.05, HIDDEN).astype(dtype)
        tensors[f"{i}.{num_layers}.weight"] = rng.normal(0, 0.05, (VOCAB, HIDDEN)).astype(dtype)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "medusa_lm_head.safetensors"))
    config = {
        "base_model_name_or_path": "lmsys/vicuna-7b-v1.3",
        "medusa_num_heads": num_heads,
        "medusa_num_layers": num_layers,
        "transformers_version": "4.34.0",
        "version": "2",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return tensors


def test_medusa1_folder_loads_as_medusa_heads(tmp_path):
    tensors = write_medusa1(tmp_path / "medusa", num_heads=3, num_layers=2)
    heads = load_heads(tmp_path / "medusa")
    assert isinstance(heads, MedusaHeads)
    assert heads.config == HeadsConfig(
        kind="medusa",
        num_heads=3,
        num_layers=2,
        hidden_size=HIDDEN,
        vocab_size=VOCAB,
        draft_vocab_size=VOCAB,
        target_name="lmsys/vicuna-7b-v1.3",
    )
    assert heads.d2t is None
    np.testing.assert_array_equal(heads.blocks[2][1][0], tensors["2.1.linear.weight"].astype(np.float32))
    np.testing.assert_array_equal(heads.blocks[0][0][1], tensors["0.0.linear.bias"].astype(np.float32))
    np.testing.assert_array_equal(heads.lm_heads[1], tensors["1.2.weight"].astype(np.float32))
    # The files inside the folder name it too.
    assert load_heads(tmp_path / "medusa" / "medusa_lm_head.safetensors").config == heads.config
    assert load_heads(tmp_path / "medusa" / "config.json").config == heads.config


def test_medusa1_with_more_heads_than_its_config_says_loads_them_all(tmp_path):
    """Uploaded Medusa configs undercount (medusa_model.py: "fix the uploaded config (only include
    2 heads)"), and Medusa's loader takes every head in the file, as here."""
    write_medusa1(tmp_path, num_heads=5)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "medusa_num_heads": 2}))
    assert load_heads(tmp_path).config.num_heads == 5


def test_medusa1_in_bfloat16_with_its_base_models_sizes(tmp_path):
    """Heads trained in bfloat16, the config carrying the base model's sizes (as Medusa's
    MedusaModelABC configs do): the sizes agree with the tensors, so they load."""
    tensors = write_medusa1(tmp_path, dtype=np.float32)
    write_safetensors_bf16(tensors, tmp_path / "medusa_lm_head.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": HIDDEN, "vocab_size": VOCAB}))
    heads = load_heads(tmp_path)
    top_half = (tensors["2.1.weight"].view(np.uint32) & 0xFFFF0000).view(np.float32)
    np.testing.assert_array_equal(heads.lm_heads[2], top_half)


def write_safetensors_bf16(tensors: dict[str, np.ndarray], path: Path) -> None:
    """What torch writes for bfloat16 tensors (numpy has no bfloat16): the float32 bits' top half."""
    header, chunks, offset = {}, [], 0
    for name, values in tensors.items():
        if values.dtype == np.float32:
            data, dtype = (values.view(np.uint32) >> 16).astype("<u2").tobytes(), "BF16"
        else:
            data, dtype = values.tobytes(), {np.dtype(np.int64): "I64", np.dtype(np.bool_): "BOOL"}[values.dtype]
        header[name] = {"dtype": dtype, "shape": list(values.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(chunks))


EAGLE3_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "initializer_range": 0.02,
    "intermediate_size": 176,
    "max_position_embeddings": 2048,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 1,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "vocab_size": VOCAB,
    "draft_vocab_size": DRAFT_VOCAB,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 6], "use_aux_hidden_state": True},
}


def eagle3_tensors(seed: int = 0, embedding: bool = False) -> dict[str, np.ndarray]:
    """SpecForge's LlamaForCausalLMEagle3 state dict as its SGLang export writes it (embeddings
    dropped unless asked for): one midlayer, fc over three target hidden states, d2t offsets."""
    rng = np.random.default_rng(seed)

    def weights(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.05, shape).astype(np.float32)

    heads, kv_heads, head_dim, intermediate = 4, 2, HIDDEN // 4, 176
    used = np.sort(rng.choice(VOCAB, DRAFT_VOCAB, replace=False))  # SpecForge sorts its hot tokens
    tensors = {
        "fc.weight": weights(HIDDEN, 3 * HIDDEN),
        "midlayer.hidden_norm.weight": 1 + weights(HIDDEN),
        "midlayer.input_layernorm.weight": 1 + weights(HIDDEN),
        "midlayer.post_attention_layernorm.weight": 1 + weights(HIDDEN),
        "midlayer.self_attn.q_proj.weight": weights(heads * head_dim, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": weights(kv_heads * head_dim, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": weights(kv_heads * head_dim, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": weights(HIDDEN, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": weights(intermediate, HIDDEN),
        "midlayer.mlp.up_proj.weight": weights(intermediate, HIDDEN),
        "midlayer.mlp.down_proj.weight": weights(HIDDEN, intermediate),
        "norm.weight": 1 + weights(HIDDEN),
        "lm_head.weight": weights(DRAFT_VOCAB, HIDDEN),
        "d2t": (used - np.arange(DRAFT_VOCAB)).astype(np.int64),
        "t2d": np.isin(np.arange(VOCAB), used),
    }
    if embedding:
        tensors["embed_tokens.weight"] = weights(VOCAB, HIDDEN)
    return tensors


def write_eagle3(folder: Path, tensors: dict[str, np.ndarray], config: dict | None = None, bf16: bool = False) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(EAGLE3_CONFIG if config is None else config, indent=2))
    if bf16:
        write_safetensors_bf16(tensors, folder / "model.safetensors")
    else:
        halves = {name: values.astype(np.float16) if values.dtype == np.float32 else values
                  for name, values in tensors.items()}
        save_file(halves, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_eagle3_folder_loads_with_absolute_draft_ids(tmp_path):
    tensors = eagle3_tensors()
    write_eagle3(tmp_path, tensors)
    heads = load_heads(tmp_path)
    assert isinstance(heads, Eagle3Heads)
    assert heads.config == HeadsConfig(
        kind="eagle",
        num_heads=EAGLE3_TRAINED_DEPTH,
        num_layers=1,
        hidden_size=HIDDEN,
        vocab_size=VOCAB,
        draft_vocab_size=DRAFT_VOCAB,
    )
    assert (heads.num_attention_heads, heads.num_key_value_heads, heads.head_dim) == (4, 2, 16)
    assert (heads.intermediate_size, heads.rms_norm_eps, heads.rope_theta) == (176, 1e-05, 500000.0)
    assert heads.aux_layer_ids == (1, 3, 6)
    np.testing.assert_array_equal(heads.d2t, np.flatnonzero(tensors["t2d"]))
    np.testing.assert_array_equal(heads.q_proj, as_half(tensors["midlayer.self_attn.q_proj.weight"]))
    np.testing.assert_array_equal(heads.fc, as_half(tensors["fc.weight"]))
    np.testing.assert_array_equal(heads.hidden_norm, as_half(tensors["midlayer.hidden_norm.weight"]))
    assert heads.embed_tokens is None
    assert heads.lm_head.dtype == np.float32 and heads.lm_head.shape == (DRAFT_VOCAB, HIDDEN)


def test_eagle3_in_bfloat16_with_its_embedding(tmp_path):
    tensors = eagle3_tensors(embedding=True)
    write_eagle3(tmp_path, tensors, bf16=True)
    heads = load_heads(tmp_path / "model.safetensors")
    top_half = (tensors["lm_head.weight"].view(np.uint32) & 0xFFFF0000).view(np.float32)
    np.testing.assert_array_equal(heads.lm_head, top_half)
    assert heads.embed_tokens.shape == (VOCAB, HIDDEN) and heads.embed_tokens.dtype == np.float16  # half the memory
    embedding = (tensors["embed_tokens.weight"].view(np.uint32) & 0xFFFF0000).view(np.float32)
    np.testing.assert_array_equal(heads.embed_tokens, embedding.astype(np.float16))


def test_an_eagle3_embedding_float16_cannot_hold_is_refused(tmp_path):
    tensors = eagle3_tensors(embedding=True)
    tensors["embed_tokens.weight"][3, 5] = 1e6  # a bfloat16 value past float16's range
    write_eagle3(tmp_path, tensors, bf16=True)
    with pytest.raises(ModelFileError) as refused:
        load_heads(tmp_path)
    assert "holds NaN, infinite or beyond-float16 weights in embed_tokens.weight" in refused.value.one_line()


def test_eagle3_without_aux_ids_reads_the_default_layers_for_a_target():
    assert default_aux_layer_ids(30) == (1, 14, 26)


# ---------------------------------------------------------------------------------------------
# Bad files: one line naming the file and the problem, nothing loaded


def saved(tmp_path: Path, **kwargs) -> Path:
    path = tmp_path / "heads.safetensors"
    save_heads(medusa_heads(**kwargs), path)
    return path


def rewrite_config(path: Path, **changes) -> None:
    config_path = path.with_suffix(".json")
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))


def rewrite_tensors(path: Path, change) -> None:
    """Change the stored tensors (``change`` edits the dict) and re-seal the config's checksum, as a
    buggy writer that still finishes its save would."""
    import hashlib

    from safetensors.numpy import load_file

    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))
    rewrite_config(path, tensors_sha256=hashlib.sha256(path.read_bytes()).hexdigest())


def test_truncated_file(tmp_path):
    path = saved(tmp_path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ModelFileError) as excinfo:
        load_heads(path)
    one_line(excinfo, str(path), "is cut short")


@pytest.mark.parametrize(
    "contents", [b"", b"\x05\x00", b"not a safetensors file at all", b"\x10" + b"\x00" * 7 + b"{garbage" + b"!" * 8]
)
def test_corrupt_or_foreign_file(tmp_path, contents):
    path = saved(tmp_path)
    path.write_bytes(contents)
    with pytest.raises(ModelFileError) as excinfo:
        load_heads(path)
    line = one_line(excinfo, str(path))
    assert "cut short" in line or "corrupt" in line


def test_a_changed_byte_is_caught_by_the_checksum(tmp_path):
    path = saved(tmp_path)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFileError) as excinfo:
        load_heads(path)
    one_line(excinfo, str(path), "does not match heads.json", "save the heads again")


def test_missing_config(tmp_path):
    path = saved(tmp_path)
    path.with_suffix(".json").unlink()
    with pytest.raises(ModelFileError) as excinfo:
        load_heads(path)
    one_line(excinfo, str(path), "has no config beside it (heads.json)")


def test_missing_file(tmp_path):
    with pytest.raises(ModelFileError) as excinfo:
        load_heads(tmp_path / "nowhere.safetensors")
    one_line(excinfo, "nowhere.safetensors", "does not exist")


@pytest.mark.parametrize(
    ("changes", "fragments"),
    [
        ({"colour": "blue"}, ["has unknown keys (colour)"]),
        ({"version": 2}, ["format version 2", "this specrun reads version 1", "upgrade specrun"]),
        ({"format": "gguf"}, ["not a specrun heads config"]),
        ({"kind": "lookahead"}, ["kind 'lookahead'", "medusa, hydra, eagle heads"]),
        ({"kind": "hydra"}, ["lacks the keys layout"]),
        ({"kind": "eagle"}, ["lacks the keys layout"]),
        ({"num_heads": 0}, ["num_heads is 0"]),
        ({"num_heads": -3}, ["num_heads is -3"]),
        ({"num_heads": 10**9}, ["num_heads is 1000000000"]),
        ({"num_layers": 2.5}, ["num_layers is 2.5"]),
        ({"hidden_size": True}, ["hidden_size is True"]),
        ({"vocab_size": 1 << 40}, ["vocab_size is 1099511627776"]),
        ({"draft_vocab_size": VOCAB + 1}, [f"draft_vocab_size is {VOCAB + 1}"]),
        ({"target": {"name": "x"}}, ["malformed target"]),
        ({"training": [1, 2]}, ["malformed training record"]),
        ({"hidden_size": 32}, ["holds tensors of hidden size 64, heads.json says 32"]),
        ({"num_heads": 4}, ["lacks the tensor heads.3.blocks.0.weight"]),
        ({"num_layers": 0}, ["holds a tensor this format does not have (heads.0.blocks.0.bias and 5 more)"]),
        ({"draft_vocab_size": 100}, ["holds lm_head.weight of shape [128, 64], expected [100, 64]"]),
    ],
)
def test_bad_config(tmp_path, changes, fragments):
    path = saved(tmp_path)
    rewrite_config(path, **changes)
    with pytest.raises(ModelFileError) as excinfo:
        load_heads(path)
    line = one_line(excinfo, *fragments)
    assert "heads.json" in line or str(path) in line


@pytest.mark.parametrize(("text", "why"), [
    ("{'format': 'specrun-heads'", "Expecting property name"),
    ("[" * 100_000 + "]" * 100_000, "it nests too deeply"),  # was internal error: RecursionError
    ('{"format": "specrun-heads", "num_heads": 1' + "0" * 5000 + "}", "a number in it has thousands of digits"),
])
def test_config_that_is_not_json(tmp_path, text, why):
    path = saved(tmp_path)
    path.with_suffix(".json").write_text(text)
    with pytest.raises(ModelFileError) as excinfo:
        load_heads(path)
    one_line(excinfo, "heads.json", "is not valid JSON", why)


def nan_weight(tensors):
    tensors["heads.1.blocks.0.weight"][2, 2] = np.nan


def out_of_range(tensors):
    tensors["d2t"][5] = VOCAB + 7


def repeated(tensors):
    tensors["d2t"][9] = tensors["d2t"][8]


def dropped(tensors):
    del tensors["heads.2.blocks.0.bias"]


def misshapen(tensors):
    tensors["heads.0.blocks.0.bias"] = tensors["heads.0.blocks.0.bias"][:10]


def no_d2t(tensors):
    del tensors["d2t"]


def not_floats(tensors):
    tensors["lm_head.weight"] = tensors["lm_head.weight"].astype(np.int32)


def extra(tensors):
    tensors["heads.0.lm_head.weight"] = tensors["lm_head.weight"]


@pytest.mark.parametrize(
    ("change", "fragments"),
    [
        (nan_weight, ["NaN or infinite weights in heads.1.blocks.0.weight"]),
        (out_of_range, [f"maps draft id 5 to target id {VOCAB + 7}, outside the vocabulary of {VOCAB}"]),
        (repeated, ["maps several draft ids to the target id"]),
        (dropped, ["lacks the tensor heads.2.blocks.0.bias"]),
        (misshapen, ["holds heads.0.blocks.0.bias of shape [10], expected [64]"]),
        (no_d2t, ["lacks the tensor d2t"]),
        (not_floats, ["holds lm_head.weight as I32, not floating point"]),
        (extra, ["holds a tensor this format does not have (heads.0.lm_head.weight)"]),
    ],
)
def test_bad_tensors(tmp_path, change, fragments):
    path = saved(tmp_path)
    rewrite_tensors(path, change)
    with pytest.raises(ModelFileError) as excinfo:
        load_heads(path)
    one_line(excinfo, str(path), *fragments)


@pytest.mark.parametrize(
    ("name", "named"),
    [
        ("heads.pt", "heads.pt"),
        ("medusa/medusa_lm_head.pt", "medusa/medusa_lm_head.pt"),
        ("medusa/medusa_lm_head.pt", "medusa"),
        ("eagle/pytorch_model.bin", "eagle"),
    ],
)
def test_pytorch_pickles_are_refused(tmp_path, name, named):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x80\x02pickled")
    with pytest.raises(ModelFileError) as excinfo:
        load_heads(tmp_path / named)
    one_line(excinfo, str(path), "PyTorch pickle", "convert it to safetensors")


def test_a_folder_without_heads(tmp_path):
    with pytest.raises(ModelFileError) as excinfo:
        load_heads(tmp_path)
    one_line(excinfo, str(tmp_path), "holds no heads")


def test_a_fifo_is_refused_without_blocking(tmp_path):
    import os

    path = tmp_path / "heads.safetensors"
    os.mkfifo(path)
    (tmp_path / "heads.json").write_text("{}")
    with pytest.raises(ModelFileError) as excinfo:
        load_heads(path)
    one_line(excinfo, str(path), "is not a regular file")


@pytest.mark.parametrize(
    ("changes", "fragments"),
    [
        (None, ["has medusa_lm_head.safetensors but no config.json"]),
        ({"medusa_num_heads": 0}, ["medusa_num_heads is 0"]),
        ({"medusa_num_layers": -1}, ["medusa_num_layers is -1"]),
        ({"medusa_num_heads": 4}, ["lacks the tensor 3.0.linear.weight"]),
        ({"hidden_size": 4096}, ["hidden size 64, config.json says 4096"]),
        ({"medusa_num_layers": 2}, ["lacks the tensor 0.2.weight"]),
    ],
)
def test_bad_medusa1_folder(tmp_path, changes, fragments):
    """``changes`` to its config.json; None: no config.json at all."""
    write_medusa1(tmp_path)
    config_path = tmp_path / "config.json"
    if changes is None:
        config_path.unlink()
    else:
        config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **changes}))
    with pytest.raises(ModelFileError) as excinfo:
        load_heads(tmp_path)
    one_line(excinfo, str(tmp_path), *fragments)


def eagle3_with(**changes):
    def change(tensors):
        tensors.update(changes)
        for name, value in list(tensors.items()):
            if value is None:
                del tensors[name]

    return change


@pytest.mark.parametrize(
    ("change", "config_changes", "fragments"),
    [
        (eagle3_with(), {"hidden_size": 128}, ["holds tensors of hidden size 64, config.json says 128"]),
        (eagle3_with(), {"num_attention_heads": 0}, ["num_attention_heads is 0"]),
        (eagle3_with(), {"num_key_value_heads": 3}, ["4 attention heads, not a multiple of its 3"]),
        (eagle3_with(), {"num_hidden_layers": 2}, ["has 2 decoder layers"]),
        (eagle3_with(), {"draft_vocab_size": 4 * VOCAB}, [f"draft_vocab_size is {4 * VOCAB}"]),
        (eagle3_with(), {"rms_norm_eps": -1}, ["rms_norm_eps is -1"]),
        (eagle3_with(), {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 1, 2]}}, ["malformed eagle_aux"]),
        (
            eagle3_with(),
            {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}},
            ["fc.weight of shape [64, 192], expected [64, 128]"],
        ),
        (eagle3_with(), {"architectures": ["LlamaForCausalLM"]}, ["neither Medusa heads nor an EAGLE-3 draft"]),
        (eagle3_with(d2t=np.zeros(DRAFT_VOCAB, np.int64)), {}, ["t2d that disagrees with its d2t"]),
        (eagle3_with(d2t=np.full(DRAFT_VOCAB, VOCAB, np.int64)), {}, ["maps draft id 0 to target id 512"]),
        (eagle3_with(d2t=-np.arange(DRAFT_VOCAB, dtype=np.int64)), {}, ["maps several draft ids to the target id 0"]),
        (eagle3_with(d2t=None, t2d=None), {}, ["lacks the tensor d2t"]),
        (eagle3_with(**{"midlayer.mlp.up_proj.weight": None}), {}, ["lacks the tensor midlayer.mlp.up_proj.weight"]),
        (eagle3_with(**{"midlayer.self_attn.qkv_proj.weight": np.zeros((4, 4), np.float32)}), {}, ["does not have"]),
        (eagle3_with(**{"lm_head.weight": np.full((DRAFT_VOCAB, HIDDEN), np.inf, np.float32)}), {}, ["infinite"]),
    ],
)
def test_bad_eagle3_folder(tmp_path, change, config_changes, fragments):
    tensors = eagle3_tensors()
    change(tensors)
    write_eagle3(tmp_path, tensors, config={**EAGLE3_CONFIG, **config_changes})
    with pytest.raises(ModelFileError) as excinfo:
        load_heads(tmp_path)
    one_line(excinfo, str(tmp_path), *fragments)


# ---------------------------------------------------------------------------------------------
# Heads against their target


def test_heads_made_for_another_target_name_both_sides(tmp_path):
    heads = medusa_heads()
    path = tmp_path / "heads.safetensors"
    ours = {"hidden_size": HIDDEN, "vocab_size": VOCAB, "num_layers": 6, "vocabulary": f"{VOCAB}:abc"}
    check_heads_for_target(heads, path=path, **ours)
    cases = [
        ({"hidden_size": 384}, "was made for hidden size 64, the target has 384"),
        ({"vocab_size": 49152}, f"was made for a vocabulary of {VOCAB} tokens, the target has 49152"),
        ({"vocabulary": f"{VOCAB}:def"}, f"was made for the vocabulary {VOCAB}:abc, the target has {VOCAB}:def"),
        ({"num_layers": 30}, "was made for a target of 6 layers, the target has 30"),
        ({"vocabulary": (f"{VOCAB}:def", f"{VOCAB}:ghi")}, f"the vocabulary {VOCAB}:abc, the target has {VOCAB}:def"),
    ]
    # heads from before the fingerprint left the end-of-generation tokens out: its older form read too
    check_heads_for_target(heads, path=path, **{**ours, "vocabulary": (f"{VOCAB}:new", f"{VOCAB}:abc")})
    for change, fragment in cases:
        with pytest.raises(ModelFileError) as excinfo:
            check_heads_for_target(heads, path=path, **{**ours, **change})
        one_line(excinfo, str(path), fragment, "train heads for it")


def test_eagle3_heads_need_the_target_layers_they_read(tmp_path):
    write_eagle3(tmp_path, eagle3_tensors())
    heads = load_heads(tmp_path)
    check_heads_for_target(heads, hidden_size=HIDDEN, vocab_size=VOCAB, num_layers=7, path=tmp_path)
    with pytest.raises(ModelFileError) as excinfo:
        check_heads_for_target(heads, hidden_size=HIDDEN, vocab_size=VOCAB, num_layers=6, path=tmp_path)
    one_line(excinfo, str(tmp_path), "a layer 6 to read, the target has 6 layers")


# ---- specrun's own EAGLE heads ------------------------------------------------------------------


def saved_eagle(tmp_path: Path) -> tuple[Path, object]:
    from heads_factory import random_eagle

    heads = random_eagle(16, VOCAB, depth=5, draft_vocab=list(range(7, 7 + 40)), window=32)
    path = tmp_path / "eagle.safetensors"
    save_heads(heads, path, {"steps": 3})
    return path, heads


def test_eagle_heads_round_trip_with_their_layout_and_draft_vocabulary(tmp_path):
    from specrun.heads.eagle import EagleHeads

    path, heads = saved_eagle(tmp_path)
    loaded = load_heads(path)
    assert isinstance(loaded, EagleHeads)
    assert loaded.layout == heads.layout and loaded.config.num_heads == 5 and loaded.config.training == {"steps": 3}
    assert np.array_equal(loaded.d2t, heads.d2t)
    for stored, original in zip(loaded.arrays(), heads.arrays()):
        assert np.array_equal(stored, as_half(original))


@pytest.mark.parametrize(
    ("changes", "fragments"),
    [
        ({"layout": {"head_dim": 4}}, ["malformed layout"]),
        ({"layout": None}, ["malformed layout"]),
        ({"num_layers": 2}, ["num_layers is 2", "one layer"]),
        ({"hidden_size": 8}, ["holds tensors of hidden size 16, eagle.json says 8"]),
    ],
)
def test_bad_eagle_config(tmp_path, changes, fragments):
    path, _ = saved_eagle(tmp_path)
    rewrite_config(path, **changes)
    with pytest.raises(ModelFileError) as excinfo:
        load_heads(path)
    one_line(excinfo, *fragments)


@pytest.mark.parametrize(
    ("layout_changes", "fragments"),
    [
        ({"head_dim": 3}, ["head_dim is 3", "even"]),
        ({"num_attention_heads": 0}, ["num_attention_heads is 0"]),
        ({"window": -1}, ["window is -1"]),
        ({"intermediate_size": 7}, ["holds eagle.gate_proj of shape [32, 16], expected [7, 16]"]),
        ({"rope_theta": "big"}, ["rope_theta is 'big'"]),
    ],
)
def test_bad_eagle_layout(tmp_path, layout_changes, fragments):
    path, heads = saved_eagle(tmp_path)
    rewrite_config(path, layout={**heads.layout.to_dict(), **layout_changes})
    with pytest.raises(ModelFileError) as excinfo:
        load_heads(path)
    one_line(excinfo, *fragments)


def test_a_truncated_eagle_file_is_refused(tmp_path):
    path, _ = saved_eagle(tmp_path)
    path.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(ModelFileError) as excinfo:
        load_heads(path)
    one_line(excinfo, str(path), "is cut short")


# ---------------------------------------------------------------------------------------------
# Hydra heads in specrun's format


def hydra_saved(tmp_path: Path, num_layers: int = 2) -> tuple[Path, object]:
    from heads_factory import random_hydra

    heads = random_hydra(HIDDEN, VOCAB, num_heads=3, num_layers=num_layers, embedding_size=8,
                         draft_vocab=np.random.default_rng(0).permutation(VOCAB)[:DRAFT_VOCAB])
    path = tmp_path / "hydra.safetensors"
    save_heads(heads, path)
    return path, heads


def test_hydra_heads_round_trip_within_float16_rounding(tmp_path):
    from specrun.heads.hydra import HydraHeads

    path, heads = hydra_saved(tmp_path)
    loaded = load_heads(path)
    assert isinstance(loaded, HydraHeads) and loaded.config == heads.config
    assert loaded.embedding_size == 8 and [w.shape[1] for w, _ in loaded.inputs] == [HIDDEN + 8, HIDDEN + 16, HIDDEN + 24]
    assert len(loaded.blocks[2]) == 1 and np.array_equal(loaded.d2t, heads.d2t)
    for name, array in heads.arrays().items():
        assert loaded.arrays()[name].dtype == np.float32
        assert np.array_equal(loaded.arrays()[name], as_half(array)), name
    assert json.loads(path.with_suffix(".json").read_text())["layout"] == {"embedding_size": 8}
    with pytest.raises(ModelFileError) as excinfo:
        check_heads_for_target(loaded, hidden_size=HIDDEN + 1, vocab_size=VOCAB, path=path)
    one_line(excinfo, str(path), f"was made for hidden size {HIDDEN}, the target has {HIDDEN + 1}")


def test_a_truncated_hydra_file_is_one_line(tmp_path):
    path, _ = hydra_saved(tmp_path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelFileError) as excinfo:
        load_heads(path)
    one_line(excinfo, str(path), "cut short")


@pytest.mark.parametrize(
    ("changes", "fragments"),
    [
        ({"layout": {"embedding_size": 8, "window": 3}}, ["malformed layout (expected the key embedding_size)"]),
        ({"layout": {"embedding_size": 0}}, ["embedding_size is 0"]),
        ({"layout": {"embedding_size": 16}}, ["holds hydra.embed of shape [129, 8], expected [129, 16]"]),
        ({"num_layers": 0}, ["num_layers is 0; a Hydra head has at least its first layer"]),
        ({"num_layers": 1}, ["holds a tensor this format does not have (hydra.0.blocks.0.bias and 5 more)"]),
        ({"num_heads": 4}, ["lacks the tensor hydra.3.in.weight"]),
        ({"hidden_size": 32}, ["holds tensors of hidden size 64, hydra.json says 32"]),
    ],
)
def test_a_bad_hydra_config_is_one_line(tmp_path, changes, fragments):
    path, _ = hydra_saved(tmp_path)
    rewrite_config(path, **changes)
    with pytest.raises(ModelFileError) as excinfo:
        load_heads(path)
    line = one_line(excinfo, *fragments)
    assert "hydra.json" in line or str(path) in line


# ---------------------------------------------------------------------------------------------
# EAGLE-3 heads specrun writes (`specrun heads train --kind eagle3`): SpecForge's layout plus a record


def test_eagle3_heads_saved_by_specrun_load_back_with_their_target_and_checksum(tmp_path):
    import dataclasses

    from heads_factory import eagle3_heads
    from specrun.heads.config import training_layer_ids
    from specrun.heads.files import save_heads

    heads = eagle3_heads(HIDDEN, VOCAB, depth=5, draft_vocab=range(0, VOCAB, 3), aux=(1, 3, 6))
    config = dataclasses.replace(heads.config, target_name="demo-target", target_layers=8,
                                 target_vocabulary="abc123")
    heads = dataclasses.replace(heads, config=config, embed_tokens=None)
    save_heads(heads, tmp_path / "eagle3", {"held_out": {"chain_accuracy": [0.7, 0.6]}})
    loaded = load_heads(tmp_path / "eagle3")
    assert loaded.config == dataclasses.replace(config, training={"held_out": {"chain_accuracy": [0.7, 0.6]}})
    assert loaded.aux_layer_ids == (1, 3, 6) and loaded.embed_tokens is None
    np.testing.assert_array_equal(loaded.d2t, heads.d2t)
    np.testing.assert_array_equal(loaded.q_proj, as_half(heads.q_proj))
    settings = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    assert settings["architectures"] == ["LlamaForCausalLMEagle3"] and settings["draft_vocab_size"] == len(heads.d2t)
    (tmp_path / "eagle3" / "model.safetensors").write_bytes(
        (tmp_path / "eagle3" / "model.safetensors").read_bytes()[:-2] + b"\0\0")
    with pytest.raises(ModelFileError) as torn:
        load_heads(tmp_path / "eagle3")
    assert "does not match model.safetensors (a torn save" in torn.value.one_line()
    assert training_layer_ids(30) == (1, 14, 26) and training_layer_ids(8) == (1, 3, 4)
    assert training_layer_ids(6) == (1, 2, 4) and training_layer_ids(2) == (0,)
