"""A prompt that cannot fit the context whatever its tokens is refused before it is tokenized
(tokenizing a 50 MB prompt took 45 s before the context check refused it)."""

from __future__ import annotations

import pytest

from specrun.errors import ContextFullError
from specrun.sessions.setup import CHEAP_BYTES_PER_TOKEN, check_prompt_size


class Vocab:
    size = 5
    add_bos = False


class NeverTokenizes:
    """A target whose longest token is 4 bytes, that fails any attempt to tokenize."""

    n_ctx = 100
    vocab = Vocab()

    def token_bytes(self, token: int) -> bytes:
        return b"abcd"[: token]

    def tokenize(self, text: str, add_bos: bool = False) -> list[int]:
        raise AssertionError("tokenized a prompt that cannot fit")


def test_a_prompt_longer_than_the_context_in_its_longest_tokens_is_refused_untokenized():
    target = NeverTokenizes()
    text = "é" * 200  # 400 bytes: at least 100 tokens of at most 4 bytes, and the context holds 100
    assert CHEAP_BYTES_PER_TOKEN * target.n_ctx > 400  # below the cheap bound: checked, never refused
    check_prompt_size(target, text)
    huge = "é" * (CHEAP_BYTES_PER_TOKEN * target.n_ctx)
    with pytest.raises(ContextFullError, match=r"3,200 bytes, at least 800 tokens .* longest token is 4 bytes"):
        check_prompt_size(target, huge)


def test_a_prompt_that_might_fit_is_tokenized():
    class Fits(NeverTokenizes):
        n_ctx = 10

        def token_bytes(self, token: int) -> bytes:
            return b"x" * 1000  # long tokens: 3,200 bytes could be 4 of them

    check_prompt_size(Fits(), "é" * 1600)  # 3,200 bytes could be 4 tokens: left to the tokenizer


def test_generate_refuses_a_prompt_of_megabytes_by_its_size(tiny_llama):
    """`specrun generate` checks the size before it tokenizes (the server too: test_serve_api)."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from cli_checks import assert_one_line_error, run_specrun

    model = str(tiny_llama.gguf_path)
    result = run_specrun("generate", "-", "-t", model, "-n", "2", input=b"xyzzy " * 400_000)
    assert_one_line_error(result.returncode, result.stderr, 1, "2,400,000 bytes", "--ctx")


def test_chat_refuses_a_message_of_megabytes_by_its_size(tiny_llama):
    """A piped message past any fit was rendered first, and the template's limits blamed the template."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from cli_checks import assert_one_line_error, run_specrun

    model = str(tiny_llama.gguf_path)
    result = run_specrun("chat", "-t", model, "-d", model, "-n", "2", input=b"xyzzy " * 400_000)
    assert_one_line_error(result.returncode, result.stderr, 1, "2,400,000 bytes", "--ctx")
    assert b"template" not in result.stderr


def test_endless_stdin_is_refused_once_past_any_context():
    """`yes | specrun generate -` read until memory ran out; it stops at 256 MiB, before any model loads."""
    import os
    import subprocess
    import sys

    from cli_checks import ROOT, assert_one_line_error

    endless = subprocess.Popen(["yes"], stdout=subprocess.PIPE)
    try:
        result = subprocess.run([sys.executable, "-m", "specrun", "generate", "-", "-t", "no-such-model.gguf"],
                                stdin=endless.stdout, capture_output=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        endless.kill()
        endless.wait()
    assert_one_line_error(result.returncode, result.stderr, 1, "stdin holds more than 256 MiB", "shorter prompt")


def test_a_context_too_small_says_to_raise_ctx_only_where_the_model_takes_more():
    """A 3,000-token prompt at demo-target's full 2,048 was told to raise --ctx, which the next run
    refused (more than the model was trained with)."""
    from types import SimpleNamespace

    from specrun.sessions.setup import ctx_fix

    assert ctx_fix(SimpleNamespace(n_ctx=512, n_ctx_train=2048), "shorten the prompt") == \
        "shorten the prompt, or raise --ctx (up to 2,048)"
    assert ctx_fix(SimpleNamespace(n_ctx=2048, n_ctx_train=2048), "shorten the prompt") == \
        "shorten the prompt (--ctx already holds the 2,048 tokens the model was trained with)"
    assert ctx_fix(SimpleNamespace(n_ctx=2048, n_ctx_train=0), "shorten it") == "shorten it, or raise --ctx"
    assert ctx_fix(NeverTokenizes(), "shorten it") == "shorten it, or raise --ctx"  # no training context said


def test_a_prompt_past_the_model_s_whole_context_is_told_to_shorten_only(tiny_llama):
    from typer.testing import CliRunner

    from specrun.cli.app import app

    result = CliRunner().invoke(app, ["generate", "-t", str(tiny_llama.gguf_path), "--method", "none", "-n", "2",
                                      "--threads", "1", "word " * 5000])
    assert result.exit_code == 1, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert "but the context holds" in line and "--ctx already holds the" in line and "raise --ctx" not in line
