"""Tool calls: tool definitions rendered into the prompt, and calls read back out of the answer.

A template that takes ``tools`` (Qwen, Llama 3.1+, Mistral) renders them itself, and the calls
come back in the format its model was trained on. A template that does not (SmolLM2, the demo
models) gets the definitions in its system message, in the Hermes format most small instruct
models know (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``), and so do the calls and
results of earlier turns; the answer is read in that format. Gemma's templates take no tools
either, and Google's guide prompts Gemma to call functions as Python: it gets the pythonic style
(``[get_weather(city="Oslo")]``, results back as ```` ```tool_output ```` blocks).

Where the caller requires a call (``tool_choice`` "required" or a named function), a grammar in
the style's format forces one, its arguments following their function's JSON schema
(specrun/grammar.py): the model cannot answer otherwise, and speculation drafts the text the
format forces for free.

Formats read (``STYLES``): Hermes/Qwen ``<tool_call>`` JSON; Llama 3's bare JSON object
(``{"name": ..., "parameters": ...}``, after ``<|python_tag|>`` where the model writes it);
Mistral's ``[TOOL_CALLS]`` JSON list; Python calls with literal keyword arguments, in a list or a
```` ```tool_code ```` block (read with ``ast``, never run); gpt-oss's harmony messages to
``functions.NAME`` (sessions/harmony.py). Control tokens (``<|python_tag|>``, ``[TOOL_CALLS]``) have
no text, so a call may also begin the answer without them.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import keyword
import re
import secrets
import string
import tokenize
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from specrun.errors import ChatTemplateError, UsageError
from specrun.grammar import GrammarError, GrammarSpec
from specrun.sessions.harmony import CALL_OPENER, MESSAGE, harmony_messages, is_harmony
from specrun.sessions.reasoning import HARMONY_ASSISTANT, grammar_items
from specrun.sessions.templates import ChatTemplate, render_with_spans


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, its arguments' JSON schema."""

    name: str
    description: str = ""
    parameters: dict | None = None

    def as_openai(self) -> dict:
        """The definition as templates and prompts take it (OpenAI's shape)."""
        function = {"name": self.name, "description": self.description,
                    "parameters": self.parameters or {"type": "object", "properties": {}}}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""

    def as_openai(self) -> dict:
        return {"id": self.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolChoice:
    """``tool_choice``: "auto", "none", "required", or the name of the one function to call;
    ``allowed``: OpenAI's ``allowed_tools``, the functions the model may call of those defined
    (all of them stay in the prompt, so its cache holds across requests that allow others)."""

    mode: str = "auto"
    function: str | None = None
    allowed: tuple[str, ...] | None = None

    @property
    def forces_a_call(self) -> bool:
        return self.mode in ("required", "function")

    def allows(self, name: str) -> bool:
        """May the model call the function ``name``?"""
        if self.mode == "function":
            return name == self.function
        return self.mode != "none" and (self.allowed is None or name in self.allowed)

    def callable(self, tools: Sequence["Tool"]) -> list["Tool"]:
        """The functions of ``tools`` the model may call, in their order."""
        return [tool for tool in tools if self.allows(tool.name)]


CUT_REASONS = ("length", "context")  # an answer's finish reasons where it stopped short, maybe inside a call
TOOL_CALL_CUT_NOTE = ("the answer stopped inside its tool calls (max tokens or the context), so only the calls "
                      "written whole count; raise --max-tokens (-n) for the rest")

# A call is one line of JSON, as the formats' examples write it: at most a space between items
# (a small model given room for line breaks and indentation fills max_tokens with them).
CALL_JSON_OPTIONS = {"whitespace_pattern": r"\x20?"}


# ---- tool definitions ---------------------------------------------------------------------
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # OpenAI's rule for a function's name


class ToolDefinitionError(UsageError):
    """A tool definition or tool_choice that cannot be used: the problem, where it is (a request's
    field, ``tools[2].function.name``) and an OpenAI error code for a server to answer with."""

    def __init__(self, problem: str, where: str, code: str = "invalid_value") -> None:
        super().__init__(problem, "see the tools format at https://platform.openai.com/docs/guides/function-calling")
        self.where = where
        self.code = code


def _shown(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def tool_definitions(tools) -> tuple[Tool, ...]:
    """OpenAI's ``tools``, checked: function definitions, each with a name and, where given, a JSON
    schema object of its arguments (``tool_choice_of`` compiles those a forced call may name)."""
    if tools is None or tools == []:
        return ()
    if not isinstance(tools, list):
        raise ToolDefinitionError('tools must be a list of {"type": "function", "function": {...}} objects',
                                  "tools", "invalid_type")
    parsed, names = [], set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(
                tool.get("function"), dict):
            raise ToolDefinitionError(f'{where} must be {{"type": "function", "function": {{"name": ...}}}}: '
                                      "only function tools are taken", where, "invalid_type")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise ToolDefinitionError(f"{where}.function.name must be 1 to 64 letters, digits, '_', '.' or '-', "
                                      f"got {_shown(name)}", f"{where}.function.name",
                                      "missing_required_parameter" if name is None else "invalid_value")
        if name in names:
            raise ToolDefinitionError(f"{where}.function.name: {name!r} is defined twice", f"{where}.function.name")
        names.add(name)
        description = function.get("description") or ""
        if not isinstance(description, str):
            raise ToolDefinitionError(f"{where}.function.description must be a string",
                                      f"{where}.function.description", "invalid_type")
        try:
            description.encode("utf-8")
        except UnicodeEncodeError as exc:  # JSON may escape half of a surrogate pair alone
            raise ToolDefinitionError(f"{where}.function.description is not valid Unicode text (a lone surrogate "
                                      f"at character {exc.start})", f"{where}.function.description") from None
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise ToolDefinitionError(f"{where}.function.parameters must be a JSON schema object",
                                          f"{where}.function.parameters", "invalid_type")
            if parameters.get("type", "object") != "object":  # a call's arguments are an object
                raise ToolDefinitionError(f"{where}.function.parameters must describe an object (\"type\": "
                                          f"\"object\"), got type {_shown(parameters.get('type'))}",
                                          f"{where}.function.parameters")
            try:
                json.dumps(parameters, ensure_ascii=False).encode("utf-8")
            except RecursionError:
                raise ToolDefinitionError(f"{where}.function.parameters nests too deeply",
                                          f"{where}.function.parameters") from None
            except UnicodeEncodeError as exc:  # rendered into the prompt: a lone surrogate was a 500
                raise ToolDefinitionError(f"{where}.function.parameters is not valid Unicode text (a lone "
                                          f"surrogate at character {exc.start} of it)",
                                          f"{where}.function.parameters") from None
        parsed.append(Tool(name, description, parameters))
    return tuple(parsed)


def _check_schemas(tools: Sequence[Tool], choice: ToolChoice) -> None:
    """The schemas of the functions a forced call may name compile (its arguments follow them).
    Others are only shown to the model, as OpenAI takes any JSON schema in a function's
    parameters: a keyword llguidance cannot enforce (uniqueItems, not) refused every request
    that carried the tool."""
    for index, tool in enumerate(tools):
        if tool.parameters is None or not choice.allows(tool.name):
            continue
        where = f"tools[{index}].function.parameters"
        try:
            GrammarSpec("json_schema", json.dumps(tool.parameters)).check()
        except RecursionError:
            raise ToolDefinitionError(f"{where} nests too deeply", where) from None
        except GrammarError as exc:
            forced = f'tool_choice "{choice.mode}"' if choice.mode == "required" else "tool_choice names it"
            forced += " among its allowed tools" if choice.allowed is not None else ""
            raise ToolDefinitionError(f"{where}: {exc.problem} ({forced}, so its arguments must follow the schema; "
                                      "a call the model may choose takes any schema)", where) from None


def tool_choice_of(choice, tools: Sequence[Tool]) -> ToolChoice:
    """OpenAI's ``tool_choice`` (None: "auto"), checked against the tools defined."""
    if choice is None:
        return ToolChoice()
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise ToolDefinitionError('tool_choice: "required" needs tools to call: send tools too', "tool_choice")
        if choice == "required":
            _check_schemas(tools, ToolChoice(choice))
        return ToolChoice(choice)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not any(tool.name == name for tool in tools):
            known = ", ".join(tool.name for tool in tools) or "none"
            raise ToolDefinitionError(f"tool_choice names the function {_shown(name)}, which tools does not "
                                      f"define (defined: {known})", "tool_choice")
        _check_schemas(tools, ToolChoice("function", name))
        return ToolChoice("function", name)
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return _allowed_tools(choice.get("allowed_tools"), tools)
    raise ToolDefinitionError('tool_choice must be "auto", "none", "required", {"type": "function", "function": '
                              '{"name": ...}} or {"type": "allowed_tools", "allowed_tools": {...}}', "tool_choice",
                              "invalid_type")


def _allowed_tools(allowed, tools: Sequence[Tool]) -> ToolChoice:
    """OpenAI's ``{"mode": "auto" | "required", "tools": [{"type": "function", "function": {"name":
    ...}}, ...]}``: the functions, of those defined, the model may call (or must call one of)."""
    where = "tool_choice.allowed_tools"
    if not isinstance(allowed, dict) or allowed.get("mode", "auto") not in ("auto", "required") or not isinstance(
            allowed.get("tools"), list) or not allowed["tools"]:
        raise ToolDefinitionError(f'{where} must be {{"mode": "auto" or "required", "tools": [{{"type": "function", '
                                  '"function": {"name": ...}}, ...]} naming at least one function', where,
                                  "invalid_type")
    defined, names = {tool.name for tool in tools}, []
    for index, entry in enumerate(allowed["tools"]):
        function = entry.get("function") if isinstance(entry, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(entry, dict) or entry.get("type", "function") != "function" or not isinstance(name, str):
            raise ToolDefinitionError(f'{where}.tools[{index}] must be {{"type": "function", "function": {{"name": '
                                      '...}}', f"{where}.tools[{index}]", "invalid_type")
        if name not in defined:
            known = ", ".join(tool.name for tool in tools) or "none"
            raise ToolDefinitionError(f"{where}.tools[{index}] names the function {_shown(name)}, which tools does "
                                      f"not define (defined: {known})", f"{where}.tools[{index}]")
        names.append(name)
    choice = ToolChoice(allowed.get("mode", "auto"), allowed=tuple(dict.fromkeys(names)))
    if choice.forces_a_call:
        _check_schemas(tools, choice)
    return choice


# ---- reading calls ------------------------------------------------------------------------
def _call_of(value) -> ToolCall | None:
    """A call from a decoded JSON object: {"name", "arguments" | "parameters"}; None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text already
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    try:  # 1e400 reads as infinity, which JSON cannot write: not arguments a client can read
        return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False, allow_nan=False))
    except ValueError:
        return None


SEPARATORS = re.compile(r"[ \t\r\n;,]*")
BARE_JSON_CALL = re.compile(r'\s*\[?\s*\{\s*"name"')  # a JSON call begun bare, alone or in a list
BARE_PYTHON_CALL = re.compile(r"\s*\[\s*[A-Za-z_][\w.]*\s*\(")  # a list of Python calls begun bare


def _json_values(text: str) -> list:
    """The JSON values written one after another in ``text`` (separated by whitespace, ``;`` or
    ``,``), or [] where any of it is not JSON (or nests past what Python's parser takes)."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        at = SEPARATORS.match(text, at).end()
        if at >= len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return []
        values.append(value)


def _values_before_cut(text: str) -> tuple[list, bool]:
    """The JSON values written whole in ``text`` before one cut off at its end: one after another
    (as ``_json_values`` reads them) or the items of a list left open; [] where what follows them
    is not the beginning of an object (not a call cut short). And whether the text ends inside
    them: an object cut off, or a list still open."""
    decoder, values = json.JSONDecoder(), []
    listed = text.startswith("[")
    at = 1 if listed else 0
    while True:
        at = SEPARATORS.match(text, at).end()
        if at >= len(text):
            return values, listed
        if text[at] != "{":
            return [], False
        try:
            value, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return values, True
        values.append(value)


@dataclass(frozen=True)
class ToolStyle:
    """How one family's models write calls: where a call begins (``opener``, which a stream holds
    back from), and how the calls are read and forced."""

    name: str
    opener: str  # the text a call begins with where it follows content
    arguments_key: str = "arguments"
    bare_starts: str = ""  # the characters a call begun without its opener may begin the answer with

    def parse(self, text: str, names: Sequence[str] | None = None) -> tuple[str, list[ToolCall]]:
        """The answer's content (the text before any call) and the calls it makes; with ``names``,
        only calls to those functions count (JSON of the same shape naming another is text)."""
        content, calls = self._read(text)
        if names is not None and not all(call.name in names for call in calls):
            return text, []
        return content, [dataclasses.replace(call, id=self.new_id()) for call in calls]

    def parse_cut(self, text: str, names: Sequence[str] | None = None) -> tuple[str, list[ToolCall]]:
        """An answer cut short (max_tokens) inside its calls: the calls whole before the cut (Hermes'
        closed ``<tool_call>`` blocks, a JSON list's or a sequence's whole objects, Python calls
        closed before it) and the content before the first; the call cut off is dropped, never
        handed back as content."""
        content, calls, _ = self._salvaged(text, names)
        if calls:
            return content, calls
        start = text.find(self.opener) if self.opener else -1
        return (text[:start].strip() if start >= 0 else ""), []

    def read_answer(self, text: str, names: Sequence[str] | None, cut: bool) -> tuple[list[ToolCall], bool]:
        """The calls an answer made, and whether a call cut off by max_tokens (``cut``: the answer
        stopped there) was dropped: the calls whole before it still count."""
        calls = self.parse(text, names)[1]
        if calls:  # whole; cut, the next call's opener may have begun after them
            return calls, cut and self._next_call_begun(text)
        if not cut:
            return [], False
        _, calls, inside = self._salvaged(text, names)
        return calls, inside

    def _salvaged(self, text: str, names: Sequence[str] | None) -> tuple[str, list[ToolCall], bool]:
        """``_read_cut``'s, the calls given ids, none where one names a function not defined."""
        content, calls, inside = self._read_cut(text)
        if not calls or (names is not None and not all(call.name in names for call in calls)):
            return text, [], inside
        return content, [dataclasses.replace(call, id=self.new_id()) for call in calls], inside

    def _next_call_begun(self, text: str) -> bool:
        """After the last closed block (Hermes' ``</tool_call>``, a ```` ```tool_code ```` block's
        fence), the first characters of another's opener (what parse reads past)."""
        if self.name == "hermes":
            end = text.rfind("</tool_call>")
            end = end + len("</tool_call>") if end >= 0 else -1
        else:
            blocks = list(TOOL_CODE.finditer(text)) if self.name == "pythonic" else []
            end = blocks[-1].end() if blocks and blocks[-1].group(0).endswith("```") else -1
        tail = text[end:].strip() if end >= 0 else ""
        return bool(tail) and (self.opener.startswith(tail) or tail.startswith(self.opener))

    def _read_cut(self, text: str) -> tuple[str, list[ToolCall], bool]:
        """A cut answer's content, the calls whole before the cut, and whether the cut lies inside
        a call (an opener not closed, a JSON object or a list of them left open)."""
        if self.name == "hermes":
            completed = _closing_completed(text)
            if completed != text:  # every block reads whole with its tag completed: nothing was cut off
                content, calls = _parse_hermes(completed)
                if calls:
                    return content, calls, False
            end = text.rfind("</tool_call>")
            inside = text.rfind("<tool_call>") > end
            content, calls = _parse_hermes(text[: end + len("</tool_call>")]) if end >= 0 else (text, [])
            return content, calls, inside
        start = text.find(self.opener) if self.opener else -1
        if start < 0 and BARE_JSON_CALL.match(text) is None:
            return text, [], False
        body = text[start + len(self.opener):] if start >= 0 else text
        values, inside = _values_before_cut(body.strip())
        calls = [_call_of(value) for value in values]
        if values and all(calls):
            return (text[:start].strip() if start >= 0 else ""), calls, inside
        return text, [], inside and not values

    def _read(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.name == "hermes":
            return _parse_hermes(text)
        start = text.find(self.opener) if self.opener else -1
        if start < 0 and text.lstrip()[:1] not in tuple(self.bare_starts):
            return text, []  # a call without its opener begins the answer as bare_starts say (a stream sent it)
        body = text[start + len(self.opener):] if start >= 0 else text
        content = text[:start] if start >= 0 else ""
        values = _json_values(body.strip())
        if len(values) == 1 and isinstance(values[0], list):
            values = values[0]
        calls = [_call_of(value) for value in values]
        if values and all(calls):
            return content.strip(), calls
        return text, []

    def new_id(self) -> str:
        """A call's id as the family's templates take it back: Mistral's checks for nine letters or
        digits ("Tool call IDs should be alphanumeric strings with length 9!"), the others take OpenAI's."""
        if self.name == "mistral":
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return f"call_{uuid.uuid4().hex[:24]}"

    def grammar(self, tools: Sequence[Tool], choice: ToolChoice, parallel: bool = False,
                backend=None) -> GrammarSpec:
        """A grammar whose every text is a call in this style (one or more where ``parallel``), to
        the functions ``choice`` allows, each one's arguments following its schema. One call by
        default, as llama-server does: a small model told it may call again calls again until
        max_tokens cuts it off."""
        allowed = choice.callable(tools)
        call = " | ".join(f"%json {json.dumps(self._call_schema(tool))}" for tool in allowed)
        if self.name == "hermes":
            block = '"<tool_call>\\n" call "\\n</tool_call>"'
            rules = f'start: {block} ("\\n" {block})*\n' if parallel else f"start: {block}\n"
        elif self.name == "mistral":
            rules = 'start: "[" call (", " call)* "]"\n' if parallel else 'start: "[" call "]"\n'
        else:
            rules = 'start: call ("; " call)*\n' if parallel else "start: call\n"
        return GrammarSpec("lark", rules + f"call: {call}\n")

    def _call_schema(self, tool: Tool) -> dict:
        """The JSON object of a call to ``tool``: its name, and arguments following its schema
        (kept as a root of their own under $defs where they refer into themselves)."""
        arguments, defs = tool.parameters or {"type": "object"}, {}
        if "$ref" in json.dumps(arguments):  # "#": the arguments' schema, kept under the call's $defs
            arguments = _rerooted({"$ref": "#"}, arguments)
            defs = {"$defs": arguments.pop("$defs")}
        return {"type": "object", "additionalProperties": False, "required": ["name", self.arguments_key],
                "properties": {"name": {"const": tool.name}, self.arguments_key: arguments},
                **defs, "x-guidance": CALL_JSON_OPTIONS}

    def written(self, calls: Sequence[dict]) -> str:
        """Earlier calls (OpenAI's ``tool_calls`` of an assistant message) as this style writes them,
        for a template that does not render calls itself."""
        objects = [{"name": call["function"]["name"], "arguments": _arguments_object(call["function"]["arguments"])}
                   for call in calls]
        return "\n".join(f"<tool_call>\n{json.dumps(each, ensure_ascii=False)}\n</tool_call>" for each in objects)

    def instructions(self, tools: Sequence[Tool]) -> str:
        """What a system message says of the tools, for a template that does not render them."""
        return SYSTEM_TOOLS.format(tools="\n".join(json.dumps(tool.as_openai(), ensure_ascii=False) for tool in tools))

    def result(self, content: str) -> str:
        """A tool's result as a user message carries it back, for a template that takes no tool role."""
        return f"<tool_response>\n{content}\n</tool_response>"


# the body is stripped after matching: \s* on both sides of a lazy body backtracks quadratically
HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def _closing_completed(text: str) -> str:
    """A cut answer whose last block lacks only (the rest of) its ``</tool_call>`` (max_tokens one
    token short of a forced call's end: its call was whole, and dropped; Qwen writes the tag as
    one token) with the tag completed; the text as it is otherwise. The block's JSON must still
    read whole to count as a call."""
    closing = "</tool_call>"
    body = text.rstrip()
    if text.rfind("<tool_call>") <= text.rfind(closing):
        return text
    for size in range(len(closing) - 1, -1, -1):
        if body.endswith(closing[:size]):  # size 0: none of the tag written
            return body[: len(body) - size] + closing
    return text


def _parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for match in HERMES_CALL.finditer(text, start):
        values = _json_values(match.group(1).strip())
        found = [_call_of(value) for value in (values[0] if len(values) == 1 and isinstance(values[0], list)
                                                else values)]
        if not values or not all(found):
            return text, []  # not a call after all: the text stays the answer
        calls.extend(found)
    return text[:start].strip(), calls


PARAMETERS_DEF = "__parameters"  # where a schema placed inside another keeps the arguments' whole schema


def _rerooted(value, parameters: dict):
    """``value`` (a part of the arguments' schema ``parameters``) as a schema of its own root: its
    ``$ref``s into the arguments' schema ("#", "#/$defs/P", "#/properties/a") pointed at a copy
    of it under $defs. Schemas without $ref come back as they are."""
    if "$ref" not in json.dumps(parameters):
        return value

    def moved(node):
        if isinstance(node, dict):
            return {key: (f"#/$defs/{PARAMETERS_DEF}{item[1:]}" if key == "$ref" and isinstance(item, str)
                          and item.startswith("#") else moved(item)) for key, item in node.items()}
        if isinstance(node, list):
            return [moved(item) for item in node]
        return node

    placed = moved(value) if isinstance(value, dict) else {}
    return {**placed, "$defs": {**placed.get("$defs", {}), PARAMETERS_DEF: moved(parameters)}}


# ---- the pythonic style: calls written as Python (Gemma's prompted format) -------------------
TOOL_CODE = re.compile(r"```tool_code[ \t]*\n?(.*?)(?:```|\Z)", re.DOTALL)
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
JSON_NAMES = {"true": True, "false": False, "null": None}  # JSON's literals, as a model may write them in Python


def _python_name(name: str) -> bool:
    """Can ``name`` be written as a name in Python (not ``from``, ``class``: keywords do not parse)?"""
    return IDENTIFIER.fullmatch(name) is not None and not keyword.iskeyword(name)


# JSON's "\\/" is an invalid escape to Python, warned of as the text compiles: silenced for this
# text alone (catch_warnings swaps the process's filters, and the server's threads raced on them)
CALL_FILENAME = "<tool-call>"
for _category in (SyntaxWarning, DeprecationWarning):
    warnings.filterwarnings("ignore", category=_category, module=re.escape(CALL_FILENAME) + r"\Z")


class NotACall(ValueError):
    """Python text that is not a list of calls with literal keyword arguments."""


def _function_name(node) -> str:
    """``f`` or ``tools.f``: a call's function as its name."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_function_name(node.value)}.{node.attr}"
    raise NotACall("not a function's name")


class _Source:
    """Python text whose nodes' text is sliced by their positions (``ast.get_source_segment``
    splits the whole text at every call: quadratic over a list of thousands of calls)."""

    def __init__(self, text: str) -> None:
        self.data = text.encode("utf-8")  # ast's columns count UTF-8 bytes
        self.starts = [0]  # each line's first byte; lines end as ast ends them (\r\n, \r or \n)
        self.starts.extend(match.end() for match in LINE_END.finditer(self.data))

    def segment(self, node) -> str | None:
        if getattr(node, "end_lineno", None) is None:
            return None
        begin = self.starts[node.lineno - 1] + node.col_offset
        return self.data[begin:self.starts[node.end_lineno - 1] + node.end_col_offset].decode("utf-8", "replace")


LINE_END = re.compile(rb"\r\n|\r|\n")


def _literal(node, source: _Source):
    """A keyword argument's value: JSON where its text is JSON (so ``"a\\/b"`` reads as JSON reads
    it), else a Python literal (``'x'``, ``True``, ``(1, 2)``), JSON's true/false/null taken too."""
    text = source.segment(node)
    if text is not None:
        try:
            return json.loads(text)
        except ValueError:
            pass
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float, bool))):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and isinstance(
            node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, ast.Name) and node.id in JSON_NAMES:
        return JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item, source) for item in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(key, source) if key is not None else None for key in node.keys]
        if not all(isinstance(key, str) for key in keys):
            raise NotACall("a dict with a key that is not a string")
        return {key: _literal(value, source) for key, value in zip(keys, node.values)}
    raise NotACall("an argument that is not a literal")


