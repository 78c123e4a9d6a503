"""gpt-oss's harmony format: an answer written as messages on channels, read apart.

gpt-oss does not think between tags around a block. Its generation prompt ends in
``<|start|>assistant``, and the answer is one or more messages, each a header then
``<|message|>`` then its body, ended by ``<|end|>`` (the last by ``<|return|>`` or ``<|call|>``,
end-of-text tokens, never text)::

    <|channel|>analysis<|message|>THINKING<|end|><|start|>assistant<|channel|>final<|message|>ANSWER
    <|channel|>analysis<|message|>THINKING<|end|><|start|>assistant to=functions.NAME<|channel|>commentary json
    <|message|>{ARGS}        (one line: the header runs on to <|message|>)

The channel says what a body is: ``analysis`` the thinking, ``final`` the answer, ``commentary``
a preamble the user sees (an answer's text too). A recipient (``to=functions.NAME``, in the role
part or after the channel) makes the body a tool call's arguments. llama.cpp reads it so
(common/parsers/gpt-oss.cpp); so does ``HarmonySplit``, as sessions/reasoning.py's
``ReasoningSplit`` reads tags: thinking apart, the answer's text, and each call written as
``to=functions.NAME<|message|>ARGS`` for sessions/tools.py's harmony style to read. The markers
are control tokens, shown as their text while an answer is read (``MARKERS``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from specrun.sessions.streamed import held_prefix

MESSAGE, END = "<|message|>", "<|end|>"
# the control tokens a harmony answer is read by, shown as their text (llama.cpp's preserved tokens)
MARKERS = ("<|start|>", "<|channel|>", MESSAGE, END, "<|constrain|>")
# the text every harmony template writes, and the generation prompt's end
TEMPLATE_MARK = "<|channel|>"
THINKING_START = "<|channel|>analysis<|message|>"
CALL_OPENER = "to=functions."  # how HarmonySplit writes a call's header into the answer's text
# a header longer than this with no <|message|> is not one (a model writing plain text)
MAX_HEADER_CHARS = 512
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z0-9_-]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_HEADER_START = ("<|start|>", "<|channel|>", "to=", MESSAGE)  # MESSAGE: an empty header's end


def is_harmony(source: str) -> bool:
    """Does a chat template's source write harmony's channels (gpt-oss)?"""
    return TEMPLATE_MARK in source and MESSAGE in source


def read_header(header: str) -> tuple[str, str]:
    """(channel, recipient) of a message's header text (either may be ""): the last channel named
    (gpt-oss-20b sometimes writes a stray ``<|channel|>commentary[ to=assistant]`` before the
    channel it means, as llama.cpp's parser notes) and the last recipient other than the assistant."""
    channels = _CHANNEL.findall(header)
    recipients = [name for name in _RECIPIENT.findall(header) if name != "assistant"]
    return (channels[-1] if channels else ""), (recipients[-1] if recipients else "")


def _may_begin_header(text: str) -> bool:
    """Could ``text`` (whitespace stripped at its start) be the beginning of a message's header?"""
    begun = text.lstrip()
    return not begun or any(begun.startswith(mark) or mark.startswith(begun) for mark in _HEADER_START)


def _is_header(text: str) -> bool:
    """Is ``text``, all that stands before a ``<|message|>``, a message's header (or none)?"""
    begun = text.lstrip()
    return not begun or begun.startswith(_HEADER_START)


class HarmonySplit:
    """A harmony answer's text as it streams, read into thinking and answer (``ReasoningSplit``'s
    interface: ``feed``, ``finish``, ``thinking``).

    ``analysis`` bodies are thinking (blocks after the first begin on a new line); ``final`` and
    ``commentary`` bodies without a recipient are the answer; a body to ``functions.NAME``, NAME
    one of ``callable`` (the functions the request lets the model call), goes to the answer as
    ``to=functions.NAME<|message|>`` then the body (a call, for the harmony tool style); a body to
    any other recipient (a built-in tool, a function not offered) is dropped, as llama.cpp drops it.
    Headers are never shown. Text that is no header (a model not writing harmony) is the answer's
    from there on, as it comes.
    """

    def __init__(self, callable: Sequence[str] = ()) -> None:
        self._callable = frozenset(callable)
        self._state = "header"  # header | body | loose
        self._route = ""  # where the body goes: "thinking", "answer" or "" (dropped)
        self._held = ""  # a header being read, or a body's end that may begin <|end|>
        self._thought = False  # any thinking given out yet (a later block begins on a new line)
        self._body_begun = False  # the body has given out text (leading whitespace is dropped till then)

    @property
    def thinking(self) -> bool:
        """Is the text read so far inside an analysis body?"""
        return self._state == "body" and self._route == "thinking"

    def feed(self, text: str) -> tuple[str, str]:
        """(thinking, answer) text that can go out now."""
        self._held += text
        out = {"thinking": [], "answer": [], "": []}
        while self._held:
            if self._state == "loose":
                out["answer"].append(self._held)
                self._held = ""
            elif self._state == "header":
                at = self._held.find(MESSAGE)
                if at < 0:  # (a <|message|> begun at the end does not count against the limit)
                    if not _may_begin_header(self._held) or \
                            len(self._held) - held_prefix(self._held, MESSAGE) > MAX_HEADER_CHARS:
                        self._state = "loose"
                        continue
                    break
                if not _is_header(self._held[:at]) or at > MAX_HEADER_CHARS:
                    self._state = "loose"
                    continue
                self._open_body(self._held[:at], out)
                self._held = self._held[at + len(MESSAGE):]
            else:
                closed = self._held.find(END)
                if closed >= 0:
                    self._body_out(self._held[:closed], out)
                    self._state, self._held = "header", self._held[closed + len(END):]
                    continue
                keep = held_prefix(self._held, END)
                self._body_out(self._held[: len(self._held) - keep], out)
                self._held = self._held[len(self._held) - keep:]
                break
        return "".join(out["thinking"]), "".join(out["answer"])

    def _open_body(self, header: str, out: dict) -> None:
        channel, recipient = read_header(header)
        self._state, self._body_begun = "body", False
        if recipient.startswith("functions.") and recipient[len("functions."):] in self._callable:
            self._route = "answer"
            out["answer"].append(f"{CALL_OPENER}{recipient[len('functions.'):]}{MESSAGE}")
        elif recipient and recipient != "assistant":
            self._route = ""  # a built-in tool's call (browser, python): not the answer's
        else:
            self._route = "thinking" if channel == "analysis" else "answer"

    def _body_out(self, text: str, out: dict) -> None:
        if not self._body_begun:
            text = text.lstrip()
            if not text:
                return
            self._body_begun = True
            if self._route == "thinking" and self._thought:
                text = "\n" + text
        if self._route == "thinking":
            self._thought = True
        out[self._route].append(text)

    def finish(self) -> tuple[str, str]:
        """What was held at the answer's end: a body's last characters; a header cut short is markup
        and dropped; loose text is the answer's."""
        held, self._held = self._held, ""
        if self._state == "loose":
            return "", held
        if self._state == "header":
            return "", ("" if _may_begin_header(held) else held)
        out = {"thinking": [], "answer": [], "": []}
        self._body_out(held, out)
        return "".join(out["thinking"]), "".join(out["answer"])


def harmony_messages(messages: Sequence[dict]) -> list[dict]:
    """A conversation as harmony templates take it back, as llama.cpp gives it: an assistant
    message's ``reasoning_content`` (what clients send back, as specrun answers it) in the
    ``thinking`` field the template reads and, beside tool calls, no content next to it (the
    template refuses both); a null content left out (the template reads a content it finds as text)."""
    taken = []
    for message in messages:
        if message.get("role") == "assistant":
            message = dict(message)
            thinking = message.pop("reasoning_content", None)
            if isinstance(thinking, str):
                message["thinking"] = thinking
                if message.get("tool_calls"):
                    message.pop("content", None)
            if message.get("content", "") is None:
                del message["content"]
        taken.append(message)
    return taken
