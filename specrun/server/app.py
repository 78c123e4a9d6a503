"""``specrun serve``: one loaded pair behind an OpenAI-compatible HTTP API.

Layout. HTTP requests are read and validated on the event loop (uvicorn + starlette;
requests.py), then queue as ``Job``s for the one worker thread that owns the pair
(worker.py), first come first served; each answer comes back as the job's events and
goes out as an OpenAI response object, whole or as server-sent events. This module holds
the routes (``OpenAIServer``), the response objects and the running of it all (``serve``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import ipaddress
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from specrun.engine.loop import check_bias
from specrun.engine.stats import Stats
from specrun.errors import UsageError, cannot_listen
from specrun.fileio import json_problem
from specrun.sampling import MAX_SEED
from specrun.server.connections import QuietAcceptErrors, connection_cap, guarded_protocol
from specrun.server.requests import (
    CompletionRequest,
    RequestError,
    ServeDefaults,
    invalid_value,
    parse_chat_request,
    parse_completion_request,
)
from specrun.server.worker import (
    DEFAULT_MAX_QUEUE,
    Calls,
    ClientGone,
    Delta,
    Done,
    Failed,
    Job,
    PairOptions,
    PairWorker,
    Started,
    TOOL_CALLS,
)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
GRACEFUL_SHUTDOWN_SECONDS = 3
FINAL_EVENT_SECONDS = 2.0  # after a forced shutdown, the moment a stream has to send its last event


# ---- HTTP ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class HttpOptions:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_queue: int = DEFAULT_MAX_QUEUE
    # the names requests may give in ``model`` (--alias's, then --target's); the first is listed
    model_names: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()  # --cors: web pages (origins) whose scripts may call the server; "*" any


def speculation_object(stats: Stats) -> dict:
    """What speculation did for one answer: the CLI's --json statistics."""
    return stats.to_dict()


def usage_object(started: Started, done: Done | Sequence[Done]) -> dict:
    """OpenAI's usage of an answer, or of the n answers of one request: the prompt counted once (as
    OpenAI counts it; ``started``: the first answer's), the answers' tokens summed."""
    dones = [done] if isinstance(done, Done) else list(done)
    new_tokens = sum(each.stats.new_tokens for each in dones)
    return {
        "prompt_tokens": started.prompt_tokens,
        "completion_tokens": new_tokens,
        "total_tokens": started.prompt_tokens + new_tokens,
        "prompt_tokens_details": {"cached_tokens": started.reused_tokens},
        "completion_tokens_details": {"reasoning_tokens": sum(each.reasoning_tokens for each in dones)},
    }


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# A body Content-Length declares over --max-body but under this is read and dropped before the 413:
# a client that sends its whole body before it reads (Python's http.client, httpx, the openai
# SDK) otherwise meets a reset connection, not the answer. A larger one is refused at once.
DRAIN_BYTES = 64 * 1024 * 1024


