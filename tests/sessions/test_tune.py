"""`specrun tune`: calibration is saved per pair and machine, and later runs use it."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specrun.cli.app import app
from specrun.engine.stats import Stats

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
    assert entry["acceptance"] == 1.0 and entry["first_acceptance"] == 1.0  # draft == target
    # draft == target: every position right, smoothed by its count towards an even chance
    curve = entry["acceptance_by_position"]
    assert curve["1"] > 0.9 and all(0.75 <= share < 1.0 for share in curve.values())
    # Whether speculation pays with a draft as costly as the target is for the clock to say;
    # round 2 (confidence stops, beside plain decoding again) runs only when it did.
    if entry["best_draft_len"]:
        assert "none (round 2)" in rates and "draft k=8 p>=0.5" in rates
        assert entry["best_min_prob"] in (0.0, 0.3, 0.5, 0.7)
    else:
        assert entry["best_min_prob"] == 0.0 and entry["speedup"] == 1.0
    assert sorted(int(n) for n in entry["target_costs"]) == list(range(1, 10))
    # The draft model's costs, which later runs' controllers start from: a cost per drafted
    # length (what each is, from the steps' own seconds, is test_calibration_picks_…'s to say:
    # their order on the tiny model is the clock's, and a busy machine reorders it).
    costs = {int(k): seconds for k, seconds in entry["draft_costs"].items()}
    assert set(costs) == {1, 2, 3, 4, 6, 8} and all(seconds > 0 for seconds in costs.values())
    # …and what a token of context adds to a pass and to a draft step, timed after several contexts
    # (the tiny model's passes barely grow: a slope of 0 is a measurement too), from the context the
    # costs above were timed at
    assert entry["costs_context"] > 0
    assert entry["target_per_context"] >= 0.0 and entry["draft_per_context"] >= 0.0

    shown = runner.invoke(app, ["tune", "--show"])
    assert shown.exit_code == 0
    assert "tuned settings" in shown.stdout and f"{entry['speedup']:.2f}×" in shown.stdout

    # Later runs take the saved settings unless told otherwise: the confidence stop, and the
    # costs and acceptance their controllers start from. Lengths adapt; -k fixes them.
    entry.update(best_draft_len=3, best_min_prob=0.7)
    tuned_file.write_text(json.dumps(saved))
    base = ["generate", "def f():", "-t", path, "-d", path, "-n", "8", "--json", "-m", "draft"]
    stats = json.loads(runner.invoke(app, base).stdout)["stats"]
    assert (stats["draft_len"], stats["adaptive"], stats["draft_min_prob"]) == (16, True, 0.7)
    explicit = json.loads(runner.invoke(app, [*base, "-k", "5", "--draft-min-prob", "0"]).stdout)["stats"]
    assert (explicit["draft_len"], explicit["adaptive"], explicit["draft_min_prob"]) == (5, False, 0.0)
    auto = json.loads(runner.invoke(app, [*base[:-2], "-m", "auto"]).stdout)["stats"]
    assert (auto["method"], auto["draft_len"], auto["adaptive"], auto["draft_min_prob"]) == ("auto", 16, True, 0.7)
    # A chain too chooses its length as it goes, up to auto's longest, unless -k fixes it.
    chain = json.loads(runner.invoke(app, [*base[:-2], "-m", "lookup+draft"]).stdout)["stats"]
    assert (chain["method"], chain["draft_len"], chain["adaptive"], chain["draft_min_prob"]) == (
        "lookup+draft", 16, True, 0.7)
    fixed = json.loads(runner.invoke(app, [*base[:-2], "-m", "lookup+draft", "-k", "4"]).stdout)["stats"]
    assert (fixed["draft_len"], fixed["adaptive"]) == (4, False)

    # The bench starts its controllers where generate does, runs each method at the length and
    # stop generate gives it, and says so; --untuned does not, nor do -k and --draft-min-prob.
    bench = ["bench", "-t", path, "-d", path, "--methods", "none,draft,lookup+draft", "--categories", "chat",
             "--per-category", "1", "-n", "8", "--json", "-"]
    tuned_run = runner.invoke(app, bench)
    assert tuned_run.exit_code == 0, tuned_run.output
    config = json.loads(tuned_run.stdout)["config"]
    assert config["tuned"] == entry["key"]
    assert [(v["name"], v["draft_len"], v["adaptive"]) for v in config["variants"]] == [
        ("none", 0, False), ("draft", 16, True), ("lookup+draft", 16, True)]
    assert config["draft_lens"] == [] and config["draft_min_prob"] == 0.7
    assert f"`specrun tune`'s measurements for this pair ({entry['key']})" in tuned_run.stderr
    footnotes = " ".join(tuned_run.stderr.split())
    assert "with tune's settings: draft model stops below p=0.7;" in footnotes
    assert "up to 16, and speculation gated on plain decoding's speed): draft, lookup+draft;" in footnotes
    untuned_run = runner.invoke(app, [*bench, "--untuned"])
    config = json.loads(untuned_run.stdout)["config"]
    assert config["tuned"] is None and config["draft_min_prob"] == 0.0
    assert [v["draft_len"] for v in config["variants"]] == [0, 16, 16]
    explicit_run = runner.invoke(app, [*bench, "-k", "5", "--draft-min-prob", "0"])
    config = json.loads(explicit_run.stdout)["config"]
    assert config["tuned"] == entry["key"] and config["draft_min_prob"] == 0.0
    assert [(v["draft_len"], v["adaptive"]) for v in config["variants"]] == [(0, False), (5, False), (5, False)]
    assert config["draft_lens"] == [5]
    assert "as `specrun generate` runs them" not in explicit_run.stderr


def test_tune_table_shows_each_setting_beside_its_rounds_plain_decoding_in_80_columns():
    from rich.console import Console

    from specrun.cli.tune import render
    from specrun.sessions.tuning import TuneResult

    rates = {"none": 200.0, "draft k=1": 250.0, "draft k=8": 150.0,
             "none (round 2)": 210.0, "draft k=1 (round 2)": 252.0, "draft k=8 p>=0.5": 189.0}
    result = TuneResult("k", "target-model.q4_k_m.gguf:4920000000", "draft-model.q4_k_m.gguf:700000000|flash=off",
                        "host|x86_64|2 cpus|?", best_draft_len=1, speedup=1.2, tokens_per_second=rates,
                        acceptance=0.4, first_acceptance=0.66, acceptance_by_position={1: 0.66, 2: 0.5, 3: 0.25})
    console = Console(width=80, record=True, color_system=None)
    console.print(render([result]))
    lines = console.export_text().splitlines()
    assert max(map(len, lines)) <= 80
    # One line per setting: its rate and its ratio to the plain decoding of its own round
    # (round 2 and the confidence stops are timed beside round 2's), not one wrapped cell.
    expected = {"none": "1.00×", "draft k=1": "1.25×", "draft k=8": "0.75×",
                "none (round 2)": "1.00×", "draft k=1 (round 2)": "1.20×", "draft k=8 p>=0.5": "0.90×"}
    for name, ratio in expected.items():
        assert [*name.split(), f"{rates[name]:.0f}", ratio] in [line.split() for line in lines], name
    text = "\n".join(lines)
    assert "best fixed draft length (-k) 1, confidence stop none, speed-up 1.20×" in text
    assert "draft tokens accepted 40% (first token 66%)" in text
    assert "accepted by draft position (the ones before it accepted): 66% 50% 25%" in text
    assert "target-model.q4_k_m.gguf  +  draft-model.q4_k_m.gguf (flash attention off)" in text
    assert "round 1" not in text  # round 2 confirmed round 1's choice


def test_tune_s_report_says_why_round_one_s_best_was_not_chosen():
    """It printed "-k 0 (plain is fastest)" above draft k=2 at 1.18×, without a word on round 2."""
    from rich.console import Console

    from specrun.cli.tune import render
    from specrun.sessions.tuning import TuneResult

    rates = {"none": 100.0, "draft k=2": 118.0, "none (round 2)": 110.0, "draft k=2 (round 2)": 104.0}
    result = TuneResult("k", "t.gguf:10", "d.gguf:5", "host", best_draft_len=0, speedup=1.0, tokens_per_second=rates)
    console = Console(width=120, record=True, color_system=None)
    console.print(render([result]))
    text = console.export_text()
    assert "best fixed draft length (-k) 0 (plain is fastest)" in text
    assert ("(draft k=2 read 1.18× in round 1, but not when timed again beside plain decoding in round 2, which "
            "decides)") in text


def test_a_corrupt_tune_file_is_one_line(config_home, tiny_llama):
    (config_home / "specrun").mkdir()
    (config_home / "specrun" / "tuned.json").write_text("{not json")
    result = CliRunner().invoke(app, ["tune", "--show"])
    assert result.exit_code == 1
    assert "cannot read tuned settings" in result.stderr and "specrun tune" in result.stderr


@pytest.mark.parametrize("flag", ["-t", "--draft"])
def test_show_with_a_model_named_is_a_usage_error(config_home, flag):
    """`tune -t nosuch --show` printed every pair's settings, exit 0, the model never looked at."""
    result = CliRunner().invoke(app, ["tune", flag, "nosuch", "--show"])
    assert result.exit_code == 2, result.output
    long = {"-t": "--target", "--draft": "--draft"}[flag]
    assert result.stderr.strip() == f"error: --show prints every pair's saved settings; it takes no {long}; leave {long} out"


