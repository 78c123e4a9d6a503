"""The server's accept failures and refusals are reported at most once a minute, as one line
(issue 56: 600 idle sockets under ulimit -n 512 logged ~264,000 tracebacks in 21 s)."""

from __future__ import annotations

import logging

from specrun.server import connections
from specrun.server.connections import REPORT_EVERY_S, QuietAcceptErrors


def accept_failure() -> logging.LogRecord:
    """What asyncio logs for each accept() that fails with EMFILE."""
    try:
        raise OSError(24, "Too many open files")
    except OSError as exc:
        error = exc
    return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "socket.accept() out of system resource",
                             None, (OSError, error, error.__traceback__))


def test_accept_failures_are_one_line_a_minute(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(connections.time, "monotonic", lambda: now[0])
    quiet = QuietAcceptErrors()
    first = accept_failure()
    assert quiet.filter(first)
    assert first.getMessage() == "specrun serve: cannot accept connections ([Errno 24] Too many open files); retrying"
    assert first.exc_info is None  # no traceback
    passed = []
    for _ in range(10_000):  # a burst, within the minute
        now[0] += 0.001
        passed.append(quiet.filter(accept_failure()))
    assert not any(passed)
    now[0] += REPORT_EVERY_S
    assert quiet.filter(accept_failure())  # a minute on: one line again
    other = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "something else", None, None)
    assert quiet.filter(other) and other.getMessage() == "something else"  # everything else as it is


def test_refusals_past_the_cap_are_reported_once_a_minute(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(connections.time, "monotonic", lambda: now[0])
    lines = []
    report = connections._EveryMinute(lines.append)
    for second in range(180):
        now[0] = float(second)
        for _ in range(50):
            report(f"refused at {second}")
    assert lines == ["refused at 0", "refused at 60", "refused at 120"]


def test_the_cap_leaves_descriptors_for_the_model_and_never_falls_below_the_minimum(monkeypatch):
    for soft, expected in ((512, 512 - connections.FD_RESERVE), (40, connections.MIN_CONNECTIONS),
                           (1 << 20, connections.MAX_CONNECTIONS)):
        monkeypatch.setattr(connections.resource, "getrlimit", lambda kind, soft=soft: (soft, soft))
        assert connections.connection_cap() == expected