async def read_json_body(request, limit: int) -> dict:
    """The request's JSON object, refused (413) once it is known to exceed ``limit`` bytes: from
    Content-Length, else while it streams in (chunked); its body up to DRAIN_BYTES read and dropped
    first, so that a client sending it whole before it reads gets the answer, not a reset."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):  # read as it is, a compressed body would be "not JSON"
        raise RequestError(f"Content-Encoding {encoding} is not supported: send the body uncompressed", status=415,
                           code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise RequestError("Content-Length is not a number", code="invalid_header")
    from starlette.requests import ClientDisconnect

    if declared is not None and int(declared) > limit:
        if int(declared) <= DRAIN_BYTES:
            try:
                async for _ in request.stream():
                    pass
            except ClientDisconnect:
                pass  # gone: the answer goes nowhere
        raise _too_large(limit)

    chunks, size = [], 0
    stream = request.stream().__aiter__()
    try:
        while True:
            try:  # past the limit, read on and dropped while the client keeps sending (as a declared
                # length is), so that one sending its whole body first reads the 413, not a reset
                chunk = await asyncio.wait_for(stream.__anext__(), DRAIN_IDLE_S if chunks is None else None)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:  # a client waiting for the answer mid-body gets it now
                raise _too_large(limit) from None
            size += len(chunk)
            if size > DRAIN_BYTES:  # past what is worth reading: refused at once
                raise _too_large(limit)
            if size > limit:
                chunks = None
            elif chunks is not None:
                chunks.append(chunk)
    except ClientDisconnect:  # the connection closed before the body was whole
        if chunks is None:
            raise _too_large(limit) from None
        raise ClientGone("a client left before sending its whole request; dropped") from None
    if chunks is None:
        raise _too_large(limit)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise RequestError(f"the request body is not valid JSON: {json_problem(exc)}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", code="invalid_type")
    return body


DRAIN_IDLE_S = 1.0  # a chunked body past the limit: read on while chunks come this often


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
            Route("/metrics", self._endpoint(self.metrics), methods=["GET"]),
            Route("/v1/models", self._endpoint(self.models), methods=["GET"]),
            Route("/v1/models/{model:path}", self._endpoint(self.model), methods=["GET"]),
            Route("/v1/chat/completions", self._endpoint(self.chat_completions), methods=["POST"]),
            Route("/v1/completions", self._endpoint(self.completions), methods=["POST"]),
            Route("/v1/responses", self._endpoint(self.responses), methods=["POST"]),
            # llama-server's own, which editors' plugins call (server/native.py)
            Route("/completion", self._endpoint(self.native_completion), methods=["POST"]),
            Route("/completions", self._endpoint(self.native_completion), methods=["POST"]),
            Route("/infill", self._endpoint(self.infill), methods=["POST"]),
            Route("/props", self._endpoint(self.props), methods=["GET"]),
            Route("/tokenize", self._endpoint(self.tokenize), methods=["POST"]),
            Route("/detokenize", self._endpoint(self.detokenize), methods=["POST"]),
            Route("/apply-template", self._endpoint(self.apply_template), methods=["POST"]),
        ]
        handlers = {HTTPException: self._http_error, Exception: self._internal_error}
        middleware = []
        if self.http.cors_origins:  # a browser's chat page: its preflight OPTIONS answered, its origin allowed
            from starlette.middleware import Middleware
            from starlette.middleware.cors import CORSMiddleware

            # a hosted page calling 127.0.0.1 asks leave to reach a private network first (Chromium)
            middleware.append(Middleware(CORSMiddleware, allow_origins=list(self.http.cors_origins),
                                         allow_methods=["GET", "POST"], allow_headers=["*"],
                                         allow_private_network=True))
        return Starlette(routes=routes, exception_handlers=handlers, middleware=middleware)

    # ---- plumbing ----------------------------------------------------------------------
    def _endpoint(self, handler):
        """Bearer auth (with --api-key) and RequestError as an OpenAI error response."""

        async def endpoint(request):
            try:
                self._check_origin(request)
                self._authorize(request)
                return await handler(request)
            except RequestError as exc:
                self._log_refusal(request, exc)
                return _error_response(exc)
            except ClientGone as gone:
                from starlette.responses import Response

                if gone.args:  # said where it was raised; a job's own departure the worker logs
                    self.worker.log(gone.args[0])
                return Response(status_code=499)  # nobody reads it: the client has gone

        return endpoint

    def _check_origin(self, request) -> None:
        """A browser's request from a web page (its Origin) that --cors does not name: 403. A page
        may POST text/plain to any server without asking first, so without this every web page a
        user opened could run generations here. Pages of this machine (localhost, 127.0.0.1,
        [::1]) and apps' own schemes (vscode-webview://, app://) are let in."""
        origin = request.headers.get("origin")
        if origin is None or "*" in self.http.cors_origins or origin in self.http.cors_origins:
            return
        scheme, _, rest = origin.partition("://")
        host = rest.rsplit(":", 1)[0] if not rest.startswith("[") else rest.split("]")[0] + "]"
        if scheme not in ("http", "https") and rest:  # an app's own page, not a web site
            return
        if scheme in ("http", "https") and is_loopback(host):
            return
        raise RequestError(f"a web page of origin {origin!r} may not call this server; start it with --cors "
                           f"{origin} to let that page", status=403, code="origin_not_allowed")

    def _authorize(self, request) -> None:
        key = self.http.api_key
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise RequestError("missing or wrong API key: send the header Authorization: Bearer KEY", status=401,
                               code="invalid_api_key")

    def _log_refusal(self, request, error: RequestError) -> None:
        """One line a refused request: an editor's client may show no error body, so the one
        running the server sees why here."""
        if error.status == 429:  # a full queue under load: /metrics counts them, a line each would flood
            return
        where = f" ({error.param})" if error.param else ""
        line = f"refused {request.method} {request.url.path}: {error.status}{where} {error.message}"
        self.worker.log(_shown_to_operator(line))

    async def _http_error(self, request, exc):
        codes = {404: "not_found", 405: "method_not_allowed"}
        error = RequestError(str(exc.detail), status=exc.status_code, code=codes.get(exc.status_code))
        self._log_refusal(request, error)
        response = _error_response(error)
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response

    async def _internal_error(self, request, exc):
        return _error_response(RequestError(f"internal error: {type(exc).__name__}: {exc}", status=500,
                                            code="internal_error", kind="server_error"))

    # ---- routes ------------------------------------------------------------------------
    async def health(self, request):
        from starlette.responses import JSONResponse

        state = {"status": "ok", "queued": self.worker.jobs.qsize(), "served": self.worker.served}
        if self.http.api_key is None:  # open to anyone with a key set: then nothing of the model (its path)
            state |= {"model": self.model_id, "method": self.worker.method}
        return JSONResponse(state)

    async def metrics(self, request):
        from starlette.responses import Response

        from specrun.server.metrics import CONTENT_TYPE, render

        return Response(render(self.worker), media_type=CONTENT_TYPE)

    async def models(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [self._model_object()]})

    async def model(self, request):
        """GET /v1/models/{id} (the openai client's models.retrieve): the served model, else 404."""
        from starlette.responses import JSONResponse

        asked = request.path_params["model"]
        if asked not in self.http.model_names:
            raise RequestError(f"the model {asked!r} is not served here; this server serves {self.model_id!r}",
                               "model", status=404, code="model_not_found")
        return JSONResponse({**self._model_object(), "id": asked})

    def _model_object(self) -> dict:
        """OpenAI's model object, with the context a request's prompt and answer share (``meta``'s
        ``n_ctx``, where llama-server says it, and ``max_model_len``, where vLLM and SGLang do) so
        that a client can size max_tokens."""
        return {"id": self.model_id, "object": "model", "created": self.started, "owned_by": "specrun",
                "max_model_len": self.worker.n_ctx, "meta": {"n_ctx": self.worker.n_ctx}}

    # A request is checked on a thread: a grammar, schema or tool definition compiles in it (up to
    # seconds for a large one), and the event loop keeps serving everyone else meanwhile.
    async def chat_completions(self, request):
        body = await read_json_body(request, self.http.max_body_bytes)
        parsed = await asyncio.to_thread(parse_chat_request, body, self.defaults, self.worker.n_ctx)
        return await self._complete(request, parsed)

    async def completions(self, request):
        body = await read_json_body(request, self.http.max_body_bytes)
        parsed = await asyncio.to_thread(parse_completion_request, body, self.defaults, self.worker.n_ctx)
        return await self._complete(request, parsed)

    async def responses(self, request):
        """OpenAI's Responses API (server/responses.py): the chat request it amounts to, answered
        as a response object or its stream of events."""
        from starlette.responses import Response

        from specrun.server.responses import parse_responses_request

        body = await read_json_body(request, self.http.max_body_bytes)
        parsed, names = await asyncio.to_thread(parse_responses_request, body, self.defaults, self.worker.n_ctx)
        try:
            job, first = await self._started(request, parsed)
        except RequestError as exc:  # the worker's refusal (a prompt too long) names chat's field
            raise names.renamed(exc) from None
        echo = {key: body.get(key) for key in ("instructions", "metadata")} | {
            "max_output_tokens": body.get("max_output_tokens"), "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto", "text": body.get("text") or {"format": {"type": "text"}},
            "parallel_tool_calls": parsed.parallel_tool_calls, "temperature": parsed.sampling.temperature,
            "top_p": parsed.sampling.top_p}
        if parsed.stream:
            from starlette.responses import StreamingResponse

            return StreamingResponse(self._response_events(job, first, echo, names), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        thinking = []
        text, calls, logprobs, event = await self._collected(request, job, names.renamed, thinking)
        # ASCII JSON: the echoed fields are the client's (metadata, tools), unchecked, and a lone
        # surrogate in them has no UTF-8 (a 500 after the whole answer); escaped, it is valid JSON
        return Response(json.dumps(self._response_object(job, echo, text, calls, first, event, logprobs=logprobs,
                                                         thinking="".join(thinking))),
                        media_type="application/json")

    def _response_object(self, job: Job, echo: dict, text: str | None, calls, started: Started,
                         done: Done | None, status: str | None = None, error: dict | None = None,
                         logprobs=(), thinking: str = "") -> dict:
        """A response object: in progress (``done`` None), or finished with its output items (the
        thinking first, where the model thought)."""
        from specrun.server.responses import call_item, logprob_items, message_item, reasoning_item, usage

        output = []
        cut = done is not None and done.finish_reason == "length"
        if done is not None:
            if thinking:
                output.append(reasoning_item(f"rs_{job.id}", thinking, done=True))
            if text or not calls:
                output.append(message_item(f"msg_{job.id}", text or "", done=True, cut=cut,
                                           logprobs=logprob_items(logprobs)))
            output += [call_item(f"fc_{job.id}_{index}", call, done=True) for index, call in enumerate(calls)]
        state = status or ("in_progress" if done is None else "incomplete" if cut else "completed")
        answer = {"id": f"resp_{job.id}", "object": "response", "created_at": job.created, "status": state,
                  "model": job.request.model, "output": output, "error": error,
                  "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                  "store": False, "truncation": "disabled", **echo,
                  "usage": None if done is None else usage(started.prompt_tokens, started.reused_tokens,
                                                           done.stats.new_tokens, done.reasoning_tokens)}
        if done is not None:
            answer["speculation"] = speculation_object(done.stats)
        return answer

    async def _response_events(self, job: Job, started: Started, echo: dict, names) -> AsyncIterator[str]:
        """The Responses API's semantic events: created, in progress, the message's text as it
        comes (its item and part opened at the first text), each call whole, then completed (or
        incomplete at max_output_tokens; failed, with the error, where the answer could not end)."""
        from specrun.server.responses import call_item, logprob_items, message_item, reasoning_item

        sequence = 0
        message_id, reasoning_id = f"msg_{job.id}", f"rs_{job.id}"

        def sent(kind: str, **fields) -> str:
            nonlocal sequence
            sequence += 1
            payload = {"type": kind, "sequence_number": sequence - 1, **fields}
            return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"  # ASCII: as the whole answer's

        texts, opened, calls, logprobs = [], False, (), []
        thinking, thought_open = [], False  # the reasoning item's text, and whether it is still open
        message_at = 0  # the message's output_index: 1 after a reasoning item

        def thought_closed():
            text = "".join(thinking)
            yield sent("response.reasoning_text.done", item_id=reasoning_id, output_index=0, content_index=0,
                       text=text)
            yield sent("response.output_item.done", output_index=0, item=reasoning_item(reasoning_id, text, True))

        try:
            shell = self._response_object(job, echo, None, (), started, None)
            yield sent("response.created", response=shell)
            yield sent("response.in_progress", response=shell)
            while True:
                event = await job.next_event()
                if isinstance(event, Delta) and event.reasoning:
                    if not thinking:
                        thought_open, message_at = True, 1
                        yield sent("response.output_item.added", output_index=0,
                                   item=reasoning_item(reasoning_id, "", done=False))
                    thinking.append(event.reasoning)
                    yield sent("response.reasoning_text.delta", item_id=reasoning_id, output_index=0,
                               content_index=0, delta=event.reasoning)
                if isinstance(event, Delta) and event.text:
                    if thought_open:
                        thought_open = False
                        for line in thought_closed():
                            yield line
                    if not opened:
                        opened = True
                        yield sent("response.output_item.added", output_index=message_at,
                                   item=message_item(message_id, "", done=False))
                        yield sent("response.content_part.added", item_id=message_id, output_index=message_at,
                                   content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                          "logprobs": []})
                    texts.append(event.text)
                    logprobs.extend(event.logprobs)
                    yield sent("response.output_text.delta", item_id=message_id, output_index=message_at,
                               content_index=0, delta=event.text, logprobs=logprob_items(event.logprobs),
                               speculation={"tokens": event.tokens, "from_draft": event.from_draft})
                elif isinstance(event, Delta):  # no text: its tokens' logprobs (a stop string's tail held)
                    logprobs.extend(event.logprobs)
                elif isinstance(event, Calls):
                    calls = event.calls  # each with its id (ToolStyle.parse gives them)
                elif isinstance(event, Failed):  # OpenAI's codes: a request's fault, or the server's
                    error = names.renamed(event.error)
                    failed = self._response_object(job, echo, None, (), started, None, status="failed", error={
                        "code": "server_error" if error.status >= 500 else "invalid_prompt",
                        "message": error.message, "specrun_code": error.code, "param": error.param})
                    yield sent("response.failed", response=failed)
                    break
                elif isinstance(event, Done):
                    text, cut = "".join(texts), event.finish_reason == "length"
                    if thought_open:
                        for line in thought_closed():
                            yield line
                    if opened or not calls:
                        if not opened:  # an empty answer: its message, opened and closed
                            yield sent("response.output_item.added", output_index=message_at,
                                       item=message_item(message_id, "", done=False))
                            yield sent("response.content_part.added", item_id=message_id, output_index=message_at,
                                       content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                              "logprobs": []})
                        item = message_item(message_id, text, done=True, cut=cut, logprobs=logprob_items(logprobs))
                        yield sent("response.output_text.done", item_id=message_id, output_index=message_at,
                                   content_index=0, text=text, logprobs=item["content"][0]["logprobs"])
                        yield sent("response.content_part.done", item_id=message_id, output_index=message_at,
                                   content_index=0, part=item["content"][0])
                        yield sent("response.output_item.done", output_index=message_at, item=item)
                    first_call = message_at + (1 if (opened or not calls) else 0)
                    for index, call in enumerate(calls):
                        item_id, at = f"fc_{job.id}_{index}", first_call + index
                        yield sent("response.output_item.added", output_index=at,
                                   item=call_item(item_id, call, done=False))
                        yield sent("response.function_call_arguments.delta", item_id=item_id, output_index=at,
                                   delta=call.arguments)
                        yield sent("response.function_call_arguments.done", item_id=item_id, output_index=at,
                                   arguments=call.arguments, name=call.name)
                        yield sent("response.output_item.done", output_index=at, item=call_item(item_id, call, True))
                    final = self._response_object(job, echo, text, calls, started, event, logprobs=logprobs,
                                                  thinking="".join(thinking))
                    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
                    yield sent(kind, response=final)
                    break
        finally:
            job.cancel()  # a client gone mid-stream: the generation stops at its next pass

    async def props(self, request):
        """llama-server's GET /props, which its clients read the context and the slots from."""
        from starlette.responses import JSONResponse

        from specrun import __version__
        from specrun.server.native import props_object

        return JSONResponse(props_object(self.worker, self.model_id, self.defaults, f"specrun {__version__}"))

    async def tokenize(self, request):
        """llama-server's /tokenize: text as the loaded model's token ids."""
        from specrun.server.native import tokenize_answer

        return await self._with_tokenizer(request, tokenize_answer)

    async def detokenize(self, request):
        """llama-server's /detokenize: token ids as the text they spell."""
        from specrun.server.native import detokenize_answer

        return await self._with_tokenizer(request, detokenize_answer)

    async def apply_template(self, request):
        """llama-server's /apply-template: a conversation as the prompt the model's template makes of it."""
        from starlette.responses import JSONResponse

        from specrun.server.native import template_answer

        body = await read_json_body(request, self.http.max_body_bytes)
        return JSONResponse(await asyncio.to_thread(template_answer, self.worker.session, body, self.defaults,
                                                    self.worker.n_ctx))

    async def _with_tokenizer(self, request, answer):
        """``answer(target, body)`` on a thread, beside the worker: tokenizing only reads the model
        (MLX's tokenizer is locked, backends/mlx.py)."""
        from starlette.responses import JSONResponse

        body = await read_json_body(request, self.http.max_body_bytes)
        return JSONResponse(await asyncio.to_thread(answer, self.worker.session.target, body))

    async def native_completion(self, request):
        """llama-server's /completion: text after a prompt, in its answer's shape."""
        return await self._native(request, infill=False)

    async def infill(self, request):
        """llama-server's /infill: a fill at an editor's cursor, with chunks of its other files."""
        return await self._native(request, infill=True)

    async def _native(self, request, infill: bool):
        from starlette.responses import JSONResponse, StreamingResponse

        from specrun.server.native import answer_object, parse_native_request, picked

        body = await read_json_body(request, self.http.max_body_bytes)
        parsed, fields = await asyncio.to_thread(parse_native_request, body, self.defaults, self.worker.n_ctx,
                                                 self.model_id, infill)
        job, first = await self._started(request, parsed)
        if parsed.stream:
            return StreamingResponse(self._native_events(job, first, fields), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, _, probabilities, event = await self._collected(request, job)
        return JSONResponse(picked(answer_object(self.model_id, parsed, text, first, event,
                                                 probabilities=probabilities), fields))

    async def _native_events(self, job: Job, started: Started, fields) -> AsyncIterator[str]:
        """llama-server's stream: a chunk per stretch of text, then the answer's last object
        (``stop``: true; only the fields asked for), and no [DONE]."""
        from specrun.server.native import answer_object, chunk_object, picked

        predicted, new_line = 0, False
        try:
            while True:
                event = await job.next_event()
                if isinstance(event, Delta):
                    predicted += event.tokens
                    new_line = new_line or "\n" in event.text
                    yield _sse_data(chunk_object(event.text, predicted, started, event.logprobs,
                                                 job.request.post_sampling))
                elif isinstance(event, Failed):
                    yield _sse_data(event.error.body())
                    break
                elif isinstance(event, Done):
                    last = answer_object(self.model_id, job.request, "", started, event, new_line=new_line)
                    yield _sse_data(picked(last, fields))
                    break
        finally:
            job.cancel()  # a client gone mid-stream: the generation stops at its next pass

    async def _started(self, request, parsed: CompletionRequest) -> tuple[Job, Started]:
        """The request queued and begun (its prompt read): the job and its Started event."""
        (job,), first = await self._queued(request, [parsed])
        return job, first

    async def _queued(self, request, requests: list[CompletionRequest]) -> tuple[list[Job], Started]:
        """The requests (one request's answers) queued all together, or none, and the first begun (its
        prompt read): the jobs and the first's Started event; the others' come in their own events.
        A request that names no model is answered by the loaded one, as llama-server answers it."""
        jobs = []
        for parsed in requests:
            if parsed.model is None:
                parsed = dataclasses.replace(parsed, model=self.model_id)
            if parsed.model not in self.http.model_names:
                raise RequestError(f"the model {parsed.model!r} is not served here; this server serves "
                                   f"{self.model_id!r} (GET /v1/models)", "model", status=404, code="model_not_found")
            jobs.append(Job(parsed, asyncio.get_running_loop()))
        self.worker.submit_all(jobs)
        try:
            first = await jobs[0].next_event(request.is_disconnected)  # queued: waits for the worker
        except BaseException:
            for job in jobs:
                job.cancel()
            raise
        if isinstance(first, Failed):
            for job in jobs:
                job.cancel()
            raise first.error
        return jobs, first

    async def _complete(self, request, parsed: CompletionRequest):
        if parsed.n > self.http.max_queue:
            raise invalid_value("n", f"at most {self.http.max_queue} answers a request here (the server's "
                                     f"--max-queue), got {parsed.n}")
        # n answers: each a generation of its own (choice i drawn with seed + i where a seed is given)
        requests = [parsed] if parsed.n == 1 else [
            dataclasses.replace(parsed, n=1, sampling=dataclasses.replace(parsed.sampling, seed=(
                None if parsed.sampling.seed is None else (parsed.sampling.seed + index) % (MAX_SEED + 1))))
            for index in range(parsed.n)]
        jobs, first = await self._queued(request, requests)
        if parsed.stream:
            from starlette.responses import StreamingResponse

            return StreamingResponse(self._sse(jobs, first), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._whole(request, jobs, first)

    @staticmethod
    async def _collected(request, job: Job, renamed=None,
                         thinking: list | None = None) -> tuple[str, tuple, list, Done]:
        """A whole answer's text, calls, logprobs and end; a failure raised (``renamed``: named as
        the endpoint's client wrote the field). ``thinking``: gets the answer's thinking, where read apart."""
        texts, calls, logprobs = [], (), []
        try:
            while True:
                event = await job.next_event(request.is_disconnected)
                if isinstance(event, Delta):
                    texts.append(event.text)
                    logprobs.extend(event.logprobs)
                    if thinking is not None and event.reasoning:
                        thinking.append(event.reasoning)
                elif isinstance(event, Calls):
                    calls = event.calls
                elif isinstance(event, Failed):
                    raise event.error if renamed is None else renamed(event.error)
                elif isinstance(event, Done):
                    return "".join(texts), calls, logprobs, event
        finally:
            job.cancel()  # a no-op once Done; else the generation stops at its next pass

    async def _whole(self, request, jobs: list[Job], started: Started):
        from starlette.responses import JSONResponse

        try:
            if len(jobs) == 1:
                answers = [await self._choice(request, jobs[0], 0)]
            else:  # one failing cancels the others' waits at once
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(self._choice(request, job, index)) for index, job in enumerate(jobs)]
                answers = [task.result() for task in tasks]
        except BaseExceptionGroup as group:  # the first failure, as one answer's would be raised
            raise group.exceptions[0] from None
        finally:
            for job in jobs:
                job.cancel()  # one failed: the others stop at their next pass
        choices, dones = [choice for choice, _ in answers], [done for _, done in answers]
        response = {**self._header(jobs[0], chunk=False), "choices": choices, "usage": usage_object(started, dones)}
        if len(jobs) == 1:
            response["speculation"] = speculation_object(dones[0].stats)
        else:  # what speculation did for each answer, beside it
            for choice, done in zip(choices, dones):
                choice["speculation"] = speculation_object(done.stats)
        return JSONResponse(response)

    async def _choice(self, request, job: Job, index: int) -> tuple[dict, Done]:
        """One whole answer as a choice of the response, and its end."""
        thinking = []
        text, calls, logprobs, event = await self._collected(request, job, thinking=thinking)
        if job.request.is_chat:
            message = {"role": "assistant", "content": text or (None if calls else "")}
            if thinking:  # as llama-server: present where the model thought
                message["reasoning_content"] = "".join(thinking)
            if calls and job.request.legacy_functions:  # the older form: one call
                message["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
            elif calls:
                message["tool_calls"] = [call.as_openai() for call in calls]
            choice = {"index": index, "message": message, "logprobs": self._logprobs(job, logprobs),
                      "finish_reason": _finish_reason(job, event.finish_reason)}
        else:
            choice = {"index": index, "text": text, "logprobs": self._logprobs(job, logprobs),
                      "finish_reason": event.finish_reason}
        return choice, event

    @staticmethod
    def _logprobs(job: Job, entries, start: int = 0) -> dict | None:
        """The tokens' log-probabilities in OpenAI's shape for the endpoint (None where not asked);
        ``start``: where in the answer's text the first token stands (a stream's later chunks)."""
        if job.request.logprobs is None:
            return None
        if job.request.is_chat:
            def shown(choice):
                return {"token": choice.text, "logprob": choice.logprob, "bytes": list(choice.bytes)}

            return {"content": [{**shown(token), "top_logprobs": [shown(other) for other in top]}
                                for token, top in entries]}
        offsets, at = [], start
        for token, _ in entries:
            offsets.append(at)
            at += len(token.text)
        return {"tokens": [token.text for token, _ in entries],
                "token_logprobs": [token.logprob for token, _ in entries],
                "top_logprobs": [{other.text: other.logprob for other in top} for _, top in entries],
                "text_offset": offsets}

    def _header(self, job: Job, chunk: bool) -> dict:
        chat = job.request.is_chat
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{job.id}", "object": kind, "created": job.created,
                "model": job.request.model, "system_fingerprint": None}  # the name asked (--alias's or --target's)

    def _chunk(self, job: Job, text: str | None, finish_reason: str | None, role: bool = False,
               thinking: str = "", index: int = 0) -> dict:
        if job.request.is_chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            if thinking:
                delta = {"reasoning_content": thinking, **({"content": text} if text else {})}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        chunk = {**self._header(job, chunk=True), "choices": [choice]}
        if job.request.include_usage:  # OpenAI's every chunk but the usage one: a null usage field
            chunk["usage"] = None
        return chunk

    async def _sse(self, jobs: list[Job], started: Started) -> AsyncIterator[str]:
        """Server-sent events: a chunk per stretch of text (with the tokens drafted in it), a last
        chunk with the finish reason and the speculation statistics, for each of the answers asked
        (n: their chunks interleaved as they come, each with its choice's index), usage if asked
        (summed), then [DONE]."""
        job = jobs[0]
        offsets = [0] * len(jobs)  # characters of text each answer's chunks spelled so far (text_offset)
        dones: dict[int, Done] = {}
        try:
            if job.request.is_chat:
                for index in range(len(jobs)):
                    yield _sse_data(self._chunk(job, None, None, role=True, index=index))
            async with contextlib.aclosing(_merged(jobs)) as events:
                async for index, event in events:
                    answer = jobs[index]
                    if isinstance(event, Delta):
                        chunk = self._chunk(job, event.text, None, thinking=event.reasoning, index=index)
                        chunk["choices"][0]["logprobs"] = self._logprobs(answer, event.logprobs, offsets[index])
                        offsets[index] += sum(len(token.text) for token, _ in event.logprobs)
                        chunk["speculation"] = {"tokens": event.tokens, "from_draft": event.from_draft}
                        yield _sse_data(chunk)
                    elif isinstance(event, Calls):  # each call whole, as one delta of its own
                        for number, call in enumerate(event.calls):
                            chunk = self._chunk(job, None, None, index=index)
                            if answer.request.legacy_functions:  # the older form: the first call alone
                                chunk["choices"][0]["delta"] = {"function_call": {"name": call.name,
                                                                                  "arguments": call.arguments}}
                                yield _sse_data(chunk)
                                break
                            chunk["choices"][0]["delta"] = {"tool_calls": [{"index": number, **call.as_openai()}]}
                            yield _sse_data(chunk)
                    elif isinstance(event, Failed):
                        yield _sse_data(event.error.body())
                        break
                    elif isinstance(event, Done):
                        last = self._chunk(job, None, _finish_reason(answer, event.finish_reason), index=index)
                        last["speculation"] = speculation_object(event.stats)
                        yield _sse_data(last)
                        dones[index] = event
                        if len(dones) == len(jobs):
                            if job.request.include_usage:
                                yield _sse_data({**self._header(job, chunk=True), "choices": [],
                                                 "usage": usage_object(started, [dones[i] for i in range(len(jobs))])})
                            break
            yield "data: [DONE]\n\n"
        finally:
            for answer in jobs:
                answer.cancel()  # a client gone mid-stream: the generations stop at their next pass


async def _merged(jobs: list[Job]) -> AsyncIterator[tuple[int, object]]:
    """The events of several answers as they come, each with its answer's index (one answer: its
    own, in order); each answer's events end at its Done or Failed."""
    if len(jobs) == 1:
        while True:
            yield 0, await jobs[0].next_event()
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, job: Job) -> None:
        while True:
            event = await job.next_event()
            await queue.put((index, event))
            if isinstance(event, (Done, Failed)):
                return

    tasks = [asyncio.create_task(pump(index, job)) for index, job in enumerate(jobs)]
    try:
        while True:
            yield await queue.get()
    finally:
        for task in tasks:
            task.cancel()


