"""OpenAI's Responses API through `specrun serve` (server/responses.py), with the openai client as
the Agents SDK and Codex call it: text answers equal to chat completions' for the same
conversation, streamed events the client's own stream reader assembles into the same response,
a tool round trip with function_call and function_call_output items, JSON output, and requests
refused by their Responses field."""

from __future__ import annotations

import json

import pytest

from server_harness import assert_refused

MODEL = "demo-target"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {key: WEATHER[key] for key in ("name", "description", "parameters")}}


def _chat_text(server, messages, **fields) -> str:
    answer = server.client().chat.completions.create(model=MODEL, messages=messages, temperature=0, **fields)
    return answer.choices[0].message.content


def test_a_text_answer_is_the_chat_answer_for_the_same_conversation(demo_server):
    client = demo_server.client()
    response = client.responses.create(model=MODEL, instructions="Answer briefly.", input="def parse(line):",
                                       max_output_tokens=24, temperature=0)
    assert response.object == "response" and response.status in ("completed", "incomplete")
    expected = _chat_text(demo_server, [{"role": "system", "content": "Answer briefly."},
                                        {"role": "user", "content": "def parse(line):"}], max_tokens=24)
    assert response.output_text == expected and response.output[0].type == "message"
    assert response.usage.output_tokens > 0 and response.usage.input_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.model_extra["speculation"]["new_tokens"] == response.usage.output_tokens


def test_streamed_events_assemble_into_the_same_response(demo_server):
    client = demo_server.client()
    whole = client.responses.create(model=MODEL, input=[{"role": "user", "content": "def emit(token):"}],
                                    max_output_tokens=20, temperature=0)
    with client.responses.stream(model=MODEL, input=[{"role": "user", "content": "def emit(token):"}],
                                 max_output_tokens=20, temperature=0) as stream:
        events = list(stream)  # the client's reader checks each event against what came before
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    # OpenAI's: "incomplete" where max_output_tokens ended the answer (the client's
    # get_final_response wants "completed", so the last event's response is read here)
    assert kinds[-1] == f"response.{whole.status}"
    final = events[-1].response
    assert final.output_text == whole.output_text and final.status == whole.status
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == whole.output_text and [e.sequence_number for e in events] == list(range(len(events)))
    assert "response.output_text.done" in kinds and kinds.count("response.output_item.done") == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip_with_call_items(demo_server, stream):
    client = demo_server.client()
    asked = dict(model=MODEL, input="Weather in Rome?", tools=[WEATHER], tool_choice="required",
                 max_output_tokens=60, temperature=0)
    if stream:
        with client.responses.stream(**asked) as events:
            kinds = [event.type for event in events]
            first = events.get_final_response()  # a forced call ends the answer: completed
        assert "response.function_call_arguments.done" in kinds
    else:
        first = client.responses.create(**asked)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Oslo", "Rome")
    assert call.call_id and call.status == "completed"
    follow_up = [{"role": "user", "content": "Weather in Rome?"},
                 {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                 {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}]
    second = client.responses.create(model=MODEL, input=follow_up, tools=[WEATHER], max_output_tokens=16,
                                     temperature=0)
    expected = _chat_text(demo_server, [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"temperature": 21}'}],
        tools=[CHAT_WEATHER], max_tokens=16)
    assert second.output_text == (expected or "")


def test_logprobs_and_specrun_s_sampling_extensions_as_chat_takes_them(demo_server):
    """include's logprobs with top_logprobs, top_k and seed were 400s where chat completions
    honours them: the same log-probabilities as chat's for the same conversation, whole and
    streamed; a cut answer's message item is incomplete, as its response."""
    client = demo_server.client()
    asked = dict(model=MODEL, input="def parse(line):", max_output_tokens=6, temperature=0, top_logprobs=2,
                 include=["message.output_text.logprobs"], extra_body={"top_k": 40, "seed": 7})
    response = client.responses.create(**asked)
    (part,) = response.output[0].content
    chat = demo_server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "def parse(line):"}], max_tokens=6, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"top_k": 40, "seed": 7})
    assert [(e.token, e.logprob) for e in part.logprobs] == [(e.token, e.logprob) for e in chat.choices[0].logprobs.content]
    assert all(len(e.top_logprobs) == 2 for e in part.logprobs)
    if response.status == "incomplete":
        assert response.output[0].status == "incomplete"
    with client.responses.stream(**asked) as stream:
        events = list(stream)
    streamed = [e for event in events if event.type == "response.output_text.delta" for e in event.logprobs]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in part.logprobs]


