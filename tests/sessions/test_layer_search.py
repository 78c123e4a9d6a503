"""`specrun tune --draft self:layers`: the search for the layers a layer-skip draft keeps, the
saved choice (layers.json), and bare ``--draft self:layers`` using it."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
from typer.testing import CliRunner

from model_factory import random_weights, tiny_config, tiny_tokenizer_json
from specrun.cli.app import app
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.errors import SpecrunError, UsageError
from specrun.modelkit import layer_choice
from specrun.modelkit.layer_choice import LayerChoice, layer_ranges, load_choices, save_choice, saved_choice
from specrun.modelkit.selfdraft import fingerprint, parse_self_draft
from specrun.sessions import layer_search
from specrun.sessions.layer_search import (
    DraftCost,
    agreement,
    calibrate_text,
    measure_draft_cost,
    modeled_speedup,
    search_layers,
)

PROMPTS = [[5, 17, 42, 9, 33, 2, 71], [88, 3, 14, 15, 92, 65]]
FLAT_COSTS = {n: 1.0 for n in range(1, 10)}  # a target pass costs the same over 1..9 tokens


def lines_of(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# ---- the objective -------------------------------------------------------------------------

def test_the_modeled_speedup_is_tokens_per_step_over_cost_at_the_best_draft_length():
    # α 0.5, a draft token half a target pass: k=1 gives 1.5 tokens for 1.5 passes; k=2 1.75 for 2.
    assert modeled_speedup(0.5, 0.5, FLAT_COSTS) == pytest.approx((1.0, 1))
    # α 0.9, a draft token a tenth of a pass: longer is better up to k=8, 6.12579511 tokens for 1.8 passes.
    speedup, draft_len = modeled_speedup(0.9, 0.1, FLAT_COSTS)
    assert draft_len == 8 and speedup == pytest.approx(6.12579511 / 1.8)
    # The target's own cost per token counted: T(2) = 1.2 T(1), α 0 gives one token for 1.45 passes.
    assert modeled_speedup(0.0, 0.25, {**FLAT_COSTS, 2: 1.2}) == pytest.approx((1 / 1.45, 1))
    # Every draft token accepted, each free, a pass of n tokens costing n: k+1 tokens for k+1 passes.
    assert modeled_speedup(1.0, 0.0, {n: float(n) for n in range(1, 10)}) == pytest.approx((1.0, 1))


# ---- the search on a tiny MLX model ---------------------------------------------------------

def llama_of(n_layers: int, folder):
    """A tiny random llama with ``n_layers`` layers, on MLX."""
    pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
    from specrun.backends.mlx import MlxBackend
    from specrun.modelkit.hf_io import write_hf_folder
    from specrun.modelkit.tokenizer import DEMO_CHAT_TEMPLATE

    config = dataclasses.replace(tiny_config("llama"), num_layers=n_layers)
    folder = write_hf_folder(folder / "hf", config, random_weights(config, seed=3),
                             tiny_tokenizer_json(config.vocab_size), DEMO_CHAT_TEMPLATE, dtype="float32")
    return MlxBackend(folder)


@pytest.fixture(scope="module")
def four_layer_target(tmp_path_factory):
    """Four layers (the shared tiny models have two: a search of one round)."""
    target = llama_of(4, tmp_path_factory.mktemp("four_layers"))
    yield target
    target.close()


@pytest.fixture(scope="module")
def calibration(four_layer_target):
    return calibrate_text(four_layer_target, PROMPTS, 12)


def test_the_calibration_text_is_each_prompt_and_the_target_s_greedy_continuation(four_layer_target, calibration):
    for prompt, text, start in zip(PROMPTS, calibration.texts, calibration.starts):
        plain = SpeculativeEngine(four_layer_target).run(prompt, GenerationParams(12, 0)).token_ids
        assert text == [*prompt, *plain] and start == len(prompt) - 1
    assert calibration.positions == sum(len(text) - start for text, start in zip(calibration.texts,
                                                                                calibration.starts))
    assert agreement(four_layer_target, calibration) == 1.0  # the target agrees with itself


def test_the_search_drops_the_layer_that_keeps_agreement_highest_and_keeps_the_best_objective(
        four_layer_target, calibration):
    rounds = []
    result = search_layers(four_layer_target, calibration, FLAT_COSTS, budget=600,
                           on_round=lambda number, scored, searched, seconds: rounds.append((scored, searched)))
    assert result.finished and result.searched == 4 + 3 + 2 and result.rounds == 3 and result.fewest == 1
    kept, scored_sets = tuple(range(4)), []
    for scored, searched in rounds:
        # Each candidate of the round scored again, apart from the search: the round keeps the highest α.
        candidates = [tuple(layer for layer in kept if layer != dropped) for dropped in kept]
        alphas = {}
        for candidate in candidates:
            draft = four_layer_target.layer_draft(candidate)
            alphas[candidate] = agreement(draft, calibration)
            draft.close()
        assert scored.kept == max(candidates, key=lambda candidate: alphas[candidate])
        assert scored.agreement == alphas[scored.kept]
        scored_sets += [(candidate, alpha) for candidate, alpha in alphas.items()]
        kept = scored.kept
    objectives = {candidate: modeled_speedup(alpha, len(candidate) / 4, FLAT_COSTS)
                  for candidate, alpha in scored_sets}
    best = max(objectives, key=lambda candidate: objectives[candidate][0])
    assert result.best.kept == best and (result.best.modeled_speedup, result.best.draft_len) == objectives[best]
    again = search_layers(four_layer_target, calibration, FLAT_COSTS, budget=600)
    assert again.best == result.best  # deterministic


def test_the_search_weighs_each_set_by_the_draft_cost_it_is_given(four_layer_target, calibration):
    # A head that costs half a pass whatever is kept: the objectives differ from the layers' share
    # alone, and the search's best is the best of what it scored under that cost.
    cost = DraftCost(0.5, 0.125)
    result = search_layers(four_layer_target, calibration, FLAT_COSTS, budget=600, draft_cost=cost)
    by_layers = search_layers(four_layer_target, calibration, FLAT_COSTS, budget=600)
    best = result.best
    assert (best.modeled_speedup, best.draft_len) == modeled_speedup(best.agreement, 0.5 + 0.125 * len(best.kept),
                                                                     FLAT_COSTS)
    assert by_layers.best.modeled_speedup != pytest.approx(result.best.modeled_speedup)
    # Every set the search scored keeps at least one layer, so no set beats a one-layer set's cost.
    assert best.modeled_speedup <= modeled_speedup(1.0, 0.625, FLAT_COSTS)[0]


def test_the_draft_cost_is_the_line_through_a_full_pass_and_a_half_draft_s(four_layer_target, monkeypatch):
    timed = []

    def passes(backend, prompt, counts, repeats=7):
        timed.append(backend.n_layers)
        return {1: 1.0 if backend is four_layer_target else 0.7}

    monkeypatch.setattr("specrun.sessions.tuning.time_passes", passes)
    cost = measure_draft_cost(four_layer_target, PROMPTS[0])
    assert timed == [4, 2]  # the target, then a draft of its first two layers
    # Two layers saved 0.3 of a pass: 0.15 a layer, and 1 - 4 x 0.15 = 0.4 fixed (the head, the call).
    assert cost.per_layer == pytest.approx(0.15) and cost.fixed == pytest.approx(0.4)
    assert cost(3) == pytest.approx(0.85) and cost(4) == pytest.approx(1.0)


@pytest.mark.parametrize("half", [1.0, 1.3, 0.0])
def test_a_half_draft_timed_no_cheaper_falls_back_to_the_layers_share(four_layer_target, monkeypatch, half):
    monkeypatch.setattr("specrun.sessions.tuning.time_passes",
                        lambda backend, prompt, counts, repeats=7: {1: 1.0 if backend is four_layer_target else half})
    cost = measure_draft_cost(four_layer_target, PROMPTS[0])
    assert cost == DraftCost.by_layers(4) == DraftCost(0.0, 0.25, measured=False)
    assert "layers' share" in cost.describe() and "measured)" not in cost.describe()


def test_tune_measures_the_draft_cost_and_searches_with_it(four_layer_target, monkeypatch):
    seen = {}
    original = layer_search.search_layers

    def spy(*args, **kwargs):
        result = original(*args, **kwargs)
        seen["cost"] = args[6] if len(args) > 6 else kwargs.get("draft_cost")
        return result

    monkeypatch.setattr(layer_search, "measure_draft_cost", lambda target, prompt: DraftCost(0.3, 0.175))
    monkeypatch.setattr(layer_search, "search_layers", spy)
    lines = []
    layer_search.tune_layers(four_layer_target, PROMPTS, 8, 600, "four", on_progress=lines.append)
    assert seen["cost"] == DraftCost(0.3, 0.175)
    assert "a draft's token costs 30% of a target pass and 17.5% a layer kept (measured)" in lines


def test_the_search_stops_at_its_budget(four_layer_target, calibration):
    ticks = itertools.count()  # a clock that moves one second each time it is read
    result = search_layers(four_layer_target, calibration, FLAT_COSTS, budget=2.5, clock=lambda: float(next(ticks)))
    # Read at the start (0), then before each set after the first: 1 and 2 are within 2.5 s, 3 is not.
    assert result.searched == 3 and result.rounds == 0 and not result.finished
    assert len(result.best.kept) == 3
    one = search_layers(four_layer_target, calibration, FLAT_COSTS, budget=0, clock=lambda: float(next(ticks)))
    assert one.searched == 1  # a set is always scored, so there is a choice to save


def test_a_target_of_one_layer_has_no_part_to_search(tmp_path):
    from specrun.sessions.layer_search import tune_layers

    target = llama_of(1, tmp_path)
    with pytest.raises(UsageError, match="one-layer has one layer: no part of it is cheaper to draft with"):
        tune_layers(target, PROMPTS, 8, 10, "one-layer")
    target.close()


# ---- the saved choice ------------------------------------------------------------------------

def a_choice(folder, kept=(0, 1, 3), n_layers=4, machine=None) -> LayerChoice:
    return LayerChoice(target="tiny", fingerprint=fingerprint(folder), machine=machine or layer_choice.machine_id(),
                       n_layers=n_layers, kept=kept, agreement=0.75, draft_len=3, modeled_speedup=1.25,
                       measured_speedup=0.8, tokens_per_second={"none": 40.0, "draft k=3": 32.0}, searched=9,
                       seconds=1.5)


def test_layer_ranges_write_what_self_layers_parses():
    assert layer_ranges((*range(14), *range(18, 30))) == "0-13,18-29"
    assert layer_ranges((0, 3, 5)) == "0,3,5" and layer_ranges((2,)) == "2"
    kept = (0, 1, 2, 5, 7, 8, 9)
    assert parse_self_draft("self:layers=" + layer_ranges(kept)).named == kept


def test_a_saved_choice_is_read_back_by_target_and_machine(tmp_path, tiny_llama, tiny_qwen2):
    path = tmp_path / "layers.json"
    mine = a_choice(tiny_llama.hf_dir)
    elsewhere = a_choice(tiny_llama.hf_dir, kept=(0,), machine="another machine")
    other_target = a_choice(tiny_qwen2.hf_dir, kept=(1,), n_layers=2)
    for choice in (mine, elsewhere, other_target):
        save_choice(choice, path)
    assert load_choices(path) == [mine, elsewhere, other_target]
    assert saved_choice(tiny_llama.hf_dir, path) == mine
    assert saved_choice(tiny_qwen2.hf_dir, path) == other_target
    assert mine.spec == "self:layers=0-1,3"
    assert saved_choice(tiny_llama.hf_dir, tmp_path / "none.json") is None


MALFORMED_FILES = {
    "not json": "{",
    "another version": json.dumps({"version": 99, "choices": {}}),
    "choices not an object": json.dumps({"version": 1, "choices": []}),
}
MISSING = object()
MALFORMED_ENTRIES = {  # a good entry with these fields changed (MISSING: left out)
    "kept past the last layer": {"kept": [0, 4]},
    "kept all layers": {"kept": [0, 1, 2, 3]},
    "kept out of order": {"kept": [1, 0]},
    "kept a string": {"kept": "0-3"},
    "agreement over 1": {"agreement": 1.5},
    "draft length 0": {"draft_len": 0},
    "a missing field": {"machine": MISSING},
    "an unknown field": {"extra": 1},
    "a rate that is not a number": {"tokens_per_second": {"none": "fast"}},
}


@pytest.mark.parametrize("case", [*MALFORMED_FILES, *MALFORMED_ENTRIES, "stored under another key"])
def test_a_damaged_choice_file_is_refused_in_one_line_naming_the_file_and_the_fix(tmp_path, tiny_llama, case):
    path = tmp_path / "layers.json"
    good = a_choice(tiny_llama.hf_dir)
    entry = dataclasses.asdict(good)
    for name, value in MALFORMED_ENTRIES.get(case, {}).items():
        entry[name] = value
    entry = {name: value for name, value in entry.items() if value is not MISSING}
    key = "0123456789abcdef" if case == "stored under another key" else good.key
    path.write_text(MALFORMED_FILES.get(case) or json.dumps({"version": 1, "choices": {key: entry}}))
    with pytest.raises(SpecrunError) as raised:
        load_choices(path)
    message = raised.value.one_line()
    assert str(path) in raised.value.problem and "\n" not in message
    assert raised.value.fix == f"delete {path} and run `specrun tune --draft self:layers` again"


def test_a_damaged_choice_file_stops_tune_show_and_generate_in_one_line(tiny_llama):
    path = layer_choice.choices_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[]")
    runner = CliRunner()
    for args in (["tune", "--show"], ["generate", "x", "-n", "4", "-t", str(tiny_llama.hf_dir), "--backend", "mlx",
                                      "-m", "draft", "--draft", "self:layers"]):
        if args[0] == "generate":
            pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
        result = runner.invoke(app, args)
        assert result.exit_code == 1 and len(lines_of(result.stderr)) == 1, result.output
        assert str(path) in result.stderr and "not a specrun layer-choice file" in result.stderr


# ---- bare --draft self:layers ----------------------------------------------------------------

def mlx_target(model):
    pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
    from specrun.backends.mlx import MlxBackend

    return MlxBackend(model.hf_dir)


def test_bare_self_layers_drafts_with_the_saved_layers_and_keeps_plain_decoding_s_text(tiny_llama):
    from specrun.drafters.methods import build_drafter
    from specrun.registry.loading import open_layer_draft

    target = mlx_target(tiny_llama)
    save_choice(a_choice(tiny_llama.hf_dir, kept=(1,), n_layers=2))
    draft = open_layer_draft(target, "self:layers", "tiny")
    assert draft.n_layers == 1 and draft.model.model.layers[0] is target.model.model.layers[1]
    prompt = PROMPTS[0]
    plain = SpeculativeEngine(target).run(prompt, GenerationParams(40, 0)).token_ids
    drafted = SpeculativeEngine(target, build_drafter("draft", draft)).run(prompt, GenerationParams(40, 4))
    assert drafted.token_ids == plain and drafted.stats.drafted > 0
    draft.close()
    target.close()


def test_bare_self_layers_without_a_saved_choice_says_how_to_tune(tiny_llama):
    from specrun.registry.loading import open_layer_draft

    target = mlx_target(tiny_llama)
    save_choice(a_choice(tiny_llama.hf_dir, kept=(1,), n_layers=2, machine="another machine"))
    with pytest.raises(UsageError) as raised:
        open_layer_draft(target, "self:layers", "tiny")
    assert raised.value.one_line() == ("no tuned layer choice for tiny on this machine; run `specrun tune --target "
                                       "tiny --draft self:layers --backend mlx`, or pass self:layers=N")
    save_choice(a_choice(tiny_llama.hf_dir, kept=(0, 1, 2), n_layers=4))  # a target with another depth
    with pytest.raises(SpecrunError, match="is for 4 layers, and the target has 2"):
        open_layer_draft(target, "self:layers", "tiny")
    target.close()


# ---- the command line ------------------------------------------------------------------------

def test_tune_searches_saves_and_generate_uses_the_choice(tiny_llama):
    pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
    folder = str(tiny_llama.hf_dir)
    runner = CliRunner()
    result = runner.invoke(app, ["tune", "-t", folder, "--backend", "mlx", "--draft", "self:layers", "--budget", "30",
                                 "--prompts", "1", "-n", "8"])
    assert result.exit_code == 0, result.output
    (choice,) = load_choices()
    # Two layers: each one alone is a candidate, and one of them is the choice.
    assert choice.kept in ((0,), (1,)) and choice.n_layers == 2 and choice.searched == 2
    assert set(choice.tokens_per_second) == {"none", f"draft k={choice.draft_len}"}
    assert choice.measured_speedup == pytest.approx(
        choice.tokens_per_second[f"draft k={choice.draft_len}"] / choice.tokens_per_second["none"])
    assert "keeps 1 of 2 layers" in result.stdout and f"{choice.measured_speedup:.2f}×" in result.stdout
    assert "searched 2 sets" in result.stderr and "saved to" in result.stderr
    assert ("plain decoding was faster here" in result.stdout) == (choice.measured_speedup < 1.0)
    shown = runner.invoke(app, ["tune", "--show"])
    assert shown.exit_code == 0 and f"keeps 1 of 2 layers: {choice.kept[0]}" in shown.stdout

    common = ["generate", "def add(a, b):\n", "--raw", "--json", "-n", "24", "-t", folder, "--backend", "mlx"]
    plain = runner.invoke(app, [*common, "--method", "none"])
    drafted = runner.invoke(app, [*common, "--method", "draft", "--draft", "self:layers", "-k", "3"])
    assert plain.exit_code == 0 and drafted.exit_code == 0, drafted.output
    assert json.loads(drafted.stdout)["text"] == json.loads(plain.stdout)["text"]
    assert json.loads(drafted.stdout)["stats"]["drafted"] > 0


@pytest.mark.parametrize("args, fragment", [
    (["--budget", "0"], "--budget must be between 1 and 86400, got 0"),
    (["--budget", "100000"], "--budget must be between 1 and 86400, got 100000"),
])
def test_a_budget_out_of_range_is_one_usage_line(args, fragment):
    result = CliRunner().invoke(app, ["tune", "--draft", "self:layers", *args])
    assert result.exit_code == 2 and lines_of(result.stderr) == [f"error: {fragment}; pass a valid --budget"]


def test_a_budget_without_the_layer_search_is_one_usage_line():
    result = CliRunner().invoke(app, ["tune", "--draft", "demo-draft", "--budget", "10"])
    assert result.exit_code == 2 and len(lines_of(result.stderr)) == 1
    assert "--budget is the layer search's" in result.stderr


def test_the_layer_search_on_a_llama_cpp_target_is_refused_in_one_line():
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    result = CliRunner().invoke(app, ["tune", "-t", "demo-target", "--backend", "llama", "--draft", "self:layers"])
    assert result.exit_code == 2 and len(lines_of(result.stderr)) == 1, result.output
    assert "llama.cpp's API cannot" in result.stderr and "--backend mlx" in result.stderr
    assert not layer_choice.choices_path().exists()


def test_models_check_says_a_layer_draft_needs_an_mlx_target(tiny_llama):
    runner = CliRunner()
    gguf_only = runner.invoke(app, ["models", "check", "-t", str(tiny_llama.gguf_path), "-d", "self:layers=1",
                                    "--json"])
    verdict = json.loads(gguf_only.stdout)
    assert gguf_only.exit_code == 1 and not verdict["compatible"]
    assert any("needs an MLX target" in problem for problem in verdict["problems"])
    both = runner.invoke(app, ["models", "check", "-t", "demo-target", "-d", "self:layers", "--json"])
    verdict = json.loads(both.stdout)
    assert both.exit_code == 0 and verdict["compatible"]
    assert any("MLX backend only" in note for note in verdict["notes"])
