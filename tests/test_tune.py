"""`specrun tune`: calibration is saved per pair and machine, and later runs use it."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specrun.cli import app

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")


@pytest.fixture()
def config_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    return tmp_path


def test_tune_saves_and_generate_uses_the_best_settings(config_home, tiny_llama):
    path = str(tiny_llama.gguf_path)
    runner = CliRunner()
    result = runner.invoke(app, ["tune", "-t", path, "-d", path, "--prompts", "1", "-n", "16"])
    assert result.exit_code == 0, result.output
    tuned_file = config_home / "specrun" / "tuned.json"
    saved = json.loads(tuned_file.read_text())
    (entry,) = saved["pairs"].values()
    rates = entry["tokens_per_second"]
    assert {"none", *(f"draft k={k}" for k in (1, 2, 3, 4, 6, 8))} <= set(rates)
    assert entry["acceptance"] == 1.0  # draft == target
    # Whether speculation pays with a draft as costly as the target is for the clock to say;
    # round 2 (confidence stops, beside plain decoding again) runs only when it did.
    if entry["best_draft_len"]:
        assert "none (round 2)" in rates and "draft k=8 p>=0.5" in rates
        assert entry["best_min_prob"] in (0.0, 0.3, 0.5, 0.7)
    else:
        assert entry["best_min_prob"] == 0.0 and entry["speedup"] == 1.0
    assert sorted(int(n) for n in entry["target_costs"]) == list(range(1, 10))

    shown = runner.invoke(app, ["tune", "--show"])
    assert shown.exit_code == 0
    assert "tuned settings" in shown.stdout and f"{entry['speedup']:.2f}×" in shown.stdout

    # Later runs take the saved settings unless told otherwise.
    entry.update(best_draft_len=3, best_min_prob=0.7)
    tuned_file.write_text(json.dumps(saved))
    base = ["generate", "def f():", "-t", path, "-d", path, "-n", "8", "--json", "-m", "draft"]
    stats = json.loads(runner.invoke(app, base).stdout)["stats"]
    assert (stats["draft_len"], stats["draft_min_prob"]) == (3, 0.7)
    explicit = json.loads(runner.invoke(app, [*base, "-k", "5", "--draft-min-prob", "0"]).stdout)["stats"]
    assert (explicit["draft_len"], explicit["draft_min_prob"]) == (5, 0.0)
    auto = json.loads(runner.invoke(app, [*base[:-2], "-m", "auto"]).stdout)["stats"]
    assert (auto["method"], auto["draft_len"], auto["draft_min_prob"]) == ("auto", 8, 0.7)  # 8: auto's longest


def test_a_corrupt_tune_file_is_one_line(config_home, tiny_llama):
    (config_home / "specrun").mkdir()
    (config_home / "specrun" / "tuned.json").write_text("{not json")
    result = CliRunner().invoke(app, ["tune", "--show"])
    assert result.exit_code == 1
    assert "cannot read tuned settings" in result.stderr and "specrun tune" in result.stderr


def test_calibration_picks_the_fastest_length_then_the_fastest_stop(monkeypatch, tiny_llama):
    """The choice itself, with the measured rates set: round 1 picks k, round 2 a stop at k or at 8."""
    from specrun import tuning
    from specrun.loading import LoadOptions, open_pair

    rounds = {
        1: {"none": 100.0, "draft k=1": 110.0, "draft k=2": 130.0, "draft k=3": 125.0, "draft k=4": 120.0,
            "draft k=6": 90.0, "draft k=8": 80.0},
        2: {"none": 95.0, "draft k=2": 128.0, "draft k=2 p>=0.3": 131.0, "draft k=2 p>=0.5": 127.0,
            "draft k=2 p>=0.7": 120.0, "draft k=8": 78.0, "draft k=8 p>=0.3": 140.0, "draft k=8 p>=0.5": 150.0,
            "draft k=8 p>=0.7": 145.0},
    }
    seen = {}

    def measured(target, draft, prompts, max_new_tokens, configs, on_progress, round_number):
        seen[round_number] = configs
        return {name: rounds[round_number][name] for name in configs}, 3, 4

    monkeypatch.setattr(tuning, "_interleaved", measured)
    monkeypatch.setattr(tuning, "_verify_costs", lambda target, prompt: {1: 0.001})
    path = str(tiny_llama.gguf_path)
    target, draft = open_pair(path, path, LoadOptions(threads=1))
    result = tuning.calibrate(target, draft, [[1, 2, 3]], 8, "key")
    target.close()
    draft.close()
    assert seen[2]["draft k=8 p>=0.5"] == (8, 0.5) and seen[2]["draft k=2"] == (2, 0.0)
    assert (result.best_draft_len, result.best_min_prob) == (8, 0.5)
    assert result.speedup == pytest.approx(150.0 / 95.0)  # against round 2's own plain decoding
    assert result.tokens_per_second["none (round 2)"] == 95.0 and result.acceptance == 0.75
