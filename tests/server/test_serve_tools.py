"""Tool calls through `specrun serve` with the openai client (issue 52): a round trip (call, the
tool's result, the final answer), streamed calls, a named function, and requests refused by the
field they got wrong. The demo target's template takes no tools, so the definitions go into its
system message and a required call is forced by a grammar in the Hermes format."""

from __future__ import annotations

import json

import jsonschema
import pytest

from server_harness import DEMO_ARGS, assert_refused, start_server, stop_server

MODEL = "demo-target"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
                   "additionalProperties": False}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def plain_server():
    server = start_server(*DEMO_ARGS, "--method", "none")
    yield server
    assert stop_server(server) == 0, server.log


def _call(server, **fields):
    return server.client().chat.completions.create(model=MODEL, max_tokens=120, temperature=0, **fields)


def test_a_tool_call_round_trip(demo_server, plain_server):
    first = _call(demo_server, messages=QUESTION, tools=[WEATHER, TIME], tool_choice="required")
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls[:1]
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(arguments, schema)
    # speculation leaves the answer as plain decoding gives it
    plain = _call(plain_server, messages=QUESTION, tools=[WEATHER, TIME], tool_choice="required").choices[0]
    assert [(c.function.name, c.function.arguments) for c in plain.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    # the tool's result goes back; the model answers in text
    follow_up = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    final = _call(demo_server, messages=follow_up, tools=[WEATHER, TIME], tool_choice="none").choices[0]
    assert final.finish_reason in ("stop", "length")
    assert final.message.tool_calls is None and final.message.content


def test_a_named_function_is_the_one_called(demo_server):
    for _ in range(2):
        choice = _call(demo_server, messages=QUESTION, tools=[WEATHER, TIME],
                       tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0]
        assert {c.function.name for c in choice.message.tool_calls} == {"get_time"}
        for c in choice.message.tool_calls:
            jsonschema.validate(json.loads(c.function.arguments), TIME["function"]["parameters"])


def _allowed(mode: str, *names: str) -> dict:
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": [
        {"type": "function", "function": {"name": name}} for name in names]}}


def test_allowed_tools_keep_every_tool_in_the_prompt_and_let_only_those_be_called(demo_server):
    """OpenAI's allowed_tools: the prompt shows every tool (its cache holds across requests that
    allow others), a required call goes to an allowed function only; on auto, a call to another is
    text. The Responses API takes its own spelling of it."""
    for _ in range(2):
        choice = _call(demo_server, messages=QUESTION, tools=[WEATHER, TIME],
                       tool_choice=_allowed("required", "get_time")).choices[0]
        assert choice.finish_reason == "tool_calls" and {c.function.name for c in choice.message.tool_calls} == {
            "get_time"}
    every = _call(demo_server, messages=QUESTION, tools=[WEATHER, TIME])
    allowed = _call(demo_server, messages=QUESTION, tools=[WEATHER, TIME], tool_choice=_allowed("auto", "get_time"))
    assert allowed.usage.prompt_tokens == every.usage.prompt_tokens
    status, body = demo_server.post("/v1/responses", {
        "model": MODEL, "input": "What is the weather in Paris?", "max_output_tokens": 120, "temperature": 0,
        "tools": [{"type": "function", **WEATHER["function"]}, {"type": "function", **TIME["function"]}],
        "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function",
                                                                                "name": "get_time"}]}})
    assert status == 200, body
    assert {item["name"] for item in body["output"] if item["type"] == "function_call"} == {"get_time"}


