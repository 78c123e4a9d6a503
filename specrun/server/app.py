"""``specrun serve``: one loaded pair behind an OpenAI-compatible HTTP API.

Layout. A single worker thread owns the pair: it loads the models, runs every
generation and closes them (MLX arrays belong to the thread that made them, and
one thread means one KV cache that nobody else touches). HTTP requests are parsed
and validated on the event loop (uvicorn + starlette), then queue as ``Job``s for
the worker, first come first served: the queue is the one lock. The worker sends
each job's events back to its request through an asyncio queue.

Prefix reuse. Every request is tokenized afresh from its messages (or prompt), so
an answer never depends on which request came before it; the engine then reuses
the longest prefix the target's cache shares with the new prompt (a conversation's
earlier turns, a shared system prompt) and prefills only the rest.

Interruptions. A stop string, a client that disconnects, or a server shutting down
closes the generation at the next verify pass; ``ChatSession.stream`` leaves both
caches exact for the next request.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import math
import queue
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specrun.backends.kv import common_prefix_len
from specrun.drafters.lookahead import LookaheadSizes
from specrun.engine.loop import Finished, GenerationParams, TextChunk
from specrun.engine.stats import Stats
from specrun.errors import SpecrunError, UsageError
from specrun.fileio import json_problem
from specrun.registry.loading import LoadOptions
from specrun.sampling import SamplingSettings
from specrun.sessions.generation import TreeSettings

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_QUEUE = 64
MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_TEMPERATURE = 2.0  # as OpenAI's API
DISCONNECT_POLL_SECONDS = 0.25
GRACEFUL_SHUTDOWN_SECONDS = 3
ROLES = ("system", "developer", "user", "assistant")

# OpenAI fields specrun accepts but does not act on, with the values that mean "nothing asked":
# any other value is refused by name rather than silently ignored.
_INERT_FIELDS = {
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "logprobs": (False, None),
    "top_logprobs": (0, None),
    "logit_bias": (None,),
    "tools": (None,),
    "tool_choice": (None, "none", "auto"),
    "functions": (None,),
    "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "echo": (False, None),
    "best_of": (1, None),
    "suffix": (None, ""),
}
# Fields with no effect on the answer: accepted as any value.
_FREE_FIELDS = ("user", "store", "metadata", "service_tier", "parallel_tool_calls")
_COMMON_FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
                  "stream_options", "n")


# ---- errors ---------------------------------------------------------------------------
class RequestError(Exception):
    """A request the server refuses: an HTTP status and an OpenAI-style error object."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.kind = kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _invalid(param: str, message: str) -> RequestError:
    return RequestError(f"{param}: {message}", param, code="invalid_value")


# ---- requests -------------------------------------------------------------------------
@dataclass(frozen=True)
class ServeDefaults:
    """What a request that does not say gets: the command line's sampling options."""

    max_tokens: int = 512
    sampling: SamplingSettings = field(default_factory=SamplingSettings)


@dataclass(frozen=True)
class CompletionRequest:
    """A validated request to either endpoint: ``messages`` (chat) or ``prompt`` (text or token ids)."""

    model: str
    max_tokens: int
    sampling: SamplingSettings
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    messages: tuple[dict[str, str], ...] | None = None
    prompt: str | tuple[int, ...] | None = None

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
        raise _invalid(name, f"must be a finite number, got {value}")
    if isinstance(value, int) and abs(value) >= 2**64:
        raise _invalid(name, "is out of range (more than 64 bits)")
    return value


def _shown(value) -> str:
    """A bad value as an error quotes it: at most 40 characters of its JSON."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _text(value: str, where: str) -> str:
    """``value`` if it is text the tokenizer can take: JSON may escape half of a surrogate pair
    alone (\\ud800), which no UTF-8 encoder accepts."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _invalid(where, f"is not valid Unicode text (a lone surrogate at character {exc.start})") from None
    return value


