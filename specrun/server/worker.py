"""The thread that owns the loaded pair, and the jobs it answers.

A single worker thread owns the pair: it loads the models, runs every generation and
closes them (MLX arrays belong to the thread that made them, and one thread means one KV
cache that nobody else touches). Requests queue as ``Job``s for it, first come first
served: the queue is the one lock. The worker sends each job's events (``Started``,
``Delta``, ``Done``, ``Failed``) back to its request through an asyncio queue.

With ``--parallel N`` (llama.cpp) the worker thread opens N slots on the loaded models
(sessions/slots.py) and N threads, itself one of them, take jobs from the same queue, each
answering with its slot's session; their passes meet in the slots' Rendezvous, which a
thread joins while it generates. A job goes to the idle slot whose cache holds most of its
prompt (server/dispatch.py): a conversation's next turn returns to the slot that holds it.

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
import codecs
import dataclasses
import json
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specrun.backends.kv import common_prefix_len
from specrun.backends.mlx_common import release_thread_streams
from specrun.drafters.lookahead import LookaheadSizes
from specrun.engine.events import Finished, TextChunk, TokenLogprob
from specrun.engine.loop import GenerationParams
from specrun.engine.passes import Verification
from specrun.engine.stats import Stats
from specrun.errors import ChatTemplateError, ContextFullError, ConversationRefusedError, SpecrunError
from specrun.grammar import Grammar, GrammarError
from specrun.registry.loading import LoadOptions
from specrun.server.dispatch import Jobs
from specrun.server.requests import (
    CompletionRequest, RequestError, check_token_ids, conversation_refused, forbids, invalid_value, with_bias_texts,
)
from specrun.sessions.reasoning import (
    ReasoningSplit, ThinkingTokens, budget_rule, closes_thinking, forbidden_forced, generation_prompt,
    grammar_after_thinking, opens_thinking, reasoning_split, shown_tags, thinking_tags,
)
from specrun.sessions.setup import TreeSettings, ctx_fix
from specrun.sessions.tools import ToolCall, ToolStyle, ToolTemplateError, render_conversation, style_for
from specrun.sessions.trace import RequestTrace, ServerTrace
from specrun.wording import count_of

DEFAULT_MAX_QUEUE = 64
DISCONNECT_POLL_SECONDS = 0.25


# ---- stop strings ---------------------------------------------------------------------
class _HeldLogprobs:
    """A request's token log-probabilities, each held until text it began goes out: a stop
    string's cut drops those of the tokens past it (the logprobs of " help" and " you" went out
    after an answer cut at "help"). A token's place is where its text begins in the answer."""

    def __init__(self) -> None:
        self._held: list[tuple[int, tuple]] = []  # (where its text begins, the entry)
        # characters the tokens' bytes decode to so far, as the answer's text is decoded (an invalid
        # byte is U+FFFD: counted in bytes, 1 against 3, every later token's place drifted)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._seen = 0
        self._out = 0  # characters of the answer the stop strings let through so far

    def add(self, entries) -> None:
        for entry in entries:
            self._held.append((self._seen, entry))
            self._seen += len(self._decoder.decode(entry[0].bytes))

    def passed(self, text: str) -> str:
        """``text`` as it passes the stop strings, counted."""
        self._out += len(text)
        return text

    def release(self, everything: bool = False) -> tuple:
        """The entries of the tokens whose text began inside what went out (``everything``: the
        answer ended without a stop string, all of them)."""
        count = len(self._held) if everything else sum(1 for start, _ in self._held if start < self._out)
        out, self._held = self._held[:count], self._held[count:]
        return tuple(entry for _, entry in out)


class StopCut:
    """Cuts streamed text before the first stop string, holding back what may begin one.

    Each stop string is matched by a Knuth-Morris-Pratt automaton fed every character once: the
    state is how much of the stop string the text's end spells, which is also how much to hold
    back. Its prefix function is built as far as the state has reached, never further: matching
    costs time linear in the text generated whatever the stop strings' length (a 1 MB stop
    string once held the server's only worker for 48 s of slicing)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._fallbacks: list[list[int]] = [[0] for _ in self.stops]  # each stop's prefix function, so far
        self._states = [0] * len(self.stops)  # per stop: the length of its prefix the text ends with
        self.held = ""
        self.stopped = False
        self.word = ""  # the stop string that stopped it

    def feed(self, text: str) -> str:
        """The text that can go out now; sets ``stopped`` (and ``word``) when a stop string appeared."""
        start = len(self.held)
        self.held += text
        first = None  # where the earliest stop string found begins in ``held``
        for index, (stop, fallback) in enumerate(zip(self.stops, self._fallbacks)):
            state = self._states[index]
            for offset, char in enumerate(text, start):
                while state and stop[state] != char:
                    state = fallback[state - 1]
                if stop[state] == char:
                    state += 1
                    if state > len(fallback):
                        _extend_prefix_function(fallback, stop)
                if state == len(stop):
                    begins = offset + 1 - len(stop)
                    if first is None or begins < first:
                        first, self.word = begins, stop
                    break
            self._states[index] = state
        if first is not None:
            out, self.held, self.stopped = self.held[:first], "", True
            return out
        keep = max(self._states, default=0)
        out = self.held[: len(self.held) - keep]
        self.held = self.held[len(out):]
        return out

    def flush(self) -> str:
        """What was held back, at the end of the answer: it began a stop string that never came."""
        out, self.held = self.held, ""
        self._states = [0] * len(self.stops)
        return out


class LineLimits:
    """llama-server's two limits on an editor's completion, applied to the text the stop strings
    let out. ``indent`` (n_indent): a line after the first that begins less indented than that
    (spaces and tabs counted; an empty line counts as none, as llama-server counts it) ends the
    answer at that line's first other character, its indentation kept as llama-server keeps it;
    the indentation is held back until that character decides. ``seconds`` (t_max_predict_ms):
    once generation has run that long, the answer ends at its next newline. ``stopped``:
    "indent" or "time" once one of them did."""

    def __init__(self, indent: int, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.indent = indent
        self.seconds = seconds
        self._clock = clock
        self._began: float | None = None  # the first text's arrival: generation's start, as seen here
        self._line_start = False  # a later line has begun and its indentation is being read
        self.held = ""
        self.stopped = ""

    def feed(self, text: str) -> str:
        if self._began is None:
            self._began = self._clock()
        out: list[str] = []
        for char in "" if self.stopped else text:
            if self._line_start:
                if char in " \t":
                    self.held += char
                    continue
                if len(self.held) < self.indent:
                    out.append(self.held)
                    self.held, self.stopped = "", "indent"
                    break
                out.append(self.held)
                self.held, self._line_start = "", False
            out.append(char)
            if char == "\n":
                if self.seconds and self._clock() - self._began > self.seconds:
                    self.stopped = "time"
                    break
                self._line_start = self.indent > 0
        return "".join(out)

    def flush(self) -> str:
        """The indentation held at the answer's end: a line that never began."""
        out, self.held = self.held, ""
        return out


