"""`specrun serve` through the official openai client: the CLI's answers, seeds, stop strings, bad input, auth."""

from __future__ import annotations

import json
import re
import socket
import subprocess

import pytest

from server_harness import DEMO_ARGS, SPECRUN, specrun_json, start_server, stop_server

MODEL = "demo-target"
MAX_TOKENS = 40
MESSAGES = ["Hello there", "def fibonacci(n):", "class Stack:"]
PROMPT = "import os\n\ndef read_config(path):"


def chat(client, message: str, **options):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": message}],
                                          max_tokens=MAX_TOKENS, temperature=0, **options)


def streamed_chat(client, messages: list[dict], **options) -> tuple[str, list]:
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True, **options))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


# ---- the same text as the CLI ---------------------------------------------------------------
def test_chat_completions_equal_specrun_chat(demo_server):
    expected = specrun_json("chat", "--each-line", "-n", str(MAX_TOKENS), *DEMO_ARGS, stdin="\n".join(MESSAGES))
    assert len(expected) == len(MESSAGES)
    client = demo_server.client()
    for message, answer in zip(MESSAGES, expected):
        whole = chat(client, message)
        assert whole.choices[0].message.content == answer["text"]
        assert whole.choices[0].finish_reason == {"eos": "stop", "length": "length"}[answer["finish_reason"]]
        assert whole.usage.prompt_tokens == answer["prompt_tokens"]
        assert whole.usage.completion_tokens == answer["stats"]["new_tokens"]
        speculation = whole.model_extra["speculation"]
        assert speculation["method"] == "auto"
        assert speculation["new_tokens"] == whole.usage.completion_tokens
        assert 0 <= speculation["accepted"] <= speculation["drafted"]

        text, chunks = streamed_chat(client, [{"role": "user", "content": message}], max_tokens=MAX_TOKENS,
                                     temperature=0, stream_options={"include_usage": True})
        assert text == answer["text"]
        assert chunks[0].choices[0].delta.role == "assistant"
        finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert [c.choices[0].finish_reason for c in finish] == [whole.choices[0].finish_reason]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        # Every text chunk says how many tokens it holds and how many of them were drafted.
        per_chunk = [c.model_extra["speculation"] for c in chunks if c.choices and c.choices[0].delta.content]
        assert sum(s["tokens"] for s in per_chunk) == whole.usage.completion_tokens
        assert sum(s["from_draft"] for s in per_chunk) == finish[0].model_extra["speculation"]["accepted"]


@pytest.mark.parametrize("usage", [True, False])
def test_with_include_usage_every_other_chunk_has_a_null_usage(demo_server, usage):
    """OpenAI: with include_usage "all other chunks will also include a usage field, but with a
    null value" (a typed client may require the key); without it no chunk has one."""
    import http.client

    body = {"model": MODEL, "messages": [{"role": "user", "content": MESSAGES[0]}], "max_tokens": 8,
            "temperature": 0, "stream": True, **({"stream_options": {"include_usage": True}} if usage else {})}
    host, port = demo_server.host_port
    connection = http.client.HTTPConnection(host, port, timeout=60)
    try:
        connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        lines = connection.getresponse().read().decode().splitlines()
    finally:
        connection.close()
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert len(chunks) >= 3
    if usage:
        assert all("usage" in chunk and chunk["usage"] is None for chunk in chunks[:-1]), chunks
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    else:
        assert all("usage" not in chunk for chunk in chunks)


def test_completions_equal_specrun_generate(demo_server):
    expected = specrun_json("generate", "-n", str(MAX_TOKENS), *DEMO_ARGS, PROMPT)[0]
    client = demo_server.client()
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert whole.choices[0].text == expected["text"]
    assert whole.usage.completion_tokens == expected["stats"]["new_tokens"]
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected["text"]


def test_a_conversation_reuses_the_cached_prefix_without_changing_answers(demo_server):
    client = demo_server.client()
    first = chat(client, "def parse(line):")
    turn = [{"role": "user", "content": "def parse(line):"},
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "def emit(token):"}]
    following = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=MAX_TOKENS, temperature=0)
    assert following.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    chat(client, "something else entirely")  # the cache now holds another prompt
    again = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=MAX_TOKENS, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens
    assert again.choices[0].message.content == following.choices[0].message.content