def test_calibration_picks_the_fastest_length_then_the_fastest_stop(monkeypatch, tiny_llama):
    """The choice itself, with the measured rates set: round 1 picks k, round 2 a stop at k or at 8."""
    from specrun.sessions import tuning
    from specrun.registry.loading import LoadOptions, open_pair

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
        totals = {name: Stats() for name in configs}
        for name, (k, _) in configs.items():
            if k:
                totals[name].record_step(k, k - 1, k, 0.001 * k, 0.01)  # one step drafting k, one lost
        return {name: rounds[round_number][name] for name in configs}, totals

    monkeypatch.setattr(tuning, "_interleaved", measured)
    monkeypatch.setattr(tuning, "_verify_costs", lambda target, prompt: {1: 0.001})
    asked = []

    def context_costs(target, draft, draft_len):
        asked.append(draft_len)
        return tuning.ContextCosts(draft_len, {}, {}, 2e-6, 5e-6)

    monkeypatch.setattr(tuning, "_context_costs", context_costs)
    path = str(tiny_llama.gguf_path)
    target, draft = open_pair(path, path, LoadOptions(threads=1))
    result = tuning.calibrate(target, draft, [[1, 2, 3]], 8, "key")
    target.close()
    draft.close()
    assert seen[2]["draft k=8 p>=0.5"] == (8, 0.5) and seen[2]["draft k=2"] == (2, 0.0)
    assert (result.best_draft_len, result.best_min_prob) == (8, 0.5)
    # the context's costs timed at the length chosen, from the context the target's were timed at
    assert asked == [8]
    assert (result.costs_context, result.target_per_context, result.draft_per_context) == (3, 2e-6, 5e-6)
    assert result.speedup == pytest.approx(150.0 / 95.0)  # against round 2's own plain decoding
    assert result.tokens_per_second["none (round 2)"] == 95.0
    assert result.acceptance == pytest.approx((0 + 1 + 2 + 3 + 5 + 7) / (1 + 2 + 3 + 4 + 6 + 8))
    assert result.draft_costs == pytest.approx({k: 0.001 * k for k in (1, 2, 3, 4, 6, 8)})
    # first token accepted on the steps of k = 2..8, not on k = 1's (it accepted k - 1 = 0)
    assert result.first_acceptance == pytest.approx(5 / 6)
    # Each position is reached by the steps of every k >= it and accepted by those whose k is
    # longer still (k accepts k - 1): position 1 by 6 steps, 5 right; 2 by 5, 4; 3 by 4, 3; 4 by
    # 3, 2; 5 by 2, 2; 6 by 2, 1. Kept where 2 steps reached it, each smoothed with 2 steps'
    # worth of an even chance.
    assert result.acceptance_by_position == pytest.approx({1: 6 / 8, 2: 5 / 7, 3: 4 / 6, 4: 3 / 5, 5: 3 / 4, 6: 2 / 4})


