"""Each request to `specrun serve` is a text of its own: the policy measures its acceptance
afresh and keeps the machine's costs (ChatSession.new_text), as generate does between processes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from specrun.registry.loading import LoadOptions
from specrun.sampling import SamplingSettings
from specrun.server.requests import CompletionRequest
from server_harness import answered
from specrun.server.worker import Done, Failed, Job, PairOptions, PairWorker


def test_each_request_starts_a_new_text_on_the_worker():
    worker = PairWorker(PairOptions("demo-target", "demo-draft", load=LoadOptions(threads=1)))
    worker.start()
    try:
        session = worker.session
        forget = session.new_text
        measured_before = []  # acceptance controllers the policy held as each request began

        def new_text() -> None:
            measured_before.append(len(session.engine.policy.controllers))
            forget()

        session.new_text = new_text

        async def ask(prompt: tuple[int, ...]):
            job = Job(CompletionRequest("demo", 24, SamplingSettings(), prompt=prompt), asyncio.get_running_loop())
            worker.submit(job)
            while not isinstance(event := await job.next_event(), (Done, Failed)):
                pass
            return event, len(session.engine.policy.controllers), dict(session.engine.policy.target_costs.seconds)

        first, held_after_first, costs = asyncio.run(ask((1, 40, 41, 42, 40, 41, 42, 40)))
        second, _, _ = asyncio.run(ask((1, 50, 51, 52, 50, 51, 52, 50)))
        assert isinstance(first, Done) and isinstance(second, Done)
        assert held_after_first > 0 and costs  # the first request measured acceptance and costs
        assert measured_before == [0, held_after_first]  # …then began the second, forgetting its acceptance
        assert session.engine.policy.target_costs.seconds.keys() >= costs.keys()  # the costs were kept
    finally:
        worker.stop()


def test_a_request_that_fails_unexpectedly_fails_alone():
    """Whatever a request raises, it gets a 500 and the worker serves the next one (a tokenizer
    error once ended the worker's thread: every later request waited for ever)."""
    worker = PairWorker(PairOptions("demo-target", None, method="none", load=LoadOptions(threads=1)))
    worker.start()
    try:
        prompt_ids = worker._prompt_ids
        failures = iter([RuntimeError("tokenizer broke")])

        def first_one_fails(job):
            for failure in failures:
                raise failure
            return prompt_ids(job)

        worker._prompt_ids = first_one_fails

        def ask():
            return answered(worker, CompletionRequest("demo", 8, SamplingSettings(), prompt=(1, 40, 41)))[0]

        failed, served = ask(), ask()
        assert isinstance(failed, Failed) and failed.error.status == 500
        assert "tokenizer broke" in failed.error.body()["error"]["message"]
        assert isinstance(served, Done)
    finally:
        worker.stop()


@contextmanager
def worker_with_template(source: str) -> Iterator[PairWorker]:
    """A worker of demo-target whose chat template is ``source``, stopped after."""
    from specrun.sessions.templates import ChatTemplate

    worker = PairWorker(PairOptions("demo-target", None, method="none", load=LoadOptions(threads=1)))
    worker.start()
    try:
        worker.session.template = ChatTemplate(source)
        yield worker
    finally:
        worker.stop()


def test_a_template_that_cannot_render_the_tools_is_a_400_naming_them_and_the_worker_goes_on():
    """A model's chat template that fails on a request's tools (raise_exception in the template):
    that request is a 400 naming ``tools`` and the template's own words; the next request is served."""
    from specrun.sessions.tools import Tool

    with worker_with_template(
        "{% for m in messages %}{% if 'get_weather' in m.content %}{{ raise_exception('no functions here') }}"
        "{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: ") as worker:
        question = ({"role": "user", "content": "Weather in Paris?"},)

        def ask(tools):
            return answered(worker, CompletionRequest("demo", 8, SamplingSettings(), messages=question, tools=tools))[0]

        refused = ask((Tool("get_weather", "The weather", {"type": "object", "properties": {}}),))
        assert isinstance(refused, Failed) and refused.error.status == 400
        error = refused.error.body()["error"]
        assert error["param"] == "tools" and "no functions here" in error["message"], error
        assert isinstance(ask(()), Done)


def test_a_template_that_refuses_the_conversation_is_a_400_with_a_fix_a_client_can_take():
    """It said to use /system and /reset, the chat's commands, to an API client."""
    with worker_with_template(
        "{% for m in messages %}{% if loop.index0 > 0 and m.role == messages[loop.index0 - 1].role %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
        "{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: ") as worker:

        def ask(messages):
            return answered(worker, CompletionRequest("demo", 8, SamplingSettings(), messages=messages))[0]

        twice = ({"role": "user", "content": "Hello"}, {"role": "user", "content": "Are you there?"})
        refused = ask(twice)
        assert isinstance(refused, Failed) and refused.error.status == 400
        error = refused.error.body()["error"]
        assert error["param"] == "messages" and error["code"] == "invalid_value", error
        assert "roles must alternate" in error["message"] and "/system" not in error["message"]
        assert "user and assistant turns in alternation" in error["message"]
        assert isinstance(ask(twice[:1]), Done)


def test_a_template_that_fails_on_its_variables_is_a_400_naming_them():
    """A template that refuses a reasoning_effort it does not know (as gpt-oss's does): the 400
    names chat_template_kwargs, not the messages, with the template's own words; the same
    messages without the variable are served."""
    with worker_with_template(
        "{% if reasoning_effort is defined and reasoning_effort not in ['low', 'high'] %}"
        "{{ raise_exception('reasoning_effort must be low or high') }}{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: ") as worker:
        question = ({"role": "user", "content": "Hello"},)

        def ask(variables):
            return answered(worker, CompletionRequest("demo", 8, SamplingSettings(), messages=question,
                                                      template_variables=variables))[0]

        refused = ask({"reasoning_effort": "max"})
        assert isinstance(refused, Failed) and refused.error.status == 400
        error = refused.error.body()["error"]
        assert error["param"] == "chat_template_kwargs" and error["code"] == "invalid_value", error
        assert "(reasoning_effort)" in error["message"] and "must be low or high" in error["message"], error
        assert isinstance(ask({"reasoning_effort": "low"}), Done)
        assert isinstance(ask({}), Done)


def test_logprobs_are_placed_by_the_text_their_tokens_decode_to():
    """An invalid byte is U+FFFD in the answer, 3 bytes of UTF-8 against the token's 1: counted in
    bytes, every later token's place drifted and a token past a stop string's cut went out."""
    from specrun.server.worker import TokenChoice, _HeldLogprobs

    def entry(piece: bytes):
        return TokenChoice(piece.decode("utf-8", "replace"), piece, -0.5, 0), ()

    held = _HeldLogprobs()
    held.add([entry(b"\xff"), entry(b"ab"), entry(b"cd"), entry(b"\xe2\x82"), entry(b"\xac!")])
    held.passed("\ufffdab")  # a stop string "cd" cut here
    assert [e[0].bytes for e in held.release()] == [b"\xff", b"ab"]
    held.passed("cd\u20ac")  # a token that only begins a character goes out with it
    assert [e[0].bytes for e in held.release()] == [b"cd", b"\xe2\x82", b"\xac!"]


def test_logprobs_held_with_a_tool_call_s_text_go_out_when_a_stop_string_ends_the_answer():
    """A stop string fired while the tool cut held text: the text went out at the end without
    the logprobs of its tokens."""
    from specrun.engine.stats import Stats
    from specrun.server.worker import Delta, ToolCallCut, TokenChoice
    from specrun.sessions.tools import STYLES

    worker = PairWorker(PairOptions("demo-target", None, method="none", load=LoadOptions(threads=1)))
    events = []

    class Recorded(Job):
        def emit(self, event) -> None:
            events.append(event)

    loop = asyncio.new_event_loop()
    job = Recorded(CompletionRequest("demo", 8, SamplingSettings(), prompt=(1, 2)), loop)
    cut = ToolCallCut(STYLES["hermes"], ["f"])
    assert cut.feed("See <tool_call>{not") == "See "  # from the opener on: held
    entries = ((TokenChoice("<tool_call>", b"<tool_call>", -0.1, 7), ()), (TokenChoice("{not", b"{not", -0.2, 8), ()))
    try:
        worker._finish(job, "stop", Stats(), cut, None, 0, entries)
    finally:
        loop.close()
    (delta,) = [event for event in events if isinstance(event, Delta)]
    assert delta.text == "<tool_call>{not" and delta.logprobs == entries  # not a call: the answer's text