def test_models_and_health(demo_server):
    assert [model.id for model in demo_server.client().models.list()] == [MODEL]
    status, body = demo_server.request("GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["method"] == "auto"


# ---- stop strings ---------------------------------------------------------------------------
def test_stop_strings_cut_before_the_first_match(demo_server):
    client = demo_server.client()
    full = chat(client, MESSAGES[1]).choices[0].message.content
    assert len(full) > 12
    early, late = full[4:7], full[9:12]  # two stop strings: the earlier match wins
    cut = full[: min(full.index(early), full.index(late))]
    whole = chat(client, MESSAGES[1], stop=[late, early])
    assert whole.choices[0].message.content == cut
    assert whole.choices[0].finish_reason == "stop"
    text, chunks = streamed_chat(client, [{"role": "user", "content": MESSAGES[1]}], max_tokens=MAX_TOKENS,
                                 temperature=0, stop=[late, early])
    assert text == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    never = chat(client, MESSAGES[1], stop="a stop string the model never writes")
    assert never.choices[0].message.content == full
    # A stop string cut mid-answer leaves the caches exact: the next answer is unchanged.
    assert chat(client, MESSAGES[1]).choices[0].message.content == full


# ---- bad input ----------------------------------------------------------------------------
def _chat_body(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


BAD_REQUESTS = [
    # (path, body, status, param, code)
    ("/v1/chat/completions", b"{not json", 400, None, "invalid_json"),
    ("/v1/chat/completions", b"[1, 2]", 400, None, "invalid_type"),
    ("/v1/chat/completions", _chat_body(messages="hi"), 400, "messages", "invalid_type"),
    ("/v1/chat/completions", _chat_body(messages=[]), 400, "messages", "invalid_value"),
    ("/v1/chat/completions", _chat_body(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role",
     "invalid_value"),
    ("/v1/chat/completions", _chat_body(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content",
     "invalid_type"),
    ("/v1/chat/completions", _chat_body(max_tokens=0), 400, "max_tokens", "invalid_value"),
    ("/v1/chat/completions", _chat_body(max_tokens=2**31), 400, "max_tokens", "invalid_value"),
    ("/v1/chat/completions", _chat_body(max_completion_tokens="many"), 400, "max_completion_tokens",
     "invalid_type"),
    ("/v1/chat/completions", _chat_body(temperature="hot"), 400, "temperature", "invalid_type"),
    ("/v1/chat/completions", _chat_body(temperature=7), 400, "temperature", "invalid_value"),
    ("/v1/chat/completions", _chat_body(top_p=0), 400, "top_p", "invalid_value"),
    ("/v1/chat/completions", _chat_body(seed=2**63), 400, "seed", "invalid_value"),
    ("/v1/chat/completions", _chat_body(stop=[chr(ord("a") + i) for i in range(17)]), 400, "stop", "invalid_value"),
    ("/v1/chat/completions", _chat_body(stream="yes"), 400, "stream", "invalid_type"),
    ("/v1/chat/completions", _chat_body(stream_options={"include_usage": True}), 400, "stream_options",
     "invalid_value"),  # OpenAI's rule: only with stream: true
    ("/v1/chat/completions", _chat_body(stream=True, stream_options={"include_usage": True, "foo": 1}), 400,
     "stream_options", "invalid_value"),
    ("/v1/chat/completions", _chat_body(max_tokens=4, max_completion_tokens=12), 400, "max_completion_tokens",
     "invalid_value"),
    ("/v1/chat/completions", _chat_body(messages=[{"role": "user", "content": "x", "name": 5}]), 400,
     "messages[0].name", "invalid_type"),
    ("/v1/chat/completions", _chat_body(n=0), 400, "n", "invalid_value"),
    ("/v1/chat/completions", _chat_body(n=17), 400, "n", "invalid_value"),
    ("/v1/chat/completions", _chat_body(n="2"), 400, "n", "invalid_type"),
    ("/completion", {"prompt": "x", "n": 2}, 400, "n", "unsupported_value"),  # llama-server's: one answer
    ("/v1/chat/completions", _chat_body(logprobs="yes"), 400, "logprobs", "invalid_type"),
    ("/v1/chat/completions", _chat_body(top_logprobs=3), 400, "top_logprobs", "invalid_value"),
    ("/v1/chat/completions", _chat_body(logprobs=True, top_logprobs=21), 400, "top_logprobs", "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": -1}, 400, "logprobs", "invalid_value"),
    ("/v1/chat/completions", _chat_body(colour="blue"), 400, "colour", "unknown_parameter"),
    ("/v1/chat/completions", _chat_body(model="gpt-4o"), 404, "model", "model_not_found"),
    ("/v1/chat/completions", _chat_body(model=5), 400, "model", "invalid_type"),
    ("/v1/chat/completions", _chat_body(messages=[{"role": "user", "content": "x " * 3000}]), 400, "messages",
     "context_length_exceeded"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", "unsupported_value"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 10**9]}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "x " * 3000}, 400, "prompt", "context_length_exceeded"),
    # more bytes than the context can hold whatever their tokens: refused by size, before tokenizing
    ("/v1/completions", {"model": MODEL, "prompt": "xyzzy " * 9000}, 400, "prompt", "context_length_exceeded"),
    ("/v1/chat/completions", _chat_body(messages=[{"role": "user", "content": "xyzzy " * 9000}]), 400,
     "messages", "context_length_exceeded"),
    # JSON escapes half a surrogate pair alone; no tokenizer takes it (it stopped the worker for good)
    ("/v1/chat/completions", _chat_body(messages=[{"role": "user", "content": "\ud800 lone"}]), 400,
     "messages[0].content", "invalid_value"),
    ("/v1/chat/completions", _chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]),
     400, "messages[0].content[0].text", "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "x\ud800"}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["\ud800"]}, 400, "stop", "invalid_value"),
    # ... and as a field's name, echoed in the error (a 500: the answer's JSON could not be encoded)
    ("/v1/completions", {"model": MODEL, "prompt": "x", "\ud800": 1}, 400, "\ud800", "unknown_parameter"),
    # Python's JSON reads NaN, which every range check lets through
    ("/v1/chat/completions", b'{"model": "demo-target", "messages": [{"role": "user", "content": "x"}], '
     b'"temperature": NaN}', 400, "temperature", "invalid_value"),
    ("/v1/completions", b'{"model": "demo-target", "prompt": "x", "temperature": 1, "top_p": NaN}', 400, "top_p",
     "invalid_value"),
    ("/v1/completions", b'{"model": "demo-target", "prompt": "x", "temperature": 1, "min_p": NaN}', 400, "min_p",
     "invalid_value"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": 10**30}, 400, "top_k", "invalid_value"),
    ("/v1/completions", b'{"model": "demo-target", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", 400, None,
     "invalid_json"),
    ("/v1/completions", b"[" * 30_000 + b"]" * 30_000, 400, None, "invalid_json"),  # under --max-body
]


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), BAD_REQUESTS,
                         ids=[f"{i}-{row[3]}-{row[4]}" for i, row in enumerate(BAD_REQUESTS)])
def test_bad_requests_name_the_field(demo_server, path, body, status, param, code):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    got_status, got = demo_server.request("POST", path, raw)
    assert got_status == status, got
    assert set(got) == {"error"} and {"message", "type", "param", "code"} <= set(got["error"])
    assert (got["error"]["param"], got["error"]["code"]) == (param, code), got
    assert got["error"]["message"]


def test_a_refused_request_is_one_line_in_the_server_s_log(demo_server):
    """An editor's client may show no error body: refusals left no trace where the server runs."""
    demo_server.request("POST", "/v1/chat/completions", json.dumps(_chat_body(colour="blue")).encode())
    demo_server.wait_for_log(re.escape("refused POST /v1/chat/completions: 400 (colour) unrecognized request "
                                       "argument supplied: colour"))
    demo_server.request("POST", "/v1/assistants", b"{}")
    demo_server.wait_for_log("refused POST /v1/assistants: 404")


def test_the_server_keeps_serving_after_bad_requests(demo_server):
    for path, body, *_ in BAD_REQUESTS[:4] + BAD_REQUESTS[-10:]:
        demo_server.request("POST", path, body if isinstance(body, bytes) else json.dumps(body).encode())
    assert demo_server.healthy()
    assert chat(demo_server.client(), MESSAGES[0]).choices[0].message.content


def test_unknown_routes_and_methods_get_error_objects(demo_server):
    status, body = demo_server.request("GET", "/v1/embeddings")
    assert status == 404 and body["error"]["code"] == "not_found"
    status, body = demo_server.request("GET", "/v1/chat/completions")
    assert status == 405 and body["error"]["message"] and body["error"]["code"] == "method_not_allowed"
    import http.client

    connection = http.client.HTTPConnection(*demo_server.host_port, timeout=30)
    try:
        connection.request("GET", "/v1/completions")
        assert connection.getresponse().getheader("Allow") == "POST"
    finally:
        connection.close()


def test_a_model_is_retrieved_by_its_id_as_the_openai_client_asks(demo_server):
    import openai

    client = demo_server.client()
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_a_compressed_body_is_a_415_not_a_json_error(demo_server):
    import gzip

    body = gzip.compress(json.dumps(_chat_body()).encode())
    status, got = demo_server.request("POST", "/v1/chat/completions", body,
                                      {"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert status == 415 and got["error"]["code"] == "unsupported_media_type", got
    assert demo_server.healthy()


def _raw_exchange(server, head: bytes, body_parts: list[bytes]) -> bytes:
    """Send a request's head and some body, then read what the server answers (never the rest).
    The server closes with the body's rest unread, so the kernel may end the connection with a
    reset once the answer is sent: what arrived before it is the answer."""
    with socket.create_connection(server.host_port, timeout=10) as sock:
        answer = b""
        try:
            sock.sendall(head)
            for part in body_parts:
                sock.sendall(part)
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
    return answer


def test_a_client_that_leaves_mid_body_is_one_log_line_not_a_traceback(demo_server):
    """Content-Length promises 100 bytes, 2 come, and the client closes: Starlette's
    ClientDisconnect was an "Exception in ASGI application" with a 40-line traceback in the log."""
    import time

    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{}")
    for closing in ("close", "shutdown"):
        with socket.create_connection(demo_server.host_port, timeout=10) as sock:
            sock.sendall(head)
            time.sleep(0.3)
            if closing == "shutdown":
                sock.shutdown(socket.SHUT_WR)
    demo_server.wait_for_log("a client left before sending its whole request; dropped")
    assert demo_server.healthy()
    assert not any("Traceback" in line or "Exception in ASGI" in line for line in demo_server.log), demo_server.log[-20:]


def test_a_body_over_the_limit_is_refused_before_it_is_read(demo_server):
    # Content-Length says 100 MB; 1 KB is sent and the server answers without waiting for the rest.
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000000\r\n\r\n")
    answer = _raw_exchange(demo_server, head, [b" " * 1024])
    assert answer.startswith(b"HTTP/1.1 413")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_too_large"
    # Chunked, with no length given: refused once the chunks pass the limit (64 KiB here) and the
    # client sends no more for a while (DRAIN_IDLE_S: one sending on is read to the end first).
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n%s\r\n" % (16384, b" " * 16384)
    answer = _raw_exchange(demo_server, head, [chunk] * 5)
    assert answer.startswith(b"HTTP/1.1 413")
    assert demo_server.healthy()


def test_a_client_that_sends_its_whole_body_first_reads_the_413(demo_server):
    """Python's http.client (as httpx and the openai SDK) sends all of a 5 MiB body before reading,
    with its length or chunked: the server reads and drops it, then answers 413 (answered before it,
    the client met a reset)."""
    import http.client

    host, port = demo_server.host_port
    connection = http.client.HTTPConnection(host, port, timeout=60)
    try:
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * (5 << 20)}]})
        connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 413
        assert json.loads(response.read())["error"]["code"] == "request_too_large"
    finally:
        connection.close()
    # the same body chunked (no length given): read on past the limit, dropped, then the 413
    connection = http.client.HTTPConnection(host, port, timeout=60)
    try:
        pieces = (body[i : i + (1 << 16)].encode() for i in range(0, len(body), 1 << 16))
        connection.request("POST", "/v1/chat/completions", pieces, {"Content-Type": "application/json"},
                           encode_chunked=True)
        response = connection.getresponse()
        assert response.status == 413
        assert json.loads(response.read())["error"]["code"] == "request_too_large"
    finally:
        connection.close()
    assert demo_server.healthy()


