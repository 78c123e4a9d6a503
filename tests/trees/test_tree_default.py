"""Token trees a run opens by itself (issue 28, item 5): where no tree option is given, the
target's stored pass costs decide. Where a pass costs about the same whatever it holds (a GPU)
second guesses pay and the run drafts trees; where each token of a pass costs most of a plain
step (this CPU: 0.45, docs/perf.md 3(f)) it keeps chains by itself."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from specrun.backends.fake import FakeBackend
from specrun.control.forecasts import TREE_MARGIN, predicted_tree_gain
from specrun.sessions.setup import DEFAULT_BRANCHES, TreeSettings, default_trees
from specrun.sessions.tuning import TuneResult

runner = CliRunner()
PROMPT = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n"
COUNTS = [1, 2, 5, 9, 25]


def cpu_like(n: int) -> float:
    return 1.0 + 0.45 * (n - 1)


def gpu_like(n: int) -> float:
    return 1.0 + 0.002 * (n - 1)


def stored(relative, counts=COUNTS) -> TuneResult:
    return TuneResult("k", "t", "none", "m", 0, 0.0, target_costs={n: 0.01 * relative(n) for n in counts},
                      learned=True)


def fake_target() -> FakeBackend:
    return FakeBackend(lambda context: np.zeros(16, dtype=np.float32), 16)


# ---- the prediction -------------------------------------------------------------------------
def test_second_guesses_are_predicted_to_pay_only_where_a_wider_pass_costs_little_more():
    assert predicted_tree_gain(cpu_like, DEFAULT_BRANCHES, 24) == 1.0  # not one sibling added
    assert predicted_tree_gain(gpu_like, DEFAULT_BRANCHES, 24) > TREE_MARGIN
    # a token at a twentieth of a plain step: a first sibling (worth ~0.075 tokens) does not pay
    assert predicted_tree_gain(lambda n: 1.0 + 0.05 * (n - 1), DEFAULT_BRANCHES, 24) == 1.0
    # the node budget bounds what is added: one node beside a chain of 4 is the likeliest
    # sibling, the first position's runner-up, worth (1 - 0.7) x 0.25 tokens
    chain_tokens = sum(0.7 ** depth for depth in range(5))
    one_sibling = ((chain_tokens + 0.3 * 0.25) / gpu_like(6)) / (chain_tokens / gpu_like(5))
    assert predicted_tree_gain(gpu_like, DEFAULT_BRANCHES, 5) == pytest.approx(one_sibling)


# ---- the choice -----------------------------------------------------------------------------
@pytest.mark.parametrize("relative, opens", [(gpu_like, True), (cpu_like, False)])
def test_trees_open_by_themselves_only_where_stored_costs_predict_they_pay(relative, opens):
    choice = default_trees("lookup", fake_target(), stored(relative), TreeSettings())
    assert (choice is not None) is opens
    if opens:
        assert choice.trees.branches == DEFAULT_BRANCHES and choice.trees.nodes > 0
        assert choice.predicted >= TREE_MARGIN and "predicted" in choice.describe()


@pytest.mark.parametrize("method, trees, entry", [
    ("lookup", TreeSettings(chain=True), stored(gpu_like)),  # --chain
    ("lookup", TreeSettings(12, 2), stored(gpu_like)),  # trees asked: the user's, not ours
    ("none", TreeSettings(), stored(gpu_like)),  # nothing drafts
    ("lookahead", TreeSettings(), stored(gpu_like)),  # a window is a tree of its own sizing
    ("lookup", TreeSettings(), None),  # no earlier run: nothing is probed
    ("lookup", TreeSettings(), stored(gpu_like, [1, 2])),  # costs that say nothing of wider passes
])
def test_no_trees_of_its_own_where_asked_otherwise_or_nothing_is_known(method, trees, entry):
    assert default_trees(method, fake_target(), entry, trees) is None


# ---- the commands ---------------------------------------------------------------------------
def generate(*args: str):
    from specrun.cli.app import app

    result = runner.invoke(app, ["generate", PROMPT, "--raw", "--json", "-n", "40", "--target", "demo-target",
                                 "--backend", "llama", "--exact", "--threads", "1", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), result.stderr


@pytest.mark.parametrize("relative, opens", [(gpu_like, True), (cpu_like, False)])
def test_generate_drafts_trees_where_the_stored_costs_say_so_and_keeps_plain_decoding_s_text(relative, opens,
                                                                                           monkeypatch):
    """llama.cpp's chains context is re-created with a sequence per path before anything is
    fed, a note says so, and (--exact) the text is plain decoding's; --chain keeps chains."""
    pytest.importorskip("llama_cpp")
    import specrun.sessions.generation as generation

    monkeypatch.setattr(generation, "load_target_entry", lambda target, threads: stored(relative))
    opened = []
    reopen = generation.default_trees

    def recording(*args, **kwargs):
        choice = reopen(*args, **kwargs)
        opened.append((choice, args[1].tree_support))
        return choice

    monkeypatch.setattr(generation, "default_trees", recording)
    plain, _ = generate("--method", "none")
    result, notes = generate("--method", "lookup")
    assert result["text"] == plain["text"]
    assert ("token trees of up to" in notes) is opens
    choice, support = opened[-1]
    assert (choice is not None) is opens and support.available is opens
    chained, notes = generate("--method", "lookup", "--chain")
    assert chained["text"] == plain["text"] and "token trees" not in notes


@pytest.mark.parametrize("relative, opens", [(gpu_like, True), (cpu_like, False)])
def test_a_chat_and_a_bench_open_trees_as_generate_does(relative, opens, monkeypatch):
    pytest.importorskip("llama_cpp")
    import specrun.sessions.chat as chat
    import specrun.sessions.generation as generation
    from specrun.bench.runner import BenchConfig, run_bench
    from specrun.bench.suite import BUILTIN_SUITE
    from specrun.engine.events import Finished
    from specrun.engine.loop import GenerationParams
    from specrun.registry.loading import LoadOptions

    import specrun.sessions.setup as setup

    monkeypatch.setattr(chat, "load_target_entry", lambda target, threads: stored(relative))
    monkeypatch.setattr(generation, "load_target_entry", lambda target, threads: stored(relative))
    monkeypatch.setattr(setup, "load_target_entry", lambda target, threads: stored(relative))  # bench reads it there
    load = LoadOptions(backend="llama", threads=1, exact=True)
    notes: list[str] = []
    with chat.open_chat("demo-target", None, "lookup", load, on_note=notes.append) as session:
        ids = session.target.tokenize(PROMPT, add_bos=session.target.vocab.add_bos)
        [result] = [e.result for e in session.stream(ids, GenerationParams(32, 0)) if isinstance(e, Finished)]
        assert session.target.tree_support.available is opens
    with chat.open_chat("demo-target", None, "none", load) as plain_session:
        [plain] = [e.result for e in plain_session.stream(ids, GenerationParams(32, 0)) if isinstance(e, Finished)]
    assert result.token_ids == plain.token_ids
    assert any(note.startswith("token trees of up to") for note in notes) is opens

    bench = run_bench(BenchConfig("demo-target", None, ("none", "lookup"), max_new_tokens=24, load=load),
                      BUILTIN_SUITE[:2])
    assert any(note.startswith("token trees of up to") for note in bench.notes) is opens
    assert (bench.config.trees.branches == DEFAULT_BRANCHES) is opens
    assert bench.comparison.mismatches.get("lookup", []) == []
