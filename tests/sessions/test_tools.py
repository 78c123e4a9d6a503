"""Tool calls (issue 52): definitions rendered through a template that takes them or through the
system message, calls read back in the Hermes, Llama 3, Mistral and pythonic (Gemma's) formats,
and the grammar that forces a call whose arguments follow their schema."""

from __future__ import annotations

import ast
import json
import re

import jsonschema
import llguidance
import numpy as np
import pytest

from grammar_walks import accepts
from specrun.backends.fake import FakeBackend

from specrun.errors import ChatTemplateError, UsageError
from specrun.grammar import Grammar, GrammarError, Vocabulary
from specrun.sessions.templates import ChatTemplate
from specrun.sessions.tools import (
    CALL_FILENAME, STYLES, Tool, ToolCall, ToolChoice, ToolTemplateError, render_conversation, renders_tools, style_for,
)

WEATHER = Tool("get_weather", "The weather in a city", {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"],
    "additionalProperties": False})
TIME = Tool("get_time", "The time in a time zone", {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}}, "required": ["zone"]})

# A Qwen-style template that renders tools, calls and results itself (the shape of Qwen2.5's)
QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}"
    "<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{%- elif message.tool_calls %}<|im_start|>assistant\n{%- for call in message.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
# Mistral's templates refuse a call or a result whose id is not nine letters or digits
_NINE = ("{%- if {0} is not defined or {0} | length != 9 %}"
         "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}")
MISTRAL_LIKE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}[INST]{%- if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}"
    "[/AVAILABLE_TOOLS]{%- endif %}{{ message.content }}[/INST]"
    "{%- elif message.role == 'tool' %}" + _NINE.replace("{0}", "message.tool_call_id")
    + '[TOOL_RESULTS]{"content": {{ message.content | tojson }}, "call_id": "{{ message.tool_call_id }}"}'
    "[/TOOL_RESULTS]"
    "{%- elif message.tool_calls %}[TOOL_CALLS][{%- for call in message.tool_calls %}"
    + _NINE.replace("{0}", "call.id")
    + '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}, '
    '"id": "{{ call.id }}"}{%- if not loop.last %}, {% endif %}{%- endfor %}]</s>'
    "{%- else %}{{ message.content }}</s>{%- endif %}{%- endfor %}"
)
PLAIN = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}assistant: "
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "C"}'}}]},
    {"role": "tool", "content": '{"temperature": 21}', "tool_call_id": "call_1"},
]


@pytest.mark.parametrize(("style", "text", "content", "calls"), [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n'
               '</tool_call>', "Let me look.", [("get_weather", {"city": "Oslo", "unit": "C"})]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", '
               '"arguments": "{\\"x\\": 1}"}\n</tool_call>', "", [("a", {}), ("b", {"x": 1})]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {"x": 1}}', "", [("a", {"x": 1})]),  # cut at max_tokens
    ("hermes", "Just text, no call.", "Just text, no call.", []),
    ("hermes", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    ("llama3", '{"name": "get_time", "parameters": {"zone": "UTC"}}', "", [("get_time", {"zone": "UTC"})]),
    ("llama3", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"y": 2}}', "",
     [("a", {}), ("b", {"y": 2})]),
    ("llama3", "The answer is 4.", "The answer is 4.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}]', "", [("get_time", {"zone": "CET"})]),
    ("mistral", '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]', "", [("a", {}), ("b", {})]),
    ("mistral", "[1, 2, 3]", "[1, 2, 3]", []),  # JSON that is not calls stays the answer
    ("pythonic", '[get_weather(city="Oslo", unit="C")]', "", [("get_weather", {"city": "Oslo", "unit": "C"})]),
    ("pythonic", "[a(), b(x=-2.5, y=True, z=None, w=null, v=('p', 'q'), d={'k': [false]})]", "",
     [("a", {}), ("b", {"x": -2.5, "y": True, "z": None, "w": None, "v": ["p", "q"], "d": {"k": [False]}})]),
    ("pythonic", 'Let me check.\n```tool_code\nprint(get_time(zone="UTC"))\n```', "Let me check.",
     [("get_time", {"zone": "UTC"})]),
    ("pythonic", '```tool_code\na(s="x\\/y")\nb(n=1)\n```', "", [("a", {"s": "x/y"}), ("b", {"n": 1})]),  # JSON's escapes
    ("pythonic", '  \n [a(s="x\\/y", t="\u00e9")]', "", [("a", {"s": "x/y", "t": "\u00e9"})]),  # read where parsed
    ("pythonic", '[get_time(zone="UTC")', '[get_time(zone="UTC")', []),  # cut short: not a call
    # Gemma writes on after its call (the call was lost as text): the call, the rest dropped as Hermes' is
    ("pythonic", '[get_weather(city="Oslo")]\nLet me check that for you.', "", [("get_weather", {"city": "Oslo"})]),
    ("pythonic", '[get_weather(city="a]b", unit="c")] staan\n```tool_output', "",
     [("get_weather", {"city": "a]b", "unit": "c"})]),
    ("pythonic", "[link](https://example.com) says so.", "[link](https://example.com) says so.", []),
    ("pythonic", "[f(x=g())] then", "[f(x=g())] then", []),
    ("pythonic", 'Sure!\n[get_weather(city="Oslo")]', 'Sure!\n[get_weather(city="Oslo")]', []),  # streamed as text
    ("pythonic", "Call f(x=1) when ready.", "Call f(x=1) when ready.", []),  # prose naming a call stays prose
    ("pythonic", "[f(1)]", "[f(1)]", []),  # positional arguments: the names are unknown
    ("pythonic", "[f(x=g())]", "[f(x=g())]", []),  # only literals: nothing is run
    ("pythonic", "[f(**k)]", "[f(**k)]", []),
    ("pythonic", '[f(a=1, **{"user-id": 2, "from": null})]', "", [("f", {"a": 1, "user-id": 2, "from": None})]),
    ("pythonic", '[f(a=1, **{"a": 2})]', '[f(a=1, **{"a": 2})]', []),  # twice, one of them unpacked
    ("pythonic", '[f(**{"a": 1, "a": 2})]', '[f(**{"a": 1, "a": 2})]', []),
    ("pythonic", "[f(**{1: 2})]", "[f(**{1: 2})]", []),
    ("pythonic", "[f(a=1, a=2)]", "[f(a=1, a=2)]", []),  # an argument twice: which was meant is unknown
    ("pythonic", "Ok.\n```tool_code\nf(y=2)\n```\n```tool_code\ng(z=3)\n```", "Ok.", [("f", {"y": 2}), ("g", {"z": 3})]),
    ("pythonic", "```tool_code\nf(y=2)\n``` and ```tool_code\ng(z=3)\n```",
     "```tool_code\nf(y=2)\n``` and ```tool_code\ng(z=3)\n```", []),  # text between: none dropped silently
    ("pythonic", "[f(v=1E400)]", "[f(v=1E400)]", []),  # infinity: JSON cannot write it back
    ("hermes", '<tool_call>{"name": "f", "arguments": {"v": -1e999}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"v": -1e999}}</tool_call>', []),
    ("llama3", '; {"name": "a", "parameters": {}}', '; {"name": "a", "parameters": {}}', []),  # not how a call begins
    ("mistral", '{"name": "a", "arguments": {}}', "", [("a", {})]),
    ("pythonic", "[1, 2]", "[1, 2]", []),
])
def test_calls_are_read_in_each_style(style, text, content, calls):
    got_content, got_calls = STYLES[style].parse(text)
    assert got_content == content
    assert [(call.name, json.loads(call.arguments)) for call in got_calls] == calls


