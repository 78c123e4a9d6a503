"""``--accept`` (lossy acceptance, labelled wherever it is on) and ``--verify`` on the commands."""

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
    (("--accept", "typical", "--exact"), "--exact contradicts --accept typical: a lossy rule changes the text"),
    (("--accept", "margin", "--exact"), "--exact contradicts --accept margin"),
    (("--accept", "typical", "--epsilon", "1.5"), "--epsilon must be in (0, 1), got 1.5"),
    (("--accept", "typical", "--epsilon", "0"), "--epsilon must be in (0, 1), got 0"),
    (("--accept", "typical", "--delta", "1"), "--delta must be in (0, 1), got 1"),
    (("--accept", "margin", "--margin", "0.5"), "--margin must be at least 1 and finite, got 0.5"),
    (("--accept", "margin", "--epsilon", "0.1"), "--epsilon sets --accept typical, and the acceptance here is margin"),
    (("--margin", "2"), "--margin sets --accept margin, and the acceptance here is exact"),
    (("--accept", "greedy"), "unknown --accept 'greedy'"),
    (("--verify", "tree"), "unknown --verify 'tree'"),
])
def test_bad_acceptance_settings_are_one_line_usage_errors_naming_the_range(command, options, message):
    args = [command, *options] + (["hello"] if command == "generate" else [])
    result = invoke(*args, input="hi\n")
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), result.stderr


def test_help_says_the_lossy_rules_change_the_text():
    result = runner.invoke(app, ["generate", "--help"], terminal_width=200)
    text = " ".join(result.output.replace("│", " ").split())
    assert "--accept" in text and "lossy rules that accept more drafts but change the text" in text
    assert "--verify" in text and "block (the default" in text


# ---- runs on the tiny llama and its perturbed draft -------------------------------------------
@pytest.fixture(scope="module")
def pair(tiny_llama, perturbed):
    pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")
    return ["-t", str(tiny_llama.gguf_path), "-d", str(perturbed["llama"]), "-m", "draft", "-k", "4"]


def test_the_default_is_exact_and_never_labelled_lossy(pair):
    as_json = invoke("generate", "def main():", *pair, "-n", "16", "--json")
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout)["stats"]["acceptance"] == "exact"
    as_text = invoke("generate", "def main():", *pair, "-n", "16")
    assert as_text.exit_code == 0 and "lossy" not in as_text.stderr


@pytest.mark.parametrize(("options", "label"), [(("--accept", "typical"), "typical (lossy)"),
                                                (("--accept", "margin", "--margin", "4"), "margin (lossy)")])
def test_a_lossy_generate_says_so_in_its_stats_line_and_json(pair, options, label):
    as_json = invoke("generate", "def main():", *pair, "-n", "24", "--json", *options)
    assert as_json.exit_code == 0, as_json.output
    stats = json.loads(as_json.stdout)["stats"]
    assert stats["acceptance"] == label and stats["drafted"] > 0
    as_text = invoke("generate", "def main():", *pair, "-n", "24", "--temp", "0.8", "--seed", "1", *options)
    assert as_text.exit_code == 0, as_text.output
    assert as_text.stderr.strip().splitlines()[-1].endswith(f"; acceptance {label}: not the target's own text")


def test_chat_answers_say_they_are_lossy(pair):
    result = invoke("chat", *pair, "-n", "16", "--json", "--each-line", "--accept", "typical",
                    input="def main():\nclass Stack:\n")
    assert result.exit_code == 0, result.output
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(answers) == 2 and all(a["stats"]["acceptance"] == "typical (lossy)" for a in answers)


@pytest.mark.parametrize(("verify", "rule"), [("block", "verify_block"), ("token", "verify_sampled")])
def test_verify_chooses_how_sampled_chains_are_verified(pair, monkeypatch, verify, rule):
    import specrun.engine.passes as passes

    calls = {"verify_block": 0, "verify_sampled": 0}
    for name in calls:
        def counted(*args, _rule=getattr(passes, name), _name=name):
            calls[_name] += 1
            return _rule(*args)

        monkeypatch.setattr(passes, name, counted)
    result = invoke("generate", "def main():", *pair, "-n", "24", "--temp", "0.8", "--seed", "2", "--json",
                    "--verify", verify)
    assert result.exit_code == 0, result.output
    assert calls[rule] > 0 and sum(calls.values()) == calls[rule], calls
    assert json.loads(result.stdout)["stats"]["acceptance"] == "exact"
