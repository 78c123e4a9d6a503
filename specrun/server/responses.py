"""OpenAI's Responses API (POST /v1/responses), which the Agents SDK and Codex use by default:
a request read as the chat completions request it amounts to, and the answer written back as
a response object (or its stream of semantic events).

Only what a local, stateless server can honour is taken: ``input`` as text or as the items a
conversation is made of (messages with text parts, ``function_call`` and
``function_call_output``), ``instructions``, function tools, ``tool_choice``,
``parallel_tool_calls``, ``text.format`` (text, JSON object, JSON schema), ``max_output_tokens``,
``temperature``, ``top_p`` (``top_k``, ``min_p`` and ``seed`` as chat takes them) and
logprobs (``include: ["message.output_text.logprobs"]``, ``top_logprobs``). Nothing is stored:
``previous_response_id`` and ``conversation`` are refused by name (the client sends the whole
conversation, as with ``store: false``), and so are built-in tools, images and files and
``text.verbosity``. A reasoning model's thinking comes back as a ``reasoning`` item before the
message (its text in ``content``, streamed as ``response.reasoning_text.delta``); ``reasoning.effort``
reaches the template as chat's ``reasoning_effort`` does, and reasoning items passed back in
``input`` are their turn's ``reasoning_content``. Every refusal names the Responses field (``input[2].content[0]``),
not the chat field it was read as. ``parallel_tool_calls`` defaults to one call, as chat's does
(llama-server's choice: a small model told it may call again calls until max tokens), where
OpenAI's default is several.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from specrun.server.requests import CompletionRequest, RequestError, ServeDefaults, invalid_value, parse_chat_request

# Fields read here and passed on under chat's name, or checked and dropped
_PASSED = {"model": "model", "temperature": "temperature", "top_p": "top_p", "stream": "stream",
           "parallel_tool_calls": "parallel_tool_calls", "max_output_tokens": "max_completion_tokens",
           "top_logprobs": "top_logprobs", "user": "user", "metadata": "metadata", "service_tier": "service_tier",
           "prompt_cache_key": "prompt_cache_key", "prompt_cache_retention": "prompt_cache_retention",
           "safety_identifier": "safety_identifier",
           # specrun's extensions, as chat completions takes them
           "top_k": "top_k", "min_p": "min_p", "seed": "seed"}
_READ = {"input", "instructions", "tools", "tool_choice", "text", "store", "stream_options", "truncation", "include",
         "reasoning"}
LOGPROBS_INCLUDED = "message.output_text.logprobs"  # include's: each output token's log-probability
# include's: a reasoning item's encrypted text, which a stateless client passes back; the thinking's
# text is in the item's content already (a local server keeps nothing from its client)
ENCRYPTED_REASONING = "reasoning.encrypted_content"
# Fields specrun cannot honour, with the values that ask nothing of it
_INERT = {"previous_response_id": (None,), "conversation": (None,),
          "background": (None, False), "max_tool_calls": (None,), "prompt": (None,)}
_WHY = {"previous_response_id": "specrun serve stores no responses: send the whole conversation in input",
        "conversation": "specrun serve stores no conversations: send the whole conversation in input",
        "prompt": "specrun serve has no stored prompts: send the instructions and input themselves"}
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesNames:
    """Where each chat field a request was read as came from in the Responses body: a refusal of
    the chat request (parsing, or the worker's: a prompt too long, a template refusing it) named
    as the client wrote it."""

    def __init__(self, where: Sequence[str], calls: dict[int, list[str]]) -> None:
        self.where = list(where)  # messages[k]'s item (or "instructions")
        self.calls = calls  # messages[k].tool_calls[j]'s function_call item

    def renamed(self, error: RequestError) -> RequestError:
        param = error.param or ""
        match = re.match(r"messages\[(\d+)\](?:\.tool_calls\[(\d+)\](?:\.function)?)?", param)
        if match and match.group(2) is not None and int(match.group(2)) < len(self.calls.get(int(match.group(1)), ())):
            renamed = self.calls[int(match.group(1))][int(match.group(2))] + param[match.end():]
        elif match and int(match.group(1)) < len(self.where):
            renamed = self.where[int(match.group(1))] + param[match.end():]
        elif param == "messages":
            renamed = "input"
        elif param == "reasoning_effort":
            renamed = "reasoning.effort"
        elif param.startswith("max_completion_tokens"):
            renamed = "max_output_tokens" + param[len("max_completion_tokens"):]
        elif param.startswith("response_format"):
            renamed = "text.format" + param[len("response_format"):].replace(".json_schema", "", 1)
        elif param.startswith("tool_choice.allowed_tools"):  # Responses' allowed_tools lie in tool_choice itself
            renamed = "tool_choice" + param[len("tool_choice.allowed_tools"):]
        else:
            renamed = re.sub(r"^(tools\[\d+\])\.function", r"\1", param)
        if renamed == param:
            return error
        message = error.message.replace(param, renamed, 1)
        return RequestError(message, renamed, status=error.status, code=error.code, kind=error.kind,
                            retry_after=error.retry_after)


def parse_responses_request(body, defaults: ServeDefaults, n_ctx: int) -> tuple[CompletionRequest, ResponsesNames]:
    """A /v1/responses body as the CompletionRequest of its chat completions equivalent, and the
    names of its fields for the worker's refusals; or a RequestError naming the Responses field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", code="invalid_type")
    for name, value in body.items():
        if name in _PASSED or name in _READ:
            continue
        if name in _INERT:
            if value not in _INERT[name] and value not in ([], {}):
                raise RequestError(_WHY.get(name, f"{name} is not supported by specrun serve"), name,
                                   code="unsupported_value")
            continue
        raise RequestError(f"unrecognized request argument supplied: {name}", name, code="unknown_parameter")
    if body.get("truncation") not in (None, "disabled"):
        raise RequestError('truncation: only "disabled" (a conversation longer than the context is a 400, '
                           "never cut)", "truncation", code="unsupported_value")
    messages, where, calls = _messages(body.get("instructions"), body.get("input"))
    names = ResponsesNames(where, calls)
    chat = {chat_name: body[name] for name, chat_name in _PASSED.items() if body.get(name) is not None}
    chat["messages"] = messages
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(item, str) for item in include):
        raise RequestError("include must be a list of strings", "include", code="invalid_type")
    if set(include) - {LOGPROBS_INCLUDED, ENCRYPTED_REASONING}:
        others = ", ".join(sorted(set(include) - {LOGPROBS_INCLUDED, ENCRYPTED_REASONING}))
        raise RequestError(f"include takes {LOGPROBS_INCLUDED} and {ENCRYPTED_REASONING} only, not {others}",
                           "include", code="unsupported_value")
    if LOGPROBS_INCLUDED in include:
        chat["logprobs"] = True
    elif chat.get("top_logprobs"):
        raise invalid_value("top_logprobs", f"needs include: [\"{LOGPROBS_INCLUDED}\"]")
    effort = _reasoning_effort(body.get("reasoning"))
    if effort is not None:
        chat["reasoning_effort"] = effort
    response_format = _text_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    options = body.get("stream_options")
    if options is not None and body.get("stream"):
        if not isinstance(options, dict) or set(options) - {"include_obfuscation"}:
            raise RequestError("stream_options takes include_obfuscation only", "stream_options", code="invalid_value")
        chat["stream_options"] = options
    try:
        parsed = parse_chat_request(chat, defaults, n_ctx)
    except RequestError as exc:
        raise names.renamed(exc) from None
    if parsed.reasoning_format == "deepseek-legacy":  # its content as generated is chat's: a reasoning item here
        parsed = dataclasses.replace(parsed, reasoning_format="deepseek")
    return parsed, names