def test_json_output_follows_its_schema(demo_server):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    response = demo_server.client().responses.create(
        model=MODEL, input="A number, as JSON.", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "number", "schema": schema, "strict": True}})
    assert isinstance(json.loads(response.output_text)["n"], int)


def _body(**fields) -> dict:
    return {"model": MODEL, "input": "hi", **fields}


BAD = [
    (_body(previous_response_id="resp_1"), "previous_response_id", "unsupported_value"),
    (_body(conversation="conv_1"), "conversation", "unsupported_value"),
    (_body(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
     "input[0].content[0]", "invalid_type"),
    (_body(input=[{"type": "reasoning", "content": "thought"}]), "input[0].content", "invalid_type"),
    (_body(input=[{"type": "item_reference", "id": "x"}]), "input[0].type", "unsupported_value"),
    (_body(input=[{"role": "robot", "content": "x"}]), "input[0].role", "invalid_value"),
    (_body(input=[]), "input", "invalid_type"),
    (_body(input=[{"type": "function_call_output", "output": "x"}]), "input[0].call_id", "invalid_type"),
    (_body(tools=[{"type": "web_search"}]), "tools[0]", "unsupported_value"),
    (_body(tools=[{"type": "function", "name": "has space"}]), "tools[0].name", "invalid_value"),
    (_body(text={"format": {"type": "json_schema", "name": "n", "schema": {"type": "objectx"}}}),
     "text.format.schema", "invalid_value"),
    (_body(input=[{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "a", "name": "f",
                                                        "arguments": "{}"},
                  {"type": "function_call", "call_id": "b", "name": "g", "arguments": 5}]),
     "input[2].arguments", "invalid_type"),
    (_body(max_output_tokens=0), "max_output_tokens", "invalid_value"),
    (_body(reasoning={"effort": 5}), "reasoning.effort", "invalid_type"),
    (_body(reasoning={"budget": 5}), "reasoning", "invalid_value"),
    (_body(reasoning="high"), "reasoning", "invalid_type"),
    (_body(truncation="auto"), "truncation", "unsupported_value"),
    (_body(text={"format": {"type": "xml"}}), "text.format.type", "invalid_value"),
    (_body(colour="blue"), "colour", "unknown_parameter"),
    (_body(tools=[WEATHER], tool_choice={"type": "allowed_tools", "mode": "required", "tools": [
        {"type": "function", "name": "launch"}]}), "tool_choice.tools[0]", "invalid_value"),
    (_body(text={"verbosity": "low"}), "text.verbosity", "unsupported_value"),
    (_body(include=["file_search_call.results"]), "include", "unsupported_value"),
    (_body(top_logprobs=2), "top_logprobs", "invalid_value"),  # without include's logprobs
    (_body(input=[{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "c9",
                                                        "output": "x"}]), "input[1].call_id", "invalid_value"),
    (_body(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice", "invalid_type"),
    (_body(instructions=5), "instructions", "invalid_type"),
]


@pytest.mark.parametrize(("body", "param", "code"), BAD, ids=[f"{i}-{row[1]}" for i, row in enumerate(BAD)])
def test_bad_requests_are_400s_naming_the_responses_field(demo_server, body, param, code):
    assert_refused(demo_server, "/v1/responses", body, param, code)


def test_a_prompt_past_the_context_is_named_as_the_responses_input(demo_server):
    """The worker's refusal (context_length_exceeded) named messages, a field the client never sent."""
    status, got = demo_server.post("/v1/responses", _body(input=[{"role": "user", "content": "word " * 5000}]))
    assert status == 400 and got["error"]["code"] == "context_length_exceeded"
    assert got["error"]["param"] == "input" and "messages" not in got["error"]["message"], got
