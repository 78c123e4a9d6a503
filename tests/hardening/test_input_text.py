"""Issue 32, item 8: input that is not UTF-8 (a Latin-1 file, random bytes) names the problem and the fix."""

from __future__ import annotations

import json
import os

import pytest

from cli_checks import assert_one_line_error, run_specrun

LATIN_1 = "Grüße aus Köln, café crème\n".encode("latin-1")
RANDOM_BYTES = bytes(range(128, 256)) * 4


@pytest.fixture(scope="module")
def llama_pair(tiny_llama) -> list[str]:
    pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")
    model = str(tiny_llama.gguf_path)
    return ["-t", model, "-d", model, "--backend", "llama", "-n", "4"]


@pytest.mark.parametrize("data", [LATIN_1, RANDOM_BYTES], ids=["latin-1", "random bytes"])
@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("locale", ["C.UTF-8", "C"])
def test_stdin_that_is_not_utf8_is_refused_in_one_line(llama_pair, data, command, locale):
    result = run_specrun(command, *llama_pair, input=data, env={"LC_ALL": locale, "PYTHONIOENCODING": ""})
    line = assert_one_line_error(result.returncode, result.stderr, 1, "stdin", "UTF-8", "iconv")
    assert "byte 0x" in line
    assert result.stdout == b""


def test_a_prompt_argument_that_is_not_utf8_is_refused(llama_pair):
    argument = os.fsdecode(LATIN_1.strip())  # how Python hands over argv bytes that are not UTF-8
    result = run_specrun("generate", argument, *llama_pair, env={"LC_ALL": "C.UTF-8"})
    assert_one_line_error(result.returncode, result.stderr, 1, "prompt", "UTF-8")


def test_utf8_stdin_still_works(llama_pair):
    result = run_specrun("generate", *llama_pair, input="Grüße aus Köln\n".encode())
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.strip()


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_byte_order_mark_before_piped_text_is_no_part_of_the_prompt(llama_pair, command):
    """A BOM (a Windows editor's file piped in) was kept in the prompt: its tokens changed the answer."""
    text = "Grüße aus Köln\n".encode()
    plain = run_specrun(command, *llama_pair, "--method", "none", "--json", input=text)
    marked = run_specrun(command, *llama_pair, "--method", "none", "--json", input=b"\xef\xbb\xbf" + text)
    assert plain.returncode == marked.returncode == 0, marked.stderr.decode()
    said = [(json.loads(line)["text"], json.loads(line)["stats"]["prompt_tokens"])
            for result in (plain, marked) for line in result.stdout.splitlines()]
    assert said[0] == said[1] and "\ufeff" not in said[1][0]