def test_functions_in_openai_s_older_form_are_called_and_answered(demo_server):
    """``functions`` and ``function_call`` (OpenAI's form before tools): the call comes back as
    message.function_call with finish_reason "function_call", whole and streamed; an earlier call
    in that form and its ``function`` result go back to the template as tools' do."""
    functions = [WEATHER["function"], TIME["function"]]
    body = {"messages": QUESTION, "functions": functions, "function_call": {"name": "get_time"}, "max_tokens": 120}
    status, answer = demo_server.post("/v1/chat/completions", body)
    assert status == 200, answer
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "function_call" and "tool_calls" not in choice["message"], choice
    call = choice["message"]["function_call"]
    assert call["name"] == "get_time"
    jsonschema.validate(json.loads(call["arguments"]), TIME["function"]["parameters"])
    chunks = [chunk for chunk in _call(demo_server, messages=QUESTION, functions=functions,
                                       function_call={"name": "get_time"}, stream=True) if chunk.choices]
    streamed = [chunk.choices[0].delta.function_call for chunk in chunks if chunk.choices[0].delta.function_call]
    assert [(part.name, part.arguments) for part in streamed] == [(call["name"], call["arguments"])]
    assert chunks[-1].choices[0].finish_reason == "function_call"
    history = [*QUESTION, {"role": "assistant", "content": None, "function_call": call},
               {"role": "function", "name": "get_time", "content": '{"time": "12:00"}'}]
    status, final = demo_server.post("/v1/chat/completions", {"messages": history, "functions": functions,
                                                              "function_call": "none", "max_tokens": 8})
    assert status == 200 and final["choices"][0]["message"]["content"], final
    status, rendered = demo_server.post("/apply-template", {"messages": history, "tools": [WEATHER, TIME]})
    assert status == 200 and '"get_time"' in rendered["prompt"] and '{"time": "12:00"}' in rendered["prompt"]
    # "auto" or "none" alone asks nothing (clients send it always): tools as they are
    status, plain = demo_server.post("/v1/chat/completions", {"messages": QUESTION, "function_call": "auto",
                                                              "max_tokens": 4})
    assert status == 200 and plain["choices"][0]["finish_reason"] in ("stop", "length"), plain


def test_a_forced_call_is_answered_whatever_the_stop_strings(demo_server):
    """A stop string the call's markup holds ("<", a client's default stop list) cut a required
    call at its first character: a 200 with neither call nor text. The forced call's grammar ends
    the answer; with tool_choice auto the stop strings apply as asked."""
    forced = _call(demo_server, messages=QUESTION, tools=[WEATHER], tool_choice="required").choices[0]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        stopped = _call(demo_server, messages=QUESTION, tools=[WEATHER], tool_choice=choice, stop=["<", "{"]).choices[0]
        assert stopped.finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in stopped.message.tool_calls] == \
            [(c.function.name, c.function.arguments) for c in forced.message.tool_calls]
    free = _call(demo_server, messages=QUESTION, tools=[WEATHER], tool_choice="auto").choices[0].message.content
    assert free and len(free.split()) >= 3, free  # greedy: the demo target answers this in words
    word = free.split()[2]
    cut = _call(demo_server, messages=QUESTION, tools=[WEATHER], tool_choice="auto", stop=[word]).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == free[:free.index(word)]


def test_streamed_calls_arrive_as_tool_call_deltas(demo_server):
    whole = _call(demo_server, messages=QUESTION, tools=[WEATHER], tool_choice="required").choices[0]
    chunks = list(demo_server.client().chat.completions.create(
        model=MODEL, max_tokens=120, temperature=0, messages=QUESTION, tools=[WEATHER], tool_choice="required",
        stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [call for delta in deltas for call in (delta.tool_calls or [])]
    assert [(c.index, c.function.name, c.function.arguments) for c in streamed] == \
        [(i, c.function.name, c.function.arguments) for i, c in enumerate(whole.message.tool_calls)]
    assert not "".join(delta.content or "" for delta in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_calls_cut_at_max_tokens_come_back_whole_and_no_markup_as_content(demo_server, stream):
    """A forced call cut by max_tokens: the calls closed before the cut are tool_calls, the one cut
    off is dropped (its markup never content), finish_reason "length"; one cut before any call
    closed gives nothing, not "<tool_call"."""
    def ask(max_tokens: int, choice):
        fields = dict(model=MODEL, temperature=0, messages=QUESTION, tools=[WEATHER, TIME], tool_choice=choice,
                      max_tokens=max_tokens, parallel_tool_calls=True)
        if not stream:
            done = demo_server.client().chat.completions.create(**fields).choices[0]
            calls = [(c.function.name, c.function.arguments) for c in done.message.tool_calls or ()]
            return done.message.content or "", calls, done.finish_reason
        chunks = [c for c in demo_server.client().chat.completions.create(stream=True, **fields) if c.choices]
        deltas = [c.choices[0].delta for c in chunks]
        calls = [(c.function.name, c.function.arguments) for d in deltas for c in (d.tool_calls or ())]
        return "".join(d.content or "" for d in deltas), calls, chunks[-1].choices[0].finish_reason

    content, calls, reason = ask(400, "required")
    assert reason == "length" and len(calls) >= 2 and "<tool" not in content and not content.strip()
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), {"get_weather": WEATHER, "get_time": TIME}[name]["function"]["parameters"])
    for max_tokens in (1, 5):
        assert ask(max_tokens, {"type": "function", "function": {"name": "get_weather"}}) == ("", [], "length")


def test_with_tools_on_auto_an_answer_without_a_call_is_text(demo_server):
    choice = _call(demo_server, messages=[{"role": "user", "content": "Say hello."}], tools=[WEATHER]).choices[0]
    if choice.message.tool_calls is None:
        assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)
    else:  # the demo model may write a call of its own accord: then it is read as one
        assert choice.finish_reason == "tool_calls"


