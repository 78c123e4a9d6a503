"""`specrun generate --branches N`: token trees from the command line, lossless, with a one-line
note where the target cannot verify trees; `--method lookahead`, whose window is a tree, and its
`--lookahead` sizes."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specrun.cli.app import app
from specrun.drafters.lookahead import LookaheadSizes
from specrun.sessions.setup import DEFAULT_BRANCHES, TreeSettings, resolve_trees

runner = CliRunner()
PROMPT = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n"


def generate_json(*args: str) -> dict:
    result = runner.invoke(app, ["generate", PROMPT, "--raw", "--json", "-n", "48", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def record_loads(monkeypatch) -> list:
    """The LoadOptions of every model the CLI opens, in order."""
    import specrun.registry.loading

    opened = []
    load = specrun.registry.loading._load
    monkeypatch.setattr(specrun.registry.loading, "_load",
                        lambda kind, path, options: opened.append(options) or load(kind, path, options))
    return opened


@pytest.mark.parametrize("backend", ["llama", "mlx"])
def test_branches_give_the_same_greedy_text_and_reach_the_target(backend, monkeypatch):
    """--exact: llama.cpp's batched and one-token kernels round alike, so any difference would
    be a defect. The target is opened able to hold trees (llama.cpp: one sequence per path)."""
    pytest.importorskip({"llama": "llama_cpp", "mlx": "mlx_lm"}[backend])
    opened = record_loads(monkeypatch)
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
    from specrun.sessions.setup import TreeSettings

    notes: list[str] = []

    def request(branches: int) -> GenerateRequest:
        return GenerateRequest(PROMPT, "demo-target", None, method="ngram", max_new_tokens=32, chat=False,
                               load=LoadOptions(backend="llama", exact=True),  # no tree_paths
                               drafter_options=DrafterOptions(branches=branches), on_note=notes.append,
                               trees=TreeSettings(8, branches))

    with_branches = generate_text(request(3))
    assert len(notes) == 1 and notes[0].startswith("token trees are off: ") and "verifying chains" in notes[0]
    assert with_branches.token_ids == generate_text(request(0)).token_ids
    assert len(notes) == 1  # no note without branches


@pytest.mark.parametrize("args, message", [
    (["--tree-nodes", "0"], "--tree-nodes must be between 1 and 64, got 0"),
    (["--tree-nodes", "65"], "--tree-nodes must be between 1 and 64, got 65"),
    (["--chain", "--tree-nodes", "8"], "--chain and --tree-nodes contradict each other"),
    (["--chain", "--branches", "2"], "--chain and --branches contradict each other"),
])
def test_tree_options_out_of_range_or_contradicting_are_usage_errors(args, message):
    result = runner.invoke(app, ["generate", "x", *args])
    assert result.exit_code == 2
    assert message in result.output and len(result.output.strip().splitlines()) == 1


def test_tree_nodes_alone_turns_trees_on_with_the_default_branches_and_chain_keeps_them_off():
    from specrun.sessions.setup import DEFAULT_BRANCHES, TreeSettings, resolve_trees

    assert resolve_trees(False, 8, None) == TreeSettings(8, DEFAULT_BRANCHES)
    assert resolve_trees(False, None, 2).nodes > 0 and resolve_trees(False, None, 2).paths == 3
    assert resolve_trees(False, None, None) == TreeSettings()
    assert resolve_trees(True, None, None) == TreeSettings(chain=True)


@pytest.mark.parametrize("method", ["auto", "draft"])
@pytest.mark.parametrize("backend", ["llama", "mlx"])
def test_tree_nodes_gives_the_same_greedy_text(backend, method, monkeypatch):
    """--tree-nodes alone: the drafters branch (4 second guesses), the target holds 5 paths, the
    adaptive policy keeps what pays, and the text is the chains' (--exact)."""
    pytest.importorskip({"llama": "llama_cpp", "mlx": "mlx_lm"}[backend])
    opened = record_loads(monkeypatch)
    common = ["--backend", backend, "--method", method, "--exact"]
    assert generate_json(*common, "--tree-nodes", "16")["text"] == generate_json(*common, "--chain")["text"]
    assert [options.tree_paths for options in opened if options.tree_paths] == [5]


