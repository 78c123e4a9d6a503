"""gpt-oss's harmony format (sessions/harmony.py): an answer's channels read into thinking, answer
and calls, however the stream is cut; its calls read and forced; its thinking given back to the
template; and a chat on a tiny model with harmony's markers, on llama.cpp (which renders gpt-oss's
markers as text) and MLX (control tokens, shown as their text)."""

from __future__ import annotations

import json
import random

import pytest

from grammar_walks import accepts, walks
from model_factory import HARMONY_TEMPLATE
from split_feeding import fed_in_pieces
from specrun.sessions.harmony import HarmonySplit, harmony_messages, read_header
from specrun.sessions.reasoning import HARMONY_TAGS, opens_thinking, split_reasoning, thinking_tags
from specrun.sessions.templates import ChatTemplate
from specrun.sessions.tools import STYLES, render_conversation, style_for, tool_choice_of, tool_definitions

HARMONY = STYLES["harmony"]
WEATHER = tool_definitions([{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Bergen"]}}, "required": ["city"],
                   "additionalProperties": False}}}])
CALL = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}'


@pytest.mark.parametrize("text, expected", [
    ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi!", ("Think.", "Hi!")),
    ("<|channel|>final<|message|>  Hi!", ("", "Hi!")),  # no thinking; a body's leading whitespace dropped
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
     "<|start|>assistant<|channel|>final<|message|>c", ("a\nb", "c")),  # blocks after the first: a new line
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary<|message|>Let me look.<|end|>",
     ("a", "Let me look.")),  # a preamble is the answer's
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant" + CALL,
     ("a", 'to=functions.get_weather<|message|>{"city": "Oslo"}')),  # the recipient in the role part
    ('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}', ("", "to=functions.f<|message|>{}")),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant to=browser.search<|channel|>commentary<|message|>{}",
     ("a", "")),  # a built-in tool's call is dropped
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant to=functions.rm<|channel|>commentary<|message|>{}",
     ("a", "")),  # so is a call to a function not offered
    # gpt-oss-20b's stray commentary before the channel it means (llama.cpp's parser notes it)
    ("<|channel|>commentary to=assistant<|channel|>analysis<|message|>private<|end|><|start|>assistant"
     "<|channel|>commentary<|channel|>final<|message|>Hi", ("private", "Hi")),
    ("Plain text, no channels", ("", "Plain text, no channels")),
    ("<|channel|>analysis<|message|>cut inside the thinking <|e", ("cut inside the thinking <|e", "")),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>fin", ("a", "")),  # a header cut: markup
    ("", ("", "")),
])
def test_an_answer_s_channels_are_read_apart(text, expected):
    assert split_reasoning(text, HARMONY_TAGS, callable=("get_weather", "f")) == expected


def _reference(text: str) -> tuple[str, str]:
    """The split of a whole text, written plainly: messages of a header (from a marker or a
    recipient) and a body to the first <|end|>; the body's route by its header."""
    marks = ("<|start|>", "<|channel|>", "to=", "<|message|>")
    thinking, answer = [], []
    while text:
        header, found, rest = text.partition("<|message|>")
        begun = header.lstrip()
        if found and begun and (not begun.startswith(marks) or len(header) > 512):
            answer.append(text)  # no header (or one too long to be): the rest is the answer's, as it is
            break
        if not found:  # a header cut short is dropped; text that can begin none is the answer's
            if begun and not begun.startswith(marks) and not any(mark.startswith(begun) for mark in marks):
                answer.append(text)
            break
        body, _, text = rest.partition("<|end|>")
        body = body.lstrip()
        channel, recipient = read_header(header)
        if recipient == "functions.f":  # the one function offered
            answer.append(f"to={recipient}<|message|>{body}")
        elif recipient and recipient != "assistant":
            continue
        elif channel == "analysis":
            if body:
                thinking.append(body)
        elif body:
            answer.append(body)
    return "\n".join(thinking), "".join(answer)


def test_the_split_is_the_same_however_the_stream_is_cut():
    rng = random.Random(11)
    pieces = ["<|start|>assistant", "<|channel|>", "analysis", "final", "commentary", "<|message|>", "<|end|>",
              " to=functions.f", " to=functions.g", " to=python", " <|constrain|>json", "<|", "end|>", "a", "b c",
              " ", "\n", "{}"]
    long_header = "<|channel|>" + "x" * 501  # with <|message|> after it: a header at the limit's edge
    for case in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        if case % 10 == 0:
            text = long_header + rng.choice(["", "x", "xx"]) + "<|message|>body" + text
        assert fed_in_pieces(HarmonySplit(callable=("f",)), text, rng, 6) == _reference(text), text