def _reasoning_effort(reasoning) -> str | None:
    """``reasoning``'s effort, as chat's reasoning_effort (the template's variable; "none" turns
    thinking off). Its summary is taken at any value: the thinking comes back whole, not summed up."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise RequestError('reasoning must be an object like {"effort": "low"}', "reasoning", code="invalid_type")
    unknown = set(reasoning) - {"effort", "summary", "generate_summary"}
    if unknown:
        raise RequestError(f"reasoning takes effort and summary only, not {', '.join(sorted(unknown))}",
                           "reasoning", code="invalid_value")
    return reasoning.get("effort")


def _messages(instructions, items) -> tuple[list[dict], list[str], dict[int, list[str]]]:
    """Chat messages for ``instructions`` and ``input``, the Responses field each came from, and
    each message's tool calls' function_call items."""
    messages, where, calls = [], [], {}
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError("instructions must be a string", "instructions", code="invalid_type")
        messages.append({"role": "system", "content": instructions})
        where.append("instructions")
    if items is None:
        raise RequestError("input is required", "input", code="missing_required_parameter")
    if isinstance(items, str):
        if not items:
            raise invalid_value("input", "must not be empty")
        return [*messages, {"role": "user", "content": items}], [*where, "input"], calls
    if not isinstance(items, list) or not items:
        raise RequestError("input must be text or a non-empty list of items", "input", code="invalid_type")
    called: set[str] = set()  # the call_ids of the function_call items so far
    thought = None  # a reasoning item's text, for the assistant turn after it
    for index, item in enumerate(items):
        at = f"input[{index}]"
        if not isinstance(item, dict):
            raise RequestError(f"{at} must be an object", at, code="invalid_type")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "reasoning":  # an earlier answer's thinking, passed back: its turn's reasoning_content
            thought = _reasoning_text(item, at)
            continue
        thought, before = None, thought  # given to this item's turn at most (an assistant's), never later
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _content(item.get("content"), f"{at}.content")})
            where.append(at)
            if before is not None and item.get("role") == "assistant":
                messages[-1]["reasoning_content"] = before
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            for name in ("call_id", "name"):
                if not isinstance(item.get(name), str) or not item[name]:
                    raise RequestError(f"{at}.{name} must be a non-empty string", f"{at}.{name}",
                                       code="invalid_type")
            called.add(item["call_id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # the calls of one turn: one assistant message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                where.append(at)
            if before is not None:  # the thinking before a call is its turn's
                messages[-1].setdefault("reasoning_content", before)
            calls.setdefault(len(messages) - 1, []).append(at)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not item["call_id"]:
                raise RequestError(f"{at}.call_id must be a non-empty string", f"{at}.call_id", code="invalid_type")
            if item["call_id"] not in called:
                raise invalid_value(f"{at}.call_id", f"no function_call before it in input has call_id "
                                                     f"{item['call_id']!r}")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _content(item.get("output"), f"{at}.output")})
            where.append(at)
        else:
            raise RequestError(f"{at}: items of type {kind!r} are not supported by specrun serve (messages, "
                               "function_call and function_call_output are)", f"{at}.type",
                               code="unsupported_value")
    return messages, where, calls


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its content's reasoning_text parts, else its summary's text."""
    for key, kinds in (("content", ("reasoning_text", "text")), ("summary", ("summary_text", "text"))):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise RequestError(f"{where}.{key} must be a list of text parts", f"{where}.{key}", code="invalid_type")
        texts = [part.get("text") for part in parts if isinstance(part, dict) and part.get("type") in kinds]
        if any(not isinstance(text, str) for text in texts):
            raise RequestError(f"{where}.{key}: each part's text must be a string", f"{where}.{key}",
                               code="invalid_type")
        if texts:
            return "\n".join(texts)
    return ""


