"""Reasoning models' thinking read apart from the answer (sessions/reasoning.py): the tags a
template writes, whether its generation prompt opens the block, and the split of a streamed
answer, which must not depend on how the text was cut into pieces."""

from __future__ import annotations

import dataclasses
import random

import pytest

from grammar_walks import walks
from model_factory import THINKING_TEMPLATE
from split_feeding import fed_in_pieces
from specrun.sessions.reasoning import (
    THINK_TAGS, ReasoningSplit, ThinkingTokens, ThinkTags, opens_thinking, split_reasoning, thinking_tags,
)
from specrun.sessions.templates import FALLBACK_TEMPLATE, ChatTemplate, template_variables_problem
from specrun.sessions.tools import STYLES, render_conversation
from specrun.server.worker import ToolCallCut, _read_apart

THINK = ThinkTags("<think>", "</think>")

# DeepSeek-R1's first template: it only strips the thinking from earlier answers; the model
# opens the block itself
R1_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
               "{% else %}<｜Assistant｜>{{ m['content'].split('</think>')[-1] }}<｜end▁of▁sentence｜>{% endif %}"
               "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")
SEED_TEMPLATE = ("{% for m in messages %}<seed:bos>{{ m['role'] }}\n{% if m.reasoning_content %}<seed:think>"
                 "{{ m.reasoning_content }}</seed:think>{% endif %}{{ m['content'] }}<seed:eos>{% endfor %}")


@pytest.mark.parametrize("text, opened, expected", [
    ("<think>\nabc def\n</think>\n\nHello", False, ("abc def", "Hello")),
    ("  \n<think>x</think>y", False, ("x", "y")),  # whitespace before the tag
    ("Hello <think>x</think>", False, ("", "Hello <think>x</think>")),  # a tag later is the answer's text
    ("abc\n</think>\n\nok", True, ("abc", "ok")),  # the prompt opened it
    ("abc </th", True, ("abc </th", "")),  # cut inside a closing tag: the block's text
    ("<thi", False, ("", "<thi")),  # cut inside an opening tag: the answer's
    ("\n\n", False, ("", "\n\n")),
    ("<think>never closed  \n", False, ("never closed", "")),
    ("<think></think>", False, ("", "")),
    ("a</think>b</think>c", True, ("a", "b</think>c")),  # the first closing tag ends it
    ("No thinking at all", False, ("", "No thinking at all")),
])
def test_an_answer_s_thinking_is_read_apart(text, opened, expected):
    assert split_reasoning(text, THINK, opened) == expected


def _reference(text: str, tags: ThinkTags, opened: bool) -> tuple[str, str]:
    """The split of a whole text, written plainly: the block (opened by the prompt, or by the
    answer's first visible text) up to its first closing tag, stripped, and the rest."""
    if not opened:
        begun = text.lstrip()
        if not begun.startswith(tags.start):
            return "", text
        text = begun[len(tags.start):]
    thought, closed, rest = text.partition(tags.end)
    return thought.strip(), rest.lstrip() if closed else ""