def test_a_version_1_tune_file_still_loads_and_starts_only_the_target_costs(config_home):
    """Files from before draft costs were saved keep working: no draft costs, no seeding."""
    from specrun.sessions import tuning

    path = config_home / "specrun" / "tuned.json"
    path.parent.mkdir()
    entry = {"key": "k1", "target": "t.gguf:1", "draft": "d.gguf:1", "machine": "m", "best_draft_len": 3,
             "speedup": 1.2, "tokens_per_second": {"none": 1.0}, "target_costs": {"1": 0.002},
             "acceptance": 0.5, "best_min_prob": 0.0}
    path.write_text(json.dumps({"version": 1, "pairs": {"k1": entry}}))
    loaded = tuning.load("k1")
    assert loaded.target_costs == {1: 0.002} and loaded.draft_costs == {}
    assert loaded.first_acceptance == 0.0  # not measured then: runs keep the default prior
    assert CliRunner().invoke(app, ["tune", "--show"]).exit_code == 0


# ---- --window-search: the windowed draft cache kept for long contexts (issue 53) ----------------
def test_the_window_search_times_every_window_smaller_than_the_prompt_and_keeps_a_faster_one():
    """Real timings (the rule that a window must win every round is tested with scripted ones):
    the line kept is the full cache or a window whose median beat the full cache's."""
    from fake_models import hashed_logits
    from specrun.backends.fake import FakeBackend
    from specrun.sessions.window_tuning import FULL, search_window

    target, draft = FakeBackend(hashed_logits(8, salt=1), 8), FakeBackend(hashed_logits(8, salt=2), 8)
    rounds = []
    choice = search_window(target, draft, [1 + i % 7 for i in range(300)], 8, 3,
                           on_progress=lambda stage, done, total: rounds.append((stage, done, total)))
    assert set(choice.rates) == {FULL, "window 128", "window 256"}  # 4 + 512 + 64 is not under 300
    assert rounds == [("window", 1, 2), ("window", 2, 2)] and choice.context == 300 and choice.sinks == 4
    kept = FULL if choice.window == 0 else f"window {choice.window}"
    assert kept in choice.rates and choice.rates[kept] >= choice.rates[FULL]
    assert choice.speedup == pytest.approx(choice.rates[kept] / choice.rates[FULL])


