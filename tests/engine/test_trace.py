"""`--trace`: each step's record, and the policy's state behind it, without moving the policy."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fake_models import VOCAB, CostedFake, SimClock, agreeing_draft, hashed_logits
from specrun.drafters.chain import ChainDrafter
from specrun.drafters.draft_model import DraftModelDrafter
from specrun.drafters.lookup import PromptLookupDrafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine


def traced_run(alpha: float, trace: bool, n: int = 400):
    """A lookup + draft chain, adaptive, on a target whose passes cost 1 s and 0.05 s a token, with
    a draft model right ``alpha`` of the time at 0.3 s a token: the result and the records."""
    clock = SimClock()
    table = hashed_logits(VOCAB, salt=5, spread=3.0)
    target = CostedFake(table, clock, 1.0, 0.05)
    draft = CostedFake(agreeing_draft(table, alpha), clock, 0.3, 0.0)
    engine = SpeculativeEngine(target, ChainDrafter([PromptLookupDrafter(), DraftModelDrafter(draft)]), clock=clock)
    records = []
    if trace:
        engine.on_trace = records.append
    result = engine.run([1, 2, 3, 1, 2], GenerationParams(n, draft_len=8, adaptive=True), complete_cache=False)
    return result, records


@pytest.mark.parametrize("alpha", [0.1, 0.9])
def test_a_traced_run_decides_and_writes_what_an_untraced_one_does(alpha):
    """Reading the controllers' estimates builds no cost table and settles no gate (describe,
    TargetCosts.peek): on simulated clocks every figure of the two runs is the same."""
    traced, records = traced_run(alpha, trace=True)
    plain, _ = traced_run(alpha, trace=False)
    assert traced.token_ids == plain.token_ids
    assert traced.stats.to_dict() == plain.stats.to_dict()
    assert records


def test_the_records_add_up_to_the_run_s_statistics():
    """One record a step (the prefill's token first, as the statistics count it); what they drafted, kept and
    emitted is the run's, and each pass's clocks are the step's."""
    result, records = traced_run(0.9, trace=True)
    stats = result.stats
    assert [r["plan"] for r in records[:1]] == ["prefill"] and len(records) == stats.steps
    assert sum(r["emitted"] for r in records) == stats.new_tokens
    assert sum(r["drafted"] for r in records) == stats.drafted
    assert sum(r["accepted"] for r in records) == stats.accepted
    assert sum(r["verify_ms"] for r in records) == pytest.approx(1e3 * stats.verify_seconds, rel=1e-3)
    assert [r["context"] for r in records] == sorted(r["context"] for r in records)
    drafting = [r for r in records if r["source"] == "draft"]
    assert drafting and all(r["plan"] == "draft" and r["drafted"] >= r["accepted"] for r in drafting)
    last = records[-1]["policy"]["drafters"]["draft"]
    # a draft right 90% of the time: on, its estimates near that, and a best length that beats plain decoding
    assert last["on"] and last["probe_in"] == 0 and last["acceptance"][0] > 0.75
    assert last["expected_tokens_per_second"] > last["plain_tokens_per_second"] > 0
    assert records[-1]["policy"]["gate"] == {"on": True, "plain_steps_left": 0}


def test_a_draft_that_does_not_pay_is_seen_switched_off_with_its_next_probe():
    """Right 10% of the time at 0.3 s a token: the draft model's controller turns it off, and the
    trace says so, with the steps before its next probe and its expected rate below plain's."""
    _, records = traced_run(0.1, trace=True)
    off = [r["policy"]["drafters"]["draft"] for r in records if "draft" in r["policy"]["drafters"]
           and not r["policy"]["drafters"]["draft"]["on"]]
    assert off and all(d["probe_in"] >= 1 for d in off)
    assert all(d["expected_tokens_per_second"] is None or d["best_length"] == 0 for d in off)


def test_a_run_without_an_adaptive_policy_traces_no_policy():
    clock = SimClock()
    table = hashed_logits(VOCAB, salt=5, spread=3.0)
    engine = SpeculativeEngine(CostedFake(table, clock, 1.0, 0.05), PromptLookupDrafter(), clock=clock)
    records = []
    engine.on_trace = records.append
    result = engine.run([1, 2, 3, 1, 2], GenerationParams(40, draft_len=4), complete_cache=False)
    assert len(records) == result.stats.steps and all(r["policy"] is None for r in records)


# ---- the file -------------------------------------------------------------------------------
def test_a_trace_file_appears_whole_when_the_run_ends(tmp_path):
    from specrun.sessions.trace import TraceFile

    path = tmp_path / "run.jsonl"
    trace = TraceFile(path)
    trace.header(method="auto")
    trace.step({"plan": "plain"})
    assert not path.exists()  # lines go beside it until the run ends
    trace.close(KeyboardInterrupt())
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["trace"] == "specrun" and lines[1] == {"step": 1, "plan": "plain"}
    assert lines[-1] == {"stopped": "KeyboardInterrupt"}
    assert [p.name for p in tmp_path.iterdir()] == ["run.jsonl"]
    trace.close()  # a second close does nothing


def test_a_run_refused_before_its_first_step_leaves_no_trace(tmp_path):
    from specrun.sessions.trace import TraceFile

    trace = TraceFile(tmp_path / "run.jsonl")
    trace.header(method="auto")
    trace.close(ValueError("the prompt is empty"))
    assert list(tmp_path.iterdir()) == []


def test_generate_writes_the_trace_and_its_summary_is_the_run_s(tiny_llama, tmp_path):
    pytest.importorskip("llama_cpp")
    from specrun.cli.app import app

    path = str(tiny_llama.gguf_path)
    out = tmp_path / "t.jsonl"
    result = CliRunner().invoke(app, ["generate", "def f():", "-t", path, "-d", path, "-n", "12", "--json",
                                      "--trace", str(out)])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)["stats"]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["trace"] == "specrun" and lines[0]["method"] == "auto" and lines[0]["prompt_tokens"] > 0
    assert lines[-1]["summary"]["new_tokens"] == stats["new_tokens"] == 12
    steps = lines[1:-1]
    assert [s["step"] for s in steps] == list(range(1, stats["steps"] + 1))
    assert sum(s["emitted"] for s in steps) == 12


