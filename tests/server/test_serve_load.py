"""`specrun serve` under load: concurrent clients get exactly their sequential answers, and a client
killed mid-stream neither stalls nor changes anyone else's."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from server_harness import DEMO_ARGS, Server, start_server, stop_server

MODEL = "demo-target"
CLIENTS = 16
REQUESTS_PER_CLIENT = 4
MAX_TOKENS = 16
LOAD_TIMEOUT_S = 90  # the whole concurrent phase; each request also has the client's own timeout
SHARED_SYSTEM = "You write short Python functions."


def messages_for(client: int, request: int) -> list[dict]:
    """Each request its own prompt; half the clients share a system prompt, so cached prefixes
    are reused across clients as well as broken by them."""
    user = {"role": "user", "content": f"def handler_{client}_{request}(event, retries={request}):"}
    return [{"role": "system", "content": SHARED_SYSTEM}, user] if client % 2 else [user]


def answer(server: Server, messages: list[dict], stream: bool, max_tokens: int = MAX_TOKENS) -> tuple[str, str]:
    """(text, finish_reason) of one chat completion at temperature 0."""
    client = server.client()
    options = dict(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    if not stream:
        choice = client.chat.completions.create(**options).choices[0]
        return choice.message.content, choice.finish_reason
    chunks = [c for c in client.chat.completions.create(stream=True, **options) if c.choices]
    return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason


def test_concurrent_clients_get_their_sequential_answers(demo_server):
    keys = [(client, request) for client in range(CLIENTS) for request in range(REQUESTS_PER_CLIENT)]
    sequential = {key: answer(demo_server, messages_for(*key), stream=False) for key in keys}
    served_before = demo_server.request("GET", "/health")[1]["served"]

    def one_client(client: int) -> dict:
        # Streamed and whole answers alternate: both must match the sequential (whole) answer.
        return {(client, request): answer(demo_server, messages_for(client, request), stream=request % 2 == 1)
                for request in range(REQUESTS_PER_CLIENT)}

    started = time.monotonic()
    with ThreadPoolExecutor(CLIENTS) as pool:
        futures = [pool.submit(one_client, client) for client in range(CLIENTS)]
        concurrent = {}
        for future in futures:
            concurrent.update(future.result(timeout=max(1.0, LOAD_TIMEOUT_S - (time.monotonic() - started))))

    assert len(concurrent) == CLIENTS * REQUESTS_PER_CLIENT  # none lost
    assert all(text for text, _ in concurrent.values())
    assert concurrent == sequential
    status, health = demo_server.request("GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["queued"] == 0
    assert health["served"] == served_before + CLIENTS * REQUESTS_PER_CLIENT


VICTIM = """
import sys, openai
client = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0)
stream = client.chat.completions.create(model="demo-target", max_tokens=1500, temperature=0, stream=True,
                                        messages=[{"role": "user", "content": "class Parser:"}])
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print("streaming", flush=True)
"""


def test_a_client_killed_mid_stream_disturbs_no_one(demo_server):
    victim_messages = [{"role": "user", "content": "class Parser:"}]
    others = [messages_for(client, 0) for client in range(4)]
    expected = [answer(demo_server, messages, stream=False) for messages in others]
    victim_start = answer(demo_server, victim_messages, stream=False)

    victim = subprocess.Popen([sys.executable, "-c", VICTIM, demo_server.url], stdout=subprocess.PIPE, text=True)
    try:
        first = victim.stdout.readline()  # its answer is streaming: the pair is busy with it
        assert first.strip() == "streaming"
        with ThreadPoolExecutor(len(others)) as pool:
            # The others queue behind the victim, which dies while they wait.
            futures = [pool.submit(answer, demo_server, messages, index % 2 == 1)
                       for index, messages in enumerate(others)]
            time.sleep(0.2)
            victim.kill()
            results = [future.result(timeout=60) for future in futures]
    finally:
        victim.kill()
        victim.wait()
    assert results == expected
    # The server noticed and stopped the victim's generation early (1500 tokens were asked for),
    # and counted it (/metrics: requests by finish reason).
    demo_server.wait_for_log("the client left")
    assert demo_server.healthy()
    from test_serve_parallel import metric_values

    assert metric_values(demo_server).get('specrun_requests_total{finish_reason="cancelled"}', 0) >= 1
    # The caches were left exact: the victim's prompt still gets its answer.
    assert answer(demo_server, victim_messages, stream=True) == victim_start


def test_a_client_gone_while_queued_is_dropped_unserved():
    """A whole (not streamed) request whose client leaves while it waits in the queue is never run
    (one slot, so that it waits behind the victim)."""
    demo_server = start_server(*DEMO_ARGS, "--parallel", "1")
    try:
        _gone_while_queued(demo_server)
    finally:
        assert stop_server(demo_server) == 0, demo_server.log


def _gone_while_queued(demo_server) -> None:
    served_before = demo_server.request("GET", "/health")[1]["served"]
    victim = subprocess.Popen([sys.executable, "-c", VICTIM, demo_server.url], stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout.readline().strip() == "streaming"
        waiting = subprocess.Popen([sys.executable, "-c", QUEUED, demo_server.url])
        deadline = time.monotonic() + 30
        while demo_server.request("GET", "/health")[1]["queued"] == 0:  # until it waits behind the victim
            assert time.monotonic() < deadline and waiting.poll() is None
            time.sleep(0.05)
        waiting.kill()
        waiting.wait()
        time.sleep(0.5)  # the server polls a waiting client's connection every 0.25 s
        victim.kill()
    finally:
        victim.kill()
        victim.wait()
    demo_server.wait_for_log("the client left while queued")
    assert demo_server.healthy()
    assert demo_server.request("GET", "/health")[1]["served"] == served_before


QUEUED = """
import sys, openai
client = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0)
client.chat.completions.create(model="demo-target", max_tokens=1500, temperature=0,
                               messages=[{"role": "user", "content": "class Lexer:"}])
