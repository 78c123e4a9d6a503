"""`specrun trace FILE`: a --trace file told in words, run by run, and files that are not traces
refused in one line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specrun.cli.app import app
from specrun.dry import Dry
from specrun.adaptive_p import AdaptiveP
from specrun.mirostat import Mirostat
from specrun.errors import FileAccessError
from specrun.sampling import SamplingSettings
from specrun.sessions.trace_reading import explain, read_trace


def policy(draft_on: bool, gate_on: bool = True, best: int | None = 3, batch: dict | None = None) -> dict:
    explained = {"gate": {"on": gate_on, "plain_steps_left": 0 if gate_on else 8},
                 "drafters": {"draft": {"on": draft_on, "probe_in": 0 if draft_on else 7, "acceptance": [0.5],
                                        "best_length": best, "expected_tokens_per_second": 40.0,
                                        "plain_tokens_per_second": 50.0}}}
    if batch is not None:
        explained["batch"] = batch
    return explained


def step(n: int, plan: str, drafted: int, accepted: int, explained: dict, **where) -> dict:
    return {**where, "step": n, "context": 10 + n, "plan": plan, "source": "draft" if drafted else "none",
            "drafted": drafted, "accepted": accepted, "emitted": accepted + 1, "draft_ms": 2.0 if drafted else 0.0,
            "verify_ms": 8.0, "policy": explained}


def write(path, records) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def test_passes_that_asked_for_a_draft_and_got_none_are_not_counted_as_drafted(tmp_path):
    """A server's trace read "12 draft" where 2 passes drafted: the others asked, got nothing, and
    verified a plain token."""
    path = tmp_path / "t.jsonl"
    write(path, [{"trace": "specrun", "version": 1, "method": "auto"}, step(1, "prefill", 0, 0, policy(True)),
                 step(2, "draft", 4, 3, policy(True)), step(3, "draft", 0, 0, policy(True)),
                 step(4, "draft", 0, 0, policy(True)), step(5, "plain", 0, 0, policy(True))])
    told = explain(read_trace(path)[1][0])
    assert told[1] == "  8 tokens in 5 passes (1.60 a pass): 2 asked for a draft and got none, 1 prefill, 1 draft, 1 plain"


def test_a_run_is_told_with_its_drafters_time_turns_and_end(tmp_path):
    path = tmp_path / "t.jsonl"
    write(path, [{"trace": "specrun", "version": 1, "target": "t", "draft": "d", "method": "auto", "prompt_tokens": 5},
                 step(1, "prefill", 0, 0, policy(True)),
                 step(2, "draft", 4, 3, policy(True)),
                 step(3, "draft", 4, 0, policy(False, best=0)),
                 step(4, "plain", 0, 0, policy(False, gate_on=False, best=0)),
                 step(5, "draft", 2, 2, policy(True, gate_on=True)),
                 {"summary": {"new_tokens": 10, "tokens_per_second": 31.25, "mean_tokens_per_step": 2.0}}])
    header, runs = read_trace(path)
    assert header["target"] == "t" and len(runs) == 1
    told = explain(runs[0])
    assert told == [
        "the run",
        "  10 tokens in 5 passes (2.00 a pass): 3 draft, 1 prefill, 1 plain",
        "  draft: 3 passes, 10 drafted, 5 kept (50%), 0.6 ms a drafted token",
        "  a plain pass: 8.0 ms (the median of 1)",
        "  time: drafting 6 ms (13%), verifying 40 ms",
        "  step 3 (context 13): draft off: no draft length beats plain decoding's 50.0 tok/s; probed again in 7 steps",
        "  step 4 (context 14): the gate on realised speed turned speculation off for 8 plain steps",
        "  step 5 (context 15): speculation back on",
        "  step 5 (context 15): draft on again (best length 3, expected 40.0 tok/s against plain 50.0)",
        "  finished: 10 tokens, 31.2 tok/s, 2.00 a verify pass",
    ]
    assert explain(runs[0], most_events=1)[5:] == [
        "  step 3 (context 13): draft off: no draft length beats plain decoding's 50.0 tok/s; probed again in 7 steps",
        "  … and 3 more turns of the policy (--events to see them)",
        "  finished: 10 tokens, 31.2 tok/s, 2.00 a verify pass"]


def test_a_server_s_requests_are_told_apart_with_the_batch_s_choices_and_how_each_ended(tmp_path):
    path = tmp_path / "serve.jsonl"
    batch = {"sequences": 2, "length": 3, "gain": 1.12}
    write(path, [{"trace": "specrun", "version": 1, "serve": True, "target": "t", "draft": None, "method": "auto",
                  "slots": 2},
                 {"request": "cmpl-a", "slot": 1, "prompt_tokens": 40, "cached_tokens": 32, "temperature": 0.7},
                 step(1, "prefill", 0, 0, policy(True), request="cmpl-a"),
                 step(2, "draft", 3, 3, policy(True, batch=batch), request="cmpl-a"),
                 {"request": "cmpl-a", "summary": {"new_tokens": 5, "mean_tokens_per_step": 2.5},
                  "finish_reason": "stop"},
                 {"request": "cmpl-b", "slot": 0, "prompt_tokens": 9, "cached_tokens": 0, "temperature": 0.0},
                 {"request": "cmpl-b", "stopped": "the client left"}])
    result = CliRunner().invoke(app, ["trace", str(path)])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        "serve: t, method auto, 2 slots",
        "request cmpl-a (slot 1, 40 prompt tokens, 32 cached, temperature 0.7)",
        "  5 tokens in 2 passes (2.50 a pass): 1 prefill, 1 draft",
        "  draft: 1 pass, 3 drafted, 3 kept (100%), 0.7 ms a drafted token",
        "  time: drafting 2 ms (11%), verifying 16 ms",
        "  step 2 (context 12): 2 slots together draft 3 each (1.12x plain batching's tokens/s, predicted)",
        "  finished (stop): 5 tokens, 2.50 a verify pass",
        "request cmpl-b (slot 0, 9 prompt tokens, 0 cached, temperature 0)",
        "  stopped: the client left",
    ]


def test_a_batch_held_plain_says_what_it_measured(tmp_path):
    """The batch's measured tokens a second under the rates' choice and plain (control/batch.Realised):
    a step where plain is held says both; a change of the hold alone (the length 0 both times) is a
    turn of its own."""
    path = tmp_path / "serve.jsonl"
    drafting = {"sequences": 4, "length": 0, "gain": 1.0, "slots": 4, "held_plain": False,
                "realised": {"rates": 52.0, "plain": 48.5}}
    held = {"sequences": 4, "length": 0, "gain": 1.0, "slots": 4, "held_plain": True,
            "realised": {"rates": 38.25, "plain": 49.5}}
    write(path, [{"trace": "specrun", "version": 1, "serve": True, "target": "t", "draft": None, "method": "auto",
                  "slots": 4},
                 {"request": "cmpl-a", "slot": 0, "prompt_tokens": 9, "cached_tokens": 0, "temperature": 0.0},
                 step(1, "draft", 2, 2, policy(True, batch=drafting), request="cmpl-a"),
                 step(2, "draft", 0, 0, policy(True, batch=held), request="cmpl-a"),
                 {"request": "cmpl-a", "summary": {"new_tokens": 4, "mean_tokens_per_step": 2.0},
                  "finish_reason": "stop"}])
    result = CliRunner().invoke(app, ["trace", str(path)])
    assert result.exit_code == 0, result.output
    assert [line for line in result.stdout.splitlines() if "slots together" in line] == [
        "  step 1 (context 11): 4 slots together draft 0 each (1.00x plain batching's tokens/s, predicted)",
        "  step 2 (context 12): 4 slots together draft 0 each (1.00x plain batching's tokens/s, predicted; "
        "plain held at 4 slots: 38.2 tok/s measured under the rates' choice against 49.5 plain)"]


def test_generate_s_trace_is_told_by_the_trace_command(tiny_llama, tmp_path):
    pytest.importorskip("llama_cpp")
    path = str(tiny_llama.gguf_path)
    out = tmp_path / "t.jsonl"
    ran = CliRunner().invoke(app, ["generate", "def f():", "-t", path, "-d", path, "-n", "12", "--trace", str(out)])
    assert ran.exit_code == 0, ran.output
    told = CliRunner().invoke(app, ["trace", str(out)])
    assert told.exit_code == 0, told.output
    lines = told.stdout.splitlines()
    assert lines[0].startswith("run: ") and "method auto" in lines[0] and lines[1] == "the run"
    assert lines[2].startswith("  12 tokens in ") and lines[-1].startswith("  finished: 12 tokens")
    # - reads the trace from stdin, told alike
    piped = CliRunner().invoke(app, ["trace", "-"], input=out.read_bytes())
    assert piped.exit_code == 0 and piped.stdout == told.stdout, piped.output
    import specrun.sessions.trace_reading as reading

    class Terminal:
        def isatty(self):
            return True

    with pytest.MonkeyPatch.context() as patch:  # on a terminal it would wait for a trace typed in
        patch.setattr(reading.sys, "stdin", Terminal())
        with pytest.raises(FileAccessError, match="cannot read the trace on stdin: stdin is a terminal"):
            read_trace("-")
    for given, problem in ((b"junk\n", "it is not a specrun trace"), (b"\xff\xfe", "it is not text"), (b"", "it is empty")):
        refused = CliRunner().invoke(app, ["trace", "-"], input=given)
        assert refused.exit_code == 1 and refused.stderr.startswith(f"error: cannot read the trace on stdin: {problem}")


def test_a_sampled_run_s_trace_says_how_it_sampled(tiny_llama, tmp_path):
    pytest.importorskip("llama_cpp")
    path = str(tiny_llama.gguf_path)
    out = tmp_path / "t.jsonl"
    ran = CliRunner().invoke(app, ["generate", "def f():", "-t", path, "-n", "6", "--temp", "0.8", "--top-k", "5",
                                   "--min-p", "0.1", "--seed", "1", "--trace", str(out)])
    assert ran.exit_code == 0, ran.output
    header = json.loads(out.read_text().splitlines()[0])
    assert (header["temperature"], header["top_k"], header["min_p"], header["seed"]) == (0.8, 5, 0.1, 1)
    assert "top_p" not in header  # off
    told = CliRunner().invoke(app, ["trace", str(out)]).stdout.splitlines()[0]
    assert told.endswith(", sampled at temperature 0.8, top-k 5, min-p 0.1, seed 1"), told


@pytest.mark.parametrize("header", [
    {"temperature": 0.0, "top_k": 5}, {"temperature": "hot"}, {"top_k": [1]}, {},
    {"temperature": True}, {"temperature": 10**400}, {"temperature": float("nan")},
    {"temperature": 0.8, "top_k": float("inf")}, {"temperature": 0.8, "top_k": 2.5},
    {"temperature": 0.8, "top_p": 0}, {"temperature": 0.8, "seed": [1]}, {"temperature": 0.8, "seed": True},
    {"temperature": 0.8, "seed": 1.5}])
def test_a_header_that_says_no_sampling_is_told_without_it(tmp_path, header):
    path = tmp_path / "t.jsonl"
    write(path, [{"trace": "specrun", "version": 1, "method": "draft", **header}, step(1, "prefill", 0, 0, policy(True))])
    told = CliRunner().invoke(app, ["trace", str(path)])
    assert told.exit_code == 0, told.output
    assert told.stdout.splitlines()[0] == "run: ?, method draft"


def test_a_header_with_llama_cpp_s_infill_rule_says_so(tmp_path):
    path = tmp_path / "t.jsonl"
    header = {"trace": "specrun", "version": 1, "method": "draft", "temperature": 1.0, "top_k": 40, "infill": True}
    write(path, [header, step(1, "prefill", 0, 0, policy(True))])
    told = CliRunner().invoke(app, ["trace", str(path)])
    assert told.stdout.splitlines()[0] == "run: ?, method draft, sampled at temperature 1, top-k 40, infill rule"


def test_a_header_with_an_order_of_its_own_says_it(tmp_path):
    path = tmp_path / "t.jsonl"
    sampling = SamplingSettings(0.7, 40, 0.9, order=("temperature", "top_k", "top_p", "min_p"))
    header = {"trace": "specrun", "version": 1, "method": "draft", **sampling.fields()}
    assert header["samplers"] == ["temperature", "top_k", "top_p", "min_p"]
    assert SamplingSettings(0.7, 40, 0.9).fields()["samplers"] == ["top_n_sigma", "top_k", "typ_p", "top_p", "min_p",
                                                                    "xtc", "temperature"]
    write(path, [header, step(1, "prefill", 0, 0, policy(True))])
    told = CliRunner().invoke(app, ["trace", str(path)])
    assert told.stdout.splitlines()[0] == ("run: ?, method draft, sampled at temperature 0.7, top-k 40, top-p 0.9, "
                                           "samplers temperature;top_k;top_p")
    write(path, [{**header, "samplers": ["temperature", "temperature"]}, step(1, "prefill", 0, 0, policy(True))])
    told = CliRunner().invoke(app, ["trace", str(path)])  # an order no run could use: not told
    assert told.stdout.splitlines()[0] == "run: ?, method draft"
    typical = SamplingSettings(0.7, typical_p=0.8, top_n_sigma=1.5, xtc_probability=0.5, xtc_threshold=0.2,
                               dry=Dry(0.8, last_n=-1, breakers=("\n",)), dynatemp_range=0.3, dynatemp_exponent=2.0)
    write(path, [{"trace": "specrun", "version": 1, "method": "draft", **typical.fields()},
                 step(1, "prefill", 0, 0, policy(True))])
    told = CliRunner().invoke(app, ["trace", str(path)])
    assert told.stdout.splitlines()[0] == ("run: ?, method draft, sampled at temperature 0.7, typical-p 0.8, "
                                           "top-n-sigma 1.5, XTC 0.5 at 0.2, dynamic temperature ±0.3 (exponent 2), "
                                           "DRY 0.8 (base 1.75, allowed 2) over the "
                                           "whole text, 1 sequence breaker")
    # mirostat: the temperature and it alone (top-k off under it), its μ's target and rate
    miro = SamplingSettings(0.8, 40, seed=3, mirostat=Mirostat(2, 4.0, 0.2))
    write(path, [{"trace": "specrun", "version": 1, "method": "draft", **miro.fields()},
                 step(1, "prefill", 0, 0, policy(True))])
    told = CliRunner().invoke(app, ["trace", str(path)])
    assert told.stdout.splitlines()[0] == ("run: ?, method draft, sampled at temperature 0.8, mirostat 2 (τ 4, η 0.2), "
                                           "seed 3")
    adaptive = SamplingSettings(0.8, min_p=0.05, adaptive_p=AdaptiveP(0.4, 0.8))
    write(path, [{"trace": "specrun", "version": 1, "method": "draft", **adaptive.fields()},
                 step(1, "prefill", 0, 0, policy(True))])
    told = CliRunner().invoke(app, ["trace", str(path)])
    assert told.stdout.splitlines()[0] == ("run: ?, method draft, sampled at temperature 0.8, min-p 0.05, "
                                           "adaptive-p 0.4 (decay 0.8)")
    # a header from before llama.cpp's order (none named) sampled with the temperature first
    write(path, [{"trace": "specrun", "version": 1, "method": "draft", "temperature": 0.7, "top_p": 0.9},
                 step(1, "prefill", 0, 0, policy(True))])
    told = CliRunner().invoke(app, ["trace", str(path)])
    assert told.stdout.splitlines()[0] == ("run: ?, method draft, sampled at temperature 0.7, top-p 0.9, "
                                           "samplers temperature;top_p")


def test_a_trace_still_being_written_is_told_as_far_as_it_goes(tmp_path):
    path = tmp_path / "t.jsonl"
    write(path, [{"trace": "specrun", "version": 1, "serve": True},
                 {"request": "cmpl-1", "slot": 0}, step(1, "prefill", 0, 0, policy(True), request="cmpl-1")])
    with path.open("a") as file:
        file.write('{"request": "cmpl-1", "step": 2, "cont')  # a line cut off mid-write
    header, runs = read_trace(path)
    assert len(runs[0].steps) == 1
    assert explain(runs[0], live=True)[-1] == "  not ended (the trace was cut off, or is still being written)"
    result = CliRunner().invoke(app, ["trace", str(path)])
    assert result.stdout.splitlines()[-1] == "  not ended (the trace was cut off, or is still being written)"


def test_a_run_stopped_by_ctrl_c_is_told_as_stopped_where_it_stopped(tmp_path):
    """bench's and chat's Ctrl-C line names no run: it ends the last run not ended (not a run of
    its own); a run without an end in a trace put in place whole was interrupted, not cut off."""
    path = tmp_path / "t.jsonl"
    where = {"prompt": 0, "line": "auto", "repeat": 0}
    write(path, [{"trace": "specrun", "version": 1, "methods": ["none", "auto"]},
                 step(1, "prefill", 0, 0, policy(True), prompt=0, line="none", repeat=0),
                 {"prompt": 0, "line": "none", "repeat": 0, "summary": {"new_tokens": 1}},
                 step(1, "prefill", 0, 0, policy(True), **where), {"stopped": "KeyboardInterrupt"}])
    _, runs = read_trace(path)
    assert [run.where for run in runs] == [{"prompt": 0, "line": "none", "repeat": 0}, where]
    assert runs[1].stopped == "KeyboardInterrupt" and explain(runs[1])[-1] == "  stopped: KeyboardInterrupt"
    told = CliRunner().invoke(app, ["trace", str(path)]).stdout
    assert "the run" not in told and "1 token in 1 pass (" in told
    write(path, [{"trace": "specrun", "version": 1}, step(1, "prefill", 0, 0, policy(True), answer=1)])
    _, runs = read_trace(path)  # a chat answer ended by Ctrl-C, the chat going on
    assert explain(runs[0])[-1].startswith("  not ended: interrupted before its statistics")


@pytest.mark.parametrize("content, said", [
    (None, "no such file"),
    ("", "it is empty"),
    ('{"hello": 1}\n', "it is not a specrun trace"),
    ("hello", "it is not a specrun trace"),  # one line, unfinished: not taken for an empty trace
    ('{"trace": "specrun", "version": 99}\n', "trace version 99, newer than this specrun reads"),
    ('{"trace": "specrun", "version": 1}\nnot json\n{"step": 1}\n', "line 2 is not JSON"),
    ('{"trace": "specrun", "version": 1}\n[1, 2]\n', "line 2 is not a JSON object"),
    (b'{"trace": "specrun", "version": 1}\n\xff\xfe\n', "it is not text"),
])
def test_a_file_that_is_not_a_trace_is_one_line_naming_why(tmp_path, content, said):
    _assert_refused(tmp_path, content, said)


GOOD = step(1, "draft", 4, 2, policy(True))


@pytest.mark.parametrize("changed, said", [
    ({"drafted": None}, "'drafted' is null, not a count"),
    ({"drafted": "4"}, "'drafted' is \"4\", not a count"),
    ({"accepted": [1]}, "'accepted' is [1], not a count"),
    ({"emitted": -3}, "'emitted' is -3, not a count"),
    ({"drafted": 10**400}, "'drafted' is 1000000"),
    ({"drafted": True}, "'drafted' is true, not a count"),
    ({"draft_ms": {}}, "'draft_ms' is {}, not a non-negative number"),
    ({"verify_ms": float("nan")}, "'verify_ms' is nan, not a non-negative number"),
    ({"verify_ms": float("inf")}, "'verify_ms' is inf"),
    ({"plan": ["draft"]}, "'plan' is ['draft'], not a name"),
    ({"source": 5}, "'source' is 5, not a name"),
    ({"drafted": 1, "accepted": 9}, "9 tokens kept of 1 drafted"),
    ({"policy": [1]}, "'policy' is [1], not an object"),
    ({"policy": {"gate": "x", "drafters": {}}}, "'policy.gate' is \"x\", not an object"),
    ({"policy": {"drafters": 5}}, "'policy.drafters' is 5"),
    ({"policy": {"drafters": {"draft": [1]}}}, "'policy.drafters'"),
    ({"policy": {"batch": {"gain": "big"}}}, "'policy.batch.gain'"),
    ({"policy": {"batch": {"realised": [1]}}}, "'policy.batch.realised' is [1], not an object"),
    ({"policy": {"batch": {"realised": {"plain": -2}}}}, "'policy.batch.realised.plain' is -2"),
    ({"policy": {"batch": {"held_plain": "yes"}}}, "'policy.batch.held_plain' is \"yes\", not true or false"),
    ({"prompt": [0], "line": "none", "repeat": 0}, "'prompt' is [0], not a count"),
    ({"prompt": 0, "line": ["none"], "repeat": 0}, "'line' is ['none'], not a name"),
    ({"queued": "yes"}, "'queued' is \"yes\", not true or false"),
])
def test_a_line_no_run_writes_is_one_line_naming_the_field(tmp_path, changed, said):
    """Wrong types were internal errors (TypeError, OverflowError, AttributeError), impossible
    numbers told as fact ("-48 tokens", "9 kept (900%)", "a plain pass: nan ms")."""
    content = "".join(json.dumps(record) + "\n" for record in (
        {"trace": "specrun", "version": 1}, {**GOOD, **changed}))
    _assert_refused(tmp_path, content, f"line 2: {said}")


@pytest.mark.parametrize("summary, said", [
    ("fast", "'summary' is \"fast\", not an object"),
    ({"new_tokens": -1}, "'summary.new_tokens' is -1, not a count"),
    ({"mean_tokens_per_step": "x"}, "'summary.mean_tokens_per_step' is \"x\""),
])
def test_a_summary_no_run_writes_is_refused(tmp_path, summary, said):
    content = "".join(json.dumps(record) + "\n" for record in (
        {"trace": "specrun", "version": 1}, GOOD, {"summary": summary}))
    _assert_refused(tmp_path, content, f"line 3: {said}")


@pytest.mark.parametrize("version", [None, [1], {"a": 1}, True, 0, -5, "1"])
def test_a_first_line_without_a_trace_version_says_so_not_newer(tmp_path, version):
    content = json.dumps({"trace": "specrun", "version": version}) + "\n"
    _assert_refused(tmp_path, content, "not a trace version")


def test_a_deeply_nested_line_is_refused_not_an_internal_error(tmp_path):
    content = '{"trace": "specrun", "version": 1}\n' + "[" * 100_000 + "]" * 100_000 + "\n"
    _assert_refused(tmp_path, content, "line 2 is not JSON")


def test_a_header_of_odd_types_is_still_told(tmp_path):
    path = tmp_path / "t.jsonl"
    write(path, [{"trace": "specrun", "version": 1, "serve": True, "slots": "x", "methods": 5}])
    told = CliRunner().invoke(app, ["trace", str(path)])
    assert told.exit_code == 0 and told.stdout.splitlines()[0] == "serve: ?, method 5", told.output


def _assert_refused(tmp_path, content, said: str) -> None:
    path = tmp_path / "t.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(FileAccessError) as refused:
        read_trace(path)
    assert said in refused.value.one_line(), refused.value.one_line()
    result = CliRunner().invoke(app, ["trace", str(path)])
    assert result.exit_code == 1
    assert len(result.output.strip().splitlines()) == 1 and said.split(",")[0] in result.output
    assert "Traceback" not in result.output


def test_a_folder_is_not_a_trace_and_events_out_of_range_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(app, ["trace", str(tmp_path)])
    assert result.exit_code == 1 and "not a regular file" in result.output
    path = tmp_path / "t.jsonl"
    write(path, [{"trace": "specrun", "version": 1}])
    assert CliRunner().invoke(app, ["trace", str(path), "--events", "-1"]).exit_code == 2


def test_plain_passes_queued_ahead_are_told_as_waits_not_as_costs(tmp_path):
    """A backend reading ahead queues the next plain pass while the caller holds the last tokens:
    such a step's verify_ms is its wait (`queued`), left out of a plain pass's median cost."""
    path = tmp_path / "t.jsonl"
    plain = [{**step(n, "plain", 0, 0, policy(False)), "verify_ms": 30.0} for n in (1, 2, 3)]
    queued = [{**step(n, "plain", 0, 0, policy(False)), "verify_ms": 2.0, "queued": True} for n in (4, 5, 6, 7)]
    write(path, [{"trace": "specrun", "version": 1}, *plain, *queued])
    _, runs = read_trace(path)
    assert "  a plain pass: 30.0 ms (the median of 3)" in explain(runs[0])
    write(path, [{"trace": "specrun", "version": 1}, *queued])
    _, runs = read_trace(path)
    assert any(line.startswith("  a plain step waited 2.0 ms for its pass") for line in explain(runs[0]))


def test_two_traces_joined_into_one_file_are_refused_naming_the_line(tmp_path):
    """`cat a.jsonl b.jsonl > two.jsonl` read as one trace: the second's run reported as a second
    answer of the first, under the first's models and method."""
    path = tmp_path / "two.jsonl"
    where = {"prompt": 0, "line": "none", "repeat": 0}
    write(path, [{"trace": "specrun", "version": 1, "methods": ["none"]}, step(1, "prefill", 0, 0, policy(True), **where),
                 {"trace": "specrun", "version": 1, "methods": ["auto"]}, step(1, "prefill", 0, 0, policy(True), **where)])
    with pytest.raises(FileAccessError) as refused:
        read_trace(path)
    assert "line 3 begins another trace" in refused.value.one_line() and "each trace on its own" in refused.value.fix


@pytest.mark.parametrize(("budget", "told"), [
    ({"budget": 64, "starts": [[5]], "ends": [[6], [7, 8]], "forced": [9, 6], "start_at": 12},
     "run: ?, method draft, decoded greedy, reasoning budget 64 tokens"),
    ({"budget": -1, "starts": [[5]], "ends": [[6]], "forced": [6], "start_at": 0}, "run: ?, method draft"),
    ({"budget": 64, "starts": [[5]], "ends": [[6]], "forced": [True], "start_at": 0}, "run: ?, method draft"),
    ({"budget": 64, "starts": "<think>", "ends": [[6]], "forced": [6], "start_at": 0}, "run: ?, method draft")])
def test_a_header_with_a_reasoning_budget_says_so_where_it_is_one_a_run_could_use(tmp_path, budget, told):
    path = tmp_path / "t.jsonl"
    header = {"trace": "specrun", "version": 1, "method": "draft", "temperature": 0.0, "reasoning_budget": budget}
    write(path, [header, step(1, "prefill", 0, 0, policy(True))])
    assert CliRunner().invoke(app, ["trace", str(path)]).stdout.splitlines()[0] == told
