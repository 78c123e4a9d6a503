"""Chat templates from model metadata, rendered in a sandbox.

A chat template is Jinja source shipped inside the model (GGUF
``tokenizer.chat_template``, or the tokenizer's ``chat_template``): code written by
whoever published the model. It runs only in Jinja's ``ImmutableSandboxedEnvironment``,
with the variables and helpers Hugging Face's ``apply_chat_template`` provides
(``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``,
``raise_exception``, ``strftime_now``, loop controls, a ``tojson`` that does not
escape HTML). A template that reaches for Python internals (``__class__``,
``__globals__``, ``mro``…) is refused before or while it runs, never executed further.
A rendering is also bounded: at most MAX_RENDER_SECONDS, and no string, list or output
longer than MAX_RENDER_CHARS (checked before a repetition, padding or format width
allocates it), so a hostile template cannot hang a run or exhaust memory.

A model without a template gets ``FALLBACK_TEMPLATE``, a plain transcript::

    System: You are terse.

    User: Hello

    Assistant:

one ``Role: content`` paragraph per message, and ``Assistant:`` as the cue for the
answer. An answer follows its cue exactly as generated (usually from a leading
space), so a rendered answer always extends the prompt it answered and the next
turn reuses every cached token. The model's BOS token is added by the tokenizer.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment, is_internal_attribute

from specrun.backends.base import Backend
from specrun.errors import ChatTemplateError, ConversationRefusedError

FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}Assistant:{% else %}{{ message['role'] | capitalize }}: {% endif %}"
    "{{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

_REFUSAL_FIX = "use another model, or report the template to its publisher"
# Real templates render a conversation in milliseconds, at most a few times its length.
MAX_RENDER_SECONDS = 5.0
MAX_RENDER_CHARS = 16_000_000
_NUMBERS = re.compile(r"\d+")


class _UnsafeAccess(SecurityError):
    """The template read an attribute the sandbox forbids."""

    def __init__(self, obj: Any, attribute: str) -> None:
        super().__init__(f"{type(obj).__name__}.{attribute}")
        self.internal = attribute.startswith("_") or is_internal_attribute(obj, attribute)
        self.where = f"{type(obj).__name__}.{attribute}"


class _TemplateRaised(Exception):
    """The template called ``raise_exception``: it refuses the conversation."""


class _OverLimit(Exception):
    """The rendering ran too long or built something too large."""


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, but a forbidden attribute fails at once instead of rendering
    empty, and every attribute, item, call, filter and arithmetic step checks the limits."""

    intercepted_binops = frozenset(["*", "**", "%", "+"])  # also keeps them from constant folding

    deadline = float("inf")

    def unsafe_undefined(self, obj: Any, attribute: str):
        raise _UnsafeAccess(obj, attribute)

    def getattr(self, obj: Any, attribute: str) -> Any:
        if isinstance(obj, str) and attribute in ("format", "format_map"):
            _check_widths(obj)  # "{:>10000000000}".format(x)
        return _bounded(self, super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        return _bounded(self, super().getitem(obj, argument))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature)
        return _bounded(__self, super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        _check_before(operator, left, right)
        return _bounded(self, super().call_binop(context, operator, left, right))


def _bounded(env: _ChatSandbox, value: Any) -> Any:
    if time.monotonic() > env.deadline:
        raise _OverLimit(f"it ran for more than {MAX_RENDER_SECONDS:g} s")
    if isinstance(value, (str, list, tuple, dict)) and len(value) > MAX_RENDER_CHARS:
        raise _OverLimit(f"it built a value of more than {MAX_RENDER_CHARS} items")
    return value


def _check_before(operator: str, left: Any, right: Any) -> None:
    """Refuse a repetition, power or format width whose result would be too large to build."""
    if operator == "*":
        for sequence, count in ((left, right), (right, left)):
            if isinstance(sequence, (str, list, tuple)) and isinstance(count, int) and len(sequence) * count > MAX_RENDER_CHARS:
                raise _OverLimit(f"it repeats a value {count} times")
    elif operator == "**" and isinstance(right, (int, float)) and isinstance(left, (int, float)):
        if abs(left) > 1 and right * max(len(str(int(abs(left)))), 1) > 10_000:
            raise _OverLimit(f"it raises {left} to the power {right}")
    elif operator == "%" and isinstance(left, str):
        _check_widths(left)


def _check_widths(format_text: str) -> None:
    if any(int(number) > MAX_RENDER_CHARS for number in _NUMBERS.findall(format_text)):
        raise _OverLimit("it formats with a width too large to build")


def _bounded_filter(env: _ChatSandbox, function):
    """A filter whose parameters (not the value filtered) may not ask for sizes over the limit."""

    # A filter marked to receive the context, eval context or environment gets it before the value.
    passed = 2 if hasattr(function, "jinja_pass_arg") else 1

    def bounded(*args, **kwargs):
        for argument in (*args[passed:], *kwargs.values()):
            if isinstance(argument, int) and argument > MAX_RENDER_CHARS:
                raise _OverLimit(f"it passes {argument} to a filter")
        return _bounded(env, function(*args, **kwargs))

    if passed == 2:
        bounded.jinja_pass_arg = function.jinja_pass_arg
    return bounded


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False,
            ensure_ascii: bool = False) -> str:
    """JSON as the template author expects it: no HTML escaping (unlike Jinja's own filter)."""
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


