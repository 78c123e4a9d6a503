"""gpt-oss's harmony format through the server (sessions/harmony.py): a required call comes back as
OpenAI's tool_calls, whole and streamed, with no harmony markup in the content; a JSON answer is
the final channel's body; an earlier call's thinking sent back as reasoning_content reaches the
template as its ``thinking``. The tiny model carries harmony's markers (llama.cpp renders them as
text, as it does gpt-oss's) and a cut-down harmony template (tests/model_factory.py)."""

from __future__ import annotations

import json

import pytest

from model_factory import build_harmony_model
from server_harness import start_server, stop_server

ASK = [{"role": "user", "content": "Weather in Oslo?"}]
# an enum and no other property: the random model's strings would run on to max_tokens
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Bergen"]}}, "required": ["city"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory):
    model = build_harmony_model(tmp_path_factory.mktemp("harmony"))
    server = start_server("-t", str(model.gguf_f32_path), "--method", "lookup", "--threads", "1", "-n", "64")
    yield server
    assert stop_server(server) == 0, server.log


def test_a_required_call_is_tool_calls_whole_and_streamed(harmony_server):
    status, body = harmony_server.post("/v1/chat/completions", {"messages": ASK, "tools": [WEATHER],
                                                                "tool_choice": "required"})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["city"] in (
        "Oslo", "Bergen")

    model = harmony_server.request("GET", "/v1/models")[1]["data"][0]["id"]
    stream = harmony_server.client().chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="required", stream=True)
    content, arguments, names, finish = [], [], [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for part in delta.tool_calls or ():
            names.append(part.function.name or "")
            arguments.append(part.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(content) == "" and "".join(names) == "get_weather" and finish == "tool_calls"
    assert json.loads("".join(arguments)) == json.loads(call["function"]["arguments"])  # greedy: the same call


def test_a_json_answer_is_the_final_channel_s_body(harmony_server):
    status, body = harmony_server.post("/v1/chat/completions", {
        "messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": {
            "type": "object", "properties": {"city": {"enum": ["Oslo"]}}, "required": ["city"],
            "additionalProperties": False}}}})
    assert status == 200, body
    message = body["choices"][0]["message"]
    assert json.loads(message["content"]) == {"city": "Oslo"}, message
    raw = harmony_server.post("/v1/chat/completions", {
        "messages": ASK, "reasoning_format": "none", "response_format": {"type": "json_object"}, "max_tokens": 8})[1]
    assert "<|channel|>" in raw["choices"][0]["message"]["content"]  # as generated: the channel's header


def test_an_earlier_call_s_thinking_reaches_the_template(harmony_server):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "reasoning_content": "A tool knows.", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    status, body = harmony_server.post("/apply-template", {"messages": messages, "tools": [WEATHER]})
    assert status == 200, body
    assert ("<|channel|>analysis<|message|>A tool knows.<|end|><|start|>assistant to=functions.get_weather"
            in body["prompt"]), body
    status, body = harmony_server.post("/v1/chat/completions", {"messages": messages, "tools": [WEATHER],
                                                                "max_tokens": 4})
    assert status == 200, body
