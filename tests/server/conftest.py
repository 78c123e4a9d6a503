"""Fixtures of the serve tests: the real server, started once, on the demo pair."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
pytest.importorskip("openai", reason="the openai client is not installed: pip install 'specrun[dev]'")

from server_harness import DEMO_ARGS, start_server, stop_server  # noqa: E402


@pytest.fixture(scope="session")
def demo_server():
    """The demo pair, served as `specrun serve` serves it by default (method auto), with --exact."""
    server = start_server(*DEMO_ARGS, "--max-body", "65536")
    yield server
    assert stop_server(server) == 0, server.log