def _pythonic_call(node, source: _Source) -> ToolCall:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print" and len(
            node.args) == 1 and not node.keywords:
        node = node.args[0]  # print(f(x=1)), as some of Gemma's examples write it
    if not isinstance(node, ast.Call) or node.args:
        raise NotACall("not a call with keyword arguments only")
    pairs = []  # (name, value) in order; ``**{"user-id": 1}`` gives names Python's cannot (``written``)
    for each in node.keywords:
        if each.arg is not None:
            pairs.append((each.arg, _literal(each.value, source)))
        elif isinstance(each.value, ast.Dict):
            unpacked = _literal(each.value, source)
            pairs.extend(unpacked.items())
            if len(unpacked) < len(each.value.keys):
                raise NotACall("an argument given twice")
        else:
            raise NotACall("not a call with literal keyword arguments only")
    names = [name for name, _ in pairs]
    if len(set(names)) < len(names):  # f(a=1, a=2) parses; which one was meant cannot be told
        raise NotACall("an argument given twice")
    arguments = dict(pairs)
    try:  # 1e400 reads as infinity, which JSON cannot write
        return ToolCall(_function_name(node.func), json.dumps(arguments, ensure_ascii=False, allow_nan=False))
    except ValueError:
        raise NotACall("a number JSON cannot write") from None