def test_the_window_search_prompt_asks_about_a_long_document_through_the_chat_template(tiny_llama):
    """Continuing code leans on its last few hundred tokens, so the search's prompt is a question
    about a document, as long prompts come: exactly ``context`` tokens, the template's turn markers
    as control tokens around the text, one BOS, the question and the assistant's turn last; a model
    without a chat template continues the file."""
    from fake_models import hashed_logits
    from specrun.backends.fake import FakeBackend
    from specrun.sessions.templates import ChatTemplate, tokenize_chat
    from specrun.sessions.window_tuning import QUESTION, long_prompt

    from specrun.backends.llama import LlamaCppBackend

    backend = LlamaCppBackend(tiny_llama.gguf_path, n_threads=1, n_ctx=512)
    ids = long_prompt(backend, 400)
    assert len(ids) == 400
    template = ChatTemplate.for_backend(backend)
    rendered = template.render([{"role": "user", "content": "x\n\n" + QUESTION}])
    tail = tokenize_chat(backend, rendered.partition("x")[2], [], add_bos=False)
    assert ids[-len(tail):] == tail and ids.count(backend.vocab.bos_id) == (1 if backend.vocab.add_bos else 0)
    text = b"".join(backend.token_bytes(t) for t in ids).decode(errors="replace")
    assert 0 < text.index("Steven J. Bethard") < text.index(QUESTION)  # argparse.py's first line, then the question
    backend.close()
    plain = FakeBackend(hashed_logits(8, salt=1), 8)  # no chat template: the file's text, continued
    assert len(long_prompt(plain, 300)) == 300


