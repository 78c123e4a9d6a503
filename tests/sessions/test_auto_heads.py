"""auto drafts with the target's own heads where it has some (issue 29): which kind, where they
are found, what a file that cannot serve does, and the text staying plain decoding's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from heads_factory import oracle_eagle, oracle_heads, oracle_hydra, random_eagle, random_heads, random_hydra
from specrun.control.forecasts import HEADS_MARGIN, PRIOR_ACCEPTANCE, predicted_heads_gain
from specrun.drafters.methods import DrafterOptions, build_drafter, check_method, resolve_method
from specrun.heads.kinds import AUTO_HEADS_ORDER
from specrun.heads.config import held_out_acceptance
from specrun.heads.files import load_heads, save_heads
from specrun.registry.heads import shipped_heads_path
from specrun.sessions.tuning import TuneResult

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hardening"))
from cli_checks import assert_one_line_error, invoke  # noqa: E402

MADE = {"medusa": random_heads, "hydra": random_hydra, "eagle": random_eagle}


# ---- the chain auto resolves to ---------------------------------------------------------------

@pytest.mark.parametrize("heads, has_draft, lookahead, chain", [
    ("eagle", True, False, "lookup+ngram+eagle+draft"),
    ("medusa", False, False, "lookup+ngram+medusa"),
    ("hydra", True, True, "lookup+ngram+lookahead+hydra+draft"),
    (None, True, False, "lookup+ngram+draft"),
    (None, False, True, "lookup+ngram+lookahead"),
])
def test_auto_puts_the_heads_after_the_cheap_drafters_and_before_the_draft_model(heads, has_draft, lookahead, chain):
    assert resolve_method("auto", has_draft, lookahead, heads) == chain
    check_method(chain)  # a chain --method itself accepts: cheapest first, one kind of heads
    assert resolve_method("lookup+draft", has_draft, lookahead, heads) == "lookup+draft"  # named chains as named


def test_auto_with_heads_builds_the_chain_with_the_kind_it_is_given():
    from fake_models import hashed_logits
    from specrun.backends.fake import FakeBackend

    assert AUTO_HEADS_ORDER == ("mtp", "eagle", "hydra", "medusa")  # a model's own MTP layers first
    draft = FakeBackend(hashed_logits(32, salt=2), 32)
    both = (oracle_heads(32), oracle_eagle(32))
    drafter = build_drafter("auto", draft, DrafterOptions(heads=both, auto_heads="medusa"))
    assert [member.name for member in drafter.members] == ["lookup", "ngram", "medusa", "draft"]
    without = build_drafter("auto", draft, DrafterOptions(heads=both))  # heads for head methods only
    assert [member.name for member in without.members] == ["lookup", "ngram", "draft"]
    assert build_drafter("medusa", None, DrafterOptions(heads=both, auto_heads="hydra")).name == "medusa"
    with pytest.raises(ValueError, match="hydra"):
        build_drafter("auto", draft, DrafterOptions(heads=both, auto_heads="hydra"))


# ---- whether heads pay (control.forecasts) ----------------------------------------------------

def cpu_like(n: int) -> float:
    return 1.0 + 0.5 * (n - 1)  # this CPU: a 5-token pass ~3 plain steps


def gpu_like(n: int) -> float:
    return 1.0 + 0.02 * (n - 1)


def stored(relative) -> TuneResult:
    return TuneResult("k", "t", "none", "m", 0, 0.0, target_costs={n: 0.01 * relative(n) for n in (1, 2, 5, 9)},
                      learned=True)


def test_heads_are_predicted_to_pay_where_a_wide_pass_is_cheap_and_the_heads_small():
    acceptance = (0.8, 0.8, 0.8)
    # by hand: depth 1 (1 + 0.8) / (1.02 + 0.1), depth 2 (1.8 + 0.64) / (1.04 + 0.2), depth 3 (2.44 + 0.512) / 1.36
    assert predicted_heads_gain(gpu_like, acceptance, 0.1) == pytest.approx(2.952 / 1.36)
    # this CPU: depth 1 is best, 1.8 / (1.5 + 0.1); heads 0.6 of the target (the demo's EAGLE) lose
    assert predicted_heads_gain(cpu_like, acceptance, 0.1) == pytest.approx(1.8 / 1.6)
    assert predicted_heads_gain(cpu_like, acceptance, 0.6) == 1.0  # plain decoding's: nothing drafts
    assert predicted_heads_gain(gpu_like, acceptance, 1.0) == 1.0  # heads as dear as the target
    assert predicted_heads_gain(gpu_like, (), 0.0) == 1.0


def test_the_held_out_acceptance_comes_from_the_training_report_and_nothing_else():
    eagle = load_heads(shipped_heads_path("demo-target", "eagle"))
    assert held_out_acceptance(eagle.config) == tuple(eagle.config.training["held_out"]["chain_accuracy"])
    import dataclasses

    for training in ({}, {"held_out": {"chain_accuracy": [0.5, 1.5]}}, {"held_out": {"chain_accuracy": "x"}},
                     {"held_out": {"chain_accuracy": [True]}}, {"held_out": {"chain_accuracy": [0.5] * 9}}):
        assert held_out_acceptance(dataclasses.replace(eagle.config, training=training)) is None, training


def test_a_depth_reads_what_its_kind_runs():
    eagle, medusa, hydra = random_eagle(16, 32), random_heads(16, 32, num_heads=3), random_hydra(16, 32)
    assert eagle.depth_bytes == sum(a.nbytes for a in eagle.arrays()) - eagle.embed.nbytes  # the layer, each depth
    per_head = [sum(w.nbytes + b.nbytes for w, b in blocks) + p.nbytes for blocks, p in zip(medusa.blocks,
                                                                                               medusa.lm_heads)]
    assert medusa.depth_bytes == sum(per_head) / 3
    assert hydra.depth_bytes == (sum(a.nbytes for a in hydra.arrays().values()) - hydra.embed.nbytes) / 4


class _Target:
    """What heads_pay reads of a target: its hidden support (the weights' size)."""

    def __init__(self, weight_bytes: int) -> None:
        from specrun.backends.base import HiddenSupport

        self.hidden_support = HiddenSupport(True, 16, weight_bytes=weight_bytes)


def test_heads_pay_by_the_stored_costs_the_report_and_their_size():
    from specrun.sessions.heads import heads_pay

    eagle = load_heads(shipped_heads_path("demo-target", "eagle"))  # 4.64 tokens a pass held out, 8.7 MB a depth
    target = _Target(int(eagle.depth_bytes / 0.6))  # a depth 0.6 of the target's weights, as on the demo target
    assert heads_pay(eagle, target, stored(gpu_like).target_costs)
    assert not heads_pay(eagle, target, stored(cpu_like).target_costs)
    assert not heads_pay(eagle, target, None)  # nothing measured on this machine: not by themselves
    assert not heads_pay(eagle, target, TuneResult("k", "t", "none", "m", 0, 0.0, learned=True).target_costs)
    assert not heads_pay(eagle, _Target(int(eagle.depth_bytes)), stored(gpu_like).target_costs)  # as dear as the target
    # published heads carry no report: a depth's acceptance is taken as PRIOR_ACCEPTANCE
    import dataclasses

    bare = dataclasses.replace(eagle, config=dataclasses.replace(eagle.config, training={}))
    assert PRIOR_ACCEPTANCE == 0.6 and HEADS_MARGIN == 1.05
    assert not heads_pay(bare, target, stored(gpu_like).target_costs)  # (1 + 0.6) / (1.02 + 0.6) at best
    assert heads_pay(bare, _Target(int(eagle.depth_bytes * 10)), stored(gpu_like).target_costs)  # 1.6 / (1.02 + 0.1)


def test_auto_with_heads_drafts_with_them_on_the_fake_pair_and_keeps_plain_decoding_s_text():
    """The harness's "auto heads" scenario (tests/engine/test_acceptance.py samples it against the
    oracle's exact distribution): greedy here, the heads draft and the text is plain decoding's."""
    from lossless_harness import SCENARIOS, fake_engine
    from specrun.engine.loop import GenerationParams

    engine = fake_engine(SCENARIOS["auto heads"])
    params = GenerationParams(80, 16, stop_at_eos=False)
    result = engine.run([1, 2, 3], params)
    plain = fake_engine(SCENARIOS["none"]).run([1, 2, 3], GenerationParams(80, 0, stop_at_eos=False))
    assert result.token_ids == plain.token_ids
    assert result.stats.drafters == "lookup+ngram+eagle+draft"
    # Alone, or merged with the others' proposals into one tree ("eagle+draft+lookup", …).
    with_eagle = [counts for source, counts in result.stats.by_source.items() if "eagle" in source.split("+")]
    assert sum(counts.drafted for counts in with_eagle) > 0 and sum(counts.accepted for counts in with_eagle) > 0


def test_the_summary_line_says_what_auto_drafted_with():
    from specrun.engine.stats import Stats

    assert "method auto (lookup+ngram+eagle+draft)" in Stats(method="auto", drafters="lookup+ngram+eagle+draft").summary()
    named = Stats(method="lookup+draft", drafters="lookup+draft").summary()
    assert named.endswith("method lookup+draft")  # a chain named is not repeated


# ---- where auto finds its heads (a tiny llama.cpp target, heads beside the model file) --------

@pytest.fixture
def model(tiny_llama, tmp_path):
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    path = tmp_path / "tiny.gguf"
    path.write_bytes(tiny_llama.gguf_path.read_bytes())
    return path


def beside(model: Path, kind: str, config, hidden_size: int | None = None) -> Path:
    path = model.with_suffix(f".{kind}.safetensors")
    save_heads(MADE[kind](hidden_size or config.hidden_size, config.vocab_size), path)
    return path


@pytest.fixture
def heads_pay_here(monkeypatch):
    """Heads that pay wherever found: the tiny target's heads weigh more than it does, so the
    gate (tested above) would keep them out; these tests are of where auto finds them."""
    import specrun.sessions.heads as heads_choice

    monkeypatch.setattr(heads_choice, "heads_pay", lambda heads, target, stored: True)  # generate, chat, bench read it there


def auto_run(model: Path, *extra: str):
    result = invoke("generate", "def f(x):", "-t", str(model), "-m", "auto", "-n", "12", "--json", *extra)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["stats"], result.stderr


@pytest.mark.parametrize("kinds, chosen", [
    (("eagle",), "eagle"), (("medusa",), "medusa"), (("medusa", "hydra"), "hydra"), (("medusa", "eagle"), "eagle"),
])
def test_auto_drafts_with_the_best_kind_of_heads_found_beside_the_model(model, tiny_llama, kinds, chosen,
                                                                      heads_pay_here):
    for kind in kinds:
        beside(model, kind, tiny_llama.config)
    stats, stderr = auto_run(model)
    assert stats["method"] == "auto" and stats["drafters"] == f"lookup+ngram+{chosen}"


def test_auto_without_heads_drafts_as_before(model):
    stats, stderr = auto_run(model)
    assert stats["drafters"] == "lookup+ngram" and "heads" not in stderr


def test_heads_found_for_another_model_leave_auto_without_them_and_say_so(model, tiny_llama, heads_pay_here):
    path = beside(model, "eagle", tiny_llama.config, hidden_size=64)
    stats, stderr = auto_run(model)
    assert stats["drafters"] == "lookup+ngram"
    notes = [line for line in stderr.splitlines() if "auto drafts without the eagle heads found" in line]
    assert len(notes) == 1 and str(path) in notes[0] and "64" in notes[0], stderr
    assert "Traceback" not in stderr
    beside(model, "medusa", tiny_llama.config)  # a kind further down that serves: auto takes it instead
    stats, stderr = auto_run(model)
    assert stats["drafters"] == "lookup+ngram+medusa"
    assert sum("auto drafts without the eagle heads found" in line for line in stderr.splitlines()) == 1


def test_auto_drafts_with_the_heads_file_given(model, tiny_llama, tmp_path):
    beside(model, "eagle", tiny_llama.config)
    given = tmp_path / "given.safetensors"
    save_heads(random_heads(tiny_llama.config.hidden_size, tiny_llama.config.vocab_size), given)
    stats, _ = auto_run(model, "--heads", str(given))
    assert stats["drafters"] == "lookup+ngram+medusa"  # --heads, not the eagle heads beside the model


def test_a_heads_file_given_that_cannot_serve_auto_is_one_line(model, tiny_llama, tmp_path):
    wrong = tmp_path / "wrong.safetensors"
    save_heads(random_eagle(64, tiny_llama.config.vocab_size), wrong)
    result = invoke("generate", "def f(x):", "-t", str(model), "-m", "auto", "-n", "4", "--heads", str(wrong))
    assert_one_line_error(result.exit_code, result.stderr, 1, "wrong.safetensors", "64",
                          str(tiny_llama.config.hidden_size))
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(b"\x00" * 16)
    result = invoke("generate", "def f(x):", "-t", str(model), "-m", "auto", "-n", "4", "--heads", str(damaged))
    assert_one_line_error(result.exit_code, result.stderr, 1, "damaged.safetensors")


# ---- the demo target's shipped heads: auto's text stays plain decoding's -------------------

@pytest.fixture
def gpu_costs_stored(monkeypatch):
    """Every session reads GPU-like pass costs stored by an earlier run (the demo target's heads pay)."""
    import specrun.bench.runner as runner
    import specrun.sessions.chat as chat
    import specrun.sessions.generation as generation
    import specrun.sessions.setup as setup

    for module in (generation, chat, runner, setup):
        monkeypatch.setattr(module, "load_tuned", lambda target, draft, threads: stored(gpu_like))
        monkeypatch.setattr(module, "load_target_entry", lambda target, threads: stored(gpu_like), raising=False)


def test_a_first_run_times_the_target_and_leaves_the_heads_out_where_its_costs_say_they_lose(monkeypatch):
    """No run has stored this machine's costs: auto times a few passes (said in a note) and, where
    a 5-token pass costs several plain steps (a CPU's, given here whatever this machine's are),
    drafts without the demo heads."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    import specrun.sessions.tuning as tuning

    monkeypatch.setattr(tuning, "time_passes", lambda target, prompt, counts, repeats=7:
                        {n: 0.01 * cpu_like(n) for n in counts})
    result = invoke("generate", "def parse(line):", "-n", "16", "--backend", "llama", "--json", "-m", "auto")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["stats"]["drafters"] == "lookup+ngram+draft"
    assert "auto timed the target's passes for its eagle heads" in result.stderr


@pytest.mark.parametrize("relative, kept", [(gpu_like, True), (cpu_like, False)])
def test_heads_without_stored_costs_are_kept_as_a_probe_of_the_target_s_passes_says(monkeypatch, relative, kept):
    import specrun.sessions.tuning as tuning
    from specrun.sessions.heads import PROBE_COUNTS, paying_heads

    eagle = load_heads(shipped_heads_path("demo-target", "eagle"))
    target = _Target(int(eagle.depth_bytes / 0.6))
    target.tokenize = lambda text: [1, 2, 3]
    empty = type("Empty", (), {"tokens": [], "thread_tally": lambda self: None})  # a sequence holding nothing
    monkeypatch.setattr("specrun.backends.kv.sequence_for", lambda backend: empty())
    probes, notes = [], []

    def time_passes(backend, prompt, counts, repeats=7):
        probes.append((tuple(counts), repeats))
        return {n: 0.01 * relative(n) for n in counts}

    monkeypatch.setattr(tuning, "time_passes", time_passes)
    assert (paying_heads(eagle, None, target, None, notes.append) is eagle) is kept
    assert probes == [(PROBE_COUNTS, 1), (PROBE_COUNTS, 3)]  # one pass of each shape to warm up, then timed
    assert notes == ["auto timed the target's passes for its eagle heads (no run had stored them yet)"]
    probes.clear()
    assert (paying_heads(eagle, None, target, stored(relative)) is eagle) is kept
    assert probes == []  # stored costs: no probe


def test_probed_costs_are_kept_as_the_target_s_own_entry_for_the_next_process(monkeypatch):
    """A server whose slots answered (its own session learned nothing) or a chat left before its
    first answer: the costs auto timed are the target's entry, read by the next process instead of
    timing again; an entry already there is left as it was."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    import specrun.sessions.tuning as tuning
    from specrun.backends.llama import LlamaCppBackend
    from specrun.modelkit.demo import demo_gguf
    from specrun.sessions.heads import paying_heads
    from specrun.sessions.setup import load_target_entry, remember_probe

    monkeypatch.setattr(tuning, "time_passes", lambda target, prompt, counts, repeats=7:
                        {n: 0.01 * cpu_like(n) for n in counts})
    eagle = load_heads(shipped_heads_path("demo-target", "eagle"))
    target = LlamaCppBackend(demo_gguf("demo-target"), n_ctx=256, n_threads=1)
    try:
        assert load_target_entry(target, 1) is None
        kept = []
        paying_heads(eagle, None, target, None, None, lambda costs: kept.append(remember_probe(target, 1, costs)))
        entry = load_target_entry(target, 1)
        assert kept and entry is not None and entry.learned
        assert entry.target_costs == {n: 0.01 * cpu_like(n) for n in entry.target_costs} and 1 in entry.target_costs
        remember_probe(target, 1, {1: 9.0, 5: 9.0})  # an entry there already: left as it was
        assert load_target_entry(target, 1).target_costs == entry.target_costs
        assert load_target_entry(target, 2) is None  # another thread count is another entry
    finally:
        target.close()


def test_auto_on_the_demo_target_drafts_with_its_shipped_eagle_heads_and_keeps_the_text(gpu_costs_stored):
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    args = ("generate", "def parse(line):", "-n", "48", "--backend", "llama", "--exact", "--json")
    plain = json.loads(invoke(*args, "-m", "none").stdout)
    result = invoke(*args, "-m", "auto")
    assert result.exit_code == 0, result.output
    auto = json.loads(result.stdout)
    assert auto["stats"]["drafters"] == "lookup+ngram+eagle+draft"
    assert auto["text"] == plain["text"]


@pytest.mark.parametrize("relative, takes", [(gpu_like, True), (cpu_like, False)])
def test_auto_takes_the_demo_target_s_heads_only_where_the_stored_costs_say_they_pay(relative, takes, monkeypatch):
    """This CPU's pass costs (a 5-token pass ~3 plain steps) keep them out, a GPU's take them in;
    generate, a chat and a bench alike, and the text stays plain decoding's either way."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    import specrun.sessions.chat as chat
    import specrun.sessions.generation as generation
    from specrun.bench.runner import BenchConfig, run_bench
    from specrun.bench.suite import BUILTIN_SUITE
    from specrun.engine.loop import GenerationParams
    from specrun.registry.loading import LoadOptions

    import specrun.bench.runner as runner

    for module in (generation, chat, runner):
        monkeypatch.setattr(module, "load_tuned", lambda target, draft, threads: stored(relative))
    chain = "lookup+ngram+eagle+draft" if takes else "lookup+ngram+draft"
    args = ("generate", "def parse(line):", "-n", "32", "--backend", "llama", "--exact", "--json")
    plain = json.loads(invoke(*args, "-m", "none").stdout)
    auto = json.loads(invoke(*args, "-m", "auto").stdout)
    assert auto["stats"]["drafters"] == chain and auto["text"] == plain["text"]
    load = LoadOptions(backend="llama", threads=1, exact=True)
    # a chat's context grows turn by turn, but the demo pair's 2,048 tokens never reach what engages
    # the draft's windowed cache (draft_model.ENGAGE_SPANS of its 580): auto holds none
    chat_chain = chain
    with chat.open_chat("demo-target", "demo-draft", "auto", load) as session:
        assert "+".join(member.name for member in session.engine.drafter.members) == chat_chain
        session.set_method("none")
        session.set_method("auto")
        assert "+".join(member.name for member in session.engine.drafter.members) == chat_chain
    bench = run_bench(BenchConfig("demo-target", "demo-draft", ("none", "auto"), max_new_tokens=16, load=load),
                      BUILTIN_SUITE[:1])
    assert any("auto drafts with the target's eagle heads too" in note for note in bench.notes) is takes
    assert bench.comparison.mismatches.get("auto", []) == []


def test_auto_with_heads_on_mlx_keeps_plain_decoding_s_text(gpu_costs_stored):
    pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
    args = ("generate", "def parse(line):", "-n", "32", "--backend", "mlx", "--json")
    plain = json.loads(invoke(*args, "-m", "none").stdout)
    result = invoke(*args, "-m", "auto")
    assert result.exit_code == 0, result.output
    auto = json.loads(result.stdout)
    assert auto["stats"]["drafters"] == "lookup+ngram+eagle+draft"
    assert auto["text"] == plain["text"] or auto["stats"]["near_ties"] > 0


# ---- chat, bench ----------------------------------------------------------------------------

def test_a_chat_in_auto_drafts_with_the_heads_and_finds_them_again_after_another_method(model, tiny_llama,
                                                                                        heads_pay_here):
    from specrun.backends.kv import sequence_for
    from specrun.engine.loop import GenerationParams
    from specrun.registry.loading import LoadOptions
    from specrun.sessions.chat import open_chat

    beside(model, "hydra", tiny_llama.config)
    chain = ["lookup", "ngram", "hydra", "draft"]
    with open_chat(str(model), str(model), "auto", LoadOptions(backend="llama")) as session:
        assert [member.name for member in session.engine.drafter.members] == chain
        assert sequence_for(session.target).tracking
        session.set_method("none")
        assert not sequence_for(session.target).tracking  # the heads' drafter closed: plain passes untracked
        session.set_method("auto")
        assert [member.name for member in session.engine.drafter.members] == chain
    with open_chat(str(model), str(model), "none", LoadOptions(backend="llama")) as session:
        session.set_method("auto")  # a chat begun without a drafter finds them when auto is asked for
        assert [member.name for member in session.engine.drafter.members] == chain
        done = list(session.ask("def f(x):", GenerationParams(8, 4)))[-1]
        assert done.stats.drafters == "+".join(chain)


def test_bench_s_auto_line_drafts_with_the_heads_and_notes_it(model, tiny_llama, heads_pay_here):
    from specrun.bench.runner import BenchConfig, run_bench
    from specrun.bench.suite import BUILTIN_SUITE
    from specrun.registry.loading import LoadOptions

    beside(model, "medusa", tiny_llama.config)
    result = invoke("bench", "-t", str(model), "--methods", "none,auto", "-n", "8", "--per-category", "1")
    assert result.exit_code == 0, result.output
    assert "auto drafts with the target's medusa heads too" in result.stderr + result.stdout
    bench = run_bench(BenchConfig(str(model), None, ("none", "auto"), max_new_tokens=8,
                                  load=LoadOptions(backend="llama")), BUILTIN_SUITE[:1])
    assert bench.comparison.figures["auto"].by_prompt[0][0].stats.drafters == "lookup+ngram+medusa"
    assert bench.comparison.figures["none"].by_prompt[0][0].stats.drafters == ""


@pytest.fixture
def reads(monkeypatch):
    """The heads files read from disk, in order."""
    import specrun.heads.files as heads_io

    read, load = [], heads_io.load_heads
    monkeypatch.setattr(heads_io, "load_heads", lambda path, *args, **kwargs: read.append(path) or load(path, *args, **kwargs))
    return read


def test_a_head_line_and_auto_s_heads_are_read_once(model, tiny_llama, heads_pay_here, reads):
    from specrun.sessions.heads import comparison_heads

    path = beside(model, "eagle", tiny_llama.config)
    from specrun.registry.loading import LoadOptions, open_pair

    target, _ = open_pair(str(model), None, LoadOptions(backend="llama"))
    try:
        options = comparison_heads(str(model), None, target, ("none", "eagle", "auto"), None, None)
    finally:
        target.close()
    assert options.auto_heads == "eagle"  # the eagle line's heads serve auto too
    assert reads == [path]


def test_a_chat_reads_its_heads_once_however_often_the_method_changes(model, tiny_llama, heads_pay_here, reads):
    from specrun.registry.loading import LoadOptions
    from specrun.sessions.chat import open_chat

    path = beside(model, "hydra", tiny_llama.config)
    with open_chat(str(model), str(model), "auto", LoadOptions(backend="llama")) as session:
        for method in ("hydra", "none", "auto", "hydra"):
            session.set_method(method)
        assert [member.name for member in session.engine.drafter.members] == ["hydra"]
    assert reads == [path]


def test_a_comparison_tracks_hidden_states_only_for_the_lines_whose_drafters_read_them(tiny_llama):
    """Every line of a bench drives one target: the heads auto binds must not have the baseline
    (or any line without heads) pay for tracked passes."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from specrun.backends.kv import sequence_for
    from specrun.backends.llama import LlamaCppBackend
    from specrun.engine.loop import GenerationParams
    from specrun.sessions.compare import Variant, compare_variants

    config = tiny_llama.config
    target = LlamaCppBackend(tiny_llama.gguf_path, n_ctx=256, n_threads=1)
    try:
        seen = []
        variants = [Variant("none", "none", 0), Variant("auto", "auto", 4), Variant("lookup", "lookup", 4),
                    Variant("eagle", "eagle", 4)]
        compare_variants(target, None, [[1, 5, 9, 1, 5], [2, 7, 2, 7]], variants, GenerationParams(6),
                         drafter_options=DrafterOptions(heads=random_eagle(config.hidden_size, config.vocab_size),
                                                        auto_heads="eagle"),
                         on_result=lambda index, name, result: seen.append((name, sequence_for(target).tracking)))
        assert seen == [(name, name in ("auto", "eagle")) for _ in range(2) for name in ("none", "auto", "lookup",
                                                                                          "eagle")]
        assert not sequence_for(target).tracking  # the drafters closed, tracking ends with them
    finally:
        target.close()


def test_a_conversation_s_cache_is_not_emptied_to_time_the_target(monkeypatch):
    """chat's /method auto mid-conversation with no stored costs: no probe (it would empty the
    cache the conversation's next turn reuses), so no heads by themselves."""
    import specrun.sessions.tuning as tuning
    from specrun.sessions.heads import paying_heads

    eagle = load_heads(shipped_heads_path("demo-target", "eagle"))
    monkeypatch.setattr("specrun.backends.kv.sequence_for", lambda backend: type("Held", (), {"tokens": [1, 2]})())

    def no_probe(*args, **kwargs):
        raise AssertionError("the conversation's cache was emptied for a probe")

    monkeypatch.setattr(tuning, "time_passes", no_probe)
    assert paying_heads(eagle, None, _Target(int(eagle.depth_bytes / 0.6)), None) is None
