"""Lookahead's sizes chosen from this machine's pass costs, its gate started off where it cannot
pay, what a run remembers for the next, and auto drafting with a window where the costs say so
(issue 30, items 3 and 4)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from specrun.backends.fake import FakeBackend
from specrun.control import forecasts
from specrun.control.forecasts import TOKENS_PER_PASS, choose_sizes, predicted_speedup
from specrun.control.policy import AdaptivePolicy
from specrun.drafters.lookahead import LADDER, LookaheadDrafter
from specrun.drafters.lookup import PromptLookupDrafter
from specrun.drafters.methods import DrafterOptions, build_drafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.sessions import lookahead_sizing as sizing
from specrun.sessions.setup import size_lookahead
from specrun.sessions.tuning import TuneResult

SMALLEST, WIDEST = LADDER[0], LADDER[-1]


def cpu_like(n: int) -> float:
    """Each token of a pass costs 0.45 of a plain step (docs/perf.md 3(f), SmolLM2 on 2 cores)."""
    return 1.0 + 0.45 * (n - 1)


def gpu_like(n: int) -> float:
    """A memory-bound pass: 200 tokens cost about what one does."""
    return 1.0 + 0.002 * (n - 1)


def seconds_of(relative, counts, plain: float = 0.01) -> dict[int, float]:
    return {n: plain * relative(n) for n in counts}


# ---- the choice -----------------------------------------------------------------------------
def test_a_pass_as_dear_as_its_tokens_picks_the_smallest_window_and_predicts_a_loss():
    sizes, predicted = choose_sizes(cpu_like)
    assert sizes == SMALLEST
    assert predicted == pytest.approx(TOKENS_PER_PASS[SMALLEST] / cpu_like(1 + SMALLEST.max_nodes))
    assert predicted < 1.0


def test_a_flat_pass_cost_picks_the_window_that_yields_most():
    sizes, predicted = choose_sizes(gpu_like)
    best_yield = max(LADDER, key=lambda each: TOKENS_PER_PASS[each] / gpu_like(1 + each.max_nodes))
    assert sizes == best_yield and sizes != SMALLEST
    assert predicted == pytest.approx(predicted_speedup(sizes, gpu_like)) and predicted > 1.0


def test_only_sizes_the_opened_target_holds_are_chosen():
    fits = forecasts.fitting(max_nodes=0, max_paths=SMALLEST.paths)
    assert choose_sizes(gpu_like, fits)[0] == SMALLEST
    assert [sizes for sizes in LADDER if forecasts.fitting(30, 0)(sizes)] == [s for s in LADDER if s.max_nodes <= 30]


def test_stored_costs_say_enough_only_with_plain_decoding_and_a_window_wide_pass():
    assert not forecasts.covers(None) and not forecasts.covers({})
    assert not forecasts.covers({1: 0.01, 5: 0.02})  # chains' passes only
    assert not forecasts.covers({2: 0.01, 40: 0.02})  # no plain pass
    assert forecasts.covers({1: 0.01, 1 + SMALLEST.max_nodes: 0.02})


def test_relative_costs_extend_the_measured_passes_by_a_line():
    relative = forecasts.relative_costs(seconds_of(cpu_like, [1, 2, 5, 10]))
    assert relative(1) == pytest.approx(1.0)
    assert relative(10) == pytest.approx(cpu_like(10), rel=0.05)
    assert relative(60) == pytest.approx(cpu_like(60), rel=0.1)  # extrapolated, not measured


@pytest.mark.parametrize("relative, probed", [(cpu_like, 1), (gpu_like, len(LADDER))])
def test_the_probe_stops_once_no_wider_window_can_pay(relative, probed):
    """On a CPU one window-wide pass already costs more plain steps than any size yields tokens."""
    asked: list[list[int]] = []

    def time_passes(counts):
        asked.append(list(counts))
        return seconds_of(relative, counts)

    costs = sizing.probe_costs(time_passes, lambda sizes: True)
    assert asked[0] == [1]
    assert asked[1:] == [[1 + sizes.max_nodes] for sizes in LADDER[:probed]]
    assert set(costs) == {1, *(1 + sizes.max_nodes for sizes in LADDER[:probed])}


# ---- the gate -------------------------------------------------------------------------------
def lone_window_policy() -> AdaptivePolicy:
    policy = AdaptivePolicy()
    policy.set_drafter(LookaheadDrafter())
    policy.configure(16, adaptive=True, max_nodes=30)
    return policy


def test_a_gate_started_off_decodes_plainly_for_its_gap_then_retries():
    policy = lone_window_policy()
    policy.start_gate_off(5)
    policy.start_text(10)
    assert not policy.gate.speculating and policy.gate_off_gap == 5
    for _ in range(5):
        policy.gate.record(1, 0.01, False, 0.01)
    assert policy.gate.speculating  # the retry
    policy.start_text(10)  # the next text starts speculating: the start-off was for one text
    assert policy.gate.speculating


def test_a_lone_window_left_off_by_one_text_starts_the_next_off_and_a_chain_does_not():
    policy = lone_window_policy()
    policy.start_text(10)
    policy.gate.start_off(64)  # as the gate leaves it after judging the window slower
    policy.start_text(10)
    assert not policy.gate.speculating and policy.gate.gap == 64
    chain = AdaptivePolicy()
    chain.set_drafter(build_drafter("lookup+ngram", None))
    chain.configure(16, adaptive=True)
    chain.start_text(10)
    chain.gate.start_off(64)
    assert chain.gate_off_gap == 0  # its loss follows the text: the next text speculates first
    chain.start_text(10)
    assert chain.gate.speculating


def test_a_lone_window_left_off_stays_off_through_a_new_text():
    """A server's next request and a new chat forget acceptance (ChatSession.new_text): the
    window's loss is the machine's price of its pass, so the next text still starts off."""
    policy = lone_window_policy()
    policy.start_text(10)
    policy.gate.start_off(64)
    policy.forget_acceptance()
    policy.start_text(10)
    assert not policy.gate.speculating and policy.gate.gap == 64


# ---- runs: the choice, what they remember, auto ---------------------------------------------
runner = CliRunner()
PROMPT = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n"


def generate(*args: str):
    result = runner.invoke(app_(), ["generate", PROMPT, "--raw", "--json", "-n", "32", "--target", "demo-target",
                                    "--backend", "llama", "--exact", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), result.stderr


def app_():
    from specrun.cli.app import app

    return app


def learned_entries(config) -> list[dict]:
    path = config / "specrun" / "learned.json"
    return list(json.loads(path.read_text())["pairs"].values()) if path.exists() else []


def test_lookahead_without_sizes_chooses_them_says_so_and_the_next_run_reads_the_costs(tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp")
    import specrun.sessions.tuning as tuning

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    plain, _ = generate("--method", "none")
    first, notes = generate("--method", "lookahead")
    assert first["text"] == plain["text"]
    assert "note: lookahead " in notes and "chosen from this machine's pass costs, predicted" in notes
    [entry] = learned_entries(tmp_path)
    assert entry["draft"] == tuning.NO_DRAFT and forecasts.covers({int(n): s for n, s in entry["target_costs"].items()})

    def no_probe(*args, **kwargs):
        raise AssertionError("the stored costs were enough: no probe")

    monkeypatch.setattr(tuning, "time_passes", no_probe)
    second, notes = generate("--method", "lookahead")
    assert second["text"] == plain["text"] and "chosen from this machine's pass costs" in notes


def test_a_window_predicted_slower_starts_its_gate_off(monkeypatch):
    """Predicted below plain decoding's speed, the window is first tried after a plain stretch."""
    target = FakeBackend(lambda context: __import__("numpy").eye(16, dtype="float32")[(context[-1] + 1) % 16], 16)
    params = GenerationParams(32, 16, adaptive=True, tree_nodes=WIDEST.max_nodes)
    stored = TuneResult("k", "t", "none", "m", 0, 0.0, target_costs=seconds_of(cpu_like, [1, 10, 24]), learned=True)
    options, params, choice = size_lookahead("lookahead", target, DrafterOptions(), params, stored, [1, 2, 3])
    assert options.lookahead == SMALLEST and choice.predicted < 1.0
    engine = SpeculativeEngine(target, build_drafter("lookahead", None, options), method="lookahead")
    engine.policy.start_gate_off(8)
    result = engine.run([1, 2, 3], params)
    assert result.stats.by_source["none"].steps >= 8  # plain first


