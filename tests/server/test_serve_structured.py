"""Structured output through `specrun serve` (issue 52): response_format json_object and
json_schema, llama-server's grammar and json_schema fields; every answer follows its schema, and
greedy answers are the same with speculation (auto) and without (--method none), or part only at a
near-tie of plain decoding's."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest

from server_harness import DEMO_ARGS, NEAR_TIE, assert_refused, start_server, stop_server

MODEL = "demo-target"
PROMPTS = [
    "Describe a cat as JSON.",
    "Give me the weather in Paris.",
    "List three colours.",
    "Who wrote Hamlet?",
    "Extract the name and age: Alice is 31 years old.",
]
# Ten schemas with bounded answers (every string, array and number has a limit), so a small
# model's answer ends within the tokens given.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"],
     "additionalProperties": False},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"],
     "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"},
                                      "temp": {"type": "integer", "minimum": -50, "maximum": 50}},
     "required": ["city", "temp"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
     "required": ["answer", "sure"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"author": {"type": "string", "maxLength": 10},
                                      "year": {"type": "integer", "minimum": 1000, "maximum": 2100}},
     "required": ["author", "year"], "additionalProperties": False},
]
CASES = [(prompt, schema_index) for schema_index in range(len(SCHEMAS)) for prompt in PROMPTS]  # 50
MAX_TOKENS = 256


@pytest.fixture(scope="module")
def plain_server():
    """The demo target served without speculation, for the answers speculation must equal."""
    server = start_server(*DEMO_ARGS, "--method", "none")
    yield server
    assert stop_server(server) == 0, server.log


# A top-2 gap of plain decoding's (log-probabilities under the schema) below NEAR_TIE is a
# numerical near-tie. Even under --exact (F32 KV cache, flash attention off) the Q8_0 demo target's
# one-token and batched passes round apart on an AVX2-only x86 CPU: its activations are quantized
# to 8 bits, so a float32 difference of ~1e-7 in attention can move a whole quantization step.
MAX_DIVERGING = 5  # of the 50 answers


def _schema_answer(server, prompt: str, schema: dict):
    response = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0,
        logprobs=True, top_logprobs=2,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
    )
    return response.choices[0]


def _diverges_at_a_near_tie(fast, plain) -> bool:
    """False where the two answers are the same; True where they part only at a near-tie of
    plain decoding's: at the first token that differs, the speculative answer took plain's runner-up
    at a gap below NEAR_TIE (after it the contexts differ, and so may the rest)."""
    if fast.message.content == plain.message.content:
        return False
    fast_tokens, plain_entries = [e.token for e in fast.logprobs.content], plain.logprobs.content
    at = next(i for i, (a, b) in enumerate(zip(fast_tokens, plain_entries)) if a != b.token)
    best, runner_up = plain_entries[at].top_logprobs
    assert fast_tokens[at] == runner_up.token, (at, fast_tokens[at], best.token, runner_up.token)
    assert best.logprob - runner_up.logprob < NEAR_TIE, (at, best.logprob - runner_up.logprob)
    return True


def test_json_schema_answers_follow_their_schema_and_equal_plain_decoding_s(demo_server, plain_server):
    diverging = 0
    for prompt, schema_index in CASES:
        schema = SCHEMAS[schema_index]
        fast, plain = _schema_answer(demo_server, prompt, schema), _schema_answer(plain_server, prompt, schema)
        diverging += _diverges_at_a_near_tie(fast, plain)
        for choice in (fast, plain):
            assert choice.finish_reason == "stop", (prompt, schema_index, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), schema)
    assert diverging <= MAX_DIVERGING, f"{diverging} of {len(CASES)} answers parted at near-ties"


def test_json_object_answers_are_json_objects_streamed_or_not(demo_server):
    client = demo_server.client()
    for prompt in PROMPTS[:3]:
        whole = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=200, temperature=0,
            response_format={"type": "json_object"})
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=200, temperature=0,
            response_format={"type": "json_object"}, stream=True) if chunk.choices)
        text = whole.choices[0].message.content
        assert streamed == text
        if whole.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:  # max_tokens reached inside the object: what there is begins one
            assert text.lstrip().startswith("{")


def test_sampled_answers_follow_their_schema_too(demo_server):
    schema = SCHEMAS[5]
    for seed in range(5):
        response = demo_server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[4]}], max_tokens=MAX_TOKENS,
            temperature=0.8, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
        jsonschema.validate(json.loads(response.choices[0].message.content), schema)


def test_a_gbnf_grammar_and_a_json_schema_field_on_completions(demo_server):
    status, body = demo_server.post("/v1/completions", {
        "model": MODEL, "prompt": "The answer is", "max_tokens": 20, "temperature": 0,
        "grammar": 'root ::= " " ("yes" | "no") "."'})
    assert status == 200, body
    assert body["choices"][0]["text"] in (" yes.", " no.")
    # Lark, as llguidance takes it inside a grammar field (llama.cpp's convention: %llguidance first)
    status, body = demo_server.post("/v1/completions", {
        "model": MODEL, "prompt": "The answer is", "max_tokens": 20, "temperature": 0,
        "grammar": '%llguidance {}\nstart: " " ANSWER "."\nANSWER: /(yes|no)/'})
    assert status == 200, body
    assert body["choices"][0]["text"] in (" yes.", " no.")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 5}},
              "required": ["n"], "additionalProperties": False}
    status, body = demo_server.post("/v1/completions", {
        "model": MODEL, "prompt": "Pick a number:", "max_tokens": 30, "temperature": 0, "json_schema": schema})
    assert status == 200, body
    jsonschema.validate(json.loads(body["choices"][0]["text"]), schema)


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


BAD = [
    (_chat(response_format="json"), "response_format", "invalid_type"),
    (_chat(response_format={"type": "xml"}), "response_format.type", "invalid_value"),
    (_chat(response_format={"type": "json_schema"}), "response_format.json_schema", "invalid_type"),
    (_chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema", "missing_required_parameter"),
    (_chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}),
     "response_format.json_schema.schema", "invalid_value"),
    (_chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/missing"}}}}}),
     "response_format.json_schema.schema", "invalid_value"),
    (_chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}),
     "response_format.json_schema.schema", "invalid_value"),  # compiles, then fails at its first token
    (_chat(grammar='root ::= "a" | ('), "grammar", "invalid_value"),
    (_chat(grammar="  "), "grammar", "invalid_type"),  # "" is none, as llama-server reads it
    (_chat(grammar="%llguidance {}\nstart: ANSWER"), "grammar", "invalid_value"),  # Lark naming no rule
    (_chat(json_schema=[1]), "json_schema", "invalid_type"),
    (_chat(grammar='root ::= "a"', response_format={"type": "json_object"}), "grammar", "invalid_value"),
    # the schema's description: each was taken whatever its type (OpenAI refuses them)
    (_chat(response_format={"type": "json_schema", "json_schema": {"name": 5, "schema": {"type": "object"}}}),
     "response_format.json_schema.name", "invalid_type"),
    (_chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "strict": "yes",
                                                                    "schema": {"type": "object"}}}),
     "response_format.json_schema.strict", "invalid_type"),
    # half a surrogate pair alone as a property name: the answer held invalid UTF-8
    (_chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"\ud800": {"type": "string"}}}}}),
     "response_format.json_schema.schema", "invalid_value"),
]


def test_a_deep_schema_neither_kills_the_server_nor_stalls_its_other_clients(demo_server):
    """1,000 chained $refs (75 kB) killed the server (SIGSEGV in llguidance's compiler; the engine's
    test compiles that many); compiled on a large stack, off the event loop, a chain that fits this
    server's --max-body is answered while /health answers at once."""
    import threading
    import time

    links = 700
    defs = {f"a{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/a{i + 1}"}}} for i in range(links)}
    defs[f"a{links}"] = {"enum": ["ok"]}
    body = _chat(max_tokens=4, response_format={"type": "json_schema", "json_schema": {
        "name": "deep", "schema": {"$defs": defs, "$ref": "#/$defs/a0"}}})
    answers = []
    thread = threading.Thread(target=lambda: answers.append(demo_server.post("/v1/chat/completions", body)))
    thread.start()
    started = time.monotonic()
    assert demo_server.healthy() and time.monotonic() - started < 2.0
    thread.join(120)
    assert answers and answers[0][0] == 200, answers
    assert demo_server.process.poll() is None and demo_server.healthy()


