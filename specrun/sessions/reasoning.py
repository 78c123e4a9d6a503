"""Reasoning models: the thinking an answer opens with, told apart from the answer.

Models such as Qwen3, DeepSeek-R1, GLM, Magistral or Seed-OSS think before they answer,
between tags their chat template knows (``<think>`` … ``</think>``); some templates open the
block in the prompt itself (DeepSeek-R1's generation prompt ends in ``<think>\\n``), others
close it there to turn thinking off (Qwen3's ``enable_thinking=false`` writes an empty block).
Clients written for llama-server and vLLM read the thinking apart from the answer: OpenAI's
message gains ``reasoning_content`` (streamed as ``delta.reasoning_content``), as llama-server's
``--reasoning-format deepseek`` (its default, ``auto``) gives it.

The split reads text: the tokens, and so speculation and its exactness, are the target's own
whatever the format. What reaches generation is a grammar's start (``grammar_after_thinking``:
the model thinks before the answer a schema holds) and the tags' text where they are control
tokens (``shown_tags``).

- ``thinking_tags(template)``: the pair of tags a template writes (``THINK_TAGS``: the
  spellings llama.cpp's chat parsers know), or None.
- ``opens_thinking(tags, tail)``: does the prompt's generation prompt (the text after the last
  message) leave the block open, so that the answer begins inside it?
- ``ReasoningSplit``: fed the answer's text as it streams, gives back (reasoning, content)
  pieces: the thinking without its tags and the whitespace around it, and the answer after it.
- ``grammar_after_thinking``: a grammar (a schema, a required call) held after the thinking, so
  that a model whose prompt opened the block thinks before the answer the grammar holds.
- ``budget_rule``: llama.cpp's reasoning budget (specrun/reasoning_budget.py) for one answer.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from specrun.grammar import GrammarSpec
from specrun.sessions import harmony
from specrun.sessions.streamed import held_prefix
from specrun.sessions.templates import ChatTemplate

# llama-server's reasoning formats: "none" leaves the thinking in the content as generated;
# "deepseek" (and "auto") moves it to reasoning_content; "deepseek-legacy" does both.
REASONING_FORMATS = ("auto", "none", "deepseek", "deepseek-legacy")


@dataclass(frozen=True)
class ThinkTags:
    """The text that opens a model's thinking and the text that closes it; ``harmony``: gpt-oss's
    channels (sessions/harmony.py), whose thinking is the analysis channel's body."""

    start: str
    end: str
    harmony: bool = False


# gpt-oss: its first analysis message, as llama.cpp reads its thinking (common/parsers/gpt-oss.cpp)
HARMONY_TAGS = ThinkTags(harmony.THINKING_START, harmony.END, harmony=True)


# The spellings llama.cpp's chat parsers read (common/chat.cpp, common/parsers/): Qwen3, QwQ,
# DeepSeek-R1/V3.1, GLM-4.5+, Kimi, MiniMax, LFM2, SmolLM3 and most others write the first;
# Seed-OSS, Magistral/Ministral 3, Command A Reasoning, MiniMax M3 and Gemma 4 their own.
# gpt-oss's harmony channels are read by sessions/harmony.py (HARMONY_TAGS).
THINK_TAGS = (
    ThinkTags("<seed:think>", "</seed:think>"),
    ThinkTags("<mm:think>", "</mm:think>"),
    ThinkTags("<|START_THINKING|>", "<|END_THINKING|>"),
    ThinkTags("[THINK]", "[/THINK]"),
    ThinkTags("<|channel>thought", "<channel|>"),
    ThinkTags("<think>", "</think>"),
)


def thinking_tags(template: ChatTemplate) -> ThinkTags | None:
    """The tags the template's model thinks between: the first spelling whose closing tag the
    template's source writes (a template may only strip ``</think>`` from earlier answers, as
    DeepSeek-R1's first ones did, while the model opens the block itself). None: no thinking."""
    if template.is_fallback:
        return None
    if harmony.is_harmony(template.source):
        return HARMONY_TAGS
    for tags in THINK_TAGS:
        if tags.end in template.source:
            return tags
    return None


def generation_prompt(text: str, spans) -> str:
    """A rendered conversation's text after its last message's content (``spans``: render_with_spans'):
    the generation prompt, where a template opens or closes the thinking block."""
    return text[spans[-1][1]:] if spans else text


def opens_thinking(tags: ThinkTags | None, tail: str) -> bool:
    """Does ``tail``, the prompt after its last message, leave a thinking block open (the answer
    begins inside it)? Qwen3's ``<think>\\n\\n</think>`` (thinking off) closes it."""
    if tags is None:
        return False
    opened = tail.rfind(tags.start)
    return opened >= 0 and tail.find(tags.end, opened) < 0


def closes_thinking(tags: ThinkTags | None, tail: str) -> bool:
    """Does ``tail``, the prompt after its last message, write a whole block (Qwen3's empty one
    where thinking is off), so that the answer is not expected to think?"""
    if tags is None:
        return False
    opened = tail.rfind(tags.start)
    return opened >= 0 and tail.find(tags.end, opened) >= 0