@pytest.mark.parametrize("relative, joins", [(gpu_like, True), (cpu_like, False)])
def test_auto_drafts_with_a_window_only_where_stored_costs_predict_it_pays(relative, joins):
    target = FakeBackend(lambda context: __import__("numpy").zeros(16, dtype="float32"), 16)
    stored = TuneResult("k", "t", "none", "m", 0, 0.0,
                        target_costs=seconds_of(relative, [1, 2, 8, 24, 120]), learned=True)
    params = GenerationParams(32, 16, adaptive=True, tree_nodes=0)
    options, params, choice = size_lookahead("auto", target, DrafterOptions(), params, stored, [1, 2, 3])
    assert options.auto_lookahead is joins
    members = [member.name for member in build_drafter("auto", None, options).members]
    assert ("lookahead" in members) is joins
    if joins:
        assert choice.predicted >= forecasts.AUTO_MARGIN and params.tree_nodes == choice.sizes.max_nodes
    # with no stored costs auto probes nothing and drafts as before
    assert size_lookahead("auto", target, DrafterOptions(), params, None, [1, 2, 3])[2] is None


def test_auto_with_a_window_is_lossless_and_verifies_windows():
    """The auto chain with a window on the fake pair: greedy output is plain decoding's, and the
    window's trees were verified (sampled losslessness: the harness's "auto lookahead")."""
    from lossless_harness import SCENARIOS, fake_engine

    engine = fake_engine(SCENARIOS["auto lookahead"])
    assert [member.name for member in engine.drafter.members] == ["lookup", "ngram", "lookahead", "draft"]
    plain = fake_engine(SCENARIOS["none"]).run([1, 2, 3], GenerationParams(60, 0))
    result = engine.run([1, 2, 3], GenerationParams(60, 16, adaptive=True))
    assert result.token_ids == plain.token_ids
    assert result.stats.by_source["lookahead"].steps > 0