def test_the_window_kept_is_timed_again_beside_other_sink_counts_and_the_fastest_kept(monkeypatch):
    """Where a window wins, its sinks are searched too (SINK_CANDIDATES that fit the prompt, in the
    same interleaved rounds); the speed-up chains the two stages' ratios. Rates are scripted by
    what each line's draft reads (its sinks and window)."""
    from fake_models import hashed_logits
    from specrun.backends.fake import FakeBackend
    from specrun.engine.loop import SpeculativeEngine
    from specrun.sessions import window_tuning
    from specrun.sessions.window_tuning import FULL, search_window

    speed = {None: 10.0, (4, 128): 12.0, (4, 256): 15.0, (16, 256): 18.0, (64, 256): 14.0}
    run = SpeculativeEngine.run

    def scripted(engine, prompt, params, **kwargs):
        result = run(engine, prompt, params, **kwargs)
        view = engine.drafter.backend  # the draft model, or a windowed view of it
        shape = (view.sinks, view.window) if hasattr(view, "window") else None
        result.stats.generation_seconds = result.stats.new_tokens / speed[shape]
        return result

    monkeypatch.setattr(SpeculativeEngine, "run", scripted)
    target, draft = FakeBackend(hashed_logits(8, salt=1), 8), FakeBackend(hashed_logits(8, salt=2), 8)
    stages = []
    prompt = [1 + i % 7 for i in range(400)]  # 64 sinks + 256 + 32 fit; 4 + 512 + 64 do not
    choice = search_window(target, draft, prompt, 8, 3, sink_candidates=window_tuning.SINK_CANDIDATES,
                           on_progress=lambda stage, done, total: stages.append(stage))
    assert stages == ["window", "window", "sinks", "sinks"]
    assert (choice.window, choice.sinks) == (256, 16)
    assert set(choice.rates) == {FULL, "window 128", "window 256", "window 256 (4 sinks)", "window 256 (16 sinks)",
                                 "window 256 (64 sinks)"}
    assert choice.speedup == pytest.approx(1.8)  # 15 / 10, then 18 / 15
    speed[None] = 20.0  # the full cache wins: no sinks to search
    stages.clear()
    full_wins = search_window(target, draft, prompt, 8, 3, sink_candidates=window_tuning.SINK_CANDIDATES,
                              on_progress=lambda stage, done, total: stages.append(stage))
    assert (full_wins.window, full_wins.speedup, stages) == (0, 1.0, ["window", "window"])


def test_a_window_within_the_rounds_spread_of_the_full_cache_is_not_kept(monkeypatch):
    """A window is kept only where every round of it beat every round of the full cache: here
    window 256's median (13) beats the full cache's (12) but its slow round (11) does not beat the
    full cache's fast one (14), so the full cache stays; once window 128's rounds all clear 14 it
    is kept, window 256 still overlapping."""
    from fake_models import hashed_logits
    from specrun.backends.fake import FakeBackend
    from specrun.engine.loop import SpeculativeEngine
    from specrun.sessions.window_tuning import FULL, search_window

    rounds = {None: [10.0, 14.0], (4, 128): [11.0, 12.5], (4, 256): [11.0, 15.0]}
    seen: dict = {}
    run = SpeculativeEngine.run

    def scripted(engine, prompt, params, **kwargs):
        result = run(engine, prompt, params, **kwargs)
        view = engine.drafter.backend
        shape = (view.sinks, view.window) if hasattr(view, "window") else None
        count = seen[shape] = seen.get(shape, -1) + 1
        result.stats.generation_seconds = result.stats.new_tokens / rounds[shape][count % 2]
        return result

    monkeypatch.setattr(SpeculativeEngine, "run", scripted)
    target, draft = FakeBackend(hashed_logits(8, salt=1), 8), FakeBackend(hashed_logits(8, salt=2), 8)
    prompt = [1 + i % 7 for i in range(300)]
    overlapping = search_window(target, draft, prompt, 8, 3)
    assert overlapping.rates["window 256"] > overlapping.rates[FULL] and (overlapping.window, overlapping.speedup) == (0, 1.0)
    rounds[(4, 128)] = [14.5, 15.0]  # every round above the full cache's 14
    seen.clear()
    clear = search_window(target, draft, prompt, 8, 3)
    assert clear.window == 128 and clear.speedup == pytest.approx(14.75 / 12.0)


