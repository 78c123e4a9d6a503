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


def test_tune_saves_and_generate_uses_the_best_draft_length(config_home, tiny_llama):
    path = str(tiny_llama.gguf_path)
    runner = CliRunner()
    result = runner.invoke(app, ["tune", "-t", path, "-d", path, "--prompts", "1", "-n", "16"])
    assert result.exit_code == 0, result.output
    saved = json.loads((config_home / "specrun" / "tuned.json").read_text())
    (entry,) = saved["pairs"].values()
    assert set(entry["tokens_per_second"]) == {"none", *(f"draft k={k}" for k in (1, 2, 3, 4, 6, 8))}
    assert entry["acceptance"] == 1.0  # draft == target
    assert sorted(int(n) for n in entry["target_costs"]) == list(range(1, 10))

    shown = runner.invoke(app, ["tune", "--show"])
    assert shown.exit_code == 0
    assert "tuned settings" in shown.stdout and f"{entry['speedup']:.2f}×" in shown.stdout

    generated = runner.invoke(app, ["generate", "def f():", "-t", path, "-d", path, "-n", "8", "--json"])
    assert json.loads(generated.stdout)["stats"]["draft_len"] == entry["best_draft_len"]
    explicit = runner.invoke(app, ["generate", "def f():", "-t", path, "-d", path, "-n", "8", "-k", "3", "--json"])
    assert json.loads(explicit.stdout)["stats"]["draft_len"] == 3


def test_a_corrupt_tune_file_is_one_line(config_home, tiny_llama):
    (config_home / "specrun").mkdir()
    (config_home / "specrun" / "tuned.json").write_text("{not json")
    result = CliRunner().invoke(app, ["tune", "--show"])
    assert result.exit_code == 1
    assert "cannot read tuned settings" in result.stderr and "specrun tune" in result.stderr