def test_auto_asks_the_window_after_the_cheap_drafters_and_before_a_draft_model():
    """Cheapest first: prompt lookup's copies and the pool's n-grams cost no wider pass."""
    chain = build_drafter("auto", None, DrafterOptions(lookahead=SMALLEST, auto_lookahead=True))
    assert isinstance(chain.members[0], PromptLookupDrafter) and chain.members[-1].name == "lookahead"
    assert chain.members[-1].sizes == SMALLEST


@pytest.mark.parametrize("relative", [cpu_like, gpu_like])
def test_bench_chooses_lookahead_s_sizes_as_generate_does_and_records_them(relative, tmp_path, monkeypatch):
    """bench --methods ...,lookahead without --lookahead: the sizes the probed costs favour (within
    what the opened target holds), said in a note and recorded in the JSON; greedy, the window's
    line keeps plain decoding's text."""
    pytest.importorskip("llama_cpp")
    import specrun.sessions.tuning as tuning

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setattr(tuning, "time_passes", lambda target, prompt, counts, repeats: seconds_of(relative, counts))
    out = tmp_path / "bench.json"
    result = runner.invoke(app_(), ["bench", "--target", "demo-target", "--backend", "llama", "--exact", "--methods",
                                    "none,lookahead", "--categories", "code-completion", "--per-category", "1",
                                    "-n", "16", "--json", str(out)])
    assert result.exit_code == 0, result.output
    expected, _ = choose_sizes(relative)
    assert f"note: lookahead window {expected} (chosen from this machine's pass costs" in result.stderr
    doc = json.loads(out.read_text())
    assert tuple(doc["config"]["lookahead"]) == (expected.window, expected.ngram, expected.candidates)
    assert doc["mismatches"] == [] and all(run["same_as_baseline"] for run in doc["runs"])


