"""`specrun serve --parallel N`: requests decoded together, each in a slot sharing every pass, get
the answers they get one at a time (greedy, and sampled with a seed at a fixed draft length), and
a failing or departing request leaves the others' intact."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_harness import DEMO_ARGS, start_server, stop_server
from test_serve_load import MODEL, answer, messages_for

SLOTS = 4


@pytest.fixture(scope="module")
def parallel_server():
    server = start_server(*DEMO_ARGS, "--parallel", str(SLOTS))
    yield server
    assert stop_server(server) == 0, server.log


@pytest.fixture(scope="module")
def one_at_a_time_server():
    server = start_server(*DEMO_ARGS, "--parallel", "1")
    yield server
    assert stop_server(server) == 0, server.log


def test_requests_decoded_together_get_their_one_at_a_time_answers(one_at_a_time_server, parallel_server):
    keys = [(client, request) for client in range(2 * SLOTS) for request in range(2)]
    sequential = {key: answer(one_at_a_time_server, messages_for(*key), stream=False) for key in keys}
    before = parallel_server.request("GET", "/health")[1]["served"]
    with ThreadPoolExecutor(2 * SLOTS) as pool:
        together = dict(zip(keys, pool.map(lambda key: answer(parallel_server, messages_for(*key),
                                                              stream=key[1] == 1), keys)))
    assert together == sequential
    assert parallel_server.request("GET", "/health")[1]["served"] == before + len(keys)
    metrics = metric_values(parallel_server)
    # the passes were shared: more sequences than passes
    assert metrics['specrun_batch_sequences_total{model="target"}'] > 1.5 * metrics['specrun_batches_total{model="target"}']
    # the draft lengths the slots' batch chose, by how many decoded together, and why (control/batch.py)
    from specrun.control.costs import SHARED_MARGIN

    chosen = {key: value for key, value in metrics.items() if key.startswith("specrun_batch_draft_lengths_total{")}
    gains = {key: value for key, value in metrics.items() if key.startswith("specrun_batch_draft_gain{")}
    # plain batching (1), or a length chosen for beating it by the shared pass's margin
    assert sum(chosen.values()) > 0 and gains, (chosen, gains)
    assert all(value == 1.0 or value >= 1.0 + SHARED_MARGIN - 1e-4 for value in gains.values()), gains
    assert {re.search(r'sequences="(\d+)"', key)[1] for key in gains} <= {
        re.search(r'sequences="(\d+)"', key)[1] for key in chosen}
    # what the batch measured, where a stretch of it was kept (control/batch.Realised), by slots generating
    realised = {key: value for key, value in metrics.items() if key.startswith("specrun_batch_realised_tokens_per_second{")}
    held = {key: value for key, value in metrics.items() if key.startswith("specrun_batch_held_plain{")}
    assert all(value > 0 for value in realised.values()) and all(value in (0.0, 1.0) for value in held.values())
    assert all(2 <= int(re.search(r'slots="(\d+)"', key)[1]) <= SLOTS for key in (*realised, *held)), (realised, held)


def test_auto_is_the_default_and_decodes_several_together_as_memory_allows(demo_server, one_at_a_time_server):
    """The demo pair's caches are small beside this machine's memory: without --parallel (auto), 4
    slots, said in the log; --parallel 1 answers one at a time."""
    from specrun.sessions.slots import DEFAULT_SLOTS

    assert metric_values(demo_server)["specrun_slots"] == DEFAULT_SLOTS
    assert any(f"up to {DEFAULT_SLOTS} requests are decoded together" in line for line in demo_server.log)
    assert metric_values(one_at_a_time_server)["specrun_slots"] == 1


def test_parallel_auto_answers_one_at_a_time_where_slots_would_draft_with_less():
    server = start_server(*DEMO_ARGS, "--parallel", "auto", "--method", "lookup+lookahead")
    try:
        assert metric_values(server)["specrun_slots"] == 1
        assert any("one at a time: slots would draft without lookahead" in line for line in server.log)
        assert server.client().completions.create(model=MODEL, prompt="def f(x):", max_tokens=4,
                                                  temperature=0).choices[0].text
    finally:
        assert stop_server(server) == 0, server.log


def test_trees_are_verified_on_slots_sharing_each_pass():
    """`--branches 2` with `--parallel 2` (no --exact: a unified cache, where a tree's paths are
    sequences beside the slots'): the slots draft trees (no note saying they leave them out), and
    each answer decoded together is the one-at-a-time server's, or parts from it only where the
    lone answer's top two tokens are a near tie (an F32 cache, flash attention off: a shared pass
    rounds apart from a lone one by ~1e-4; client 0's second token is a 0.002 tie)."""
    from server_harness import parts_only_at_a_near_tie

    args = ("--method", "draft", "-k", "3", "--branches", "2", "--kv-type", "f32", "--flash-attn", "off")
    lone = start_server(*args, "--parallel", "1")
    server = start_server(*args, "--parallel", "2")
    try:
        keys = [(client, 0) for client in range(4)]
        alone = {key: answer(lone, messages_for(*key), stream=False, max_tokens=16)[0] for key in keys}

        def ask(key):
            return server.client().chat.completions.create(
                model=MODEL, messages=messages_for(*key), max_tokens=16, temperature=0, logprobs=True,
                top_logprobs=2).choices[0].logprobs.content

        with ThreadPoolExecutor(4) as pool:
            together = dict(zip(keys, pool.map(ask, keys)))
        for key in keys:
            parts_only_at_a_near_tie(together[key], alone[key])  # equal, or parted at a near tie
        assert not any("without token trees" in line for line in server.log), server.log
        metrics = metric_values(server)
        assert metrics["specrun_slots"] == 2 and metrics["specrun_drafted_tokens_total"] > 0
    finally:
        assert stop_server(server) == 0, server.log
        assert stop_server(lone) == 0, lone.log


def test_eagle3_heads_draft_on_slots_reading_the_layers_they_read():
    """demo-target's EAGLE-3 heads (found first for --method eagle) read three layers' outputs:
    the slots' context copies them out for every row fed, so auto opens slots for them, every
    slot drafts with them, and the answers decoded together are the one-at-a-time server's."""
    from specrun.sessions.slots import DEFAULT_SLOTS

    server = start_server(*DEMO_ARGS, "--parallel", "auto", "--method", "eagle", "-k", "3")
    lone = start_server(*DEMO_ARGS, "--parallel", "1", "--method", "eagle", "-k", "3")
    try:
        assert metric_values(server)["specrun_slots"] == DEFAULT_SLOTS
        keys = [(client, 0) for client in range(DEFAULT_SLOTS)]
        alone = {key: answer(lone, messages_for(*key), stream=False) for key in keys}
        with ThreadPoolExecutor(DEFAULT_SLOTS) as pool:
            together = dict(zip(keys, pool.map(lambda key: answer(server, messages_for(*key), stream=False), keys)))
        assert together == alone
        metrics = metric_values(server)
        assert metrics["specrun_drafted_tokens_total"] > 0, metrics
        assert metrics['specrun_batch_sequences_total{model="target"}'] > metrics['specrun_batches_total{model="target"}']
    finally:
        assert stop_server(server) == 0, server.log
        assert stop_server(lone) == 0, lone.log


def test_a_conversation_s_next_turn_returns_to_the_slot_that_holds_it(parallel_server):
    """Four conversations open at once, one a slot; their second turns, one at a time in another
    order, each find the slot holding their first (idle slots are chosen by the prompt they hold,
    not by which was idle longest): the whole first turn comes from the cache."""
    client = parallel_server.client()
    openings = [f"Conversation {name}: " + " ".join(f"{name.lower()}{i} = load({i})" for i in range(12))
                for name in ("Alpha", "Bravo", "Charlie", "Delta")]

    def first_turn(opening: str):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": opening}],
                                              max_tokens=8, temperature=0)

    with ThreadPoolExecutor(SLOTS) as pool:
        firsts = list(pool.map(first_turn, openings))
    cached_before = metric_values(parallel_server)["specrun_prompt_tokens_cached_total"]
    for index in (2, 0, 3, 1):
        messages = [{"role": "user", "content": openings[index]},
                    {"role": "assistant", "content": firsts[index].choices[0].message.content},
                    {"role": "user", "content": "and then?"}]
        usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0).usage
        assert usage.prompt_tokens_details.cached_tokens >= firsts[index].usage.prompt_tokens, (index, usage)
    cached = metric_values(parallel_server)["specrun_prompt_tokens_cached_total"] - cached_before
    assert cached >= sum(first.usage.prompt_tokens for first in firsts)


