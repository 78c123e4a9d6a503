"""Repetition penalties and logit bias through `specrun serve` (specrun/penalties.py): OpenAI's
frequency_penalty, presence_penalty and logit_bias, llama-server's repeat_penalty, repeat_last_n,
its list form of logit_bias (a token's text, false for never) and its ``penalties`` sampler; what a
request leaves out, the command line gives. Greedy answers under penalties are the same with
speculation (auto) and without (--method none), or part only at a near-tie of plain decoding's;
a bad value is a 400 naming its field, and the server serves on."""

from __future__ import annotations

import math

import pytest

from server_harness import DEMO_ARGS, assert_refused, parts_only_at_a_near_tie, start_server, stop_server
from specrun.penalties import Penalties
from specrun.sampling import SamplingSettings
from specrun.server.requests import RequestError, ServeDefaults, parse_chat_request, parse_completion_request

MODEL = "demo-target"
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
PROMPTS = ["Write a short poem about the sea.", "List five fruits.", "Tell me about Paris.",
           "Count from one to twenty in words."]
PENALISED = {"repeat_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.2, "repeat_last_n": 64}


# ---- the fields -------------------------------------------------------------------------
def test_penalties_are_read_from_openai_s_and_llama_server_s_fields():
    request = parse_chat_request({**CHAT, **PENALISED}, ServeDefaults(), 2048)
    assert request.sampling.penalties == Penalties(1.3, 0.2, 0.5, 64)
    # the command line's, where a request says nothing; a request's own where it does
    defaults = ServeDefaults(sampling=SamplingSettings(penalties=Penalties(repeat=1.1, last_n=32)))
    assert parse_chat_request(CHAT, defaults, 2048).sampling.penalties == Penalties(repeat=1.1, last_n=32)
    assert parse_chat_request({**CHAT, "repeat_penalty": 1}, defaults, 2048).sampling.penalties == Penalties()
    # llama-server's samplers: penalties left out of the list are off, listed ("e") they are on
    assert parse_chat_request({**CHAT, **PENALISED, "samplers": "kt"}, ServeDefaults(), 2048).sampling.penalties \
        == Penalties()
    assert parse_chat_request({**CHAT, **PENALISED, "samplers": ["penalties", "temperature"]}, ServeDefaults(),
                              2048).sampling.penalties.on


def test_logit_bias_is_read_in_openai_s_form_and_llama_server_s():
    openai = parse_completion_request({"prompt": "x", "logit_bias": {"17": -100, "40": 2.5}}, ServeDefaults(), 2048)
    assert openai.sampling.logit_bias == ((17, -100.0), (40, 2.5)) and openai.bias_texts == ()
    llama = parse_completion_request({"prompt": "x", "logit_bias": [[17, False], ["hello", -1], [40, 0.5]]},
                                     ServeDefaults(), 2048)
    assert llama.sampling.logit_bias == ((17, -math.inf), (40, 0.5))
    assert llama.bias_texts == (("hello", -1.0),)
    assert parse_completion_request({"prompt": "x", "logit_bias": {"the": False}}, ServeDefaults(),
                                    2048).bias_texts == (("the", -math.inf),)
    # an object's key is an id as llama-server's strtol reads one to its end: " +12" is, "12 " is text
    keys = parse_completion_request({"prompt": "x", "logit_bias": {" +12": 1, "12 ": 2}}, ServeDefaults(), 2048)
    assert keys.sampling.logit_bias == ((12, 1.0),) and keys.bias_texts == (("12 ", 2.0),)
    # finite biases beside a grammar are taken; penalties after the samplers are taken where they are off
    assert parse_chat_request({**CHAT, "logit_bias": {"17": -100}, "response_format": {"type": "json_object"}},
                              ServeDefaults(), 2048).sampling.logit_bias == ((17, -100.0),)
    assert not parse_chat_request({**CHAT, "samplers": ["top_k", "penalties"]}, ServeDefaults(),
                                  2048).sampling.penalties.on


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"repeat_penalty": 0}, "repeat_penalty", "must be in (0, 10]"),
    ({"repeat_penalty": "high"}, "repeat_penalty", "must be a number"),
    ({"frequency_penalty": 2.5}, "frequency_penalty", "must be in [-2, 2]"),
    ({"presence_penalty": -3}, "presence_penalty", "must be in [-2, 2]"),
    ({"repeat_last_n": -2}, "repeat_last_n", "must be -1 (the whole text), 0 (off)"),
    ({"repeat_last_n": 1.5}, "repeat_last_n", "must be an integer"),
    ({"logit_bias": "17:-100"}, "logit_bias", "an object like"),
    ({"logit_bias": {"17": 101}}, 'logit_bias["17"]', "the bias must be a number in [-100, 100] or false"),
    ({"logit_bias": {"17": True}}, 'logit_bias["17"]', "or false (never that token), got true"),
    ({"logit_bias": [[17]]}, "logit_bias[0]", "must be a [token, bias] pair"),
    ({"logit_bias": [[None, 1]]}, "logit_bias[0]", "the token must be a token id or text, got null"),
    ({"logit_bias": [["", 1]]}, "logit_bias[0]", "the token must be a token id or text"),
    ({"logit_bias": {"9" * 5000: 1}}, 'logit_bias["' + "9" * 36 + '...]', "the token id is outside the vocabulary"),
    ({"logit_bias": {"17": False}, "response_format": {"type": "json_object"}}, "logit_bias",
     "a bias of false (never) beside a grammar (response_format) could forbid every token"),
    ({"repeat_penalty": 1.2, "samplers": ["top_k", "penalties", "temperature"]}, "samplers",
     "list penalties before the other samplers"),
])
def test_bad_penalties_and_biases_are_400s_naming_the_field(fields, param, message):
    with pytest.raises(RequestError) as refused:
        parse_chat_request({**CHAT, **fields}, ServeDefaults(), 2048)
    assert refused.value.status == 400 and refused.value.param == param, refused.value.message
    assert message in refused.value.message, refused.value.message