class ReasoningSplit:
    """The answer's text as it streams, read into thinking and answer.

    ``open``: the prompt opened the block (``opens_thinking``); else the answer's thinking is a
    block it opens first (whitespace before the tag allowed), and an answer that begins with
    anything else has none. The thinking ends at the first closing tag; the whitespace around it
    is dropped, as is the whitespace between the closing tag and the answer. A tag written later
    in the answer is the answer's text. Text that may begin a tag is held until the next piece
    says (``finish`` lets it go).
    """

    def __init__(self, tags: ThinkTags, open: bool = False) -> None:
        self.tags = tags
        self._state = "thinking" if open else "before"  # before | thinking | after | answer
        self._held = ""  # text not given out yet: a tag's possible beginning, or trailing whitespace
        self._thought = False  # any thinking given out yet (leading whitespace is dropped until then)

    @property
    def thinking(self) -> bool:
        """Is the text read so far inside the block?"""
        return self._state == "thinking"

    def feed(self, text: str) -> tuple[str, str]:
        """(thinking, answer) text that can go out now."""
        self._held += text
        reasoning, content = [], []
        while self._held:
            if self._state == "before":
                begun = self._held.lstrip()
                if begun.startswith(self.tags.start):
                    self._state, self._held = "thinking", begun[len(self.tags.start):]
                    continue
                if self.tags.start.startswith(begun):  # whitespace, or the tag's first characters
                    break
                self._state = "answer"
            elif self._state == "thinking":
                closed = self._held.find(self.tags.end)
                if closed >= 0:
                    reasoning.append(self._thinking_out(self._held[:closed].rstrip()))
                    self._state, self._held = "after", self._held[closed + len(self.tags.end):]
                    continue
                # a closing tag's first characters wait, and the whitespace before them (dropped
                # if the tag closes there)
                tag_part = held_prefix(self._held, self.tags.end)
                before = self._held[: len(self._held) - tag_part]
                keep = tag_part + len(before) - len(before.rstrip())
                reasoning.append(self._thinking_out(self._held[: len(self._held) - keep]))
                self._held = self._held[len(self._held) - keep:]
                break
            elif self._state == "after":
                self._held = self._held.lstrip()
                if self._held:
                    self._state = "answer"
            else:
                content.append(self._held)
                self._held = ""
        return "".join(reasoning), "".join(content)

    def _thinking_out(self, text: str) -> str:
        if not self._thought:
            text = text.lstrip()
            self._thought = bool(text)
        return text

    def finish(self) -> tuple[str, str]:
        """What was held at the answer's end: an unfinished tag's text is the block's (inside it)
        or the answer's (before it); trailing whitespace of the thinking is dropped."""
        held, self._held = self._held, ""
        if self._state == "thinking":
            return self._thinking_out(held.rstrip()), ""
        if self._state == "before":
            return "", held
        return "", held.lstrip() if self._state == "after" else held


def reasoning_split(tags: ThinkTags, open: bool = False,
                    callable: Sequence[str] = ()) -> ReasoningSplit | harmony.HarmonySplit:
    """What reads an answer's thinking apart from it: ``ReasoningSplit``, or gpt-oss's channels read
    by ``harmony.HarmonySplit`` (the same interface; ``callable``: the functions whose calls it
    keeps, as a request offers them)."""
    return harmony.HarmonySplit(callable) if tags.harmony else ReasoningSplit(tags, open)


class ThinkingTokens:
    """How many of an answer's tokens are its thinking (OpenAI's ``reasoning_tokens``), counted as
    they come from their texts: the block's tokens up to and including the one that completes its
    closing tag (the opening tag and any whitespace before it too); all of them while the block is
    open (an answer cut inside it); none where the answer writes no block. ``open``: the prompt
    opened the block (``opens_thinking``). The block read as ReasoningSplit reads it: the first
    closing tag ends it, and an answer that begins with anything but the opening tag has none."""

    def __init__(self, tags: ThinkTags, open: bool = False) -> None:
        self._start, self._end = tags.start, tags.end.encode()
        self._state = "thinking" if open else "before"  # before | thinking | done
        # the answer's start as text (whitespace is Unicode's, as ReasoningSplit strips it; a
        # character split across tokens waits in the decoder), then a closing tag's first bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._begun = ""
        self._text = b""
        self._count = 0

    @property
    def count(self) -> int:
        """The thinking's tokens so far (none while the answer may yet open the block)."""
        return 0 if self._state == "before" else self._count

    def feed(self, pieces: Iterable[bytes]) -> None:
        """The next tokens' texts, in order."""
        for piece in pieces:
            if self._state == "done":
                return
            self._count += 1
            if self._state == "before":
                self._begun = (self._begun + self._decoder.decode(piece)).lstrip()
                if not self._begun.startswith(self._start):
                    if self._start.startswith(self._begun):  # whitespace, or the tag's first characters
                        continue
                    self._state, self._count = "done", 0  # no block: nothing of the answer is thinking
                    return
                self._state = "thinking"
                piece = self._begun[len(self._start):].encode() + self._decoder.getstate()[0]
            self._text += piece
            if self._end in self._text:
                self._state = "done"
                return
            self._text = self._text[-(len(self._end) - 1):] if len(self._end) > 1 else b""