def _check_range(name: str, value, low, high, low_open: bool = False, high_open: bool = False) -> None:
    below = value <= low if low_open else value < low
    above = value >= high if high_open else value > high
    if below or above:
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise _invalid(name, f"must be in {lo}{low:g}, {high:g}{hi}, got {value}")


def _check_fields(body: dict, known: Sequence[str]) -> None:
    for name, value in body.items():
        if name in known or name in _FREE_FIELDS:
            continue
        if name in _INERT_FIELDS:
            if value not in _INERT_FIELDS[name] and value not in ([], {}):
                raise RequestError(f"{name} is not supported by specrun serve", name, code="unsupported_value")
            continue
        raise RequestError(f"unrecognized request argument supplied: {name}", name, code="unknown_parameter")


def _parse_common(body: dict, defaults: ServeDefaults, n_ctx: int, max_tokens_field: str) -> dict:
    """The fields both endpoints share, validated; each error names its field."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model must be a non-empty string naming the served model", "model",
                           code="invalid_type" if model is not None else "missing_required_parameter")
    n = _number(body, "n", 1, integer=True)
    if n != 1:
        raise RequestError(f"n must be 1: specrun serve returns one choice per request, got {n}", "n",
                           code="unsupported_value")
    max_tokens = _number(body, max_tokens_field, None, integer=True)
    if max_tokens is None and max_tokens_field != "max_tokens":
        max_tokens_field = "max_tokens"
        max_tokens = _number(body, "max_tokens", None, integer=True)
    if max_tokens is None:
        max_tokens = min(defaults.max_tokens, n_ctx)
    _check_range(max_tokens_field, max_tokens, 1, n_ctx)
    base = defaults.sampling
    temperature = _number(body, "temperature", base.temperature)
    _check_range("temperature", temperature, 0.0, max(MAX_TEMPERATURE, base.temperature))
    top_p = _number(body, "top_p", base.top_p)
    _check_range("top_p", top_p, 0.0, 1.0, low_open=True)
    top_k = _number(body, "top_k", base.top_k, integer=True)
    if top_k < 0:
        raise _invalid("top_k", f"must be 0 (off) or positive, got {top_k}")
    min_p = _number(body, "min_p", base.min_p)
    _check_range("min_p", min_p, 0.0, 1.0, high_open=True)
    seed = _number(body, "seed", base.seed, integer=True)
    if seed is not None and not (0 <= seed < 2**63):
        raise _invalid("seed", f"must be a non-negative 64-bit integer, got {seed}")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError("stream must be a boolean", "stream", code="invalid_type")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise RequestError("stream_options must be an object like {\"include_usage\": true}", "stream_options",
                           code="invalid_type")
    return dict(
        model=model,
        max_tokens=max_tokens,
        sampling=SamplingSettings(float(temperature), top_k, float(top_p), float(min_p), seed),
        stop=_parse_stop(body.get("stop")),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
    )


def _parse_stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError("stop must be a string or a list of strings", "stop", code="invalid_type")
    if len(stops) > MAX_STOP_STRINGS:
        raise _invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    if any(not s for s in stops):
        raise _invalid("stop", "stop strings must not be empty")
    return tuple(_text(s, "stop") for s in stops)


def parse_chat_request(body: dict, defaults: ServeDefaults, n_ctx: int) -> CompletionRequest:
    """A /v1/chat/completions body as a CompletionRequest, or a RequestError naming the bad field."""
    _check_fields(body, (*_COMMON_FIELDS, "messages", "max_completion_tokens"))
    common = _parse_common(body, defaults, n_ctx, "max_completion_tokens")
    return CompletionRequest(messages=_parse_messages(body.get("messages")), **common)


def _parse_messages(messages) -> tuple[dict[str, str], ...]:
    if messages is None:
        raise RequestError("messages is required", "messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise RequestError("messages must be a list of {role, content} objects", "messages", code="invalid_type")
    if not messages:
        raise _invalid("messages", "must hold at least one message")
    parsed = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object with role and content", where, code="invalid_type")
        role = message.get("role")
        if role not in ROLES:
            raise _invalid(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {json.dumps(role)}")
        content = _message_text(message.get("content"), f"{where}.content", optional=role == "assistant")
        parsed.append({"role": "system" if role == "developer" else role, "content": content})
    return tuple(parsed)


def _message_text(content, where: str, optional: bool) -> str:
    """A message's content as text: a string, or a list of text parts (joined by newlines)."""
    if content is None and optional:
        return ""
    if isinstance(content, str):
        return _text(content, where)
    if isinstance(content, list) and content:
        texts = []
        for index, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}[{index}] must be a text part ({{\"type\": \"text\", \"text\": ...}}): "
                                   "specrun serve takes text only", f"{where}[{index}]", code="invalid_type")
            texts.append(_text(part["text"], f"{where}[{index}].text"))
        return "\n".join(texts)
    raise RequestError(f"{where} must be a string or a list of text parts", where, code="invalid_type")


def parse_completion_request(body: dict, defaults: ServeDefaults, n_ctx: int) -> CompletionRequest:
    """A /v1/completions body as a CompletionRequest, or a RequestError naming the bad field."""
    _check_fields(body, (*_COMMON_FIELDS, "prompt"))
    common = _parse_common(body, defaults, n_ctx, "max_tokens")
    return CompletionRequest(prompt=_parse_prompt(body.get("prompt")), **common)


def _parse_prompt(prompt) -> str | tuple[int, ...]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise _invalid("prompt", "must not be empty")
        return _text(prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError("a batch of prompts is not supported: send one prompt per request", "prompt",
                           code="unsupported_value")
    raise RequestError("prompt must be a non-empty string or a list of token ids", "prompt",
                       code="invalid_type" if prompt is not None else "missing_required_parameter")


# ---- stop strings ---------------------------------------------------------------------
class StopCut:
    """Cuts streamed text before the first stop string, holding back what may begin one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text that can go out now; sets ``stopped`` when a stop string appeared."""
        self.held += text
        found = [at for at in (self.held.find(stop) for stop in self.stops) if at >= 0]
        if found:
            out, self.held, self.stopped = self.held[: min(found)], "", True
            return out
        keep = max((k for stop in self.stops for k in range(1, len(stop)) if self.held.endswith(stop[:k])),
                   default=0)
        out = self.held[: len(self.held) - keep]
        self.held = self.held[len(out):]
        return out

    def flush(self) -> str:
        """What was held back, at the end of the answer: it began a stop string that never came."""
        out, self.held = self.held, ""
        return out


# ---- the worker and its jobs ------------------------------------------------------------
@dataclass(frozen=True)
class Started:
    """Event: the prompt fits and generation begins; ``reused_tokens`` came from the cache."""

    prompt_tokens: int
    reused_tokens: int


@dataclass(frozen=True)
class Delta:
    """Event: answer text, with the tokens produced since the last Delta and how many came from drafts."""

    text: str
    tokens: int
    from_draft: int


@dataclass(frozen=True)
class Done:
    """Event: the answer ended ("stop" or "length", as OpenAI says)."""

    finish_reason: str
    stats: Stats


@dataclass(frozen=True)
class Failed:
    error: RequestError


JobEvent = Started | Delta | Done | Failed
_FINISH_REASONS = {"eos": "stop", "length": "length", "context": "length"}


class Job:
    """One request waiting for, or being served by, the worker. Events reach the request's
    event loop (``next_event``); ``cancel`` stops the generation at its next verify pass."""

    def __init__(self, request: CompletionRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.id = uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.cancelled = threading.Event()
        self._loop = loop
        self._events: asyncio.Queue[JobEvent] = asyncio.Queue()
        self._check_at = 0.0  # when next_event next asks whether the client is still there

    def emit(self, event: JobEvent) -> None:
        """From the worker thread."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the event loop is gone: nobody is listening any more
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()

    async def next_event(self, disconnected: Callable | None = None) -> JobEvent:
        """The next event; with ``disconnected`` (an async check), cancel and raise
        ``ClientGone`` when the client has left, checked every DISCONNECT_POLL_SECONDS whether
        or not events keep coming (a whole answer's text arrives at every pass)."""
        while True:
            if disconnected is None:
                return await self._events.get()
            now = time.monotonic()
            if now >= self._check_at:
                self._check_at = now + DISCONNECT_POLL_SECONDS
                if await disconnected():
                    self.cancel()
                    raise ClientGone()
            try:
                return await asyncio.wait_for(self._events.get(), self._check_at - now)
            except asyncio.TimeoutError:
                continue


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


@dataclass(frozen=True)
class PairOptions:
    """The pair to load and how to speculate: what ``specrun chat`` takes too."""

    target: str
    draft: str | None
    method: str = "auto"
    load: LoadOptions = field(default_factory=LoadOptions)
    draft_len: int | None = None
    draft_min_prob: float | None = None
    ngram_cache: Path | None = None
    heads: str | None = None  # --heads: a head method's heads file (None: found by the target's alias)
    trees: TreeSettings = field(default_factory=TreeSettings)  # --tree-nodes, --branches (chains by default)
    lookahead: LookaheadSizes | None = None  # --lookahead (None: chosen from the target's pass costs)


class PairWorker:
    """The thread that owns the loaded pair and answers jobs one at a time, in arrival order."""

    def __init__(self, pair: PairOptions, max_queue: int = DEFAULT_MAX_QUEUE,
                 log: Callable[[str], None] | None = None) -> None:
        self.pair = pair
        self.log = log or (lambda line: None)
        self.jobs: queue.Queue[Job | None] = queue.Queue(max_queue)
        self.session = None
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="specrun-serve-worker", daemon=True)
        self._current: Job | None = None
        self.served = 0

    def start(self) -> None:
        """Load the pair on the worker thread; re-raises a loading failure here."""
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error

    @property
    def n_ctx(self) -> int:
        return self.session.target.n_ctx

    @property
    def method(self) -> str:
        return self.session.method

    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise RequestError(f"the server is busy: {self.jobs.maxsize} requests are waiting already; retry later",
                               status=503, code="server_busy", kind="server_error") from None

    def stop(self) -> None:
        """Cancel what is queued or running, then close the pair on its thread."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
        current = self._current
        if current is not None:
            current.cancel()
        self.jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        from specrun.sessions.chat import open_chat

        pair = self.pair
        try:
            self.session = open_chat(pair.target, pair.draft, pair.method, pair.load, draft_len=pair.draft_len,
                                     draft_min_prob=pair.draft_min_prob, ngram_cache=pair.ngram_cache,
                                     heads=pair.heads, branches=pair.trees.branches, lookahead=pair.lookahead,
                                     chain=pair.trees.chain, tree_nodes=pair.trees.nodes,
                                     on_note=lambda note: self.log(f"note: {note}"))
        except BaseException as exc:
            self._load_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while (job := self.jobs.get()) is not None:
                if job.cancelled.is_set():
                    self.log(f"{job.id}: the client left while queued; dropped")
                    continue
                self._current = job
                try:
                    self._answer(job)
                except Exception as exc:  # noqa: BLE001 - one request failed; the server keeps serving
                    self.log(f"{job.id}: failed: {type(exc).__name__}: {exc}")
                    job.emit(Failed(RequestError(f"the request failed: {type(exc).__name__}: {exc}", status=500,
                                                 code="internal_error", kind="server_error")))
                self._current = None
        finally:
            self.session.close()

    def _answer(self, job: Job) -> None:
        try:
            prompt_ids = self._prompt_ids(job.request)
        except RequestError as exc:
            job.emit(Failed(exc))
            return
        except SpecrunError as exc:  # a chat template that refuses the conversation
            job.emit(Failed(RequestError(exc.one_line(), "messages" if job.request.is_chat else "prompt")))
            return
        session = self.session
        session.new_text()  # each request is a text of its own: its acceptance is measured afresh
        reused = min(common_prefix_len(session.engine.target.tokens, prompt_ids), len(prompt_ids) - 1)
        job.emit(Started(len(prompt_ids), reused))
        cut = StopCut(job.request.stop)
        tokens = from_draft = 0
        params = GenerationParams(job.request.max_tokens, 0, job.request.sampling, tree_nodes=self.pair.trees.nodes)
        stream = session.stream(prompt_ids, params)
        try:
            for event in stream:
                if job.cancelled.is_set():
                    self.log(f"{job.id}: the client left; stopped after the pass in progress")
                    return
                if isinstance(event, TextChunk):
                    tokens += len(event.token_ids)
                    from_draft += sum(event.from_draft)
                    text = cut.feed(event.text)
                    if text:
                        job.emit(Delta(text, tokens, from_draft))
                        tokens = from_draft = 0
                    if cut.stopped:
                        self._finish(job, "stop", event.stats)
                        return
                elif isinstance(event, Finished):
                    tail = cut.flush()
                    if tail or tokens:
                        job.emit(Delta(tail, tokens, from_draft))
                    self._finish(job, _FINISH_REASONS[event.result.finish_reason], event.result.stats)
        except Exception as exc:  # noqa: BLE001 - the server keeps serving; the request learns what failed
            message = exc.one_line() if isinstance(exc, SpecrunError) else f"{type(exc).__name__}: {exc}"
            job.emit(Failed(RequestError(f"generation failed: {message}", status=500, code="internal_error",
                                         kind="server_error")))
        finally:
            stream.close()  # stops the engine at this pass; the caches stay exact

    def _finish(self, job: Job, finish_reason: str, stats: Stats) -> None:
        self.served += 1
        job.emit(Done(finish_reason, stats))
        self.log(f"{job.id}: {finish_reason}; {stats.summary()}")

    def _prompt_ids(self, request: CompletionRequest) -> list[int]:
        from specrun.sessions.generation import prompt_token_ids
        from specrun.sessions.templates import message_spans, tokenize_rendered

        session = self.session
        target = session.target
        param = "messages" if request.is_chat else "prompt"
        if request.is_chat:
            messages = list(request.messages)
            text = session.template.render(messages, add_generation_prompt=True)
            prompt_ids = tokenize_rendered(target, session.template, text, message_spans(text, messages))
        elif isinstance(request.prompt, str):
            prompt_ids = prompt_token_ids(target, request.prompt, chat=False)
        else:
            bad = next((t for t in request.prompt if not 0 <= t < target.vocab.size), None)
            if bad is not None:
                raise _invalid("prompt", f"token id {bad} is outside the vocabulary (0 to {target.vocab.size - 1})")
            prompt_ids = list(request.prompt)
        if not prompt_ids:
            raise _invalid(param, "the prompt is empty")
        if len(prompt_ids) >= target.n_ctx:
            raise RequestError(
                f"{param}: the prompt has {len(prompt_ids)} tokens but the context holds {target.n_ctx}; "
                "shorten it, or restart the server with a larger --ctx",
                param,
                code="context_length_exceeded",
            )
        return prompt_ids


# ---- HTTP ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class HttpOptions:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_queue: int = DEFAULT_MAX_QUEUE
    model_names: tuple[str, ...] = ()  # the names requests may give in ``model``; the first is listed


def speculation_object(stats: Stats) -> dict:
    """What speculation did for one answer: the CLI's --json statistics."""
    return stats.to_dict()


def usage_object(started: Started, stats: Stats) -> dict:
    return {
        "prompt_tokens": started.prompt_tokens,
        "completion_tokens": stats.new_tokens,
        "total_tokens": started.prompt_tokens + stats.new_tokens,
        "prompt_tokens_details": {"cached_tokens": started.reused_tokens},
    }


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


async def read_json_body(request, limit: int) -> dict:
    """The request's JSON object, refused (413) as soon as it is known to exceed ``limit`` bytes:
    from Content-Length before reading anything, else while it streams in."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise RequestError("Content-Length is not a number", code="invalid_header")
        if int(declared) > limit:
            raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise RequestError(f"the request body is not valid JSON: {json_problem(exc)}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", code="invalid_type")
    return body


def _too_large(limit: int) -> RequestError:
    return RequestError(f"the request body is larger than the server's limit of {limit} bytes "
                        "(specrun serve --max-body)", status=413, code="request_too_large")


class OpenAIServer:
    """The routes over one PairWorker: /v1/chat/completions, /v1/completions, /v1/models, /health."""

    def __init__(self, worker: PairWorker, http: HttpOptions, defaults: ServeDefaults) -> None:
        self.worker = worker
        self.http = http
        self.defaults = defaults
        self.started = int(time.time())

    @property
    def model_id(self) -> str:
        return self.http.model_names[0]

    def app(self):
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.routing import Route

        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self._endpoint(self.models), methods=["GET"]),
            Route("/v1/chat/completions", self._endpoint(self.chat_completions), methods=["POST"]),
            Route("/v1/completions", self._endpoint(self.completions), methods=["POST"]),
        ]
        handlers = {HTTPException: self._http_error, Exception: self._internal_error}
        return Starlette(routes=routes, exception_handlers=handlers)

    # ---- plumbing ----------------------------------------------------------------------
    def _endpoint(self, handler):
        """Bearer auth (with --api-key) and RequestError as an OpenAI error response."""

        async def endpoint(request):
            try:
                self._authorize(request)
                return await handler(request)
            except RequestError as exc:
                return _error_response(exc)
            except ClientGone:
                from starlette.responses import Response

                return Response(status_code=499)  # nobody reads it: the client has gone

        return endpoint

    def _authorize(self, request) -> None:
        key = self.http.api_key
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise RequestError("missing or wrong API key: send the header Authorization: Bearer KEY", status=401,
                               code="invalid_api_key")

    async def _http_error(self, request, exc):
        return _error_response(RequestError(str(exc.detail), status=exc.status_code,
                                            code="not_found" if exc.status_code == 404 else None))

    async def _internal_error(self, request, exc):
        return _error_response(RequestError(f"internal error: {type(exc).__name__}: {exc}", status=500,
                                            code="internal_error", kind="server_error"))

    # ---- routes ------------------------------------------------------------------------
    async def health(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "ok", "model": self.model_id, "method": self.worker.method,
                             "queued": self.worker.jobs.qsize(), "served": self.worker.served})

    async def models(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.started, "owned_by": "specrun"}
        ]})

    async def chat_completions(self, request):
        body = await read_json_body(request, self.http.max_body_bytes)
        return await self._complete(request, parse_chat_request(body, self.defaults, self.worker.n_ctx))

    async def completions(self, request):
        body = await read_json_body(request, self.http.max_body_bytes)
        return await self._complete(request, parse_completion_request(body, self.defaults, self.worker.n_ctx))

    async def _complete(self, request, parsed: CompletionRequest):
        if parsed.model not in self.http.model_names:
            raise RequestError(f"the model {parsed.model!r} is not served here; this server serves "
                               f"{self.model_id!r} (GET /v1/models)", "model", status=404, code="model_not_found")
        job = Job(parsed, asyncio.get_running_loop())
        self.worker.submit(job)
        try:
            first = await job.next_event(request.is_disconnected)  # queued: waits for the worker
        except BaseException:
            job.cancel()
            raise
        if isinstance(first, Failed):
            raise first.error
        if parsed.stream:
            from starlette.responses import StreamingResponse

            return StreamingResponse(self._sse(job, first), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._whole(request, job, first)

    async def _whole(self, request, job: Job, started: Started):
        from starlette.responses import JSONResponse

        texts = []
        try:
            while True:
                event = await job.next_event(request.is_disconnected)
                if isinstance(event, Delta):
                    texts.append(event.text)
                elif isinstance(event, Failed):
                    raise event.error
                elif isinstance(event, Done):
                    break
        finally:
            job.cancel()  # a no-op once Done; else the generation stops at its next pass
        text = "".join(texts)
        if job.request.is_chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": event.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": event.finish_reason}
        return JSONResponse({
            **self._header(job, chunk=False),
            "choices": [choice],
            "usage": usage_object(started, event.stats),
            "speculation": speculation_object(event.stats),
        })

    def _header(self, job: Job, chunk: bool) -> dict:
        chat = job.request.is_chat
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{job.id}", "object": kind, "created": job.created,
                "model": self.model_id, "system_fingerprint": None}

    def _chunk(self, job: Job, text: str | None, finish_reason: str | None, role: bool = False) -> dict:
        if job.request.is_chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._header(job, chunk=True), "choices": [choice]}

    async def _sse(self, job: Job, started: Started) -> AsyncIterator[str]:
        """Server-sent events: a chunk per stretch of text (with the tokens drafted in it),
        a last chunk with the finish reason and the speculation statistics, usage if asked,
        then [DONE]."""
        try:
            if job.request.is_chat:
                yield _sse_data(self._chunk(job, None, None, role=True))
            while True:
                event = await job.next_event()
                if isinstance(event, Delta):
                    chunk = self._chunk(job, event.text, None)
                    chunk["speculation"] = {"tokens": event.tokens, "from_draft": event.from_draft}
                    yield _sse_data(chunk)
                elif isinstance(event, Failed):
                    yield _sse_data(event.error.body())
                    break
                elif isinstance(event, Done):
                    last = self._chunk(job, None, event.finish_reason)
                    last["speculation"] = speculation_object(event.stats)
                    yield _sse_data(last)
                    if job.request.include_usage:
                        yield _sse_data({**self._header(job, chunk=True), "choices": [],
                                         "usage": usage_object(started, event.stats)})
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()  # a client gone mid-stream: the generation stops at its next pass


def _sse_data(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _error_response(error: RequestError):
    from starlette.responses import JSONResponse

    headers = {"Connection": "close"} if error.status == 413 else None  # the rest of the body is never read
    if error.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


# ---- running it ------------------------------------------------------------------------------
def bind(host: str, port: int) -> socket.socket:
    """A listening socket for ``host:port`` (port 0: any free one), or a UsageError saying why not."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                         "pick another --port (or --host)") from None
    sock.set_inheritable(True)
    return sock


class _Terminated(Exception):
    """SIGTERM, raised once uvicorn has shut down (it re-raises the signals it caught)."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated()


def serve(pair: PairOptions, http: HttpOptions, defaults: ServeDefaults, log: Callable[[str], None]) -> None:
    """Load the pair, then serve until Ctrl-C or SIGTERM; ``log`` gets a line when it is
    listening (with the base URL) and one per answer. Either signal ends it normally: the
    requests in flight get a few seconds, then the pair is closed (what the runs learned kept)."""
    import dataclasses
    import signal

    import uvicorn

    sock = bind(http.host, http.port)  # before loading: a port in use fails at once
    if not is_loopback(http.host) and http.api_key is None:  # once bound: a host that cannot be is one error line
        log(f"warning: --host {http.host} lets anyone who can reach this machine use the server, which has "
            "no authentication; set --api-key (or SPECRUN_API_KEY) to require a key")
    worker = PairWorker(pair, max_queue=http.max_queue, log=log)
    previous_sigterm = None
    if threading.current_thread() is threading.main_thread():
        previous_sigterm = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        worker.start()
        names = http.model_names or (pair.target,)
        server = OpenAIServer(worker, dataclasses.replace(http, model_names=names), defaults)
        config = uvicorn.Config(server.app(), log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS)
        sock.listen(socket.SOMAXCONN)  # connections from now on wait in the backlog until uvicorn takes them
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        log(f"specrun serve: {names[0]} (method {worker.method}) on http://{shown}:{port}/v1; Ctrl-C stops")
        uvicorn.Server(config).run(sockets=[sock])
    except (KeyboardInterrupt, _Terminated):
        log("specrun serve: stopped")
    finally:
        sock.close()
        worker.stop()
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