@pytest.mark.parametrize(("body", "param", "code"), BAD, ids=[f"{i}-{row[1]}" for i, row in enumerate(BAD)])
def test_a_grammar_that_cannot_be_used_is_a_400_naming_its_field(demo_server, body, param, code):
    assert_refused(demo_server, "/v1/chat/completions", body, param, code)


def test_a_lark_grammar_s_error_names_lark_and_a_gbnf_one_gbnf(demo_server):
    _, lark = demo_server.post("/v1/chat/completions", _chat(grammar="%llguidance {}\nstart: foo"))
    assert lark["error"]["message"].startswith("grammar: a Lark grammar (llguidance's) that cannot be used"), lark
    _, gbnf = demo_server.post("/v1/chat/completions", _chat(grammar='root ::= "a" | ('))
    assert gbnf["error"]["message"].startswith("grammar: a GBNF grammar (llama.cpp's)"), gbnf


def test_a_grammar_past_llguidance_s_limits_mid_answer_is_a_400_not_a_length(demo_server):
    """A grammar that compiles and lets the first token through, then exceeds llguidance's limits:
    the text so far follows no grammar, so the client gets a 400 naming the field and why (streamed:
    an error event after the text sent), not an answer cut short as "length"; others are served."""
    import openai

    body = _chat(max_tokens=12, temperature=0, grammar='root ::= "a"{100000}')
    status, got = demo_server.post("/v1/chat/completions", body)
    assert status == 400, got
    assert (got["error"]["param"], got["error"]["code"]) == ("grammar", "grammar_failed"), got
    message = got["error"]["message"]
    assert "the grammar stopped the answer after" in message and "Too many items" in message, message
    assert "\n" not in message
    demo_server.wait_for_log("grammar: the grammar stopped the answer after")
    stream = demo_server.client().chat.completions.create(
        model=MODEL, messages=body["messages"], max_tokens=12, temperature=0, stream=True,
        extra_body={"grammar": body["grammar"]})
    with pytest.raises(openai.APIError, match="the grammar stopped the answer after"):
        for _ in stream:
            pass
    status, fine = demo_server.post("/v1/chat/completions", _chat(max_tokens=4, temperature=0))
    assert status == 200 and fine["choices"][0]["finish_reason"] in ("stop", "length"), fine