# ---- seeds and auth: a fixed draft length (seeds repeat a text only there; README) ---------------
KEY = "test-key-123"


@pytest.fixture(scope="module")
def keyed_server():
    server = start_server(*DEMO_ARGS, "--method", "draft", "--draft-len", "4", "--api-key", KEY)
    yield server
    assert stop_server(server) == 0, server.log


def test_health_behind_an_api_key_says_nothing_of_the_model(keyed_server):
    """/health stays open (a load balancer's probe has no key), so it names no model file."""
    status, body = keyed_server.request("GET", "/health")
    assert status == 200 and body["status"] == "ok" and "model" not in body and "method" not in body


def test_requests_without_the_api_key_get_401(keyed_server):
    import openai

    with pytest.raises(openai.AuthenticationError) as refused:
        keyed_server.client(api_key="wrong").models.list()
    assert refused.value.status_code == 401
    status, body = keyed_server.post("/v1/completions", {"model": MODEL, "prompt": "x"})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert keyed_server.healthy()  # /health is open: a load balancer's probe carries no key
    assert [model.id for model in keyed_server.client(api_key=KEY).models.list()] == [MODEL]


def test_seeded_sampling_repeats_and_matches_specrun_generate(keyed_server):
    client = keyed_server.client(api_key=KEY)
    options = dict(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0.9)

    def sampled(seed: int) -> str:
        return client.completions.create(seed=seed, **options).choices[0].text

    first = sampled(7)
    assert sampled(8) != first  # the seed is used
    assert sampled(7) == first
    cli = specrun_json("generate", "-n", "32", "--temp", "0.9", "--seed", "7", "--method", "draft",
                       "--draft-len", "4", *DEMO_ARGS, PROMPT)[0]
    assert cli["text"] == first
    messages = [{"role": "user", "content": MESSAGES[2]}]
    chats = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0.9,
                                            seed=3).choices[0].message.content for _ in range(2)]
    assert chats[0] == chats[1]


