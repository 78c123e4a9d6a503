"""``--draft self:layers=…``: some of the target's own layers (and its final norm and head) as its
draft, on MLX, sharing the target's weights; refused on llama.cpp in one line."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from typer.testing import CliRunner

from reference_model import ReferenceModel
from specrun.cli.app import app
from specrun.drafters.methods import build_drafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.errors import UsageError
from specrun.modelkit.selfdraft import LayerDraft, parse_self_draft
from specrun.registry.loading import open_layer_draft

PROMPT = [5, 17, 42, 9, 33, 2, 71]


def mlx_target(model):
    pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
    from specrun.backends.mlx import MlxBackend

    return MlxBackend(model.hf_dir)


def reference_of_layers(model, kept: tuple[int, ...]) -> ReferenceModel:
    """The oracle (float64 NumPy) of a model made of layers ``kept`` alone, written apart from mlx-lm."""
    weights = {name: value for name, value in model.weights.items() if not name.startswith("model.layers.")}
    for new, old in enumerate(kept):
        prefix = f"model.layers.{old}."
        weights.update({f"model.layers.{new}." + name[len(prefix):]: value
                        for name, value in model.weights.items() if name.startswith(prefix)})
    return ReferenceModel(dataclasses.replace(model.config, num_layers=len(kept)), weights)


@pytest.mark.parametrize("spec, kept", [("self:layers=1", (0,)), ("self:layers=1-1", (1,))])
def test_a_layer_draft_is_the_target_s_own_layers_and_computes_them_alone(random_model, spec, kept):
    target = mlx_target(random_model)
    draft = open_layer_draft(target, spec)
    assert draft.n_layers == len(kept) and target.n_layers == 2
    assert all(draft.model.model.layers[i] is target.model.model.layers[k] for i, k in enumerate(kept))  # shared
    logits = draft.forward(PROMPT, range(len(PROMPT)))  # (T, V)
    expected = reference_of_layers(random_model, kept).logits(PROMPT)  # (T, V)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-3)
    assert target.n_layers == 2 and len(target.model.model.layers) == 2  # the target is untouched
    draft.close()
    target.close()


def test_drafting_with_the_target_s_first_layer_gives_plain_decoding_s_text(tiny_llama):
    target = mlx_target(tiny_llama)
    plain = SpeculativeEngine(target).run(PROMPT, GenerationParams(40, 0)).token_ids
    draft = open_layer_draft(target, "self:layers=1")
    result = SpeculativeEngine(target, build_drafter("draft", draft)).run(PROMPT, GenerationParams(40, 4))
    assert result.token_ids == plain
    assert result.stats.drafted > 0


@pytest.mark.parametrize("spec, kept", [
    ("self:layers=3", LayerDraft("self:layers=3", first=3)),
    ("self:layers=0-2,5,7-8", LayerDraft("self:layers=0-2,5,7-8", named=(0, 1, 2, 5, 7, 8))),
])
def test_layer_specs_parse(spec, kept):
    assert parse_self_draft(spec) == kept


@pytest.mark.parametrize("spec, fragment", [
    ("self:layers=0", "keeps no layer"),
    ("self:layers=", "'' is not a layer number"),
    ("self:layers=x", "'x' is not a layer number"),
    ("self:layers=3-", "'' is not a layer number"),
    ("self:layers=3-1", "the range '3-1' runs backwards"),
    ("self:layers=-1", "'-1' is not a layer number (they count from 0)"),  # was read as '' and 1
    ("self:layers=0,-3", "'-3' is not a layer number"),
    ("self:layers=2,1", "names layers out of order or twice"),
    ("self:layers=1,1", "names layers out of order or twice"),
])
def test_malformed_layer_specs_are_one_usage_line(spec, fragment):
    with pytest.raises(UsageError) as raised:
        parse_self_draft(spec)
    assert "self:layers=N" in raised.value.one_line()  # the fix shows both forms
    result = CliRunner().invoke(app, ["generate", "--draft", spec, "-n", "4", "x"])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and fragment in lines[0], result.stderr


@pytest.mark.parametrize("spec, fragment", [
    ("self:layers=7", "asks for layers the target does not have (it has 6)"),
    ("self:layers=0-6", "asks for layers the target does not have (it has 6)"),
    ("self:layers=6", "keeps all 6 of the target's layers"),
])
def test_layers_the_target_lacks_or_all_of_them_are_one_usage_line(spec, fragment):
    pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
    result = CliRunner().invoke(app, ["generate", "-t", "demo-target", "--draft", spec, "--backend", "mlx",
                                      "--method", "draft", "-n", "4", "x"])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and fragment in lines[0], result.stderr


def test_a_layer_draft_on_llama_cpp_says_plainly_it_is_unavailable(monkeypatch):
    """...before the target loads (a large target would take its time to be refused)."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from specrun.registry import loading

    def no_load(*args, **kwargs):
        raise AssertionError("the target was loaded before the layer draft was refused")

    monkeypatch.setattr(loading, "open_backend", no_load)
    result = CliRunner().invoke(app, ["generate", "-t", "demo-target", "--draft", "self:layers=2", "--backend",
                                      "llama", "--method", "draft", "-n", "4", "x"])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.stderr
    assert "llama.cpp's API cannot" in lines[0] and "--backend mlx" in lines[0]


