"""What a request to ``specrun serve`` may ask, checked before it queues: the OpenAI fields
both endpoints take, validated on the event loop into a ``CompletionRequest``; a request the
server refuses is a ``RequestError`` (an HTTP status and an OpenAI-style error object) that
names the bad field."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from specrun.grammar import GrammarError, GrammarSpec
from specrun.dry import MAX_DRY_BASE, MAX_DRY_LENGTH, MAX_DRY_MULTIPLIER, Dry
from specrun.adaptive_p import MAX_DECAY, AdaptiveP
from specrun.mirostat import MAX_ETA, MAX_TAU, Mirostat
from specrun.penalties import MAX_BIAS, MAX_PENALTY, Penalties
from specrun.sampling import (
    MAX_DYNATEMP_EXPONENT, MAX_DYNATEMP_RANGE, MAX_SEED, XTC_MAX_THRESHOLD, SamplingSettings, listed_order,
    named_samplers,
)
from specrun.sessions.infill import Fill
from specrun.sessions.reasoning import REASONING_FORMATS
from specrun.sessions.templates import template_variables_problem
from specrun.sessions.tools import Tool, ToolChoice, ToolDefinitionError, tool_choice_of, tool_definitions

# OpenAI's API takes 4; editors' completion plugins send a dozen (llama-server takes any number)
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API (its completions API: 5)
MAX_TEMPERATURE = 2.0  # as OpenAI's API
MAX_CHOICES = 16  # n: the answers one request may ask for (each a generation of its own)
ROLES = ("system", "developer", "user", "assistant", "tool")

# OpenAI fields specrun accepts but does not act on, with the values that mean "nothing asked":
# any other value is refused by name rather than silently ignored.
_INERT_FIELDS = {
    "echo": (False, None),
    "best_of": (1, None),
    # llama-server's own, which clients written for it send (llama.vscode's edits send every one)

    "n_probs": (0, None),
    "min_keep": (0, 1, None), "return_tokens": (False, None),
    "post_sampling_probs": (False, None), "lora": (None,), "n_cmpl": (1, None), "grammar_lazy": (False, None),
}
# Fields with no effect on the answer: accepted as any value.
_FREE_FIELDS = ("user", "store", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention",
                "safety_identifier",
                # llama-server's: its cache and slot controls (specrun keeps a prompt's cache always and
                # chooses a slot by the prompt it holds), the settings of samplers left off above, and
                # its timing extras (t_max_prompt_ms: llama-server does not act on it either)
                "cache_prompt", "id_slot", "n_keep", "n_discard", "n_cache_reuse",
                "t_max_prompt_ms", "timings_per_token",
                "return_progress", "sse_ping_interval", "verbose", "backend_sampling")
COMMON_FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "typical_p", "top_n_sigma",
                  "xtc_probability", "xtc_threshold", "dynatemp_range", "dynatemp_exponent", "mirostat",
                  "mirostat_tau", "mirostat_eta", "adaptive_target", "adaptive_decay", "dry_multiplier",
                  "dry_base", "dry_allowed_length",
                  "dry_penalty_last_n", "dry_sequence_breakers", "seed", "stop", "stream", "stream_options", "n",
                  "response_format", "grammar", "json_schema", "samplers", "n_indent",
                  "t_max_predict_ms", "repeat_penalty", "repeat_last_n", "frequency_penalty", "presence_penalty",
                  "logit_bias", "ignore_eos")

# ---- errors ---------------------------------------------------------------------------
class RequestError(Exception):
    """A request the server refuses: an HTTP status and an OpenAI-style error object."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 code: str | None = None, kind: str = "invalid_request_error", retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after  # seconds, sent as Retry-After (a 429)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.kind = kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def check_token_ids(ids, vocab_size: int, param: str) -> None:
    """A 400 naming ``param`` where a token id of ``ids`` is outside a vocabulary of ``vocab_size``."""
    bad = next((token for token in ids if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise invalid_value(param, f"token id {_shown(bad)} is outside the vocabulary (0 to {vocab_size - 1})")


def conversation_refused(problem: str) -> RequestError:
    """A conversation the chat template refuses, told what a client can change (the chat's /system
    and /reset are no fix for one)."""
    return RequestError(f"{problem}; send messages the template takes (many take one system message, first, "
                        "then user and assistant turns in alternation)", "messages", code="invalid_value")


def invalid_value(param: str, message: str) -> RequestError:
    """The error for a field whose value is refused, the field named first."""
    return RequestError(f"{param}: {message}", param, code="invalid_value")


# ---- requests -------------------------------------------------------------------------
@dataclass(frozen=True)
class ServeDefaults:
    """What a request that does not say gets: the command line's sampling options."""

    max_tokens: int = 512
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    # --chat-template-kwargs and --reasoning: the template's variables a request's own override
    template_variables: dict = field(default_factory=dict)
    reasoning_format: str = "auto"  # --reasoning-format: where an answer's thinking goes (sessions/reasoning.py)
    reasoning_budget: int = -1  # --reasoning-budget: the thinking's tokens before its end is forced (-1: no limit)
    reasoning_budget_message: str = ""  # --reasoning-budget-message: forced before the closing tag
    # --samplers as it names them (llama.cpp's names): a request that sends no list of its own is
    # read with this one, those it leaves out off, as llama-server reads its own --samplers
    samplers: tuple[str, ...] | None = None


@dataclass(frozen=True)
class CompletionRequest:
    """A validated request to either endpoint: ``messages`` (chat) or ``prompt`` (text or token ids)."""

    model: str | None  # None: the loaded model (a client that names none), filled in as it queues
    max_tokens: int
    sampling: SamplingSettings
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    messages: tuple[dict[str, str], ...] | None = None
    prompt: str | tuple[int, ...] | None = None
    grammar: GrammarSpec | None = None  # what the answer must follow (response_format, grammar, json_schema)
    grammar_field: str | None = None  # the field that asked for it, which a refusal names
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = False  # may a required call be several? (llama-server's default: one)
    n: int = 1  # the answers asked for (OpenAI's n), each generated apart, choice i with seed + i
    # asked in OpenAI's older form (``functions``, ``function_call``): a call answers as
    # message.function_call, finish_reason "function_call"
    legacy_functions: bool = False
    logprobs: int | None = None  # each token's log-probability with this many alternatives; None: not asked
    suffix: str | None = None  # completions: the text after the cursor, filled in between (sessions/infill.py)
    fill: Fill | None = None  # /infill: the text around an editor's cursor (sessions/infill.py)
    indent: int = 0  # llama-server's n_indent: a later line indented less ends the answer before it (0: none)
    line_seconds: float = 0.0  # llama-server's t_max_predict_ms: past it, the next line end ends the answer
    # logit_bias entries naming text, not a token id (llama-server's): each of its tokens gets the bias,
    # tokenized by the worker (``with_bias_texts``), which knows the model
    bias_texts: tuple[tuple[str, float], ...] = ()
    ignore_eos: bool = False  # llama-server's: no end-of-generation token, the answer runs to its length
    # llama-server's post_sampling_probs (/completion): logprobs as probabilities after the sampling settings
    post_sampling: bool = False
    # chat: variables the chat template reads beside the conversation (chat_template_kwargs,
    # reasoning_effort), and where the answer's thinking goes (reasoning_format; "none": the content)
    template_variables: dict = field(default_factory=dict)
    reasoning_format: str = "none"
    # llama-server's reasoning_budget_tokens (-1: no limit) and reasoning_budget_message: the thinking
    # cut at that many tokens, the message and the closing tag forced (specrun/reasoning_budget.py)
    reasoning_budget: int = -1
    reasoning_budget_message: str = ""

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


def _number(body: dict, name: str, default, *, integer: bool = False):
    value = body.get(name)
    if value is None:
        return default
    allowed = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, allowed):
        raise RequestError(f"{name} must be {'an integer' if integer else 'a number'}, got {_shown(value)}",
                           name, code="invalid_type")
    if isinstance(value, float) and not math.isfinite(value):  # JSON as Python reads it allows NaN
        raise invalid_value(name, f"must be a finite number, got {value}")
    if isinstance(value, int) and abs(value) >= 2**64:
        raise invalid_value(name, "is out of range (more than 64 bits)")
    return value


def _shown(value) -> str:
    """A bad value as an error quotes it: at most 40 characters of its JSON."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def checked_text(value: str, where: str) -> str:
    """``value`` if it is text the tokenizer can take: JSON may escape half of a surrogate pair
    alone (\\ud800), which no UTF-8 encoder accepts."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise invalid_value(where, f"is not valid Unicode text (a lone surrogate at character {exc.start})") from None
    return value


def _check_range(name: str, value, low, high, low_open: bool = False, high_open: bool = False) -> None:
    below = value <= low if low_open else value < low
    above = value >= high if high_open else value > high
    if below or above:
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise invalid_value(name, f"must be in {lo}{_bound(low)}, {_bound(high)}{hi}, got {value}")


def _bound(value) -> str:
    """A range's end as written: an integer whole (2147483647, not 2.14748e+09), a float short."""
    return str(value) if isinstance(value, int) else f"{value:g}"


def check_fields(body: dict, known: Sequence[str], inert: dict | None = None) -> None:
    """Every field of ``body`` is ``known``, changes nothing, or is inert at its value (``inert``:
    an endpoint's own, beside the common ones); else a 400 naming it."""
    inert = _INERT_FIELDS | (inert or {})
    for name, value in body.items():
        if name in known or name in _FREE_FIELDS:
            continue
        if name in inert:
            if value not in inert[name] and value not in ([], {}):
                raise RequestError(f"{name} is not supported by specrun serve", name, code="unsupported_value")
            continue
        raise RequestError(f"unrecognized request argument supplied: {name}", name, code="unknown_parameter")


MAX_ANSWER_TOKENS = 2**31 - 1  # max_tokens above it is a 400 (above the context, the context ends the answer)


def parse_common(body: dict, defaults: ServeDefaults, n_ctx: int, max_tokens_field: str,
                  prompt_only: bool = False) -> dict:
    """The fields every endpoint shares, validated; each error names its field. A length of -1
    is the context's (llama-server's "no limit"); ``prompt_only``: 0 reads the prompt into the
    cache and answers nothing (llama-server's native endpoints, which editors warm it with)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("model must be a string naming the served model", "model", code="invalid_type")
    if model is not None and not model.strip():  # llama-server's clients send a blank, or none at all
        model = None
    n = _number(body, "n", 1, integer=True)
    if n != 1 and prompt_only:
        raise RequestError(f"n must be 1 here: this endpoint returns one answer per request, got {n}", "n",
                           code="unsupported_value")
    _check_range("n", n, 1, MAX_CHOICES)
    if max_tokens_field != "max_tokens" and body.get(max_tokens_field) is not None \
            and body.get("max_tokens") is not None:
        raise RequestError(f"max_tokens and {max_tokens_field} both set the answer's length: send one",
                           max_tokens_field, code="invalid_value")
    max_tokens = _number(body, max_tokens_field, None, integer=True)
    if max_tokens is None and max_tokens_field != "max_tokens":
        max_tokens_field = "max_tokens"
        max_tokens = _number(body, "max_tokens", None, integer=True)
    if max_tokens is None:
        max_tokens = min(defaults.max_tokens, n_ctx)
    elif max_tokens == -1:  # llama-server's clients ask "until the context is full" so
        max_tokens = n_ctx
    # Editors send 4,096 or 8,192 whatever the model's context: taken, the answer stops where the
    # context is full (finish_reason "length"), as llama-server and ollama do; past int32 is no length
    least = 0 if prompt_only else 1
    if not least <= max_tokens <= MAX_ANSWER_TOKENS:
        raise invalid_value(max_tokens_field, f"must be -1 (until the context is full) or in [{least}, "
                                              f"{MAX_ANSWER_TOKENS}], got {max_tokens}")
    max_tokens = min(max_tokens, n_ctx)
    base = defaults.sampling
    temperature = _number(body, "temperature", base.temperature)
    _check_range("temperature", temperature, 0.0, max(MAX_TEMPERATURE, base.temperature))
    top_p = _number(body, "top_p", base.top_p)
    _check_range("top_p", top_p, 0.0, 1.0, low_open=True)
    top_k = _number(body, "top_k", base.top_k, integer=True)
    if top_k < 0:
        raise invalid_value("top_k", f"must be 0 (off) or positive, got {top_k}")
    min_p = _number(body, "min_p", base.min_p)
    _check_range("min_p", min_p, 0.0, 1.0, high_open=True)
    typical_p = _number(body, "typical_p", base.typical_p)
    _check_range("typical_p", typical_p, 0.0, 1.0)
    top_n_sigma = _number(body, "top_n_sigma", base.top_n_sigma)  # 0 or less: off, as llama.cpp reads it
    xtc_probability = _number(body, "xtc_probability", base.xtc_probability)
    _check_range("xtc_probability", xtc_probability, 0.0, 1.0)
    xtc_threshold = _number(body, "xtc_threshold", base.xtc_threshold)
    # dynamic temperature: a range of 0 or less is off, as llama-server reads it
    dynatemp_range = _number(body, "dynatemp_range", base.dynatemp_range)
    if dynatemp_range > MAX_DYNATEMP_RANGE:
        raise invalid_value("dynatemp_range", f"must be at most {MAX_DYNATEMP_RANGE:g} (0 or less: off), "
                                              f"got {dynatemp_range}")
    dynatemp_exponent = _number(body, "dynatemp_exponent", base.dynatemp_exponent)
    mirostat = _parse_mirostat(body, base.mirostat)
    adaptive_target = _number(body, "adaptive_target", base.adaptive_p.target)
    adaptive_decay = _number(body, "adaptive_decay", base.adaptive_p.decay)
    given_temperature = temperature  # mirostat's, whatever the list (llama.cpp's chain under it)
    listed = samplers_order(body.get("samplers"))  # in the list's order; none: the server's own
    listed = defaults.samplers if listed is None else listed
    samplers = None if listed is None else frozenset(listed)  # adaptive_p changes nothing while its target is off
    if samplers is not None:  # what the list leaves out is off
        temperature = temperature if "temperature" in samplers else 1.0
        top_k = top_k if "top_k" in samplers else 0
        top_p = top_p if "top_p" in samplers else 1.0
        min_p = min_p if "min_p" in samplers else 0.0
        typical_p = typical_p if "typ_p" in samplers else 1.0
        top_n_sigma = top_n_sigma if "top_n_sigma" in samplers else 0.0
        xtc_probability = xtc_probability if "xtc" in samplers else 0.0
        dynatemp_range = dynatemp_range if "temperature" in samplers else 0.0
    if mirostat.on:  # llama.cpp's chain: the temperature, then mirostat, whatever the list says
        temperature = given_temperature
    # adaptive-p: on where its target is 0 or more and the list names it (llama-server's default list
    # does not); without a list, where the server's own settings have it on
    adaptive_listed = "adaptive_p" in samplers if samplers is not None else base.adaptive_p.on
    adaptive = AdaptiveP(float(adaptive_target), float(adaptive_decay))
    if not adaptive_listed or mirostat.on:
        adaptive = AdaptiveP(-1.0, float(adaptive_decay))
    if adaptive.on:  # its ranges read only where on, as llama-server takes any value then
        _check_range("adaptive_target", adaptive_target, 0.0, 1.0)
        _check_range("adaptive_decay", adaptive_decay, 0.0, MAX_DECAY)
        if temperature > 0.0 and xtc_probability > 0.0 and xtc_threshold <= XTC_MAX_THRESHOLD:
            raise invalid_value("adaptive_target", "adaptive-p beside XTC (xtc_probability) is not supported: its "
                                                   "average would follow the rows XTC's coin left, which the text "
                                                   "does not say: send one of them")
    if temperature == 0.0:  # greedy: the argmax (llama-server would sample between 0 and the range)
        dynatemp_range = 0.0
    if dynatemp_range > 0.0:  # read only where on, as llama-server reads it
        _check_range("dynatemp_exponent", dynatemp_exponent, 0.0, MAX_DYNATEMP_EXPONENT)
    if xtc_probability > 0.0 and xtc_threshold <= 0.0:  # every token would reach it (over 0.5: off, as llama.cpp's)
        raise invalid_value("xtc_threshold", f"must be above 0 (over 0.5: off), got {xtc_threshold}")
    penalties = _parse_penalties(body, base.penalties)
    if samplers is not None and "penalties" not in samplers:
        penalties = Penalties()
    dry = _parse_dry(body, base.dry)
    if samplers is not None and "dry" not in samplers:
        dry = Dry()
    logit_bias, bias_texts = _parse_logit_bias(body.get("logit_bias"), base.logit_bias)
    order = _sampling_order(listed, base.order, penalties.on, dry.on)
    indent = _number(body, "n_indent", 0, integer=True)
    _check_range("n_indent", indent, 0, MAX_ANSWER_TOKENS)
    line_ms = _number(body, "t_max_predict_ms", 0)
    seed = _number(body, "seed", base.seed, integer=True)
    if seed is not None and not (-MAX_SEED - 1 <= seed <= MAX_SEED):
        raise invalid_value("seed", f"must be a 64-bit integer, got {seed}")
    if seed == -1:  # "random", as llama-server and the UIs written for it send it
        seed = None
    elif seed is not None and seed < 0:  # OpenAI's seed is signed: s < 0 draws as s + 2**63 does
        seed += MAX_SEED + 1
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError("stream must be a boolean", "stream", code="invalid_type")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise RequestError("stream_options must be an object like {\"include_usage\": true}", "stream_options",
                           code="invalid_type")
    if not isinstance(options.get("include_obfuscation", False), bool):
        raise RequestError("stream_options.include_obfuscation must be a boolean", "stream_options",
                           code="invalid_type")
    # include_obfuscation pads chunks against a network observer's size counting: taken, none added
    if set(options) - {"include_usage", "include_obfuscation"}:
        unknown = ", ".join(sorted(set(options) - {"include_usage", "include_obfuscation"}))
        raise RequestError(f"stream_options takes include_usage and include_obfuscation only, not {unknown}",
                           "stream_options", code="invalid_value")
    if options and not stream:
        raise RequestError("stream_options is only allowed with stream: true", "stream_options",
                           code="invalid_value")
    grammar, grammar_field = _parse_grammar(body)
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise RequestError("ignore_eos must be a boolean", "ignore_eos", code="invalid_type")
    if ignore_eos and grammar is not None:
        raise invalid_value("ignore_eos", f"a grammar ({grammar_field}) ends its answer with an end-of-text token, "
                                          "which ignore_eos forbids: send one of them")
    if grammar is not None and forbids(logit_bias, bias_texts):
        raise invalid_value("logit_bias", f"a bias of false (never) beside a grammar ({grammar_field}) could forbid "
                                          "every token the grammar allows: give finite biases, or drop one of them")
    return dict(
        model=model,
        n=n,
        max_tokens=max_tokens,
        sampling=SamplingSettings(float(temperature), top_k, float(top_p), float(min_p), seed,
                                  infill=samplers is not None and "infill" in samplers, penalties=penalties,
                                  logit_bias=logit_bias, order=order, typical_p=float(typical_p),
                                  top_n_sigma=float(top_n_sigma), xtc_probability=float(xtc_probability),
                                  xtc_threshold=float(xtc_threshold), dry=dry,
                                  dynatemp_range=max(float(dynatemp_range), 0.0),
                                  dynatemp_exponent=float(dynatemp_exponent), mirostat=mirostat,
                                  adaptive_p=adaptive),
        bias_texts=bias_texts,
        ignore_eos=bool(ignore_eos),
        indent=indent,
        line_seconds=max(line_ms, 0) / 1000,  # 0 or less: no limit, as llama-server reads it
        stop=_parse_stop(body.get("stop")),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        grammar=grammar,
        grammar_field=grammar_field,
    )


def _parse_mirostat(body: dict, base: Mirostat) -> Mirostat:
    """llama-server's mirostat fields: ``mirostat`` 0 (off), 1 or 2, its target surprise
    ``mirostat_tau`` and rate ``mirostat_eta`` (numbers, their ranges checked only where it is on:
    llama-server takes any then)."""
    version = _number(body, "mirostat", base.version, integer=True)
    if version not in (0, 1, 2):
        raise invalid_value("mirostat", f"must be 0 (off), 1 or 2, got {version}")
    tau, eta = _number(body, "mirostat_tau", base.tau), _number(body, "mirostat_eta", base.eta)
    if version != 0:
        _check_range("mirostat_tau", tau, 0.0, MAX_TAU)
        _check_range("mirostat_eta", eta, 0.0, MAX_ETA)
    return Mirostat(version, float(tau), float(eta))


def _parse_penalties(body: dict, base: Penalties) -> Penalties:
    """llama-server's repeat_penalty and repeat_last_n, and OpenAI's frequency_penalty and
    presence_penalty (llama.cpp's penalties, specrun/penalties.py); what a request leaves out, the
    server's command line gives."""
    repeat = _number(body, "repeat_penalty", base.repeat)
    _check_range("repeat_penalty", repeat, 0.0, 10.0, low_open=True)
    frequency = _number(body, "frequency_penalty", base.frequency)
    _check_range("frequency_penalty", frequency, -MAX_PENALTY, MAX_PENALTY)
    presence = _number(body, "presence_penalty", base.presence)
    _check_range("presence_penalty", presence, -MAX_PENALTY, MAX_PENALTY)
    last_n = _number(body, "repeat_last_n", base.last_n, integer=True)
    if not -1 <= last_n <= MAX_ANSWER_TOKENS:
        raise invalid_value("repeat_last_n", f"must be -1 (the whole text), 0 (off) or a count of tokens, got {last_n}")
    penalties = Penalties(float(repeat), float(frequency), float(presence), last_n)
    return penalties if penalties.on else Penalties()


MAX_DRY_BREAKERS = 64  # llama-server takes any number; each is looked up in the whole vocabulary


def _parse_dry(body: dict, base: Dry) -> Dry:
    """llama-server's DRY fields (dry_multiplier, dry_base, dry_allowed_length, dry_penalty_last_n,
    dry_sequence_breakers; specrun/dry.py); what a request leaves out, the server's command line
    gives. A base under 1 is the server's, as llama-server reads it."""
    multiplier = _number(body, "dry_multiplier", base.multiplier)
    _check_range("dry_multiplier", multiplier, 0.0, MAX_DRY_MULTIPLIER)
    dry_base = _number(body, "dry_base", base.base)
    dry_base = base.base if dry_base < 1.0 else dry_base
    _check_range("dry_base", dry_base, 1.0, MAX_DRY_BASE)
    allowed = _number(body, "dry_allowed_length", base.allowed_length, integer=True)
    _check_range("dry_allowed_length", allowed, 0, MAX_DRY_LENGTH)
    last_n = _number(body, "dry_penalty_last_n", base.last_n, integer=True)
    if not -1 <= last_n <= MAX_DRY_LENGTH:
        raise invalid_value("dry_penalty_last_n", f"must be -1 (the whole text), 0 (off) or a count of tokens, "
                                                  f"got {last_n}")
    breakers = body.get("dry_sequence_breakers")
    if breakers is None:
        breakers = base.breakers
    elif not (isinstance(breakers, list) and breakers and all(isinstance(b, str) and b for b in breakers)):
        raise RequestError("dry_sequence_breakers must be a non-empty array of non-empty strings",
                           "dry_sequence_breakers", code="invalid_type")
    elif len(breakers) > MAX_DRY_BREAKERS:
        raise invalid_value("dry_sequence_breakers", f"takes at most {MAX_DRY_BREAKERS} breakers, got {len(breakers)}")
    for at, breaker in enumerate(breakers):
        checked_text(breaker, f"dry_sequence_breakers[{at}]")
    dry = Dry(float(multiplier), float(dry_base), allowed, last_n, tuple(breakers))
    return dry if dry.on else Dry()


def _parse_logit_bias(value, base: tuple[tuple[int, float], ...]
                      ) -> tuple[tuple[tuple[int, float], ...], tuple[tuple[str, float], ...]]:
    """``logit_bias`` as OpenAI writes it ({"token id": bias}) or llama-server does ([[token, bias],
    ...], a token an id or text, the bias a number or false: never): the biases by token id, and by
    text (each of its tokens, tokenized by the worker). Ids are checked against the vocabulary there too."""
    if value is None:
        return base, ()
    if isinstance(value, dict):  # OpenAI's keys are token ids written as strings; llama-server's may be text
        pairs = [(_token_id(key, f"logit_bias[{_shown(key)}]"), bias, f"logit_bias[{_shown(key)}]")
                 for key, bias in value.items()]
    elif isinstance(value, list):
        pairs = []
        for index, pair in enumerate(value):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise invalid_value(f"logit_bias[{index}]", "must be a [token, bias] pair")
            pairs.append((pair[0], pair[1], f"logit_bias[{index}]"))
    else:
        raise RequestError('logit_bias must be an object like {"15043": -100} or a list of [token, bias] pairs',
                           "logit_bias", code="invalid_type")
    by_id, by_text = [], []
    for token, bias, where in pairs:
        if bias is False:
            amount = -math.inf  # llama-server's "never"
        elif isinstance(bias, (int, float)) and not isinstance(bias, bool) and -MAX_BIAS <= bias <= MAX_BIAS:
            amount = float(bias)
        else:
            raise invalid_value(where, f"the bias must be a number in [-{MAX_BIAS:g}, {MAX_BIAS:g}] or false "
                                       f"(never that token), got {_shown(bias)}")
        if isinstance(token, int) and not isinstance(token, bool):
            by_id.append((token, amount))
        elif isinstance(token, str) and token:
            by_text.append((checked_text(token, "logit_bias"), amount))
        else:
            raise invalid_value(where, f"the token must be a token id or text, got {_shown(token)}")
    return tuple(by_id), tuple(by_text)


def forbids(logit_bias, bias_texts=()) -> bool:
    """Does a bias forbid a token outright (false, -inf)?"""
    return any(amount == -math.inf for _, amount in (*logit_bias, *bias_texts))


def _token_id(key: str, where: str) -> int | str:
    """An object form's key as llama-server reads it (``strtol`` to the end): a token id, or text."""
    if re.fullmatch(r"\s*[+-]?[0-9]+", key) is None:
        return key
    if len(key.strip().lstrip("+-")) > 10:  # past any vocabulary (and Python's int of 4,300 digits)
        raise invalid_value(where, "the token id is outside the vocabulary")
    return int(key)


def with_bias_texts(request: CompletionRequest, tokenize, vocab_size: int) -> CompletionRequest:
    """``request`` with its logit_bias complete: each text's tokens biased (``tokenize(text)``: its
    ids, no special tokens added or read) beside the ids, every id within ``vocab_size``."""
    sampling = request.sampling
    resolved = [(token, amount) for text, amount in request.bias_texts for token in tokenize(text)]
    check_token_ids([token for token, _ in sampling.logit_bias], vocab_size, "logit_bias")
    if not resolved:
        return request
    return dataclasses.replace(request, bias_texts=(),
                               sampling=dataclasses.replace(sampling, logit_bias=sampling.logit_bias + tuple(resolved)))


def samplers_order(samplers) -> tuple[str, ...] | None:
    """llama-server's ``samplers`` (a list of names, or a string of their letters; those specrun
    has take their request's settings, one left out is off), each as llama.cpp names it, in the
    list's order (None where the request does not say); a name or letter that is no sampler is a 400."""
    if samplers is None:
        return None
    if isinstance(samplers, str) or (isinstance(samplers, list) and all(isinstance(name, str) for name in samplers)):
        try:
            return named_samplers(samplers)
        except ValueError as error:
            raise invalid_value("samplers", str(error)) from None
    raise RequestError("samplers must be a list of sampler names or a string of their letters", "samplers",
                       code="invalid_type")


def _sampling_order(listed: tuple[str, ...] | None, default: tuple[str, ...], penalties_on: bool,
                    dry_on: bool) -> tuple[str, ...]:
    """The order specrun's samplers apply in (SamplingSettings.order): llama-server applies its
    chain in ``samplers``' order (sampling.listed_order: a sampler listed twice, or one before the
    penalties or DRY where they are on, is a 400, never a silent difference); where the request
    does not say, the server's (llama.cpp's, unless ``serve --samplers`` named another)."""
    if listed is None:
        return default
    try:
        return listed_order(listed, penalties_on, dry_on)
    except ValueError as error:
        raise invalid_value("samplers", str(error)) from None


def _parse_grammar(body: dict) -> tuple[GrammarSpec | None, str | None]:
    """What the answer must follow, and the field that said so: OpenAI's ``response_format``
    (``json_object``, ``json_schema``), or llama-server's ``grammar`` (GBNF; Lark after a first line
    ``%llguidance {}``, which llguidance reads as llama.cpp's llguidance builds do) and ``json_schema``.
    The grammar is compiled here, before the request queues, so one that cannot be used is a 400
    naming its field."""
    asked = []
    response_format = body.get("response_format")
    if response_format is not None:
        asked.append(_response_format(response_format))
    grammar = body.get("grammar")
    if grammar is not None and grammar != "":  # "": none, as llama-server reads it
        if not isinstance(grammar, str) or not grammar.strip():
            raise RequestError("grammar must be a non-empty string of GBNF rules (or Lark after %llguidance {})",
                               "grammar", code="invalid_type")
        # Lark after %llguidance {} (llguidance reads it either way; its errors then say Lark)
        kind = "lark" if grammar.lstrip().startswith("%llguidance") else "gbnf"
        asked.append((GrammarSpec(kind, checked_text(grammar, "grammar")), "grammar"))
    schema = body.get("json_schema")
    if schema is not None:
        if not isinstance(schema, dict):
            raise RequestError("json_schema must be a JSON schema object", "json_schema", code="invalid_type")
        asked.append((GrammarSpec("json_schema", _schema_text(schema, "json_schema")), "json_schema"))
    asked = [each for each in asked if each[0] is not None]
    if len(asked) > 1:
        names = " and ".join(where.split(".")[0] for _, where in asked)
        raise invalid_value(asked[1][1], f"{names} both constrain the answer: send one of them")
    if not asked:
        return None, None
    spec, where = asked[0]
    try:
        spec.check()
    except GrammarError as exc:
        raise invalid_value(where, exc.problem) from None
    return spec, where


def _schema_text(schema: dict, where: str) -> str:
    """A schema as JSON text (json.loads takes a little more nesting than json.dumps writes back)."""
    try:
        return json.dumps(schema)
    except RecursionError:
        raise invalid_value(where, "nests too deeply") from None


def _response_format(response_format) -> tuple[GrammarSpec | None, str]:
    """``response_format`` as a grammar (None for text), and the field a refusal names."""
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise RequestError('response_format must be an object like {"type": "json_object"}', "response_format",
                           code="invalid_type")
    kind = response_format["type"]
    if kind == "text":
        return None, "response_format"
    if kind == "json_object":
        schema = response_format.get("schema")  # llama-server's extension: a schema beside json_object
        if schema is None:
            return GrammarSpec("json_object"), "response_format"
        if not isinstance(schema, dict):
            raise RequestError("response_format.schema must be a JSON schema object", "response_format.schema",
                               code="invalid_type")
        return GrammarSpec("json_schema", _schema_text(schema, "response_format.schema")), "response_format.schema"
    if kind == "json_schema":
        described = response_format.get("json_schema")
        if not isinstance(described, dict):
            raise RequestError('response_format.json_schema must be an object like {"name": ..., "schema": {...}}',
                               "response_format.json_schema", code="invalid_type")
        for key, kind_of_value, wanted in (("name", str, "a string"), ("description", str, "a string"),
                                           ("strict", bool, "true or false")):
            if described.get(key) is not None and not isinstance(described[key], kind_of_value):
                raise RequestError(f"response_format.json_schema.{key} must be {wanted}, got {_shown(described[key])}",
                                   f"response_format.json_schema.{key}", code="invalid_type")
        schema = described.get("schema")
        if not isinstance(schema, dict):
            raise RequestError("response_format.json_schema.schema must be a JSON schema object",
                               "response_format.json_schema.schema",
                               code="invalid_type" if schema is not None else "missing_required_parameter")
        where = "response_format.json_schema.schema"
        return GrammarSpec("json_schema", _schema_text(schema, where)), where
    raise invalid_value("response_format.type", f"must be text, json_object or json_schema, got {_shown(kind)}")


def _parse_stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError("stop must be a string or a list of strings", "stop", code="invalid_type")
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid_value("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    if any(not s for s in stops):
        raise invalid_value("stop", "stop strings must not be empty")
    return tuple(checked_text(s, "stop") for s in stops)


def parse_chat_request(body: dict, defaults: ServeDefaults, n_ctx: int) -> CompletionRequest:
    """A /v1/chat/completions body as a CompletionRequest, or a RequestError naming the bad field."""
    check_fields(body, (*COMMON_FIELDS, "messages", "max_completion_tokens", "tools", "tool_choice",
                         "parallel_tool_calls", "logprobs", "top_logprobs", "functions", "function_call",
                         *CHAT_TEMPLATE_FIELDS))
    common = parse_common(body, defaults, n_ctx, "max_completion_tokens")
    # function_call "auto" or "none" alone asks nothing (clients send it always, as they did tool_choice)
    legacy = body.get("functions") is not None or body.get("function_call") not in (None, "auto", "none")
    if legacy:
        tools, choice = _legacy_functions(body)
    else:
        tools = _parse_tools(body.get("tools"))
        choice = _parse_tool_choice(body.get("tool_choice"), tools)
    if choice.forces_a_call and common["grammar"] is not None:
        raise invalid_value("tool_choice", f"a required tool call and {common['grammar_field']} both constrain "
                            "the answer: send one of them")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("parallel_tool_calls must be a boolean", "parallel_tool_calls", code="invalid_type")
    return CompletionRequest(messages=_parse_messages(body.get("messages")), tools=tools, tool_choice=choice,
                             parallel_tool_calls=bool(parallel) and not legacy, logprobs=_chat_logprobs(body),
                             legacy_functions=legacy, **chat_template_settings(body, defaults), **common)


def _legacy_functions(body: dict) -> tuple[tuple[Tool, ...], ToolChoice]:
    """OpenAI's older ``functions`` (definitions without the ``{"type": "function"}`` wrapper) and
    ``function_call`` ("none", "auto" or ``{"name": ...}``) as tools and tool_choice; a refusal names
    the older fields."""
    functions, call = body.get("functions"), body.get("function_call")
    if functions is None:
        raise invalid_value("function_call", "names a function of functions (their older form): send functions too, "
                                             "or use tools and tool_choice")
    if body.get("tools") is not None or body.get("tool_choice") is not None:
        raise invalid_value("functions", "send tools and tool_choice, or functions and function_call (their older "
                                         "form), not both")
    if not isinstance(functions, list):
        raise RequestError("functions must be a list of {name, description, parameters} objects", "functions",
                           code="invalid_type")
    for index, function in enumerate(functions):
        if not isinstance(function, dict):
            raise RequestError(f"functions[{index}] must be an object {{name, description, parameters}}",
                               f"functions[{index}]", code="invalid_type")
    try:
        tools = tool_definitions([{"type": "function", "function": function} for function in functions])
        if isinstance(call, dict) and set(call) <= {"name"}:
            call = {"type": "function", "function": call}
        elif call is not None and call not in ("none", "auto"):
            raise ToolDefinitionError('function_call must be "none", "auto" or {"name": ...}', "function_call",
                                      "invalid_type")
        return tools, tool_choice_of(call, tools)
    except ToolDefinitionError as exc:
        def older(text: str) -> str:
            return re.sub(r"\btools(\[\d+\])\.function\b", r"functions\1", text).replace(
                "tool_choice", "function_call").replace("tools does not", "functions does not")

        raise RequestError(older(exc.problem), older(exc.where), code=exc.code) from None


# A chat request's fields for its template and its thinking (llama-server's and vLLM's)
CHAT_TEMPLATE_FIELDS = ("chat_template_kwargs", "reasoning_effort", "reasoning_format", "reasoning_budget_tokens",
                        "thinking_budget_tokens", "reasoning_budget_message")
MAX_BUDGET_MESSAGE_CHARS = 4096


def chat_template_settings(body: dict, defaults: ServeDefaults) -> dict:
    """``template_variables`` and ``reasoning_format`` of a chat request: ``chat_template_kwargs``
    over the server's (--chat-template-kwargs, --reasoning), then OpenAI's ``reasoning_effort``
    (a template's variable of that name; "none" sets enable_thinking false, as llama-server reads it)."""
    variables = body.get("chat_template_kwargs")
    if variables is not None:
        problem = template_variables_problem(variables)
        if problem:
            raise invalid_value("chat_template_kwargs", problem)
    variables = {**defaults.template_variables, **(variables or {})}
    effort = body.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str) or not effort.strip():
            raise RequestError("reasoning_effort must be a string such as \"low\", \"medium\", \"high\" or \"none\"",
                               "reasoning_effort", code="invalid_type")
        if effort == "none":
            variables.pop("reasoning_effort", None)
            variables["enable_thinking"] = False
        else:
            variables["reasoning_effort"] = checked_text(effort, "reasoning_effort")
    reasoning_format = body.get("reasoning_format", defaults.reasoning_format)
    if reasoning_format not in REASONING_FORMATS:
        raise invalid_value("reasoning_format", f"must be one of {', '.join(REASONING_FORMATS)}, "
                                                f"got {_shown(reasoning_format)}")
    budget = _number(body, "reasoning_budget_tokens", None, integer=True)
    budget_field = "reasoning_budget_tokens"
    if budget is None:  # llama-server's other name for it
        budget, budget_field = _number(body, "thinking_budget_tokens", -1, integer=True), "thinking_budget_tokens"
    if budget < -1 or budget > MAX_ANSWER_TOKENS:
        raise invalid_value(budget_field, f"must be -1 (the server's: --reasoning-budget) or a count of tokens, "
                                          f"got {budget}")
    message = body.get("reasoning_budget_message")
    if message is not None and not isinstance(message, str):
        raise RequestError("reasoning_budget_message must be a string", "reasoning_budget_message", code="invalid_type")
    if message is not None and len(message) > MAX_BUDGET_MESSAGE_CHARS:
        raise invalid_value("reasoning_budget_message", f"at most {MAX_BUDGET_MESSAGE_CHARS} characters, got "
                                                        f"{len(message)}")
    return {"template_variables": variables, "reasoning_format": reasoning_format,
            "reasoning_budget": budget if budget >= 0 else defaults.reasoning_budget,
            "reasoning_budget_message": checked_text(message, "reasoning_budget_message") if message is not None
            else defaults.reasoning_budget_message}


def _chat_logprobs(body: dict) -> int | None:
    """Chat's ``logprobs`` (a boolean) and ``top_logprobs`` (0 to 20, with logprobs only)."""
    asked = body.get("logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise RequestError("logprobs must be a boolean", "logprobs", code="invalid_type")
    top = _number(body, "top_logprobs", None, integer=True)
    if top is not None:
        _check_range("top_logprobs", top, 0, MAX_TOP_LOGPROBS)
        if not asked and top:
            raise invalid_value("top_logprobs", "needs logprobs: true")
    return (top or 0) if asked else None


def _parse_tools(tools) -> tuple[Tool, ...]:
    """``tools``: function definitions (sessions/tools.py checks them), refused by the field named."""
    try:
        return tool_definitions(tools)
    except ToolDefinitionError as exc:
        raise RequestError(exc.problem, exc.where, code=exc.code) from None


def _parse_tool_choice(choice, tools: Sequence[Tool]) -> ToolChoice:
    try:
        return tool_choice_of(choice, tools)
    except ToolDefinitionError as exc:
        raise RequestError(exc.problem, exc.where, code=exc.code) from None


def _parse_messages(messages) -> tuple[dict[str, str], ...]:
    if messages is None:
        raise RequestError("messages is required", "messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise RequestError("messages must be a list of {role, content} objects", "messages", code="invalid_type")
    if not messages:
        raise invalid_value("messages", "must hold at least one message")
    parsed = []
    unanswered: list[str] = []  # the ids of the last assistant turn's calls no tool message answered yet
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object with role and content", where, code="invalid_type")
        role = message.get("role")
        if role == "function":  # a result in OpenAI's older form: a tool's, answering the call before it
            role = "tool"
        if role not in ROLES:
            raise invalid_value(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {_shown(role)}")
        content = _message_text(message.get("content"), f"{where}.content", optional=role == "assistant")
        if message.get("name") is not None and not isinstance(message["name"], str):
            raise RequestError(f"{where}.name must be a string", f"{where}.name", code="invalid_type")
        entry = {"role": "system" if role == "developer" else role, "content": content}
        if role == "assistant" and message.get("tool_calls"):
            entry["tool_calls"] = _earlier_calls(message["tool_calls"], f"{where}.tool_calls")
        elif role == "assistant" and message.get("function_call") is not None:  # the older form of one call
            entry["tool_calls"] = _earlier_function_call(message["function_call"], f"{where}.function_call")
        if role == "assistant":  # an earlier answer's thinking, which a template may write back (Qwen3's last)
            for key in ("reasoning_content", "reasoning"):  # llama-server's name, and vLLM's newer one
                if message.get(key) is not None:
                    thought = message[key]
                    if not isinstance(thought, str):
                        raise RequestError(f"{where}.{key} must be a string", f"{where}.{key}", code="invalid_type")
                    entry["reasoning_content"] = checked_text(thought, f"{where}.{key}")
                    break
        if role in ("user", "assistant"):  # by position: a call sent without an id keeps its place
            unanswered = [call["id"] for call in entry.get("tool_calls", ())]
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise RequestError(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id",
                                   code="invalid_type")
            # a result sent without its call's id (some clients leave it out) answers the last assistant
            # turn's first call no result answered yet: a template that writes ids back (Mistral's) needs one
            call_id = checked_text(call_id or (unanswered[0] if unanswered else ""), f"{where}.tool_call_id")
            if call_id in unanswered:
                unanswered.remove(call_id)
            entry["tool_call_id"] = call_id
            name = message.get("name")
            if name is not None:
                if not isinstance(name, str):
                    raise RequestError(f"{where}.name must be a string", f"{where}.name", code="invalid_type")
                entry["name"] = checked_text(name, f"{where}.name")
        parsed.append(entry)
    return tuple(parsed)


def _earlier_function_call(call, where: str) -> list[dict]:
    """An assistant message's ``function_call`` (OpenAI's older form of one call) as its tool_calls."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise RequestError(f'{where} must be {{"name": ..., "arguments": ...}}', where, code="invalid_type")
    try:
        return _earlier_calls([{"type": "function", "function": call}], where)
    except RequestError as exc:  # named as the client wrote it: where.arguments, not where[0].function.arguments
        param = (exc.param or where).replace(f"{where}[0].function", where)
        raise RequestError(exc.message.replace(exc.param or "", param), param, code=exc.code) from None


def _earlier_calls(calls, where: str) -> list[dict]:
    """An assistant message's ``tool_calls``, as the model made them in an earlier answer."""
    if not isinstance(calls, list):
        raise RequestError(f"{where} must be a list of tool calls", where, code="invalid_type")
    checked = []
    for index, call in enumerate(calls):
        at = f"{where}[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"{at} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                               "\"arguments\": ...}}", at, code="invalid_type")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, (str, dict)):
            raise RequestError(f"{at}.function.arguments must be JSON text", f"{at}.function.arguments",
                               code="invalid_type")
        if isinstance(arguments, dict):  # every text inside must be text a tokenizer takes
            checked_text(json.dumps(arguments, ensure_ascii=False), f"{at}.function.arguments")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise RequestError(f"{at}.id must be a string", f"{at}.id", code="invalid_type")
        checked.append({"id": checked_text(call_id or "", f"{at}.id"), "type": "function",
                        "function": {"name": checked_text(function["name"], f"{at}.function.name"),
                                     "arguments": arguments if isinstance(arguments, dict)
                                     else checked_text(arguments, f"{at}.function.arguments")}})
    return checked


def _message_text(content, where: str, optional: bool) -> str:
    """A message's content as text: a string, or a list of text parts (joined by newlines). An
    assistant's (``optional``) may be empty ([] beside its tool_calls) or hold refusal parts, as
    OpenAI's answers carry them back."""
    if (content is None or content == []) and optional:
        return ""
    if isinstance(content, str):
        return checked_text(content, where)
    if isinstance(content, list) and content:
        texts = []
        for index, part in enumerate(content):
            kind = "refusal" if optional and isinstance(part, dict) and part.get("type") == "refusal" else "text"
            if not isinstance(part, dict) or part.get("type") != kind or not isinstance(part.get(kind), str):
                raise RequestError(f"{where}[{index}] must be a text part ({{\"type\": \"text\", \"text\": ...}}): "
                                   "specrun serve takes text only", f"{where}[{index}]", code="invalid_type")
            texts.append(checked_text(part[kind], f"{where}[{index}].{kind}"))
        return "\n".join(texts)
    raise RequestError(f"{where} must be a string or a list of text parts", where, code="invalid_type")


def parse_completion_request(body: dict, defaults: ServeDefaults, n_ctx: int) -> CompletionRequest:
    """A /v1/completions body as a CompletionRequest, or a RequestError naming the bad field."""
    check_fields(body, (*COMMON_FIELDS, "prompt", "logprobs", "suffix"))
    common = parse_common(body, defaults, n_ctx, "max_tokens")
    logprobs = _number(body, "logprobs", None, integer=True)  # the completions API's: how many alternatives
    if logprobs is not None:
        _check_range("logprobs", logprobs, 0, MAX_TOP_LOGPROBS)
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise RequestError("suffix must be a string", "suffix", code="invalid_type")
    suffix = checked_text(suffix, "suffix") if suffix is not None else None  # "": a fill at a file's end
    if suffix and common["grammar"] is not None:
        raise invalid_value("suffix", f"a suffix and {common['grammar_field']} both shape the answer: send one")
    return CompletionRequest(prompt=parse_prompt(body.get("prompt"), empty=suffix is not None), logprobs=logprobs,
                             suffix=suffix, **common)


def parse_prompt(prompt, empty: bool = False) -> str | tuple[int, ...]:
    """The prompt: text or token ids; ``empty``: "" is one (a suffix's fill at a file's start)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt and not empty:
            raise invalid_value("prompt", "must not be empty")
        return checked_text(prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError("a batch of prompts is not supported: send one prompt per request", "prompt",
                           code="unsupported_value")
    raise RequestError("prompt must be a non-empty string or a list of token ids", "prompt",
                       code="invalid_type" if prompt is not None else "missing_required_parameter")
