"""Flash attention chosen by measurement on a CPU (sessions/kernels.py): measured once per
model, machine and thread count, stored, read back, and never where the user chose."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from specrun.errors import ContextFullError, ModelFileError, SpecrunError
from specrun.registry.loading import LoadOptions
from specrun.sessions import kernels
from specrun.sessions.kernels import FlashCosts, kernels_path, settle_flash_attn


class StubLlama:
    """What settle_flash_attn asks of a llama.cpp backend, with set pass costs."""

    name = "llama"
    path = None
    n_ctx = 4096
    n_threads = 2
    kv_type = "f16"
    library_version = "llama-cpp-python 0.3.36"

    def __init__(self, on: dict[int, float], off: dict[int, float], runs_on_cpu: bool = True, flash_attn=None,
                 deep: tuple | None = None):
        self.costs = {True: on, False: off} if on else {}
        self.deep_costs = {True: deep[0], False: deep[1]} if deep else self.costs  # after DEEP_DEPTH tokens
        self.runs_on_cpu = runs_on_cpu
        self.flash_attn = flash_attn
        self.timed = 0
        self.probes: list[tuple[int, float]] = []  # (depth, budget) of each probe

    def time_flash_attn(self, depth, counts, budget_s):
        assert depth in (kernels.PROBE_DEPTH, kernels.DEEP_DEPTH) and tuple(counts) == kernels.PROBE_COUNTS
        self.timed += 1
        self.probes.append((depth, budget_s))
        costs = self.deep_costs if depth == kernels.DEEP_DEPTH else self.costs
        return (depth if costs else 0), costs

    def set_flash_attn(self, on: bool) -> None:
        self.flash_attn = on

    busy = False  # other processes holding cores (LlamaCppBackend.busy_now)

    def busy_now(self) -> bool:
        return self.busy


class FailingLlama(StubLlama):
    """A timing pass or a re-created context that fails (memory)."""

    def __init__(self, fail_in: str) -> None:
        super().__init__(*SLOW_ON)
        self.fail_in = fail_in

    def time_flash_attn(self, depth, counts, budget_s):
        if self.fail_in == "timing":
            raise ContextFullError("llama.cpp could not decode a timing pass of 6 tokens", "free memory")
        return super().time_flash_attn(depth, counts, budget_s)

    def set_flash_attn(self, on: bool) -> None:
        raise ModelFileError("llama.cpp could not create a context of 4096 tokens", "lower --ctx or free memory")


SLOW_ON = ({1: 0.010, 6: 0.030}, {1: 0.009, 6: 0.020})  # on loses both passes (this project's Intel CPU)


def test_the_setting_faster_over_a_plain_step_and_a_verify_pass_is_chosen():
    assert FlashCosts("m", "machine", 2, 256, *SLOW_ON).flash_on() is False
    fast_on = FlashCosts("m", "machine", 2, 256, {1: 0.009, 6: 0.020}, {1: 0.010, 6: 0.030})  # the AMD CPU's way
    assert fast_on.flash_on() is True
    # on wins the plain step, loses more on the verify pass: off, one setting for every method
    mixed = FlashCosts("m", "machine", 2, 256, {1: 0.009, 6: 0.030}, {1: 0.010, 6: 0.020})
    assert mixed.flash_on() is False
    even = FlashCosts("m", "machine", 2, 256, {1: 0.0100, 6: 0.0300}, {1: 0.0099, 6: 0.0297})
    assert even.flash_on() is True  # within MARGIN: llama.cpp's choice stands


def test_the_first_run_measures_and_says_so_later_runs_read_what_it_stored():
    first = StubLlama(*SLOW_ON)
    note = settle_flash_attn(first, LoadOptions())
    assert first.timed == 1 and first.flash_attn is False
    assert note.startswith("flash attention off") and "--flash-attn on|off overrides" in note
    assert "6-token pass 30 ms on, 20 ms off" in note
    stored = json.loads(kernels_path().read_text())["flash_attn"]
    assert len(stored) == 1 and next(iter(stored.values()))["threads"] == 2

    second = StubLlama(*SLOW_ON)
    assert settle_flash_attn(second, LoadOptions()) is None
    assert second.timed == 0 and second.flash_attn is False
    other_threads = StubLlama(*SLOW_ON)
    other_threads.n_threads = 1
    settle_flash_attn(other_threads, LoadOptions())
    assert other_threads.timed == 1  # what a pass costs depends on the threads: measured apart


def test_a_choice_timed_while_other_processes_held_cores_is_this_run_s_alone():
    """Timed on a busy machine, the costs are of passes a displaced thread held up: the run takes
    the choice, says it was not stored, and the next run measures again."""
    busy = StubLlama(*SLOW_ON)
    busy.busy = True
    note = settle_flash_attn(busy, LoadOptions())
    assert busy.timed == 1 and busy.flash_attn is False and note.endswith(
        "not stored: other processes kept cores busy while it was timed")
    assert not kernels_path().exists()
    quiet = StubLlama(*SLOW_ON)
    settle_flash_attn(quiet, LoadOptions())
    assert quiet.timed == 1 and kernels_path().exists()


def test_a_long_context_chooses_by_a_probe_after_thousands_of_tokens_kept_apart():
    """After 256 tokens on wins (llama.cpp's choice); after 4,096 off runs a plain step and a
    verify pass far faster (this project's CPU, docs/perf.md 3(s)): a run whose context will reach
    DEEP_FROM tokens probes there, with the deep budget, and keeps it under a key of its own."""
    near_even = ({1: 0.0100, 6: 0.0200}, {1: 0.0102, 6: 0.0203})
    deep = ({1: 0.176, 6: 0.619}, {1: 0.094, 6: 0.166})
    short = StubLlama(*near_even, deep=deep)
    settle_flash_attn(short, LoadOptions(), context=kernels.DEEP_FROM - 1)
    assert short.probes == [(kernels.PROBE_DEPTH, kernels.PROBE_BUDGET_S)] and short.flash_attn is True
    long = StubLlama(*near_even, deep=deep)
    note = settle_flash_attn(long, LoadOptions(), context=8000)
    assert long.probes == [(kernels.DEEP_DEPTH, kernels.DEEP_BUDGET_S)] and long.flash_attn is False
    assert f"measured once after {kernels.DEEP_DEPTH} tokens" in note
    again = StubLlama(*near_even, deep=deep)
    assert settle_flash_attn(again, LoadOptions(), context=5000) is None  # stored: read back
    assert again.timed == 0 and again.flash_attn is False
    assert len(json.loads(kernels_path().read_text())["flash_attn"]) == 2


@pytest.mark.parametrize("options", [LoadOptions(flash_attn="on"), LoadOptions(flash_attn="off"),
                                     LoadOptions(exact=True)])
def test_the_users_choice_and_exact_are_never_measured_over(options):
    backend = StubLlama(*SLOW_ON)
    assert settle_flash_attn(backend, options) is None
    assert backend.timed == 0 and backend.flash_attn is None and not kernels_path().exists()


def test_gpus_mlx_and_models_without_flash_attention_keep_their_own_choice():
    gpu = StubLlama(*SLOW_ON, runs_on_cpu=False)
    assert settle_flash_attn(gpu, LoadOptions()) is None and gpu.timed == 0 and gpu.flash_attn is None
    mlx = StubLlama(*SLOW_ON)
    mlx.name = "mlx"
    assert settle_flash_attn(mlx, LoadOptions()) is None and mlx.timed == 0
    unsupported = StubLlama({}, {})
    assert settle_flash_attn(unsupported, LoadOptions()) is None
    assert unsupported.timed == 1 and unsupported.flash_attn is None and not kernels_path().exists()


def test_a_config_folder_that_cannot_be_written_costs_a_measurement_per_run_not_the_run(tmp_path, monkeypatch):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("a file where the config folder would be")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(blocker))
    backend = StubLlama(*SLOW_ON)
    assert settle_flash_attn(backend, LoadOptions()) is not None and backend.flash_attn is False


@pytest.mark.parametrize("document", [
    "{not json",
    json.dumps({"version": 99, "flash_attn": {}}),
    json.dumps({"version": 1, "flash_attn": []}),
])
def test_a_damaged_file_is_one_error_naming_it_and_the_fix(document):
    kernels_path().parent.mkdir(parents=True, exist_ok=True)
    kernels_path().write_text(document)
    with pytest.raises(SpecrunError) as raised:
        settle_flash_attn(StubLlama(*SLOW_ON), LoadOptions())
    assert str(kernels_path()) in raised.value.one_line() and "delete it" in raised.value.one_line()
    assert kernels_path().read_text() == document  # nothing written over it


@pytest.mark.parametrize(("field", "value"), [
    ("on", {"1": -1.0, "6": 0.02}), ("off", {"1": 0.01}), ("threads", 0), ("depth", "256"),
    ("off", {"1": float("inf"), "6": 0.02}), ("extra", 1),
])
def test_a_forged_entry_is_refused_not_used(field, value):
    backend = StubLlama(*SLOW_ON)
    settle_flash_attn(backend, LoadOptions())
    document = json.loads(kernels_path().read_text())
    entry = next(iter(document["flash_attn"].values()))
    entry[field] = value
    kernels_path().write_text(json.dumps(document))
    with pytest.raises(SpecrunError) as raised:
        settle_flash_attn(StubLlama(*SLOW_ON), LoadOptions())
    assert "malformed" in raised.value.one_line() and "delete it" in raised.value.one_line()


def test_machines_of_one_name_and_size_with_other_processors_measure_apart(monkeypatch):
    """Cloud VMs share host names ("vm") and core counts; what one CPU measured (flash attention's
    costs, tuned and learned costs) must not be read on another: the processor's name keys them."""
    import platform

    from specrun import fileio

    monkeypatch.setattr(platform, "processor", lambda: "")  # Python's answer on most Linux machines
    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("no /proc/cpuinfo here")
    with open("/proc/cpuinfo", encoding="utf-8") as info:
        names = [line.partition(":")[2].strip() for line in info if line.startswith("model name")]
    if not names:
        pytest.skip("/proc/cpuinfo names no model here")
    assert fileio.machine_id().endswith("|" + names[0])


@pytest.mark.parametrize("fail_in", ["timing", "reopening"])
def test_a_measurement_that_fails_never_costs_the_run(fail_in):
    """A pass or a context that fails (memory) leaves llama.cpp's own choice: the run goes on."""
    backend = FailingLlama(fail_in)
    assert settle_flash_attn(backend, LoadOptions()) is None
    assert backend.flash_attn is None


def test_the_kv_cache_type_and_the_llama_cpp_build_measure_apart():
    settle_flash_attn(StubLlama(*SLOW_ON), LoadOptions())
    f32 = StubLlama(*SLOW_ON)
    f32.kv_type = "f32"
    newer = StubLlama(*SLOW_ON)
    newer.library_version = "llama-cpp-python 0.4.0"
    for backend in (f32, newer):
        settle_flash_attn(backend, LoadOptions(kv_type=backend.kv_type))
        assert backend.timed == 1
    assert len(json.loads(kernels_path().read_text())["flash_attn"]) == 3


@pytest.mark.parametrize(("python_says", "cpuinfo", "expected"), [
    ("Apple M2", None, "Apple M2"),  # Python's own answer where it has one
    ("", "processor\t: 0\nmodel name\t: AMD EPYC 9R14\n", "AMD EPYC 9R14"),
    ("", "Processor\t: ARMv7 Processor rev 4 (v7l)\n", "ARMv7 Processor rev 4 (v7l)"),
    ("", "flags\t: fpu\n", "?"),  # a cpuinfo that names nothing
    ("", OSError, "?"),  # no /proc/cpuinfo
])
def test_the_processor_is_named_from_python_or_cpuinfo(monkeypatch, tmp_path, python_says, cpuinfo, expected):
    import builtins
    import io
    import platform

    from specrun import fileio

    monkeypatch.setattr(platform, "processor", lambda: python_says)
    real_open = builtins.open

    def fake_open(path, *args, **kwargs):
        if path != "/proc/cpuinfo":
            return real_open(path, *args, **kwargs)
        if cpuinfo is OSError:
            raise FileNotFoundError(path)
        return io.StringIO(cpuinfo)

    monkeypatch.setattr(builtins, "open", fake_open)
    assert fileio.processor_name() == expected


def test_a_bench_chooses_flash_attention_for_the_context_its_longest_prompt_reaches(monkeypatch):
    """As generate passes its prompt's length and new tokens, bench passes its longest prompt's:
    a long-context bench (benchmarks/long_context.py) runs the kernels generate would."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    import specrun.bench.runner as runner
    from specrun.bench.suite import BUILTIN_SUITE

    told = []
    monkeypatch.setattr(runner, "settle_pair", lambda target, draft, options, on_note, context=None: told.append(
        (target.name, draft, context)))
    load = LoadOptions(backend="llama", threads=1)
    bench = runner.run_bench(runner.BenchConfig("demo-target", None, ("none",), max_new_tokens=8, load=load),
                             BUILTIN_SUITE[:3])
    longest = max(bench.prompt_tokens)
    assert told == [(told[0][0], None, longest + 8)]


def test_a_generate_waits_a_bounded_time_for_the_deep_probe_a_bench_any(monkeypatch):
    """generate passes its prompt's length and new tokens with DEEP_WAIT_S (a run the user waits
    on); the bench above passes no wait (a measurement, as tune)."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from typer.testing import CliRunner

    import specrun.sessions.generation as generation
    from specrun.cli.app import app

    told = []
    monkeypatch.setattr(generation, "settle_pair", lambda target, draft, options, on_note, context=None,
                        wait_s=None: told.append((context, wait_s)))
    result = CliRunner().invoke(app, ["generate", "-t", "demo-target", "--backend", "llama", "--threads", "1",
                                      "-n", "8", "--method", "none", "hello there"])
    assert result.exit_code == 0, result.output
    assert len(told) == 1 and told[0][0] > 8 and told[0][1] == kernels.DEEP_WAIT_S


# ---- a conversation that grows past DEEP_FROM (sessions/kernels.settle_for_context) ----------------

NEAR_EVEN = ({1: 0.0050, 6: 0.0100}, {1: 0.0051, 6: 0.01015})  # after 256 tokens: on (llama.cpp's choice)
DEEP_OFF = ({1: 0.176, 6: 0.619}, {1: 0.094, 6: 0.166})  # after 4,096: off far faster (docs/perf.md 3(s))


class RefusingAgain(StubLlama):
    """A model whose context can be made once, not again (memory)."""

    def set_flash_attn(self, on):
        if self.flash_attn is not None:
            raise ModelFileError("llama.cpp could not create a context of 4096 tokens", "free memory")
        super().set_flash_attn(on)


def settled_short(**kwargs) -> StubLlama:
    backend = StubLlama(*NEAR_EVEN, deep=DEEP_OFF, **kwargs)
    settle_flash_attn(backend, LoadOptions())
    assert backend.flash_attn is True
    return backend


def test_a_conversation_past_deep_from_switches_to_the_deep_choice_emptying_the_caches_once():
    target, draft = settled_short(), settled_short()
    draft.n_threads = 1  # measured apart
    emptied, notes = [], []
    switched = kernels.settle_for_context((target, draft), LoadOptions(), kernels.DEEP_FROM + 10,
                                          lambda: emptied.append(1), notes.append)
    assert len(switched) == 2 and emptied == [1]  # both models made again, the caches emptied once
    assert target.flash_attn is False and draft.flash_attn is False
    assert target.probes[-1] == (kernels.DEEP_DEPTH, kernels.DEEP_BUDGET_S)
    assert sum("flash attention off (was on)" in note for note in notes) == 2
    assert any(note.startswith("flash attention off for") for note in notes)  # what the probe measured
    # said before each deep probe ran (an answer waits for it): once a model, ahead of what it measured
    timing = [i for i, note in enumerate(notes) if note.startswith(f"timing flash attention after {kernels.DEEP_DEPTH}")]
    measured = [i for i, note in enumerate(notes) if note.startswith("flash attention off for")]
    assert len(timing) == 2 and timing[0] < measured[0] and "this answer waits for it" in notes[timing[0]]
    notes.clear()
    kernels.settle_for_context((settled_short(),), LoadOptions(), kernels.DEEP_FROM + 10, lambda: None, notes.append)
    assert not any(note.startswith("timing") for note in notes)  # stored: nothing timed, nothing said


SLOW_MODEL = ({1: 0.100, 6: 0.200}, {1: 0.102, 6: 0.203})  # an 8B model on a small CPU: on, near even


def test_a_deep_probe_estimated_past_the_wait_is_not_run_the_short_choice_stands_with_a_note():
    """Two prefills of 4,096 tokens at a 6-token pass of 200 ms: about 3 minutes (the prefill stops
    at a quarter of the deep budget), then the timed rounds. A chat's answer
    or a request does not wait for it: the short probe's choice stands, said once with the
    estimate and what measures it; nothing deep is stored, so tune measures it later."""
    assert kernels.deep_probe_seconds(FlashCosts("m", "x", 2, 256, *NEAR_EVEN)) < kernels.DEEP_WAIT_S
    slow = FlashCosts("m", "x", 2, 256, *SLOW_MODEL)
    assert kernels.DEEP_BUDGET_S / 4 < kernels.deep_probe_seconds(slow) < 200
    backend = StubLlama(*SLOW_MODEL, deep=DEEP_OFF)
    settle_flash_attn(backend, LoadOptions())
    emptied, notes = [], []
    assert kernels.settle_for_context((backend,), LoadOptions(), 8000, lambda: emptied.append(1), notes.append) == []
    assert backend.probes == [(kernels.PROBE_DEPTH, kernels.PROBE_BUDGET_S)] and backend.flash_attn is True
    assert emptied == [] and len(notes) == 1
    assert notes[0].startswith("flash attention on for") and "in this long context too" in notes[0]
    assert f"would take about {kernels.deep_probe_seconds(slow):.0f} s here" in notes[0]
    assert "`specrun tune` measures it once" in notes[0]
    assert len(json.loads(kernels_path().read_text())["flash_attn"]) == 1  # the short probe's only

    # a long generate opening on it: the short probe's choice (measured now), not llama.cpp's
    fresh = StubLlama(*SLOW_ON)
    fresh.costs = {True: {1: 0.2, 6: 0.5}, False: {1: 0.1, 6: 0.3}}  # off, and slow
    fresh.n_threads = 4  # measured apart from the one above
    note = settle_flash_attn(fresh, LoadOptions(), context=8000, wait_s=kernels.DEEP_WAIT_S)
    assert fresh.probes == [(kernels.PROBE_DEPTH, kernels.PROBE_BUDGET_S)] and fresh.flash_attn is False
    assert note.startswith("flash attention off for") and "in this long context too" in note
    # without a wait (a bench, tune) the deep probe runs however long it takes
    waited = StubLlama(*SLOW_MODEL, deep=DEEP_OFF)
    waited.n_threads = 3
    settle_flash_attn(waited, LoadOptions(), context=8000)
    assert waited.probes == [(kernels.DEEP_DEPTH, kernels.DEEP_BUDGET_S)] and waited.flash_attn is False


def test_tune_measures_the_deep_probe_for_models_whose_context_reaches_deep_from():
    """`specrun tune` (kernels.measure_deep): a deep probe for each llama.cpp model that can reach
    DEEP_FROM tokens, however long, stored; a later long request reads it and switches at once."""
    target, draft = settled_short(), settled_short()
    target.costs = draft.costs = dict(zip((True, False), SLOW_MODEL))  # past the wait
    draft.n_threads = 1
    short_context = settled_short()
    short_context.n_ctx = kernels.DEEP_FROM - 1
    short_context.n_threads = 5
    window = settled_short()
    window.reopen = lambda: None
    notes = []
    kernels.measure_deep((target, draft, None, short_context, window), LoadOptions(), notes.append)
    for backend in (target, draft):
        assert backend.probes[-1] == (kernels.DEEP_DEPTH, kernels.DEEP_BUDGET_S)
        assert backend.flash_attn is True  # measured and stored, not switched: tune calibrates as opened
    for unprobed in (short_context, window):  # the open's probe at most
        assert all(depth == kernels.PROBE_DEPTH for depth, _ in unprobed.probes)
    assert sum(note.startswith("timing flash attention after") for note in notes) == 2
    assert sum(note.startswith("flash attention off for") for note in notes) == 2
    notes.clear()
    kernels.measure_deep((target,), LoadOptions(), notes.append)
    assert notes == [] and target.probes[-1][0] == kernels.DEEP_DEPTH and target.timed == 2  # stored: once
    emptied = []
    assert len(kernels.settle_for_context((target,), LoadOptions(), 8000, lambda: emptied.append(1))) == 1
    assert target.flash_attn is False and emptied == [1] and target.timed == 2  # read, not measured


def test_a_deep_choice_that_agrees_changes_nothing():
    target = StubLlama(*NEAR_EVEN, deep=NEAR_EVEN)
    settle_flash_attn(target, LoadOptions())
    emptied = []
    assert kernels.settle_for_context((target, None), LoadOptions(), 5000, lambda: emptied.append(1)) == []
    assert emptied == [] and target.flash_attn is True


def test_models_whose_context_is_not_specruns_to_make_again_keep_theirs():
    gpu = StubLlama(*NEAR_EVEN, deep=DEEP_OFF, runs_on_cpu=False, flash_attn=True)  # a GPU's own choice
    unsettled = StubLlama(*NEAR_EVEN, deep=DEEP_OFF)  # llama.cpp's choice, never measured (flash_attn None)
    heads = settled_short()
    heads.tracking_hidden = True  # heads read its states
    window = settled_short()
    window.reopen = lambda: None  # a windowed draft: its few cells
    emptied = []
    for backend in (gpu, unsettled, heads, window):
        assert kernels.settle_for_context((backend,), LoadOptions(), 5000, lambda: emptied.append(1)) == []
    assert emptied == [] and gpu.flash_attn is True and unsettled.flash_attn is None
    assert heads.flash_attn is True and window.flash_attn is True
    for options in (LoadOptions(flash_attn="on"), LoadOptions(exact=True)):  # the user's choice
        backend = settled_short()
        assert kernels.settle_for_context((backend,), options, 5000, lambda: emptied.append(1)) == []


def test_a_context_that_cannot_be_made_again_keeps_the_one_it_had():
    backend = RefusingAgain(*NEAR_EVEN, deep=DEEP_OFF)
    settle_flash_attn(backend, LoadOptions())
    assert kernels.settle_for_context((backend,), LoadOptions(), 5000, lambda: None) == []
    assert backend.flash_attn is True


def test_backends_without_flash_attention_are_left_alone():
    class Mlx:  # MLX's backend (and the fake one) have no flash attention setting at all
        name = "mlx"

    assert settle_flash_attn(Mlx(), LoadOptions()) is None
    assert kernels.settle_for_context((Mlx(),), LoadOptions(), 5000, lambda: None) == []


def test_a_model_whose_states_heads_read_is_not_even_probed():
    heads = settled_short()
    heads.tracking_hidden = True
    kernels.settle_for_context((heads,), LoadOptions(), 5000, lambda: None)
    assert heads.probes == [(kernels.PROBE_DEPTH, kernels.PROBE_BUDGET_S)]  # the open's only


def test_the_caches_are_emptied_once_when_the_first_model_cannot_switch():
    target = RefusingAgain(*NEAR_EVEN, deep=DEEP_OFF)
    settle_flash_attn(target, LoadOptions())
    draft = settled_short()
    draft.n_threads = 1
    emptied = []
    assert len(kernels.settle_for_context((target, draft), LoadOptions(), 5000, lambda: emptied.append(1))) == 1
    assert emptied == [1] and target.flash_attn is True and draft.flash_attn is False


def deep_off_costs(monkeypatch) -> list[bool]:
    """kernels.flash_costs answering as NEAR_EVEN / DEEP_OFF without the probes' minutes; returns
    the list of its answers (True: the deep one)."""
    asked: list[bool] = []

    def costs(backend, options, context=None, on_start=None, wait_s=None):
        if options.flash_attn is not None or options.exact:
            return None, None
        deep = context is not None and context >= kernels.DEEP_FROM
        asked.append(deep)
        return FlashCosts("m", "machine", 1, 4096 if deep else 256, *(DEEP_OFF if deep else NEAR_EVEN)), None

    monkeypatch.setattr(kernels, "flash_costs", costs)
    return asked


LONG_TEXT = "\n".join(f"value_{i} = compute({i}, {i * 7 % 13})" for i in range(135))


@pytest.mark.parametrize(("method", "draft", "kv_type"), [("none", None, None), ("draft", "demo-draft", "f32")])
def test_a_chat_switches_once_its_context_may_reach_deep_from_and_answers_as_a_fresh_session(
        monkeypatch, method, draft, kv_type):
    """The real backend: a chat opened on the short probe's choice (on) reaches DEEP_FROM tokens in
    its second answer, switches its models to the deep choice (off) once, reads that prompt again in
    full, takes what tune stored under the new setting's key, and answers exactly as a session running
    with off from the start answers the same conversation (with a draft model: an F32 cache, so that
    the batch shapes of two sessions drafting differently round alike)."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    import copy

    import specrun.sessions.chat as chat_module
    from specrun.engine.loop import GenerationParams

    asked = deep_off_costs(monkeypatch)
    tuned_for = []  # (the target's flash setting, what was found) each time the session read tune's entry
    real_load_tuned = chat_module.load_tuned

    def load_tuned(target, loaded, threads):
        found = real_load_tuned(target, loaded, threads)
        tuned_for.append((target.flash_attn, found))
        return found

    monkeypatch.setattr(chat_module, "load_tuned", load_tuned)
    notes: list[str] = []
    load = LoadOptions(backend="llama", threads=1, kv_type=kv_type)
    with chat_module.open_chat("demo-target", draft, method, load, on_note=notes.append) as chat:
        assert chat.target.flash_attn is True
        list(chat.ask("def add(a, b):", GenerationParams(8, 0)))
        assert chat.target.flash_attn is True  # a short context: no probe, no switch
        before = copy.deepcopy(chat.transcript)
        assert 1700 < len(chat.target.tokenize(LONG_TEXT, add_bos=False)) < 1900
        *_, switched = chat.ask(LONG_TEXT, GenerationParams(260, 0))
        assert chat.target.flash_attn is False and switched.reused_tokens == 0
        models = [chat.target] + ([chat.draft] if draft else [])
        assert all(model.flash_attn is False for model in models)
        assert len([note for note in notes if "(was on)" in note]) == len(models)
        assert tuned_for[-1][0] is False and chat._tuned is tuned_for[-1][1]  # remembered under the new key
        chat.reset()
        list(chat.ask(LONG_TEXT, GenerationParams(260, 0)))
        assert asked == [False] * len(models) + [True] * len(models)  # the open's, then the deep, once
    off = dataclasses.replace(load, flash_attn="off")
    with chat_module.open_chat("demo-target", draft, method, off) as fresh:
        fresh.transcript = before
        *_, again = fresh.ask(LONG_TEXT, GenerationParams(260, 0))
    assert again.text == switched.text and again.prompt_tokens == switched.prompt_tokens


def test_a_context_that_cannot_reach_deep_from_asks_for_no_deep_probe(monkeypatch):
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from specrun.engine.loop import GenerationParams
    from specrun.sessions.chat import open_chat

    asked = deep_off_costs(monkeypatch)
    with open_chat("demo-target", None, "none", LoadOptions(backend="llama", threads=1, n_ctx=1024)) as chat:
        list(chat.ask("def add(a, b):", GenerationParams(4000, 0)))  # more than the context holds
        assert chat.target.flash_attn is True
    assert asked == [False]


def test_a_draft_model_loaded_after_the_switch_is_settled_for_the_long_context_too(monkeypatch):
    """A chat that began without its draft model (method none) and switched: the draft a later
    /method draft loads runs with the deep choice too, without the target's cache emptied again."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from specrun.engine.loop import GenerationParams
    from specrun.sessions.chat import open_chat

    asked = deep_off_costs(monkeypatch)
    with open_chat("demo-target", "demo-draft", "none", LoadOptions(backend="llama", threads=1)) as chat:
        assert chat.draft is None
        list(chat.ask(LONG_TEXT, GenerationParams(300, 0)))  # 1,772 prompt tokens: the context may fill
        assert chat.target.flash_attn is False and asked == [False, True]
        cached = chat.target.n_past
        chat.set_method("draft")
        assert chat.draft.flash_attn is False and asked == [False, True, False, True]  # its open's, then deep
        assert chat.target.n_past == cached


def test_a_server_with_one_sequence_switches_for_a_long_request_and_answers_as_one_running_off(monkeypatch):
    """`specrun serve --parallel 1` opened on the short probe's choice (on): a short request keeps
    it; a request whose context may reach DEEP_FROM switches the model to the deep choice (off) once,
    and is answered as a server running with off from the start answers it."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    import asyncio

    from specrun.sampling import SamplingSettings
    from specrun.server.requests import CompletionRequest
    from specrun.server.worker import Delta, Done, Failed, Job, PairOptions, PairWorker

    asked = deep_off_costs(monkeypatch)

    def answer(worker, prompt: tuple[int, ...], max_tokens: int) -> str:
        async def ask():
            job = Job(CompletionRequest("demo", max_tokens, SamplingSettings(), prompt=prompt),
                      asyncio.get_running_loop())
            worker.submit(job)
            text = ""
            while not isinstance(event := await job.next_event(), (Done, Failed)):
                text += event.text if isinstance(event, Delta) else ""
            return event, text

        done, text = asyncio.run(ask())
        assert isinstance(done, Done), done
        return text

    texts = {}
    for flash in (None, "off"):
        worker = PairWorker(PairOptions("demo-target", None, method="none", parallel=1,
                                        load=LoadOptions(backend="llama", threads=1, flash_attn=flash)))
        worker.start()
        try:
            target = worker.session.target
            long_prompt = tuple(target.tokenize(LONG_TEXT))
            if flash is None:
                assert target.flash_attn is True
                answer(worker, tuple(target.tokenize("def add(a, b):")), 8)
                assert target.flash_attn is True and asked == [False]  # a short request: no deep probe
            texts[flash] = answer(worker, long_prompt, 290)  # 1,764 + 290: past DEEP_FROM
            assert target.flash_attn is False
        finally:
            worker.stop()
    assert asked == [False, True] and texts[None] == texts["off"]