def test_a_kept_window_is_what_later_runs_draft_with_unless_they_choose(tmp_path):
    import dataclasses

    from fake_models import hashed_logits
    from specrun.backends.fake import FakeBackend
    from specrun.backends.window import WindowedBackend
    from specrun.registry.loading import LoadOptions
    from specrun.sessions import tuning
    from specrun.sessions.setup import tuned_window

    draft = FakeBackend(hashed_logits(8, salt=2), 8, n_ctx=4096)
    tuned = tuning.TuneResult("k", "t", "d", "m", 4, 1.2, window=256, window_sinks=4, window_context=4096,
                              window_speedup=1.41)
    notes = []
    windowed = tuned_window(draft, tuned, LoadOptions(), notes.append)
    assert isinstance(windowed, WindowedBackend) and (windowed.window, windowed.sinks, windowed.owns) == (256, 4, True)
    assert notes == ["the draft reads its first 4 tokens and its last 256 (`specrun tune --window-search` after "
                     "4,096 tokens: 1.41x its full cache); --window N sets another"]
    assert tuned_window(draft, tuned, LoadOptions(window=64), notes.append) is draft  # --window chose
    assert tuned_window(draft, dataclasses.replace(tuned, window=0), LoadOptions(), notes.append) is draft
    assert tuned_window(windowed, tuned, LoadOptions(), notes.append) is windowed and len(notes) == 1
    path = tmp_path / "tuned.json"
    tuning.save(tuned, path)
    assert tuning.load("k", path) == tuned
    raw = json.loads(path.read_text())
    raw["pairs"]["k"]["window"] = -1
    path.write_text(json.dumps(raw))
    with pytest.raises(Exception, match="window"):
        tuning.load("k", path)


@pytest.mark.parametrize(("args", "fragment"), [
    (["--threads", "-3"], "--threads must be between 1 and 1024"), (["--threads", "0"], "--threads"),
    (["--threads", "5000"], "--threads"), (["--ctx", "5"], "--ctx must be between 16"),
])
def test_threads_and_ctx_out_of_range_are_usage_errors_before_anything_is_saved(config_home, tiny_llama, args,
                                                                                   fragment):
    """tune --threads -3 timed a pass and saved kernel costs "measured" at -3 threads, a kernels.json
    every later run refused; --ctx 5 failed only once a prompt did not fit."""
    path = str(tiny_llama.gguf_path)
    refused = CliRunner().invoke(app, ["tune", "-t", path, "-d", path, "--prompts", "1", "-n", "8", *args])
    assert refused.exit_code == 2 and fragment in refused.stderr, refused.output
    assert not any(config_home.rglob("*.json")), list(config_home.rglob("*"))


def test_tune_window_search_saves_the_draft_cache_it_timed(config_home, tiny_llama):
    path = str(tiny_llama.gguf_path)
    runner = CliRunner()
    for lonely in (["--window-context", "512"], ["--sinks", "8"]):
        refused = runner.invoke(app, ["tune", "-t", path, "-d", path, *lonely])
        assert refused.exit_code == 2 and f"{lonely[0]} sizes the window search, which is off" in refused.output
    zero = runner.invoke(app, ["tune", "-t", path, "-d", path, "--window-search", "--sinks", "0"])
    assert zero.exit_code == 2 and "--sinks" in zero.output
    result = runner.invoke(app, ["tune", "-t", path, "-d", path, "--prompts", "1", "-n", "8", "--window-search",
                                 "--window-context", "600", "--sinks", "8"])
    assert result.exit_code == 0, result.output
    # the tiny model's context is 512 tokens: the prompt is what is left beside 8 new ones, and said so
    assert ("note: --window-context 600 is more than a context of 512 holds beside --max-tokens 8 and 16 tokens of "
            "margin: searching after 488 tokens (pass a larger --ctx for more)") in " ".join(result.output.split())
    assert "window search: 488 tokens of prompt; full cache, windows 128-1024, 8 sinks" in result.output
    assert "draft cache after 488 tokens:" in result.output
    (entry,) = json.loads((config_home / "specrun" / "tuned.json").read_text())["pairs"].values()
    assert entry["window_context"] == 488 and entry["window"] in (0, 128, 256) and entry["window_speedup"] > 0
    assert entry["window_sinks"] == (8 if entry["window"] else 0)
    searched = runner.invoke(app, ["tune", "-t", path, "-d", path, "--prompts", "1", "-n", "8", "--window-search",
                                   "--window-context", "600"])
    assert searched.exit_code == 0, searched.output
    assert ("window search: 488 tokens of prompt; full cache, windows 128-1024, 4 sinks\n"
            "window search: then 16 and 64 sinks, if a window wins") in searched.output
    (entry,) = json.loads((config_home / "specrun" / "tuned.json").read_text())["pairs"].values()
    # the sinks are searched where a window won (and said as they are timed)
    assert ("sinks search: round 2/2" in searched.output) == bool(entry["window"])
    assert entry["window_sinks"] in ((4, 16, 64) if entry["window"] else (0,))