def test_sampled_answers_decoded_together_follow_the_target_s_distribution(parallel_server):
    """Three tokens at temperature 1, top-k 2, from eight clients at once on four slots (the draft
    model's chains verified by rejection sampling beside other slots' passes): the texts' frequencies
    against the target's exact distribution over its 8 continuations, by chi-square."""
    from collections import Counter

    from tests.lossless_harness import ALPHA, chi_square_p

    expected = top2_continuations(PROMPT, 3)
    client = parallel_server.client()

    def sampled(_: int) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=1.0,
                                         extra_body={"top_k": 2}).choices[0].text

    with ThreadPoolExecutor(2 * SLOTS) as pool:
        counts = Counter(pool.map(sampled, range(SAMPLES)))
    assert set(counts) <= set(expected), set(counts) - set(expected)
    assert chi_square_p(counts, expected, SAMPLES) > ALPHA, (counts, expected)


PROMPT = "def load(path):\n    with open(path) as"
SAMPLES = 480


def top2_continuations(prompt: str, length: int, target=None) -> dict[str, float]:
    """The demo target's exact distribution over the texts of its next ``length`` tokens sampled at
    temperature 1 from its two likeliest (the server's top-k 2), as plain decoding computes it
    (``target``: on that backend, closed after; else llama.cpp's)."""
    import numpy as np

    from specrun.backends.llama import LlamaCppBackend
    from specrun.modelkit.demo import demo_gguf

    if target is None:
        target = LlamaCppBackend(demo_gguf("demo-target"), n_ctx=256, n_threads=1, kv_type="f32", flash_attn=False)
    try:
        ids = target.tokenize(prompt)
        texts: dict[str, float] = {}

        def extend(context: list[int], probability: float, depth: int) -> None:
            if depth == length:
                text = b"".join(target.token_bytes(t) for t in context[len(ids):]).decode("utf-8", "replace")
                texts[text] = texts.get(text, 0.0) + probability
                return
            target.rewind(0)
            logits = target.forward(context, [len(context) - 1])[0].astype(np.float64)
            top = np.argsort(logits)[-2:]
            assert not set(top.tolist()) & target.vocab.eos_ids, "the prompt's continuations must not end"
            weights = np.exp(logits[top] - logits[top].max())
            for token, weight in zip(top, weights / weights.sum()):
                extend([*context, int(token)], probability * weight, depth + 1)

        extend(ids, 1.0, 0)
        return texts
    finally:
        target.close()