def _pythonic_calls(text: str) -> list[ToolCall]:
    """The calls of ``[f(a=1), g()]``, of one call alone, or of one call a line; NotACall otherwise."""
    text = text.strip()  # the text parsed is the text its nodes' positions index
    try:
        module = ast.parse(text, CALL_FILENAME)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise NotACall("not Python") from None
    if not module.body or not all(isinstance(statement, ast.Expr) for statement in module.body):
        raise NotACall("not expressions")
    nodes = [statement.value for statement in module.body]
    if len(nodes) == 1 and isinstance(nodes[0], (ast.List, ast.Tuple)):
        nodes = nodes[0].elts
    source = _Source(text)
    try:
        return [_pythonic_call(node, source) for node in nodes] if nodes else []
    except RecursionError:
        raise NotACall("nested too deeply") from None


MAX_CUT_TRIES = 64  # calls' ends tried from the last of a cut answer back: each try parses it all


def _call_ends(body: str, listed: bool) -> tuple[list[int], bool]:
    """Where the calls of a cut answer end at its top level (Python's tokenizer: strings and
    brackets skipped): after a call's ``)`` that a ``,`` follows in a list (a newline in lines), or
    that ends the text; not one a list's ``]`` closes, which prose may follow. And whether the
    text ends inside the calls: the list never closed (lines: a bracket left open)."""
    starts = [0] + [match.end() for match in re.finditer(r"\r\n|\r|\n", body)]
    level = 1 if listed else 0  # the depth a call's own parentheses open from
    depth, ends, closed, list_closed = 0, [], None, False
    try:
        for token in tokenize.generate_tokens(io.StringIO(body).readline):
            if token.type == tokenize.ERRORTOKEN:  # a string left open (the tokenizer reads on past it)
                break
            if closed is not None and token.type not in (tokenize.COMMENT, tokenize.NL):
                if (token.string == "," if listed else token.type == tokenize.NEWLINE) or \
                        token.type == tokenize.ENDMARKER:
                    ends.append(closed)
                closed = None
            if token.type != tokenize.OP:
                continue
            if token.string in "([{":
                depth += 1
            elif token.string in ")]}":
                depth -= 1
                if depth == level and token.string == ")":
                    closed = starts[token.end[0] - 1] + token.end[1]
                list_closed = list_closed or (listed and depth == 0)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass  # the cut: what was read before it stands
    if closed is not None:
        ends.append(closed)
    return ends, (not list_closed if listed else depth > 0)