def test_the_window_search_runs_on_the_kernels_a_long_run_settles_on_and_is_kept_where_it_looks(
        config_home, tiny_llama, monkeypatch):
    """Flash attention is chosen by a short probe for calibration, by the deep probe for a run
    whose context is long; where they differ, the window search runs with the deep probe's choice
    and its entry is saved under the key such a run reads (beside calibration's): before, a long
    run looked its tuned window up under other kernels and never found it. Scripted probes: on
    wins shallow, off deep."""
    from specrun.backends.llama import LlamaCppBackend
    from specrun.sessions import kernels, tuning

    monkeypatch.setattr(kernels, "DEEP_FROM", 256)
    monkeypatch.setattr(kernels, "DEEP_DEPTH", 300)

    probes = []

    def probe(backend, depth, counts, budget_s, max_rounds=9):
        probes.append(depth)
        fast, slow = {n: 0.001 * n for n in counts}, {n: 0.003 * n for n in counts}
        return depth, ({True: fast, False: slow} if depth < 300 else {True: slow, False: fast})

    monkeypatch.setattr(LlamaCppBackend, "time_flash_attn", probe)
    path = str(tiny_llama.gguf_path)
    result = CliRunner().invoke(app, ["tune", "-t", path, "-d", path, "--prompts", "1", "-n", "8", "--window-search",
                                      "--window-context", "600", "--sinks", "4"])
    assert result.exit_code == 0, result.output
    entries = json.loads((config_home / "specrun" / "tuned.json").read_text())["pairs"]
    by_kernels = {entry["target"].rsplit("flash=", 1)[-1]: entry for entry in entries.values()}
    assert set(by_kernels) == {"on", "off"}  # calibration's, and the long runs'
    assert by_kernels["on"]["window_context"] == 0 and by_kernels["off"]["window_context"] == 488
    assert by_kernels["off"]["best_draft_len"] == by_kernels["on"]["best_draft_len"]  # calibration carried
    from specrun.registry.loading import LoadOptions, open_pair

    target, draft = open_pair(path, path, LoadOptions())
    try:
        kernels.settle_pair(target, draft, LoadOptions(), context=600)  # as a long generate settles
        key = tuning.pair_key(target, draft, None)
    finally:
        target.close()
        draft.close()
    assert tuning.load(key).window_context == 488  # what that run finds
    assert probes == [kernels.PROBE_DEPTH, 300]  # each probe once (target and draft are one file): stored, then read


