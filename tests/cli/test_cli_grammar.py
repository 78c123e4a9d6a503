"""`specrun generate --json-schema / --grammar` on both real backends (issue 52): the answer follows
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
    result = invoke("generate", "Say something.", *pair, "--raw", "--max-tokens", "200", "--json", *options)
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


def test_a_missing_grammar_file_and_both_options_are_usage_errors(tiny_llama, tmp_path):
    missing = invoke("generate", "x", "-t", str(tiny_llama.gguf_path), "--json-schema", str(tmp_path / "no.json"))
    assert missing.exit_code == 2 and "cannot use the --json-schema file" in missing.output
    schema = tmp_path / "s.json"
    schema.write_text("{}")
    both = invoke("generate", "x", "-t", str(tiny_llama.gguf_path), "--json-schema", str(schema), "--grammar",
                  str(schema))
    assert both.exit_code == 2 and "--grammar and --json-schema both constrain" in both.output
