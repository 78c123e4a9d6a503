"""Reasoning models through the server: the template's variables (chat_template_kwargs,
reasoning_effort, --chat-template-kwargs, --reasoning) and the thinking read apart into
``reasoning_content`` (reasoning_format, --reasoning-format), whole and streamed, as llama-server
answers. The tiny model's template opens a thinking block in its generation prompt unless
enable_thinking is false (tests/model_factory.THINKING_TEMPLATE); its random answers never close
it, so an answer is thinking to its end (the reasoning budget's tests close it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from model_factory import build_thinking_model
from server_harness import assert_refused, start_server, stop_server
from specrun.server.requests import RequestError, ServeDefaults, parse_chat_request

HI = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    return build_thinking_model(tmp_path_factory.mktemp("thinking"))


@pytest.fixture(scope="module")
def thinking_server(thinking_model):
    server = start_server("-t", str(thinking_model.gguf_f32_path), "--method", "lookup", "--threads", "1", "-n", "24")
    yield server
    assert stop_server(server) == 0, server.log


def _message(server, **fields) -> dict:
    status, body = server.post("/v1/chat/completions", {"messages": HI, **fields})
    assert status == 200, body
    return body["choices"][0]["message"]


def _streamed(server, **fields) -> tuple[str, str]:
    """A streamed answer's (thinking, content), each its deltas joined."""
    import openai

    model = server.request("GET", "/v1/models")[1]["data"][0]["id"]
    stream = server.client().chat.completions.create(model=model, messages=HI, stream=True, extra_body=fields)
    thought, content = [], []
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            thought.append((delta.model_extra or {}).get("reasoning_content") or "")
            content.append(delta.content or "")
    assert isinstance(stream, openai.Stream)
    return "".join(thought), "".join(content)


def test_thinking_is_read_apart_whole_and_streamed(thinking_server):
    thought = _message(thinking_server)
    assert thought["content"] == "" and thought["reasoning_content"].strip()  # the prompt opened the block
    raw = _message(thinking_server, reasoning_format="none")
    assert "reasoning_content" not in raw and raw["content"].strip() == thought["reasoning_content"]
    legacy = _message(thinking_server, reasoning_format="deepseek-legacy")
    assert (legacy["content"], legacy["reasoning_content"]) == (raw["content"], thought["reasoning_content"])
    assert _streamed(thinking_server) == (thought["reasoning_content"], "")


def test_enable_thinking_false_closes_the_block_and_the_answer_is_content(thinking_server):
    for fields in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        answer = _message(thinking_server, **fields)
        assert "reasoning_content" not in answer and answer["content"], answer
    status, body = thinking_server.post("/apply-template", {"messages": HI, "chat_template_kwargs":
                                                            {"enable_thinking": False}})
    assert status == 200 and body["prompt"].endswith("<think>\n\n</think>"), body


