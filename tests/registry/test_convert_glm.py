"""`specrun models convert` for GLM-4.5's layout (llama.cpp's glm4moe) and DeepSeek's latent
attention (deepseek2, GLM-4.7-Flash's): the folder mlx-lm loads computes what llama.cpp computes on
the GGUF and what the folder the tests write by hand computes, and carries the model's MTP layer,
which specrun's MTP drafter reads and drafts with as it does from the hand-written folder (issue 50)."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
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
PROMPTS = ("def hello(world):", "Grüße aus München! Ça va", "import os\nimport sys\n")
# A 4-bit folder's logits against the float16 folder's, in the logits' std: min-max groups of 32 put
# each weight within half a step (~1/30 of its group's range) of its float16 value, and these random
# tiny models carry such noise through every matrix of three blocks (measured: median 0.32 of a
# std for both layouts, correlation 0.85); the bound says only that nothing else moved them. That
# every group sits where mlx-lm reads it is the comparison with the folder of the dequantized weights.
APART_4_BIT, CORRELATION_4_BIT = 0.5, 0.75


@pytest.fixture(scope="module", params=["glm4moe", "deepseek2"])
def model(request, tmp_path_factory) -> dict:
    """A random tiny model of the layout with its MTP block: {"gguf", "hand": the same weights as the
    folder the MTP tests write by hand, "shape", "weights"}. GLM's second trunk block routes experts
    (a dense first one, as GLM-4.5's), DeepSeek's too."""
    import mtp_models

    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "glm4moe":
        shape = mtp_models.GlmShape(dense_layers=1)
        weights = mtp_models.glm_weights(shape)
        return {"gguf": mtp_models.write_glm_gguf(folder / "glm.gguf", shape, weights),
                "hand": mtp_models.write_glm_hf_folder(folder / "hand", shape, weights),
                "shape": shape, "weights": weights, "arch": request.param}
    shape = mtp_models.DeepseekShape()
    weights = mtp_models.deepseek_weights(shape)
    return {"gguf": mtp_models.write_deepseek_gguf(folder / "deepseek.gguf", shape, weights),
            "hand": mtp_models.write_deepseek_mlx_folder(folder / "hand", shape, weights),
            "shape": shape, "weights": weights, "arch": request.param}


def _write(model: dict, path: Path, weights: dict, **options) -> Path:
    """``weights`` in place of the model's, as a GGUF of its layout at ``path``."""
    import mtp_models

    if model["arch"] == "glm4moe":
        return mtp_models.write_glm_gguf(path, model["shape"], weights, **options)
    return mtp_models.write_deepseek_gguf(path, model["shape"], weights, **options)


def _llama_logits(path: Path) -> np.ndarray:
    from mtp_models import llama_logits

    return llama_logits(path, TOKENS)


def _mlx_logits(folder: Path) -> np.ndarray:
    from mtp_models import mlx_logits

    return mlx_logits(folder, TOKENS)


def test_the_converted_folder_computes_what_llama_cpp_and_the_hand_written_folder_compute(model, tmp_path):
    """Experts stacked in their order, the shared expert, the router and its selection bias, the
    latent attention's k_b and v_b: mlx-lm's logits on the converted folder are those on the
    hand-written one (the same numbers, float16 here, float32 there) and llama.cpp's on the GGUF;
    the MTP layer read from the folder is the GGUF's to the bit, in the same layout."""
    from specrun.modelkit.mtp import read_mtp_folder, read_mtp_gguf

    folder = tmp_path / "mlx"
    result = runner.invoke(app, ["models", "convert", str(model["gguf"]), "--to", "mlx", "--out", str(folder)])
    assert result.exit_code == 0, result.output
    ours, hand, theirs = _mlx_logits(folder), _mlx_logits(model["hand"]), _llama_logits(model["gguf"])
    np.testing.assert_allclose(ours, hand, rtol=0, atol=1e-5 * hand.std())
    apart = np.abs(ours - theirs) / theirs.std()
    assert np.median(apart) < 0.005 and apart.max() < 0.1, (np.median(apart), apart.max())
    from_gguf, from_folder = read_mtp_gguf(model["gguf"]), read_mtp_folder(folder)
    assert from_folder.layout == from_gguf.layout == read_mtp_folder(model["hand"]).layout
    assert set(from_folder.tensors) == set(from_gguf.tensors) and {"router_bias", "gate_exps"} <= set(from_gguf.tensors)
    for name in from_gguf.tensors:
        np.testing.assert_array_equal(np.asarray(from_folder.tensors[name], np.float32),
                                      np.asarray(from_gguf.tensors[name], np.float32), name)


def _greedy_chains(folder: Path) -> list[list[int]]:
    """The MTP drafter's greedy 5-token chain on the MLX target ``folder``, with the MTP layer read
    from it, after each of PROMPTS."""
    from mtp_models import greedy_chains
    from specrun.modelkit.mtp import read_mtp_folder
    from specrun.registry.loading import LoadOptions, open_backend

    target = open_backend(str(folder), LoadOptions(backend="mlx", n_ctx=512, threads=1), entries={})
    try:
        return greedy_chains(target, read_mtp_folder(folder), PROMPTS)
    finally:
        target.close()


def _widened(folder: Path) -> Path:
    """The folder with its float16 weights stored as float32: MLX's CPU gathers experts in float32
    only (a float16 folder runs its experts on a Mac's GPU alone)."""
    import mlx.core as mx

    weights = folder / "model.safetensors"
    mx.save_safetensors(str(weights), {name: array.astype(mx.float32) for name, array in mx.load(str(weights)).items()},
                        metadata={"format": "pt"})
    return folder


def test_on_mlx_the_converted_folder_drafts_the_hand_written_folder_s_chains(model, tmp_path):
    """The MTP drafter on mlx-lm's model of the converted folder, with the MTP layer read from it:
    the hand-written folder's greedy chains after every prompt."""
    folder = tmp_path / "mlx"
    convert_gguf_to_mlx(model["gguf"], folder)
    ours = _greedy_chains(_widened(folder))
    assert ours == _greedy_chains(model["hand"]) and all(len(chain) == 5 for chain in ours)


def test_the_converted_float16_folder_generates_on_the_cpu(model, tmp_path):
    """MLX's CPU gathers experts in float32 only: a float16 MoE folder as converted ended every pass
    in an internal error ("[GatherMM::eval] Currently only supports float32"). The backend stores
    its experts' weights as float32 on the CPU, and the MTP drafter drafts the chains it drafts over
    the folder widened whole."""
    folder = tmp_path / "mlx"
    convert_gguf_to_mlx(model["gguf"], folder)
    result = runner.invoke(app, ["generate", "--backend", "mlx", "--target", str(folder), PROMPTS[0],
                                 "-n", "6", "--method", "none", "--temp", "0"])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    half = _greedy_chains(folder)
    assert half == _greedy_chains(_widened(folder)) and all(len(chain) == 5 for chain in half)


@pytest.mark.parametrize("change, said", [
    (lambda w: w.update({"blk.1.ffn_gate_exps.weight": w["blk.1.ffn_gate_exps.weight"][:-1].copy()}),
     "its tensor blk.1.ffn_gate_exps.weight is (3, 64, 128), where the header's sizes give (4, 64, 128)"),
    (lambda w: w.update({"blk.2.ffn_down_exps.weight": w["blk.2.ffn_down_exps.weight"][:, :, :-1].copy()}),
     "its tensor blk.2.ffn_down_exps.weight is (4, 128, 63), where the header's sizes give (4, 128, 64)"),
    (lambda w: w.pop("blk.1.exp_probs_b.bias"), "lacks the tensor blk.1.exp_probs_b.bias"),
], ids=["an-expert-short", "the-mtp-experts-a-column-short", "no-selection-bias"])
def test_a_mis_shaped_or_missing_expert_tensor_is_one_line_naming_the_file_and_nothing_is_written(model, tmp_path,
                                                                                                 change, said):
    weights = dict(model["weights"])
    change(weights)
    path = _write(model, tmp_path / "bad.gguf", weights)
    with pytest.raises(ModelFileError, match=re.escape(said)):
        convert_gguf_to_mlx(path, tmp_path / "direct")
    result = runner.invoke(app, ["models", "convert", str(path), "--to", "mlx"])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 1 and len(errors) == 1 and "Traceback" not in result.output, result.output
    assert str(path) in errors[0] and said in errors[0]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bad.gguf"]


def test_a_truncated_file_is_one_line_naming_it(model, tmp_path):
    path = tmp_path / "cut.gguf"
    data = model["gguf"].read_bytes()
    path.write_bytes(data[: len(data) - 4096])  # the last expert tensors' bytes missing
    result = runner.invoke(app, ["models", "convert", str(path), "--to", "mlx", "--out", str(tmp_path / "out")])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 1 and len(errors) == 1 and "Traceback" not in result.output, result.output
    assert str(path) in errors[0] and "damaged" in errors[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, said", [
    ({"expert_gating_func": 1}, "its experts are routed by softmax"),
    ({"rope.scaling.type": "yarn"}, "RoPE scaling (yarn)"),
    ({"expert_count": 0}, "expert_count is 0, not a count of at least 1"),
    ({"leading_dense_block_count": 0}, "holds the tensor blk.0.ffn_down.weight, which mlx-lm's"),
], ids=["softmax-routing", "yarn", "no-experts", "a-dense-block-where-experts-route"])
def test_fields_the_conversion_cannot_use_are_one_line_before_anything_is_read(model, change, said):
    """Routing mlx-lm's models do not compute, rotary scaling they would not apply, zero counts, a
    dense block where the header says experts route: one ModelFileError naming the problem, from the
    header and the tensors' names alone."""
    from specrun.modelkit.gguf_check import read_layout
    from specrun.modelkit.gguf_convert_glm import check_glm

    fields, infos = read_layout(model["gguf"])
    arch = model["arch"]
    with pytest.raises(ModelFileError) as raised:
        check_glm("model.gguf", {**fields, **{f"{arch}.{key}": value for key, value in change.items()}},
                  {info.name for info in infos})
    assert said in raised.value.one_line() and raised.value.one_line().startswith("model.gguf cannot be converted")