def test_earlier_pythonic_calls_are_written_as_python_that_reads_back_as_the_same_calls():
    """A client's earlier calls written into Gemma's prompt: valid Python the reader takes back,
    argument names Python cannot write as keywords (``user-id``, ``from``) among them."""
    calls = [{"function": {"name": "f", "arguments": json.dumps({"user-id": 7, "a": "x", "from": None})}},
             {"function": {"name": "g", "arguments": "{}"}}]
    text = STYLES["pythonic"].written(calls)
    assert text == '[f(a="x", **{"user-id": 7, "from": null}), g()]'
    assert ast.parse(text).body  # Python takes it (null is a name there)
    _, read = STYLES["pythonic"].parse(text)
    assert [(call.name, json.loads(call.arguments)) for call in read] == [
        ("f", {"a": "x", "user-id": 7, "from": None}), ("g", {})]


def test_a_call_in_openai_s_shape_carries_its_arguments_as_json_text():
    shaped = ToolCall("f", '{"a": 1}').as_openai()
    assert shaped["type"] == "function" and shaped["id"].startswith("call_")
    assert shaped["function"] == {"name": "f", "arguments": '{"a": 1}'}


def test_a_template_that_takes_tools_renders_them_calls_and_results_itself():
    template = ChatTemplate(QWEN_LIKE)
    assert renders_tools(template) and style_for(template) is STYLES["hermes"]
    text, spans = render_conversation(template, CONVERSATION, (WEATHER,))
    assert '"name": "get_weather"' in text.split("<|im_end|>")[0]  # the definition, in the system block
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}' in text
    assert "<tool_response>\n{\"temperature\": 21}\n</tool_response>" in text
    assert [text[a:b] for a, b in spans][:1] == ["Weather in Paris?"]


def test_a_template_without_tools_gets_them_in_its_system_message_and_earlier_calls_written_out():
    template = ChatTemplate(PLAIN)
    assert not renders_tools(template) and style_for(template) is STYLES["hermes"]
    text, _ = render_conversation(template, CONVERSATION, (WEATHER, TIME))
    assert text.startswith("system: You may call functions")
    assert text.count('"type": "function"') == 2
    assert 'assistant: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}' in text
    assert 'user: <tool_response>\n{"temperature": 21}\n</tool_response>' in text
    # without tools the conversation renders as it always did
    assert render_conversation(template, CONVERSATION[:1])[0] == "user: Weather in Paris?\nassistant: "


def test_a_template_without_a_system_role_gets_the_tools_in_the_first_user_message():
    """Gemma 2's template refuses a system message: the tools head the first user message instead,
    and a turn's tool results go back as one user message, so roles still alternate (in the
    pythonic style, Gemma's)."""
    gemma_like = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
        "<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}<start_of_turn>model\n")
    two_results = [*CONVERSATION[:2], {**CONVERSATION[1], "tool_calls": CONVERSATION[1]["tool_calls"] * 2},
                   CONVERSATION[2], {"role": "tool", "content": '{"humidity": 40}', "tool_call_id": "call_2"}]
    del two_results[1]
    text, _ = render_conversation(gemma_like, two_results, (WEATHER,))
    assert text.startswith("<start_of_turn>user\nYou may call functions")
    assert text.rstrip().endswith("<start_of_turn>model")
    assert text.count("<start_of_turn>user") == 2  # the question, then both results in one message
    assert '```tool_output\n{"temperature": 21}\n```\n```tool_output\n{"humidity": 40}\n```' in text


