"""--learn, --no-learn, --learn-budget, --learn-buffer, --learn-labels and --keep-learned through
the CLI: bad values are one-line usage errors before anything loads; a run that learns (tokens or
distributions) prints the same text as plain decoding, reports what it learned, and writes the
heads back where asked."""

from __future__ import annotations

import json

import pytest

from test_cli_accept import invoke

COMMANDS = ("generate", "chat", "serve")


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("options", "message"), [
    (("--learn", "--learn-budget", "0"), "--learn-budget must be more than 0 and at most 1"),
    (("--learn", "--learn-budget", "1.5"), "--learn-budget must be more than 0 and at most 1"),
    (("--learn", "--learn-buffer", "10"), "--learn-buffer must be between 64 and 131072 tokens, got 10"),
    (("--keep-learned", "--no-learn"), "--keep-learned keeps what learning learned, and --no-learn turns"),
    (("--no-learn", "--learn-budget", "0.5"), "--learn-budget shapes online learning, which is off for this run"),
    (("--learn", "--learn-labels", "logits"), "unknown --learn-labels 'logits'"),
    (("--learn", "--no-learn"), "--learn and --no-learn contradict each other"),
    (("--no-learn", "--learn"), "--learn and --no-learn contradict each other"),
    (("--no-learn", "--learn-labels", "tokens"), "--learn-labels shapes online learning, which is off for this run"),
])
def test_bad_learning_options_are_one_line_usage_errors(command, options, message):
    args = [command, *(["x"] if command == "generate" else []), "-t", "/nonexistent.gguf", *options]
    result = invoke(*args, input="hello\n")
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) <= 2  # the error and its fix


def test_generate_learns_only_when_asked():
    result = invoke("generate", "x", "-t", "/nonexistent.gguf", "--learn-buffer", "128")
    assert result.exit_code == 2 and "--learn-buffer shapes online learning" in result.stderr


@pytest.fixture
def llama_installed():
    pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")


@pytest.fixture
def medusa_run(tiny_llama, tmp_path, llama_installed):
    from heads_factory import random_heads
    from specrun.heads.files import save_heads

    config = tiny_llama.config
    path = tmp_path / "heads.safetensors"
    save_heads(random_heads(config.hidden_size, config.vocab_size), path)
    return ["-t", str(tiny_llama.gguf_path), "-n", "48", "-k", "4", "--raw"], path


PROMPT = "def f(x):\n    return x\n" * 3


def test_a_learning_run_prints_plain_decoding_s_text_and_keeps_the_heads(medusa_run):
    from specrun.heads.files import load_heads

    args, path = medusa_run
    before = path.read_bytes()
    plain_args = [arg for arg in args if arg not in ("-k", "4")]  # -k: refused with none, which drafts nothing
    plain = invoke("generate", PROMPT, *plain_args, "--method", "none", "--json")
    args = [*args, "--heads", str(path)]
    assert plain.exit_code == 0, plain.output
    learned = invoke("generate", PROMPT, *args, "--method", "medusa", "--keep-learned", "--learn-budget", "1",
                     "--json")
    assert learned.exit_code == 0, learned.output
    answer = json.loads(learned.stdout)
    assert answer["text"] == json.loads(plain.stdout)["text"]
    report = answer["learning"][0]
    assert report["kind"] == "medusa" and report["steps"] > 0 and report["kept"] == str(path), report
    assert path.read_bytes() != before
    assert load_heads(path).config.training["online"][-1]["steps"] == report["steps"]
    assert report["labels"] == "tokens"
    as_text = invoke("generate", PROMPT, *args, "--method", "medusa", "--learn")
    assert as_text.exit_code == 0 and "learning (medusa):" in as_text.stderr
    soft = invoke("generate", PROMPT, *args, "--method", "medusa", "--learn", "--learn-labels", "distributions",
                  "--learn-budget", "1", "--json")
    assert soft.exit_code == 0, soft.output
    answer = json.loads(soft.stdout)
    assert answer["text"] == json.loads(plain.stdout)["text"]
    assert answer["learning"][0]["labels"] == "distributions" and answer["learning"][0]["steps"] > 0


def test_learning_with_nothing_that_learns_says_why_in_a_note(tiny_llama, llama_installed):
    result = invoke("generate", PROMPT, "-t", str(tiny_llama.gguf_path), "-d", str(tiny_llama.gguf_path), "-n", "8",
                    "--method", "draft", "--learn")
    assert result.exit_code == 0, result.output
    assert "note: --learn: nothing learns: llama.cpp's draft models cannot learn online" in result.stderr
    lookup = invoke("generate", PROMPT, "-t", str(tiny_llama.gguf_path), "-n", "8", "--method", "lookup", "--learn")
    assert lookup.exit_code == 0, lookup.output
    assert "note: --learn: nothing learns: the method drafts with no heads and no draft model" in lookup.stderr