def test_an_earlier_answer_s_thinking_is_written_back_by_the_template(thinking_server):
    turns = [*HI, {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."},
             {"role": "user", "content": "And?"}]
    status, body = thinking_server.post("/apply-template", {"messages": turns})
    assert status == 200 and "<think>\nGreet back.\n</think>" in body["prompt"], body
    vllm = [*turns[:1], {**turns[1], "reasoning_content": None, "reasoning": "Greet back."}, turns[2]]
    assert thinking_server.post("/apply-template", {"messages": vllm})[1] == body  # vLLM's newer name
    assert _message(thinking_server, messages=turns)["reasoning_content"]


@pytest.mark.parametrize("fields, param", [
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": "false"}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"reasoning_format": "r1"}, "reasoning_format"),
    ({"reasoning_effort": 3}, "reasoning_effort"),
    ({"chat_template_kwargs": {"tone": "\ud800"}}, "chat_template_kwargs"),  # a lone surrogate: no text
    ({"chat_template_kwargs": {"namespace": 1}}, "chat_template_kwargs"),  # Jinja's own, which templates call
    ({"messages": [*HI, {"role": "assistant", "content": "x", "reasoning_content": 5}]},
     "messages[1].reasoning_content"),
])
def test_bad_reasoning_fields_are_400s_naming_the_field(thinking_server, fields, param):
    code = "invalid_type" if param in ("reasoning_effort", "messages[1].reasoning_content") else "invalid_value"
    assert_refused(thinking_server, "/v1/chat/completions", {"messages": HI, **fields}, param, code)


def test_a_request_s_template_variables_override_the_server_s():
    defaults = ServeDefaults(template_variables={"enable_thinking": False, "tone": "dry"}, reasoning_format="none")
    parsed = parse_chat_request({"messages": HI}, defaults, 2048)
    assert (parsed.template_variables, parsed.reasoning_format) == ({"enable_thinking": False, "tone": "dry"}, "none")
    parsed = parse_chat_request({"messages": HI, "chat_template_kwargs": {"enable_thinking": True},
                                 "reasoning_effort": "high", "reasoning_format": "auto"}, defaults, 2048)
    assert parsed.template_variables == {"enable_thinking": True, "tone": "dry", "reasoning_effort": "high"}
    assert parsed.reasoning_format == "auto"
    assert parse_chat_request({"messages": HI}, ServeDefaults(), 2048).reasoning_format == "auto"
    with pytest.raises(RequestError):
        parse_chat_request({"messages": HI, "reasoning_effort": ""}, defaults, 2048)


def test_the_server_s_options_set_what_a_request_does_not(thinking_model):
    server = start_server("-t", str(thinking_model.gguf_f32_path), "--method", "none", "--threads", "1", "-n", "8",
                          "--reasoning", "off", "--reasoning-format", "none", "--reasoning-budget", "0")
    try:
        status, body = server.post("/apply-template", {"messages": HI})
        assert status == 200 and body["prompt"].endswith("</think>"), body  # --reasoning off
        opened = _message(server, chat_template_kwargs={"enable_thinking": True}, reasoning_budget_tokens=5)
        assert "reasoning_content" not in opened and opened["content"]  # --reasoning-format none
        assert "</think>" in opened["content"]  # the request's budget over the server's
        assert _message(server, chat_template_kwargs={"enable_thinking": True})["content"].startswith(
            "</think>")  # --reasoning-budget 0
        assert _message(server, chat_template_kwargs={"enable_thinking": True}, reasoning_format="auto",
                        reasoning_budget_tokens=5)["reasoning_content"] == opened["content"].partition("</think>")[0].strip()
    finally:
        assert stop_server(server) == 0, server.log


@pytest.mark.parametrize("args, named", [
    (("--chat-template-kwargs", "{not json"), "--chat-template-kwargs is not JSON"),
    (("--chat-template-kwargs", '{"bos_token": "x"}'), "--chat-template-kwargs: bos_token"),
    (("--reasoning", "maybe"), "--reasoning must be on, off or auto"),
    (("--reasoning", "on", "--chat-template-kwargs", '{"enable_thinking": false}'), "disagree"),
    (("--reasoning-format", "r1"), "--reasoning-format must be one of"),
])
def test_bad_reasoning_options_are_one_line_usage_errors(args, named):
    done = subprocess.run([sys.executable, "-m", "specrun", "serve", "-t", "demo-target", *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0] and "Traceback" not in done.stderr, done.stderr
    assert json.dumps(lines)  # one line, nothing else written


def _model(server) -> str:
    return server.request("GET", "/v1/models")[1]["data"][0]["id"]


def test_the_responses_api_gives_the_thinking_as_a_reasoning_item_first(thinking_server):
    thought = _message(thinking_server)["reasoning_content"]
    client, model = thinking_server.client(), _model(thinking_server)
    whole = client.responses.create(model=model, input="Hi there")
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == thought and whole.output_text == ""
    events = list(client.responses.create(model=model, input="Hi there", stream=True))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == thought
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message")]
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [(e.output_index, e.item.type) for e in done] == [(0, "reasoning"), (1, "message")]
    assert done[0].item.content[0].text == thought
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]
    off = client.responses.create(model=model, input="Hi there", reasoning={"effort": "none"})
    assert [item.type for item in off.output] == ["message"] and off.output_text


def test_a_reasoning_item_passed_back_is_its_turn_s_thinking(thinking_server):
    """A stateless client (include reasoning.encrypted_content, as Codex asks) sends the last turn's
    reasoning item back before its message: the template writes it back as the chat's would."""
    status, body = thinking_server.post("/v1/responses", {
        "model": _model(thinking_server), "include": ["reasoning.encrypted_content"], "max_output_tokens": 4,
        "reasoning": {"effort": "low", "summary": "auto"},
        "input": [{"role": "user", "content": "Hi"},
                  {"type": "reasoning", "id": "rs_1", "summary": [],
                   "content": [{"type": "reasoning_text", "text": "Greet back."}]},
                  {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
                  {"role": "user", "content": "And?"}]})
    assert status == 200 and body["output"][0]["type"] == "reasoning", body
    from specrun.server.requests import ServeDefaults
    from specrun.server.responses import parse_responses_request

    parsed, _ = parse_responses_request({"input": [{"role": "user", "content": "Hi"},
                                                   {"type": "reasoning", "summary": [{"type": "summary_text",
                                                                                      "text": "Sum."}]},
                                                   {"type": "function_call", "call_id": "c", "name": "f",
                                                    "arguments": "{}"}],
                                         "reasoning": {"effort": "high"}}, ServeDefaults(), 2048)
    assert parsed.messages[1]["reasoning_content"] == "Sum." and parsed.template_variables["reasoning_effort"] == "high"


NUMBER = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
# a boolean: the random model's integers and strings may run on to max_tokens inside the call
CONFIRM = {"type": "function", "function": {"name": "confirm", "parameters": {
    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}
CLOSE_AT_ONCE = {"logit_bias": {"513": 100}}  # the tiny model's </think>, at its first chance


def test_a_schema_and_a_required_call_hold_the_answer_after_the_thinking(thinking_server):
    """The prompt opened the block: the grammar lets the model think and holds what follows the
    closing tag (which the bias makes come at once), read apart as any thinking is."""
    answer = _message(thinking_server, response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": NUMBER}}, max_tokens=40, **CLOSE_AT_ONCE)
    assert isinstance(json.loads(answer["content"])["n"], int) and "reasoning_content" not in answer
    status, body = thinking_server.post("/v1/chat/completions", {
        "messages": HI, "tools": [CONFIRM], "tool_choice": "required", "max_tokens": 160, **CLOSE_AT_ONCE})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    assert isinstance(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])["ok"], bool)


def test_a_closing_tag_that_is_a_control_token_is_shown_in_the_text(thinking_server):
    """The tiny model's tags are control tokens, with no text of their own: the answer's text
    shows them (llama.cpp's preserved tokens), so reasoning_format none gives it as generated."""
    raw = _message(thinking_server, reasoning_format="none", max_tokens=3, **CLOSE_AT_ONCE)
    assert raw["content"].startswith("</think>"), raw
    read = _message(thinking_server, max_tokens=3, **CLOSE_AT_ONCE)
    assert "reasoning_content" not in read  # an empty block; after it, the tags it writes are its text
    assert read["content"] == raw["content"].removeprefix("</think>").lstrip()


def test_a_reasoning_budget_forces_the_thinking_s_end(thinking_server):
    """llama-server's reasoning_budget_tokens: after that many tokens of thinking, the message and
    the closing tag are forced; what follows is the answer."""
    free = _message(thinking_server, reasoning_format="none")["content"]
    raw = _message(thinking_server, reasoning_format="none", reasoning_budget_tokens=3,
                   reasoning_budget_message=" Enough.")["content"]
    thought, closed, after = raw.partition(" Enough.</think>")
    assert closed and free.startswith(thought) and after, raw  # the first 3 tokens, then the forced end
    assert thinking_server.post("/v1/chat/completions", {"messages": HI, "thinking_budget_tokens": 0,
                                                         "reasoning_format": "none"})[1][
        "choices"][0]["message"]["content"].startswith("</think>")  # none at all
    split = _message(thinking_server, reasoning_budget_tokens=3, reasoning_budget_message=" Enough.")
    assert split["reasoning_content"] == (thought + " Enough.").strip() and split["content"] == after.lstrip()


@pytest.mark.parametrize("fields, param, code", [
    ({"reasoning_budget_tokens": -2}, "reasoning_budget_tokens", "invalid_value"),
    ({"thinking_budget_tokens": "5"}, "thinking_budget_tokens", "invalid_type"),
    ({"reasoning_budget_message": 5}, "reasoning_budget_message", "invalid_type"),
    # a bias of false on the closing tag it forces: nothing left to sample
    ({"reasoning_budget_tokens": 2, "logit_bias": [[513, False]]}, "logit_bias", "invalid_value"),
])
def test_a_bad_budget_is_a_400_naming_its_field(thinking_server, fields, param, code):
    assert_refused(thinking_server, "/v1/chat/completions", {"messages": HI, **fields}, param, code)


def test_a_tag_s_log_probability_is_shown_with_its_text(thinking_server):
    status, body = thinking_server.post("/v1/chat/completions", {
        "messages": HI, "reasoning_format": "none", "max_tokens": 3, "logprobs": True, **CLOSE_AT_ONCE})
    assert status == 200, body
    choice = body["choices"][0]
    tokens = [entry["token"] for entry in choice["logprobs"]["content"]]
    assert tokens[0] == "</think>" and "".join(tokens) == choice["message"]["content"], tokens


def test_responses_items_give_their_thinking_to_their_own_turn():
    """A reasoning item before a call that joins the assistant's turn before it is that turn's; it
    never reaches a later one; the legacy format (chat's content as generated) is a reasoning item."""
    from specrun.server.responses import parse_responses_request

    thought = {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Call it."}]}
    parsed, _ = parse_responses_request({"input": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Let me look."}, thought,
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "5"},
        {"role": "assistant", "content": "It is 5."}]}, ServeDefaults(reasoning_format="deepseek-legacy"), 2048)
    assert parsed.messages[1]["reasoning_content"] == "Call it." and "reasoning_content" not in parsed.messages[3]
    assert parsed.reasoning_format == "deepseek"
    parsed, _ = parse_responses_request({"input": [{"role": "user", "content": "Hi"}, thought,
                                                   {"role": "assistant", "content": "Hello."}]}, ServeDefaults(), 2048)
    assert parsed.messages[1] == {"role": "assistant", "content": "Hello.", "reasoning_content": "Call it."}


def test_usage_counts_the_thinking_s_tokens(thinking_server):
    """OpenAI's completion_tokens_details.reasoning_tokens (the Responses API's
    output_tokens_details): the answer's tokens up to and including its closing tag, whatever the
    reasoning_format shows, whole or streamed; all of them while the block is open; none where
    the answer does not think."""
    closed = {"messages": HI, "temperature": 0, "reasoning_budget_tokens": 3, "reasoning_budget_message": " Enough."}
    status, body = thinking_server.post("/v1/chat/completions", {**closed, "reasoning_format": "none",
                                                                 "logprobs": True})
    assert status == 200, body
    tokens = [entry["token"] for entry in body["choices"][0]["logprobs"]["content"]]
    thinking = tokens.index("</think>") + 1  # the 3 budgeted, the message's, the tag
    assert 3 + 1 < thinking < body["usage"]["completion_tokens"], tokens
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": thinking}
    for fields in ({}, {"reasoning_format": "deepseek-legacy"}):
        status, answer = thinking_server.post("/v1/chat/completions", {**closed, **fields})
        assert status == 200 and answer["usage"]["completion_tokens_details"]["reasoning_tokens"] == thinking, answer
    client, model = thinking_server.client(), _model(thinking_server)
    budget = {key: closed[key] for key in closed if key.startswith("reasoning")}
    stream = client.chat.completions.create(model=model, messages=HI, stream=True, temperature=0,
                                            stream_options={"include_usage": True}, extra_body=budget)
    assert [chunk.usage for chunk in stream][-1].completion_tokens_details.reasoning_tokens == thinking
    open_to_the_end = thinking_server.post("/v1/chat/completions", {"messages": HI})[1]["usage"]
    assert open_to_the_end["completion_tokens_details"]["reasoning_tokens"] == open_to_the_end["completion_tokens"]
    assert open_to_the_end["completion_tokens"] > 0
    off = thinking_server.post("/v1/chat/completions", {"messages": HI, "reasoning_effort": "none"})[1]["usage"]
    assert off["completion_tokens_details"] == {"reasoning_tokens": 0} and off["completion_tokens"] > 0
    thought = client.responses.create(model=model, input="Hi there").usage
    assert thought.output_tokens_details.reasoning_tokens == thought.output_tokens > 0
    plain = client.responses.create(model=model, input="Hi there", reasoning={"effort": "none"}).usage
    assert plain.output_tokens_details.reasoning_tokens == 0 and plain.output_tokens > 0