# ---- log-probabilities ------------------------------------------------------------------------
def test_chat_logprobs_are_the_tokens_of_the_answer_with_their_alternatives(demo_server, plain_server):
    def asked(server, **fields):
        return server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=40, temperature=0,
            logprobs=True, top_logprobs=3, **fields)

    fast, plain = asked(demo_server).choices[0], asked(plain_server).choices[0]
    entries = fast.logprobs.content
    assert "".join(entry.token for entry in entries) == fast.message.content
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        values = [other.logprob for other in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the likeliest token was chosen
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    # drafted or not, a token's log-probability is the target's own
    assert [e.token for e in entries] == [e.token for e in plain.logprobs.content]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in plain.logprobs.content], abs=1e-3)
    streamed = [entry for chunk in demo_server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=40, temperature=0,
        logprobs=True, top_logprobs=3, stream=True) if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


def test_logprobs_end_with_the_text_a_stop_string_cut(demo_server):
    """The tokens past a stop string are cut from the answer and from its logprobs (" help" and
    " you" were listed after an answer cut at "help"); the token the stop string begins inside
    is listed, as its text begins the cut."""
    def asked(stream=False, **fields):
        return demo_server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=40, temperature=0,
            logprobs=True, top_logprobs=1, stream=stream, **fields)

    whole = asked().choices[0]
    tokens = [entry.token for entry in whole.logprobs.content]
    text = whole.message.content
    starts = [len("".join(tokens[:i]).encode()) for i in range(len(tokens))]
    at = next(i for i in range(4, len(tokens)) if len(tokens[i].strip()) >= 2
              and text.find(tokens[i].strip()) == len("".join(tokens[:i])) + tokens[i].index(tokens[i].strip()))
    stop = tokens[at].strip()
    cut = asked(stop=[stop]).choices[0]
    assert cut.message.content == text[:text.find(stop)] and cut.finish_reason == "stop"
    kept = len(cut.message.content.encode())
    expected = [token for token, start in zip(tokens, starts) if start < kept]
    assert [entry.token for entry in cut.logprobs.content] == expected == tokens[:at + 1]
    streamed = [entry.token for chunk in asked(stream=True, stop=[stop]) if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content]
    assert streamed == expected


def test_logprobs_under_a_schema_list_only_tokens_it_allows(demo_server):
    schema = SCHEMAS[3]
    response = demo_server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=MAX_TOKENS, temperature=0,
        logprobs=True, top_logprobs=5,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    entries = response.choices[0].logprobs.content
    first = entries[0]
    assert first.token.lstrip().startswith("{") and all(o.token.lstrip().startswith("{") or not o.token.strip()
                                                        for o in first.top_logprobs)
    total = sum(math.exp(o.logprob) for o in first.top_logprobs)
    assert total <= 1.0 + 1e-6


def test_completions_logprobs_in_the_legacy_shape(demo_server):
    status, body = demo_server.post("/v1/completions", {
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "logprobs": 2})
    assert status == 200, body
    choice = body["choices"][0]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert len(logprobs["token_logprobs"]) == len(logprobs["tokens"]) == len(logprobs["top_logprobs"])
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"])
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])