def _content(content, where: str):
    """A message's content as chat takes it: text, or its text parts (input_text, output_text;
    an assistant's refusal) as chat's text parts."""
    if not isinstance(content, list):
        return content  # text, or what chat refuses by the same field
    parts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": part.get("text")})
        elif kind == "refusal":
            parts.append(part)
        else:
            raise RequestError(f"{where}[{index}] must be a text part (input_text or output_text): specrun serve "
                               "takes text only", f"{where}[{index}]", code="invalid_type")
    return parts


def _tools(tools):
    """Responses' function tools ({type, name, description, parameters}) as chat's."""
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of function tools", "tools", code="invalid_type")
    chat = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise RequestError(f"tools[{index}]: only function tools are taken, not {kind!r} (specrun serve runs "
                               "no tools of its own)", f"tools[{index}]", code="unsupported_value")
        function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        chat.append({"type": "function", "function": function})
    return chat


def _tool_choice(choice):
    """Responses' tool_choice ("auto", "none", "required", {"type": "function", "name": ...},
    {"type": "allowed_tools", "mode": ..., "tools": [{"type": "function", "name": ...}]}) as chat's."""
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools" and isinstance(choice.get("tools"), list):
        tools = [{"type": tool.get("type"), "function": {"name": tool.get("name")}} if isinstance(tool, dict) else tool
                 for tool in choice["tools"]]
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode", "auto"), "tools": tools}}
    raise RequestError('tool_choice must be "auto", "none", "required", {"type": "function", "name": ...} or '
                       '{"type": "allowed_tools", "mode": ..., "tools": [...]}', "tool_choice", code="invalid_type")


