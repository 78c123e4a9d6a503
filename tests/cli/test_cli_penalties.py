"""``--repeat-penalty``, ``--repeat-last-n``, ``--presence-penalty``, ``--frequency-penalty`` and
``--logit-bias`` on the commands: llama.cpp's spellings and ranges, one-line usage errors, and a
run under them that speculates and says so, its text plain decoding's."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specrun.cli.app import app

runner = CliRunner()
COMMANDS = ("generate", "chat", "bench", "serve")


def invoke(*args: str, input: str | None = None):
    return runner.invoke(app, list(args), input=input)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("options", "message"), [
    (("--repeat-penalty", "0"), "--repeat-penalty must be in (0, 10] (1: off), got 0.0"),
    (("--frequency-penalty", "2.5"), "--frequency-penalty must be between -2 and 2 (0: off), got 2.5"),
    (("--presence-penalty", "-3"), "--presence-penalty must be between -2 and 2 (0: off), got -3.0"),
    (("--repeat-last-n", "-2"), "--repeat-last-n must be -1 (the whole text), 0 (off) or a count of tokens"),
    (("--logit-bias", "15043"), "--logit-bias '15043' is not TOKEN_ID+BIAS or TOKEN_ID-BIAS"),
    (("--logit-bias", "a+1"), "--logit-bias 'a+1' is not TOKEN_ID+BIAS"),
    (("-l", "5+inf"), "--logit-bias '5+inf' would force its token at every step"),
    (("-l", "5+150"), "--logit-bias for token 5 must be between -100 and 100 (or -inf to forbid it), got 150.0"),
    (("-l", "9" * 5000 + "+1"), "--logit-bias '999"),
])
def test_bad_penalties_and_biases_are_one_line_usage_errors(command, options, message):
    args = [command, *options] + (["hello"] if command == "generate" else [])
    result = invoke(*args, input="hi\n")
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), result.stderr


@pytest.fixture(scope="module")
def pair(tiny_llama, perturbed):
    pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")
    return ["-t", str(tiny_llama.gguf_path), "-d", str(perturbed["llama"])]


PENALISED = ("--repeat-penalty", "1.3", "--repeat-last-n", "32", "--presence-penalty", "0.4", "-l", "17-inf",
             "-l", "40+2.5")


def _text(pair, *options) -> tuple[str, dict]:
    result = invoke("generate", "def main():", *pair, "-n", "24", "--json", *options)
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    return answer["text"], answer


def test_a_penalised_run_speculates_and_makes_plain_decoding_s_text(pair):
    plain, _ = _text(pair, "-m", "none", *PENALISED)
    drafted, answer = _text(pair, "-m", "draft", *PENALISED)
    assert drafted == plain
    assert answer["stats"]["drafted"] > 0
    unpenalised, _ = _text(pair, "-m", "none")
    assert unpenalised != plain


def test_a_bias_on_a_token_the_target_lacks_is_one_line(pair):
    result = invoke("generate", "def main():", *pair, "-n", "4", "-l", "9999999+1")
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--logit-bias names token 9999999, outside the target's vocabulary" in lines[0]


def test_a_forbidding_bias_beside_a_grammar_and_penalties_beside_native_are_refused(tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    result = invoke("generate", "hi", "--json-schema", str(schema), "-l", "5-inf")
    assert result.exit_code == 2 and result.stderr.startswith("error: --logit-bias forbids a token (-inf) beside a grammar")
    result = invoke("bench", "--native", "--repeat-penalty", "1.1")
    assert result.exit_code == 2 and result.stderr.startswith("error: --native times llama-cpp-python's own plain loop")