def test_a_request_running_into_its_slot_s_context_end_leaves_the_others_intact(parallel_server):
    """A long prompt (fed in chunks beside the others' steps) whose answer reaches the end of its
    slot's context ends there, as alone; the answers decoded beside it are their own."""
    keys = [(client_id, 0) for client_id in range(3)]
    expected = [answer(parallel_server, messages_for(*key), stream=False) for key in keys]

    def too_long():
        return parallel_server.post("/v1/completions", {"model": MODEL, "prompt": "word " * 1900, "max_tokens": 2048})

    with ThreadPoolExecutor(4) as pool:
        failing = pool.submit(too_long)
        others = list(pool.map(lambda key: answer(parallel_server, messages_for(*key), stream=True), keys))
        status, body = failing.result()
    assert others == expected
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == CONTEXT
    assert parallel_server.healthy()


def test_a_stream_failing_mid_answer_ends_with_an_error_event_and_the_others_are_their_own(parallel_server):
    """One slot's request fails after its first tokens were sent (a grammar past llguidance's limits
    mid-answer): its stream ends with an error event naming why; the streams decoded beside it
    get the answers they get alone."""
    import openai

    keys = [(client_id, 1) for client_id in range(3)]
    expected = [answer(parallel_server, messages_for(*key), stream=False) for key in keys]

    def failing():
        stream = parallel_server.client().chat.completions.create(
            model=MODEL, messages=messages_for(5, 0), max_tokens=12, temperature=0, stream=True,
            extra_body={"grammar": 'root ::= "a"{100000}'})
        received = 0
        try:
            for _ in stream:
                received += 1
        except openai.APIError as error:
            return received, str(error)
        return received, None

    with ThreadPoolExecutor(4) as pool:
        failed = pool.submit(failing)
        others = list(pool.map(lambda key: answer(parallel_server, messages_for(*key), stream=True), keys))
        received, error = failed.result()
    assert error is not None and "the grammar stopped the answer after" in error, (received, error)
    assert others == expected
    assert parallel_server.healthy()


CONTEXT = 2048  # the demo target's


def test_a_client_that_leaves_frees_its_slot_for_the_queue(parallel_server):
    """Every slot busy with a client that then leaves: the requests queued behind them are served."""
    import openai

    clients = [openai.OpenAI(base_url=parallel_server.url, api_key="unused", max_retries=0, timeout=60)
               for _ in range(SLOTS)]
    streams = [c.chat.completions.create(model=MODEL, messages=messages_for(i, 9), max_tokens=400, stream=True)
               for i, c in enumerate(clients)]
    for stream in streams:
        next(iter(stream))  # each slot has begun
        stream.close()  # and its client leaves
    started = time.monotonic()
    text, reason = answer(parallel_server, messages_for(0, 0), stream=False)
    assert text and reason in ("stop", "length")
    assert time.monotonic() - started < 30
    parallel_server.wait_for_log("the client left")


