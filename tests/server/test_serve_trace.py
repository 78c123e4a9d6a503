"""`specrun serve --trace FILE`: every request's steps as JSON Lines, a request's lines appended
together when it ends (so slots decoding side by side never interleave), each ending with its
summary and finish reason or why it stopped; tracing changes no answer, and a trace that cannot be
written stops the tracing, not the serving."""

from __future__ import annotations

import errno
import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from server_harness import DEMO_ARGS, SPECRUN, start_server, stop_server
from test_serve_load import MODEL, answer, messages_for

from specrun.sessions.trace import ServerTrace


def read_trace(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def by_request(records: list[dict]) -> dict[str, list[dict]]:
    """Each request's lines, checked to be side by side in the file."""
    requests: dict[str, list[dict]] = {}
    previous = None
    for record in records:
        request = record["request"]
        assert request == previous or request not in requests, f"the lines of {request} are interleaved"
        requests.setdefault(request, []).append(record)
        previous = request
    return requests


def test_a_traced_server_writes_every_request_whole_with_its_steps_and_ending(demo_server, tmp_path):
    path = tmp_path / "serve.jsonl"
    server = start_server(*DEMO_ARGS, "--parallel", "2", "--trace", str(path))
    try:
        keys = [(client, 0) for client in range(4)]
        expected = {key: answer(demo_server, messages_for(*key), stream=False) for key in keys}
        stop = expected[keys[0]][0][6:9]  # a stop string inside the first answer
        client = server.client()

        def ask(key):
            if key == keys[0]:
                response = client.chat.completions.create(model=MODEL, messages=messages_for(*key), max_tokens=16,
                                                          temperature=0, stop=[stop])
                return response.id, (response.choices[0].message.content, response.choices[0].finish_reason)
            stream = key[0] % 2 == 1
            options = dict(model=MODEL, messages=messages_for(*key), max_tokens=16, temperature=0)
            if stream:
                chunks = [c for c in client.chat.completions.create(stream=True, **options) if c.choices]
                got = "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason
                return chunks[0].id, got
            response = client.chat.completions.create(**options)
            return response.id, (response.choices[0].message.content, response.choices[0].finish_reason)

        with ThreadPoolExecutor(4) as pool:
            answers = dict(zip(keys, pool.map(ask, keys)))
        for key in keys[1:]:
            assert answers[key][1] == expected[key]  # tracing changes no answer
        assert answers[keys[0]][1] == (expected[keys[0]][0].split(stop)[0], "stop")

        # A client that leaves mid-answer: its request ends with why.
        stream = client.chat.completions.create(model=MODEL, messages=messages_for(9, 9), max_tokens=400,
                                                temperature=0, stream=True)
        left = next(iter(stream)).id
        stream.close()
        deadline = time.monotonic() + 30
        while left not in path.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        # A request refused once it reaches a slot (its prompt outgrows the context): a 400 to its
        # client, its id and why in the trace.
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "tea " * 20_000}],
                                           max_tokens=4)
    finally:
        assert stop_server(server) == 0, server.log

    header, *records = read_trace(path)
    assert header["trace"] == "specrun" and header["serve"] is True and header["slots"] == 2
    assert header["target"] == "demo-target" and header["method"] == "auto"
    requests = by_request(records)
    refused = [lines for lines in requests.values() if lines[-1].get("stopped", "").startswith("refused: ")]
    assert len(refused) == 1 and len(refused[0]) == 2 and "context" in refused[0][-1]["stopped"]
    assert set(requests) == {answers[key][0] for key in keys} | {left, refused[0][0]["request"]}
    for key in keys:
        opening, *steps, ending = requests[answers[key][0]]
        assert opening["slot"] in (0, 1) and opening["prompt_tokens"] > 0 and opening["temperature"] == 0
        assert [step["step"] for step in steps] == list(range(1, len(steps) + 1)) and steps[0]["plan"] == "prefill"
        assert ending["finish_reason"] == answers[key][1][1]
        assert sum(step["emitted"] for step in steps) == ending["summary"]["new_tokens"]
        assert sum(step["accepted"] for step in steps) == ending["summary"]["accepted"]
    assert requests[left][-1] == {"request": left, "stopped": "the client left"}
    # Requests decoded side by side: their steps say what the slots' batch chose (control/batch.py).
    shared = [step["policy"]["batch"] for lines in requests.values() for step in lines
              if "batch" in (step.get("policy") or {})]
    assert shared and all(batch is None or batch["sequences"] == 2 for batch in shared)