@pytest.mark.parametrize("chain", [False, True])
def test_auto_reopens_a_chains_only_llama_context_for_a_window_that_pays(chain, monkeypatch):
    """llama.cpp sizes a context's sequences when it creates it: a target opened for chains (no
    tree options) is re-created for the window's paths where stored costs predict it pays, before
    anything is fed, and auto drafts with the window beside its other drafters; greedy output
    stays plain decoding's. --chain keeps chains. (Whether the window's proposal is the one a step
    takes is timing: beside the demo target's EAGLE heads it was in 5 runs of 8 here.)"""
    pytest.importorskip("llama_cpp")
    from specrun.registry.loading import LoadOptions
    from specrun.sessions import generation
    from specrun.sessions.generation import GenerateRequest, generate_text
    from specrun.sessions.setup import TreeSettings

    stored = TuneResult("k", "t", "none", "m", 0, 0.0, target_costs=seconds_of(gpu_like, [1, 2, 8, 24, 120]),
                        learned=True)
    monkeypatch.setattr(generation, "load_target_entry", lambda target, threads: stored)
    monkeypatch.setattr(generation, "remember_run", lambda *args, **kwargs: None)  # the test's costs are not this machine's
    from specrun.backends.llama import LlamaCppBackend

    reopened = []
    open_for_trees = LlamaCppBackend.open_for_trees

    def counted(self, paths):
        reopened.append(paths)
        return open_for_trees(self, paths)

    monkeypatch.setattr(LlamaCppBackend, "open_for_trees", counted)
    notes = []
    request = GenerateRequest(PROMPT, "demo-target", None, method="auto", max_new_tokens=48,
                              load=LoadOptions(backend="llama", exact=True), trees=TreeSettings(chain=chain),
                              on_note=notes.append)
    plain = generate_text(dataclasses.replace(request, method="none"))
    result = generate_text(request)
    assert result.token_ids == plain.token_ids
    chosen = [note for note in notes if note.startswith("lookahead ")]
    assert bool(chosen) is not chain and bool(reopened) is not chain, notes


def test_a_context_that_cannot_be_re_created_for_trees_keeps_chains(monkeypatch):
    """No memory for the wider cache: the chains context stays usable, auto goes on without a
    window, and the model is still freed on close; re-creating after a pass is refused."""
    pytest.importorskip("llama_cpp")
    from specrun.backends.llama import LlamaCppBackend
    from specrun.errors import ModelFileError
    from specrun.modelkit.builtin import builtin_gguf

    target = LlamaCppBackend(builtin_gguf("demo-target"), n_ctx=256, n_threads=1)
    lib = target._lib
    real_init = lib.llama_init_from_model
    monkeypatch.setattr(lib, "llama_init_from_model", lambda model, params: None)
    stored = TuneResult("k", "t", "none", "m", 0, 0.0, target_costs=seconds_of(gpu_like, [1, 2, 8, 24, 120]),
                        learned=True)
    params = GenerationParams(32, 16, adaptive=True, tree_nodes=0)
    options, _, choice = size_lookahead("auto", target, DrafterOptions(), params, stored, [1, 2, 3])
    assert choice is None and not options.auto_lookahead and not target.tree_support.available
    with pytest.raises(ModelFileError):
        target.open_for_trees(4)
    monkeypatch.setattr(lib, "llama_init_from_model", real_init)
    assert target.forward([1, 2, 3], [2]).shape == (1, target.vocab.size)  # the chains context still works
    with pytest.raises(RuntimeError, match="before anything is fed"):
        target.open_for_trees(4)
    freed, real_free = [], lib.llama_model_free
    monkeypatch.setattr(lib, "llama_model_free", lambda model: freed.append(model))
    target.close()
    assert len(freed) == 1
    real_free(freed[0])


# ---- auto's window in chat, serve and bench, as in generate --------------------------------
def stored_target_entry(relative) -> TuneResult:
    return TuneResult("k", "t", "none", "m", 0, 0.0, target_costs=seconds_of(relative, [1, 2, 8, 24, 120]), learned=True)