def test_a_template_that_fails_on_tools_is_one_error_saying_so():
    refusing = ChatTemplate("{% for m in messages %}{% if 'function' in m.content %}"
                            "{{ raise_exception('no functions here') }}{% endif %}{{ m.content }}{% endfor %}")
    with pytest.raises(ToolTemplateError) as caught:
        render_conversation(refusing, CONVERSATION[:1], (WEATHER,))
    assert isinstance(caught.value, ChatTemplateError)
    assert "cannot render tools" in caught.value.one_line() and "no functions here" in caught.value.one_line()


@pytest.mark.parametrize("text", ["[" * 5000, "<tool_call>x" + " " * 40_000 + "y", "; " * 100_000])
def test_reading_calls_from_hostile_text_is_quick_and_finds_none(text):
    import time

    for style in STYLES.values():
        started = time.perf_counter()
        assert style.parse(text, ["get_weather"])[1] == []
        assert time.perf_counter() - started < 1.0


@pytest.mark.parametrize("text", ["[" + ", ".join(["f(x=1)"] * 20_000) + "]", "```tool_code\n" + "f(x=1)\n" * 20_000])
def test_thousands_of_python_calls_are_read_in_linear_time(text):
    """Each argument's text is sliced by its position: ast.get_source_segment split the whole
    answer at every argument (20,000 calls: minutes)."""
    import time

    started = time.perf_counter()
    assert len(STYLES["pythonic"].parse(text, ["f"])[1]) == 20_000
    assert time.perf_counter() - started < 10.0


def test_only_calls_to_defined_functions_count_and_mistral_ids_are_nine_letters_or_digits():
    text = '[{"name": "launch", "arguments": {}}]'
    assert STYLES["mistral"].parse(text, ["get_weather"])[1] == []
    (call,) = STYLES["mistral"].parse(text.replace("launch", "get_weather"), ["get_weather"])[1]
    assert len(call.id) == 9 and call.id.isalnum()
    (hermes,) = STYLES["hermes"].parse('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>')[1]
    assert hermes.id.startswith("call_")


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("choice", [ToolChoice("required"), ToolChoice("function", "get_time")])
def test_a_required_call_s_grammar_accepts_exactly_calls_whose_arguments_follow_their_schema(style, choice):
    """The grammar's texts parse back as calls to the functions allowed, arguments valid; a call to
    another function or with arguments the schema refuses is not one of its texts."""
    backend = FakeBackend(lambda context: np.zeros(257, dtype=np.float32), 257, eos_ids=[256])  # a token a byte
    grammar = Grammar.compile(STYLES[style].grammar((WEATHER, TIME), choice), backend)
    key = STYLES[style].arguments_key
    good = {"name": "get_time", key: {"zone": "UTC"}}
    other = {"name": "get_weather", key: {"city": "Rome", "unit": "C"}}
    bad_arguments = {"name": "get_time", key: {"zone": 5}}

    def written(call: dict) -> str:
        body = json.dumps(call)
        if style == "pythonic":
            return STYLES[style].written([{"function": call}])
        if style == "harmony":  # a message to the function, its body the arguments
            return f" to=functions.{call['name']}<|channel|>commentary json<|message|>{json.dumps(call[key])}"
        return {"hermes": f"<tool_call>\n{body}\n</tool_call>", "mistral": f"[{body}]"}.get(style, body)

    def accepted(text: str) -> bool:
        matcher = llguidance.LLMatcher(Vocabulary.of(backend).tokenizer, grammar.spec.llguidance_grammar(), log_level=0)
        return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()

    assert accepted(written(good))
    assert accepted(written(other)) == (choice.mode == "required")
    assert not accepted(written(bad_arguments))
    _, calls = STYLES[style].parse(written(good))
    jsonschema.validate(json.loads(calls[0].arguments), TIME.parameters)