def test_serve_trace_into_a_folder_is_one_line_before_anything_loads(tmp_path):
    done = subprocess.run([*SPECRUN, "serve", "--port", "0", *DEMO_ARGS, "--trace", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 2  # a usage error, as a folder that does not exist is
    assert done.stderr.strip().count("\n") == 0 and "is a folder" in done.stderr and "Traceback" not in done.stderr


def test_serve_trace_in_a_folder_that_does_not_exist_is_a_usage_error_and_makes_no_folder(tmp_path):
    missing = tmp_path / "no" / "such"
    done = subprocess.run([*SPECRUN, "serve", "--port", "0", *DEMO_ARGS, "--trace", str(missing / "t.jsonl")],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "does not exist" in done.stderr and str(missing) in done.stderr
    assert list(tmp_path.iterdir()) == []


class FullDisk:
    def __init__(self) -> None:
        self.closed = False

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_a_trace_that_cannot_be_written_stops_tracing_with_one_log_line(tmp_path):
    logged: list[str] = []
    with ServerTrace(tmp_path / "t.jsonl") as trace:
        trace.log = logged.append
        trace.header(target="t", method="auto", slots=1)
        full = trace._file = FullDisk()
        first = trace.request("cmpl-1", slot=0)
        first.step({"plan": "prefill", "emitted": 1})
        first.end(stopped="the client left")
        trace.request("cmpl-2", slot=0).end(stopped="the client left")  # tracing has stopped: no second line
    assert full.closed and len(logged) == 1
    assert "cannot be written (No space left on device); tracing stops, serving goes on" in logged[0]
    assert read_trace(tmp_path / "t.jsonl")[0]["serve"] is True  # what was written stays


def test_a_value_json_cannot_hold_stops_tracing_not_serving(tmp_path):
    logged: list[str] = []
    with ServerTrace(tmp_path / "t.jsonl") as trace:
        trace.log = logged.append
        trace.header(target="t", method="auto", slots=1)
        request = trace.request("cmpl-1", slot=0)
        request.step({"plan": "prefill", "emitted": 1, "odd": object()})
        request.end(stopped="the client left")  # raises nothing
        trace.request("cmpl-2", slot=0).end(stopped="the client left")
    assert len(logged) == 1 and "TypeError" in logged[0] and "serving goes on" in logged[0]
    assert len(read_trace(tmp_path / "t.jsonl")) == 1


def test_a_server_that_never_starts_leaves_an_earlier_trace_as_it_was_and_no_new_file(tmp_path):
    earlier = tmp_path / "earlier.jsonl"
    earlier.write_text('{"trace": "specrun", "version": 1, "serve": true}\n')
    with ServerTrace(earlier):
        pass  # the model failed to load: no header
    assert earlier.read_text() == '{"trace": "specrun", "version": 1, "serve": true}\n'
    with ServerTrace(tmp_path / "new.jsonl"):
        pass
    assert not (tmp_path / "new.jsonl").exists()
    with ServerTrace(earlier) as trace:  # one that starts empties it first
        trace.header(target="t", method="none", slots=1)
    assert [record["target"] for record in read_trace(earlier)] == ["t"]


def test_a_request_trace_ends_once(tmp_path):
    with ServerTrace(tmp_path / "t.jsonl") as trace:
        request = trace.request("cmpl-1", slot=1, prompt_tokens=3)
        request.recorder(answer=4)({"plan": "prefill", "emitted": 1})
        request.end("stop", stats=None, stopped=None)  # no statistics: said as a stop
        request.end("length")
    lines = read_trace(tmp_path / "t.jsonl")
    assert lines == [{"request": "cmpl-1", "slot": 1, "prompt_tokens": 3},
                     {"request": "cmpl-1", "step": 1, "plan": "prefill", "emitted": 1},
                     {"request": "cmpl-1", "stopped": "ended before it finished"}]