def chat_answer(method: str, **kwargs):
    """open_chat on demo-target (llama.cpp, --exact, no draft model; what `specrun chat` and a
    server's worker open): the session's drafters, what it noted, its greedy answer's result."""
    from specrun.registry.loading import LoadOptions
    from specrun.sessions.chat import open_chat
    from specrun.engine.events import Finished

    notes: list[str] = []
    with open_chat("demo-target", None, method, LoadOptions(backend="llama", threads=1, exact=True),
                   on_note=notes.append, **kwargs) as session:
        drafter = session.engine.drafter
        members = [member.name for member in drafter.members] if drafter is not None else []
        ids = session.target.tokenize(PROMPT, add_bos=session.target.vocab.add_bos)
        [result] = [event.result for event in session.stream(ids, GenerationParams(32, 0)) if isinstance(event, Finished)]
        trees = session.target.tree_support.available
    return members, notes, result, trees


@pytest.mark.parametrize("relative, chain, joins", [(gpu_like, False, True), (cpu_like, False, False),
                                                    (gpu_like, True, False)])
def test_a_chat_s_auto_drafts_with_a_window_where_stored_costs_predict_it_pays(relative, chain, joins, monkeypatch):
    """`specrun chat` and `specrun serve` (both open_chat) add auto's window as generate does:
    where the target's stored costs predict it pays, on llama.cpp's chains context re-created for
    it, said in a note; never under --chain. Greedy, the answer is plain decoding's."""
    pytest.importorskip("llama_cpp")
    from specrun.sessions import chat

    monkeypatch.setattr(chat, "load_target_entry", lambda target, threads: stored_target_entry(relative))
    members, notes, result, trees = chat_answer("auto", chain=chain)
    assert ("lookahead" in members) is joins and trees is joins
    assert any(note.startswith("auto drafts with a lookahead") for note in notes) is joins
    _, _, plain, _ = chat_answer("none")
    assert result.token_ids == plain.token_ids


def test_a_chat_s_auto_window_fits_the_tree_nodes_asked_and_every_answer_s_passes_hold_it(monkeypatch):
    """--tree-nodes bounds the window auto may choose; the answers' passes hold the chosen
    window's nodes (the CLI's tree_nodes may be smaller than the window: 0, none asked)."""
    pytest.importorskip("llama_cpp")
    from specrun.sessions import chat

    monkeypatch.setattr(chat, "load_target_entry", lambda target, threads: stored_target_entry(gpu_like))
    small = [sizes for sizes in LADDER if sizes.max_nodes <= 30]
    members, notes, result, _ = chat_answer("auto", tree_nodes=30)
    assert "lookahead" in members
    chosen = forecasts.choose(seconds_of(gpu_like, [1, 2, 8, 24, 120]), forecasts.fitting(30, 0)).sizes
    assert chosen in small and str(chosen) in notes[-1]
    assert result.stats.new_tokens > 0


@pytest.mark.parametrize("relative, joins", [(gpu_like, True), (cpu_like, False)])
def test_bench_s_auto_line_drafts_with_a_window_where_stored_costs_predict_it_pays(relative, joins, monkeypatch):
    """bench's auto line is generate's auto: without a draft model, a window where the stored
    costs predict it pays, noted and recorded in the result; outputs still plain decoding's."""
    pytest.importorskip("llama_cpp")
    import specrun.sessions.setup as setup
    from specrun.bench.runner import BenchConfig, run_bench
    from specrun.bench.suite import BUILTIN_SUITE
    from specrun.registry.loading import LoadOptions

    monkeypatch.setattr(setup, "load_target_entry", lambda target, threads: stored_target_entry(relative))
    config = BenchConfig("demo-target", None, ("none", "auto"), max_new_tokens=24,
                         load=LoadOptions(backend="llama", threads=1, exact=True))
    result = run_bench(config, BUILTIN_SUITE[:2])
    assert any(note.startswith("auto drafts with a lookahead") for note in result.notes) is joins
    assert (result.config.lookahead is not None) is joins
    assert result.comparison.mismatches.get("auto", []) == []
    # --untuned: the stored costs are not read, so no window
    untuned = run_bench(dataclasses.replace(config, use_tuned=False), BUILTIN_SUITE[:1])
    assert not any(note.startswith("auto drafts with a lookahead") for note in untuned.notes)
