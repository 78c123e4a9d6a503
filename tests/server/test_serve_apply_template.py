"""llama-server's POST /apply-template: a chat request's messages, and its tools as the model is
shown them, rendered through the model's chat template (the prompt it would read), unanswered; the
body read as /v1/chat/completions reads it, so a bad field is the same 400."""

from __future__ import annotations

from server_harness import assert_refused

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def test_a_conversation_is_the_prompt_its_template_makes(demo_server):
    status, body = demo_server.post("/apply-template", {"messages": [{"role": "system", "content": "Be brief."},
                                                                     {"role": "user", "content": "Hi"}]})
    assert status == 200, body
    assert body == {"prompt": "system: Be brief.\nuser: Hi\nassistant: "}  # the demo pair's plain template
    status, with_tools = demo_server.post("/apply-template", {"messages": [{"role": "user", "content": "Weather?"}],
                                                              "tools": [WEATHER]})
    assert status == 200 and "get_weather" in with_tools["prompt"] and with_tools["prompt"].endswith("assistant: ")
    status, none = demo_server.post("/apply-template", {"messages": [{"role": "user", "content": "Weather?"}],
                                                        "tools": [WEATHER], "tool_choice": "none"})
    assert status == 200 and "get_weather" not in none["prompt"]  # a tool it may not call is not shown


def test_a_bad_conversation_is_a_400_naming_its_field(demo_server):
    assert_refused(demo_server, "/apply-template", {"messages": []}, "messages", "invalid_value")
    assert_refused(demo_server, "/apply-template", {"messages": [{"role": "user", "content": "x"}], "temperature": 9},
                   "temperature", "invalid_value")


def test_the_template_s_bos_is_left_to_the_model_that_adds_its_own():
    """As llama-server gives the prompt: a template writing its BOS (Llama 3's) has it cut where the
    model adds one itself, so the prompt sent back to /completion reads one BOS, not two; and
    ``add_generation_prompt`` false leaves the assistant's turn unopened."""
    from types import SimpleNamespace

    from specrun.server.native import template_answer
    from specrun.server.requests import ServeDefaults
    from specrun.sessions.templates import ChatTemplate

    template = ChatTemplate("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                            "{% if add_generation_prompt %}<assistant>{% endif %}", bos_token="<s>")
    body = {"messages": [{"role": "user", "content": "hi"}]}
    for add_bos, prompt in ((True, "<user>hi<assistant>"), (False, "<s><user>hi<assistant>")):
        session = SimpleNamespace(template=template, target=SimpleNamespace(vocab=SimpleNamespace(add_bos=add_bos)))
        assert template_answer(session, body, ServeDefaults(), 2048) == {"prompt": prompt}
    session = SimpleNamespace(template=template, target=SimpleNamespace(vocab=SimpleNamespace(add_bos=True)))
    assert template_answer(session, {**body, "add_generation_prompt": False}, ServeDefaults(), 2048) == {
        "prompt": "<user>hi"}