@pytest.mark.parametrize("where", ["folder", "under_a_file"])
def test_a_trace_path_that_cannot_be_written_is_one_line_before_anything_runs(tiny_llama, tmp_path, where):
    pytest.importorskip("llama_cpp")
    from specrun.cli.app import app

    blocker = tmp_path / "file"
    blocker.write_text("x")
    target = tmp_path if where == "folder" else blocker / "t.jsonl"
    result = CliRunner().invoke(app, ["generate", "def f():", "-t", str(tiny_llama.gguf_path), "-n", "4",
                                      "--trace", str(target)])
    assert result.exit_code == (2 if where == "folder" else 1)  # a folder named: a usage error, as a missing one
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "trace" in lines[0] and "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_trace_in_a_folder_that_does_not_exist_is_a_usage_error_and_makes_no_folder(tiny_llama, tmp_path):
    """As bench's --json and --report: a mistyped folder was made (with the trace in it)."""
    pytest.importorskip("llama_cpp")
    from specrun.cli.app import app

    missing = tmp_path / "no" / "such"
    result = CliRunner().invoke(app, ["generate", "def f():", "-t", str(tiny_llama.gguf_path), "-n", "4",
                                      "--trace", str(missing / "t.jsonl")])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and str(missing) in lines[0] and "does not exist" in lines[0], result.output
    assert list(tmp_path.iterdir()) == []


