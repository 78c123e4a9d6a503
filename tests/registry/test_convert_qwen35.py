"""`specrun models convert` for Qwen3.5's hybrid layout (llama.cpp's qwen35 and qwen35moe): the
folder mlx-lm's qwen3_5 loads computes what llama.cpp computes on the GGUF, and carries the
model's MTP layer as Qwen's checkpoints hold it, which specrun's MTP drafter reads (issue 50)."""

from __future__ import annotations

import re

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from specrun.cli.app import app
from specrun.errors import ModelFileError
from specrun.modelkit.gguf_convert import convert_gguf_to_mlx

pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")
pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")

runner = CliRunner()
TOKENS = list(range(5, 45))
MTP_ARRAYS = ("eh_proj", "enorm", "hnorm", "head_norm", "attn_norm", "post_norm", "q_proj", "k_proj", "v_proj",
              "o_proj", "q_norm", "k_norm", "gate_proj", "up_proj", "down_proj", "router", "gate_exps", "up_exps",
              "down_exps", "shared_gate")


@pytest.fixture(scope="module", params=["qwen35", "qwen35moe", "qwen3next"])
def hybrid_gguf(request, tmp_path_factory) -> Path:
    """A random tiny Qwen3.5 (two key heads for four value heads: llama.cpp reorders those) with its
    MTP layer, dense or with routed experts, or a Qwen3-Next (routed experts; q, k, v and z joined
    in one projection, beta and alpha in another, value heads kept grouped)."""
    from hybrid_models import HybridShape, hybrid_weights, write_hybrid_gguf

    shape = HybridShape(experts=0 if request.param == "qwen35" else 4, next=request.param == "qwen3next")
    folder = tmp_path_factory.mktemp(request.param)
    return write_hybrid_gguf(folder / "hybrid.gguf", shape, hybrid_weights(shape, mtp_layers=1), mtp_layers=1)


def _llama_logits(path: Path) -> np.ndarray:
    from mtp_models import llama_logits

    return llama_logits(path, TOKENS)


def _mlx_logits(folder: Path) -> np.ndarray:
    from mtp_models import mlx_logits

    return mlx_logits(folder, TOKENS)


def test_the_converted_folder_computes_what_llama_cpp_computes_and_holds_the_mtp_layer(hybrid_gguf, tmp_path):
    """Every change llama.cpp's converter made (norms, A, the convolution, value heads reordered
    for ggml's broadcast) undone: mlx-lm's logits are llama.cpp's, and the MTP layer read from the
    folder is the GGUF's to the bit (its norms stored as Qwen's checkpoints store them)."""
    from specrun.modelkit.mtp import read_mtp_folder, read_mtp_gguf

    folder = tmp_path / "mlx"
    convert_gguf_to_mlx(hybrid_gguf, folder)
    theirs, ours = _llama_logits(hybrid_gguf), _mlx_logits(folder)
    apart = np.abs(ours - theirs) / theirs.std()
    # float16 weights; with routed experts a near tie may route a row to another expert in one of them
    assert np.median(apart) < 0.005 and (apart.max() < 0.1 or "moe" in hybrid_gguf.parent.name)
    assert (ours.argmax(1) == theirs.argmax(1)).mean() > 0.9
    from_gguf, from_folder = read_mtp_gguf(hybrid_gguf), read_mtp_folder(folder)
    assert from_folder.layout == from_gguf.layout
    held = [name for name in MTP_ARRAYS if getattr(from_gguf, name) is not None]
    assert "eh_proj" in held and "q_norm" in held
    for name in held:
        np.testing.assert_array_equal(np.asarray(getattr(from_folder, name), np.float32),
                                      np.asarray(getattr(from_gguf, name), np.float32), err_msg=name)


def test_a_4_bit_conversion_holds_every_matrix_within_half_a_step_and_drafts_with_its_mtp_layer(hybrid_gguf,
                                                                                              tmp_path):
    """``--dtype q4``: each quantized matrix within half a step of the float16 conversion's (value
    heads regrouped before quantizing), routers and vectors as they were; on the dense model, MLX
    drafts with the carried MTP layer and every token is plain decoding's."""
    import mlx.core as mx

    half, q4 = tmp_path / "f16", tmp_path / "q4"
    convert_gguf_to_mlx(hybrid_gguf, half)
    result = runner.invoke(app, ["models", "convert", str(hybrid_gguf), "--to", "mlx", "--dtype", "q4", "--out", str(q4)])
    assert result.exit_code == 0, result.output
    reference, stored = _stored(half), _stored(q4)
    quantized = [name for name in stored if name.endswith(".scales")]
    assert any("linear_attn.out_proj" in name for name in quantized) and any(name.startswith("mtp.") for name in quantized)
    for name in quantized:
        module = name.removesuffix(".scales")
        weight = mx.dequantize(stored[f"{module}.weight"], stored[name], stored[f"{module}.biases"], 32, 4)
        step = mx.repeat(stored[name].astype(mx.float32), 32, axis=-1)
        assert bool(mx.all(mx.abs(weight - reference[f"{module}.weight"].astype(mx.float32)) <= step / 2 + 1e-3)), name
    for module in ("linear_attn.A_log", "linear_attn.conv1d", "mlp.gate", "input_layernorm"):
        assert not any(key.endswith(f"{module}.scales") for key in stored)
    generated = [runner.invoke(app, ["generate", "def hello(world):", "-t", str(q4), "--backend", "mlx", "-n", "24",
                                     "--method", method, "--threads", "1"]) for method in ("none", "mtp")]
    assert [result.exit_code for result in generated] == [0, 0], [result.output for result in generated]
    assert generated[0].stdout == generated[1].stdout
    assert "mtp" in generated[1].stderr