def _python_calls_before_cut(body: str) -> tuple[list[ToolCall], bool]:
    """The calls of a list (or of lines) that max_tokens cut short: the longest text ending where
    a call ends at the top level that reads as calls, the list closed after it; [] if none does.
    And whether the cut lies inside them (``_call_ends``)."""
    body = body.strip()
    listed = body.startswith("[")
    ends, inside = _call_ends(body, listed)
    for end in reversed(ends[-MAX_CUT_TRIES:]):
        try:
            return _pythonic_calls(body[:end] + ("]" if listed else "")), inside
        except NotACall:
            continue
    return [], inside


def _leading_call_list(text: str) -> list[ToolCall]:
    """The calls of a list that begins the answer and text after it (``[f(a=1)] Let me check``:
    Gemma writes on after its call, as Hermes' models after ``</tool_call>``, whose text is
    dropped too): the shortest prefix closed by a ``]`` that reads as calls; [] if none does."""
    text = text.strip()
    closes = [match.start() for match in re.finditer(r"\]", text)][:MAX_CUT_TRIES]
    for close in closes[:-1] if closes and closes[-1] == len(text) - 1 else closes:  # the whole text: tried
        try:
            return _pythonic_calls(text[: close + 1])
        except NotACall:
            continue
    return []


@dataclass(frozen=True)
class PythonicStyle(ToolStyle):
    """Calls written as a Python list, keyword arguments only (``[get_weather(city="Oslo")]``), as
    Google's function-calling guide prompts Gemma to write them; also read inside a
    ```` ```tool_code ```` block (the guide's other form) and one call a line. Gemma's templates
    render no tools: the definitions go into the prompt with this instruction, and results come
    back as ```` ```tool_output ```` blocks."""

    def _read(self, text: str) -> tuple[str, list[ToolCall]]:
        blocks = list(TOOL_CODE.finditer(text))
        if not blocks and not text.lstrip().startswith("["):
            return text, []  # a bare call must be the whole answer as a list: prose naming f(x) stays prose
        between = [text[a.end():b.start()] for a, b in zip(blocks, blocks[1:])]
        if any(part.strip() for part in between):
            return text, []  # text between blocks: not an answer of calls alone after its content
        content = text[:blocks[0].start()] if blocks else ""
        try:
            calls = [call for body in ([b.group(1) for b in blocks] or [text]) for call in _pythonic_calls(body)]
        except NotACall:
            calls = [] if blocks else _leading_call_list(text)
        return (content.strip(), calls) if calls else (text, [])

    def _read_cut(self, text: str) -> tuple[str, list[ToolCall], bool]:
        """The calls closed before the cut: in a list left open, or in the last ```` ```tool_code ````
        block left open (the blocks before it whole); and whether the cut lies inside them."""
        blocks = list(TOOL_CODE.finditer(text))
        if blocks and blocks[-1].group(0).endswith("```") and len(blocks[-1].group(0)) > len(self.opener):
            return text, [], False  # every block closed: not cut inside one
        if not blocks:
            if BARE_PYTHON_CALL.match(text) is None:
                return text, [], False
            calls, inside = _python_calls_before_cut(text)
            return ("", calls, inside) if calls else (text, [], inside)
        content, whole = self._read(text[:blocks[-1].start()]) if len(blocks) > 1 else (text[:blocks[0].start()], [])
        if len(blocks) > 1 and not whole:
            return text, [], True
        calls, _ = _python_calls_before_cut(blocks[-1].group(1).rstrip("`"))
        return (content.strip(), whole + calls, True) if whole + calls else (text, [], True)

    def grammar(self, tools: Sequence[Tool], choice: ToolChoice, parallel: bool = False,
                backend=None) -> GrammarSpec:
        """A list of calls in Python: each function's keyword arguments in its schema's order,
        the required ones always, each value JSON following its property's schema (which the
        reader takes as Python). Names must be Python's: GrammarError otherwise."""
        allowed = choice.callable(tools)
        rules, calls = [], []
        for index, tool in enumerate(allowed):
            if not all(_python_name(part) for part in tool.name.split(".")):
                raise GrammarError(f"the function name {tool.name!r} cannot be written as a Python call, the "
                                   "format this model calls functions in",
                                   "name it with letters, digits and '_' only")
            arguments = _keyword_rules(f"a{index}", tool.parameters or {}, rules)
            calls.append(f'"{tool.name}(" {arguments} ")"' if arguments else f'"{tool.name}()"')
        start = 'start: "[" call (", " call)* "]"' if parallel else 'start: "[" call "]"'
        return GrammarSpec("lark", "\n".join([start, f"call: {' | '.join(calls)}", *rules]) + "\n")

    def written(self, calls: Sequence[dict]) -> str:
        """Earlier calls as the model writes them; arguments whose names Python cannot write as
        keywords (``user-id``, ``from``) go last in one ``**{...}``, which the reader takes too."""
        written = []
        for call in calls:
            arguments = _arguments_object(call["function"]["arguments"])
            parts = [f"{key}={json.dumps(value, ensure_ascii=False)}" for key, value in arguments.items()
                     if _python_name(key)]
            others = {key: value for key, value in arguments.items() if not _python_name(key)}
            if others:
                parts.append(f"**{json.dumps(others, ensure_ascii=False)}")
            written.append(f"{call['function']['name']}({', '.join(parts)})")
        return f"[{', '.join(written)}]"

    def instructions(self, tools: Sequence[Tool]) -> str:
        return SYSTEM_TOOLS_PYTHONIC.format(tools=json.dumps([tool.as_openai()["function"] for tool in tools],
                                                             ensure_ascii=False, indent=1))

    def result(self, content: str) -> str:
        return f"```tool_output\n{content}\n```"