def metric_values(server) -> dict[str, float]:
    """/metrics as {name{labels}: value}, checked to be Prometheus' text format."""
    import http.client

    host, port = server.host_port
    connection = http.client.HTTPConnection(host, port, timeout=30)
    connection.request("GET", "/metrics")
    response = connection.getresponse()
    body = response.read().decode()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/plain"), body
    values = {}
    for line in body.splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r'([a-z_]+(?:\{[^}]*\})?) (-?[0-9.e+]+|NaN)', line)
        assert match, f"not a Prometheus sample line: {line!r}"
        values[match.group(1)] = float(match.group(2))
    return values


def test_a_full_queue_is_a_429_with_retry_after_and_the_others_are_served():
    import http.client
    import json

    server = start_server(*DEMO_ARGS, "--parallel", "2", "--max-queue", "1")
    try:
        host, port = server.host_port

        def post(index: int):
            connection = http.client.HTTPConnection(host, port, timeout=60)
            body = {"model": MODEL, "prompt": f"Story {index}:", "max_tokens": 300, "temperature": 0}
            connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, response.getheader("Retry-After"), json.loads(response.read())

        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(post, range(8)))
        busy = [reply for reply in replies if reply[0] == 429]
        served = [reply for reply in replies if reply[0] == 200]
        assert busy and served and len(busy) + len(served) == 8, replies
        for _, retry_after, body in busy:
            assert int(retry_after) >= 1
            assert body["error"]["code"] == "server_busy" and "\n" not in body["error"]["message"]
        assert all(body["choices"][0]["text"] for _, _, body in served)
        metrics = metric_values(server)
        answered = sum(value for name, value in metrics.items()
                       if name.startswith("specrun_requests_total") and "error" not in name)
        assert answered == len(served)
        assert metrics['specrun_requests_refused_total{reason="busy"}'] == len(busy)
        assert metrics['specrun_requests_refused_total{reason="shutting_down"}'] == 0
    finally:
        assert stop_server(server) == 0, server.log


@pytest.mark.parametrize(("args", "code", "message"), [
    (("--parallel", "0"), 2, "--parallel must be between 1 and 64"),
    (("--parallel", "many"), 2, "--parallel 'many' is neither a number of slots nor auto"),
    (("--parallel", "2", "--method", "lookahead"), 2, "drafts with lookahead"),
    (("--parallel", "2", "--method", "lookup+mtp"), 2, "carries no MTP layers"),  # slots draft with MTP where it is
    (("--parallel", "2", "--branches", "2", "--exact"), 2, "--branches drafts trees with --exact"),
])
def test_parallel_options_a_slot_cannot_hold_are_one_line_errors(args, code, message):
    from tests.hardening.cli_checks import assert_one_line_error, run_specrun

    done = run_specrun("serve", "--port", "0", *args)
    assert_one_line_error(done.returncode, done.stderr, code, message)


def test_a_double_ctrl_c_ends_every_slot_s_stream_with_a_final_event():
    """Two slots streaming long answers and one request queued: a double Ctrl-C gives the queued a
    JSON 503, each stream a final event and [DONE], and the server exits 0 with no traceback."""
    import http.client
    import json
    import signal
    import threading

    server = start_server(*DEMO_ARGS, "--parallel", "2", "--method", "none")
    host, port = server.host_port
    streams: list[list[str]] = [[], []]
    begun = [threading.Event(), threading.Event()]
    queued = []

    def stream(index: int) -> None:
        connection = http.client.HTTPConnection(host, port, timeout=60)
        body = {"model": MODEL, "prompt": f"Chapter {index}.", "max_tokens": 2000, "stream": True}
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        for line in connection.getresponse():
            if line.strip():
                streams[index].append(line.decode().strip())
                begun[index].set()
        begun[index].set()

    threads = [threading.Thread(target=stream, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    assert all(event.wait(60) for event in begun)
    waiting = threading.Thread(target=lambda: queued.append(server.post("/v1/completions", {
        "model": MODEL, "prompt": "Hi", "max_tokens": 8})))
    waiting.start()
    time.sleep(0.5)
    for _ in range(2):
        server.process.send_signal(signal.SIGINT)
        time.sleep(0.2)
    for thread in [*threads, waiting]:
        thread.join(60)
    assert server.process.wait(timeout=30) == 0, server.log[-10:]
    assert [status for status, _ in queued] == [503]
    for lines in streams:
        assert lines[-1] == "data: [DONE]" and "server_shutting_down" in lines[-2], lines[-3:]
    assert not any("Traceback" in line or "CancelledError" in line for line in server.log), server.log[-10:]
