"""An option that shapes a drafter no method of the run drafts with (--draft-min-prob,
--ngram-cache) is a one-line usage error naming it, before anything loads: it was taken and
ignored. Chat takes them: its /method may turn to a method that uses them. --draft names the
pair, taken with any method (a script runs one pair through several)."""

from __future__ import annotations

import pytest

from tests.cli.test_cli_accept import invoke

CASES = [
    (("--method", "lookup", "--draft-min-prob", "0.5"),
     "--draft-min-prob cuts a draft model's drafts at a probability, and --method lookup drafts without one"),
    (("--method", "lookup", "--ngram-cache", "pool.bin"),
     "--ngram-cache keeps the n-gram pool's counts, and --method lookup drafts without the pool; "
     "drop --ngram-cache, or choose a method with the pool"),
    (("--method", "lookup+draft", "--ngram-cache", "pool.bin"),
     "--ngram-cache keeps the n-gram pool's counts, and --method lookup+draft drafts without the pool"),
]


def one_line_usage_error(result, message: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), result.stderr


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize(("options", "message"), CASES)
def test_an_option_no_method_uses_is_refused(command, options, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke(command, "-t", "demo-target", *options, *(["hello"] if command == "generate" else []))
    one_line_usage_error(result, message)
    assert list(tmp_path.iterdir()) == []  # no pool file written


@pytest.mark.parametrize(("options", "message"), [
    (("--methods", "none,lookup", "--draft-min-prob", "0.3"),
     "--draft-min-prob cuts a draft model's drafts at a probability, and --methods none,lookup draft without one"),
    (("--methods", "ngram,lookup+ngram", "--draft-min-prob", "0.3"),
     "--draft-min-prob cuts a draft model's drafts at a probability, and --methods none,ngram,lookup+ngram draft "
     "without one"),
])
def test_bench_refuses_them_where_no_method_in_its_list_uses_them(options, message):
    one_line_usage_error(invoke("bench", "-t", "demo-target", *options), message)


@pytest.mark.parametrize("options", [
    ("--method", "auto", "--draft", "demo-draft", "--draft-min-prob", "0.2", "--ngram-cache", "pool.bin"),
    ("--method", "ngram+draft", "--draft", "demo-draft", "--draft-min-prob", "0.2", "--ngram-cache", "pool.bin"),
])
def test_methods_that_use_them_run(options, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("generate", "-t", "demo-target", *options, "-n", "4", "--threads", "1", "hello")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "pool.bin").is_file()  # the pool was kept where asked


def test_chat_takes_them_for_a_later_method():
    result = invoke("chat", "-t", "demo-target", "--method", "lookup", "-d", "demo-draft", "--draft-min-prob", "0.2",
                    "-n", "4", "--threads", "1", input="hi\n/method draft\nhello\n")
    assert result.exit_code == 0, result.output
    assert "error" not in result.stderr


@pytest.mark.parametrize("method", ["lookup", "medusa", "none"])
def test_a_draft_is_taken_with_any_method_and_a_note_says_it_is_not_loaded(method):
    """The pair through several methods: --draft beside a method without a draft model runs, a
    note saying so (it was ignored in silence, a file that does not exist too)."""
    result = invoke("generate", "-t", "demo-target", "-d", "/nowhere/draft.gguf", "--method", method, "-n", "4",
                    "--threads", "1", "hello")
    assert result.exit_code == 0, result.output
    assert (f"note: --draft /nowhere/draft.gguf is not loaded: --method {method} drafts without a draft model"
            in result.stderr.splitlines())
    used = invoke("generate", "-t", "demo-target", "-d", "demo-draft", "--method", "draft", "-n", "4",
                  "--threads", "1", "hello")
    assert used.exit_code == 0 and "not loaded" not in used.stderr


def test_bench_notes_a_draft_none_of_its_methods_loads():
    result = invoke("bench", "-t", "demo-target", "-d", "demo-draft", "--methods", "none,lookup", "-n", "2",
                    "--per-category", "1", "--threads", "1", "--categories", "chat")
    assert result.exit_code == 0, result.output
    assert "note: --draft demo-draft is not loaded: --methods none,lookup draft without a draft model" in result.stderr


@pytest.mark.parametrize("layers", ["5", "-1"])
def test_gpu_layers_without_a_gpu_is_a_note_after_the_run(layers):
    """--gpu-layers was taken in silence where llama.cpp sees no GPU (every layer on the CPU)."""
    from specrun.backends.llama import has_local_gpu

    if has_local_gpu():
        pytest.skip("this machine has a GPU: the layers go to it")
    result = invoke("generate", "-t", "demo-target", "--gpu-layers", layers, "-n", "4", "--threads", "1", "hello")
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[-1] == (f"note: --gpu-layers {layers}: llama.cpp sees no GPU on this machine, "
                                              "so every layer runs on the CPU")
    none_asked = invoke("generate", "-t", "demo-target", "--gpu-layers", "0", "-n", "4", "--threads", "1", "hello")
    assert none_asked.exit_code == 0 and "--gpu-layers" not in none_asked.stderr


def test_chat_notes_gpu_layers_without_a_gpu_after_its_first_answer():
    from specrun.backends.llama import has_local_gpu

    if has_local_gpu():
        pytest.skip("this machine has a GPU: the layers go to it")
    result = invoke("chat", "-t", "demo-target", "--gpu-layers", "5", "-n", "4", "--threads", "1", input="hello\n")
    assert result.exit_code == 0, result.output
    assert ("note: --gpu-layers 5: llama.cpp sees no GPU on this machine, so every layer runs on the CPU"
            in result.stderr.splitlines())
    failed = invoke("chat", "-t", "no-such-model", "--gpu-layers", "5", input="hello\n")
    assert failed.exit_code != 0 and len(failed.stderr.strip().splitlines()) == 1  # the error alone