def _keyword_rules(prefix: str, schema: dict, rules: list[str]) -> str:
    """The grammar of a call's keyword arguments (rules appended to ``rules``): the schema's
    properties in order, each written ``name=value`` with ", " between, the required ones never
    left out; a schema without properties takes any names. "" where the call takes no arguments."""
    value_options = {"x-guidance": CALL_JSON_OPTIONS}
    properties = schema.get("properties")
    extra = schema.get("additionalProperties", True)
    if not isinstance(properties, dict):  # names the schema requires, else any
        properties = {name: extra if isinstance(extra, dict) else {} for name in schema.get("required") or ()}
        if not properties:
            if extra is False:
                return ""
            any_value = json.dumps({**_rerooted(extra if isinstance(extra, dict) else {}, schema), **value_options})
            # a name of Python's, not a keyword (``from=1`` does not parse)
            keywords = "|".join(sorted(keyword.kwlist, key=len, reverse=True))
            rules.append(f"{prefix.upper()}_NAME: /[A-Za-z_][A-Za-z0-9_]*/ & ~/({keywords})/")
            rules.append(f"{prefix}_kw: {prefix.upper()}_NAME \"=\" %json {any_value}")
            return f"({prefix}_kw (\", \" {prefix}_kw)*)?"
    required = set(schema.get("required") or ())
    properties = {name: value for name, value in properties.items() if value is not False or name in required}
    names = list(properties)
    bad = next((name for name in names if not _python_name(name)), None)
    if bad is not None:
        raise GrammarError(f"the argument name {bad!r} cannot be written as a Python keyword, the format this "
                           "model calls functions in", "name arguments with letters, digits and '_' only")
    if not names:
        return ""
    if any(value is False for value in properties.values()):
        raise GrammarError("the function's schema requires an argument it allows no value for",
                           "fix the tool's parameters schema")
    pairs = []
    for name in names:
        value = properties[name] if isinstance(properties[name], dict) else {}
        pairs.append(f'"{name}=" %json {json.dumps({**_rerooted(value, schema), **value_options})}')
    # {prefix}_r{i}: the arguments from the i-th on after one was written; {prefix}_f{i}: the first written is the i-th or later
    last, can_be_first = len(names) - 1, True  # can the i-th be the first written? (those before it optional)
    for i, pair in enumerate(pairs):
        rest = f" {prefix}_r{i + 1}" if i < last else ""
        optional = names[i] not in required
        if i > 0:
            rules.append(f'{prefix}_r{i}: (", " {pair})?{rest}' if optional else f'{prefix}_r{i}: ", " {pair}{rest}')
        if can_be_first:
            later = f" | {prefix}_f{i + 1}" if optional and i < last else ""
            rules.append(f"{prefix}_f{i}: {pair}{rest}{later}")
        can_be_first = can_be_first and optional
    nothing_required = not required.intersection(names)
    return f"{prefix}_f0?" if nothing_required else f"{prefix}_f0"