def test_allowed_tools_narrow_what_may_be_called():
    from specrun.sessions.tools import ToolDefinitionError, tool_choice_of

    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "get_time"}}, {"type": "function", "function": {"name": "get_time"}}]}}
    choice = tool_choice_of(allowed, (WEATHER, TIME))
    assert choice == ToolChoice("required", allowed=("get_time",)) and choice.forces_a_call
    assert choice.callable((WEATHER, TIME)) == [TIME] and not choice.allows("get_weather")
    auto = tool_choice_of({"type": "allowed_tools", "allowed_tools": {"tools": [
        {"type": "function", "function": {"name": "get_weather"}}]}}, (WEATHER, TIME))
    assert auto.mode == "auto" and not auto.forces_a_call and auto.callable((WEATHER, TIME)) == [WEATHER]
    other = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'  # on auto, a call to another is text
    assert STYLES["hermes"].parse(other, [tool.name for tool in auto.callable((WEATHER, TIME))]) == (other, [])
    assert ToolChoice().callable((WEATHER, TIME)) == [WEATHER, TIME] and ToolChoice("none").callable((WEATHER,)) == []
    assert ToolChoice("function", "get_time").callable((WEATHER, TIME)) == [TIME]
    with pytest.raises(ToolDefinitionError, match="which tools does not define"):
        tool_choice_of({"type": "allowed_tools", "allowed_tools": {"tools": [
            {"type": "function", "function": {"name": "launch"}}]}}, (WEATHER,))
    # a required call among them: its grammar calls those alone
    backend = FakeBackend(lambda context: np.zeros(257, dtype=np.float32), 257, eos_ids=[256])
    grammar = Grammar.compile(STYLES["hermes"].grammar((WEATHER, TIME), choice), backend)

    def accepted(call: dict) -> bool:
        return accepts(grammar, backend, f"<tool_call>\n{json.dumps(call)}\n</tool_call>".encode())

    assert accepted({"name": "get_time", "arguments": {"zone": "UTC"}})
    assert not accepted({"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}})


@pytest.mark.parametrize("style", [name for name in STYLES if name != "harmony"])  # harmony: one a message
def test_a_required_call_is_one_call_unless_parallel_calls_are_asked_for(style):
    backend = FakeBackend(lambda context: np.zeros(257, dtype=np.float32), 257, eos_ids=[256])
    key = STYLES[style].arguments_key
    one = json.dumps({"name": "get_time", key: {"zone": "UTC"}})
    two = {"hermes": f"<tool_call>\n{one}\n</tool_call>\n<tool_call>\n{one}\n</tool_call>",
           "mistral": f"[{one}, {one}]", "llama3": f"{one}; {one}",
           "pythonic": '[get_time(zone="UTC"), get_time(zone="UTC")]'}[style]

    def accepted(parallel: bool) -> bool:
        grammar = Grammar.compile(STYLES[style].grammar((TIME,), ToolChoice("required"), parallel), backend)
        matcher = llguidance.LLMatcher(Vocabulary.of(backend).tokenizer, grammar.spec.llguidance_grammar(), log_level=0)
        return matcher.consume_tokens(list(two.encode())) and matcher.is_accepting()

    assert accepted(parallel=True) and not accepted(parallel=False)
    assert len(STYLES[style].parse(two)[1]) == 2


GEMMA_LIKE = ChatTemplate(
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{{ m.content }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_gemma_s_template_gets_calls_in_python_and_results_as_tool_output_blocks():
    """Gemma's templates take no tools; Google's guide prompts it to call functions as a Python
    list: the instruction says so, earlier calls are written that way (and read back the same),
    results come back in ```tool_output blocks."""
    assert style_for(GEMMA_LIKE) is STYLES["pythonic"]
    text, _ = render_conversation(GEMMA_LIKE, CONVERSATION, (WEATHER,))
    assert "Python list of calls" in text and '"name": "get_weather"' in text
    assert '<start_of_turn>model\n[get_weather(city="Paris", unit="C")]<end_of_turn>' in text
    assert '<start_of_turn>user\n```tool_output\n{"temperature": 21}\n```<end_of_turn>' in text
    (call,) = STYLES["pythonic"].parse('[get_weather(city="Paris", unit="C")]', ["get_weather"])[1]
    assert json.loads(call.arguments) == json.loads(CONVERSATION[1]["tool_calls"][0]["function"]["arguments"])
    assert call.id.startswith("call_")


def test_a_python_call_s_grammar_writes_arguments_in_schema_order_the_required_ones_always():
    backend = FakeBackend(lambda context: np.zeros(257, dtype=np.float32), 257, eos_ids=[256])
    forecast = Tool("forecast", "", {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1},
        "unit": {"enum": ["C", "F"]}, "hourly": {"type": "boolean"}}, "required": ["days"]})
    anything = Tool("note", "", {"type": "object"})  # no properties: any keyword arguments
    spec = STYLES["pythonic"].grammar((forecast, anything), ToolChoice("required"))
    grammar = Grammar.compile(spec, backend)

    def accepted(text: str) -> bool:
        matcher = llguidance.LLMatcher(Vocabulary.of(backend).tokenizer, grammar.spec.llguidance_grammar(), log_level=0)
        return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()

    good = ['[forecast(days=3)]', '[forecast(city="Oslo", days=2)]', '[forecast(days=1, unit="F", hourly=true)]',
            '[forecast(city="Rome", days=5, unit="C", hourly=false)]', '[note()]', '[note(text="hi", n=2)]']
    bad = ['[forecast()]', '[forecast(city="Oslo")]', '[forecast(days=0)]', '[forecast(unit="C", days=2)]',
           '[forecast(days=2, unit="K")]', '[forecast(days=2, extra=1)]', '[forecast(days=2), note()]']
    assert [text for text in good if not accepted(text)] == []
    assert [text for text in bad if accepted(text)] == []
    for text in good:  # what the grammar writes reads back as the call, arguments valid
        (call,) = STYLES["pythonic"].parse(text)[1]
        if call.name == "forecast":
            jsonschema.validate(json.loads(call.arguments), forecast.parameters)


@pytest.mark.parametrize(("parameters", "good", "bad"), [
    ({"type": "object"}, ['[f()]', '[f(a=1, b="x")]', '[f(from_=1)]'], ['[f(from=1)]', '[f(True=1)]', '[f(None=2)]']),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, ['[f(a=1)]'], ['[f(a="s")]']),
    ({"type": "object", "required": ["a"]}, ['[f(a=[1])]'], ['[f()]', '[f(b=1)]']),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": False}}, ['[f(a=1)]', '[f()]'], ['[f(b=1)]']),
    ({"type": "object", "properties": {"name": {"type": "string"}, "child": {"$ref": "#"}}, "required": ["name"]},
     ['[f(name="a", child={"name": "b", "child": {"name": "c"}})]', '[f(name="a")]'],
     ['[f(child={"name": "b"})]', '[f(name="a", child={"name": 5})]']),
    ({"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}, "q": {"$ref": "#/properties/p"}},
      "$defs": {"P": {"type": "integer"}}}, ['[f(p=1, q=2)]'], ['[f(q="x")]']),
])
def test_a_python_call_s_grammar_reads_back_what_it_writes_whatever_the_schema(parameters, good, bad):
    """Schemas without properties, extra properties, required names only, a property that takes
    nothing, $refs into the whole schema: every call the grammar writes is read back as written."""
    backend = FakeBackend(lambda context: np.zeros(257, dtype=np.float32), 257, eos_ids=[256])
    grammar = Grammar.compile(STYLES["pythonic"].grammar((Tool("f", "", parameters),), ToolChoice("required")), backend)

    def accepted(text: str) -> bool:
        matcher = llguidance.LLMatcher(Vocabulary.of(backend).tokenizer, grammar.spec.llguidance_grammar(), log_level=0)
        return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()

    assert [text for text in good if not accepted(text)] == []
    assert [text for text in bad if accepted(text)] == []
    for text in good:
        (call,) = STYLES["pythonic"].parse(text, ["f"])[1]
        jsonschema.validate(json.loads(call.arguments), parameters)


@pytest.mark.parametrize("style", ["hermes", "mistral"])
def test_a_json_call_s_grammar_follows_arguments_that_refer_into_their_schema(style):
    """Pydantic's schemas refer to their own $defs: inside the call's object they pointed nowhere."""
    backend = FakeBackend(lambda context: np.zeros(257, dtype=np.float32), 257, eos_ids=[256])
    parameters = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"],
                  "$defs": {"P": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
    grammar = Grammar.compile(STYLES[style].grammar((Tool("f", "", parameters),), ToolChoice("required")), backend)

    def accepted(arguments: dict) -> bool:
        body = json.dumps({"name": "f", "arguments": arguments})
        text = f"<tool_call>\n{body}\n</tool_call>" if style == "hermes" else f"[{body}]"
        matcher = llguidance.LLMatcher(Vocabulary.of(backend).tokenizer, grammar.spec.llguidance_grammar(), log_level=0)
        return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()

    assert accepted({"p": {"n": 1}}) and not accepted({"p": {"n": "x"}}) and not accepted({})


@pytest.mark.parametrize(("tool", "named"), [
    (Tool("get-weather"), "get-weather"), (Tool("import"), "import"),
    (Tool("f", "", {"type": "object", "properties": {"first-name": {}}}), "first-name"),
    (Tool("f", "", {"type": "object", "properties": {"from": {}}}), "from"),  # a keyword: `from=1` does not parse
])
def test_a_name_python_cannot_write_is_one_error_where_a_python_call_is_required(tool, named):
    with pytest.raises(GrammarError) as caught:
        STYLES["pythonic"].grammar((tool,), ToolChoice("required"))
    assert "Python" in caught.value.one_line() and repr(named) in caught.value.one_line()


def test_an_answer_held_whole_keeps_its_content_before_the_call():
    from specrun.server.worker import ToolCallCut

    cut = ToolCallCut(STYLES["pythonic"], ["f"])
    assert cut.feed("[Note] I will check.\n") + cut.feed("```tool_code\nf(x=1)\n```") == ""
    rest, (call,) = cut.finish()
    assert rest == "[Note] I will check." and call.name == "f"


@pytest.mark.parametrize(("style", "chunks", "content", "calls"), [
    # two calls whole, the third cut off by max_tokens: the two, the third's markup dropped
    ("hermes", ['<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n',
                '<tool_call>{"name": "g", "arguments": {}}</tool_call>\n<tool_call>{"name": "f", "argu'], "",
     ["f", "g"]),
    ("hermes", ["Let me check.", '<tool_call>{"name": "f", "argu'], "", []),  # the content went out already
    ("hermes", ["<tool_call"], "", []),  # the opener itself cut short
    ("hermes", ["<"], "", []),
    ("pythonic", ["[f(x=1), g(y="], "", ["f"]),  # a bare list held whole, cut: the call closed before it
    ("pythonic", ["[f(x=", "1"], "", []),
    ("llama3", ['{"name": "f", "param'], "", []),
    ("llama3", ['{"name": "f", "parameters": {}}; {"name": "g", "param'], "", ["f"]),
    ("mistral", ['[{"name": "g", "arguments": {}}, {"name": "f", "argu'], "", ["g"]),
])
def test_an_answer_cut_inside_its_calls_gives_the_calls_whole_and_no_markup(style, chunks, content, calls):
    """max_tokens reached inside a call (the server's tool_choice required, a named function, or
    a model calling on its own): the calls closed before the cut are calls, and nothing of the one
    cut off reaches the client as content."""
    from specrun.server.worker import ToolCallCut

    cut = ToolCallCut(STYLES[style], ["f", "g"])
    sent = "".join(cut.feed(chunk) for chunk in chunks)
    rest, found = cut.finish(cut=True)
    assert "<tool" not in sent + rest and "{" not in sent + rest and "[" not in sent + rest
    assert rest == content and [call.name for call in found] == calls
    whole = ToolCallCut(STYLES[style], ["f", "g"])  # not cut: what was held and not a call is the answer
    sent = "".join(whole.feed(chunk) for chunk in chunks)
    rest, found = whole.finish()
    if not [c for c in found]:
        assert sent + rest == "".join(chunks)


def test_reading_python_calls_in_threads_leaves_the_process_s_warning_filters_alone():
    """JSON's "\\/" warns as Python compiles it: silenced by a filter for the calls' text alone
    (catch_warnings in the server's threads left an "ignore everything" filter behind)."""
    import threading
    import warnings

    before = list(warnings.filters)
    threads = [threading.Thread(target=lambda: [STYLES["pythonic"].parse('[f(s="x\\/y")]') for _ in range(200)])
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert warnings.filters == before
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        warnings.filterwarnings("ignore", module=re.escape(CALL_FILENAME) + r"\Z")  # what the module sets
        STYLES["pythonic"].parse('[f(s="x\\/y")]')
    assert caught == []


@pytest.mark.parametrize(("style", "chunks", "streamed", "calls"), [
    # content streams, the call is held from its opener on
    ("hermes", ["Let me ", "look.<tool", '_call>{"name": "f", "arguments": {}}</tool_call>'], "Let me look.", ["f"]),
    ("pythonic", ["Sure.\n``", "`tool_code\nf(x=1)\n```"], "Sure.\n", ["f"]),
    # an answer that begins as a bare call could is held whole, whitespace and all
    ("pythonic", ["  ", "[f(x=", "1)]"], "", ["f"]),
    ("llama3", ['{"name": "f", ', '"parameters": {}}'], "", ["f"]),
    ("mistral", ["[1, 2]"], "", []),  # held, then not a call after all: it goes out at the end
    ("mistral", ['{"name": "f", ', '"arguments": {}}'], "", ["f"]),  # a bare object is held too
    ("llama3", ["; ", '{"name": "f", "parameters": {}}'], '; {"name": "f", "parameters": {}}', []),  # sent: text
    # an answer that cannot be a bare call streams at once
    ("pythonic", ["\nThe weather ", "is fine."], "\nThe weather is fine.", []),
    ("llama3", ["It is ", "4."], "It is 4.", []),
])
def test_a_stream_sends_content_as_it_comes_and_holds_calls_back(style, chunks, streamed, calls):
    from specrun.server.worker import ToolCallCut

    cut = ToolCallCut(STYLES[style], ["f"])
    sent = "".join(cut.feed(chunk) for chunk in chunks)
    assert sent == streamed
    rest, found = cut.finish()
    assert [call.name for call in found] == calls
    if not calls:
        assert sent + rest == "".join(chunks)


@pytest.mark.parametrize(("style", "text", "content", "calls"), [
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}, {"name": "f", '
     '"argu', "", ["f", "g"]),
    ("mistral", 'Checking. [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"na', "Checking.", ["f"]),
    ("mistral", '[{"name": "f", "arguments": {"x": 1}}, ', "", ["f"]),  # the list left open between calls
    ("llama3", '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {"y": [1, ',
     "", ["f"]),
    ("llama3", '{"name": "f", "parameters": {"x": 1}}\n{"name": "g"', "", ["f"]),
    ("pythonic", '[f(x=(1, 2)), g(y=(3', "", ["f"]),
    # more closing parentheses inside the cut call's string than any count of tries would reach
    ("pythonic", '[f(x=1), g(code="print(0)\\nprint(1)' + ")" * 40, "", ["f"]),
    ("pythonic", '[f(x=1), g(s="""a\nb)))', "", ["f"]),
    ("pythonic", 'I will.\n```tool_code\nf(x=1)\ng(y=', "I will.", ["f"]),
    ("pythonic", '```tool_code\nf(x=1)\n```\n```tool_code\ng(y=2)\nf(', "", ["f", "g"]),
    ("pythonic", '```tool_code\nf(x=1)\n`', "", ["f"]),  # the closing fence cut short
    ("hermes", 'Sure.<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"na', "Sure.", ["f"]),
    # not calls before the cut: nothing counts, and the call begun is not content
    ("pythonic", '[f(s="a)b', "", []),
    ("mistral", '[TOOL_CALLS][{"name": "h", "arguments": {}}, {"na', "", []),  # h is not defined
    ("hermes", 'It is sunny <tool_call>{"na', "It is sunny", []),
])
def test_an_answer_cut_inside_its_calls_keeps_the_calls_written_whole_in_every_style(style, text, content, calls):
    """generate --tools and chat read a cut answer (-n reached inside a call) as the server does:
    the calls closed before the cut, in each family's format, and it says a call was left out."""
    found, dropped = STYLES[style].read_answer(text, ["f", "g"], cut=True)
    assert [call.name for call in found] == calls and dropped
    assert STYLES[style].parse_cut(text, ["f", "g"])[0] == content
    assert STYLES[style].read_answer(text, ["f", "g"], cut=False) == ([], False)  # not cut: not calls


@pytest.mark.parametrize(("style", "text", "calls", "dropped"), [
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call>', ["f"], False),  # whole, then cut
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_c', ["f"], True),  # the next opener
    ("pythonic", '```tool_code\nf(x=1)\n```\n```tool_co', ["f"], True),
    # one token short of a forced call's end: the call is whole (it was dropped)
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call', ["f"], False),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n<', ["f"], False),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n', ["f"], False),  # Qwen's tag: one token
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"s": "a<', [], True),  # inside the JSON: cut
    # cut outside any call: prose that merely looks like a call's beginning, or follows closed calls
    ("hermes", "It is sunny in", [], False),
    ("hermes", "It holds when a <", [], False),
    ("llama3", "[1, 2, 3, 4", [], False),
    ("llama3", '{"name": "f", "parameters": {}} and then I', [], False),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}}] and then {"na', [], False),
    ("pythonic", "Run it:\n```python\nprint(1)\n```", [], False),
    # a list of calls that begins the answer is its calls, whatever follows (Gemma 3 270M went on to
    # write the tool's output itself, and the call was lost as text): nothing of a call was cut
    ("pythonic", '[f(x=1)] is the call I would make, but first (as you asked', ["f"], False),
    ("pythonic", '[get_weather(city="Oslo")] done\n```tool_output\n{"temperature":', ["get_weather"], False),
])
def test_a_cut_answer_says_a_call_was_left_out_only_where_one_was(style, text, calls, dropped):
    found, left_out = STYLES[style].read_answer(text, ["f", "get_weather"], cut=True)
    assert [call.name for call in found] == calls and left_out == dropped


