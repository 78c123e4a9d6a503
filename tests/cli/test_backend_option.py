"""--backend other than auto, llama or mlx: one usage error on every command that takes it, before
anything is said or loaded (demo printed its loading lines, bench its pair and prompts, first)."""

from __future__ import annotations

import pytest

from tests.cli.test_cli_accept import invoke


@pytest.mark.parametrize("args", [
    ("generate", "-t", "demo-target", "hello"), ("chat", "-t", "demo-target"), ("serve", "-t", "demo-target"),
    ("bench", "-t", "demo-target"), ("demo", "-t", "demo-target"), ("tune", "-t", "demo-target"),
    ("heads", "train", "-t", "demo-target", "--heads-out", "heads.safetensors"), ("models", "rm", "demo-target"),
    ("models", "pull", "demo-target"), ("models", "pull", "no-such-model"),
    ("distill", "--target", "demo-target", "--student", "self:layers=1", "--out", "d", "--batch", "0"),
])
def test_an_unknown_backend_is_one_usage_error_before_anything_else(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke(*args, "--backend", "foo", input="hi\n")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == ["error: unknown backend 'foo'; use one of: auto, llama, mlx"]
    assert result.stdout == "" and list(tmp_path.iterdir()) == []
