"""How many connections the server holds open, and what happens to the rest.

Idle sockets once exhausted the process's file descriptors: 600 connections that sent nothing
(ulimit -n 512) made every later accept() fail, asyncio logged a traceback for each failure
(~264,000 in 21 s) and a real request timed out. So:

- the soft descriptor limit is raised towards the hard one, and the connections held open at
  once are capped below it (``connection_cap``), descriptors kept back for the model files and
  the worker;
- a connection past the cap is answered at once with a JSON 503 and closed, so descriptors stay
  bounded whatever clients do (``guarded_protocol``);
- a connection that sends nothing is closed after the keep-alive timeout, as an idle one between
  requests already was;
- asyncio's own "out of system resource" reports, should any remain, are one line a minute
  (``QuietAcceptErrors``).
"""

from __future__ import annotations

import json
import logging
import resource
import time
from collections.abc import Callable

MAX_CONNECTIONS = 1024  # open connections served at once, where the descriptor limit allows
FD_RESERVE = 64  # descriptors kept back: model files, the log, the worker's, a client being refused
MIN_CONNECTIONS = 8
REPORT_EVERY_S = 60.0

BUSY_BODY = json.dumps({"error": {
    "message": "the server holds as many connections as it can; retry later", "type": "server_error",
    "param": None, "code": "too_many_connections"}}).encode()
BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                 b"content-length: " + str(len(BUSY_BODY)).encode() + b"\r\nconnection: close\r\n\r\n" + BUSY_BODY)


def connection_cap() -> int:
    """The connections to hold open at once: MAX_CONNECTIONS where the descriptor limit (raised
    towards its hard limit first) leaves FD_RESERVE beside them, fewer where it does not."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MAX_CONNECTIONS + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if raised > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
                soft = raised
            except (ValueError, OSError):
                pass  # kept as it was: the cap follows it
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(MIN_CONNECTIONS, min(MAX_CONNECTIONS, soft - FD_RESERVE))


def guarded_protocol(cap: int, log: Callable[[str], None]) -> type:
    """uvicorn's HTTP/1.1 protocol, refusing connections past ``cap`` with a JSON 503 and closing
    one that sends nothing within the keep-alive timeout; ``log`` hears of refusals once a minute."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    report = _EveryMinute(log)

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > cap:
                transport.write(BUSY_RESPONSE)
                transport.close()
                report(f"specrun serve: {len(self.connections) - 1} connections open, the most it holds: "
                       "refusing more with 503 (raise ulimit -n for more)")
                return
            # closed unless data comes first (handle_events cancels it), as between requests
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

    return GuardedH11Protocol


class QuietAcceptErrors(logging.Filter):
    """asyncio's report of a failed accept() (descriptors or memory exhausted) as one line, at most
    once a minute; every other record passes as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.last = float("-inf")

    def filter(self, record: logging.LogRecord) -> bool:
        if "out of system resource" not in record.getMessage():
            return True
        now = time.monotonic()
        if now - self.last < REPORT_EVERY_S:
            return False
        self.last = now
        reason = record.exc_info[1] if record.exc_info else None
        record.msg, record.args = f"specrun serve: cannot accept connections ({reason}); retrying", None
        record.exc_info = record.exc_text = None
        return True


class _EveryMinute:
    def __init__(self, log: Callable[[str], None]) -> None:
        self.log = log
        self.last = float("-inf")

    def __call__(self, line: str) -> None:
        now = time.monotonic()
        if now - self.last >= REPORT_EVERY_S:
            self.last = now
            self.log(line)