def test_bench_with_trees_gives_every_line_the_baseline_s_text_and_records_them(monkeypatch, tmp_path):
    """bench --tree-nodes opens the target for trees, has drafters branch, and records it in
    the JSON; greedy, every line keeps plain decoding's text (--exact: bit for bit)."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    opened = record_loads(monkeypatch)
    out = tmp_path / "bench.json"
    result = runner.invoke(app, ["bench", "--backend", "llama", "--exact", "--methods", "none,draft,lookup",
                                 "-k", "4", "--tree-nodes", "12", "--branches", "2", "--categories",
                                 "code-completion", "--per-category", "1", "-n", "24", "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert (doc["config"]["tree_nodes"], doc["config"]["branches"]) == (12, 2)
    assert opened[0].tree_paths == 3 and opened[1].tree_paths == 0  # the target's paths; the draft drafts chains
    assert doc["mismatches"] == [] and all(run["same_as_baseline"] for run in doc["runs"])


# ---- lookahead: its window is a tree whatever --branches says -------------------------------
@pytest.mark.parametrize("backend", ["llama", "mlx"])
def test_lookahead_gives_plain_decoding_s_text_with_the_target_opened_for_its_tree(backend, monkeypatch):
    """--exact: any difference would be a defect. The window is a tree whatever --branches says:
    llama.cpp opens the target with a sequence per path the window and candidates may bring."""
    pytest.importorskip({"llama": "llama_cpp", "mlx": "mlx_lm"}[backend])
    import specrun.registry.loading

    opened = []
    load = specrun.registry.loading._load
    monkeypatch.setattr(specrun.registry.loading, "_load",
                        lambda kind, path, options: opened.append(options) or load(kind, path, options))
    common = ["--backend", backend, "--exact"]
    plain = generate_json(*common, "--method", "none")
    lookahead = generate_json(*common, "--method", "lookahead", "--lookahead", "4:3:2", "-k", "8")
    assert lookahead["text"] == plain["text"]
    assert lookahead["stats"]["drafted"] > 0
    assert [options.tree_paths for options in opened] == [0, 4 + 2]


@pytest.mark.parametrize("args, message", [
    (["--method", "lookahead", "--lookahead", "1:4:3"], "--lookahead window must be 2 to 32, got 1"),
    (["--method", "lookahead", "--lookahead", "5:9:3"], "--lookahead ngram must be 2 to 8, got 9"),
    (["--method", "lookahead", "--lookahead", "5:4:33"], "--lookahead candidates must be 0 to 32, got 33"),
    (["--method", "lookahead", "--lookahead", "5:4"], "--lookahead takes WINDOW:NGRAM:CANDIDATES, got '5:4'"),
    (["--method", "lookahead", "--lookahead", "5:-4:3"], "--lookahead takes WINDOW:NGRAM:CANDIDATES"),
    (["--method", "lookup", "--lookahead", "5:4:3"], "--lookahead sets the lookahead method's window"),
    (["--method", "lookahead", "--chain"], "--chain contradicts --method lookahead"),
    (["--method", "lookahead", "--lookahead", "5:4:3", "--tree-nodes", "8"],
     "--tree-nodes 8 cannot hold the lookahead window"),
    (["--method", "lookahead", "--tree-nodes", "8"], "--tree-nodes 8 cannot hold the smallest lookahead window"),
])
def test_lookahead_sizes_out_of_range_or_contradicting_are_usage_errors(args, message):
    result = runner.invoke(app, ["generate", "x", *args])
    assert result.exit_code == 2
    assert message in result.output and len(result.output.strip().splitlines()) == 1


def test_bench_refuses_lookahead_sizes_without_a_lookahead_method():
    result = runner.invoke(app, ["bench", "--methods", "none,lookup", "--lookahead", "5:4:3"])
    assert result.exit_code == 2
    assert "--lookahead sets the lookahead method's window" in result.output


def test_a_lookahead_method_turns_trees_on_for_its_window_alone():
    sizes = LookaheadSizes(5, 4, 3)
    assert resolve_trees(False, None, None, sizes) == TreeSettings(sizes.max_nodes, 0, 8)
    assert resolve_trees(False, None, None, sizes).paths == 8  # window columns + candidates
    # trees asked for as well: their nodes and branches, and paths enough for both
    assert resolve_trees(False, 40, None, sizes) == TreeSettings(40, DEFAULT_BRANCHES, 8)
    assert resolve_trees(False, None, 9, LookaheadSizes(2, 3, 0)).paths == 10
    assert resolve_trees(True, None, None, sizes) == TreeSettings(chain=True)


@pytest.mark.parametrize("tree_paths, message", [
    (2, "method 'lookahead' verifies a token tree of up to 5 paths, and this target was opened for 2"),
])
def test_switching_a_chat_to_lookahead_on_a_target_opened_for_fewer_paths_is_refused(tree_paths, message):
    """Verified as a chain, the window would learn nothing and every pass would cost more. (A
    target opened for chains alone is made again for the window's trees: tests/sessions/test_chat.py.)"""
    pytest.importorskip("llama_cpp")
    from specrun.errors import UsageError
    from specrun.registry.loading import LoadOptions
    from specrun.sessions.chat import open_chat

    with open_chat("demo-target", None, "lookup", LoadOptions(backend="llama", tree_paths=tree_paths)) as session:
        with pytest.raises(UsageError, match="verifies a token tree") as refused:
            session.set_method("lookahead")
        assert str(refused.value).startswith(message)
        assert session.method == "lookup"  # the session goes on as it was


def test_bench_runs_lookahead_only_when_named():
    """Its window opens the target for trees, which would change every other line's pass."""
    from specrun.cli.bench import parse_methods

    assert "lookahead" not in parse_methods(None, has_draft=True)
    assert parse_methods("lookahead", has_draft=False) == ("none", "lookahead")
    result = runner.invoke(app, ["bench", "--chain", "--methods", "none,lookahead"])
    assert result.exit_code == 2 and "--chain contradicts --method lookahead" in result.output