# ---- specrun chat with tools ----------------------------------------------------------------
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                 "parameters": {"type": "object", "properties": {
                                                     "city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"],
                                                     "additionalProperties": False}}}]


def test_a_chat_with_tools_calls_takes_the_result_and_answers(tmp_path):
    """The demo pair (a template without tools): a required call on the user's turn, the result as
    a tool message (rendered in the Hermes format), then a free answer; the conversation's next
    prompt extends the cached one."""
    pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")
    from specrun.engine.loop import GenerationParams
    from specrun.registry.loading import LoadOptions
    from specrun.sessions.chat import AnswerDone, open_chat
    from specrun.sessions.tools import tool_definitions

    tools = tool_definitions(CHAT_TOOLS)
    params = GenerationParams(max_new_tokens=60)
    with open_chat("demo-target", "demo-draft", "draft", LoadOptions(threads=1), tools=tools,
                   tool_choice=ToolChoice("required")) as session:
        first = [e for e in session.ask("Weather in Oslo?", params) if isinstance(e, AnswerDone)][0]
        assert [call.name for call in first.tool_calls] == ["get_weather"]
        assert json.loads(first.tool_calls[0].arguments)["city"] in ("Oslo", "Rome")
        assert first.to_dict()["tool_calls"][0]["function"]["name"] == "get_weather"
        second = [e for e in session.ask('{"temperature": 21}', params, role="tool") if isinstance(e, AnswerDone)][0]
        assert second.reused_tokens > first.prompt_tokens  # the call and its answer stayed in the cache
        assert [m["role"] for m in session.transcript.messages] == ["user", "assistant", "tool", "assistant"]
        # the result answers the call by its id, as a client's tool message does
        assert session.transcript.messages[2]["tool_call_id"] == first.tool_calls[0].id
        assert session.unanswered == list(second.tool_calls)
        rendered = render_conversation(session.template, session.transcript.messages, tools)[0]
        assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in rendered