def test_describing_a_controller_leaves_it_and_its_costs_as_they_were():
    """What a traced step reads: no cost table built (it would move when the next one is, and
    with it the lengths chosen) and no gate settled (it would switch a drafter on or off a step
    before an untraced run does)."""
    import copy

    from specrun.control.costs import DraftCosts, TargetCosts
    from specrun.control.draft_length import DraftLengthController

    costs, drafting = TargetCosts(), DraftCosts()
    for n, seconds in ((1, 1.0), (5, 1.2)):
        costs.observe(n, seconds)
    drafting.observe(4, 2.0)
    controller = DraftLengthController(max_draft_len=8, target_costs=costs, draft_costs=drafting)
    controller.observe(4, 0, 2.0, 1.2)  # evidence that would switch it off, not yet settled
    def state(value):  # every field, through the objects it holds
        if hasattr(value, "__dict__"):
            return {name: state(field) for name, field in vars(value).items()}
        return copy.deepcopy(value)

    before = state(controller)
    described = controller.describe()
    assert state(controller) == before
    assert described["on"] is True and described["best_length"] == 0  # as last settled; plain is best now
    assert not controller.speculating  # settled by the run itself, as an untraced run would


def test_bench_traces_every_run_and_says_which_run_each_line_is(tiny_llama, tmp_path):
    """Each step and each run's statistics name the prompt, the line and the repeat; what a run's
    steps emitted is what the bench counted for it; the warm-up is not traced."""
    pytest.importorskip("llama_cpp")
    from specrun.cli.app import app

    path = str(tiny_llama.gguf_path)
    out, report = tmp_path / "b.jsonl", tmp_path / "b.json"
    result = CliRunner().invoke(app, ["bench", "-t", path, "-d", path, "--methods", "none,draft", "--categories",
                                      "chat", "--per-category", "2", "-n", "8", "--trace", str(out),
                                      "--json", str(report)])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["trace"] == "specrun" and lines[0]["methods"] == ["none", "draft"] and lines[0]["prompts"] == 2
    summaries = {(s["prompt"], s["line"], s["repeat"]): s["summary"] for s in lines if "summary" in s}
    runs = {(r["prompt_index"], r["variant"], r["repeat"]): r["stats"] for r in json.loads(report.read_text())["runs"]}
    assert summaries.keys() == runs.keys() == {(p, line, 0) for p in (0, 1) for line in ("none", "draft")}
    for key, stats in runs.items():
        steps = [s for s in lines if "step" in s and (s["prompt"], s["line"], s["repeat"]) == key]
        assert summaries[key]["new_tokens"] == stats["new_tokens"] == sum(s["emitted"] for s in steps) == 8
        assert len(steps) == stats["steps"]


def test_the_time_a_record_takes_is_left_out_of_the_run_s_clocks():
    """Where plain steps read ahead, each step is timed from when the last one was handed over, and
    that is what the gate weighs: a trace that takes 0.2 s a record (against 1 s passes) must not
    read as slower steps. Decisions, outputs and every figure match the untraced run's."""
    def run(trace_seconds):
        clock = SimClock()
        table = hashed_logits(VOCAB, salt=5, spread=3.0)
        target = CostedFake(table, clock, 1.0, 0.05, reads_ahead=True)
        draft = CostedFake(agreeing_draft(table, 0.5), clock, 0.3, 0.0)
        engine = SpeculativeEngine(target, ChainDrafter([PromptLookupDrafter(), DraftModelDrafter(draft)]),
                                   clock=clock)
        records = []

        def record(line):
            clock.now += trace_seconds
            records.append(line)

        if trace_seconds is not None:
            engine.on_trace = record
        return engine.run([1, 2, 3, 1, 2], GenerationParams(300, draft_len=8, adaptive=True), complete_cache=False)

    untraced, traced = run(None), run(0.2)
    assert traced.token_ids == untraced.token_ids
    assert traced.stats.to_dict() == untraced.stats.to_dict()


