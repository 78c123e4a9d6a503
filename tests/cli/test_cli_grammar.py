"""`specrun generate --json-schema / --grammar / --tools` on both real backends (issue 52): the answer follows
the schema, speculation gives the greedy answer plain decoding gives, and bad grammar files are
one-line usage errors."""

from __future__ import annotations

import json

import jsonschema
import pytest
from typer.testing import CliRunner

from specrun.cli.app import app

runner = CliRunner()
SCHEMA = {"type": "object", "properties": {"word": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["word", "n"], "additionalProperties": False}


def invoke(*args: str):
    return runner.invoke(app, list(args))


def _answer(pair, *options):
    raw = [] if "--tools" in options else ["--raw"]  # tools go into the chat template
    result = invoke("generate", "Say something.", *pair, *raw, "--max-tokens", "200", "--json", *options)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("method", ["draft", "lookup", "auto"])
def test_a_json_schema_answer_follows_it_and_equals_plain_decoding_s(backend_pair, method, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    plain = _answer(backend_pair, "--method", "none", "--json-schema", str(schema))
    fast = _answer(backend_pair, "--method", method, "--json-schema", str(schema), "-k", "4")
    assert fast["text"] == plain["text"]
    if plain["finish_reason"] == "eos":  # a random model may fill max_tokens with the whitespace allowed
        jsonschema.validate(json.loads(plain["text"]), SCHEMA)
    else:
        assert plain["text"].lstrip().startswith("{")


def test_a_gbnf_grammar_file_bounds_the_answer(backend_pair, tmp_path):
    grammar = tmp_path / "answer.gbnf"
    grammar.write_text('root ::= "It is " ("yes" | "no" | "maybe") "."\n')
    for method in ("none", "draft"):
        answer = _answer(backend_pair, "--method", method, "--grammar", str(grammar))
        assert answer["text"] in ("It is yes.", "It is no.", "It is maybe."), answer
        assert answer["finish_reason"] == "eos"


@pytest.mark.parametrize(("content", "option", "words"), [
    ('root ::= "a" | (', "--grammar", "GBNF grammar"),
    ("start: (", "--grammar", "Lark grammar"),
    ('{"type": "objectx"}', "--json-schema", "JSON schema"),
    ("{not json", "--json-schema", "JSON schema"),
    (b"\xff\xfe", "--json-schema", "not UTF-8"),
])
def test_a_grammar_file_that_cannot_be_used_is_one_usage_error(tiny_llama, tmp_path, content, option, words):
    path = tmp_path / ("g.lark" if "start:" in str(content) else "g.txt")
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    result = invoke("generate", "x", "-t", str(tiny_llama.gguf_path), option, str(path))
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and str(path) in lines[0], result.output


def test_a_schema_that_fails_at_its_first_token_is_one_usage_error(tiny_llama, tmp_path):
    """{"$ref": "#"} compiles; llguidance fails only once asked for a first mask, where it would
    have allowed the end of text alone (an empty answer, not JSON)."""
    path = tmp_path / "s.json"
    path.write_text('{"$ref": "#"}')
    result = invoke("generate", "x", "-t", str(tiny_llama.gguf_path), "--json-schema", str(path))
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "JSON schema that cannot be used" in lines[0] and "first token" in lines[0], lines


def test_a_grammar_past_llguidance_s_limits_mid_answer_is_one_error_after_the_text(tiny_llama, tmp_path):
    """The grammar lets a first token through, then exceeds llguidance's limits: the text printed
    so far, then one line saying the grammar stopped it and why, exit 1 (--json: the reason too)."""
    path = tmp_path / "g.gbnf"
    path.write_text('root ::= "a"{100000}\n')
    for json_output in ([], ["--json"]):
        result = invoke("generate", "x", "-t", str(tiny_llama.gguf_path), "--raw", "-n", "12", "--grammar", str(path),
                        *json_output)
        assert result.exit_code == 1, result.output
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("error: the grammar stopped the answer after ") and "Too many items" in last, last
        if json_output:
            answer = json.loads(result.stdout.strip().splitlines()[-1])
            assert answer["finish_reason"] == "grammar" and "Too many items" in answer["grammar_problem"]
            assert answer["text"].startswith("a")


def test_a_missing_grammar_file_and_both_options_are_usage_errors(tiny_llama, tmp_path):
    missing = invoke("generate", "x", "-t", str(tiny_llama.gguf_path), "--json-schema", str(tmp_path / "no.json"))
    assert missing.exit_code == 2 and "cannot use the --json-schema file" in missing.output
    schema = tmp_path / "s.json"
    schema.write_text("{}")
    both = invoke("generate", "x", "-t", str(tiny_llama.gguf_path), "--json-schema", str(schema), "--grammar",
                  str(schema))
    assert both.exit_code == 2 and "--grammar and --json-schema both constrain" in both.output


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}]
# The demo pair: the tools go into its system message, more than the tiny models' 512 tokens of context
DEMO_PAIR = ["--backend", "llama"]


