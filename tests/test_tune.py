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
    assert entry["best_draft_len"] > 0  # a draft identical to the target always pays here
    # Round 2 tried confidence stops at the best length and the longest, beside plain decoding again.
    assert "none (round 2)" in rates and "draft k=8 p>=0.5" in rates
    assert entry["best_min_prob"] in (0.0, 0.3, 0.5, 0.7)
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