def test_chat_learns_by_default_from_every_answer(medusa_run):
    args, path = medusa_run
    args = [arg for arg in args if arg != "--raw"]
    messages = "Write a loop in Python.\nNow write it as a comprehension.\n"
    plain = invoke("chat", *args, "--method", "none", "--each-line", "--json", input=messages)
    assert plain.exit_code == 0, plain.output
    learned = invoke("chat", *args, "--heads", str(path), "--method", "medusa", "--each-line", "--json",
                     input=messages)
    assert learned.exit_code == 0, learned.output
    assert [json.loads(line)["text"] for line in learned.stdout.splitlines()] == \
        [json.loads(line)["text"] for line in plain.stdout.splitlines()]
    line = next(line for line in learned.stderr.splitlines() if line.startswith("learning (medusa):"))
    assert int(line.split(" steps on ")[1].split(" positions")[0]) >= 2 * 40  # both answers
    quiet = invoke("chat", *args, "--heads", str(path), "--method", "medusa", "--no-learn", input="hi\n")
    assert quiet.exit_code == 0 and "learning (" not in quiet.stderr


def test_an_mlx_draft_model_learns_in_chat_and_the_answers_are_plain_decoding_s(tiny_llama, looping_llama,
                                                                               tmp_path, monkeypatch):
    """chat on MLX with a draft model: its adapters learn from both answers (reported in the stats;
    the whole of generation's time its budget, so that two short answers see steps) and the texts
    are plain decoding's; --keep-learned writes the adapters to specrun's cache, where the next
    --keep-learned run starts from them (a note says so), its text plain decoding's too."""
    pytest.importorskip("mlx_lm", reason="the mlx backend is not installed")
    pair = ["-t", str(tiny_llama.hf_dir), "-d", str(looping_llama["mlx"]), "--backend", "mlx", "-n", "40"]
    args = [*pair, "-k", "3"]
    messages = "def f(x):\n    return x\nWrite it again.\n"
    plain = invoke("chat", *args, "--method", "none", "--each-line", "--json", input=messages)
    assert plain.exit_code == 0, plain.output
    learned = invoke("chat", *args, "--method", "draft", "--learn-budget", "1", "--each-line", "--json",
                     input=messages)
    assert learned.exit_code == 0, learned.output
    assert [json.loads(line)["text"] for line in learned.stdout.splitlines()] == \
        [json.loads(line)["text"] for line in plain.stdout.splitlines()]
    line = next(line for line in learned.stderr.splitlines() if line.startswith("learning (draft):"))
    assert int(line.split(" steps on ")[1].split(" positions")[0]) >= 2 * 30, line  # both answers
    assert int(line.split(": ")[1].split(" steps")[0]) > 0 and "stopped" not in line, line
    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path / "cache"))
    plain_generate = invoke("generate", "def f(x):\n", *pair, "--raw", "--method", "none")  # -k: refused with none
    assert plain_generate.exit_code == 0, plain_generate.output
    kept = invoke("generate", "def f(x):\n", *args, "--raw", "--method", "draft", "--keep-learned",
                  "--learn-budget", "1")
    assert kept.exit_code == 0, kept.output
    (written,) = (tmp_path / "cache" / "heads").glob("*/draft-*.adapters.safetensors")
    assert f"kept in {written}" in kept.stderr and "earlier runs" not in kept.stderr
    again = invoke("generate", "def f(x):\n", *args, "--raw", "--method", "draft", "--keep-learned")
    assert again.exit_code == 0, again.output
    assert f"note: --keep-learned: the draft model drafts with the adapters it learned in earlier runs ({written})" \
        in again.stderr
    assert kept.stdout == again.stdout == plain_generate.stdout


def test_an_mlx_draft_model_learns_the_target_s_distributions_where_sampling_brings_them(tiny_llama, looping_llama,
                                                                                         tmp_path, monkeypatch):
    """--learn-labels distributions: a draft model learns soft labels from the rows of sampled
    passes (the report says "distributions"); greedy passes keep their rows on the device, so a
    greedy run learns tokens, and says so. Kept (--keep-learned), the 48 tokens' one window is
    trained on at close however busy the machine left the worker while generating."""
    pytest.importorskip("mlx_lm", reason="the mlx backend is not installed")
    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path / "cache"))
    args = ["-t", str(tiny_llama.hf_dir), "-d", str(looping_llama["mlx"]), "--backend", "mlx", "-n", "48", "-k", "3",
            "--raw", "--method", "draft", "--learn", "--learn-labels", "distributions", "--learn-budget", "1", "--json",
            "--keep-learned"]
    sampled = invoke("generate", "def f(x):\n", *args, "--temp", "0.8", "--seed", "3")
    assert sampled.exit_code == 0, sampled.output
    (report,) = json.loads(sampled.stdout)["learning"]
    assert report["kind"] == "draft" and report["labels"] == "distributions" and report["steps"] > 0, report
    greedy = invoke("generate", "def f(x):\n", *args)
    assert greedy.exit_code == 0, greedy.output
    (report,) = json.loads(greedy.stdout)["learning"]
    assert report["labels"] == "tokens" and report["steps"] > 0, report
    assert "note: --learn-labels distributions: the draft model had the target's tokens only" in greedy.stderr
