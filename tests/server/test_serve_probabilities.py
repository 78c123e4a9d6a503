"""llama-server's ``n_probs`` on /completion (mikupad, SillyTavern and scripts written for
llama-server show them): each token's log-probability and its likeliest alternatives', as
``completion_probabilities`` entries (id, token, bytes, logprob, top_logprobs) on the answer, or
on each chunk of a stream; the same figures chat completions' logprobs give."""

from __future__ import annotations

import json
import math

import pytest

from server_harness import assert_refused
from specrun.server.native import parse_native_request
from specrun.server.requests import RequestError, ServeDefaults

PROMPT = "user: Tell me about the sea.\nassistant: "


def test_n_probs_asks_for_log_probabilities():
    for body, asked in (({"n_probs": 5}, 5), ({"n_probs": 5.0}, 5), ({"logprobs": 4}, 4),
                        ({"n_probs": 3, "logprobs": 9}, 3), ({"n_probs": 1000}, 1000), ({}, None), ({"n_probs": 0}, None),
                        ({"logprobs": False}, None)):
        request, _ = parse_native_request({"prompt": "x", **body}, ServeDefaults(), 2048, "m")
        assert request.logprobs == asked, body


@pytest.mark.parametrize(("value", "message"), [(-1, "must be in [0, 1000]"), (1001, "must be in [0, 1000]"),
                                                ("3", "must be an integer"), (True, "must be an integer"),
                                                (2.5, "must be an integer")])
def test_bad_n_probs_are_400s(value, message):
    with pytest.raises(RequestError) as refused:
        parse_native_request({"prompt": "x", "n_probs": value}, ServeDefaults(), 2048, "m")
    assert refused.value.param == "n_probs" and message in refused.value.message


def _events(server, body: dict) -> list[dict]:
    import http.client

    host, port = server.host_port
    connection = http.client.HTTPConnection(host, port, timeout=60)
    try:
        connection.request("POST", "/completion", body=json.dumps({**body, "stream": True}),
                           headers={"Content-Type": "application/json"})
        lines = connection.getresponse().read().decode().splitlines()
    finally:
        connection.close()
    return [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]


def test_completion_probabilities_come_with_the_answer_and_its_chunks(demo_server):
    body = {"prompt": PROMPT, "n_predict": 24, "n_probs": 3, "temperature": 0}
    status, answer = demo_server.post("/completion", body)
    assert status == 200, answer
    entries = answer["completion_probabilities"]
    assert (answer["generation_settings"]["n_probs"], answer["generation_settings"]["post_sampling_probs"]) == (3, False)
    assert len(entries) == answer["tokens_predicted"] > 0
    assert bytes(b for entry in entries for b in entry["bytes"]).decode() == answer["content"]
    for entry in entries:
        assert set(entry) == {"id", "token", "bytes", "logprob", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 3 and entry["logprob"] <= 0
        best = entry["top_logprobs"][0]
        assert (best["id"], best["token"]) == (entry["id"], entry["token"])  # greedy: the likeliest
        assert math.isclose(best["logprob"], entry["logprob"])
        status, tokenized = demo_server.post("/detokenize", {"tokens": [entry["id"]]})
        assert tokenized["content"].encode() == bytes(entry["bytes"]) or "\ufffd" in tokenized["content"]
    chunks = _events(demo_server, body)
    streamed = [entry for chunk in chunks[:-1] for entry in chunk.get("completion_probabilities", [])]
    assert [e["id"] for e in streamed] == [e["id"] for e in entries]
    assert all(math.isclose(a["logprob"], b["logprob"], abs_tol=1e-6) for a, b in zip(streamed, entries))
    assert "completion_probabilities" not in chunks[-1]  # llama-server's last chunk of a stream has none
    status, plain = demo_server.post("/completion", {**body, "n_probs": 0})
    assert status == 200 and "completion_probabilities" not in plain


def test_n_probs_past_its_range_is_a_400_and_the_server_serves_on(demo_server):
    assert_refused(demo_server, "/completion", {"prompt": "hi", "n_probs": 5000}, "n_probs", "invalid_value")


def test_post_sampling_probs_are_the_distribution_each_token_was_drawn_from(demo_server):
    """llama-server's post_sampling_probs: probabilities after the sampling settings, under
    ``prob`` and ``top_probs``; a token top-k leaves out has none and is not listed."""
    body = {"prompt": PROMPT, "n_predict": 16, "n_probs": 10, "post_sampling_probs": True, "temperature": 0.8,
            "top_k": 5, "seed": 3}
    status, answer = demo_server.post("/completion", body)
    assert status == 200, answer
    entries = answer["completion_probabilities"]
    assert len(entries) == answer["tokens_predicted"] > 0
    for entry in entries:
        assert set(entry) == {"id", "token", "bytes", "prob", "top_probs"}
        assert 0 < entry["prob"] <= 1 and 1 <= len(entry["top_probs"]) <= 5
        assert math.isclose(sum(other["prob"] for other in entry["top_probs"]), 1.0, rel_tol=1e-6)
        assert entry["id"] in [other["id"] for other in entry["top_probs"]]
    status, greedy = demo_server.post("/completion", {**body, "temperature": 0})
    assert status == 200 and all(entry["prob"] == 1.0 and len(entry["top_probs"]) == 1
                                 for entry in greedy["completion_probabilities"])
    # streamed greedily (a seed repeats a sampled answer only at a fixed draft length): the same entries
    chunks = _events(demo_server, {**body, "temperature": 0})
    streamed = [entry for chunk in chunks for entry in chunk.get("completion_probabilities", [])]
    assert streamed == greedy["completion_probabilities"]
    assert_refused(demo_server, "/completion", {"prompt": "hi", "post_sampling_probs": "yes"}, "post_sampling_probs",
                   "invalid_type")