def test_layouts_the_conversion_cannot_carry_are_one_line(model, tmp_path):
    """A block tensor mlx-lm's model has no place for, an expert tensor of a type gguf-py cannot
    read (Q8_1), and (GLM) two MTP blocks, of which mlx-lm's glm4_moe drops only the first."""
    import mtp_models

    unread = _write(model, tmp_path / "q8_1.gguf", model["weights"],
                    quantized={"blk.1.ffn_up_exps.weight": gguf.GGMLQuantizationType.Q8_1})
    cases = [(["--dtype", dtype], unread, "the tensor blk.1.ffn_up_exps.weight is of type Q8_1, which the "
              "conversion cannot read") for dtype in ("float16", "q4")]
    extra = _write(model, tmp_path / "extra.gguf", {**model["weights"], "blk.0.attn_output.bias": np.zeros(128)})
    cases.append(([], extra, "blk.0.attn_output.bias, which mlx-lm's"))
    if model["arch"] == "glm4moe":
        two = mtp_models.GlmShape(dense_layers=1, mtp_layers=2)
        path = mtp_models.write_glm_gguf(tmp_path / "two.gguf", two, mtp_models.glm_weights(two))
        cases.append(([], path, "it holds 2 MTP blocks, where mlx-lm's glm4_moe loads a folder with one"))
    for options, path, said in cases:
        result = runner.invoke(app, ["models", "convert", str(path), "--to", "mlx", *options,
                                     "--out", str(tmp_path / "out")])
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.exit_code == 1 and len(errors) == 1 and said in errors[0], result.output
        assert not (tmp_path / "out").exists()


