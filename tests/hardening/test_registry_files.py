"""Issue 32, items 10 and 11: registry files that are not UTF-8, nest without end, hold
impossible values or are no regular file name themselves and the fix."""

from __future__ import annotations

import os

import pytest

from cli_checks import assert_one_line_error, invoke
from specrun.errors import RegistryError
from specrun.registry.catalog import parse_registry

GOOD_ENTRY = '[models.mine]\ngguf_path = "/models/mine.gguf"\nfamily = "llama3"\n'


@pytest.mark.parametrize(
    "contents, fragment",
    [
        (GOOD_ENTRY.replace("llama3", "caf\xe9").encode("latin-1"), "not UTF-8"),
        (b"\xff\xfe" + GOOD_ENTRY.encode("utf-16-le"), "not UTF-8"),
        (GOOD_ENTRY.encode() + b"context = -5\n", "'context' must be a positive number"),
        (GOOD_ENTRY.encode() + b"size_gb = -1.5\n", "'size_gb' must be a positive number"),
        (GOOD_ENTRY.encode() + b"size_gb = inf\n", "'size_gb' must be a positive number"),
        (GOOD_ENTRY.encode() + b"drafts = " + b"[" * 50_000 + b"]" * 50_000 + b"\n", "not valid TOML"),
        # past Python's 4,300 digits: was an internal error ending in "use sys.set_int_max_str_digits()"
        (GOOD_ENTRY.encode() + b"context = 1" + b"0" * 5000 + b"\n", "a number of more than 4300 digits"),
    ],
    ids=["latin-1", "utf-16", "negative context", "negative size", "infinite size", "deep nesting", "huge number"],
)
def test_bad_registry_files_name_the_file_and_the_fix(tmp_path, contents, fragment):
    path = tmp_path / "models.toml"
    path.write_bytes(contents)
    with pytest.raises(RegistryError, match=fragment) as caught:
        parse_registry(path)
    assert str(path) in caught.value.one_line() and caught.value.fix
    result = invoke("models", "list", "--registry", str(path))
    assert_one_line_error(result.exit_code, result.stderr, 1, str(path))


def test_a_fifo_registry_is_refused_without_blocking(tmp_path):
    path = tmp_path / "models.toml"
    os.mkfifo(path)
    result = invoke("models", "list", "--registry", str(path))
    assert_one_line_error(result.exit_code, result.stderr, 1, str(path), "not a regular file")


def test_a_good_registry_still_loads(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text(GOOD_ENTRY + "context = 4096\nsize_gb = 0.5\n", encoding="utf-8")
    entry = parse_registry(path)["mine"]
    assert (entry.context, entry.size_gb, entry.family) == (4096, 0.5, "llama3")
