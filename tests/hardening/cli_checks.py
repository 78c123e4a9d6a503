"""What every hardening test checks of a failed command: one line, a fix, the right exit code."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specrun.cli.app import app
from specrun.drafters.ngram import HEADER, MAGIC

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]


def invoke(*args: str, input: str | bytes | None = None, env: dict | None = None):
    return runner.invoke(app, list(args), input=input, env=env)


def run_specrun(
    *args: str, input: bytes | None = None, env: dict | None = None, timeout: float = 120,
    max_file_bytes: int | None = None, honour_permissions: bool = False,
):
    """specrun in a process of its own (signals, pipes and stdin bytes need a real one).
    ``max_file_bytes``: writes past this size fail (EFBIG) as they would on a full disk.
    ``honour_permissions``: run as root without the capabilities that override file modes, so
    that a read-only folder refuses root as it refuses a user (CI runs as root)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    prefix = _without_root_overrides() if honour_permissions else []

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))

    return subprocess.run(
        [*prefix, sys.executable, "-m", "specrun", *args], input=input, capture_output=True, env=full_env, timeout=timeout,
        preexec_fn=limit_file_size if max_file_bytes is not None else None,
    )


def _without_root_overrides() -> list[str]:
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("root ignores file modes and setpriv (util-linux) is not installed to drop that")
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--"]


def error_lines(stderr: str | bytes) -> list[str]:
    text = stderr.decode("utf-8", "replace") if isinstance(stderr, bytes) else stderr
    return [line for line in text.splitlines() if line.strip()]


def assert_one_line_error(exit_code: int, stderr: str | bytes, expected_code: int, *fragments: str) -> str:
    """One line on stderr that starts with 'error:', names each fragment and a fix (after ';')."""
    lines = error_lines(stderr)
    assert exit_code == expected_code, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ") and "; " in lines[0], lines
    assert "Traceback" not in lines[0] and "internal error" not in lines[0], lines
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines)
    return lines[0]


def ngram_cache_bytes(document) -> bytes:
    """A cache file with a valid header and checksum around any JSON document (or raw payload bytes)."""
    payload = document if isinstance(document, bytes) else json.dumps(document).encode()
    return HEADER.pack(MAGIC, 1, len(payload), hashlib.sha256(payload).digest()) + payload


@contextmanager
def deadline(seconds: float, case: str):
    """Fail a case that runs past ``seconds`` (a hang) instead of hanging the suite. The suite's
    own per-test timer (pytest-timeout, the same SIGALRM) is armed again afterwards with the time
    it had left, so the rest of the test keeps its limit."""

    def expire(signum, frame):
        raise AssertionError(f"{case}: still running after {seconds} s")

    outer, _ = signal.getitimer(signal.ITIMER_REAL)
    began = time.monotonic()
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - began), 0.001))