# ---- --dtype q4 ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folders(model, tmp_path_factory) -> dict[str, Path]:
    """The model converted to float16 and, by the command, to q4."""
    out = tmp_path_factory.mktemp(f"{model['arch']}-folders")
    convert_gguf_to_mlx(model["gguf"], out / "f16")
    result = runner.invoke(app, ["models", "convert", str(model["gguf"]), "--to", "mlx", "--dtype", "q4",
                                 "--out", str(out / "q4")])
    assert result.exit_code == 0, result.output
    return {"f16": out / "f16", "q4": out / "q4"}


def _stored(folder: Path) -> dict:
    import mlx.core as mx

    return mx.load(str(folder / "model.safetensors"))


def _bits(stored: dict, module: str) -> int:
    """A quantized module's bits, from its words' and scales' widths (groups of 32)."""
    return stored[f"{module}.weight"].shape[-1] // stored[f"{module}.scales"].shape[-1]


def _dequantized(stored: dict, module: str):
    """A stored quantized weight as float32, computed in float32 (exact for GGML's blocks)."""
    import mlx.core as mx

    scales, biases = (stored[f"{module}.{part}"].astype(mx.float32) for part in ("scales", "biases"))
    return mx.dequantize(stored[f"{module}.weight"], scales, biases, group_size=32, bits=_bits(stored, module))