def test_a_chat_answers_a_call_by_its_id_where_the_template_requires_one():
    """A Mistral-style template (a result without its call's nine-letter id is an error): the demo
    target under it, a required call forced in that style, then the result typed back (``/tool``)
    renders and is answered; a second result, with no call left open, is refused as one line (it
    went without an id, and a template that takes one said so; Hermes's took it), the conversation
    as it was."""
    pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")
    from specrun.engine.loop import GenerationParams
    from specrun.registry.loading import LoadOptions
    from specrun.sessions.chat import AnswerDone, open_chat
    from specrun.sessions.tools import tool_definitions

    tools = tool_definitions(CHAT_TOOLS)
    params = GenerationParams(max_new_tokens=40)
    with open_chat("demo-target", None, "none", LoadOptions(threads=1), tools=tools,
                   tool_choice=ToolChoice("required")) as session:
        session.template = ChatTemplate(MISTRAL_LIKE)
        first = [e for e in session.ask("Weather in Oslo?", params) if isinstance(e, AnswerDone)][0]
        assert [call.name for call in first.tool_calls] == ["get_weather"]  # the style's call, forced
        (call,) = first.tool_calls
        assert session.unanswered == [call] and len(call.id) == 9
        answer = [e for e in session.ask('{"temperature": 21}', GenerationParams(max_new_tokens=4), role="tool")
                  if isinstance(e, AnswerDone)][0]
        result = {"role": "tool", "content": '{"temperature": 21}', "tool_call_id": call.id}
        assert session.transcript.messages[2] == result
        assert not answer.tool_calls and session.unanswered == []  # 4 tokens hold no whole call
        rendered = render_conversation(session.template, session.transcript.messages, tools)[0]
        assert f'"call_id": "{call.id}"' in rendered
        kept = session.transcript
        with pytest.raises(UsageError, match="there is no tool call to answer: the last answer called none"):
            list(session.ask('{"temperature": 22}', GenerationParams(max_new_tokens=4), role="tool"))
        assert session.transcript is kept and session.unanswered == []