# a harmony call's recipient, as HarmonySplit writes it into the answer (or the raw header has it)
HARMONY_CALL = re.compile(r"to=functions\.([A-Za-z0-9_.\-]+)")
# what may stand before a raw harmony call's recipient: its message's start and channel (markup)
HARMONY_HEADER_TAIL = re.compile(r"(?:<\|end\|>)?\s*(?:<\|start\|>assistant)?\s*(?:<\|channel\|>\w*)?\s*\Z")


@dataclass(frozen=True)
class HarmonyStyle(ToolStyle):
    """gpt-oss's calls (sessions/harmony.py): a message to ``functions.NAME`` whose body is the
    arguments' JSON, one call an answer (``<|call|>`` ends it). Read in the answer as HarmonySplit
    writes it (``to=functions.NAME<|message|>{...}``) or as generated (reasoning_format "none")."""

    def _read(self, text: str) -> tuple[str, list[ToolCall]]:
        content, calls, inside = self._read_cut(text)
        return (content, calls) if calls and not inside else (text, [])

    def _read_cut(self, text: str) -> tuple[str, list[ToolCall], bool]:
        found = HARMONY_CALL.search(text)
        if found is None:
            return text, [], False
        content = HARMONY_HEADER_TAIL.sub("", text[: found.start()]).strip()
        body_at = text.find(MESSAGE, found.end())
        if body_at < 0:
            return content, [], True  # cut inside the call's header
        values, inside = _values_before_cut(text[body_at + len(MESSAGE):].strip())
        call = _call_of({"name": found.group(1), "arguments": values[0]}) if values else None
        if call is None or len(values) > 1:
            return (content, [], True) if inside and not values else (text, [], False)
        return content, [call], False

    def grammar(self, tools: Sequence[Tool], choice: ToolChoice, parallel: bool = False,
                backend=None) -> GrammarSpec:
        """One call (harmony writes one a message; ``<|call|>`` ends the answer), its header as the
        model's own template writes calls back: `` to=functions.NAME<|channel|>commentary
        json<|message|>`` after the answer's own message start, the arguments following their
        schema. The markers are control tokens by id where ``backend``'s are (MLX's), else text
        (llama.cpp renders gpt-oss's as text)."""
        def items(text: str) -> str:
            return grammar_items(backend, text) if backend is not None else json.dumps(text)

        allowed = choice.callable(tools)
        calls = " | ".join(f"{items(f' to=functions.{tool.name}<|channel|>commentary json<|message|>')} "
                           f"%json {json.dumps(self._arguments_schema(tool))}" for tool in allowed)
        return GrammarSpec("lark", f"start: ({items(HARMONY_ASSISTANT)})? call\ncall: {calls}\n", headed=True)

    def _arguments_schema(self, tool: Tool) -> dict:
        arguments = dict(tool.parameters or {"type": "object"})
        return {**arguments, "x-guidance": CALL_JSON_OPTIONS}