def _extend_prefix_function(table: list[int], stop: str) -> None:
    """One more entry of KMP's table for ``stop``: for its prefix of len(table) + 1 characters, the
    length of the longest proper prefix that is also a suffix (where a partial match falls back
    to on a mismatch). Each entry needs only those before it."""
    i = len(table)
    length = table[-1]
    while length and stop[i] != stop[length]:
        length = table[length - 1]
    if stop[i] == stop[length]:
        length += 1
    table.append(length)


class ToolCallCut:
    """Streams an answer's content and keeps its tool calls back, to be read whole at the end.

    Content streams as it comes and everything from the style's opener on (Hermes'
    ``<tool_call>``, a ```` ```tool_code ```` block) is held. In a style whose calls may also
    begin the answer bare (Llama 3's JSON, Mistral's and the pythonic list: their openers are
    control tokens without text, or none), an answer that begins as a call could ("{", "[") is
    held whole. Text held that turns out not to be a call goes out as content at the end."""

    def __init__(self, style: ToolStyle, names: Sequence[str]) -> None:
        self.style = style
        self.names = tuple(names)  # the functions defined: JSON naming another is text
        self._opener = StopCut([style.opener])
        self._holding = None  # None until the answer's first visible character says
        self._text: list[str] = []
        self._sent = 0  # characters of the answer sent as content

    def feed(self, text: str) -> str:
        self._text.append(text)
        if self._holding is None:
            begun = "".join(self._text).lstrip()
            if not begun:
                return ""
            self._holding = begun[0] in self.style.bare_starts
            text = "".join(self._text)  # the whitespace waited on goes out with the rest
        if self._holding or self._opener.stopped:
            return ""
        out = self._opener.feed(text)
        self._sent += len(out)
        return out

    def finish(self, cut: bool = False) -> tuple[str, tuple[ToolCall, ...]]:
        """The content not sent yet, and the calls the answer made. ``cut``: the answer stopped at
        max_tokens, maybe inside a call: the calls whole before it count, and what was held of the
        call cut off (from its opener, or the part of the opener written) is dropped, not sent as
        content."""
        answer = "".join(self._text)
        content, calls = self.style.parse(answer, self.names)
        if not calls and cut:
            held = answer[self._sent:]
            if self._holding or self._opener.stopped:
                content, calls = self.style.parse_cut(answer, self.names)
            elif held.strip() and self.style.opener.startswith(held.strip()):
                return "", ()  # the opener's first characters, held back from the stream
        if calls or (cut and (self._holding or self._opener.stopped)):
            # streamed, the content went out before the call's opener; held whole, it goes now
            return ("" if self._sent else content), tuple(calls)
        return answer[self._sent:], ()


def _read_apart(split: ReasoningSplit | None, reasoning_format: str, text: str,
                end: bool = False) -> tuple[str, str]:
    """(thinking, content) of a stretch of a chat answer's text (``end``: the last, letting go of
    what the split held). "deepseek-legacy" keeps the thinking in the content too, as generated."""
    if split is None:
        return "", text
    thought, content = split.feed(text)
    if end:
        held_thought, held_content = split.finish()
        thought, content = thought + held_thought, content + held_content
    return thought, text if reasoning_format == "deepseek-legacy" else content