@pytest.mark.parametrize("choice", ["required", "get_time"])
def test_generate_with_tools_makes_the_call_required_and_names_it(tmp_path, choice):
    pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps({"tools": TOOLS}))
    plain = _answer(DEMO_PAIR, "--method", "none", "--tools", str(tools), "--tool-choice", choice)
    fast = _answer(DEMO_PAIR, "--method", "draft", "--tools", str(tools), "--tool-choice", choice)
    assert fast["text"] == plain["text"] and fast["tool_calls"] and fast["finish_reason"] == "eos"
    (call,) = fast["tool_calls"]
    if choice != "required":
        assert call["function"]["name"] == choice
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call["function"]["name"])
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
    assert fast["stats"]["by_source"]["grammar"]["accepted"] > 0  # the call's forced text drafted for free


def test_generate_cut_inside_its_call_gives_no_call_and_says_why(tmp_path):
    """-n reached inside the required call: no call in the JSON, a flag saying one was cut off, and
    the printed answer followed by a note naming the fix."""
    pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")
    from specrun.sessions.tools import TOOL_CALL_CUT_NOTE

    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps({"tools": TOOLS}))
    options = ["--method", "draft", "--tools", str(tools), "--tool-choice", "required"]
    answer = _answer(DEMO_PAIR, *options, "--max-tokens", "6")
    assert answer["finish_reason"] == "length" and answer["tool_calls"] == [] and answer["tool_call_cut"]
    whole = _answer(DEMO_PAIR, *options)
    assert whole["tool_calls"] and "tool_call_cut" not in whole
    printed = invoke("generate", "Say something.", *DEMO_PAIR, *options, "--max-tokens", "6")
    assert printed.exit_code == 0, printed.output
    assert TOOL_CALL_CUT_NOTE[:40] in " ".join(printed.stderr.split())


@pytest.mark.parametrize(("content", "choice", "words"), [
    ("[1, 2]", "auto", "tools[0] must be"),
    ('[{"type": "function", "function": {"name": "a b"}}]', "auto", "tools[0].function.name"),
    ("{not json", "auto", "is not JSON"),
    ("[]", "auto", "defines no tools"),
    (json.dumps(TOOLS), "launch", "--tool-choice names the function"),
])
def test_a_tools_file_that_cannot_be_used_is_one_usage_error(tiny_llama, tmp_path, content, choice, words):
    path = tmp_path / "tools.json"
    path.write_text(content)
    result = invoke("generate", "x", "-t", str(tiny_llama.gguf_path), "--tools", str(path), "--tool-choice", choice)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], result.output


def test_tools_with_raw_is_a_usage_error(tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    result = invoke("generate", "x", "--raw", "--tools", str(tools))
    assert result.exit_code == 2 and "drop --raw" in result.output, result.output