def test_a_chat_answer_cut_inside_its_call_says_so_and_shows_no_call(tmp_path):
    """-n reached inside a required call: no call to answer with /tool, a note saying why."""
    pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")
    from typer.testing import CliRunner

    from specrun.cli.app import app
    from specrun.sessions.tools import TOOL_CALL_CUT_NOTE

    path = tmp_path / "tools.json"
    path.write_text(json.dumps(CHAT_TOOLS))
    result = CliRunner().invoke(app, ["chat", "--tools", str(path), "--tool-choice", "required", "--json",
                                      "-n", "6", "--threads", "1"], input="Weather in Rome?\n")
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer["finish_reason"] == "length" and answer["tool_call_cut"] and "tool_calls" not in answer
    assert answer["text"].startswith("<tool_call>")
    assert TOOL_CALL_CUT_NOTE[:40] in " ".join(result.stderr.split())


def test_a_chat_keeps_no_markup_of_a_call_cut_off_and_the_calls_written_whole(monkeypatch):
    """An answer cut inside its call (-n) is kept in the transcript as a client sends one back: the
    content before the calls, the calls written whole as tool_calls, and none of the cut call's
    markup, which the next turn's prompt would otherwise carry; that next turn answers. A template
    that cannot take the calls back keeps the content alone."""
    pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")
    from specrun.engine.loop import GenerationParams
    from specrun.registry.loading import LoadOptions
    from specrun.sessions.chat import AnswerDone, open_chat
    from specrun.sessions.tools import tool_definitions

    tools = tool_definitions(CHAT_TOOLS)
    with open_chat("demo-target", None, "none", LoadOptions(threads=1), tools=tools,
                   tool_choice=ToolChoice("required")) as session:
        cut = [e for e in session.ask("Weather in Rome?", GenerationParams(max_new_tokens=6))
               if isinstance(e, AnswerDone)][0]
        assert cut.tool_call_cut and not cut.tool_calls and cut.text.startswith("<tool_call>")
        assert session.transcript.messages[-1] == {"role": "assistant", "content": ""}
        rendered = render_conversation(session.template, session.transcript.messages, tools)[0]
        assert "<tool_call>" not in rendered.split("Weather in Rome?")[1]  # the instructions show one
        after = [e for e in session.ask("And in Oslo?", GenerationParams(max_new_tokens=6))
                 if isinstance(e, AnswerDone)][0]
        assert after.prompt_tokens > cut.prompt_tokens and after.text
        whole = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        text = f'Checking.\n{whole}\n<tool_call>\n{{"name": "get_weather", "argu'
        calls, dropped = style_for(session.template).read_answer(text, ["get_weather"], True)
        assert dropped and [call.name for call in calls] == ["get_weather"]
        asked = [{"role": "user", "content": "Weather?"}]
        kept, closed = session._cut_answer(asked, text, ["get_weather"], calls)
        assert kept["content"] == "Checking." and kept["tool_calls"] == [call.as_openai() for call in calls]
        # what it rendered to know the template takes the calls is the record's rendering (one, not two)
        assert closed == render_conversation(session.template, [*asked, kept], tools, add_generation_prompt=False)[0]
        rendered = render_conversation(session.template, [*asked, kept], tools)[0]
        answered = rendered.split("Weather?")[1]
        assert answered.count("<tool_call>") == 1 and '"city": "Oslo"' in answered, answered

        def refusing(template, messages, tools=(), add_generation_prompt=True):  # Llama 3's: one call a turn
            raise ChatTemplateError("This model only supports single tool-calls at once!", "")

        monkeypatch.setattr("specrun.sessions.chat.render_conversation", refusing)
        assert session._cut_answer(asked, text, ["get_weather"], calls) == (
            {"role": "assistant", "content": "Checking."}, None)


