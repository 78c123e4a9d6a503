"""`specrun models convert` for GLM-4.5's layout (llama.cpp's glm4moe) and DeepSeek's latent
attention (deepseek2, GLM-4.7-Flash's): the folder mlx-lm loads computes what llama.cpp computes on
the GGUF and what the folder the tests write by hand computes, and carries the model's MTP layer,
which specrun's MTP drafter reads and drafts with as it does from the hand-written folder (issue 50)."""

from __future__ import annotations

import re
from pathlib import Path
from time import perf_counter

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
    from specrun.backends.llama import LlamaCppBackend

    backend = LlamaCppBackend(path, n_ctx=256, n_threads=1)
    try:
        return backend.forward(TOKENS, list(range(len(TOKENS))))
    finally:
        backend.close()


def _mlx_logits(folder: Path) -> np.ndarray:
    """mlx-lm's own model over the folder, in float32 (MLX's CPU gathers experts in float32 only)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    model.set_dtype(mx.float32)
    return np.array(model(mx.array([TOKENS]))[0].astype(mx.float32))


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
    from specrun.backends.kv import KVSequence
    from specrun.drafters.heads.mtp import MtpDrafter
    from specrun.modelkit.mtp import read_mtp_folder
    from specrun.registry.loading import LoadOptions, open_backend
    from specrun.sampling import SamplingSettings

    target = open_backend(str(folder), LoadOptions(backend="mlx", n_ctx=512, threads=1), entries={})
    heads = read_mtp_folder(folder)
    chains = []
    try:
        for prompt in PROMPTS:
            context = target.tokenize(prompt)
            sequence = KVSequence(target)
            sequence.reset()
            drafter = MtpDrafter(heads)
            drafter.bind(sequence, perf_counter)
            sequence.feed(context[:-1])
            chains.append(list(drafter.propose(context, 5, SamplingSettings(), np.random.default_rng(0)).tokens))
            drafter.close()
    finally:
        target.close()
    return chains


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


def test_layouts_and_dtypes_the_conversion_cannot_carry_are_one_line(model, tmp_path):
    """--dtype q4 (not written for these layouts), a block tensor mlx-lm's
    model has no place for, and (GLM) two MTP blocks, of which mlx-lm's glm4_moe drops only the first."""
    import mtp_models

    cases = [(["--dtype", "q4"], model["gguf"], "models to float16 only")]
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
