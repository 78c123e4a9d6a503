"""llama-server's own endpoints, which editors' plugins written for it call: POST /completion
(and /completions) for text after a prompt, POST /infill for a fill at an editor's cursor
(llama.vim, llama.vscode), GET /props for the context and the slots, POST /tokenize and
/detokenize with the loaded model's tokenizer. Requests are read into the same ``CompletionRequest`` the OpenAI
endpoints make, so they speculate, queue and stop as those do; answers go back in llama-server's
shape: ``content``, ``stop``, ``stop_type``, ``tokens_cached``, ``truncated`` and ``timings``
(with ``draft_n`` and ``draft_n_accepted``, as llama-server counts its drafts), beside specrun's
``speculation``; a stream is server-sent events of that shape, the last with ``stop: true``.

As llama-server does, these endpoints answer whatever model is loaded (a plugin sends the model
its user configured for llama-server, or a blank), take ``n_predict`` -1 as "until the context is
full" and 0 as "read the prompt into the cache, answer nothing" (the plugins warm the cache with
the chunks of context they will send next), and keep only the fields ``response_fields`` names,
each under its path (``timings/prompt_n``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from specrun.engine.stats import Stats
from specrun.server.requests import (
    COMMON_FIELDS,
    CompletionRequest,
    RequestError,
    ServeDefaults,
    check_fields,
    check_token_ids,
    checked_text,
    invalid_value,
    parse_common,
    parse_prompt,
)
from specrun.sessions.infill import CHUNK_FILE, Fill

# Fields of llama-server's native endpoints only, taken at the values that change nothing
MAX_N_PROBS = 1000  # alternatives a token's entry lists at most (llama-server sets none; mikupad asks 10)


def parse_native_request(body: dict, defaults: ServeDefaults, n_ctx: int, model: str,
                         infill: bool = False) -> tuple[CompletionRequest, tuple[str, ...]]:
    """A /completion (``infill``: /infill) body as a CompletionRequest answering for ``model``,
    and the response fields it asks for (empty: all); a RequestError naming the bad field."""
    fill_fields = ("input_prefix", "input_suffix", "input_extra") if infill else ()
    check_fields(body, (*COMMON_FIELDS, "prompt", "n_predict", "response_fields", "n_probs", "logprobs",
                        "post_sampling_probs", *fill_fields))
    asked = body.get("model")
    if asked is not None and not isinstance(asked, str):
        raise RequestError("model must be a string (this server answers with the model it has loaded)", "model",
                           code="invalid_type")
    # as llama-server reads them: n_predict over max_tokens, an empty stop string none
    read = {**body, "model": model}
    if body.get("n_predict") is not None:
        read.pop("max_tokens", None)
    if isinstance(body.get("stop"), list):
        read["stop"] = [stop for stop in body["stop"] if stop != ""]
    common = parse_common(read, defaults, n_ctx, "n_predict", prompt_only=True)
    # llama-server reads logprobs where n_probs is not given
    common["logprobs"] = _n_probs(body["n_probs"] if body.get("n_probs") is not None else body.get("logprobs"),
                                  "n_probs" if body.get("n_probs") is not None else "logprobs")
    post_sampling = body.get("post_sampling_probs")
    if post_sampling is not None and not isinstance(post_sampling, bool):
        raise RequestError("post_sampling_probs must be a boolean", "post_sampling_probs", code="invalid_type")
    common["post_sampling"] = bool(post_sampling)
    fields = _response_fields(body.get("response_fields"))
    if not infill:
        return CompletionRequest(prompt=parse_prompt(body.get("prompt")), **common), fields
    middle = body.get("prompt", "")
    if not isinstance(middle, str):
        raise RequestError("prompt must be a string: the cursor line's text before the cursor", "prompt",
                           code="invalid_type")
    fill = Fill(prefix=_required_text(body, "input_prefix"), suffix=_required_text(body, "input_suffix"),
                middle=checked_text(middle, "prompt"), extra=_extra_chunks(body.get("input_extra")))
    return CompletionRequest(prompt=fill.middle, fill=fill, **common), fields


def _n_probs(value, name: str) -> int | None:
    """``n_probs``: each token's log-probability and this many likeliest alternatives'
    (``completion_probabilities``); 0, false or none: not asked (a whole float is its integer, as
    llama-server reads it)."""
    if value is None or value is False:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer", name, code="invalid_type")
    if not 0 <= value <= MAX_N_PROBS:
        raise invalid_value(name, f"must be in [0, {MAX_N_PROBS}], got {value}")
    return value or None


def _required_text(body: dict, name: str) -> str:
    value = body.get(name)
    if value is None:
        raise RequestError(f"{name} is required (\"\" where there is no text)", name,
                           code="missing_required_parameter")
    if not isinstance(value, str):
        raise RequestError(f"{name} must be a string", name, code="invalid_type")
    return checked_text(value, name)


def _extra_chunks(chunks) -> tuple[tuple[str, str], ...]:
    """``input_extra``: [{"filename": ..., "text": ...}], oldest first (other keys, such as
    llama.vim's ``time``, are the plugin's own)."""
    if chunks is None:
        return ()
    if not isinstance(chunks, list):
        raise RequestError('input_extra must be a list of {"filename": ..., "text": ...} objects', "input_extra",
                           code="invalid_type")
    read = []
    for index, chunk in enumerate(chunks):
        where = f"input_extra[{index}]"
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise RequestError(f'{where} must be an object with a "text" string', where, code="invalid_type")
        name = chunk.get("filename", CHUNK_FILE)
        if not isinstance(name, str):
            raise RequestError(f"{where}.filename must be a string", f"{where}.filename", code="invalid_type")
        read.append((checked_text(name, f"{where}.filename"), checked_text(chunk["text"], f"{where}.text")))
    return tuple(read)


def _response_fields(fields) -> tuple[str, ...]:
    if fields is None:
        return ()
    if not isinstance(fields, list) or not all(isinstance(path, str) for path in fields):
        raise RequestError('response_fields must be a list of field paths, such as ["content", "timings/prompt_n"]',
                           "response_fields", code="invalid_type")
    return tuple(fields)


# ---- answers ----------------------------------------------------------------------------
def answer_object(model: str, request: CompletionRequest, content: str, started, done,
                  new_line: bool | None = None, probabilities: Sequence = ()) -> dict:
    """The last answer of a /completion or /infill request in llama-server's shape (a stream's has
    ``content`` "": its text went out in the chunks, ``new_line`` says whether it held a newline),
    with specrun's ``speculation``. ``started`` and ``done``: the job's Started and Done events
    (server/worker.py). ``truncated``: the context filled, as llama-server says it (llama.vim then
    warns the context is full); ``prompt_cut``, specrun's: a fill's parts were cut to their shares."""
    stats = done.stats
    sampling = request.sampling
    answer = {
        "index": 0,
        "content": content,
        "tokens": [],
        "stop": True,
        "model": model,
        "tokens_predicted": stats.new_tokens,
        "tokens_evaluated": started.prompt_tokens,
        "generation_settings": {
            "n_predict": request.max_tokens, "temperature": sampling.temperature, "top_k": sampling.top_k,
            "top_p": sampling.top_p, "min_p": sampling.min_p, "typical_p": sampling.typical_p,
            "top_n_sigma": sampling.top_n_sigma, "xtc_probability": sampling.xtc_probability,
            "xtc_threshold": sampling.xtc_threshold, "dynatemp_range": sampling.dynatemp_range,
            "dynatemp_exponent": sampling.dynatemp_exponent, **mirostat_settings(sampling), "seed": sampling.seed,
            "stop": list(request.stop),
            "n_indent": request.indent, "t_max_predict_ms": round(request.line_seconds * 1000),
            "infill_rule": sampling.infill, "samplers": sampler_names(sampling), **penalty_settings(sampling),
            "n_probs": request.logprobs or 0,
            "post_sampling_probs": request.post_sampling},
        "has_new_line": "\n" in content if new_line is None else new_line,
        "truncated": done.stopped_by == "context",
        "prompt_cut": started.prompt_cut,
        "stop_type": stop_type(done.finish_reason, done.stopped_by),
        "stopping_word": done.stopping_word,
        "tokens_cached": started.prompt_tokens + stats.new_tokens,
        "timings": timings(stats, started.prompt_tokens, started.reused_tokens),
        "speculation": stats.to_dict(),
    }
    if request.logprobs is not None and probabilities:  # a stream's went out with its chunks
        answer["completion_probabilities"] = completion_probabilities(probabilities, request.post_sampling)
    return answer


def completion_probabilities(entries: Sequence, post_sampling: bool = False) -> list[dict]:
    """Tokens' log-probabilities (the worker's Delta.logprobs entries) in llama-server's shape: each
    ``logprob`` with its ``top_logprobs``, or where the request asked post_sampling_probs each
    ``prob`` (after the sampling settings) with its ``top_probs``."""
    def shown(choice) -> dict:
        value = {"prob": math.exp(choice.logprob)} if post_sampling else {"logprob": choice.logprob}
        return {"id": choice.id, "token": choice.text, "bytes": list(choice.bytes), **value}

    top = "top_probs" if post_sampling else "top_logprobs"
    return [{**shown(token), top: [shown(other) for other in others]} for token, others in entries]


def sampler_names(sampling) -> list[str]:
    """The samplers in the order they apply, as llama-server's generation settings list them: the
    penalties and DRY first (specrun's place for them), then SamplingSettings.samplers, adaptive-p
    last where on."""
    return ["penalties", "dry", *sampling.samplers, *(["adaptive_p"] if sampling.adaptive_p.on else [])]


def penalty_settings(sampling) -> dict:
    """The penalties and DRY as llama-server's generation settings name them."""
    penalties, dry = sampling.penalties, sampling.dry
    return {"repeat_penalty": penalties.repeat, "repeat_last_n": penalties.last_n,
            "presence_penalty": penalties.presence, "frequency_penalty": penalties.frequency,
            "dry_multiplier": dry.multiplier, "dry_base": dry.base, "dry_allowed_length": dry.allowed_length,
            "dry_penalty_last_n": dry.last_n, "dry_sequence_breakers": list(dry.breakers)}


def mirostat_settings(sampling) -> dict:
    """Mirostat and adaptive-p as llama-server's generation settings name them (mirostat 0 where off,
    adaptive-p's target below 0)."""
    mirostat, adaptive = sampling.mirostat, sampling.adaptive_p
    return {"mirostat": mirostat.version, "mirostat_tau": mirostat.tau, "mirostat_eta": mirostat.eta,
            "adaptive_target": adaptive.target, "adaptive_decay": adaptive.decay}


def template_answer(session, body: dict, defaults: ServeDefaults, n_ctx: int) -> dict:
    """llama-server's POST /apply-template: a chat request's messages (and its tools, as the model
    is shown them) rendered through the model's chat template: the prompt it would read, not
    answered. The body is read as /v1/chat/completions reads it, so a bad field is the same 400."""
    from specrun.errors import ConversationRefusedError, SpecrunError
    from specrun.server.requests import conversation_refused, parse_chat_request
    from specrun.sessions.tools import ToolTemplateError, render_conversation

    body = dict(body)
    opening = body.pop("add_generation_prompt", True)  # llama-server's: the assistant's turn opened after
    if not isinstance(opening, bool):
        raise RequestError("add_generation_prompt must be a boolean", "add_generation_prompt", code="invalid_type")
    request = parse_chat_request(body, defaults, n_ctx)
    offered = () if request.tool_choice.mode == "none" else request.tools
    template = session.template.with_variables(request.template_variables)
    try:
        text, _ = render_conversation(template, list(request.messages), offered, opening)
    except ToolTemplateError as exc:
        raise RequestError(exc.one_line(), "tools", code="invalid_value") from None
    except ConversationRefusedError as exc:
        raise conversation_refused(exc.problem) from None
    except SpecrunError as exc:  # a template that fails on the conversation (roles out of turn)
        raise RequestError(exc.one_line(), "messages", code="invalid_value") from None
    # as llama-server gives it: without the template's BOS where the model adds its own (a prompt sent
    # back to /completion would read two)
    if session.target.vocab.add_bos and template.bos_token and text.startswith(template.bos_token):
        text = text[len(template.bos_token):]
    return {"prompt": text}


def props_object(worker, model: str, defaults: ServeDefaults, build: str) -> dict:
    """llama-server's /props for the loaded pair: the context a request's prompt and answer share,
    the slots, the sampling a request that says nothing gets, the chat template."""
    sampling = defaults.sampling
    template = worker.session.template if worker.session is not None else None
    return {
        "default_generation_settings": {
            "n_ctx": worker.n_ctx,
            "params": {"n_predict": defaults.max_tokens, "temperature": sampling.temperature,
                       "top_k": sampling.top_k, "top_p": sampling.top_p, "min_p": sampling.min_p,
                       "typical_p": sampling.typical_p, "top_n_sigma": sampling.top_n_sigma,
                       "xtc_probability": sampling.xtc_probability, "xtc_threshold": sampling.xtc_threshold,
                       "dynatemp_range": sampling.dynatemp_range, "dynatemp_exponent": sampling.dynatemp_exponent,
                       **mirostat_settings(sampling), "seed": sampling.seed, "samplers": sampler_names(sampling), **penalty_settings(sampling),
                       "speculative.method": worker.method}},
        "total_slots": worker.parallel,
        "model_alias": model,
        "model_path": worker.pair.target,
        "modalities": {"vision": False, "video": False, "audio": False},
        "chat_template": template.source if template is not None and not template.is_fallback else "",
        "bos_token": template.bos_token if template is not None else "",
        "eos_token": template.eos_token if template is not None else "",
        "build_info": build,
        "is_sleeping": False,
    }


def chunk_object(text: str, predicted: int, started, probabilities: Sequence = (), post_sampling: bool = False) -> dict:
    """A stream's chunk of text in llama-server's shape: the tokens answered so far, and where
    asked (n_probs) the log-probabilities of the chunk's tokens."""
    chunk = {"index": 0, "content": text, "tokens": [], "stop": False, "tokens_predicted": predicted,
             "tokens_evaluated": started.prompt_tokens}
    if probabilities:
        chunk["completion_probabilities"] = completion_probabilities(probabilities, post_sampling)
    return chunk


def stop_type(finish_reason: str, stopped_by: str) -> str:
    """llama-server's reason an answer ended: "eos" (the model ended it), "word" (a stop string),
    "limit" (n_predict, the context, n_indent or t_max_predict_ms)."""
    if stopped_by == "word":
        return "word"
    return "eos" if finish_reason in ("stop", "tool_calls") and not stopped_by else "limit"


def timings(stats: Stats, prompt_tokens: int, reused_tokens: int) -> dict:
    """llama-server's ``timings``: the prompt's tokens read and the answer's, each with its time."""
    read = prompt_tokens - reused_tokens
    prompt_ms = stats.prefill_seconds * 1000
    predicted_ms = stats.generation_seconds * 1000
    shown = {
        "cache_n": reused_tokens,
        "prompt_n": read,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / read if read else 0.0,
        "prompt_per_second": read / stats.prefill_seconds if stats.prefill_seconds > 0 else 0.0,
        "predicted_n": stats.new_tokens,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / stats.new_tokens if stats.new_tokens else 0.0,
        "predicted_per_second": stats.new_tokens / stats.generation_seconds if stats.generation_seconds > 0 else 0.0,
    }
    if stats.drafted:  # as llama-server says what its drafts did
        shown |= {"draft_n": stats.drafted, "draft_n_accepted": stats.accepted}
    return shown


def picked(answer: dict, paths: Sequence[str]) -> dict:
    """The fields ``response_fields`` asked for, each under its path (``timings/prompt_n``), as
    llama-server returns them; a path naming nothing is left out."""
    if not paths:
        return answer
    kept = {}
    for path in paths:
        value, found = answer, True
        for key in path.split("/"):
            if isinstance(value, dict) and key in value:
                value = value[key]
            else:
                found = False
                break
        if found:
            kept[path] = value
    return kept


# ---- the tokenizer ----------------------------------------------------------------------------
def tokenize_answer(backend, body: dict) -> dict:
    """llama-server's /tokenize: ``content`` (text, or a list of texts and token ids) as the
    model's token ids, control-token text parsed unless ``parse_special`` is false, a BOS first
    with ``add_special``; ``with_pieces``: each id with its text (its bytes where they are no
    whole UTF-8)."""
    check_fields(body, ("content", "add_special", "parse_special", "with_pieces"))
    flags = {}
    for name, default in (("add_special", False), ("parse_special", True), ("with_pieces", False)):
        value = body.get(name, default)
        if not isinstance(value, bool):
            raise RequestError(f"{name} must be a boolean", name, code="invalid_type")
        flags[name] = value
    content = body.get("content")
    parts = [content] if isinstance(content, str) else content
    if not isinstance(parts, list) or not all(isinstance(part, (str, int)) and not isinstance(part, bool)
                                              for part in parts):
        raise RequestError("content must be a string, or a list of strings and token ids", "content",
                           code="invalid_type" if content is not None else "missing_required_parameter")
    ids: list[int] = []
    for index, part in enumerate(parts):
        if isinstance(part, str):
            add_bos = flags["add_special"] and index == 0
            ids += backend.tokenize(checked_text(part, "content"), add_bos=add_bos, special=flags["parse_special"])
        else:
            check_token_ids([part], backend.vocab.size, "content")
            ids.append(part)
    if not flags["with_pieces"]:
        return {"tokens": ids}
    return {"tokens": [{"id": token, "piece": _piece(_spelled(backend, token))} for token in ids]}


def detokenize_answer(backend, body: dict) -> dict:
    """llama-server's /detokenize: ``tokens`` (ids) as the text they spell."""
    check_fields(body, ("tokens",))
    tokens = body.get("tokens", [])
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise RequestError("tokens must be a list of token ids", "tokens", code="invalid_type")
    check_token_ids(tokens, backend.vocab.size, "tokens")
    spelled = b"".join(_spelled(backend, token) for token in tokens)
    return {"content": spelled.decode("utf-8", errors="replace")}


def _spelled(backend, token: int) -> bytes:
    """A token's bytes, a control token's text too (``<|fim_prefix|>``), as llama-server spells them."""
    piece = backend.token_bytes(token)
    if not piece and (text := backend.token_text(token)) in backend.control_texts():
        return text.encode("utf-8")
    return piece


def _piece(piece: bytes) -> str | list[int]:
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)