# ---- lossy acceptance: every answer says so -------------------------------------------------------
def test_a_lossy_server_says_so_in_every_answer_and_the_default_never_does(demo_server):
    assert chat(demo_server.client(), MESSAGES[1]).model_extra["speculation"]["acceptance"] == "exact"
    server = start_server("--method", "draft", "--draft-len", "4", "--accept", "typical")
    try:
        client = server.client()
        whole = chat(client, MESSAGES[1])
        assert whole.model_extra["speculation"]["acceptance"] == "typical (lossy)"
        assert whole.model_extra["speculation"]["drafted"] > 0
        streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.8,
                                             seed=1, stream=True)
        finals = [c.model_extra["speculation"] for c in streamed if c.choices and c.choices[0].finish_reason]
        assert [final["acceptance"] for final in finals] == ["typical (lossy)"]
    finally:
        assert stop_server(server) == 0, server.log


# ---- the command line ----------------------------------------------------------------------------
def test_a_public_host_without_api_key_warns():
    # A model that does not exist: the server stops before it ever listens.
    args = [*SPECRUN, "serve", "--host", "0.0.0.0", "--port", "0", "--target", "/nonexistent/model.gguf"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1
    assert "warning: --host 0.0.0.0" in done.stderr and "--api-key" in done.stderr
    done = subprocess.run([*args, "--api-key", KEY], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1
    assert "warning" not in done.stderr and "error:" in done.stderr


def test_an_api_key_no_client_can_send_is_refused():
    """HTTP headers carry ASCII: a UTF-8 client could never match a key with "é" in it (401), while
    the same key's Latin-1 bytes were let in."""
    done = subprocess.run([*SPECRUN, "serve", "--port", "0", "--api-key", "clé-secrète"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --api-key") and "printable ASCII" in lines[0]


def test_a_port_in_use_is_a_one_line_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        done = subprocess.run([*SPECRUN, "serve", "--port", port], capture_output=True, text=True, timeout=60,
                              check=False)
    assert done.returncode == 1  # the machine's state, not a usage error (rpc-server's too)
    assert done.stderr.startswith(f"error: cannot listen on 127.0.0.1:{port}") and "--port" in done.stderr


def test_a_host_that_cannot_be_bound_is_one_line_without_the_public_host_warning():
    """The warning about a public host came first, then the error: two lines for one problem."""
    done = subprocess.run([*SPECRUN, "serve", "--host", "999.1.1.1"], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 2
    assert done.stderr.startswith("error: cannot listen on 999.1.1.1:") and len(done.stderr.splitlines()) == 1


def test_a_host_of_another_machine_is_a_usage_error_naming_the_host():
    done = subprocess.run([*SPECRUN, "serve", "--host", "8.8.8.8", "--port", "0"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot listen on 8.8.8.8:0: 8.8.8.8 is not an address of "
                                                   "this machine; pass 127.0.0.1"), done.stderr


@pytest.mark.parametrize("host", ["bad..x", "a" * 70 + ".example"])
def test_a_host_name_no_resolver_takes_is_a_usage_error(host):
    """A name with an empty label, or one of more than 63 characters, was an internal error
    (UnicodeError from the idna codec) before anything was served."""
    done = subprocess.run([*SPECRUN, "serve", "--host", host], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: --host {host!r} is not a valid host name") and len(done.stderr.splitlines()) == 1


def test_max_tokens_past_the_context_is_taken_and_the_context_ends_the_answer():
    """Editors send max_tokens 4096 or 8192 whatever the model: taken (up to int32), the answer
    stops where the context is full, finish_reason "length"; the context's size is in /v1/models."""
    from server_harness import start_server, stop_server

    server = start_server(*DEMO_ARGS, "--ctx", "128", "--method", "none")
    try:
        status, body = server.post("/v1/chat/completions", _chat_body(max_tokens=8192, temperature=0))
        assert status == 200, body
        usage = body["usage"]
        assert body["choices"][0]["finish_reason"] == "length"
        assert usage["prompt_tokens"] + usage["completion_tokens"] <= 128 < usage["prompt_tokens"] + 8192
        assert usage["completion_tokens"] > 64
        status, models = server.request("GET", "/v1/models")
        assert status == 200 and models["data"][0]["meta"]["n_ctx"] == 128 == models["data"][0]["max_model_len"]
    finally:
        assert stop_server(server) == 0, server.log


def test_a_range_refused_names_its_integer_ends_whole():
    """max_tokens past 2**31 - 1: the range as written (it read "[1, 2.14748e+09]")."""
    from specrun.server.requests import MAX_ANSWER_TOKENS, RequestError, _check_range

    with pytest.raises(RequestError, match=r"must be in \[1, 2147483647\], got 2147483648"):
        _check_range("max_tokens", 2**31, 1, MAX_ANSWER_TOKENS)
    with pytest.raises(RequestError, match=r"must be in \(0, 1\], got 1.5"):
        _check_range("top_p", 1.5, 0.0, 1.0, low_open=True)


def test_fields_clients_send_that_change_nothing_are_taken():
    """Refused as unknown or out of range (agent frameworks' and llama-server UIs' requests): a
    seed of -1 ("random" to llama-server; OpenAI's seed is signed), prompt_cache_key and
    safety_identifier (OpenAI's, no effect on the answer), cache_prompt (llama-server's: specrun
    keeps the cache always), stream_options.include_obfuscation."""
    from specrun.sampling import MAX_SEED
    from specrun.server.requests import RequestError, ServeDefaults, parse_chat_request

    def parsed(**fields):
        return parse_chat_request(_chat_body(**fields), ServeDefaults(), 256)

    assert parsed(seed=-1).sampling.seed is None
    assert parsed(seed=-5).sampling.seed == MAX_SEED - 4 and parsed(seed=7).sampling.seed == 7
    assert parsed(prompt_cache_key="k", safety_identifier="u1", cache_prompt=True).max_tokens > 0
    assert parsed(stream=True, stream_options={"include_usage": True, "include_obfuscation": False}).include_usage
    with pytest.raises(RequestError) as refused:
        parsed(stream=True, stream_options={"include_obfuscation": "no"})
    assert refused.value.param == "stream_options"


def test_an_alias_is_a_model_name_clients_may_send_and_the_one_listed():
    """Clients that remember one model name (gpt-4o) were a 404 unless they sent --target's."""
    server = start_server(*DEMO_ARGS, "--method", "none", "--alias", "gpt-4o", "--alias", "local")
    try:
        assert any("specrun serve: demo-target (model gpt-4o, local too)" in line for line in server.log), server.log
        client = server.client()
        assert [model.id for model in client.models.list().data] == ["gpt-4o"]
        for name in ("gpt-4o", "local", "demo-target"):
            answer = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=2)
            assert answer.model == name and answer.choices[0].finish_reason  # the name asked, echoed
    finally:
        assert stop_server(server) == 0, server.log


@pytest.mark.parametrize(("option", "value"), [
    ("--alias", ""), ("--alias", " gpt"), ("--alias", "a\tb"),  # no name a client could send
    ("--cors", "localhost:3000"), ("--cors", "http://localhost:3000/chat"), ("--cors", ""),  # no origin a browser sends
])
def test_an_alias_or_origin_no_client_sends_is_a_usage_error(option, value):
    done = subprocess.run([*SPECRUN, "serve", "--port", "0", option, value], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 2 and done.stderr.startswith(f"error: {option}") and len(done.stderr.splitlines()) == 1


def test_an_assistant_turn_as_openai_answers_carry_it_back_is_taken():
    """An assistant's content [] beside its tool_calls, or holding a refusal part: both were 400s."""
    from specrun.server.requests import RequestError, ServeDefaults, parse_chat_request

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [], "tool_calls": [call]},
             {"role": "tool", "content": "21", "tool_call_id": "c1"},
             {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
             {"role": "user", "content": "why?"}]
    messages = parse_chat_request(_chat_body(messages=turns), ServeDefaults(), 256).messages
    assert messages[1]["content"] == "" and messages[3]["content"] == "I cannot."
    for content in ([], [{"type": "refusal", "refusal": "no"}]):  # a user's is text
        with pytest.raises(RequestError) as refused:
            parse_chat_request(_chat_body(messages=[{"role": "user", "content": content}]), ServeDefaults(), 256)
        assert refused.value.param.startswith("messages[0].content")


def _headers_of(server, method: str, path: str, headers: dict[str, str], body: bytes | None = None):
    import http.client

    connection = http.client.HTTPConnection(*server.host_port, timeout=60)
    try:
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        response.read()
        return response.status, {key.lower(): value for key, value in response.getheaders()}
    finally:
        connection.close()


def test_cors_lets_a_browser_page_of_the_origins_given_call_the_server(demo_server):
    """A browser chat page's preflight was a 405 and no answer carried Access-Control-Allow-Origin."""
    page = "http://localhost:3000"
    preflight = {"Origin": page, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    status, _ = _headers_of(demo_server, "OPTIONS", "/v1/chat/completions", preflight)
    assert status == 405  # none without --cors
    server = start_server(*DEMO_ARGS, "--method", "none", "--cors", page, "--api-key", KEY)
    try:
        status, headers = _headers_of(server, "OPTIONS", "/v1/chat/completions", preflight)
        assert status == 200 and headers["access-control-allow-origin"] == page
        assert "authorization" in headers["access-control-allow-headers"].lower()
        body = json.dumps(_chat_body(max_tokens=2)).encode()
        status, headers = _headers_of(server, "POST", "/v1/chat/completions", {
            "Origin": page, "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}, body)
        assert status == 200 and headers["access-control-allow-origin"] == page
        status, headers = _headers_of(server, "OPTIONS", "/v1/chat/completions", {**preflight,
                                                                                  "Origin": "http://evil.example"})
        assert status == 400 and "access-control-allow-origin" not in headers
        # a hosted page calling 127.0.0.1 asks leave to reach a private network (Chromium): a 400 was all it got
        status, headers = _headers_of(server, "OPTIONS", "/v1/chat/completions", {
            **preflight, "Access-Control-Request-Private-Network": "true"})
        assert status == 200 and headers["access-control-allow-private-network"] == "true"
        assert not any(line.startswith("warning: --cors") for line in server.log)
    finally:
        assert stop_server(server) == 0, server.log


@pytest.mark.parametrize(("origin", "status"), [
    ("http://evil.example", 403), ("null", 403), ("https://localhost:5173", 200), ("http://127.0.0.1:3000", 200),
    ("http://[::1]:8000", 200), ("vscode-webview://abc123", 200)])
def test_a_web_page_of_an_origin_not_named_cannot_run_generations(demo_server, origin, status):
    """A page may POST text/plain to any server without a preflight: every page a user opened could
    run generations on a server with no key (its answers unread, the machine's time spent)."""
    body = json.dumps(_chat_body(max_tokens=1)).encode()
    got, answer = demo_server.request("POST", "/v1/chat/completions", body,
                                      headers={"Origin": origin, "Content-Type": "text/plain"})
    assert got == status, answer
    if status == 403:
        assert answer["error"]["code"] == "origin_not_allowed" and f"--cors {origin}" in answer["error"]["message"]


def test_cors_for_every_page_without_a_key_is_warned_of():
    server = start_server(*DEMO_ARGS, "--method", "none", "--cors", "*")
    try:
        assert any(line.startswith("warning: --cors * lets every web page") for line in server.log), server.log
    finally:
        assert stop_server(server) == 0, server.log