# ---- what the server has done, for /metrics ------------------------------------------------
class Metrics:
    """Counters of the answers served (written by the slots' threads, read by /metrics)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[str, int] = {}  # by finish reason; "error" for failed requests
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0  # of those, found in the slot's cache (not prefilled)
        self.new_tokens = 0
        self.steps = 0  # verify passes
        self.drafted = 0
        self.accepted = 0
        self.first_token_seconds = 0.0  # summed over answers: queued to first text
        self.first_tokens = 0
        self.answer_seconds = 0.0  # summed over answers: queued to done
        self.answers = 0
        self.refused: dict[str, int] = {}  # requests never answered, by why: "busy" (429), "shutting_down" (503)

    def refuse(self, why: str) -> None:
        with self._lock:
            self.refused[why] = self.refused.get(why, 0) + 1

    def started(self, reused: int) -> None:
        with self._lock:
            self.cached_prompt_tokens += reused

    def first_token(self, job: Job) -> None:
        with self._lock:
            self.first_token_seconds += time.monotonic() - job.queued_at
            self.first_tokens += 1

    def finished(self, job: Job, finish_reason: str, stats: Stats | None) -> None:
        with self._lock:
            self.requests[finish_reason] = self.requests.get(finish_reason, 0) + 1
            if stats is None:
                return
            self.answer_seconds += time.monotonic() - job.queued_at
            self.answers += 1
            self.prompt_tokens += stats.prompt_tokens
            self.new_tokens += stats.new_tokens
            self.steps += stats.steps
            self.drafted += stats.drafted
            self.accepted += stats.accepted

    def mean_answer_seconds(self) -> float:
        return self.answer_seconds / self.answers if self.answers else 1.0


# ---- the worker and its jobs ------------------------------------------------------------
@dataclass(frozen=True)
class Started:
    """Event: the prompt fits and generation begins; ``reused_tokens`` came from the cache."""

    prompt_tokens: int
    reused_tokens: int
    prompt_cut: bool = False  # a fill's parts were cut to their shares of the context (sessions/infill.fill_prompt)


@dataclass(frozen=True)
class TokenChoice:
    """A token with its log-probability, as a response shows it: its text and bytes."""

    text: str
    bytes: bytes
    logprob: float
    id: int  # the token's id (llama-server's completion_probabilities show it)


@dataclass(frozen=True)
class Delta:
    """Event: answer text, with the tokens produced since the last Delta and how many came from drafts;
    where the request asked, each token's log-probability and its likeliest alternatives'."""

    text: str
    tokens: int
    from_draft: int
    logprobs: tuple[tuple[TokenChoice, tuple[TokenChoice, ...]], ...] = ()
    reasoning: str = ""  # the model's thinking in this stretch (chat's reasoning_content), where read apart


@dataclass(frozen=True)
class Done:
    """Event: the answer ended ("stop" or "length", as OpenAI says); ``stopped_by`` says what
    ended it beyond that: "word" (the stop string ``stopping_word``), "indent" or "time"
    (LineLimits), "context" (the context was full); "" the end of text or max_tokens."""

    finish_reason: str
    stats: Stats
    stopped_by: str = ""
    stopping_word: str = ""
    reasoning_tokens: int = 0  # of stats.new_tokens, the thinking's (ThinkingTokens)


@dataclass(frozen=True)
class Calls:
    """Event, just before Done: the tool calls the answer made (OpenAI's finish_reason "tool_calls")."""

    calls: tuple[ToolCall, ...]


@dataclass(frozen=True)
class Failed:
    error: RequestError


JobEvent = Started | Delta | Calls | Done | Failed
# OpenAI's reasons (an answer its grammar stopped is a 400: PairWorker._grammar_failed)
_FINISH_REASONS = {"eos": "stop", "length": "length", "context": "length"}
TOOL_CALLS = "tool_calls"  # the finish reason of an answer that made calls


class Job:
    """One request waiting for, or being served by, the worker. Events reach the request's
    event loop (``next_event``); ``cancel`` stops the generation at its next verify pass."""

    def __init__(self, request: CompletionRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.id = uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.cancelled = threading.Event()
        self.queued_at = time.monotonic()
        self.prompt_ids: list[int] | None = None  # tokenized once, where a slot is chosen for it
        self.prompt_cut = False  # a fill's prompt was cut to fit the context
        self.opens_thinking = False  # a chat prompt whose generation prompt opened the thinking block
        self.closes_thinking = False  # ... or wrote a whole one (thinking off): no budget to count
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


def shutting_down() -> RequestError:
    return RequestError("the server is shutting down; send the request again once it is back", status=503,
                        code="server_shutting_down", kind="server_error")


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
    verification: Verification = field(default_factory=Verification)  # --verify, --accept: exact by default
    parallel: int | None = 1  # --parallel: requests decoded together, each in a slot of its own (None: auto)
    learn: Callable | None = None  # --learn: the heads' learner (sessions/heads.with_learner); None: none learn
    trace: ServerTrace | None = None  # --trace: every request's steps (sessions/trace.py); None: untraced


class PairWorker:
    """The thread that owns the loaded pair and answers jobs in arrival order: one at a time, or
    with ``pair.parallel`` slots up to that many together, each slot on a thread of its own whose
    passes the others' share (sessions/slots.py)."""

    def __init__(self, pair: PairOptions, max_queue: int = DEFAULT_MAX_QUEUE,
                 log: Callable[[str], None] | None = None) -> None:
        self.pair = pair
        self.parallel = pair.parallel or 1  # set once the pair is loaded where None
        self.log = log or (lambda line: None)
        # unbounded: submit keeps it to max_queue jobs; a job goes to the idle slot holding most of its prompt
        self.jobs: Jobs[Job] = Jobs(self.parallel, self._held_prompt if pair.parallel != 1 else None,
                                    self._tokenized if pair.parallel != 1 else None)
        self.max_queue = max_queue
        self._submitting = threading.Lock()
        self.session = None
        self.slots = None  # SlotSessions with parallel > 1
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="specrun-serve-worker", daemon=True)
        self._current: set[Job] = set()  # the jobs being answered
        self.metrics = Metrics()
        self.served = 0
        self.closing = False  # shutting down: new and queued requests are answered 503

    def start(self) -> None:
        """Load the pair on the worker thread; re-raises a loading failure here."""
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error

    @property
    def active(self) -> list[Job]:
        """The jobs being answered now."""
        return list(self._current)

    @property
    def n_ctx(self) -> int:
        return self.session.target.n_ctx

    @property
    def method(self) -> str:
        return self.session.method

    def submit(self, job: Job) -> None:
        self.submit_all([job])

    def submit_all(self, jobs: Sequence[Job]) -> None:
        """Queue the jobs (one request's answers) all together, or none: a 429 where the queue has
        no room for them all, a 503 shutting down."""
        if self.closing:
            self.metrics.refuse("shutting_down")
            raise shutting_down()
        with self._submitting:
            if self.jobs.qsize() + len(jobs) <= self.max_queue:
                for job in jobs:
                    self.jobs.put(job)
                return
        self.metrics.refuse("busy")
        # the queue drains at about one answer per slot per mean answer time
        wait = math.ceil(self.metrics.mean_answer_seconds() * self.max_queue / self.parallel)
        raise RequestError(f"the server is busy: {self.max_queue} requests are waiting already; retry later",
                           status=429, code="server_busy", kind="rate_limit_error", retry_after=max(1, min(wait, 600)))

    def refuse_queued(self) -> None:
        """Shutting down: every request still queued, and any that arrives, is answered with a
        JSON 503 at once (they were a bare 500 once the shutdown's grace period ran out)."""
        self.closing = True
        for job in self._take_queued():
            self.metrics.refuse("shutting_down")
            job.emit(Failed(shutting_down()))
            job.cancel()

    def end_current(self) -> None:
        """Shutting down, the grace period spent: the answers in progress end with a final event
        saying so (a stream gets it and [DONE]) instead of being cut off; they stop at their next pass."""
        self.refuse_queued()
        for current in list(self._current):
            if not current.cancelled.is_set():
                current.emit(Failed(shutting_down()))
                current.cancel()

    def stop(self) -> None:
        """Cancel what is queued or running, then close the pair on its thread."""
        for job in self._take_queued():
            job.cancel()
        for current in list(self._current):
            current.cancel()
        self.jobs.close()
        self._thread.join()

    def _take_queued(self) -> list[Job]:
        """Every job waiting in the queue, taken out of it."""
        return self.jobs.take_all()

    def _tokenized(self, job: Job) -> None:
        """``job``'s prompt ids, where the request can be tokenized (answering it says why not)."""
        if job.prompt_ids is None:
            try:
                job.prompt_ids = self._prompt_ids(job)
            except (RequestError, SpecrunError):
                pass

    def _held_prompt(self, slot: int, job: Job) -> int:
        """How many tokens of ``job``'s prompt (tokenized by ``_tokenized``) the idle ``slot``'s
        cache holds; 0 where the prompt has no ids."""
        if self.slots is None or job.prompt_ids is None:
            return 0
        return common_prefix_len(self.slots.sessions[slot].engine.target.tokens, job.prompt_ids)

    def _run(self) -> None:
        from specrun.sessions.chat import open_chat

        pair = self.pair
        try:
            self.session = open_chat(pair.target, pair.draft, pair.method, pair.load, draft_len=pair.draft_len,
                                     draft_min_prob=pair.draft_min_prob, ngram_cache=pair.ngram_cache,
                                     heads=pair.heads, branches=pair.trees.branches, lookahead=pair.lookahead,
                                     chain=pair.trees.chain, tree_nodes=pair.trees.nodes,
                                     verification=pair.verification, learn=pair.learn,
                                     # slots draft from their own caches, never a window beside them
                                     window_alternative=pair.parallel == 1,
                                     on_note=lambda note: self.log(f"note: {note}"))
            self._open_slots()
            if self.slots is None and pair.parallel is None:  # auto found one at a time: as --parallel 1
                self.session.hold_window_alternative()
            if pair.trace is not None:
                pair.trace.log = self.log
                pair.trace.header(target=pair.target, draft=pair.draft, method=self.session.method,
                                  slots=self.parallel)
        except BaseException as exc:
            if self.session is not None:
                self.session.close()
            self._load_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            if self.slots is None:
                self._serve(self.session, 0)
            else:
                others = [threading.Thread(target=self._serve_slot, args=(session, seq), name=f"specrun-serve-slot-{seq}",
                                           daemon=True) for seq, session in enumerate(self.slots.sessions[1:], 1)]
                for thread in others:
                    thread.start()
                self._serve(self.slots.sessions[0], 0)
                for thread in others:
                    thread.join()
        finally:
            if self.slots is not None:
                self.slots.close()
            self.session.close()
            release_thread_streams()  # this thread ends: the MLX streams it made go with it

    def _open_slots(self) -> None:
        """The slots --parallel asks for; with --parallel auto, as many as default_slots finds room
        for (halved while the models cannot open them: fewer, not a server that fails to start)."""
        from specrun.sessions.slots import SlotSessions, default_slots

        wanted = self.pair.parallel
        if wanted is None:
            wanted, why = default_slots(self.session, exact=self.pair.load.exact)
            self.log(f"note: {why}")
        while wanted > 1:
            try:
                self.slots = SlotSessions(self.session, wanted, self.pair.load.exact)
                break
            except (RuntimeError, MemoryError, SpecrunError) as exc:
                if self.pair.parallel is not None:
                    raise
                self.log(f"note: {wanted} slots could not be opened ({exc}); trying {wanted // 2}")
                wanted //= 2
        self.parallel = max(wanted, 1)
        dropped = self.session.slot_drops(self.pair.load.exact) if self.slots is not None else ""
        if dropped:  # --parallel N asked for: what the slots leave out
            self.log(f"note: the slots draft without {dropped}")
        elif self.slots is not None and self.session.draft_learns():  # learning by default, not asked for
            self.log("note: the slots' draft model does not learn online (--parallel 1 learns; heads learn on slots)")

    def _serve_slot(self, session, slot: int) -> None:
        """``_serve`` on a slot's own thread: heads drafting there may compute in MLX (EAGLE-3's
        embedding rows), whose streams go with the thread."""
        try:
            self._serve(session, slot)
        finally:
            release_thread_streams()

    def _serve(self, session, slot: int) -> None:
        """Answer jobs with ``session`` (slot ``slot``'s) until the queue hands out None (stop)."""
        while (job := self.jobs.get(slot)) is not None:
            if job.cancelled.is_set():
                self.log(f"{job.id}: the client left while queued; dropped")
                continue
            self._current.add(job)
            try:
                self._answer(job, session, slot)
            except Exception as exc:  # noqa: BLE001 - one request failed; the server keeps serving
                self.metrics.finished(job, "error", None)
                self.log(f"{job.id}: failed: {type(exc).__name__}: {exc}")
                job.emit(Failed(RequestError(f"the request failed: {type(exc).__name__}: {exc}", status=500,
                                             code="internal_error", kind="server_error")))
            finally:
                self._current.discard(job)

    def _answer(self, job: Job, session, slot: int = 0) -> None:
        try:
            prompt_ids = job.prompt_ids if job.prompt_ids is not None else self._prompt_ids(job)
            grammar = self._grammar(job)
            budget = self._reasoning_budget(job, session, prompt_ids)
        except RequestError as exc:
            self._refused(job, exc, slot)
            return
        except ConversationRefusedError as exc:
            self._refused(job, conversation_refused(exc.problem), slot)
            return
        except SpecrunError as exc:  # a chat template that fails on the conversation
            self._refused(job, RequestError(exc.one_line(), "messages" if job.request.is_chat else "prompt"), slot)
            return
        session.new_text()  # each request is a text of its own: its acceptance is measured afresh
        if self.slots is None:  # one sequence: its models' flash attention follows a long request's context
            session.settle_for(min(len(prompt_ids) + job.request.max_tokens, session.target.n_ctx))
        reused = min(common_prefix_len(session.engine.target.tokens, prompt_ids), len(prompt_ids) - 1)
        self.metrics.started(reused)
        job.emit(Started(len(prompt_ids), reused, job.prompt_cut))
        # a forced call (tool_choice "required" or a named function): its grammar ends the answer at
        # the call, and a stop string matching its markup ("<") left a 200 with neither call nor text
        forced = bool(job.request.tools) and job.request.tool_choice.forces_a_call
        cut = StopCut(() if forced else job.request.stop)
        limits = LineLimits(job.request.indent, job.request.line_seconds) \
            if job.request.indent or job.request.line_seconds else None
        tool_cut = self._tool_cut(job.request)
        split = self._reasoning_split(job, grammar)
        thinking = self._thinking_tokens(job)

        def thought_tokens() -> int:  # usage's reasoning_tokens so far
            return thinking.count if thinking is not None else 0

        tokens = from_draft = 0
        first_sent = False
        logprobs = _HeldLogprobs()  # the tokens' since the last Delta, each sent with the text it began
        sampling = job.request.sampling
        if job.request.ignore_eos:  # llama-server's: every end-of-generation token biased to never
            eog = tuple((token, -math.inf) for token in sorted(session.target.vocab.eos_ids))
            sampling = dataclasses.replace(sampling, logit_bias=sampling.logit_bias + eog)
        if budget is not None:  # the thinking's end forced past its budget: a rule on the rows, as penalties are
            sampling = dataclasses.replace(sampling, reasoning_budget=budget)
        params = GenerationParams(job.request.max_tokens, 0, sampling, tree_nodes=self.pair.trees.nodes,
                                  grammar=grammar, logprobs=job.request.logprobs,
                                  logprobs_sampled=job.request.post_sampling, stop_at_eos=not job.request.ignore_eos,
                                  shown_tokens=self._shown_tags(job))
        stopped = "ended before it finished"
        stream = session.stream(prompt_ids, params)
        rendezvous = self.slots.rendezvous if self.slots is not None else None
        if rendezvous is not None:
            rendezvous.join()  # the other slots' passes wait for this one's from now on
        trace = None
        if self.pair.trace is not None:  # begun here, ended in the finally below
            budget = sampling.reasoning_budget
            sampling = dataclasses.replace(job.request.sampling, reasoning_budget=budget)
            trace = session.trace = self.pair.trace.request(
                self._trace_id(job), slot=slot, prompt_tokens=len(prompt_ids), cached_tokens=reused,
                max_tokens=job.request.max_tokens, temperature=sampling.temperature, top_k=sampling.top_k,
                top_p=sampling.top_p, grammar=grammar is not None,
                **{name: value for name, value in sampling.fields().items()
                   if name in ("min_p", "typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold",
                               "dynatemp_range", "dynatemp_exponent", "mirostat", "adaptive_p", "infill", "samplers", "penalties", "dry",
                               "logit_bias", "reasoning_budget")})
        try:
            for event in stream:
                if job.cancelled.is_set():
                    stopped = "the server is shutting down" if self.closing else "the client left"
                    self.log(f"{job.id}: {stopped}; stopped after the pass in progress")
                    self.metrics.finished(job, "cancelled", None)  # counted, as every request is
                    return
                if isinstance(event, TextChunk):
                    tokens += len(event.token_ids)
                    if thinking is not None:
                        thinking.feed(params.shown_tokens.get(token) or session.target.token_bytes(token)
                                      for token in event.token_ids)
                    from_draft += sum(event.from_draft)
                    logprobs.add(self._shown(entry, params.shown_tokens) for entry in event.logprobs)
                    text = cut.feed(event.text)
                    if limits is not None:
                        text = limits.feed(text)
                        if cut.stopped and not limits.stopped:  # the indentation before the stop string
                            text += limits.flush()
                    text = logprobs.passed(text)
                    thought, text = _read_apart(split, job.request.reasoning_format, text)
                    if tool_cut is not None:
                        text = tool_cut.feed(text)
                    if text or thought:
                        if not first_sent:
                            first_sent = True
                            self.metrics.first_token(job)
                        job.emit(Delta(text, tokens, from_draft, logprobs.release(), thought))
                        tokens = from_draft = 0
                    ended_by = "word" if cut.stopped else limits.stopped if limits is not None else ""
                    if ended_by:
                        self._let_go(job, split, tool_cut)
                        self._finish(job, "length" if ended_by == "time" else "stop", event.stats, tool_cut, trace,
                                     slot, logprobs.release(), stopped_by=ended_by, word=cut.word,
                                     reasoning_tokens=thought_tokens())
                        return
                elif isinstance(event, Finished):
                    tail = cut.flush()
                    if limits is not None:
                        tail = limits.feed(tail)
                        tail += limits.flush()
                    thought, tail = _read_apart(split, job.request.reasoning_format, tail, end=True)
                    if tool_cut is not None:
                        tail = tool_cut.feed(tail)
                    if tail or thought or tokens:
                        job.emit(Delta(tail, tokens, from_draft, logprobs.release(everything=True), thought))
                    if event.result.finish_reason == "grammar":
                        stopped = self._grammar_failed(job, event.result)
                        return
                    ended_by = limits.stopped if limits is not None else ""
                    self._finish(job, _FINISH_REASONS[event.result.finish_reason], event.result.stats, tool_cut,
                                 trace, slot, stopped_by=ended_by or ("context" if event.result.finish_reason
                                                                      == "context" else ""),
                                 reasoning_tokens=thought_tokens())
        except Exception as exc:  # noqa: BLE001 - the server keeps serving; the request learns what failed
            self.metrics.finished(job, "error", None)
            message = exc.one_line() if isinstance(exc, SpecrunError) else f"{type(exc).__name__}: {exc}"
            stopped = f"generation failed: {message}"
            job.emit(Failed(RequestError(f"generation failed: {message}", status=500, code="internal_error",
                                         kind="server_error")))
        finally:
            stream.close()  # stops the engine at this pass; the caches stay exact
            if rendezvous is not None:
                rendezvous.leave()
            if trace is not None:
                session.trace = None
                trace.end(stopped=stopped)  # nothing where _finish ended it

    def _reasoning_split(self, job: Job, grammar: Grammar | None) -> ReasoningSplit | None:
        """What reads a chat answer's thinking apart from it (sessions/reasoning.py): None where the
        request keeps it in the content (reasoning_format "none"), or the model writes none."""
        if not job.request.is_chat or job.request.reasoning_format == "none":
            return None
        if grammar is not None and grammar.spec.thought is None:
            return None
        tags = thinking_tags(self.session.template)
        # gpt-oss's calls to the functions the prompt shows (the tool style reads those it may call)
        offered = [] if job.request.tool_choice.mode == "none" else [tool.name for tool in job.request.tools]
        return None if tags is None else reasoning_split(tags, job.opens_thinking, offered)

    def _thinking_tokens(self, job: Job) -> ThinkingTokens | None:
        """What counts a chat answer's thinking tokens (usage's reasoning_tokens), whatever the
        request's reasoning_format shows; None where the model thinks between no tags."""
        tags = thinking_tags(self.session.template) if job.request.is_chat else None
        return None if tags is None else ThinkingTokens(tags, job.opens_thinking)

    def _reasoning_budget(self, job: Job, session, prompt_ids: list[int]):
        """The request's reasoning budget as a rule on the rows (sessions/reasoning.budget_rule); None
        where it asks none, or the model thinks between no tags (as llama-server, which ignores it then)."""
        request = job.request
        tags = thinking_tags(self.session.template) if request.is_chat and request.reasoning_budget >= 0 else None
        if tags is None or job.closes_thinking:  # thinking off: no row waits on a count (nor comes to the host)
            return None
        rule = budget_rule(session.target, tags, prompt_ids, job.opens_thinking, request.reasoning_budget,
                           request.reasoning_budget_message)
        token = forbidden_forced(dataclasses.replace(request.sampling, reasoning_budget=rule))
        if token is not None:
            raise invalid_value("logit_bias", f"a bias of false (never) on token {token}, which the reasoning budget "
                                              "forces (its closing tag or message): give a finite bias")
        return rule

    def _shown_tags(self, job: Job) -> dict[int, bytes]:
        """A chat answer's thinking tags that are control tokens, shown in its text to be read apart."""
        if not job.request.is_chat:
            return {}
        return shown_tags(self.session.target, thinking_tags(self.session.template))

    @staticmethod
    def _let_go(job: Job, split: ReasoningSplit | None, tool_cut: ToolCallCut | None) -> None:
        """What the split held when a stop string or a line limit ends the answer: a tag's first
        characters that never closed (a call's text goes to the tool cut, which reads it at the end)."""
        thought, text = _read_apart(split, job.request.reasoning_format, "", end=True)
        if tool_cut is not None:
            text = tool_cut.feed(text)
        if text or thought:
            job.emit(Delta(text, 0, 0, (), thought))

    def _fill_ids(self, job: Job) -> list[int]:
        """/infill's prompt, each part within its share of the context (sessions/infill.fill_prompt);
        ``job.prompt_cut`` says whether any was cut."""
        from specrun.sessions.infill import FillTooLongError, NoInfillError, fill_prompt

        target = self.session.target
        try:
            ids, job.prompt_cut = fill_prompt(target, job.request.fill, target.n_ctx)
        except NoInfillError as exc:
            raise RequestError(exc.one_line(), "input_prefix", code="unsupported_value") from None
        except FillTooLongError as exc:
            raise RequestError(f"prompt: {exc.problem}; shorten the cursor line, or restart the server with a "
                               "larger --ctx", "prompt", code="context_length_exceeded") from None
        return ids

    @staticmethod
    def _trace_id(job: Job) -> str:
        """The request's id as its client was given it."""
        return f"{'chatcmpl' if job.request.is_chat else 'cmpl'}-{job.id}"

    def _refused(self, job: Job, error: RequestError, slot: int) -> None:
        """A request its prompt or grammar refused: a 4xx to its client, two lines in the trace."""
        self.metrics.finished(job, "error", None)
        if self.pair.trace is not None:
            self.pair.trace.request(self._trace_id(job), slot=slot).end(stopped=f"refused: {error}")
        job.emit(Failed(error))

    def _grammar_failed(self, job: Job, result) -> str:
        """An answer its grammar stopped (past llguidance's limits, or allowing no token): the text
        so far does not follow the grammar, so the client gets a 400 naming the field and the
        reason (a stream: an error event after what it was sent), not a finish reason. Returns what
        the trace records."""
        request = job.request
        field_name = "tools" if request.tools and request.tool_choice.forces_a_call else request.grammar_field
        count = result.stats.new_tokens
        message = (f"{field_name}: the grammar stopped the answer after {count_of(count, 'token')}: "
                   f"{result.grammar_problem}")
        self.metrics.finished(job, "error", None)
        self.log(f"{job.id}: {message}")
        job.emit(Failed(RequestError(f"{message} (simplify the grammar)", field_name, code="grammar_failed")))
        return message

    def _finish(self, job: Job, finish_reason: str, stats: Stats, tool_cut: ToolCallCut | None = None,
                trace: RequestTrace | None = None, slot: int = 0, logprobs: tuple = (), stopped_by: str = "",
                word: str = "", reasoning_tokens: int = 0) -> None:
        """The answer's end; ``logprobs``: the entries of tokens whose text the tool cut held (a stop
        string fired while it held them), sent with the text it lets go; ``stopped_by`` and ``word``:
        where the server ended it, and ``reasoning_tokens`` how many of its tokens were thinking (Done)."""
        if tool_cut is not None:
            cut = finish_reason == "length"
            tail, calls = tool_cut.finish(cut)
            if tail or logprobs:
                job.emit(Delta(tail, 0, 0, logprobs))
            if calls:
                job.emit(Calls(calls))
                finish_reason = finish_reason if cut else TOOL_CALLS  # cut: the calls whole before max_tokens
        if trace is not None:
            trace.end(finish_reason, stats)
        self.served += 1
        self.metrics.finished(job, finish_reason, stats)
        self.jobs.answered(slot)  # idle before its client hears: a next turn sent at once finds this slot
        job.emit(Done(finish_reason, stats, stopped_by, word, reasoning_tokens))
        self.log(f"{job.id}: {finish_reason}; {stats.summary()}")

    def _shown(self, entry: TokenLogprob, shown: dict[int, bytes]) -> tuple[TokenChoice, tuple[TokenChoice, ...]]:
        """An engine's token log-probability with the texts a response shows (``shown``: control
        tokens the answer's text shows, GenerationParams.shown_tokens)."""
        target = self.session.target

        def choice(token: int, logprob: float) -> TokenChoice:
            piece = shown.get(token) or target.token_bytes(token)
            return TokenChoice(piece.decode("utf-8", "replace"), piece, logprob, token)

        # a token a grammar forbids has no probability at all, and JSON no -infinity: it is not listed
        return choice(entry.token, entry.logprob), tuple(choice(t, value) for t, value in entry.top
                                                         if math.isfinite(value))

    def _style(self) -> ToolStyle:
        return style_for(self.session.template)

    def _tool_cut(self, request: CompletionRequest) -> ToolCallCut | None:
        """What reads the calls out of this request's answer: None where it has no tools to call."""
        if not request.tools or request.tool_choice.mode == "none":
            return None
        return ToolCallCut(self._style(), [tool.name for tool in request.tool_choice.callable(request.tools)])

    def _grammar(self, job: Job) -> Grammar | None:
        """The request's grammar compiled for the target's vocabulary (checked without one already);
        where a call is required, the grammar of calls in the format the model writes them. A chat
        answer of a reasoning model is held by it after its thinking (sessions/reasoning.py)."""
        request = job.request
        spec, field_name = request.grammar, request.grammar_field
        try:
            if request.tools and request.tool_choice.forces_a_call:
                field_name = "tools"  # a name the model's call format cannot write, too
                if request.ignore_eos:  # its grammar ends the call with an end-of-text token
                    raise invalid_value("ignore_eos", "a required tool call ends with an end-of-text token, which "
                                                      "ignore_eos forbids: send one of them")
                if forbids(request.sampling.logit_bias, request.bias_texts):
                    raise invalid_value("logit_bias", "a bias of false (never) beside a required tool call could forbid "
                                                      "every token its grammar allows: give finite biases")
                spec = self._style().grammar(request.tools, request.tool_choice, request.parallel_tool_calls,
                                             self.session.target)
            if spec is None:
                return None
            tags = thinking_tags(self.session.template) if request.is_chat else None
            if tags is not None:
                spec = grammar_after_thinking(spec, self.session.target, tags, job.opens_thinking)
            return Grammar.compile(spec, self.session.target)
        except GrammarError as exc:
            raise invalid_value(field_name, exc.problem) from None

    def _blame_variables(self, request: CompletionRequest, offered, exc: SpecrunError) -> None:
        """A chat template that fails with the template's variables (a request's
        chat_template_kwargs or reasoning_effort, the server's --chat-template-kwargs or --reasoning)
        and renders without them: a 400 naming them, not the messages."""
        if not request.template_variables:
            return
        try:
            render_conversation(self.session.template, list(request.messages), offered)
        except SpecrunError:
            return  # it fails on the conversation itself
        names = ", ".join(sorted(request.template_variables))
        raise RequestError(f"the chat template fails with its variables ({names}): {exc.problem}; change "
                           f"chat_template_kwargs or reasoning_effort (or the server's --chat-template-kwargs, "
                           f"--reasoning)", "chat_template_kwargs", code="invalid_value") from None

    def _prompt_ids(self, job: Job) -> list[int]:
        from specrun.sessions.infill import NoInfillError, fim_tokens, infill_ids
        from specrun.sessions.setup import check_prompt_size, prompt_token_ids
        from specrun.sessions.templates import tokenize_rendered

        session = self.session
        target = session.target
        # logit_bias: texts' tokens biased, ids checked against the vocabulary (a 400 before any answer)
        job.request = request = with_bias_texts(
            job.request, lambda text: target.tokenize(text, add_bos=False, special=False), target.vocab.size)
        if request.fill is not None:
            return self._fill_ids(job)
        param = "messages" if request.is_chat else "prompt"
        # what the prompt holds: the messages, and the tools and earlier calls rendered beside them;
        # a prompt's text and its suffix (beside token ids, the suffix alone)
        text = ("".join(str(m.get("content") or "") + str(m.get("reasoning_content") or "")
                        + json.dumps(m.get("tool_calls") or "") for m in request.messages)
                + "".join(json.dumps(tool.as_openai()) for tool in request.tools)) if request.is_chat \
            else (request.prompt if isinstance(request.prompt, str) else "") + (request.suffix or "")
        if text:
            try:
                check_prompt_size(target, text)  # before tokenizing megabytes that cannot fit
            except ContextFullError as exc:
                raise RequestError(f"{param}: {exc.problem}; shorten it, or restart the server with a larger --ctx",
                                   param, code="context_length_exceeded") from None
        if request.is_chat:
            try:
                # tool_choice "none": the model is not told of tools it may not call
                offered = () if request.tool_choice.mode == "none" else request.tools
                template = session.template.with_variables(request.template_variables)
                text, spans = render_conversation(template, list(request.messages), offered)
            except ToolTemplateError as exc:
                raise RequestError(exc.one_line(), "tools", code="invalid_value") from None
            except (ChatTemplateError, ConversationRefusedError) as exc:
                self._blame_variables(request, offered, exc)
                raise
            prompt_ids = tokenize_rendered(target, template, text, spans)
            # the generation prompt: the text after the last message's (DeepSeek-R1's ends in <think>)
            tags, tail = thinking_tags(template), generation_prompt(text, spans)
            job.opens_thinking, job.closes_thinking = opens_thinking(tags, tail), closes_thinking(tags, tail)
        else:
            if not isinstance(request.prompt, str):
                check_token_ids(request.prompt, target.vocab.size, "prompt")
            # an editor's fill at the cursor; an empty suffix (a file's end) only where the model fills
            fim = fim_tokens(target) if request.suffix == "" else None
            if request.suffix is not None and (request.suffix or fim is not None):
                try:
                    prompt_ids = infill_ids(target, request.prompt, request.suffix, fim)
                except NoInfillError as exc:
                    raise invalid_value("suffix", exc.one_line()) from None
            elif request.prompt == "":  # an empty suffix where the model fills nothing: no prompt at all
                raise invalid_value("prompt", "must not be empty (a model without fill-in-the-middle tokens "
                                              "takes no empty prompt beside an empty suffix)")
            elif isinstance(request.prompt, str):
                prompt_ids = prompt_token_ids(target, request.prompt, chat=False)
            else:
                prompt_ids = list(request.prompt)
        if not prompt_ids:
            raise invalid_value(param, "the prompt is empty")
        if len(prompt_ids) >= target.n_ctx:
            raise RequestError(
                f"{param}: the prompt has {len(prompt_ids)} tokens but the context holds {target.n_ctx}; "
                + ctx_fix(target, "shorten it", "restart the server with a larger --ctx"),
                param,
                code="context_length_exceeded",
            )
        return prompt_ids
