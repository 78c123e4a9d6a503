"""``--chat-template-kwargs`` and ``--reasoning`` on generate, chat, bench and serve, and a
reasoning model's thinking in ``specrun chat``: dimmed before the answer where it is shown, left
out of a pipe's answer, ``reasoning_content`` in --json. The tiny thinking model's template opens
the block unless enable_thinking is false (tests/model_factory.THINKING_TEMPLATE)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from model_factory import build_thinking_model
from specrun.cli.app import app

runner = CliRunner()


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    model = build_thinking_model(tmp_path_factory.mktemp("thinking"))
    return ["-t", str(model.gguf_f32_path), "--method", "lookup", "--threads", "1", "-n", "10"]


def invoke(*args: str, input: str | None = None):
    return runner.invoke(app, list(args), input=input)


@pytest.mark.parametrize("command", ("generate", "chat", "bench", "serve"))
@pytest.mark.parametrize(("options", "message"), [
    (("--chat-template-kwargs", "[1]"), "--chat-template-kwargs: must be an object of template variables"),
    (("--chat-template-kwargs", "{"), "--chat-template-kwargs is not JSON"),
    (("--chat-template-kwargs", '{"tools": []}'), "--chat-template-kwargs: tools is given to the template"),
    (("--reasoning", "yes"), "--reasoning must be on, off or auto, got 'yes'"),
])
def test_bad_template_options_are_one_line_usage_errors(command, options, message):
    args = [command, *options] + (["hello"] if command == "generate" else [])
    result = invoke(*args, input="hi\n")
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), result.stderr


@pytest.mark.parametrize("command", ("generate", "bench"))
def test_template_variables_beside_raw_are_refused(command):
    result = invoke(command, "--raw", "--reasoning", "off", *(["hello"] if command == "generate" else []))
    assert result.exit_code == 2 and "which --raw leaves out" in result.stderr, result.stderr


def test_a_piped_chat_gives_the_answer_and_json_the_thinking_beside_it(thinking):
    whole = invoke("chat", *thinking, "--json", input="Hi there\n")
    assert whole.exit_code == 0, whole.output
    answer = json.loads(whole.stdout)
    assert answer["text"] == "" and answer["reasoning_content"]  # the template opened the block; never closed
    piped = invoke("chat", *thinking, input="Hi there\n")
    assert piped.exit_code == 0 and piped.stdout.strip() == "", piped.stdout  # the thinking is not the answer
    shown = invoke("chat", *thinking, "--show-accept", input="Hi there\n")
    assert "\x1b[2;3m" in shown.stdout  # dimmed where it is shown
    off = invoke("chat", *thinking, "--json", "--reasoning", "off", input="Hi there\n")
    answer_off = json.loads(off.stdout)
    assert answer_off["text"] and "reasoning_content" not in answer_off
    assert answer_off["prompt_tokens"] > answer["prompt_tokens"]  # the empty block the template writes


def test_generate_renders_the_prompt_with_the_template_s_variables(thinking):
    counts = {}
    for options in ((), ("--reasoning", "off"), ("--chat-template-kwargs", '{"enable_thinking": false}')):
        result = invoke("generate", *thinking, "--json", *options, "Hi there")
        assert result.exit_code == 0, result.output
        counts[options] = json.loads(result.stdout)["stats"]["prompt_tokens"]
    first, *closed = counts.values()
    assert closed[0] == closed[1] > first


@pytest.mark.parametrize(("command", "options", "message"), [
    *((command, ("--reasoning-budget", "-2"), "--reasoning-budget must be -1 (no limit), 0 or a count of tokens, got -2")
      for command in ("generate", "chat", "serve")),
    # serve takes a message alone: the one forced where a request sets a budget, as llama-server does
    *((command, ("--reasoning-budget-message", "Done."),
       "--reasoning-budget-message is forced when --reasoning-budget runs out") for command in ("generate", "chat")),
])
def test_bad_budgets_are_one_line_usage_errors(command, options, message):
    result = invoke(command, *options, *(["hello"] if command == "generate" else []), input="hi\n")
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), result.stderr


def test_a_chat_under_a_reasoning_budget_answers_alike_whatever_drafts_it(thinking):
    """The budget forces the thinking's end after 4 tokens: the answer follows, and plain
    decoding, lookup and a draft model (the model itself, so its drafts are taken) give the same
    thinking and the same answer."""
    model = thinking[1]
    answers = []
    for method in (("--method", "none"), ("--method", "lookup"), ("--method", "draft", "-d", model)):
        result = invoke("chat", "-t", model, *method, "--threads", "1", "-n", "16", "--json",
                        "--reasoning-budget", "4", "--reasoning-budget-message", " So.", input="Hi there\n")
        assert result.exit_code == 0, result.output
        answer = json.loads(result.stdout)
        answers.append((answer["reasoning_content"], answer["text"]))
        if method[1] == "draft":
            assert answer["stats"]["accepted"] > 0  # the forced tokens drafted and taken
    assert answers[0][0].endswith("So.") and answers[0][1], answers[0]
    assert answers[1] == answers[0] and answers[2] == answers[0]


def test_generate_under_a_reasoning_budget_shows_the_forced_end_and_answers_alike(thinking, tmp_path):
    """generate prints the text as written, the forced message and closing tag in it (the tiny
    model's tags are control tokens, shown as llama-cli shows them), and --json the answer with
    the thinking beside it (as chat --json), whatever drafts it; a schema holds what follows the
    thinking."""
    model = thinking[1]
    options = ("-t", model, "--threads", "1", "-n", "12", "--reasoning-budget", "3", "--reasoning-budget-message",
               " So.", "Hi there")
    answers = []
    for method in ("none", "lookup"):
        result = invoke("generate", "--method", method, "--json", *options)
        assert result.exit_code == 0, result.output
        payload = json.loads(result.stdout)
        answers.append((payload["reasoning_content"], payload["text"]))
    assert answers[0][0].endswith(" So.") and answers[1] == answers[0]
    written = invoke("generate", "--method", "none", *options)
    assert written.exit_code == 0, written.output
    before, tag, after = written.stdout.partition(" So.</think>")  # as written: the thinking, the tag, the answer
    assert tag and before.strip() + " So." == answers[0][0] and after.strip() == answers[0][1], written.stdout
    schema = tmp_path / "ok.json"
    schema.write_text('{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}')
    result = invoke("generate", *thinking, "-n", "40", "--json", "--json-schema", str(schema),
                    "--reasoning-budget", "2", "Hi there")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["reasoning_content"] and isinstance(json.loads(payload["text"])["ok"], bool)


def test_generate_reads_the_calls_from_the_answer_after_the_thinking(thinking, tmp_path):
    """A call written while thinking is no call: generate reads calls from the answer after the
    thinking, as chat and the server do (here the budget's message writes one into the thinking)."""
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps({"tools": [{"type": "function", "function": {
        "name": "ping", "parameters": {"type": "object", "properties": {}}}}]}))
    call = '<tool_call>{"name": "ping", "arguments": {}}</tool_call>'
    result = invoke("generate", *thinking, "-n", "100", "--json", "--tools", str(tools), "--reasoning-budget", "1",
                    "--reasoning-budget-message", call, "Hi there")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["reasoning_content"].endswith(call) and call not in payload["text"], payload
    assert payload["tool_calls"] == [], payload
