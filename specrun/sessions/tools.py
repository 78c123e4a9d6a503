"""Tool calls: tool definitions rendered into the prompt, and calls read back out of the answer.

A template that takes ``tools`` (Qwen, Llama 3.1+, Mistral) renders them itself, and the calls
come back in the format its model was trained on. A template that does not (SmolLM2, Gemma, the
demo models) gets the definitions in its system message, in the Hermes format most small
instruct models know (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``), and so do the
calls and results of earlier turns; the answer is read in that format.

Where the caller requires a call (``tool_choice`` "required" or a named function), a grammar in
the style's format forces one, its arguments following their function's JSON schema
(specrun/grammar.py): the model cannot answer otherwise, and speculation drafts the text the
format forces for free.

Formats read (``STYLES``): Hermes/Qwen ``<tool_call>`` JSON; Llama 3's bare JSON object
(``{"name": ..., "parameters": ...}``, after ``<|python_tag|>`` where the model writes it);
Mistral's ``[TOOL_CALLS]`` JSON list. Control tokens (``<|python_tag|>``, ``[TOOL_CALLS]``) have
no text, so a call may also begin the answer without them.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import string
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from specrun.errors import ChatTemplateError, UsageError
from specrun.grammar import GrammarError, GrammarSpec
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
    """``tool_choice``: "auto", "none", "required", or the name of the one function to call."""

    mode: str = "auto"
    function: str | None = None

    @property
    def forces_a_call(self) -> bool:
        return self.mode in ("required", "function")


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
    schema of its arguments that compiles (a required call's arguments follow it)."""
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
                GrammarSpec("json_schema", json.dumps(parameters)).check()
            except RecursionError:
                raise ToolDefinitionError(f"{where}.function.parameters nests too deeply",
                                          f"{where}.function.parameters") from None
            except GrammarError as exc:
                raise ToolDefinitionError(f"{where}.function.parameters: {exc.problem}",
                                          f"{where}.function.parameters") from None
        parsed.append(Tool(name, description, parameters))
    return tuple(parsed)


def tool_choice_of(choice, tools: Sequence[Tool]) -> ToolChoice:
    """OpenAI's ``tool_choice`` (None: "auto"), checked against the tools defined."""
    if choice is None:
        return ToolChoice()
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise ToolDefinitionError('tool_choice: "required" needs tools to call: send tools too', "tool_choice")
        return ToolChoice(choice)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not any(tool.name == name for tool in tools):
            known = ", ".join(tool.name for tool in tools) or "none"
            raise ToolDefinitionError(f"tool_choice names the function {_shown(name)}, which tools does not "
                                      f"define (defined: {known})", "tool_choice")
        return ToolChoice("function", name)
    raise ToolDefinitionError('tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                              '{"name": ...}}', "tool_choice", "invalid_type")


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
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


SEPARATORS = re.compile(r"[ \t\r\n;,]*")


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


@dataclass(frozen=True)
class ToolStyle:
    """How one family's models write calls: where a call begins (``opener``, which a stream holds
    back from), and how the calls are read and forced."""

    name: str
    opener: str  # the text a call begins with ("" where calls begin the answer as bare JSON)
    arguments_key: str = "arguments"

    def parse(self, text: str, names: Sequence[str] | None = None) -> tuple[str, list[ToolCall]]:
        """The answer's content (the text before any call) and the calls it makes; with ``names``,
        only calls to those functions count (JSON of the same shape naming another is text)."""
        content, calls = self._read(text)
        if names is not None and not all(call.name in names for call in calls):
            return text, []
        return content, [dataclasses.replace(call, id=self.new_id()) for call in calls]

    def _read(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.name == "hermes":
            return _parse_hermes(text)
        start = text.find(self.opener) if self.opener else -1
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

    def grammar(self, tools: Sequence[Tool], choice: ToolChoice, parallel: bool = False) -> GrammarSpec:
        """A grammar whose every text is a call in this style (one or more where ``parallel``), to
        the functions ``choice`` allows, each one's arguments following its schema. One call by
        default, as llama-server does: a small model told it may call again calls again until
        max_tokens cuts it off."""
        allowed = [tool for tool in tools if choice.mode != "function" or tool.name == choice.function]
        schemas = [{"type": "object", "additionalProperties": False, "required": ["name", self.arguments_key],
                    "properties": {"name": {"const": tool.name},
                                   self.arguments_key: tool.parameters or {"type": "object"}},
                    "x-guidance": CALL_JSON_OPTIONS} for tool in allowed]
        call = " | ".join(f"%json {json.dumps(schema)}" for schema in schemas)
        if self.name == "hermes":
            block = '"<tool_call>\\n" call "\\n</tool_call>"'
            rules = f'start: {block} ("\\n" {block})*\n' if parallel else f"start: {block}\n"
        elif self.name == "mistral":
            rules = 'start: "[" call (", " call)* "]"\n' if parallel else 'start: "[" call "]"\n'
        else:
            rules = 'start: call ("; " call)*\n' if parallel else "start: call\n"
        return GrammarSpec("lark", rules + f"call: {call}\n")

    def written(self, calls: Sequence[dict]) -> str:
        """Earlier calls (OpenAI's ``tool_calls`` of an assistant message) as this style writes them,
        for a template that does not render calls itself."""
        objects = [{"name": call["function"]["name"], "arguments": _arguments_object(call["function"]["arguments"])}
                   for call in calls]
        return "\n".join(f"<tool_call>\n{json.dumps(each, ensure_ascii=False)}\n</tool_call>" for each in objects)


# the body is stripped after matching: \s* on both sides of a lazy body backtracks quadratically
HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


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


STYLES = {
    "hermes": ToolStyle("hermes", "<tool_call>"),
    "llama3": ToolStyle("llama3", "<|python_tag|>", arguments_key="parameters"),
    "mistral": ToolStyle("mistral", "[TOOL_CALLS]"),
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
    """The format the template's model writes calls in."""
    source = template.source if renders_tools(template) else ""
    if "[TOOL_CALLS]" in source:
        return STYLES["mistral"]
    if "<|python_tag|>" in source or "ipython" in source:
        return STYLES["llama3"]
    return STYLES["hermes"]


SYSTEM_TOOLS = (
    "You may call functions to help with the user's request. The functions, as JSON schemas:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call one, answer with a JSON object of its name and arguments inside tags:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <arguments-object>}}\n</tool_call>"
)


def tool_conversation(template: ChatTemplate, messages: Sequence[dict], tools: Sequence[Tool],
                      system_role: bool = True) -> tuple[list[dict], dict]:
    """The messages and the template's extra variables for a conversation with tools: as they
    are, with ``tools`` (and earlier calls' arguments as objects), for a template that renders
    tools; else with the definitions in the system message (``system_role`` false: at the head of
    the first user message, for a template without a system role such as Gemma's) and earlier
    calls and results written out in the Hermes format, a turn's results in one user message."""
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
    style = STYLES["hermes"]
    plain = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if plain and plain[-1]["role"] == "user" and plain[-1]["content"].endswith("</tool_response>"):
                plain[-1] = {"role": "user", "content": f"{plain[-1]['content']}\n{response}"}  # roles alternate
            else:
                plain.append({"role": "user", "content": response})
        elif message.get("tool_calls"):
            written = style.written(message["tool_calls"])
            plain.append({"role": "assistant", "content": f"{content}\n{written}".strip()})
        else:
            plain.append({"role": role, "content": content})
    if tools:
        described = SYSTEM_TOOLS.format(tools="\n".join(json.dumps(tool.as_openai(), ensure_ascii=False)
                                                       for tool in tools))
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