def _environment() -> _ChatSandbox:
    # trim_blocks and lstrip_blocks as in transformers, so renderings match Hugging Face's.
    env = _ChatSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(env, function) for name, function in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _internals_named(source_ast: nodes.Template) -> list[str]:
    """Dunder attributes the template names outright (``x.__class__``, ``x['__globals__']``)."""
    names = []
    for node in source_ast.find_all((nodes.Getattr, nodes.Getitem)):
        name = node.attr if isinstance(node, nodes.Getattr) else getattr(node.arg, "value", None)
        if isinstance(name, str) and name.startswith("__"):
            names.append(name)
    return names


def _refusal(what: str) -> ChatTemplateError:
    return ChatTemplateError(
        f"the model's chat template tried to access Python internals ({what}); refusing to run it", _REFUSAL_FIX
    )


# The names a rendering gives the template itself: a template variable of the user's
# (``--chat-template-kwargs``, a request's ``chat_template_kwargs``) may not take one.
RENDERING_NAMES = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "raise_exception",
                   "strftime_now")
# Jinja's own globals, which templates call (Qwen3's calls namespace())
JINJA_NAMES = ("range", "dict", "lipsum", "cycler", "joiner", "namespace")


def template_variables_problem(variables: Any) -> str:
    """What is wrong with variables given a template (empty if nothing): an object of names to
    JSON values, none of them a name the rendering gives (``RENDERING_NAMES``), and
    ``enable_thinking`` a boolean (as llama-server checks it: a string "false" would read true)."""
    if not isinstance(variables, dict):
        return "must be an object of template variables, e.g. {\"enable_thinking\": false}"
    for name, value in variables.items():
        if not name.isidentifier():
            return f"{json.dumps(name)[:40]} is not a name a template can read"
        if name in RENDERING_NAMES:
            return f"{name} is given to the template by the rendering itself; send it where the API takes it"
        if name in JINJA_NAMES:
            return f"{name} is one of Jinja's own functions, which templates call; name the variable otherwise"
        if name == "enable_thinking" and not isinstance(value, bool):
            return f"enable_thinking must be true or false, got {json.dumps(value)[:40]}"
        try:  # a lone surrogate (JSON's \\ud800) is no text a tokenizer takes
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return f"{name}'s value holds text that is not UTF-8 (a lone surrogate)"
    return ""