def split_reasoning(text: str, tags: ThinkTags | None, open: bool = False,
                    callable: Sequence[str] = ()) -> tuple[str, str]:
    """A whole answer as (thinking, answer) (``ReasoningSplit``); no tags: ("", text)."""
    if tags is None:
        return "", text
    split = reasoning_split(tags, open, callable)
    fed, held = split.feed(text), split.finish()
    return fed[0] + held[0], fed[1] + held[1]


def grammar_after_thinking(spec: GrammarSpec, backend, tags: ThinkTags, opened: bool) -> GrammarSpec:
    """``spec`` held after a thinking block (``GrammarSpec.thought``): where the prompt opened
    one, the grammar lets the model think before the answer it holds, as llama.cpp's lazy grammars
    do; else the answer may open one first. Each tag is its text, or its control token by id
    where it is one token without text. Under gpt-oss's channels the answer is the final
    channel's body: its header comes first (after the thinking, its own message's start), unless
    the grammar writes its message's header itself (``GrammarSpec.headed``: a call's)."""
    header = ""
    if tags.harmony and not spec.headed:
        header = f"({grammar_items(backend, HARMONY_ASSISTANT)})? {grammar_items(backend, HARMONY_FINAL)}"
    return dataclasses.replace(spec, thought=(grammar_items(backend, tags.start), grammar_items(backend, tags.end),
                                              opened, header))


HARMONY_ASSISTANT = "<|start|>assistant"  # a message of the answer's after the first
HARMONY_FINAL = "<|channel|>final<|message|>"
_CONTROL_NAME = re.compile(r"(<\|[A-Za-z_]+\|>)")


def grammar_items(backend, text: str) -> str:
    """``text`` as llguidance items: its ``<|name|>`` parts that are control tokens (one token
    without text) by id (``<[id]>``), the rest quoted text."""
    items = []
    for part in _CONTROL_NAME.split(text):
        if not part:
            continue
        ids = backend.tokenize(part, add_bos=False, special=True)
        if len(ids) == 1 and not backend.token_bytes(ids[0]):
            items.append(f"<[{ids[0]}]>")
        elif items and items[-1].startswith('"'):  # text beside text: one string
            items[-1] = json.dumps(json.loads(items[-1]) + part)
        else:
            items.append(json.dumps(part))
    return " ".join(items)


def shown_tags(backend, tags: ThinkTags | None) -> dict[int, bytes]:
    """The tags that are control tokens (no text of their own), with the text the answer shows
    for them, so that the thinking can be read apart in the text (llama.cpp's preserved tokens);
    under gpt-oss's channels, every marker its messages are read by (``harmony.MARKERS``)."""
    if tags is None:
        return {}
    shown = {}
    for tag in harmony.MARKERS if tags.harmony else (tags.start, tags.end):
        ids = backend.tokenize(tag, add_bos=False, special=True)
        if len(ids) == 1 and not backend.token_bytes(ids[0]):
            shown[ids[0]] = tag.encode("utf-8")
    return shown


def forbidden_forced(sampling) -> int | None:
    """A token the reasoning budget forces that a bias of -inf forbids (nothing left to sample
    once it forces), or None."""
    rule = sampling.reasoning_budget
    if rule is None:
        return None
    return next((token for token, amount in sampling.logit_bias if amount == float("-inf") and token in rule.forced),
                None)


def check_forced_allowed(sampling) -> None:
    """A UsageError where --logit-bias forbids a token the reasoning budget forces."""
    from specrun.errors import UsageError

    token = forbidden_forced(sampling)
    if token is not None:
        raise UsageError(f"--logit-bias forbids token {token}, which --reasoning-budget forces (its closing tag or "
                         "message)", "give that token a finite bias, or drop --reasoning-budget")


def budget_rule(backend, tags: ThinkTags, prompt_ids: Sequence[int], opened: bool, budget: int,
                message: str = ""):
    """llama.cpp's reasoning budget for an answer to ``prompt_ids`` (specrun/reasoning_budget.py):
    ``budget`` tokens of thinking, then ``message`` and the closing tag forced. The rule reads the
    answer: where the prompt opened the block, the count starts at its first token (llama.cpp also
    counts the prompt's own "\n" after the tag, which left budget 0 forcing nothing: not copied);
    else the answer may open one. Tags and message are tokenized as llama-server tokenizes them
    (special tokens parsed)."""
    from specrun.reasoning_budget import ReasoningBudget, incomplete_tokens_of

    start = tuple(backend.tokenize(tags.start, add_bos=False, special=True))
    end = tuple(backend.tokenize(tags.end, add_bos=False, special=True))
    forced = tuple(backend.tokenize(message, add_bos=False, special=True)) + end if message else end
    return ReasoningBudget((start,), (end,), forced, budget, len(prompt_ids), incomplete_tokens_of(backend),
                           opened=opened)