def test_chat_answers_a_tool_result_only_with_tools():
    pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")
    from specrun.engine.loop import GenerationParams
    from specrun.errors import UsageError
    from specrun.registry.loading import LoadOptions
    from specrun.sessions.chat import open_chat

    with open_chat("demo-target", None, "none", LoadOptions(threads=1)) as session:
        with pytest.raises(UsageError, match="no tools"):
            list(session.ask("{}", GenerationParams(max_new_tokens=4), role="tool"))


def test_piped_chat_with_tools_prints_the_calls_in_its_json(tmp_path):
    pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")
    from typer.testing import CliRunner

    from specrun.cli.app import app

    path = tmp_path / "tools.json"
    path.write_text(json.dumps(CHAT_TOOLS))
    result = CliRunner().invoke(app, ["chat", "--tools", str(path), "--tool-choice", "required", "--json",
                                      "-n", "60", "--threads", "1"], input="Weather in Rome?\n")
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer["tool_calls"][0]["function"]["name"] == "get_weather"
    # it said "answer it with /tool RESULT", which a pipe cannot
    calls = [line for line in result.stderr.splitlines() if line.startswith("tool call: get_weather")]
    assert len(calls) == 1 and calls[0].endswith("(a piped chat cannot answer it: run specrun chat in a terminal, "
                                                 "or send the result to specrun serve)"), result.stderr


def test_a_server_answers_a_required_call_python_cannot_write_with_a_400_naming_tools():
    """The server builds the required call's grammar inside its refusal of bad grammars: a
    function Gemma's format cannot name is a 400 on `tools`, not a failed request."""
    from types import SimpleNamespace

    from specrun.sampling import SamplingSettings
    from specrun.server.requests import CompletionRequest, RequestError
    from specrun.server.worker import PairWorker

    worker = SimpleNamespace(_style=lambda: STYLES["pythonic"], session=SimpleNamespace(target=None))
    request = CompletionRequest.__new__(CompletionRequest)
    for name, value in {"grammar": None, "grammar_field": None, "tools": (Tool("get-weather"),),
                        "tool_choice": ToolChoice("required"), "parallel_tool_calls": False,
                        "sampling": SamplingSettings()}.items():
        object.__setattr__(request, name, value)
    with pytest.raises(RequestError) as refused:
        PairWorker._grammar(worker, SimpleNamespace(request=request, opens_thinking=False))
    assert refused.value.param == "tools" and "get-weather" in str(refused.value)