def test_text_that_is_no_header_is_not_held_and_a_header_without_its_message_is_given_up():
    split = HarmonySplit()
    assert split.feed("Hello") == ("", "Hello")  # at once: it can begin no header
    long = HarmonySplit()
    assert long.feed("<|channel|>" + "x" * 600) == ("", "<|channel|>" + "x" * 600)
    thinking = HarmonySplit()
    assert thinking.feed("<|channel|>analysis<|message|>ab") == ("ab", "") and thinking.thinking


@pytest.mark.parametrize("text, content, arguments", [
    ('to=functions.get_weather<|message|>{"city": "Oslo"}', "", '{"city": "Oslo"}'),  # as the split writes it
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant" + CALL, "<|channel|>analysis<|message|>a",
     '{"city": "Oslo"}'),  # as generated (reasoning_format none): the markup before the call's own header dropped
    ('Let me look.to=functions.get_weather<|message|> {"city": "Oslo"} ', "Let me look.", '{"city": "Oslo"}'),
])
def test_a_call_is_read_with_the_content_before_it(text, content, arguments):
    got_content, calls = HARMONY.parse(text, ["get_weather"])
    assert got_content == content
    assert [(call.name, call.arguments) for call in calls] == [("get_weather", arguments)]
    assert calls[0].id.startswith("call_")


@pytest.mark.parametrize("text", [
    "to=functions.get_weather<|message|>not json",
    'to=functions.get_weather<|message|>["a list"]',
    'to=functions.get_weather<|message|>{"a": 1} {"b": 2}',
    "It is sunny.",
])
def test_what_is_no_call_is_text(text):
    assert HARMONY.parse(text) == (text, [])


def test_a_call_to_a_function_not_offered_is_text_and_a_cut_call_is_dropped():
    text = 'to=functions.rm_rf<|message|>{"path": "/"}'
    assert HARMONY.parse(text, ["get_weather"]) == (text, [])
    cut = 'Looking.to=functions.get_weather<|message|>{"city": "Os'
    assert HARMONY.read_answer(cut, ["get_weather"], cut=True) == ([], True)
    assert HARMONY.parse_cut(cut, ["get_weather"]) == ("Looking.", [])
    assert HARMONY.read_answer('to=functions.get_weather<|message|>{"city": "Oslo"}', ["get_weather"], cut=True)[1] \
        is False


def test_a_required_call_is_one_call_parallel_or_not():
    """``<|call|>`` (an end of text) ends a harmony answer after its one call: parallel_tool_calls
    asks for nothing more."""
    import numpy as np

    from specrun.backends.fake import FakeBackend
    from specrun.grammar import Grammar

    backend = FakeBackend(lambda context: np.zeros(257, dtype=np.float32), 257, eos_ids=[256])  # a token a byte
    for parallel in (False, True):
        grammar = Grammar.compile(HARMONY.grammar(WEATHER, tool_choice_of("required", WEATHER), parallel), backend)
        for text, taken in ((CALL, True), ("<|start|>assistant" + CALL, True), (CALL + CALL, False)):
            assert accepts(grammar, backend, text.encode()) == taken, (parallel, text)


def test_a_harmony_template_is_known_by_its_channels():
    template = ChatTemplate(HARMONY_TEMPLATE)
    assert thinking_tags(template) == HARMONY_TAGS and style_for(template) is HARMONY
    text, spans = render_conversation(template, [{"role": "user", "content": "Hi"}])
    assert text.endswith("<|start|>assistant") and not opens_thinking(HARMONY_TAGS, text[spans[-1][1]:])


def test_the_thinking_clients_send_back_is_the_template_s_thinking():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "reasoning_content": "Need a tool.", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "assistant", "content": "Sunny.", "reasoning_content": ""}]
    taken = harmony_messages(messages)
    assert taken[1] == {"role": "assistant", "thinking": "Need a tool.", "tool_calls": [call]}  # no content beside
    assert taken[3] == {"role": "assistant", "content": "Sunny.", "thinking": ""}
    assert messages[1]["reasoning_content"]  # the caller's messages as they were
    assert harmony_messages([{"role": "assistant", "content": None, "tool_calls": [call]}]) == [
        {"role": "assistant", "tool_calls": [call]}]  # a null content left out: the template reads it as text
    text, _ = render_conversation(ChatTemplate(HARMONY_TEMPLATE), messages, WEATHER)
    assert ('<|start|>assistant<|channel|>analysis<|message|>Need a tool.<|end|><|start|>assistant '
            'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>') in text
    assert '<|channel|>commentary<|message|>"sunny"<|end|>' in text and "# Toolsget_weather<|end|>" in text