def test_ignore_eos_is_taken_and_refused_beside_a_grammar():
    assert parse_completion_request({"prompt": "x", "ignore_eos": True}, ServeDefaults(), 2048).ignore_eos
    assert not parse_completion_request({"prompt": "x"}, ServeDefaults(), 2048).ignore_eos
    for fields, code in (({"ignore_eos": "yes"}, "invalid_type"),
                         ({"ignore_eos": True, "response_format": {"type": "json_object"}}, "invalid_value")):
        with pytest.raises(RequestError) as refused:
            parse_chat_request({**CHAT, **fields}, ServeDefaults(), 2048)
        assert (refused.value.param, refused.value.code) == ("ignore_eos", code), refused.value.message


# ---- served -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain_server():
    """The demo target served without speculation, for the answers speculation must equal."""
    server = start_server(*DEMO_ARGS, "--method", "none")
    yield server
    assert stop_server(server) == 0, server.log


def _answer(server, prompt: str, **fields):
    response = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=64, temperature=0, logprobs=True,
        top_logprobs=3, extra_body=fields)
    return response.choices[0]


def test_greedy_answers_under_penalties_are_plain_decoding_s(demo_server, plain_server):
    changed = 0
    for prompt in PROMPTS:
        fast, plain = _answer(demo_server, prompt, **PENALISED), _answer(plain_server, prompt, **PENALISED)
        parts_only_at_a_near_tie(plain.logprobs.content, fast.message.content)
        changed += _answer(demo_server, prompt).message.content != fast.message.content
    assert changed >= len(PROMPTS) // 2  # the penalties change what the target says


def _first_token(server, prompt: str) -> tuple[int, str]:
    """The id and text of the first token of the unbiased greedy answer."""
    text = _answer(server, prompt).message.content
    status, body = server.post("/tokenize", {"content": text, "with_pieces": True})
    assert status == 200, body
    return body["tokens"][0]["id"], body["tokens"][0]["piece"]


def test_a_token_biased_to_never_is_never_said_by_id_or_by_text(demo_server):
    prompt = PROMPTS[1]
    token, piece = _first_token(demo_server, prompt)
    status, body = demo_server.post("/tokenize", {"content": piece})
    assert status == 200 and body["tokens"] == [token], (piece, body)
    for bias in ({str(token): -100}, [[token, False]], [[piece, False]]):
        answer = _answer(demo_server, prompt, logit_bias=bias)
        assert answer.logprobs.content[0].token != piece, bias
        assert all(entry.token != piece for entry in answer.logprobs.content[0].top_logprobs)


