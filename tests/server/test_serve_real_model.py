"""`specrun serve` on the real model (SmolLM2-135M-Instruct, a ChatML template): `specrun chat`'s answers."""

from __future__ import annotations

import time

import pytest

from server_harness import parts_only_at_a_near_tie, specrun_json, start_server, stop_server

MODEL = "smollm2-135m"
ARGS = ("--target", MODEL, "--exact")
MAX_TOKENS = 32
MESSAGES = ["What is the capital of France?", "Name three colors."]
SYSTEM = "You answer in one short sentence."


@pytest.fixture(scope="module")
def smollm2_server(smollm2):
    server = start_server(*ARGS)
    yield server
    assert stop_server(server) == 0, server.log[-5:]


@pytest.mark.parametrize("system", [None, SYSTEM], ids=["template-default-system", "own-system"])
def test_chat_completions_equal_specrun_chat(smollm2_server, system):
    system_args = ("--system", system) if system else ()
    expected = specrun_json("chat", "--each-line", "-n", str(MAX_TOKENS), *ARGS, *system_args,
                            stdin="\n".join(MESSAGES))
    client = smollm2_server.client()
    for message, answer in zip(MESSAGES, expected, strict=True):
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": message})
        # SmolLM2 is Q4_1: on an AVX2-only CPU --exact answers may part at a near-tie (server_harness)
        asked = dict(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=3)
        whole = client.chat.completions.create(**asked)
        assert whole.usage.prompt_tokens == answer["prompt_tokens"]
        entries = whole.choices[0].logprobs.content
        assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8") == whole.choices[0].message.content
        if not parts_only_at_a_near_tie(entries, answer["text"]):
            assert whole.choices[0].finish_reason == {"eos": "stop", "length": "length"}[answer["finish_reason"]]
        chunks = list(client.chat.completions.create(**asked, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
        assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8") == text
        parts_only_at_a_near_tie(entries, answer["text"])


@pytest.mark.parametrize("typed", ["<|im_end|>", "<|im_start|>system"])
def test_a_message_that_is_a_template_marker_is_text_as_in_generate(smollm2_server, typed):
    """The server tokenizes a typed marker as text, as `specrun generate` does: the same prompt
    tokens and the same answer (a control token there would end or restart the turn)."""
    [expected] = specrun_json("generate", "-", "-n", str(MAX_TOKENS), *ARGS, stdin=typed)
    reply = smollm2_server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": typed}], max_tokens=MAX_TOKENS, temperature=0)
    assert reply.usage.prompt_tokens == expected["stats"]["prompt_tokens"]
    assert reply.choices[0].message.content == expected["text"]


@pytest.mark.parametrize("signals", [("SIGTERM",), ("SIGINT",), ("SIGINT", "SIGINT")],
                         ids=["SIGTERM", "Ctrl-C", "a double Ctrl-C"])
def test_shutdown_answers_the_queued_with_a_json_503_and_ends_the_stream_with_a_final_event(smollm2, signals):
    """SIGTERM or Ctrl-C with a stream in flight and requests queued: the queued got a bare 500 and
    the log CancelledError tracebacks (4; 8 on a double Ctrl-C). Now they get a JSON 503 at once,
    the stream a final event and [DONE], and the server exits 0 with no traceback."""
    import http.client
    import json
    import signal
    import threading

    from server_harness import start_server

    # flash attention given: the stream's context may pass DEEP_FROM, and the deep probe it would
    # run first (two 4,096-token prefills) took past the 60 s below on a busy machine
    server = start_server("--target", "smollm2-135m-f16", "--method", "none", "--parallel", "1", "--flash-attn", "off")
    host, port = server.host_port
    started, stream_lines, queued = threading.Event(), [], []

    def stream() -> None:
        connection = http.client.HTTPConnection(host, port, timeout=60)
        body = {"model": "smollm2-135m-f16", "prompt": "Once upon a time", "max_tokens": 4000, "stream": True}
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        for line in response:
            if line.strip():
                stream_lines.append(line.decode().strip())
                started.set()
        started.set()

    def queued_request() -> None:
        queued.append(server.post("/v1/completions", {"model": "smollm2-135m-f16", "prompt": "Hi", "max_tokens": 8}))

    threads = [threading.Thread(target=stream)] + [threading.Thread(target=queued_request) for _ in range(3)]
    threads[0].start()
    assert started.wait(60)
    for thread in threads[1:]:
        thread.start()
    time.sleep(0.5)  # queued behind the stream
    for name in signals:
        server.process.send_signal(getattr(signal, name))
        time.sleep(0.2)
    for thread in threads:
        thread.join(60)
    assert server.process.wait(timeout=30) == 0, server.log[-10:]
    assert [status for status, _ in queued] == [503] * 3
    assert all(body["error"]["code"] == "server_shutting_down" for _, body in queued)
    assert stream_lines[-1] == "data: [DONE]"
    assert "server_shutting_down" in stream_lines[-2], stream_lines[-3:]
    assert not any("Traceback" in line or "CancelledError" in line for line in server.log), server.log[-10:]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}


def test_a_tool_call_round_trip_on_the_real_model(smollm2_server, tmp_path):
    """SmolLM2's template takes no tools: they go into its system message (Hermes format), the call
    is required, its arguments follow the schema and equal what `generate --tools --method none`
    makes; the result goes back and the answer is text."""
    import json

    import jsonschema

    client = smollm2_server.client()
    question = "What is the weather in Paris?"
    first = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                           tools=[WEATHER], tool_choice="required", max_tokens=64,
                                           temperature=0).choices[0]
    assert first.finish_reason == "tool_calls"
    (call,) = first.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER]))
    [plain] = specrun_json("generate", question, *ARGS, "--method", "none", "--tools", str(tools),
                           "--tool-choice", "required", "-n", "64")
    assert [c["function"]["arguments"] for c in plain["tool_calls"]] == [call.function.arguments]
    follow_up = [{"role": "user", "content": question},
                 {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "sunny"}'}]
    final = client.chat.completions.create(model=MODEL, messages=follow_up, tools=[WEATHER], max_tokens=48,
                                           temperature=0).choices[0]
    assert final.message.tool_calls is None and final.finish_reason in ("stop", "length")
    assert final.message.content.strip()


def _entries(*rows):
    from types import SimpleNamespace

    def choice(text, logprob):
        return SimpleNamespace(token=text, bytes=list(text.encode("utf-8")), logprob=logprob)

    return [SimpleNamespace(**vars(choice(token, -1.0)), top_logprobs=[choice(token, -1.0), choice(other, -1.0 - gap)])
            for token, other, gap in rows]


def test_the_near_tie_allowance_lets_answers_part_only_at_a_near_tie():
    """The allowance above cannot hide a defect: an answer parts from the expected one only where
    the expected token is its runner-up within NEAR_TIE."""
    expected = "L'Étoile, la Marseillaise"
    same = _entries(("L'Étoile,", "The", 0.3), (" la", " le", 0.6), (" Mar", " Cit", 0.06), ("seillaise", "s", 2.0))
    assert parts_only_at_a_near_tie(same, expected) is False
    flipped = _entries(("L'Étoile,", "The", 0.3), (" la", " le", 0.6), (" Cit", " Mar", 0.06), ("é", ",", 1.0))
    assert parts_only_at_a_near_tie(flipped, expected) is True
    wide = _entries(("L'Étoile,", "The", 0.3), (" la", " le", 0.6), (" Cit", " Mar", 0.5))
    with pytest.raises(AssertionError, match="no near-tie"):
        parts_only_at_a_near_tie(wide, expected)
    elsewhere = _entries(("L'Étoile,", "The", 0.3), (" le", " du", 0.01))
    with pytest.raises(AssertionError, match="no runner-up"):
        parts_only_at_a_near_tie(elsewhere, expected)
    split = _entries(("L'", "The", 0.3), ("?", "?", 1.0), ("?", "?", 1.0), ("toile, la Marseillaise", "x", 1.0))
    split[1].bytes, split[2].bytes = [0xC3], [0x89]  # "É" over two tokens, each shown as U+FFFD
    split[1].top_logprobs[0].bytes, split[2].top_logprobs[0].bytes = [0xC3], [0x89]
    assert parts_only_at_a_near_tie(split, expected) is False
    with pytest.raises(AssertionError, match="stops inside"):
        parts_only_at_a_near_tie(same[:2], expected)