def test_a_run_ended_before_any_step_is_traced_too(tmp_path):
    from specrun.engine.stats import Stats
    from specrun.sessions.trace import TraceFile

    trace = TraceFile(tmp_path / "t.jsonl")
    trace.header(method="auto")
    trace.finish(Stats())
    trace.close()
    assert [list(json.loads(line))[0] for line in (tmp_path / "t.jsonl").read_text().splitlines()] == [
        "trace", "summary"]


def test_a_trace_that_cannot_be_written_leaves_the_run_s_own_error_standing(tmp_path):
    """A full disk while Ctrl-C stops the run: the trace goes, nothing is left beside it, and the
    interruption is what the run ends with; without an error of the run's, the write error is one."""
    import errno

    from specrun.errors import FileAccessError
    from specrun.sessions.trace import TraceFile

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            pass

    from specrun.engine.stats import Stats

    for interrupted in (True, False):
        trace = TraceFile(tmp_path / "t.jsonl")
        trace.step({"plan": "plain"})
        trace._file.close()
        trace._file = Full()
        if interrupted:
            trace.close(KeyboardInterrupt())  # no error of its own: the caller re-raises the interruption
        else:  # the disk fills as the run's statistics are written: that is the run's error
            with pytest.raises(FileAccessError, match="No space left") as raised:
                trace.finish(Stats())
            trace.close(raised.value)
        assert list(tmp_path.iterdir()) == []


def test_a_trace_given_through_a_link_is_written_to_the_linked_file(tmp_path):
    (tmp_path / "logs").mkdir()
    real = tmp_path / "logs" / "run.jsonl"
    real.write_text("old\n")
    link = tmp_path / "run.jsonl"
    link.symlink_to(real)
    from specrun.sessions.trace import TraceFile

    trace = TraceFile(link)
    trace.step({"plan": "plain"})
    trace.close()
    assert link.is_symlink() and json.loads(real.read_text()) == {"step": 1, "plan": "plain"}


def test_chat_traces_each_answer_by_its_number(tiny_llama, tmp_path):
    """Two messages on a pipe, one answer each: every step and each answer's statistics say which
    answer; each answer's steps emit what its statistics count."""
    pytest.importorskip("llama_cpp")
    from specrun.cli.app import app

    path = str(tiny_llama.gguf_path)
    out = tmp_path / "c.jsonl"
    result = CliRunner().invoke(app, ["chat", "-t", path, "-d", path, "-n", "6", "--each-line",
                                      "--trace", str(out)], input="def f():\nclass A:\n")
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["trace"] == "specrun" and lines[0]["method"] == "auto"
    summaries = {line["answer"]: line["summary"] for line in lines if "summary" in line}
    assert sorted(summaries) == [1, 2]
    for answer, stats in summaries.items():
        steps = [line for line in lines if "step" in line and line["answer"] == answer]
        assert len(steps) == stats["steps"] and sum(s["emitted"] for s in steps) == stats["new_tokens"] == 6


def test_plain_passes_queued_by_the_step_before_say_so():
    """A target reading ahead queues the next plain pass while the caller holds the last tokens: such
    a step's record says `queued` (its verify_ms is a wait, not a cost; `specrun trace` leaves it out
    of a plain pass's median); a pass timed whole does not."""
    clock = SimClock()
    table = hashed_logits(VOCAB, salt=5, spread=3.0)
    target = CostedFake(table, clock, 1.0, 0.05, reads_ahead=True)
    draft = CostedFake(agreeing_draft(table, 0.0), clock, 0.5, 0.0)  # never right: the gate goes plain
    engine = SpeculativeEngine(target, DraftModelDrafter(draft), clock=clock)
    records = []
    engine.on_trace = records.append
    engine.run([1, 2, 3, 1, 2], GenerationParams(200, draft_len=8, adaptive=True), complete_cache=False)
    queued = [line for line in records if "queued" in line]
    assert len(queued) > 50 and all(line["queued"] is True and line["plan"] == "plain" for line in queued)
    assert any(line["plan"] == "plain" and "queued" not in line for line in records)  # the first of a stretch
