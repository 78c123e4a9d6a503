"""`specrun models convert --out` where no folder can be made, and SIGTERM while converting:
one line naming the place and the fix, checked before anything is converted, and nothing left
behind (issue 56)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from cli_checks import ROOT, assert_one_line_error, run_specrun

pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")


def convert(source, out, **kwargs):
    return run_specrun("models", "convert", str(source), "--to", "mlx", "--out", str(out), timeout=120, **kwargs)


def test_out_as_a_link_to_a_folder_or_a_dangling_link_is_one_line(tiny_llama, tmp_path):
    (tmp_path / "real").mkdir()
    for name, points_to in (("to-folder", tmp_path / "real"), ("dangling", tmp_path / "nowhere")):
        link = tmp_path / name
        link.symlink_to(points_to)
        result = convert(tiny_llama.gguf_path, link)
        assert_one_line_error(result.returncode, result.stderr, 2, str(link), "symbolic link")
        assert b"converting" not in result.stderr  # refused first (the dangling link was found after converting)
        assert link.is_symlink() and not list((tmp_path / "real").iterdir())


def test_out_under_a_file_is_one_line_naming_the_file(tiny_llama, tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    result = convert(tiny_llama.gguf_path, tmp_path / "notes.txt" / "out")
    assert_one_line_error(result.returncode, result.stderr, 1, "notes.txt")


def test_out_in_a_read_only_folder_is_one_line_before_converting(tiny_llama, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        result = convert(tiny_llama.gguf_path, locked / "out", honour_permissions=True)
        assert_one_line_error(result.returncode, result.stderr, 1, str(locked))
        assert b"converting" not in result.stderr
    finally:
        locked.chmod(0o700)


def test_out_on_a_full_disk_is_one_line_and_leaves_nothing(tiny_llama, tmp_path):
    """safetensors reports a failed write as its own error: it was an internal error."""
    result = convert(tiny_llama.gguf_path, tmp_path / "out", max_file_bytes=64 * 1024)
    stderr = result.stderr.decode()
    assert stderr.startswith("converting ")  # the one progress line, then the error
    assert_one_line_error(result.returncode, stderr.split("\n", 1)[1], 1, "no room to write out", str(tmp_path),
                          "another folder")
    assert sorted(path.name for path in tmp_path.iterdir()) == []


def test_sigterm_while_converting_leaves_no_scratch_folder(smollm2, tmp_path):
    """The real model's conversion takes seconds: long enough to be stopped halfway."""
    command = [sys.executable, "-m", "specrun", "models", "convert", str(smollm2["smollm2-135m-f16"]), "--to", "mlx",
               "--out", str(tmp_path / "out")]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".deriving-*")) and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.02)
    assert list(tmp_path.glob(".deriving-*")), "the conversion never started writing"
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert stderr.decode().strip().splitlines()[-1] == "interrupted"
    assert list(tmp_path.iterdir()) == []


def test_a_failed_conversion_leaves_the_places_as_they_were(tiny_llama, tmp_path):
    """A GGUF cut short fails mid-conversion: an empty --out folder the user made is still there
    (it was removed), and folders made for a deeper --out are gone (they were left)."""
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_llama.gguf_path.read_bytes()[:-4096])
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "a" / "b" / "c"):
        result = convert(cut, out)
        assert result.returncode == 1 and b"is damaged" in result.stderr, result.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["cut.gguf", "empty"]
    assert not list((tmp_path / "empty").iterdir())