class ChatTemplate:
    """A compiled, sandboxed chat template (the model's, or ``FALLBACK_TEMPLATE``), with the
    variables every rendering gives it beside the conversation (``with_variables``)."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "") -> None:
        self.is_fallback = not source
        self.source = source or FALLBACK_TEMPLATE
        self.bos_token = bos_token
        self.eos_token = eos_token
        # e.g. enable_thinking, reasoning_effort; a template that reads enable_thinking is given it true,
        # as llama-server gives it (--reasoning off, or a request's, says false)
        self.variables: dict[str, Any] = {"enable_thinking": True} if "enable_thinking" in self.source else {}
        env = _environment()
        try:
            parsed = env.parse(self.source)
        except TemplateError as exc:
            raise ChatTemplateError(
                f"the model's chat template is not valid Jinja: {exc}", "use a model with a working chat template"
            ) from None
        internals = _internals_named(parsed)
        if internals:
            raise _refusal(", ".join(sorted(set(internals))))
        try:  # compiling finds what parsing does not: a filter or test no environment has
            self._template = env.from_string(parsed)
        except TemplateError as exc:
            raise ChatTemplateError(
                f"the model's chat template does not compile: {exc}", "use a model with a working chat template"
            ) from None

    def with_variables(self, variables: dict[str, Any] | None) -> ChatTemplate:
        """This template rendering with ``variables`` too (over its own of the same names): a copy
        sharing the compiled template. Checked by ``template_variables_problem`` first."""
        if not variables:
            return self
        copy = object.__new__(ChatTemplate)
        copy.__dict__.update(self.__dict__)
        copy.variables = {**self.variables, **variables}
        return copy

    @classmethod
    def for_backend(cls, backend: Backend) -> ChatTemplate:
        """The backend's template with its BOS/EOS texts.

        ``eos_token`` is the lowest-numbered end-of-generation token: the backend
        interface lists every EOG id but does not single out the GGUF's eos id.
        """
        vocab = backend.vocab
        bos = backend.token_text(vocab.bos_id) if vocab.bos_id is not None else ""
        eos = backend.token_text(min(vocab.eos_ids)) if vocab.eos_ids else ""
        return cls(backend.chat_template(), bos, eos)

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True,
               extra: dict | None = None) -> str:
        """The conversation as the model's prompt text; ChatTemplateError if the template fails,
        is unsafe, or runs past its limits. ``extra``: more variables the template may read
        (``tools``)."""
        self._template.environment.deadline = time.monotonic() + MAX_RENDER_SECONDS
        try:
            return self._render(messages, add_generation_prompt, extra or {})
        except _OverLimit as exc:
            raise ChatTemplateError(
                f"the model's chat template was stopped: {exc}, too much for any conversation", _REFUSAL_FIX
            ) from None
        except _UnsafeAccess as exc:
            if exc.internal:
                raise _refusal(exc.where) from None
            raise ChatTemplateError(
                f"the model's chat template tried to modify its input ({exc.where}), which the sandbox forbids",
                _REFUSAL_FIX,
            ) from None
        except SecurityError as exc:
            raise ChatTemplateError(f"the model's chat template did something unsafe: {exc}", _REFUSAL_FIX) from None
        except _TemplateRaised as exc:
            raise ConversationRefusedError(
                f"the model's chat template refused the conversation: {exc}",
                "change the conversation (/system, /reset) to what the model's template accepts",
            ) from None
        except Exception as exc:  # a template bug: undefined names, type errors in its expressions
            raise ChatTemplateError(
                f"the model's chat template failed: {type(exc).__name__}: {exc}",
                "use a model with a working chat template",
            ) from None


    def _render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool, extra: dict) -> str:
        """The rendering, streamed so that its length is checked as it grows."""
        pieces, length = [], 0
        for piece in self._template.generate(
            **self.variables,
            **extra,
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        ):
            length += len(piece)
            if length > MAX_RENDER_CHARS:
                raise _OverLimit(f"its output passed {MAX_RENDER_CHARS} characters")
            _bounded(self._template.environment, piece)
            pieces.append(piece)
        return "".join(pieces)


def render_with_spans(template: ChatTemplate, messages: Sequence[dict[str, str]],
                      add_generation_prompt: bool = True, extra: dict | None = None) -> tuple[str, list[tuple[int, int]]]:
    """``messages`` rendered, and where each message's content stands in the text, in order.

    The template is rendered a second time with each content replaced by a marker of its own
    that no text holds; the pieces between the markers are the template's own text, so each
    content is placed exactly, even where it repeats the template's text (a message that is
    ``<|im_end|>``, or ``<|im_start|>system``). A template that rendered the markers otherwise
    than the contents (one that branches on a message's text, or repeats it) is matched by
    searching instead (:func:`message_spans`).
    """
    text = template.render(messages, add_generation_prompt, extra)
    marked = [{**message, "content": _MARKER.format(i)} if isinstance(message.get("content"), str) else message
              for i, message in enumerate(messages)]
    try:
        skeleton = template.render(marked, add_generation_prompt, extra)
    except ChatTemplateError:
        return text, message_spans(text, messages)
    spans = _placed_spans(text, skeleton, messages)
    return text, spans if spans is not None else message_spans(text, messages)


# private-use characters, which no template's own text holds (typed text never enters the skeleton)
_MARKER = "\ue000specrun-message-{}\ue001"
_MARKER_RE = re.compile("\ue000specrun-message-(\\d+)\ue001")


def _placed_spans(text: str, skeleton: str, messages: Sequence[dict[str, str]]) -> list[tuple[int, int]] | None:
    """The contents' spans in ``text`` where ``skeleton`` (the same rendering with markers for the
    contents) is ``text`` with each marker standing for its content, as is or stripped; else None."""
    pieces = _MARKER_RE.split(skeleton)  # template text, message index, template text, …
    literals, indices = pieces[0::2], [int(i) for i in pieces[1::2]]
    if len(set(indices)) != len(indices) or indices != sorted(indices) or any(i >= len(messages) for i in indices):
        return None
    spans, at = [], 0
    for literal, index, following in zip(literals, indices, literals[1:]):
        if not text.startswith(literal, at):
            return None
        at += len(literal)
        content = messages[index]["content"]
        for candidate in dict.fromkeys((content, content.strip())):
            if text.startswith(candidate + following, at):
                if candidate:  # an empty content has nothing to protect
                    spans.append((at, at + len(candidate)))
                at += len(candidate)
                break
        else:
            return None
    return spans if text[at:] == literals[-1] else None


def message_spans(text: str, messages: Sequence[dict[str, str]]) -> list[tuple[int, int]]:
    """Where each message's content stands in ``text`` (a rendering of ``messages``), in order,
    found by searching for each content after the previous one: the fallback of
    :func:`render_with_spans` for templates that transform what they are given.

    A template that rewrote a content (stripped it, say) is matched on the stripped text, and one
    it dropped or transformed otherwise has no span.
    """
    spans, start = [], 0
    for message in messages:
        content = message.get("content") or ""
        for candidate in (content, content.strip()):
            at = text.find(candidate, start) if candidate else -1
            if at >= 0:
                spans.append((at, at + len(candidate)))
                start = at + len(candidate)
                break
    return spans


def render_user_prompt(backend: Backend, user_text: str, variables: dict | None = None) -> tuple[str, list[int]]:
    """One user message in ``backend``'s chat template (its default system prompt, if the
    template has one, included), as text and token ids: what ``generate`` and ``bench`` send.
    ``variables``: the template's own (--chat-template-kwargs, --reasoning)."""
    template = ChatTemplate.for_backend(backend).with_variables(variables)
    text, spans = render_with_spans(template, [{"role": "user", "content": user_text}])
    return text, tokenize_rendered(backend, template, text, spans)


