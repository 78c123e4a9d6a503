"""specrun/allocator.py: glibc told once a process to keep freed arrays mapped; SPECRUN_KEEP_FREED=0 leaves it."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

ASK = "from specrun.allocator import keep_freed_arrays; print(keep_freed_arrays(), keep_freed_arrays())"


def _asked(environment: dict[str, str]) -> str:
    return subprocess.run([sys.executable, "-c", ASK], capture_output=True, text=True, check=True,
                          env=environment).stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_glibc_takes_the_thresholds_once_and_the_variable_turns_it_off():
    import os

    environment = {name: value for name, value in os.environ.items() if name != "SPECRUN_KEEP_FREED"}
    assert _asked(environment) == "True True"  # this machine's C library is glibc
    assert _asked({**environment, "SPECRUN_KEEP_FREED": "0"}) == "False False"


def test_an_engine_asks_for_it(monkeypatch):
    import specrun.engine.loop as loop
    from specrun.backends.fake import FakeBackend

    asked = []
    monkeypatch.setattr(loop, "keep_freed_arrays", lambda: asked.append(True))
    loop.SpeculativeEngine(FakeBackend(lambda context: [0.0, 1.0], 2))
    assert asked == [True]