@pytest.mark.parametrize("method", ["draft", "auto"])
def test_generate_with_a_layer_draft_gives_plain_decoding_s_text(method):
    """As the draft model alone and as auto's (issue 30, item 4: a layer draft takes part in auto
    through --draft, behind prompt lookup and the n-gram pool)."""
    pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
    common = ["generate", "def add(a, b):\n", "--raw", "--json", "-n", "32", "-t", "demo-target", "--backend", "mlx"]
    runner = CliRunner()
    plain = runner.invoke(app, [*common, "--method", "none"])
    drafted = runner.invoke(app, [*common, "--method", method, "--draft", "self:layers=4"])
    assert plain.exit_code == 0 and drafted.exit_code == 0, drafted.output
    import json

    assert json.loads(drafted.stdout)["text"] == json.loads(plain.stdout)["text"]
    assert json.loads(drafted.stdout)["stats"]["drafted"] > 0


def test_sampling_with_a_layer_draft_is_lossless(tiny_llama):
    """PIT and acceptance against a second copy of the target (lossless_harness), temperature 1."""
    from lossless_harness import real_scenario
    from specrun.sampling import SamplingSettings

    target, reference = mlx_target(tiny_llama), mlx_target(tiny_llama)
    draft = open_layer_draft(target, "self:layers=1")
    sampled, problems = real_scenario(target, draft, reference, "draft", SamplingSettings(temperature=1.0), False)
    assert problems == []
    assert 0 < sampled.verified.accepted < sampled.verified.tested
    for backend in (draft, target, reference):
        backend.close()


def test_a_layer_draft_tunes_apart_from_its_target(tiny_llama):
    from specrun.sessions.tuning import model_id

    target = mlx_target(tiny_llama)
    first, second = open_layer_draft(target, "self:layers=1"), open_layer_draft(target, "self:layers=1-1")
    assert len({model_id(target), model_id(first), model_id(second)}) == 3


def test_models_that_place_attention_kinds_by_layer_position_are_refused(tiny_llama, monkeypatch):
    """A cut list would give a layer another's mask or cache (gemma3's sliding pattern, llama's
    swa_idx); a body that fails the probe is refused in one line as well, never an internal error."""
    from specrun.errors import ModelFileError

    target = mlx_target(tiny_llama)
    monkeypatch.setattr(target.model.model, "swa_idx", 1, raising=False)
    with pytest.raises(ModelFileError, match="mixes sliding-window and full attention"):
        open_layer_draft(target, "self:layers=1")
    monkeypatch.setattr(target.model.model, "swa_idx", None)
    monkeypatch.setattr(target.model.model, "fa_idx", 1, raising=False)  # past a one-layer view's caches
    with pytest.raises(ModelFileError, match="cannot run a part of its layers"):
        open_layer_draft(target, "self:layers=1")