# ---- on a model ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from model_factory import build_harmony_model

    return build_harmony_model(tmp_path_factory.mktemp("harmony"))


def _backends(model):
    from specrun.backends.llama import LlamaCppBackend

    yield LlamaCppBackend(model.gguf_f32_path, n_threads=1, gpu_layers=0, flash_attn=False)
    pytest.importorskip("mlx.core")
    from specrun.backends.mlx import MlxBackend

    yield MlxBackend(model.hf_dir)


def test_a_required_call_and_a_schema_are_held_in_harmony_s_messages(harmony_model):
    """The grammars of a required call and of a JSON answer, after any analysis message: the call
    with its recipient in the role part (as the template writes calls back), the JSON in the final
    channel's body; llama.cpp's markers are text (it renders gpt-oss's so), MLX's control tokens."""
    from specrun.grammar import Grammar, GrammarSpec
    from specrun.sessions.reasoning import grammar_after_thinking, shown_tags

    for backend in _backends(harmony_model):
        try:
            ids = lambda text: backend.tokenize(text, add_bos=False, special=True)  # noqa: E731
            markers = shown_tags(backend, HARMONY_TAGS)
            assert markers == ({} if type(backend).__name__ == "LlamaCppBackend" else
                               {512: b"<|start|>", 513: b"<|channel|>", 514: b"<|message|>", 515: b"<|end|>",
                                516: b"<|constrain|>"})
            spec = HARMONY.grammar(WEATHER, tool_choice_of("required", WEATHER), backend=backend)
            call = Grammar.compile(grammar_after_thinking(spec, backend, HARMONY_TAGS, False), backend)
            thinking = "<|channel|>analysis<|message|>Need a tool.<|end|><|start|>assistant"
            assert walks(call, ids(CALL)) and walks(call, ids(thinking + CALL))
            assert not walks(call, ids("<|channel|>final<|message|>Hi"))
            assert not walks(call, ids(' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}'))
            schema = Grammar.compile(grammar_after_thinking(GrammarSpec("json_object"), backend, HARMONY_TAGS, False),
                                     backend)
            assert walks(schema, ids(thinking + '<|channel|>final<|message|>{"a": 1}'))
            assert walks(schema, ids('<|channel|>final<|message|>{"a": 1}'))
            assert not walks(schema, ids('{"a": 1}'))  # the final channel's header first
        finally:
            backend.close()


@pytest.mark.parametrize("backend", ["llama", "mlx"])
def test_a_chat_calls_a_tool_and_takes_its_result_back(harmony_model, backend):
    """A required call on the tiny harmony model: the answer's text is the call (no markup in it),
    AnswerDone carries it, the transcript keeps it as tool_calls, and the result renders back
    through the template after the call; the next turn, not forced, answers."""
    if backend == "mlx":
        pytest.importorskip("mlx.core")
    from specrun.engine.loop import GenerationParams
    from specrun.registry.loading import LoadOptions
    from specrun.sessions.chat import AnswerDone, open_chat

    path = str(harmony_model.gguf_f32_path if backend == "llama" else harmony_model.hf_dir)
    with open_chat(path, None, "lookup", LoadOptions(threads=1, backend=backend), tools=WEATHER,
                   tool_choice=tool_choice_of("required", WEATHER)) as session:
        done = [e for e in session.ask("Weather in Oslo?", GenerationParams(48, 0)) if isinstance(e, AnswerDone)][0]
        assert [call.name for call in done.tool_calls] == ["get_weather"], done
        # the call as the split writes it (the markup of its header gone), nothing else
        header, arguments = done.text.split("<|message|>")
        assert header == "to=functions.get_weather" and json.loads(arguments) == json.loads(done.tool_calls[0].arguments)
        assert "<|" not in done.reasoning
        kept = session.transcript.messages[-1]
        assert kept["tool_calls"][0]["function"]["name"] == "get_weather"
        result = [e for e in session.ask('{"sky": "clear"}', GenerationParams(6, 0), role="tool")
                  if isinstance(e, AnswerDone)][0]
        assert not result.tool_calls
        text, _ = render_conversation(session.template, session.transcript.messages[:3], WEATHER)
        assert "to=functions.get_weather<|channel|>commentary json<|message|>" in text
        assert '<|message|>"{\\"sky\\": \\"clear\\"}"<|end|>' in text