def tokenize_rendered(backend: Backend, template: ChatTemplate, text: str,
                      spans: Sequence[tuple[int, int]], start: int = 0) -> list[int]:
    """Token ids of ``text[start:]``, a rendered conversation (``spans`` as
    :func:`message_spans` finds them in ``text``). From the start: exactly one BOS where
    the model wants one, whether or not the template wrote it."""
    add_bos = start == 0 and backend.vocab.add_bos
    if add_bos and template.bos_token and text.startswith(template.bos_token):
        start = len(template.bos_token)  # the template wrote the BOS the tokenizer adds
    shifted = [(max(a, start) - start, b - start) for a, b in spans if b > start]
    return tokenize_chat(backend, text[start:], shifted, add_bos=add_bos)


def tokenize_chat(backend: Backend, text: str, spans: Sequence[tuple[int, int]], add_bos: bool) -> list[int]:
    """Token ids of a rendered conversation: the template's own markers become control
    tokens; text inside ``spans`` (what the user typed, what the model answered) never does.

    Without control-token text inside a span this is exactly ``tokenize(text,
    special=True)``. Otherwise the text is split at the template's own markers only, and
    the pieces between them, spans included, are tokenized as plain text: what a user
    types that looks like ``<|im_end|>`` stays those characters.
    """
    controls = backend.control_texts()
    if not any(control in text[a:b] for a, b in spans for control in controls):
        return backend.tokenize(text, add_bos=add_bos, special=True)
    ids: list[int] = []
    piece_start = 0
    for at, control in _template_markers(text, spans, controls):
        if at > piece_start or (add_bos and not ids):
            ids += backend.tokenize(text[piece_start:at], add_bos=add_bos and not ids, special=False)
        ids += backend.tokenize(control, add_bos=False, special=True)
        piece_start = at + len(control)
    if piece_start < len(text):
        ids += backend.tokenize(text[piece_start:], add_bos=add_bos and not ids, special=False)
    return ids


def _template_markers(text: str, spans: Sequence[tuple[int, int]], controls: frozenset[str]):
    """(position, control text) of every control-token text outside ``spans``, left to right,
    the longest at a position first, as a tokenizer reads them."""
    inside = [False] * len(text)
    for a, b in spans:
        inside[a:b] = [True] * (b - a)
    found = []
    for control in controls:
        at = text.find(control)
        while at >= 0:
            if not any(inside[at : at + len(control)]):
                found.append((at, -len(control), control))
            at = text.find(control, at + 1)
    found.sort()
    end = 0
    for at, _, control in found:
        if at >= end:  # not overlapping a marker already taken
            yield at, control
            end = at + len(control)
