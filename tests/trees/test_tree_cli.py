"""`specrun generate --branches N`: token trees from the command line, lossless, with a one-line
note where the target cannot verify trees."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specrun.cli.app import app

runner = CliRunner()
PROMPT = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n"


def generate_json(*args: str) -> dict:
    result = runner.invoke(app, ["generate", PROMPT, "--raw", "--json", "-n", "48", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("backend", ["llama", "mlx"])
def test_branches_give_the_same_greedy_text_and_reach_the_target(backend, monkeypatch):
    """--exact: llama.cpp's batched and one-token kernels round alike, so any difference would
    be a defect. The target is opened able to hold trees (llama.cpp: one sequence per path)."""
    pytest.importorskip({"llama": "llama_cpp", "mlx": "mlx_lm"}[backend])
    import specrun.registry.loading

    opened = []
    load = specrun.registry.loading._load
    monkeypatch.setattr(specrun.registry.loading, "_load",
                        lambda kind, path, options: opened.append(options) or load(kind, path, options))
    common = ["--backend", backend, "--method", "lookup+ngram", "--exact"]
    chains = generate_json(*common)
    trees = generate_json(*common, "--branches", "3")
    assert trees["text"] == chains["text"]
    assert [options.tree_paths for options in opened] == [0, 4]  # the chains' run, then the trees'


def test_branches_out_of_range_is_a_usage_error():
    result = runner.invoke(app, ["generate", "x", "--branches", "9"])
    assert result.exit_code == 2
    assert "--branches must be between 0 and 8" in result.output


def test_a_target_without_trees_says_so_in_one_line_and_verifies_chains():
    """The llama.cpp target opened without tree paths stands for any target that cannot hold a
    tree (MLX's rotating or quantized caches): one note, then the chain, losslessly."""
    pytest.importorskip("llama_cpp")
    from specrun.drafters.methods import DrafterOptions
    from specrun.registry.loading import LoadOptions
    from specrun.sessions.generation import GenerateRequest, generate_text

    notes: list[str] = []

    def request(branches: int) -> GenerateRequest:
        return GenerateRequest(PROMPT, "demo-target", None, method="ngram", max_new_tokens=32, chat=False,
                               load=LoadOptions(backend="llama", exact=True),  # no tree_paths
                               drafter_options=DrafterOptions(branches=branches), on_note=notes.append)

    with_branches = generate_text(request(3))
    assert len(notes) == 1 and notes[0].startswith("token trees are off: ") and "verifying chains" in notes[0]
    assert with_branches.token_ids == generate_text(request(0)).token_ids
    assert len(notes) == 1  # no note without branches