STYLES = {
    "hermes": ToolStyle("hermes", "<tool_call>"),
    "llama3": ToolStyle("llama3", "<|python_tag|>", arguments_key="parameters", bare_starts="{["),
    "mistral": ToolStyle("mistral", "[TOOL_CALLS]", bare_starts="[{"),
    "pythonic": PythonicStyle("pythonic", "```tool_code", bare_starts="["),
    "harmony": HarmonyStyle("harmony", CALL_OPENER),
}


def _arguments_object(arguments) -> dict:
    """OpenAI sends earlier calls' arguments as JSON text; templates index them as objects."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments)
    except (TypeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


# ---- rendering ----------------------------------------------------------------------------
def renders_tools(template: ChatTemplate) -> bool:
    """Does the template render tool definitions itself?"""
    return re.search(r"\btools\b", template.source) is not None


def style_for(template: ChatTemplate) -> ToolStyle:
    """The format the template's model writes calls in: its own where the template renders tools;
    else Python calls for Gemma (its turns ``<start_of_turn>``: what Google's guide prompts it with)
    and Hermes for the others."""
    if is_harmony(template.source):
        return STYLES["harmony"]
    if not renders_tools(template):
        return STYLES["pythonic"] if "<start_of_turn>" in template.source else STYLES["hermes"]
    if "[TOOL_CALLS]" in template.source:
        return STYLES["mistral"]
    if "<|python_tag|>" in template.source or "ipython" in template.source:
        return STYLES["llama3"]
    return STYLES["hermes"]


SYSTEM_TOOLS = (
    "You may call functions to help with the user's request. The functions, as JSON schemas:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call one, answer with a JSON object of its name and arguments inside tags:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <arguments-object>}}\n</tool_call>"
)
SYSTEM_TOOLS_PYTHONIC = (
    "You may call functions to help with the user's request. To call them, answer with nothing but a "
    "Python list of calls, each with keyword arguments:\n"
    "[function_name(argument=value, other_argument=value), other_function(argument=value)]\n"
    "The functions, as JSON schemas:\n{tools}"
)


def tool_conversation(template: ChatTemplate, messages: Sequence[dict], tools: Sequence[Tool],
                      system_role: bool = True) -> tuple[list[dict], dict]:
    """The messages and the template's extra variables for a conversation with tools: as they
    are, with ``tools`` (and earlier calls' arguments as objects), for a template that renders
    tools; else with the definitions in the system message (``system_role`` false: at the head of
    the first user message, for a template without a system role such as Gemma's) and earlier
    calls and results written out in the style the model is read in (``style_for``), a turn's
    results in one user message."""
    if renders_tools(template):
        rendered = []
        for message in messages:
            if message.get("tool_calls"):
                calls = [{**call, "function": {**call["function"],
                                               "arguments": _arguments_object(call["function"]["arguments"])}}
                         for call in message["tool_calls"]]
                message = {**message, "tool_calls": calls}
            rendered.append(message)
        return rendered, {"tools": [tool.as_openai() for tool in tools]} if tools else {}
    style = style_for(template)
    plain, after_results = [], False  # after_results: the last message holds tool results
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            response = style.result(content)
            if after_results:
                plain[-1] = {"role": "user", "content": f"{plain[-1]['content']}\n{response}"}  # roles alternate
            else:
                plain.append({"role": "user", "content": response})
            after_results = True
            continue
        after_results = False
        if message.get("tool_calls"):
            written = style.written(message["tool_calls"])
            plain.append({"role": "assistant", "content": f"{content}\n{written}".strip()})
        else:
            plain.append({"role": role, "content": content})
    if tools:
        described = style.instructions(tools)
        if system_role and plain and plain[0]["role"] == "system":
            plain[0] = {"role": "system", "content": f"{plain[0]['content']}\n\n{described}"}
        elif system_role:
            plain.insert(0, {"role": "system", "content": described})
        else:
            first = next((i for i, m in enumerate(plain) if m["role"] == "user"), None)
            if first is None:
                plain.insert(0, {"role": "user", "content": described})
            else:
                plain[first] = {"role": "user", "content": f"{described}\n\n{plain[first]['content']}"}
    return plain, {}


class ToolTemplateError(ChatTemplateError):
    """A chat template that fails on a conversation with tools (definitions, calls or results)."""


def uses_tools(messages: Sequence[dict], tools: Sequence[Tool]) -> bool:
    return bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def render_conversation(template: ChatTemplate, messages: Sequence[dict], tools: Sequence[Tool] = (),
                        add_generation_prompt: bool = True) -> tuple[str, list[tuple[int, int]]]:
    """The conversation as prompt text with its contents' spans (``render_with_spans``), tools and
    earlier calls included; ToolTemplateError where the template cannot render them (a template
    without tools that refuses a system message gets them in the first user message instead)."""
    if is_harmony(template.source):  # the thinking clients send back, where its templates read it
        messages = harmony_messages(messages)
    if not uses_tools(messages, tools):
        return render_with_spans(template, messages, add_generation_prompt)
    problem = ""
    for system_role in (True,) if renders_tools(template) or not tools else (True, False):
        converted, extra = tool_conversation(template, messages, tools, system_role)
        try:
            return render_with_spans(template, converted, add_generation_prompt, extra=extra)
        except ChatTemplateError as exc:
            problem = exc.problem
    raise ToolTemplateError(f"the model's chat template cannot render tools: {problem}",
                            "send the request without tools, or use a model whose template takes them")
