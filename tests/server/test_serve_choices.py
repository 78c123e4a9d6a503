"""OpenAI's ``n``: several answers to one request, each a generation of its own (choice i drawn
with seed + i where a seed is given), whole and streamed, usage counting the prompt once and
every answer's tokens; a refusal of one cancels them all."""

from __future__ import annotations

import json

import pytest

from server_harness import DEMO_ARGS, start_server, stop_server

MODEL = "demo-target"
ASK = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def plain_server():
    """Plain decoding, one request at a time: a seed's answer is the same whenever it is drawn (a
    drafter's lengths, which follow the clock, and a batch's rounding would move a sampled text)."""
    server = start_server(*DEMO_ARGS, "--method", "none", "--parallel", "1")
    yield server
    assert stop_server(server) == 0, server.log


def _answer(server, **fields) -> dict:
    status, body = server.post("/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 12, **fields})
    assert status == 200, body
    return body


def test_n_answers_are_n_generations_each_as_one_request_gives_it(demo_server):
    greedy = _answer(demo_server, n=3)
    one = _answer(demo_server)
    assert [choice["index"] for choice in greedy["choices"]] == [0, 1, 2]
    assert {choice["message"]["content"] for choice in greedy["choices"]} == {one["choices"][0]["message"]["content"]}
    assert greedy["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]  # the prompt counted once
    assert greedy["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]
    assert all(choice["speculation"]["new_tokens"] == one["usage"]["completion_tokens"] for choice in greedy["choices"])


def test_choice_i_is_drawn_with_seed_plus_i(plain_server):
    sampled = _answer(plain_server, n=3, temperature=1.0, seed=40)
    alone = [_answer(plain_server, temperature=1.0, seed=40 + index)["choices"][0] for index in range(3)]
    assert [choice["message"]["content"] for choice in sampled["choices"]] == [c["message"]["content"] for c in alone]
    assert len({c["message"]["content"] for c in alone}) > 1  # the seeds differ, and so do their answers


def test_n_answers_stream_interleaved_by_their_index(plain_server):
    whole = _answer(plain_server, n=2, temperature=1.0, seed=7)
    stream = plain_server.client().chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=12, n=2, temperature=1.0, seed=7, stream=True,
        stream_options={"include_usage": True})
    texts, finished, usage, ids = {0: [], 1: []}, {}, None, set()
    for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index].append(choice.delta.content or "")
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert ["".join(texts[index]) for index in (0, 1)] == [c["message"]["content"] for c in whole["choices"]]
    assert finished == {0: whole["choices"][0]["finish_reason"], 1: whole["choices"][1]["finish_reason"]}
    assert usage.completion_tokens == whole["usage"]["completion_tokens"]
    assert len(ids) == 1  # every chunk of one request carries its id


def test_more_answers_than_the_queue_holds_are_a_400_and_the_queue_takes_all_or_none():
    server = start_server(*DEMO_ARGS, "--method", "none", "--parallel", "1", "--max-queue", "2")
    try:
        status, body = server.post("/v1/chat/completions", {"model": MODEL, "messages": ASK, "n": 3})
        assert status == 400 and body["error"]["param"] == "n" and "--max-queue" in body["error"]["message"], body
        assert _answer(server, n=2)["choices"][1]["index"] == 1
    finally:
        assert stop_server(server) == 0, server.log


def test_completions_take_n_too(demo_server):
    status, body = demo_server.post("/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "n": 2,
                                                        "max_tokens": 6})
    assert status == 200, body
    assert [choice["index"] for choice in body["choices"]] == [0, 1]
    assert body["choices"][0]["text"] == body["choices"][1]["text"]  # greedy
    assert json.dumps(body)  # one JSON object