@pytest.mark.parametrize("tags", [THINK, ThinkTags("[THINK]", "[/THINK]"), ThinkTags("<|channel>thought", "<channel|>")])
def test_the_split_is_the_same_however_the_stream_is_cut(tags):
    rng = random.Random(7)
    pieces = [tags.start, tags.end, tags.end[:3], tags.start[:2], " ", "\n", "  ", "a", "bc", "<", "/", "]"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        opened = rng.random() < 0.5
        expected = _reference(text, tags, opened)
        assert fed_in_pieces(ReasoningSplit(tags, opened), text, rng, 5) == expected, (text, opened)


def test_thinking_goes_out_as_it_comes_and_only_a_tag_s_beginning_waits():
    split = ReasoningSplit(THINK, open=True)
    assert split.feed("\nLet me see") == ("Let me see", "")
    assert split.feed(" more.\n</thi") == (" more.", "")  # the whitespace before a possible tag waits
    assert split.thinking
    assert split.feed("nk>\n\nThe answer") == ("", "The answer")
    assert not split.thinking
    assert split.finish() == ("", "")


def test_templates_name_their_tags():
    assert thinking_tags(ChatTemplate(THINKING_TEMPLATE)) == THINK
    assert thinking_tags(ChatTemplate(R1_TEMPLATE)) == THINK  # only the closing tag is written
    assert thinking_tags(ChatTemplate(SEED_TEMPLATE)) == ThinkTags("<seed:think>", "</seed:think>")
    assert thinking_tags(ChatTemplate(None)) is None  # the fallback transcript
    assert thinking_tags(ChatTemplate(FALLBACK_TEMPLATE.replace("Assistant", "Bot"))) is None
    assert len({tags.end for tags in THINK_TAGS}) == len(THINK_TAGS)


def test_the_generation_prompt_opens_the_block_or_closes_it():
    template = ChatTemplate(THINKING_TEMPLATE)
    messages = [{"role": "user", "content": "Why <think>?"}]
    for variables, opened in (({}, True), ({"enable_thinking": True}, True), ({"enable_thinking": False}, False)):
        text, spans = render_conversation(template.with_variables(variables), messages)
        assert opens_thinking(THINK, text[spans[-1][1]:]) is opened, text
    assert not opens_thinking(None, "<think>")
    assert not opens_thinking(THINK, "<|im_start|>assistant\n")


def test_a_template_that_reads_enable_thinking_is_given_it_true_as_llama_server_gives_it():
    template = ChatTemplate("{% if enable_thinking is defined and enable_thinking %}T{% else %}F{% endif %}")
    assert template.render([]) == "T" and template.with_variables({"enable_thinking": False}).render([]) == "F"
    assert ChatTemplate("{{ messages | length }}").variables == {}


def test_template_variables_reach_the_template_and_bad_ones_are_named():
    template = ChatTemplate("{{ greeting }} {% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert template.with_variables({"greeting": "Hello"}).render([{"role": "user", "content": "x"}]) == "Hello x"
    assert template.with_variables({}) is template and template.variables == {}  # the original untouched
    assert template_variables_problem({"enable_thinking": False, "reasoning_effort": "low"}) == ""
    assert "object" in template_variables_problem(["enable_thinking"])
    assert "rendering itself" in template_variables_problem({"messages": []})
    assert "rendering itself" in template_variables_problem({"add_generation_prompt": False})
    assert "true or false" in template_variables_problem({"enable_thinking": "false"})
    assert "not a name" in template_variables_problem({"two words": 1})


def test_a_call_after_the_thinking_is_a_call_and_the_thinking_is_not_content():
    """The tool cut reads the answer after the thinking: a call the model weighed while thinking
    (its markup in the block) is not made, the one after it is."""
    text = ('<think>\nMaybe <tool_call>{"name": "f", "arguments": {}}</tool_call>? No: the weather.\n</think>\n\n'
            '<tool_call>\n{"name": "f", "arguments": {"city": "Oslo"}}\n</tool_call>')
    split, cut, thought = ReasoningSplit(THINK), ToolCallCut(STYLES["hermes"], ["f"]), []
    for at in range(0, len(text), 7):
        piece_thought, content = _read_apart(split, "auto", text[at:at + 7])
        thought.append(piece_thought)
        assert cut.feed(content) == ""  # nothing of a call goes out as content
    piece_thought, content = _read_apart(split, "auto", "", end=True)
    thought.append(piece_thought)
    cut.feed(content)
    content, calls = cut.finish()
    assert "".join(thought).startswith("Maybe <tool_call>") and "".join(thought).endswith("the weather.")
    assert content == "" and [(call.name, call.arguments) for call in calls] == [("f", '{"city": "Oslo"}')]


def test_deepseek_legacy_keeps_the_text_as_generated_beside_the_thinking():
    split = ReasoningSplit(THINK, open=True)
    assert _read_apart(split, "deepseek-legacy", "R\n</think>\nA", end=True) == ("R", "R\n</think>\nA")
    assert _read_apart(None, "auto", "text") == ("", "text")


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from model_factory import build_thinking_model

    return build_thinking_model(tmp_path_factory.mktemp("thinking"))


def test_a_chat_keeps_the_thinking_apart_and_gives_it_back_to_the_template(thinking_model):
    """ChatSession's answers: thinking events then answer events, AnswerDone's text the answer and
    ``reasoning`` the thinking, and the transcript's message as a client sends one back (content
    and reasoning_content), so the next turn's prompt is the template's rendering of it."""
    from specrun.engine.loop import GenerationParams
    from specrun.registry.loading import LoadOptions
    from specrun.sessions.chat import AnswerDone, AnswerText, open_chat

    with open_chat(str(thinking_model.gguf_f32_path), None, "lookup", LoadOptions(threads=1)) as session:
        assert session.thinking == THINK
        events = list(session.ask("Hi there", GenerationParams(10, 0)))
        done = events[-1]
        assert isinstance(done, AnswerDone) and done.reasoning and done.text == ""
        assert "".join(e.text for e in events if isinstance(e, AnswerText) and e.thinking) == done.reasoning
        assert session.transcript.messages[-1] == {"role": "assistant", "content": "", "reasoning_content": done.reasoning}
        events = list(session.ask("And?", GenerationParams(4, 0)))
        assert isinstance(events[-1], AnswerDone)
        text, _ = render_conversation(session.template, session.transcript.messages[:2])
        assert f"<think>\n{done.reasoning}\n</think>" in text
    off = {"enable_thinking": False}
    with open_chat(str(thinking_model.gguf_f32_path), None, "lookup", LoadOptions(threads=1),
                   template_variables=off) as session:
        done = list(session.ask("Hi there", GenerationParams(10, 0)))[-1]
        assert done.text and not done.reasoning
        assert session.transcript.messages[-1] == {"role": "assistant", "content": done.text}


def _walk(grammar, backend, text_or_ids) -> bool:
    """Does the grammar allow these tokens (text tokenized plainly), one after another?"""
    ids = text_or_ids if isinstance(text_or_ids, list) else backend.tokenize(text_or_ids, add_bos=False)
    return walks(grammar, ids)


def test_a_grammar_holds_the_answer_after_the_thinking(thinking_model):
    """A schema (or a required call) on a reasoning model whose prompt opened the block: any
    thinking, the closing tag (a control token here, by id), at most a blank line, then what the
    schema holds, and nothing else after the tag; not opened, the answer may open one or begin
    with the schema's text. A tag with text of its own ends the thinking as a stop string."""
    from specrun.backends.llama import LlamaCppBackend
    from specrun.grammar import Grammar, GrammarSpec
    from specrun.sessions.reasoning import grammar_after_thinking

    backend = LlamaCppBackend(thinking_model.gguf_f32_path, n_threads=1, gpu_layers=0, flash_attn=False)
    try:
        spec = GrammarSpec("json_schema", '{"type": "object", "properties": {"n": {"type": "integer"}}, '
                                          '"required": ["n"]}')
        text = backend.tokenize
        opened = Grammar.compile(grammar_after_thinking(spec, backend, THINK, True), backend)
        answer = text('{"n": 5}', add_bos=False)
        assert _walk(opened, backend, text("Let < me > think", add_bos=False) + [513] + text("\n\n", add_bos=False) + answer)
        assert _walk(opened, backend, [513] + answer)
        assert not _walk(opened, backend, [513] + text("Sure: ", add_bos=False))  # only the schema after it
        assert not _walk(opened, backend, answer[:1] + [513, 513])
        closed = Grammar.compile(grammar_after_thinking(spec, backend, THINK, False), backend)
        assert _walk(closed, backend, answer) and _walk(closed, backend, [512] + text("hm", add_bos=False) + [513] + answer)
        assert not _walk(closed, backend, text("hm", add_bos=False))
        plain = Grammar.compile(spec, backend)
        assert not _walk(plain, backend, [513] + answer)
        worded = Grammar.compile(dataclasses.replace(spec, thought=('"<t>"', '"</t>"', True)), backend)
        assert _walk(worded, backend, 'a < b </t>\n{"n": 5}')
        assert not _walk(worded, backend, "a </t>x")  # the first closing tag ends it
        # a rejected draft rolls the grammar back, inside the thinking and after its tag (llguidance
        # rolls back no stop lexeme: the tag is a suffix)
        state = worded.start()
        ids = text("a < b </t>\n{", add_bos=False)
        assert state.advance(ids)
        state.rollback(len(ids) - 2)
        assert not state.error and state.advance(ids[2:]) and not state.error
    finally:
        backend.close()


@pytest.mark.parametrize("pieces, opened, thinking", [
    (["<think>", "a", "b", "</th", "ink>", "\n\n", "Hi"], False, 5),  # the tag across two tokens
    (["\n", "<th", "ink>", "a", "</think>", "Hi"], False, 5),  # whitespace, then the tag across two
    (["a", "b", "</think>", "c"], True, 3),  # the prompt opened it
    (["<think>", "a", "b"], False, 3),  # cut inside: every token
    (["a", "b"], True, 2),
    (["<think>a</think>b"], False, 1),  # one token holds the block
    (["Hi", "<think>", "a", "</think>"], False, 0),  # an answer that begins elsewhere has none
    ([" ", "<", "x"], False, 0),  # a tag's beginning, then not the tag
    (["<think>", "a", "</think>", "<think>", "b", "</think>"], False, 3),  # a tag later is the answer's
    ([], False, 0),
    ([" ", "<"], False, 0),  # ended before the block opened: none
    ([""], False, 0),  # an end-of-generation token, no text
])
def test_the_thinking_s_tokens_are_counted_to_its_closing_tag(pieces, opened, thinking):
    counter = ThinkingTokens(ThinkTags("<think>", "</think>"), opened)
    counter.feed(piece.encode() for piece in pieces[:2])  # in several calls, as a stream feeds it
    counter.feed(piece.encode() for piece in pieces[2:])
    assert counter.count == thinking


@pytest.mark.parametrize("pieces, thinking", [
    ([b"\xe3\x80", b"\x80", b"<think>", b"a", b"</think>"], 5),  # an ideographic space split across two tokens
    ([b"\xc2\xa0<thi", b"nk>a", b"</think>ok"], 3),  # a no-break space in the tag's token
    ([b"\xc3", b"\xa9", b"<think>", b"a", b"</think>"], 0),  # an é split across two: the answer begins there
    ([b"<think>\xe3\x81", b"\x82</think>", b"ok"], 2),  # a character split across the tag's token and the next
])
def test_the_thinking_is_found_after_unicode_whitespace_as_the_split_finds_it(pieces, thinking):
    """Whitespace before the opening tag is Unicode's (ReasoningSplit's, on text), whichever
    tokens a character's bytes fall in."""
    counter = ThinkingTokens(THINK)
    counter.feed(pieces)
    assert counter.count == thinking
    assert bool(split_reasoning(b"".join(pieces).decode(), THINK)[0]) == (thinking > 0)