def test_penalties_are_said_in_llama_server_s_settings(demo_server):
    status, body = demo_server.post("/completion", {"prompt": "Once upon a time", "n_predict": 4, **PENALISED})
    assert status == 200, body
    settings = body["generation_settings"]
    assert (settings["repeat_penalty"], settings["repeat_last_n"], settings["presence_penalty"],
            settings["frequency_penalty"]) == (1.3, 64, 0.5, 0.2)


def test_a_bias_outside_the_vocabulary_is_a_400_and_the_server_serves_on(demo_server):
    assert_refused(demo_server, "/v1/chat/completions",
                   {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999999": 1}},
                   "logit_bias", "invalid_value")
    assert_refused(demo_server, "/v1/completions", {"model": MODEL, "prompt": "hi", "presence_penalty": 9},
                   "presence_penalty", "invalid_value")


def test_ignore_eos_runs_the_answer_to_its_length(demo_server):
    status, props = demo_server.request("GET", "/props")
    status, eos = demo_server.post("/tokenize", {"content": props["eos_token"], "parse_special": True})
    assert status == 200 and len(eos["tokens"]) == 1, eos
    # the demo target (a code model) never ends by itself: a bias makes it end at once
    body = {"prompt": "def main():\n", "n_predict": 40, "logit_bias": [[eos["tokens"][0], 100]]}
    status, ended = demo_server.post("/completion", body)
    assert status == 200 and ended["stop_type"] == "eos" and ended["tokens_predicted"] < 40, ended
    status, ran = demo_server.post("/completion", {**body, "ignore_eos": True})
    assert status == 200 and ran["stop_type"] == "limit" and ran["tokens_predicted"] == 40, ran
    assert ran["content"].startswith(ended["content"])
    assert_refused(demo_server, "/v1/chat/completions",
                   {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True,
                    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                    "tool_choice": "required"}, "ignore_eos", "invalid_value")


def test_a_bias_on_a_token_the_target_lacks_stops_the_server_starting():
    """`specrun serve -l` is checked once the vocabulary is known, not blamed on every client."""
    import subprocess

    from server_harness import SPECRUN

    done = subprocess.run([*SPECRUN, "serve", "--port", "0", "-l", "99999999+1"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "--logit-bias names token 99999999" in lines[0], done.stderr


def test_mirostat_and_adaptive_p_are_served_and_said_in_llama_server_s_settings(demo_server):
    """The samplers that carry a state along the text, through the server: answered, told in the
    answer's settings as llama-server tells them; a bad version a 400, and the server serves on."""
    # ignore_eos: a sampled answer (whose draws follow the drafts' lengths, the clock's) may end early
    status, body = demo_server.post("/completion", {"prompt": "def main(", "n_predict": 24, "temperature": 0.8,
                                                    "seed": 1, "mirostat": 2, "mirostat_tau": 4, "mirostat_eta": 0.2,
                                                    "ignore_eos": True})
    assert status == 200 and body["tokens_predicted"] == 24, body
    settings = body["generation_settings"]
    assert (settings["mirostat"], settings["mirostat_tau"], settings["mirostat_eta"]) == (2, 4.0, 0.2)
    status, body = demo_server.post("/completion", {
        "prompt": "def main(", "n_predict": 24, "temperature": 0.8, "seed": 1, "min_p": 0.05,
        "samplers": ["min_p", "temperature", "adaptive_p"], "adaptive_target": 0.4, "adaptive_decay": 0.8,
        "ignore_eos": True})
    assert status == 200 and body["tokens_predicted"] == 24, body
    settings = body["generation_settings"]
    assert (settings["adaptive_target"], settings["adaptive_decay"]) == (0.4, 0.8)
    assert settings["samplers"][-1] == "adaptive_p"
    assert_refused(demo_server, "/completion", {"prompt": "hi", "mirostat": 3}, "mirostat", "invalid_value")
    status, body = demo_server.post("/completion", {"prompt": "def main(", "n_predict": 4})
    assert status == 200, body