LOGGED_CHARACTERS = 300  # of a refusal's line: the client's text in it (a path, a field's name) is cut there


def _shown_to_operator(line: str) -> str:
    """A log line quoting a client's text: control characters escaped (an escape sequence for the
    operator's terminal, a newline faking a line of its own), cut to LOGGED_CHARACTERS."""
    shown = "".join(char if char.isprintable() else repr(char)[1:-1] for char in line)
    return shown if len(shown) <= LOGGED_CHARACTERS else shown[: LOGGED_CHARACTERS - 1] + "…"


def _finish_reason(job: Job, reason: str) -> str:
    """A chat answer's finish reason as the request's form says it: OpenAI's older functions end a
    call with "function_call"."""
    return "function_call" if reason == TOOL_CALLS and job.request.legacy_functions else reason


def _sse_data(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _error_response(error: RequestError):
    from starlette.responses import Response

    headers = {"Connection": "close"} if error.status == 413 else None  # the rest of the body is never read
    if error.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    if error.retry_after is not None:
        headers = {"Retry-After": str(error.retry_after)}
    # ASCII JSON: an error may quote the client's text, and a lone surrogate in it (a field's name)
    # has no UTF-8 (Starlette's JSONResponse failed there with a 500); escaped, it is valid JSON.
    return Response(json.dumps(error.body()), status_code=error.status, headers=headers,
                    media_type="application/json")


# ---- running it ------------------------------------------------------------------------------
def bind(host: str, port: int) -> socket.socket:
    """A listening socket for ``host:port`` (port 0: any free one), or one line saying why not: a
    port taken or forbidden is the machine's state (exit 1, as rpc-server's), a host that names no
    address of this machine a usage error (exit 2)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except UnicodeError:  # a name with an empty label or one past 63 characters (bad..x)
        raise UsageError(f"--host {host!r} is not a valid host name", "pass an address, or a name such as "
                         "localhost") from None
    except OSError as exc:
        raise cannot_listen(host, port, exc) from None
    sock.set_inheritable(True)
    return sock


def _server_class() -> type:
    """uvicorn.Server told of shutdown (made on first use: uvicorn is imported only to serve)."""
    import uvicorn

    class ServerFor(uvicorn.Server):
        """uvicorn's server, telling the worker when shutdown begins: the queued requests get a JSON
        503 at once, and the answer in progress a final event just before uvicorn's grace period
        ends (it cancelled them: a bare 500 and CancelledError tracebacks)."""

        def __init__(self, worker: PairWorker, config) -> None:
            super().__init__(config)
            self.worker = worker

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self.worker.refuse_queued()
            if self.force_exit:  # a second Ctrl-C: no grace period
                self.worker.end_current()

        async def shutdown(self, sockets=None) -> None:
            self.worker.refuse_queued()
            ending = asyncio.get_running_loop().call_later(max(GRACEFUL_SHUTDOWN_SECONDS - 1.0, 0.0),
                                                           self.worker.end_current)
            try:
                await super().shutdown(sockets)
            finally:
                ending.cancel()
            # A second Ctrl-C ends uvicorn's wait at once, and whatever still runs is cancelled as the
            # loop closes (a CancelledError traceback from a stream): the answer in progress was just
            # told to end (end_current), so give it a moment to send its final event and [DONE].
            running = [task for task in self.server_state.tasks if not task.done()]
            if running:
                await asyncio.wait(running, timeout=FINAL_EVENT_SECONDS)

    return ServerFor


class _Terminated(Exception):
    """SIGTERM, raised once uvicorn has shut down (it re-raises the signals it caught)."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated()


def serve(pair: PairOptions, http: HttpOptions, defaults: ServeDefaults, log: Callable[[str], None]) -> None:
    """Load the pair, then serve until Ctrl-C or SIGTERM; ``log`` gets a line when it is
    listening (with the base URL) and one per answer. Either signal ends it normally: the
    requests in flight get a few seconds, then the pair is closed (what the runs learned kept)."""
    import signal

    import uvicorn

    from specrun.backends.mlx_distributed import follower

    if follower():  # beside rank 0 under mlx.launch: this process holds a part of the target, no HTTP
        from specrun.registry.loading import open_pair

        open_pair(pair.target, None, pair.load)  # follows rank 0's target until rank 0 closes it
        return
    sock = bind(http.host, http.port)  # before loading: a port in use fails at once
    if not is_loopback(http.host) and http.api_key is None:  # once bound: a host that cannot be is one error line
        log(f"warning: --host {http.host} lets anyone who can reach this machine use the server, which has "
            "no authentication; set --api-key (or SPECRUN_API_KEY) to require a key")
    if "*" in http.cors_origins and http.api_key is None:
        log("warning: --cors * lets every web page the browser opens use the server and read its answers; "
            "set --api-key (or SPECRUN_API_KEY), or name the page's origin")
    worker = PairWorker(pair, max_queue=http.max_queue, log=log)
    quiet_accept = QuietAcceptErrors()
    previous_sigterm = None
    if threading.current_thread() is threading.main_thread():
        previous_sigterm = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        worker.start()
        check_bias(defaults.sampling, worker.session.target.vocab.size)  # --logit-bias, once the vocabulary is known
        names = http.model_names or (pair.target,)
        server = OpenAIServer(worker, dataclasses.replace(http, model_names=names), defaults)
        protocol = guarded_protocol(connection_cap(), log)  # past it: a JSON 503 and closed
        config = uvicorn.Config(server.app(), http=protocol, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS)
        logging.getLogger("asyncio").addFilter(quiet_accept)
        sock.listen(socket.SOMAXCONN)  # connections from now on wait in the backlog until uvicorn takes them
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        called = f" (model {', '.join(names[:-1])} too)" if len(names) > 1 else ""  # --alias
        log(f"specrun serve: {names[-1]}{called} (method {worker.method}) on http://{shown}:{port}/v1; Ctrl-C stops")
        _server_class()(worker, config).run(sockets=[sock])
    except (KeyboardInterrupt, _Terminated):
        log("specrun serve: stopped")
    finally:
        logging.getLogger("asyncio").removeFilter(quiet_accept)
        sock.close()
        worker.stop()
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
