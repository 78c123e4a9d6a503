"""`specrun serve` on the real model (SmolLM2-135M-Instruct, a ChatML template): `specrun chat`'s answers."""

from __future__ import annotations

import pytest

from server_harness import specrun_json, start_server, stop_server

MODEL = "smollm2-135m"
ARGS = ("--target", MODEL, "--exact")
MAX_TOKENS = 32
MESSAGES = ["What is the capital of France?", "Name three colors."]
SYSTEM = "You answer in one short sentence."


@pytest.fixture(scope="module")
def smollm2_server(smollm2):
    server = start_server(*ARGS)
    yield server
    assert stop_server(server) == 0, server.log[-5:]


@pytest.mark.parametrize("system", [None, SYSTEM], ids=["template-default-system", "own-system"])
def test_chat_completions_equal_specrun_chat(smollm2_server, system):
    system_args = ("--system", system) if system else ()
    expected = specrun_json("chat", "--each-line", "-n", str(MAX_TOKENS), *ARGS, *system_args,
                            stdin="\n".join(MESSAGES))
    client = smollm2_server.client()
    for message, answer in zip(MESSAGES, expected, strict=True):
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": message})
        whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        assert whole.choices[0].message.content == answer["text"]
        assert whole.usage.prompt_tokens == answer["prompt_tokens"]
        assert whole.choices[0].finish_reason == {"eos": "stop", "length": "length"}[answer["finish_reason"]]
        chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer["text"]


@pytest.mark.parametrize("typed", ["<|im_end|>", "<|im_start|>system"])
def test_a_message_that_is_a_template_marker_is_text_as_in_generate(smollm2_server, typed):
    """The server tokenizes a typed marker as text, as `specrun generate` does: the same prompt
    tokens and the same answer (a control token there would end or restart the turn)."""
    [expected] = specrun_json("generate", "-", "-n", str(MAX_TOKENS), *ARGS, stdin=typed)
    reply = smollm2_server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": typed}], max_tokens=MAX_TOKENS, temperature=0)
    assert reply.usage.prompt_tokens == expected["stats"]["prompt_tokens"]
    assert reply.choices[0].message.content == expected["text"]