def _body(**fields) -> dict:
    return {"model": MODEL, "messages": QUESTION, **fields}


BAD = [
    (_body(tools={"a": 1}), "tools", "invalid_type"),
    (_body(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools[0].function.name",
     "missing_required_parameter"),
    (_body(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools[0].function.name",
     "invalid_value"),
    (_body(tools=[WEATHER, WEATHER]), "tools[1].function.name", "invalid_value"),
    (_body(tools=[{"type": "retrieval"}]), "tools[0]", "invalid_type"),
    (_body(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]),
     "tools[0].function.parameters", "invalid_value"),
    (_body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "launch"}}), "tool_choice",
     "invalid_value"),
    (_body(tool_choice="required"), "tool_choice", "invalid_value"),
    (_body(tools=[WEATHER], tool_choice="always"), "tool_choice", "invalid_type"),
    (_body(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
     "invalid_value"),
    (_body(messages=[*QUESTION, {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]),
     "messages[1].tool_calls[0]", "invalid_type"),
    (_body(messages=[*QUESTION, {"role": "tool", "content": 5}]), "messages[1].content", "invalid_type"),
    (_body(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
           tool_choice="required"), "tools[0].function.parameters", "invalid_value"),
    # JSON escapes half a surrogate pair alone; inside an earlier call's arguments it was a 500
    (_body(messages=[*QUESTION, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": "\ud800"}}}]}]),
     "messages[1].tool_calls[0].function.arguments", "invalid_value"),
    (_body(messages=[*QUESTION, {"role": "assistant", "tool_calls": [
        {"id": 5, "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]),
     "messages[1].tool_calls[0].id", "invalid_type"),
    (_body(messages=[*QUESTION, {"role": "tool", "content": "x", "tool_call_id": "\udfff"}]),
     "messages[1].tool_call_id", "invalid_value"),
    # ... as a property name of a tool's parameters: the schema compiled, and rendering the prompt was a 500
    (_body(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"\ud800": {"type": "string"}}}}}]), "tools[0].function.parameters",
     "invalid_value"),
]


BAD += [
    (_body(tools=[WEATHER], tool_choice=_allowed("required", "launch")), "tool_choice.allowed_tools.tools[0]",
     "invalid_value"),
    (_body(tools=[WEATHER], tool_choice=_allowed("sometimes", "get_weather")), "tool_choice.allowed_tools",
     "invalid_type"),
    (_body(tools=[WEATHER], tool_choice=_allowed("auto")), "tool_choice.allowed_tools", "invalid_type"),
    (_body(tools=[WEATHER], tool_choice={"type": "allowed_tools", "allowed_tools": {"tools": [{"name": "x"}]}}),
     "tool_choice.allowed_tools.tools[0]", "invalid_type"),
]


BAD += [
    (_body(functions=[WEATHER["function"]], tools=[WEATHER]), "functions", "invalid_value"),
    (_body(function_call={"name": "get_weather"}), "function_call", "invalid_value"),  # functions to name
    (_body(tools=[WEATHER], function_call={"name": "get_weather"}), "function_call", "invalid_value"),
    (_body(messages=[*QUESTION, {"role": "assistant", "function_call": {"name": "f", "arguments": 5}}]),
     "messages[1].function_call.arguments", "invalid_type"),
    (_body(messages=[*QUESTION, {"role": "assistant", "function_call": {"arguments": "{}"}}]),
     "messages[1].function_call", "invalid_type"),
    (_body(functions={"name": "f"}), "functions", "invalid_type"),
    (_body(functions=["f"]), "functions[0]", "invalid_type"),
    (_body(functions=[{"description": "no name"}]), "functions[0].name", "missing_required_parameter"),
    (_body(functions=[WEATHER["function"]], function_call={"name": "launch"}), "function_call", "invalid_value"),
    (_body(functions=[WEATHER["function"]], function_call="always"), "function_call", "invalid_type"),
]


UNIQUE = {"type": "function", "function": {"name": "tag", "parameters": {"type": "object", "properties": {
    "labels": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}}}  # pydantic's set[str]
BAD += [
    (_body(tools=[WEATHER, UNIQUE], tool_choice="required"), "tools[1].function.parameters", "invalid_value"),
    (_body(tools=[WEATHER, UNIQUE], tool_choice={"type": "function", "function": {"name": "tag"}}),
     "tools[1].function.parameters", "invalid_value"),
]


@pytest.mark.parametrize(("body", "param", "code"), BAD, ids=[f"{i}-{row[1]}" for i, row in enumerate(BAD)])
def test_bad_tool_requests_are_400s_naming_the_field(demo_server, body, param, code):
    assert_refused(demo_server, "/v1/chat/completions", body, param, code)


@pytest.mark.parametrize("choice", ["auto", "none", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_schema_no_grammar_can_enforce_is_taken_where_no_call_to_it_is_forced(demo_server, choice):
    """OpenAI takes any JSON schema in a function's parameters; llguidance enforces no uniqueItems.
    Every request carrying such a tool was a 400, though only a forced call follows a schema."""
    choice_answer = _call(demo_server, messages=QUESTION, tools=[WEATHER, UNIQUE], tool_choice=choice).choices[0]
    assert choice_answer.finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_none_leaves_the_tools_out_of_the_prompt(demo_server):
    with_tools = _call(demo_server, messages=QUESTION, tools=[WEATHER, TIME])
    none = _call(demo_server, messages=QUESTION, tools=[WEATHER, TIME], tool_choice="none")
    plain = _call(demo_server, messages=QUESTION)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < with_tools.usage.prompt_tokens


def test_a_tool_result_sent_without_its_call_s_id_answers_the_first_call_still_open():
    """Some clients send a tool's result without ``tool_call_id``; a template that writes the id
    back (Mistral's) needs one: each such result answers the last assistant turn's first call no
    result answered yet (by position: a call sent without an id keeps its place). A result with an
    id answers that call, one not open is kept as sent; a system message changes nothing; after a
    user turn or an assistant turn without calls no call is open and none is given."""
    from specrun.server.requests import ServeDefaults, parse_chat_request

    def call(call_id, name):
        return {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}

    messages = [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [call("c1", "get_weather"),
                                                                               call("c2", "get_time")]},
                {"role": "tool", "content": "21 C"},
                {"role": "tool", "content": "noon"},
                {"role": "assistant", "content": "", "tool_calls": [call("c3", "get_weather"), call("c4", "get_time")]},
                {"role": "tool", "content": "noon", "tool_call_id": "c4"},
                {"role": "tool", "content": "18 C"},
                {"role": "user", "content": "thanks"},
                {"role": "tool", "content": "stray"},
                {"role": "assistant", "content": "", "tool_calls": [call("", "get_weather"), call("c6", "get_time")]},
                {"role": "system", "content": "be brief"},
                {"role": "tool", "content": "rain", "tool_call_id": "zz"},
                {"role": "tool", "content": "19 C"},
                {"role": "tool", "content": "one"},
                {"role": "assistant", "content": "ok"},
                {"role": "tool", "content": "late"}]
    parsed = parse_chat_request({"model": MODEL, "messages": messages}, ServeDefaults(), 4096).messages
    assert [each.get("tool_call_id") for each in parsed if each["role"] == "tool"] == [
        "c1", "c2", "c4", "c3", "", "zz", "", "c6", ""]