def _text_format(text):
    """``text.format`` as chat's response_format (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise RequestError('text must be an object like {"format": {"type": "text"}}', "text", code="invalid_type")
    if set(text) - {"format", "verbosity"}:
        raise RequestError(f"text takes format only, not {', '.join(sorted(set(text) - {'format', 'verbosity'}))}",
                           "text", code="invalid_value")
    if text.get("verbosity") is not None:  # it changes the answer: refused by name, never ignored
        raise RequestError("text.verbosity is not supported by specrun serve", "text.verbosity",
                           code="unsupported_value")
    form = text.get("format")
    if form is None or (isinstance(form, dict) and form.get("type") == "text"):
        return None
    if not isinstance(form, dict):
        raise RequestError("text.format must be an object", "text.format", code="invalid_type")
    if form.get("type") == "json_schema":
        schema = {key: form[key] for key in ("name", "schema", "strict", "description") if key in form}
        return {"type": "json_schema", "json_schema": schema}
    return form  # json_object, or what chat refuses by its type


# ---- answers --------------------------------------------------------------------------
def usage(prompt_tokens: int, cached: int, output_tokens: int, reasoning_tokens: int = 0) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


def message_item(item_id: str, text: str, done: bool, cut: bool = False, logprobs: list | None = None) -> dict:
    """The answer's message: in progress, or done (``cut``: at max_output_tokens, incomplete)."""
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}] if done else []
    status = ("incomplete" if cut else "completed") if done else "in_progress"
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def logprob_items(entries) -> list[dict]:
    """The tokens' log-probabilities as output_text's ``logprobs`` (entries: (token, alternatives))."""
    def shown(choice) -> dict:
        return {"token": choice.text, "logprob": choice.logprob, "bytes": list(choice.bytes)}

    return [{**shown(token), "top_logprobs": [shown(other) for other in top]} for token, top in entries]


def reasoning_item(item_id: str, text: str, done: bool) -> dict:
    """The model's thinking, as OpenAI's open-weight models' reasoning item carries it (its text
    in ``content``, no summary), and as llama-server gives it: ``encrypted_content`` empty, since
    nothing is kept from the client (the text itself comes back in a stateless client's input)."""
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if done else [],
            "encrypted_content": "", "status": "completed" if done else "in_progress"}


def call_item(item_id: str, call, done: bool) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if done else "", "status": "completed" if done else "in_progress"}
