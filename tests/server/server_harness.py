"""Helpers to run the real `specrun serve` in a subprocess on 127.0.0.1 (a free port it picks itself)."""

from __future__ import annotations

import http.client
import json
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

SPECRUN = [sys.executable, "-m", "specrun"]
START_TIMEOUT_S = 60
# The demo pair under --exact: greedy speculation bit-identical to plain decoding where the CPU's
# kernels allow it (AVX-512; on an AVX2-only CPU answers can part at near-ties, docs/methods.md),
# so answers cannot depend on which requests came before (the cache's prefix, the controllers' state).
DEMO_ARGS = ("--exact",)
# A top-2 gap of log-probabilities below this is a numerical near-tie: even under --exact a
# quantized target's one-token and batched passes round apart on an AVX2-only x86 CPU, by up to
# 0.052 measured (docs/design.md, "Exactness"); SmolLM2's answer to "What is the capital of
# France?" has gaps of 0.064 and 0.009 within 16 tokens, and once parted there in a full run.
NEAR_TIE = 0.1


@dataclass
class Server:
    """A running server: its base URL (…/v1), the process, and the lines it wrote to stderr."""

    url: str
    process: subprocess.Popen
    log: list[str] = field(default_factory=list)

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = re.match(r"http://([^:/]+):(\d+)", self.url).groups()
        return host, int(port)

    def client(self, **options):
        import openai

        options.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=self.url, max_retries=0, timeout=60, **options)

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict]:
        """A raw HTTP request (what the openai client would refuse to send): status and JSON body."""
        host, port = self.host_port
        connection = http.client.HTTPConnection(host, port, timeout=60)
        try:
            connection.request(method, path, body=body, headers=headers or {"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, json.loads(response.read() or b"null")
        finally:
            connection.close()

    def post(self, path: str, payload: dict, **headers: str) -> tuple[int, dict]:
        return self.request("POST", path, json.dumps(payload).encode(),
                            {"Content-Type": "application/json", **headers})

    def healthy(self) -> bool:
        status, body = self.request("GET", "/health")
        return status == 200 and body["status"] == "ok"

    def wait_for_log(self, pattern: str, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = next((line for line in list(self.log) if re.search(pattern, line)), None)
            if found is not None:
                return found
            time.sleep(0.05)
        raise AssertionError(f"the server never logged {pattern!r}; its last lines: {self.log[-5:]}")


def start_server(*args: str, env: dict[str, str] | None = None, max_files: int | None = None) -> Server:
    """`specrun serve ARGS --port 0` started and listening (its stderr kept in ``log``);
    ``max_files``: its descriptor limit, soft and hard (ulimit -n)."""

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max_files, max_files))

    process = subprocess.Popen([*SPECRUN, "serve", "--port", "0", *args], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **(env or {})}, preexec_fn=limit_files if max_files else None)
    log: list[str] = []
    ready = threading.Event()

    def read_stderr() -> None:
        for line in process.stderr:
            log.append(line.rstrip("\n"))
            if "specrun serve:" in line:
                ready.set()
        ready.set()  # the process ended

    threading.Thread(target=read_stderr, daemon=True).start()
    if not ready.wait(START_TIMEOUT_S) or process.poll() is not None:
        process.kill()
        raise AssertionError(f"specrun serve did not start: {log}")
    url = re.search(r"http://\S+/v1", next(line for line in log if "specrun serve:" in line)).group(0)
    return Server(url, process, log)


def stop_server(server: Server) -> int:
    """Ctrl-C, as a user stops it; the exit code."""
    server.process.send_signal(signal.SIGINT)
    try:
        return server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.process.kill()
        raise AssertionError(f"specrun serve ignored Ctrl-C: {server.log}") from None


def specrun_json(*args: str, stdin: str | None = None) -> list[dict]:
    """The JSON objects a `specrun … --json` command prints, one per line."""
    done = subprocess.run([*SPECRUN, *args, "--json"], input=stdin, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]



def assert_refused(server: Server, path: str, body: dict, param: str, code: str) -> None:
    """``body`` is a 400 naming ``param`` with ``code`` in one line, and the server serves on."""
    status, got = server.post(path, body)
    assert status == 400, got
    assert (got["error"]["param"], got["error"]["code"]) == (param, code), got
    assert "\n" not in got["error"]["message"]
    assert server.healthy()


def parts_only_at_a_near_tie(entries, expected: str) -> bool:
    """False where the answer whose logprob ``entries`` (top_logprobs of 2 or more) are given reads
    ``expected``; True where it parts from ``expected`` only at a near-tie: at the first token
    that leaves ``expected``, the token ``expected`` goes on with is among its top_logprobs,
    within NEAR_TIE of it (after that the contexts differ, and so may the rest). Fails otherwise.
    Read in bytes: a character split over two tokens is no whole text in either."""
    want = expected.encode("utf-8")
    got = b"".join(bytes(entry.bytes) for entry in entries)
    if got == want:
        return False
    at = 0
    for index, entry in enumerate(entries):
        piece = bytes(entry.bytes)
        if piece and want.startswith(piece, at):
            at += len(piece)
            continue
        others = [o for o in entry.top_logprobs if bytes(o.bytes) != piece and o.bytes
                  and want.startswith(bytes(o.bytes), at)]
        assert others, f"token {index} {entry.token!r} parts from {want[at:at + 20]!r}, no runner-up of its goes on"
        gap = entry.logprob - max(others, key=lambda o: o.logprob).logprob
        assert gap < NEAR_TIE, f"token {index} {entry.token!r} against {others[0].token!r}: gap {gap:.3f}, no near-tie"
        return True
    raise AssertionError(f"{got!r} stops inside {want!r}: no token parted from it (a near-tie with the end is not told)")



def answered(worker, request) -> tuple[object, str]:
    """``request`` through a started PairWorker as the HTTP layer hands it over: its last event
    (Done or Failed) and the text its Deltas carried."""
    import asyncio

    from specrun.server.worker import Delta, Done, Failed, Job

    async def ask():
        job = Job(request, asyncio.get_running_loop())
        worker.submit(job)
        texts = []
        while not isinstance(event := await job.next_event(), (Done, Failed)):
            if isinstance(event, Delta):
                texts.append(event.text)
        return event, "".join(texts)

    return asyncio.run(ask())