"""



def test_a_whole_answer_stops_when_its_client_leaves(demo_server):
    """Not streamed: the answer's text reaches the request at every pass, and the check for a
    gone client used to wait for a quiet moment that never came (all 1500 tokens were made)."""
    import socket

    def stopped() -> int:
        return sum("the client left; stopped" in line for line in list(demo_server.log))

    before = stopped()
    body = json.dumps({"model": MODEL, "max_tokens": 1500, "temperature": 0,
                       "messages": [{"role": "user", "content": "class Tokenizer:"}]}).encode()
    host, port = demo_server.host_port
    with socket.create_connection((host, port), timeout=30) as client:
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.5)  # generating: 1500 tokens take seconds here
    deadline = time.monotonic() + 10
    while stopped() == before:
        assert time.monotonic() < deadline, demo_server.log[-5:]
        time.sleep(0.05)
    assert demo_server.healthy()


def test_a_megabyte_stop_string_holds_up_no_one():
    """A hostile stop string (1 MB, under the default 4 MiB body limit) costs its request time
    linear in the text generated: a second client's request, sent meanwhile, is answered as
    promptly."""
    from server_harness import DEMO_ARGS, start_server, stop_server

    server = start_server(*DEMO_ARGS)
    try:
        hostile = {"model": MODEL, "max_tokens": 64, "temperature": 0, "stop": ["x" * (1 << 20), "y" * (1 << 20)],
                   "messages": [{"role": "user", "content": "def parse(line):"}]}
        with ThreadPoolExecutor(2) as pool:
            started = time.monotonic()
            first = pool.submit(server.post, "/v1/chat/completions", hostile)
            second = pool.submit(answer, server, messages_for(0, 0), False)
            status, body = first.result(timeout=60)
            text, _ = second.result(timeout=60)
        assert status == 200 and body["choices"][0]["message"]["content"], body
        assert text
        assert time.monotonic() - started < 30  # both answered; the stop strings once held the worker 48 s
    finally:
        assert stop_server(server) == 0, server.log


def test_idle_connections_past_the_cap_get_a_json_503_and_the_server_recovers():
    """600 sockets that sent nothing under ulimit -n 512 exhausted the descriptors: ~264,000
    tracebacks, and a real request timed out. Now a connection past the cap (the limit less
    FD_RESERVE) is answered 503 at once and closed, idle ones close after the keep-alive timeout,
    and the server answers again; its log says so once, with no traceback."""
    import socket

    from server_harness import DEMO_ARGS, start_server, stop_server
    from specrun.server.connections import FD_RESERVE

    max_files = 160
    server = start_server(*DEMO_ARGS, max_files=max_files)
    host, port = server.host_port
    idle = []
    try:
        for _ in range(max_files + 40):
            idle.append(socket.create_connection((host, port), timeout=10))
        refused = idle[max_files - FD_RESERVE + 8:]  # past the cap, with room for the accept order
        for sock in refused[:10]:
            reply = sock.recv(4096)
            assert reply.startswith(b"HTTP/1.1 503") and b'"code": "too_many_connections"' in reply, reply
        for sock in idle:
            sock.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if server.healthy():
                    break
            except (OSError, json.JSONDecodeError):
                pass
            time.sleep(0.2)
        assert server.healthy()
        assert answer(server, messages_for(0, 0), stream=False)[1] in ("stop", "length")
    finally:
        for sock in idle:
            sock.close()
        assert stop_server(server) == 0, server.log[-5:]
    assert not any("Traceback" in line for line in server.log), server.log[-10:]
    assert sum("refusing more with 503" in line for line in server.log) == 1, server.log


def test_a_connection_that_sends_nothing_is_closed(demo_server):
    """Idle before its first request, as between requests: closed after the keep-alive timeout."""
    import socket

    host, port = demo_server.host_port
    with socket.create_connection((host, port), timeout=30) as sock:
        started = time.monotonic()
        assert sock.recv(1) == b""  # the server closed it
        assert time.monotonic() - started < 20