def _stored(folder: Path) -> dict:
    """Every array the converted folder holds: model.safetensors, and Qwen3-Next's MTP file beside it."""
    import mlx.core as mx

    from specrun.modelkit.gguf_convert_qwen35 import MTP_FILE

    files = [folder / "model.safetensors", folder / MTP_FILE]
    return {name: array for path in files if path.is_file() for name, array in mx.load(str(path)).items()}


def _rewritten(tmp_path: Path, name: str, change, **options) -> Path:
    from hybrid_models import HybridShape, hybrid_weights, write_hybrid_gguf

    shape = HybridShape()
    weights = hybrid_weights(shape, mtp_layers=1)
    change(weights)
    return write_hybrid_gguf(tmp_path / name, shape, weights, mtp_layers=1, **options)


def test_several_mtp_layers_convert_one_a_depth_under_the_first_one_s_fc(tmp_path):
    """Qwen's several MTP layers (llama.cpp writes the module's fc and norms in the first MTP block
    only) become ``mtp.layers.N`` under one ``mtp.fc``: mlx-lm loads the folder, and the layers read
    from it, one a draft depth, are the GGUF's to the bit; a later block with its own fc, which that
    layout cannot hold, is one line."""
    from hybrid_models import HybridShape, hybrid_weights, write_hybrid_gguf
    from mlx_lm.utils import load_model

    from specrun.modelkit.mtp import read_mtp_folder, read_mtp_gguf

    shape = HybridShape()
    weights = hybrid_weights(shape, mtp_layers=2)
    later = f"blk.{shape.layers + 1}.nextn."
    shared = {name: value for name, value in weights.items() if not name.startswith(later)}
    path = write_hybrid_gguf(tmp_path / "two.gguf", shape, shared, mtp_layers=2)
    folder = tmp_path / "mlx"
    convert_gguf_to_mlx(path, folder)
    load_model(folder)  # the MTP layers stay out of mlx-lm's model
    from_gguf, from_folder = read_mtp_gguf(path), read_mtp_folder(folder)
    assert len(from_gguf.layers) == len(from_folder.layers) == 2
    for ours, theirs in zip(from_folder.layers, from_gguf.layers):
        for name in (name for name in MTP_ARRAYS if getattr(theirs, name) is not None):
            np.testing.assert_array_equal(np.asarray(getattr(ours, name), np.float32),
                                          np.asarray(getattr(theirs, name), np.float32), err_msg=name)
    own = write_hybrid_gguf(tmp_path / "own.gguf", shape, weights, mtp_layers=2)
    with pytest.raises(ModelFileError, match=rf"its MTP block {shape.layers + 1} holds nextn\.\w+\.weight of its own"):
        convert_gguf_to_mlx(own, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def test_a_hybrid_file_the_conversion_cannot_express_is_one_line_and_leaves_nothing(tmp_path):
    import gguf

    missing = _rewritten(tmp_path, "missing.gguf", lambda weights: weights.pop("blk.1.ssm_out.weight"))
    own_head = _rewritten(tmp_path, "own-head.gguf", lambda weights: weights.update(
        {"blk.4.nextn.shared_head_head.weight": weights["output.weight"].copy()}))
    # a type gguf-py cannot read (the GLM conversion refused it; this one had no check)
    unread = _rewritten(tmp_path, "q8_1.gguf", lambda weights: None,
                        quantized={"blk.1.ssm_out.weight": gguf.GGMLQuantizationType.Q8_1})
    for path, said in ((missing, "lacks the tensor blk.1.ssm_out.weight"),
                       (own_head, "blk.4.nextn.shared_head_head.weight"),
                       (unread, "the tensor blk.1.ssm_out.weight is of type Q8_1, which the conversion cannot read")):
        with pytest.raises(ModelFileError, match=said):
            convert_gguf_to_mlx(path, tmp_path / "direct")
        result = runner.invoke(app, ["models", "convert", str(path), "--to", "mlx"])
        assert result.exit_code == 1
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and said in errors[0] and "Traceback" not in result.output
    assert sorted(path.name for path in tmp_path.iterdir()) == ["missing.gguf", "own-head.gguf", "q8_1.gguf"]


@pytest.mark.parametrize("tensor, said", [
    ("blk.1.ssm_out.weight", "blk.0.ssm_out.weight (128, 64) and blk.1.ssm_out.weight (128, 63) differ in shape"),
    ("blk.3.attn_q.weight", "blk.3.attn_q.weight (256, 127) and blk.4.attn_q.weight (256, 128) differ in shape"),
    ("blk.4.nextn.eh_proj.weight", "blk.4.nextn.eh_proj.weight is (128, 255), where the header's sizes give (128, 256)"),
    ("token_embd.weight", "token_embd.weight is (512, 127), where the header's sizes give (512, 128)"),
], ids=["a-layer", "the-mtp-layer-s-attention", "the-mtp-projection", "the-embedding"])
def test_a_mis_shaped_tensor_is_one_line_before_anything_is_written(tmp_path, tensor, said):
    """A tensor one column short (a linear layer's, where a reshape failed inside the conversion; the
    MTP block's attention, the embedding and the MTP projection, which converted into a folder
    mlx-lm would refuse): one line naming it, on the command line too, and nothing written."""
    path = _rewritten(tmp_path, "short.gguf", lambda weights: weights.update({tensor: weights[tensor][..., :-1].copy()}))
    with pytest.raises(ModelFileError, match=re.escape(said)):
        convert_gguf_to_mlx(path, tmp_path / "direct")
    result = runner.invoke(app, ["models", "convert", str(path), "--to", "mlx"])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 1 and len(errors) == 1 and said in errors[0] and "Traceback" not in result.output
    assert sorted(path.name for path in tmp_path.iterdir()) == ["short.gguf"]


def test_an_architecture_the_conversion_does_not_handle_is_named(tmp_path):
    from hybrid_models import HybridShape, hybrid_weights, write_hybrid_gguf

    shape = HybridShape(experts=4, next=True)
    weights = hybrid_weights(shape)
    path = write_hybrid_gguf(tmp_path / "next.gguf", shape, weights)
    renamed = tmp_path / "other.gguf"
    renamed.write_bytes(path.read_bytes().replace(b"qwen3next", b"qwen3nexu"))  # the same layout, another name
    with pytest.raises(ModelFileError) as raised:
        convert_gguf_to_mlx(renamed, tmp_path / "direct")
    assert "architecture 'qwen3nexu' cannot be converted" in raised.value.one_line()
    assert "llama, qwen2, qwen35, qwen35moe, qwen3next" in raised.value.one_line()


def test_qwen3_next_s_mtp_layer_waits_beside_the_weights_mlx_lm_loads(tmp_path):
    """mlx-lm's qwen3_next drops ``mtp.*`` only from a checkpoint's unstacked experts: the converted
    folder keeps the layer in a file mlx-lm does not load (a model*.safetensors would fail its
    strict load), where specrun's drafter reads it."""
    from hybrid_models import HybridShape, hybrid_weights, write_hybrid_gguf
    from specrun.modelkit.gguf_convert_qwen35 import MTP_FILE
    from specrun.modelkit.mtp import folder_mtp_layers

    shape = HybridShape(experts=4, next=True)
    path = write_hybrid_gguf(tmp_path / "next.gguf", shape, hybrid_weights(shape, mtp_layers=1), mtp_layers=1)
    folder = tmp_path / "mlx"
    convert_gguf_to_mlx(path, folder)
    import mlx.core as mx

    assert not any(name.startswith("mtp.") for name in mx.load(str(folder / "model.safetensors")))
    assert all(name.startswith("mtp.") for name in mx.load(str(folder / MTP_FILE)))
    assert folder_mtp_layers(folder) == 1
    import json

    from specrun.modelkit.mtp import read_mtp_folder

    alone = read_mtp_folder(folder)
    names = mx.load(str(folder / "model.safetensors"))  # the same folder as a sharded one's index lists it
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": dict.fromkeys(names, "model.safetensors")}))
    np.testing.assert_array_equal(np.asarray(read_mtp_folder(folder).eh_proj), np.asarray(alone.eh_proj))


@pytest.mark.parametrize("change, said", [
    ({"qwen35.ssm.time_step_rank": 0}, "qwen35.ssm.time_step_rank is 0, not a count"),
    ({"qwen35.ssm.group_count": 3}, "value heads are not a multiple of its 3 key heads"),
    ({"qwen35.rope.scaling.type": "yarn"}, "RoPE scaling (yarn)"),
], ids=["zero-heads", "uneven-heads", "yarn"])
def test_hybrid_fields_the_conversion_cannot_use_are_one_line_before_anything_is_read(tmp_path, change, said):
    """Counts of zero (a division by zero before), heads that do not divide, rotary scaling mlx-lm's
    qwen3_5 would not apply: one ModelFileError naming the field, from the header alone."""
    from specrun.modelkit.gguf_check import read_layout
    from specrun.modelkit.gguf_convert_qwen35 import check_qwen35

    fields, infos = read_layout(_rewritten(tmp_path, "fine.gguf", lambda weights: None))
    with pytest.raises(ModelFileError) as raised:
        check_qwen35("model.gguf", {**fields, **change}, {info.name for info in infos})
    assert said in raised.value.one_line() and raised.value.one_line().startswith("model.gguf cannot be converted")