def _dequantized_folder(folder: Path, out: Path) -> Path:
    """A float32 copy of the quantized ``folder`` holding its weights dequantized: what the 4-bit
    folder must compute, to float rounding, were its groups placed right."""
    import json
    import shutil

    import mlx.core as mx

    shutil.copytree(folder, out)
    stored = _stored(folder)
    modules = [name.removesuffix(".scales") for name in stored if name.endswith(".scales")]
    floats = {name: array.astype(mx.float32) for name, array in stored.items()
              if not name.endswith((".scales", ".biases"))}
    floats.update({f"{module}.weight": _dequantized(stored, module) for module in modules})
    mx.save_safetensors(str(out / "model.safetensors"), floats, metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    del config["quantization"], config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_4_bit_folder_holds_every_matrix_within_half_a_step_and_computes_its_dequantized_weights(model, folders,
                                                                                                tmp_path):
    """``--dtype q4``: the stacked experts expert by expert (weight (E, out, in/8) words, scales and
    biases (E, out, in/32)), the attention, the shared expert, the embedding, the output head and the
    MTP block's matrices within half a step of the float16 folder's; DeepSeek's v_b (unembed_out)
    head by head, its k_b (embed_q: 16 columns, which mlx-lm's quantize leaves) float16; norms and
    the router as the float16 folder holds them. mlx-lm loads the experts as QuantizedSwitchLinear
    and computes on the CPU what a float32 folder of the dequantized weights computes: every
    difference from the float16 folder's logits is the weights' 4-bit rounding."""
    import json

    import mlx.core as mx
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear
    from mlx_lm.utils import load_model

    reference, stored = _stored(folders["f16"]), _stored(folders["q4"])
    config = json.loads((folders["q4"] / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    trunk, experts = config["num_hidden_layers"], config["n_routed_experts"]
    quantized = sorted(name.removesuffix(".scales") for name in stored if name.endswith(".scales"))
    mtp = f"model.layers.{trunk}"
    wanted = [f"model.layers.1.mlp.switch_mlp.{part}_proj" for part in ("gate", "up", "down")] + [
        "model.embed_tokens", "lm_head", f"{mtp}.eh_proj", f"{mtp}.mlp.switch_mlp.down_proj",
        "model.layers.1.mlp.shared_experts.up_proj", "model.layers.0.self_attn.o_proj"]
    if model["arch"] == "deepseek2":
        wanted.append("model.layers.1.self_attn.unembed_out")
        assert reference["model.layers.1.self_attn.embed_q.weight"].shape[-1] % 32
        assert stored["model.layers.1.self_attn.embed_q.weight"].dtype == mx.float16
    assert set(wanted) <= set(quantized), sorted(set(wanted) - set(quantized))
    gate = stored["model.layers.1.mlp.switch_mlp.gate_proj.weight"]
    columns = reference["model.layers.1.mlp.switch_mlp.gate_proj.weight"].shape[-1]
    assert gate.dtype == mx.uint32 and gate.shape == (experts, config["moe_intermediate_size"], columns // 8)
    assert stored["model.layers.1.mlp.switch_mlp.gate_proj.scales"].shape == (*gate.shape[:2], columns // 32)
    for module in quantized:
        scales = stored[f"{module}.scales"]
        assert _bits(stored, module) == 4 and scales.dtype == (mx.float32 if module.endswith("embed_tokens")
                                                              else mx.float16), module
        step = mx.repeat(scales.astype(mx.float32), 32, axis=-1)
        apart = mx.abs(_dequantized(stored, module) - reference[f"{module}.weight"].astype(mx.float32))
        assert bool(mx.all(apart <= step / 2 + 1e-3)), module
    for name, array in reference.items():
        if name.removesuffix(".weight") not in quantized:
            assert stored[name].dtype == array.dtype and bool(mx.array_equal(stored[name], array)), name
    assert stored["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == mx.float32
    assert not any(f"{part}.scales" in stored for part in ("model.layers.1.mlp.gate", "model.norm"))

    loaded, _ = load_model(folders["q4"])
    assert isinstance(loaded.model.layers[1].mlp.switch_mlp.gate_proj, QuantizedSwitchLinear)
    ours = np.array(loaded(mx.array([TOKENS]))[0].astype(mx.float32))  # float32 activations: the embedding's scales
    dequantized = _mlx_logits(_dequantized_folder(folders["q4"], tmp_path / "dequantized"))
    np.testing.assert_allclose(ours, dequantized, rtol=0, atol=1e-3 * dequantized.std())
    half = _mlx_logits(folders["f16"])
    apart = np.abs(ours - half) / half.std()
    assert np.median(apart) < APART_4_BIT and np.corrcoef(ours.ravel(), half.ravel())[0, 1] > CORRELATION_4_BIT, (
        np.median(apart), np.corrcoef(ours.ravel(), half.ravel())[0, 1])


def test_the_4_bit_folder_generates_and_drafts_with_its_mtp_layer_on_the_cpu(model, folders, tmp_path):
    """MLX's CPU gathers quantized experts (gather_qmm) as they are stored: the 4-bit folder
    generates greedily by ``specrun generate --backend mlx``, and drafting with its MTP layer read
    from it (quantized, held so by the MLX layer) changes no token. The drafter's chains are
    5 long and those it drafts over the folder of the dequantized weights (the same numbers in
    float32). Not the float16 folder's: on these random models 4-bit rounding moves the logits by
    more than their top two's usual gap (measured: a median gap of 0.22-0.31 of a std against a
    median move of 0.32), and the 15 chained tokens agreed with the float16 folder's in none."""
    generated = [runner.invoke(app, ["generate", PROMPTS[0], "-t", str(folders["q4"]), "--backend", "mlx", "-n", "12",
                                     "--method", method, "--temp", "0", "--threads", "1"])
                 for method in ("none", "mtp")]
    assert [result.exit_code for result in generated] == [0, 0], [result.output for result in generated]
    assert "Traceback" not in generated[1].output and "mtp" in generated[1].stderr
    assert generated[0].stdout == generated[1].stdout and generated[0].stdout.strip()
    ours = _greedy_chains(folders["q4"])
    assert all(len(chain) == 5 for chain in ours)
    assert ours == _greedy_chains(_dequantized_folder(folders["q4"], tmp_path / "dequantized"))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_experts_stored_in_ggml_blocks_mlx_groups_express_are_carried_exactly(model, qtype, tmp_path):
    """Every expert stack (the trunk's and the MTP block's) and the shared expert stored as Q8_0,
    Q4_0 or Q4_1 (DeepSeek's v_b too): their MLX groups dequantize to gguf-py's values bit for bit
    (Q8_0 as 8-bit groups, named per layer in config.json), mlx-lm loads the folder and computes
    what the folder of its dequantized weights computes, and the MTP layer read from the folder
    holds the GGUF's experts to the bit. A type no MLX group expresses (Q5_0) is quantized afresh
    within half a step of its own values (the next test)."""
    import json

    from specrun.modelkit.gguf_convert_glm import glm_tensor_plan
    from specrun.modelkit.mtp import read_mtp_folder, read_mtp_gguf

    stacks = [name for name in model["weights"] if name.endswith(("_exps.weight", "_shexp.weight", "attn_v_b.weight"))]
    chosen = getattr(gguf.GGMLQuantizationType, qtype)
    path = _write(model, tmp_path / f"{qtype}.gguf", model["weights"], quantized=dict.fromkeys(stacks, chosen))
    folder = tmp_path / "q4"
    convert_gguf_to_mlx(path, folder, mlx_dtype="q4")
    reader = gguf.GGUFReader(str(path))
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = json.loads((folder / "config.json").read_text())
    plan = glm_tensor_plan(config, tensors)
    stored, bits = _stored(folder), 8 if qtype == "Q8_0" else 4
    for name in stacks:
        module = plan[name].removesuffix(".weight")
        assert tensors[name].tensor_type == chosen and _bits(stored, module) == bits, name
        expected = gguf.quants.dequantize(np.asarray(tensors[name].data), chosen).astype(np.float32)
        np.testing.assert_array_equal(np.array(_dequantized(stored, module)), expected, name)  # Q4_0's 0 may be -0
        if bits != 4:
            assert config["quantization"][module] == {"group_size": 32, "bits": bits}, module
    dequantized = _mlx_logits(_dequantized_folder(folder, tmp_path / "dequantized"))
    np.testing.assert_allclose(_mlx_logits(folder), dequantized, rtol=0, atol=1e-3 * dequantized.std())
    from_gguf, from_folder = read_mtp_gguf(path), read_mtp_folder(folder)
    for name in ("gate_exps", "up_exps", "down_exps"):
        np.testing.assert_array_equal(np.asarray(from_folder.tensors[name], np.float32),
                                      np.asarray(from_gguf.tensors[name], np.float32), name)


def test_experts_of_a_type_mlx_groups_do_not_express_are_quantized_afresh(model, tmp_path):
    """Q5_0 experts: no MLX 4-bit group holds their 5-bit values, so they are dequantized and
    quantized to 4 bits, each within half a step of gguf-py's values."""
    import json

    import mlx.core as mx

    from specrun.modelkit.gguf_convert_glm import glm_tensor_plan

    stacks = [name for name in model["weights"] if name.endswith("_exps.weight")]
    path = _write(model, tmp_path / "q5.gguf", model["weights"],
                  quantized=dict.fromkeys(stacks, gguf.GGMLQuantizationType.Q5_0))
    folder = tmp_path / "q4"
    convert_gguf_to_mlx(path, folder, mlx_dtype="q4")
    config = json.loads((folder / "config.json").read_text())
    tensors = {tensor.name: tensor for tensor in gguf.GGUFReader(str(path)).tensors}
    plan, stored = glm_tensor_plan(config, tensors), _stored(folder)
    for name in stacks:
        module = plan[name].removesuffix(".weight")
        assert _bits(stored, module) == 4 and module not in config["quantization"], name
        expected = gguf.quants.dequantize(np.asarray(tensors[name].data), gguf.GGMLQuantizationType.Q5_0)
        step = mx.repeat(stored[f"{module}.scales"].astype(mx.float32), 32, axis=-1)
        assert bool(mx.all(mx.abs(_dequantized(stored, module) - mx.array(expected, mx.float32)) <= step / 2 + 1e-3))


def test_deepseek_s_k_b_is_quantized_head_by_head_where_its_columns_divide_into_groups(tmp_path):
    """With 32 nope dimensions (GLM-4.7-Flash has 192) k_b is 4-bit too, head by head as mlx-lm's
    QuantizedMultiLinear holds it (which multiplies it both ways: queries in, latent keys out):
    within half a step of the float16 folder's, the folder computes what its dequantized weights
    compute, and the MTP drafter, its k_b quantized, drafts their chains."""
    import mlx.core as mx
    import mtp_models
    from mlx_lm.models.mla import QuantizedMultiLinear
    from mlx_lm.utils import load_model

    shape = mtp_models.DeepseekShape(nope=32)
    path = mtp_models.write_deepseek_gguf(tmp_path / "deepseek.gguf", shape, mtp_models.deepseek_weights(shape))
    convert_gguf_to_mlx(path, tmp_path / "f16")
    convert_gguf_to_mlx(path, tmp_path / "q4", mlx_dtype="q4")
    reference, stored = _stored(tmp_path / "f16"), _stored(tmp_path / "q4")
    for block in range(shape.trunk_layers + 1):
        module = f"model.layers.{block}.self_attn.embed_q"
        assert stored[f"{module}.scales"].shape == (shape.heads, shape.kv_rank, 1), module
        step = mx.repeat(stored[f"{module}.scales"].astype(mx.float32), 32, axis=-1)
        apart = mx.abs(_dequantized(stored, module) - reference[f"{module}.weight"].astype(mx.float32))
        assert bool(mx.all(apart <= step / 2 + 1e-3)), module
    loaded, _ = load_model(tmp_path / "q4")
    assert isinstance(loaded.model.layers[0].self_attn.embed_q, QuantizedMultiLinear)
    dequantized = _dequantized_folder(tmp_path / "q4", tmp_path / "dequantized")
    expected = _mlx_logits(dequantized)
    np.testing.assert_allclose(_mlx_logits(tmp_path / "q4"), expected, rtol=0, atol=1e-3 * expected.std())
    chains = _greedy_chains(tmp_path / "q4")
    assert chains == _greedy_chains(dequantized) and all(len(chain) == 5 for chain in chains)
    generated = runner.invoke(app, ["generate", PROMPTS[0], "-t", str(tmp_path / "q4"), "--backend", "mlx", "-n", "6",
                                    "--method", "none", "--temp", "0", "--threads", "1"])  # a token a pass
    assert generated.exit_code == 0 and "Traceback" not in generated.output, generated.output