def test_bench_s_draft_lines_read_through_the_window_tune_kept_unless_untuned(tiny_llama, monkeypatch):
    """As generate and chat do: the pair's tune entry kept a window, bench's draft lines draft from
    it and say so; --untuned reads no entry, so the full cache."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    import specrun.bench.runner as bench_runner
    from specrun.sessions import tuning

    tuned = tuning.TuneResult("k", "t", "d", "m", 4, 1.2, window=128, window_sinks=4, window_context=480,
                              window_speedup=1.2, learned=True)
    monkeypatch.setattr(bench_runner, "load_tuned", lambda target, draft, threads: tuned)
    path = str(tiny_llama.gguf_path)
    bench = ["bench", "-t", path, "-d", path, "--methods", "none,draft", "--categories", "chat", "--per-category", "1",
             "-n", "8", "--json", "-"]
    note = "the draft reads its first 4 tokens and its last 128"
    windowed = CliRunner().invoke(app, bench)
    assert windowed.exit_code == 0, windowed.output
    assert note in " ".join(windowed.stderr.split())
    full = CliRunner().invoke(app, [*bench, "--untuned"])
    assert full.exit_code == 0 and note not in " ".join(full.stderr.split())


# ---- costs at several contexts --------------------------------------------------------
class ContextCostedFake:
    """A fake whose pass costs 10 ms, 1 ms a token fed and ``per_cell`` a token its cache holds
    (reading the KV cache), on a simulated clock."""

    @staticmethod
    def make(clock, per_cell: float, n_ctx: int = 4096):
        from fake_models import VOCAB, hashed_logits
        from specrun.backends.fake import FakeBackend

        class Costed(FakeBackend):
            def forward(self, tokens, logit_rows):
                clock.now += 0.010 + 0.001 * len(tokens) + per_cell * (self.n_past + len(tokens))
                return super().forward(tokens, logit_rows)

        return Costed(hashed_logits(VOCAB, salt=3), VOCAB, n_ctx=n_ctx)


def test_tune_fits_what_a_token_of_context_adds_to_a_pass_and_to_a_draft_step():
    """Timed after 256, 1,024 and 2,048 tokens: a target pass whose every cached token costs 10 us
    grows 10 us a token of context, whatever its length; drafting 4 tokens, 4 passes, grows 4 times
    what the draft model's own pass does. Each length's timings are kept by context."""
    from fake_models import SimClock
    from specrun.sessions import tuning

    clock = SimClock()
    target, draft = ContextCostedFake.make(clock, 1e-5), ContextCostedFake.make(clock, 2e-6)
    document = list(range(1, 3000))
    costs = tuning.time_context_costs(target, draft, document, 4, (256, 1024, 2048), repeats=3, clock=clock)
    assert costs.target_per_context == pytest.approx(1e-5)
    assert costs.draft_per_context == pytest.approx(4 * 2e-6)
    assert set(costs.target) == set(costs.draft) == {256, 1024, 2048}
    assert costs.target[1024][5] == pytest.approx(0.010 + 0.005 + 1e-5 * (1024 + 5))
    assert costs.draft[256] == pytest.approx(sum(0.011 + 2e-6 * (256 + i) for i in range(1, 5)))
    assert target.n_past == draft.n_past == 0  # both left empty


@pytest.mark.parametrize("n_ctx, depths", [
    (8192, (256, 1024, 2048)), (2048, (256, 1024, 2038)), (1100, (256, 1024)), (600, (256, 590)), (512, ()),
    (300, ()),
])
def test_tune_times_the_contexts_the_pair_s_context_holds(n_ctx, depths):
    """With room for a draft after the deepest (here 10 tokens); the context itself where it lies
    256 tokens past the last (two contexts 246 apart spread too little to fit a slope); no slope
    through one context."""
    from specrun.sessions import tuning

    assert tuning.context_depths(n_ctx, 10) == depths


def test_no_slope_where_the_document_is_shorter_than_the_deepest_context():
    from fake_models import SimClock
    from specrun.sessions import tuning

    clock = SimClock()
    pair = ContextCostedFake.make(clock, 1e-5), ContextCostedFake.make(clock, 1e-5)
    assert tuning.time_context_costs(*pair, list(range(1, 500)), 4, (256, 1024), clock=clock) is None
    assert tuning.time_context_costs(*pair, list(range(1, 500)), 4, (256,), clock=clock) is None


def test_show_on_a_machine_with_nothing_tuned_says_so_and_how(config_home):
    """It printed a heading over nothing."""
    result = CliRunner().invoke(app, ["tune", "--show"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == ("no tuned settings on this machine yet: `specrun tune --target MODEL --draft DRAFT` "
                                     "measures a pair and saves its settings")
