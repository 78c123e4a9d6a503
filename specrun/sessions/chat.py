"""A multi-turn conversation over one loaded target (and drafter): the library behind ``specrun chat``.

``ChatSession.ask`` renders the conversation with the model's chat template,
tokenizes it, streams the answer through the speculative engine and yields events;
it never prints.

KV reuse. The session keeps a ``Transcript``: the token ids the target has actually
seen (the last prompt plus the tokens it generated) and the text they spell. The
next turn's prompt is those ids plus the tokenized text the template adds after
them (the end of the answer, the new user message, the assistant cue), so the
engine's longest-common-prefix reuse prefills only the new tokens. When the template
rewrites earlier text (a changed system prompt, a template that trims or drops
parts of old answers), the whole conversation is tokenized afresh instead; the
engine then reuses whatever prefix still matches.

Interruptions. An answer that does not finish (Ctrl-C, a closed generator, an
error) is dropped together with its question: the transcript stays as it was
before ``ask``, and the caches are left consistent, so the next turn gives what a
fresh session fed the same transcript gives. Keeping the question alone would leave
two user messages in a row, which many templates refuse.
"""

from __future__ import annotations

import codecs
import dataclasses
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specrun.backends.base import Backend
from specrun.drafters.ngram import vocabulary_fingerprints
from specrun.engine.events import Finished, GenerationResult, TextChunk
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.engine.passes import Verification
from specrun.errors import ChatTemplateError, ContextFullError, SpecrunError, UsageError
from specrun.sessions.heads import heads_for_auto, load_target_heads, paying_heads, with_auto_heads, with_learner
from specrun.sessions.setup import (
    ctx_fix,
    TreeSettings,
    adapts_length,
    auto_draft_window,
    auto_window,
    check_prompt_size,
    check_trees_for,
    choose_window,
    default_trees,
    load_target_entry,
    load_tuned,
    method_trees,
    remember_probe,
    tuned_key_model,
    tuned_window,
    remember_run,
    resolve_draft_len,
    resolve_min_prob,
)
from specrun.backends.kv import common_prefix_len, sequence_for
from specrun.backends.slots import PREFILL_CHUNK
from specrun.drafters.draft_model import DraftModelDrafter
from specrun.drafters.lookahead import LookaheadSizes
from specrun.registry.loading import LoadOptions, open_pair
from specrun.drafters.heads.eagle import eagle3_layers
from specrun.heads.kinds import SLOT_KINDS, kind_of
from specrun.sessions.kernels import DEEP_FROM, open_settled_draft, settle_for_context, settle_pair
from specrun.drafters.methods import (
    DrafterOptions,
    build_drafter,
    check_method,
    SLOT_HEAD_KINDS,
    SLOT_PARTS,
    check_slots_method,
    heads_kind,
    heads_of_kind,
    is_adaptive,
    needs_draft_model,
    needs_heads,
    uses_lookahead,
)
from specrun.engine.stats import Stats
from specrun.grammar import Grammar
from specrun.sessions.reasoning import (
    ReasoningSplit, budget_rule, check_forced_allowed, generation_prompt, grammar_after_thinking, opens_thinking,
    reasoning_split, shown_tags, thinking_tags,
)
from specrun.sessions.templates import ChatTemplate, tokenize_rendered
from specrun.sessions.trace import TraceFile
from specrun.sessions.tools import CUT_REASONS, Tool, ToolCall, ToolChoice, render_conversation, style_for

# What a lookahead window's pass-cost probe feeds first where the chat has no system prompt.
PROBE_TEXT = "You are a helpful assistant. Answer the question below clearly and briefly."


@dataclass(frozen=True)
class AnswerText:
    """Event: a run of answer text, all from accepted drafts or all from the target itself;
    ``thinking``: a reasoning model's thinking before its answer (sessions/reasoning.py)."""

    text: str
    from_draft: bool
    thinking: bool = False


@dataclass(frozen=True)
class ContextFullNotice:
    """Event: the context filled up, so the answer stops here (it is kept, cut short)."""

    message: str


@dataclass(frozen=True)
class AnswerDone:
    """Event: the last of an answer. ``reused_tokens`` prompt tokens came from the cache."""

    text: str
    finish_reason: str  # "eos", "length" or "context"
    stats: Stats
    prompt_tokens: int
    reused_tokens: int
    tool_calls: tuple[ToolCall, ...] = ()  # the calls the answer made (a session with tools)
    tool_call_cut: bool = False  # max tokens or the context stopped the answer inside a call (left out)
    reasoning: str = ""  # a reasoning model's thinking, read apart from ``text`` (its answer)

    def to_dict(self) -> dict:
        answer = {
            "text": self.text,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "stats": self.stats.to_dict(),
        }
        if self.reasoning:  # as the server's message names it
            answer["reasoning_content"] = self.reasoning
        if self.tool_calls:
            answer["tool_calls"] = [call.as_openai() for call in self.tool_calls]
        if self.tool_call_cut:
            answer["tool_call_cut"] = True
        return answer


ChatEvent = AnswerText | ContextFullNotice | AnswerDone


@dataclass
class Transcript:
    """The conversation, and the exact tokens the target saw for it.

    ``token_ids`` spell ``text``, which is a prefix of the template's rendering of
    ``messages``. Empty ids mean: tokenize the whole conversation next time.
    """

    messages: list[dict[str, str]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""


class _SpanDecoder:
    """Answer tokens to text, split where runs of accepted drafts begin and end; ``shown``: control
    tokens whose text the answer shows (GenerationParams.shown_tokens)."""

    def __init__(self, backend: Backend, shown: dict[int, bytes] | None = None) -> None:
        self.backend = backend
        self.shown = shown or {}
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def spans(self, chunk: TextChunk) -> Iterator[AnswerText]:
        for from_draft, run in itertools.groupby(zip(chunk.token_ids, chunk.from_draft), key=lambda pair: pair[1]):
            text = self.decoder.decode(b"".join(self.shown.get(token) or self.backend.token_bytes(token)
                                                for token, _ in run))
            if text:
                yield AnswerText(text, from_draft)

    def flush(self) -> Iterator[AnswerText]:
        tail = self.decoder.decode(b"", final=True)
        if tail:
            yield AnswerText(tail, False)


def _read_apart(split: ReasoningSplit | None, spans: Iterator[AnswerText], end: bool = False) -> Iterator[AnswerText]:
    """Answer text as thinking and answer (``split``; None: as it is); ``end``: the answer's last."""
    for span in spans:
        if split is None:
            yield span
            continue
        thought, answer = split.feed(span.text)
        if thought:
            yield AnswerText(thought, span.from_draft, thinking=True)
        if answer:
            yield AnswerText(answer, span.from_draft)
    if split is not None and end:
        thought, answer = split.finish()
        if thought:
            yield AnswerText(thought, False, thinking=True)
        if answer:
            yield AnswerText(answer, False)


class ChatSession:
    """A conversation with one target and an optional drafter; use as a context manager.

    load_draft: called the first time ``set_method`` needs a draft model that was not
    loaded at the start (the chat began with a method that needs none).
    load_heads: likewise for a head method's heads (specrun.heads.files), called with its
    ``kind``; ``kind=None``: the heads auto drafts with (None where the target has none).
    draft_len, draft_min_prob: the user's choices. draft_len None: lengths adapt, up to 16;
    draft_min_prob None: what ``specrun tune`` saved for this pair and machine (``tuned``),
    else none (setup.resolve_*).
    find_tuned: gives the tuned settings for a draft model loaded later by ``load_draft``.
    threads: the target's thread count, which keys what the session's runs learned (kept
    on close for the next session, as ``specrun generate`` keeps it).
    verification: how drafts are verified (--verify, --accept; engine/passes.py), exact by default.
    window_alternative: auto holds the draft model's windowed cache beside its full one, as
    `specrun generate` does where --window was left out (setup.auto_draft_window).
    """

    def __init__(
        self,
        target: Backend,
        draft: Backend | None = None,
        method: str = "draft",
        *,
        system_prompt: str | None = None,
        drafter_options: DrafterOptions | None = None,
        load_draft: Callable[[], Backend] | None = None,
        load_heads: Callable[..., object] | None = None,
        draft_len: int | None = None,
        draft_min_prob: float | None = None,
        tuned=None,
        find_tuned: Callable[[Backend], object] | None = None,
        threads: int | None = None,
        chain: bool = False,
        tree_nodes: int = 0,
        on_note: Callable[[str], None] | None = None,
        tools: Sequence[Tool] = (),
        tool_choice: ToolChoice = ToolChoice(),
        verification: Verification = Verification(),
        learn: Callable | None = None,
        window_alternative: bool = False,
        settle_context: Callable[[int, tuple, Callable[[], None]], list[str]] | None = None,
        find_settled_tuned: Callable[[Backend | None], object] | None = None,
        template_variables: dict | None = None,
        reasoning_budget: tuple[int, str] = (-1, ""),
    ) -> None:
        self.target = target
        # open_chat's: flash attention chosen again once the conversation's context reaches
        # kernels.DEEP_FROM tokens (sessions/kernels.settle_for_context), at most once a session
        self._settle_context = settle_context
        self._deep_context = 0  # the context settle_for chose again for (0: not yet): a later draft's too
        self._find_settled_tuned = find_settled_tuned  # what tune saved under the models' keys as they are now
        self._learn = learn  # --learn: the learner of the heads drafted with (sessions/heads.with_learner)
        self.tools = tuple(tools)  # functions the model may call, rendered into every prompt
        self.tool_choice = tool_choice  # a required call is forced on each user turn, not after a result
        self._call_grammar: dict[bool, Grammar] = {}  # by whether the prompt opened a thinking block
        self.draft = draft
        # --chat-template-kwargs, --reasoning: variables every rendering gives the template
        self.template = ChatTemplate.for_backend(target).with_variables(template_variables)
        self.thinking = thinking_tags(self.template)  # the tags a reasoning model thinks between (None: none)
        self._shown_tags = shown_tags(target, self.thinking)  # those that are control tokens, shown as text
        self._reasoning_budget = reasoning_budget  # --reasoning-budget (-1: no limit) and its message
        self._opened_thinking = False  # the last prompt's generation prompt opened the block
        self.system_prompt = None
        self.set_system_prompt(system_prompt)  # --system: refused at the start where it alone fills the context
        self.transcript = Transcript()
        # the calls answers made and no tool message answered yet, oldest first: a result typed back
        # (ask with role "tool") answers the first and carries its id, which a template may require
        # (Mistral's refuse a result without one; the answer itself is kept as the text it was)
        self.unanswered: list[ToolCall] = []
        self.answers: list[Stats] = []
        self._load_draft = load_draft
        self._load_heads = load_heads  # a head method's heads, for a /method that needs them
        self._draft_len = draft_len
        self._draft_min_prob = draft_min_prob
        self._find_tuned = find_tuned
        self._threads = threads  # the learned costs are kept per thread count (tuning.pair_key)
        self._drafter_options = drafter_options or DrafterOptions()
        self._chain = chain  # --chain: auto never drafts with a lookahead window
        self._tree_nodes = tree_nodes  # --tree-nodes (0: none asked), which a window must fit
        self._window_nodes = 0  # the nodes auto's window or trees opened by themselves hold in every pass
        self._on_note = on_note
        self._window_alternative = window_alternative  # auto holds a window beside the draft's full cache
        self._tuned = None
        self.trace: TraceFile | None = None  # `chat --trace`: where each answer's steps go (the caller closes it)
        self.traced_answers = 0
        self.engine = SpeculativeEngine(target, None, method, verification=verification)
        self._use_tuned(tuned)
        check_trees_for(method, target, self._drafter_options.lookahead)
        if is_adaptive(method) and draft is None and not self._chain:  # once, before anything is fed
            self._add_auto_window()
        if not self._window_nodes:
            self._add_default_trees(method)
        self.engine.set_drafter(self._drafter_for(method), method)

    def _add_default_trees(self, method: str) -> None:
        """Token trees where none were asked and the stored pass costs predict they pay, as
        `specrun generate` opens them (setup.default_trees), said in a note."""
        if self._drafter_options.branches or self._drafter_options.lookahead is not None:
            return
        stored = self._tuned if self.draft is not None else load_target_entry(self.target, self._threads)
        choice = default_trees(method, self.target, stored, TreeSettings(self._tree_nodes, chain=self._chain))
        if choice is None:
            return
        self._drafter_options = dataclasses.replace(self._drafter_options, branches=choice.trees.branches)
        self._window_nodes = choice.trees.nodes
        if self._on_note is not None:
            self._on_note(choice.describe())

    def _drafter_for(self, method: str):
        """The drafter of ``method``; a lookahead window's sizes, where none were given, chosen
        once from the target's pass costs (earlier runs', else probed on the system prompt)."""
        if uses_lookahead(method) and self._drafter_options.lookahead is None:
            from specrun.control.forecasts import fitting
            from specrun.sessions.lookahead_sizing import stored_costs

            stored = load_target_entry(self.target, self._threads)
            costs = stored_costs(stored)
            probe = self.target.tokenize(self.system_prompt or PROBE_TEXT, add_bos=self.target.vocab.add_bos)
            choice = choose_window(self.target, costs, fitting(0, self.target.tree_support.max_paths), probe)
            self._drafter_options = dataclasses.replace(self._drafter_options, lookahead=choice.sizes)
        options = with_learner(self._drafter_options, method, self.target, self._learn, self.draft)
        if self._window_alternative and options.draft_learner is None:  # auto's window beside the full cache
            options = dataclasses.replace(options, draft_window=auto_draft_window(method, self.draft, self._tuned,
                                                                                 None, None))
        return build_drafter(method, self.draft, options)

    def _add_auto_window(self) -> None:
        """auto without a draft model drafts with a lookahead window too where earlier runs'
        pass costs predict it pays, as `specrun generate` does (setup.auto_window); the
        target, if it verifies chains only, is re-created for the window before anything is fed.
        Weighed when the session opens: a later /method auto needs a draft model, and then
        drafts with none (as generate's auto with a draft model)."""
        from specrun.control.forecasts import fitting
        from specrun.sessions.lookahead_sizing import stored_costs

        costs = stored_costs(load_target_entry(self.target, self._threads))
        choice = auto_window("auto", self.target, costs, fitting(self._tree_nodes, self.target.tree_support.max_paths))
        if choice is None:
            return
        self._drafter_options = dataclasses.replace(self._drafter_options, lookahead=choice.sizes, auto_lookahead=True)
        self._window_nodes = choice.sizes.max_nodes
        self.engine.policy.target_costs.preload(choice.costs)
        if self._on_note is not None:
            self._on_note(f"auto drafts with a {choice.describe()}")

    def _use_tuned(self, tuned) -> None:
        """Take what `specrun tune` saved: the confidence stop (where the user chose none) for
        drafters built from now on, and the measured costs and acceptance the controllers
        start from (lengths adapt unless -k fixes them)."""
        self._tuned = tuned
        self._drafter_options = dataclasses.replace(
            self._drafter_options, draft_min_prob=resolve_min_prob(self._draft_min_prob, tuned)
        )
        if tuned is not None:
            tuned.apply(self.engine)  # auto and a chain's gate need not explore them

    # ---- the conversation ---------------------------------------------------------
    def ask(self, text: str, params: GenerationParams, role: str = "user") -> Iterator[ChatEvent]:
        """Answer ``text`` as the next user turn (``role`` "tool": the result of the first call still
        open, ``unanswered``, carrying its id): AnswerText events, maybe a ContextFullNotice, AnswerDone.

        Raises ContextFullError (before generating) when the conversation no longer
        fits, ChatTemplateError when the template refuses it.
        """
        # before rendering and tokenizing megabytes that cannot fit (a 54 MB message overran the
        # template's limits and blamed the template)
        check_prompt_size(self.target, text)
        if role == "tool" and not self.tools:
            raise UsageError("there is no tool call to answer: this chat has no tools", "start it with --tools FILE")
        if role == "tool" and not self.unanswered:  # a result of no call: sent without an id, or taken as text
            raise UsageError("there is no tool call to answer: the last answer called none (or its calls are answered)",
                             "type your message as it is")
        message = {"role": role, "content": text}
        if role == "tool" and self.unanswered:
            message["tool_call_id"] = self.unanswered[0].id
        messages = [*self.transcript.messages, message]
        prompt_text, prompt_ids = self._prompt(messages)
        if role == "user" and self.tool_choice.forces_a_call:  # after the thinking the prompt opened
            params = dataclasses.replace(params, grammar=self._required_call(self._opened_thinking))
        params = dataclasses.replace(params, shown_tokens=self._shown_tags)
        budget, message = self._reasoning_budget
        if budget >= 0 and self.thinking is not None:  # the thinking's end forced past it: a rule on the rows
            rule = budget_rule(self.target, self.thinking, prompt_ids, self._opened_thinking, budget, message)
            params = dataclasses.replace(params, sampling=dataclasses.replace(params.sampling, reasoning_budget=rule))
            check_forced_allowed(params.sampling)
        self._check_fits(prompt_ids)
        self.settle_for(min(len(prompt_ids) + params.max_new_tokens, self.target.n_ctx))
        reused = min(common_prefix_len(self.engine.target.tokens, prompt_ids), len(prompt_ids) - 1)
        decoder = _SpanDecoder(self.target, self._shown_tags)
        # a reasoning model's thinking read apart (not under a grammar that holds the answer from its first token)
        offered = [tool.name for tool in self.tools]
        split = reasoning_split(self.thinking, self._opened_thinking, offered) if self.thinking is not None and (
            params.grammar is None or params.grammar.spec.thought is not None) else None
        result: GenerationResult | None = None
        read: dict[bool, list[str]] = {True: [], False: []}  # the thinking's pieces, and the answer's
        stream = self.stream(prompt_ids, params)
        try:
            for event in stream:
                if isinstance(event, TextChunk):
                    for piece in _read_apart(split, decoder.spans(event)):
                        read[piece.thinking].append(piece.text)
                        yield piece
                elif isinstance(event, Finished):
                    result = event.result
        finally:
            stream.close()  # an interrupted answer: the stream repairs the caches as it closes
        for piece in _read_apart(split, decoder.flush(), end=True):
            read[piece.thinking].append(piece.text)
            yield piece
        thought, answer = ("".join(read[True]), "".join(read[False])) if split is not None else ("", result.text)
        if result.finish_reason == "context":
            yield ContextFullNotice(
                f"the context of {self.target.n_ctx} tokens is full, so the answer stops here; "
                + ctx_fix(self.target, "/reset starts a new conversation")
            )
        names = [tool.name for tool in self.tools]
        calls, call_cut = (style_for(self.template).read_answer(answer, names, result.finish_reason in CUT_REASONS)
                           if self.tools else ((), False))
        # a call cut off, or calls whose text is not what the template writes back (gpt-oss's): the
        # transcript keeps them as a client sends them back
        kept_apart = call_cut or (calls and style_for(self.template).name == "harmony")
        cut, rendered = self._cut_answer(messages, answer, names, calls) if kept_apart else (None, None)
        if split is not None and answer != result.text:  # kept as a client sends it back: the template
            # writes the thinking (or drops it) as it does
            cut = {**(cut or {"role": "assistant", "content": answer}), **({"reasoning_content": thought} if thought
                                                                          else {})}
            rendered = None  # rendered by _record, with the thinking
        self._record(messages, prompt_text, prompt_ids, result, cut, rendered)
        # a user's turn leaves earlier calls behind; a result answers the first still open
        self.unanswered = [*(self.unanswered[1:] if role == "tool" else ()), *calls]
        self.answers.append(result.stats)
        yield AnswerDone(answer, result.finish_reason, result.stats, len(prompt_ids), reused, tuple(calls),
                         call_cut, thought)

    def settle_for(self, context: int) -> None:
        """Once an answer's context may reach DEEP_FROM tokens (within the context): flash attention
        as the deep probe chooses it (the chat opened with the short probe's choice, right for a short
        chat); where that differs, the models' caches are emptied and this prompt is read again in
        full, once a session (a /reset does not ask again; a draft model loaded later by /method is
        settled the same way). A server with one sequence at a time asks before each request."""
        if self._settle_context is None or self._deep_context or context < DEEP_FROM:
            return
        self._deep_context = context
        if self._settle_context(context, (self.target, self.draft), self._empty_caches):
            self._remember_under_new_keys()

    def _remember_under_new_keys(self) -> None:
        """The flash setting keys what tune and earlier runs stored: what this session's runs are
        remembered with on close (``remember_run``) becomes the new setting's entry. The running
        controllers keep what they measured in this conversation (acceptance does not follow the
        kernels; the pass costs they learn online do)."""
        if self._find_settled_tuned is not None:
            self._tuned = self._find_settled_tuned(self.draft)

    def _empty_caches(self) -> None:
        sequence_for(self.target).reset()
        if self.draft is not None:
            sequence_for(self.draft).reset()

    def _required_call(self, opened_thinking: bool = False) -> Grammar:
        """The grammar of a call in the model's format to the tools ``tool_choice`` allows, after the
        thinking of a reasoning model (``opened_thinking``: its prompt opened the block); compiled once."""
        if self._call_grammar.get(opened_thinking) is None:
            spec = style_for(self.template).grammar(self.tools, self.tool_choice, backend=self.target)
            if self.thinking is not None:
                spec = grammar_after_thinking(spec, self.target, self.thinking, opened_thinking)
            self._call_grammar[opened_thinking] = Grammar.compile(spec, self.target)
        return self._call_grammar[opened_thinking]

    def stream(self, prompt_ids: list[int], params: GenerationParams) -> Iterator[TextChunk | Finished]:
        """The engine's events for ``prompt_ids`` at the session's draft settings, the
        transcript untouched (``ask`` and a server's requests). Closed early (Ctrl-C, a stop
        string, a client gone) or failing, it leaves both caches exact: a prefix of prompt +
        output, which the next prompt reuses as far as it matches."""
        params = dataclasses.replace(
            params, draft_len=self.draft_len, adaptive=adapts_length(self.method, self._draft_len),
            tree_nodes=max(params.tree_nodes, self._window_nodes),
        )
        stream = self.engine.stream(prompt_ids, params)
        trace = self.trace
        if trace is not None:  # `chat --trace`: each answer's steps, numbered by answer
            self.traced_answers += 1
            where = {"answer": self.traced_answers}
            self.engine.on_trace = trace.recorder(**where)
        try:
            for event in stream:
                if trace is not None and isinstance(event, Finished):
                    trace.finish(event.result.stats, **where)
                yield event
        except BaseException:
            stream.close()  # the engine rewinds in its finally (a no-op if the error came from inside it)
            self._repair_caches()
            raise
        finally:
            self.engine.on_trace = None

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays) and empty both caches; the next
        answer is a text of its own (``new_text``)."""
        self.transcript = Transcript()
        self.unanswered = []
        self._empty_caches()
        self.new_text()

    def new_text(self) -> None:
        """The next answer is a text of its own, not the conversation's next turn (a server's
        next request, a new conversation): the policy forgets the acceptance it measured, which
        belongs to a text, and keeps the machine's pass costs and a gated-off draft model's
        probe gap, as bench does between prompts and learned.json between generate's processes.
        Carried over instead, a server probed its idle draft model every 128 steps, each probe
        reading all it had skipped (docs/perf.md 3(k)). A slot whose sequence was emptied while it
        waited (backends/slots.py: a rewind that failed twice) reads the next text afresh."""
        self.engine.policy.forget_acceptance()
        for backend in (self.target, self.draft):
            if getattr(backend, "emptied", False):
                sequence_for(backend).reset()

    def set_system_prompt(self, text: str | None) -> None:
        """Use ``text`` from the next answer on; the conversation so far is kept. A system prompt
        that alone fills the context is refused here (every later message was, blamed on itself)."""
        if text:
            check_prompt_size(self.target, text)
            tokens = self._system_tokens(text)
            if tokens + self._rendered_tokens() >= self.target.n_ctx:  # no message could follow it
                raise ContextFullError(f"the system prompt has {tokens} tokens but the context holds "
                                       f"{self.target.n_ctx}", ctx_fix(self.target, "shorten it"))
        self.system_prompt = text or None

    def _system_tokens(self, text: str | None = None) -> int:
        """The tokens the system prompt (``text``, else the one in use) adds to a rendered prompt,
        the template's markers around it included: an empty message rendered with it and without.
        (Counted as its text alone, a prompt the markers took past the context passed /system and
        was refused at the next message.)"""
        text = self.system_prompt if text is None else text
        if not text:
            return 0
        alone = len(self.target.tokenize(text, add_bos=False))
        with_it = self._rendered_tokens(text)
        return max(with_it - self._rendered_tokens(), alone) if with_it else alone

    def _rendered_tokens(self, system: str | None = None) -> int:
        """The tokens of an empty user message rendered, after ``system`` as the system prompt if
        given; 0 where the template refuses it (the next message's rendering says why)."""
        conversation = [{"role": "system", "content": system}] if system else []
        try:
            text, spans = render_conversation(self.template, [*conversation, {"role": "user", "content": ""}],
                                              self.tools)
        except ChatTemplateError:
            return 0
        return len(tokenize_rendered(self.target, self.template, text, spans))

    def _with_system(self, messages: Sequence[dict[str, str]]) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, *messages]

    def _prompt(self, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
        """The rendered prompt for ``messages`` and its token ids, extending the transcript's when possible."""
        conversation = self._with_system(messages)
        # The template's markers (<|im_start|>) become their tokens; what was typed stays text.
        text, spans = render_conversation(self.template, conversation, self.tools)
        self._opened_thinking = opens_thinking(self.thinking, generation_prompt(text, spans))
        seen = self.transcript
        if seen.token_ids and text.startswith(seen.text):
            added = tokenize_rendered(self.target, self.template, text, spans, start=len(seen.text))
            return text, seen.token_ids + added
        return text, tokenize_rendered(self.target, self.template, text, spans)

    def _check_fits(self, prompt_ids: list[int]) -> None:
        n_ctx = self.target.n_ctx
        if len(prompt_ids) < n_ctx:
            return
        system = self._system_tokens()
        if system and not self.transcript.messages and len(prompt_ids) - system < n_ctx:
            # the message alone would fit: the system prompt is what to shorten (a /reset keeps it)
            raise ContextFullError(
                f"the system prompt ({system} tokens) and the message need {len(prompt_ids)} tokens but the "
                f"context holds {n_ctx}",
                ctx_fix(self.target, "shorten the system prompt (--system, or /system in a chat; /system - removes it)"),
            )
        if self.transcript.messages:
            also = ", or shorten the system prompt" if system else ""
            raise ContextFullError(
                f"the conversation has {len(prompt_ids)} tokens but the context holds {n_ctx}",
                ctx_fix(self.target, f"type /reset to start a new conversation{also}"),
            )
        raise ContextFullError(
            f"the message needs {len(prompt_ids)} tokens but the context holds {n_ctx}",
            ctx_fix(self.target, "shorten it"),
        )

    def _cut_answer(self, messages: list[dict], text: str, names: list[str],
                    calls: Sequence[ToolCall]) -> tuple[dict, str | None]:
        """The message a transcript keeps of an answer cut inside its calls, as a client sends one
        back: the content before the calls and the calls written whole (``calls``), never the
        markup of the call cut off, which the next turn's prompt would carry as if it were written.
        A template that cannot take those calls back (Llama 3's, one call a turn) gets the content.
        With it, the conversation rendered closed where this had to render it to know (else None):
        the record's rendering."""
        content = {"role": "assistant", "content": style_for(self.template).parse_cut(text, names)[0]}
        if not calls:
            return content, None
        message = {**content, "tool_calls": [call.as_openai() for call in calls]}
        try:
            rendered = render_conversation(self.template, self._with_system([*messages, message]), self.tools,
                                           add_generation_prompt=False)[0]
        except ChatTemplateError:
            return content, None
        return message, rendered

    def _record(self, messages: list[dict[str, str]], prompt_text: str, prompt_ids: list[int],
                result: GenerationResult, cut: dict | None = None, rendered: str | None = None) -> None:
        """Append the answer to the transcript (``cut``: the message kept of an answer cut inside its
        calls, ``_cut_answer``, with ``rendered``, the conversation with it as that rendered it where it
        did), keeping the ids the target generated where the template agrees."""
        messages = [*messages, cut if cut is not None else {"role": "assistant", "content": result.text}]
        if rendered is None:
            rendered = render_conversation(self.template, self._with_system(messages), self.tools,
                                           add_generation_prompt=False)[0]
        ids = prompt_ids + result.token_ids
        text = prompt_text + result.text
        if result.finish_reason == "eos":
            eos_text = self.target.token_text(ids[-1])
            if rendered.startswith(text + eos_text):
                text += eos_text  # the template ends the turn with this very token
            else:
                ids.pop()  # the template ends turns otherwise: its own text follows
        if not rendered.startswith(text):
            ids, text = [], ""
        self.transcript = Transcript(messages, ids, text)

    def _repair_caches(self) -> None:
        """After an interruption: every sequence back in step with its backend (engine rewinds did
        the rest), and no drafter index left half-updated."""
        sequence_for(self.target).repair()
        if self.draft is not None:
            sequence_for(self.draft).repair()
        if self.engine.drafter is not None:
            self.engine.drafter.recover()

    # ---- speculation ----------------------------------------------------------------
    @property
    def method(self) -> str:
        return self.engine.method

    @property
    def draft_len(self) -> int:
        """The draft length the next answer uses (adaptive: the longest it may choose)."""
        return resolve_draft_len(self.method, self._draft_len)

    def set_method(self, method: str) -> None:
        """Switch the speculation method between answers, loading the draft model if it is needed now."""
        check_method(method)
        if needs_draft_model(method) and self.draft is None:
            if self._load_draft is None:
                raise UsageError(f"method {method!r} needs a draft model", "start specrun chat with --draft MODEL")
            self.draft = self._load_draft()
            if self._deep_context and self._settle_context is not None:  # as the target chose again
                draft = self.draft  # (then tune's entry below is read under the keys as they are now)
                self._settle_context(self._deep_context, (draft,), lambda: sequence_for(draft).reset())
            if self._tuned is None and self._find_tuned is not None:
                self._use_tuned(self._find_tuned(self.draft))
        kind = heads_kind(method)
        if kind is not None and heads_of_kind(self._drafter_options.heads, kind) is None:
            if self._load_heads is None:
                raise UsageError(f"method {method!r} needs heads for the target",
                                 "start specrun chat with --heads FILE")
            self._drafter_options = dataclasses.replace(self._drafter_options, heads=self._load_heads(kind=kind),
                                                        auto_heads=None)  # a later /method auto looks again
        elif is_adaptive(method) and self._load_heads is not None:  # auto's own, as it would open with them
            self._drafter_options = with_auto_heads(self._drafter_options, self._load_heads(kind=None))
        self._open_for_trees(method)
        check_trees_for(method, self.target, self._drafter_options.lookahead, switch="/method")
        self._rebuild_drafter(method)

    def _open_for_trees(self, method: str) -> None:
        """A lookahead window's trees asked of a target opened for chains (a llama.cpp context sizes
        its sequences when made): the context made again for them, the conversation read again once
        (`/method lookahead` in a chat opened for chains was refused, the fix to start again). Not
        where heads read the target's states (check_trees_for then says why)."""
        paths = method_trees(method, self._drafter_options.lookahead).paths
        support = self.target.tree_support
        if not paths or support.available or not support.reopenable or getattr(self.target, "tracking_hidden", False):
            return
        self._empty_caches()
        try:
            self.target.open_for_trees(paths)
        except SpecrunError:
            return  # a context that failed (memory): it keeps the one it had, and check_trees_for says so
        if self._on_note is not None:
            self._on_note(f"the target's context is made again for the lookahead window's trees ({paths} paths); "
                          "the conversation is read again once")

    def _rebuild_drafter(self, method: str) -> None:
        """Draft with a drafter of ``method`` built now from the session's options, the old one closed."""
        drafter = self._drafter_for(method)
        previous = self.engine.drafter
        if previous is not None:  # first: a head drafter stops the target's hidden states when closed
            previous.close()
        self.engine.set_drafter(drafter, method)

    def hold_window_alternative(self) -> None:
        """From now on auto holds the draft model's windowed cache beside its full one (as with
        ``window_alternative``): for a server that opened without it in case it would decode in slots
        (which draft from their own caches) and then found it answers one at a time. Before anything
        is fed: the drafter is built again."""
        if self._window_alternative:
            return
        self._window_alternative = True
        if is_adaptive(self.method) and self.draft is not None:  # else none to hold (setup.auto_draft_window)
            self._rebuild_drafter(self.method)

    def slot_drops(self, exact: bool = False) -> str:
        """What this session drafts with that a slot's would not (on_slot; ``exact``: slots
        opened for --exact): "" where nothing."""
        options = self._drafter_options
        # asked only of a method with heads (MLX's answer runs the model once, splitting its head off)
        hidden = needs_heads(self.method) and bool(getattr(self.target, "slots_hidden", False))
        try:
            check_slots_method(self.method, hidden)
        except UsageError:
            allowed = SLOT_PARTS + (SLOT_HEAD_KINDS if hidden else ())
            return next(part for part in self.method.split("+") if part not in allowed)
        heads = options.heads[0] if isinstance(options.heads, tuple) else options.heads
        if (heads is not None or options.auto_heads) and self._slot_heads_problem():
            return f"the {options.auto_heads or heads.config.kind} heads"
        if options.branches and not self.slot_tree_paths(exact):
            return "token trees"
        if options.auto_lookahead:
            return "a lookahead window"
        if self.draft_learns() and getattr(self._learn, "explicit", True):  # asked for, not the default
            return "the draft model's learning online (--learn)"
        return ""

    def draft_learns(self) -> bool:
        """Does this session's draft model learn online (its adapters, which slots' drafts do not)?"""
        drafter = self.engine.drafter
        return drafter is not None and any(getattr(member, "learner", None) is not None and
                                           isinstance(member, DraftModelDrafter) for member in drafter.members)

    def _slot_learner(self, heads, method: str):
        """A slot's reader of the learner this session's heads learn with (one learner: every
        slot's text teaches it, every slot drafts with its latest weights); None where they do not
        learn (no --learn default or flag, heads that cannot)."""
        reader_for = getattr(self._learn, "reader_for", None)  # training/online.Learning's
        if reader_for is None or heads is None:
            return None
        kind = heads_kind(method) if needs_heads(method) else (
            self._drafter_options.auto_heads if is_adaptive(method) else None)
        chosen = heads_of_kind(heads, kind) if kind is not None else None
        return reader_for(chosen, self.target) if chosen is not None else None

    def slot_tree_paths(self, exact: bool = False) -> int:
        """The paths a slot's tree may have (the target's, opened for trees): where this session
        drafts trees and its target's slots can hold them (llama.cpp's, not with ``exact``; MLX's,
        not on a hybrid); else 0. No limit (MLX's): a path a node of the most a slot's pass holds."""
        problem = getattr(self.target, "slots_tree_problem", None)
        if not self._drafter_options.branches or problem is None or problem(exact):
            return 0
        return self.target.tree_support.max_paths or PREFILL_CHUNK

    def slot_heads(self):
        """The heads this session's slots draft with (on_slot), None where none: its own, where
        the target's slots give hidden states and the heads read the output head's input
        (heads.kinds.SLOT_KINDS: chains on slots, their weights shared, their states each slot's)."""
        heads = self._drafter_options.heads
        return None if heads is None or self._slot_heads_problem() else heads

    def _slot_heads_problem(self) -> str:
        """Why this session's heads cannot draft on its target's slots ("" where they can)."""
        heads = self._drafter_options.heads
        if heads is None:
            return ""
        if isinstance(heads, tuple):
            return "slots draft with one kind of heads"
        if not getattr(self.target, "slots_hidden", False):
            return f"the {self.target.name} backend's slots give no hidden states"
        kind = kind_of(heads)
        if kind.name not in SLOT_KINDS:
            return f"its {kind.name} heads run beside one sequence only"
        if kind.reads == "layers":
            try:
                self.target.hidden_support.check_layers(self.slot_layers(heads))
            except ValueError as exc:
                return f"its {kind.name} heads read layer outputs: {exc}"
        return ""

    def slot_layers(self, heads=None) -> tuple[int, ...]:
        """The target layers the slots' heads read (EAGLE-3's); () the output head's input."""
        heads = heads if heads is not None else self._drafter_options.heads
        if heads is None or isinstance(heads, tuple) or kind_of(heads).reads != "layers":
            return ()
        return eagle3_layers(heads, self.target)

    def on_slot(self, target: Backend, draft: Backend | None, exact: bool = False) -> ChatSession:
        """A session answering as this one does (method, draft settings, verification, stored
        costs) on a slot of the same models (backends/slots.py), for a server decoding several
        requests together. Its drafters are the ones a slot can feed (check_slots_method): chains
        from prompt lookup, an n-gram pool of its own (the pool file stays this session's), the
        draft model's slot and heads reading the target slot's hidden states (``slot_heads``); trees
        where the slots hold them (``slot_tree_paths``), else chains. Heads that learn online go on
        learning, every slot's text teaching the one learner (``_slot_learner``); the draft model's
        adapters do not learn on slots."""
        method = self.method
        check_slots_method(method, bool(getattr(self.target, "slots_hidden", False)))
        problem = self._slot_heads_problem()
        if problem and needs_heads(method):
            raise UsageError(f"--parallel decodes requests together, and method {method!r} cannot draft on slots: "
                             f"{problem}", "use --parallel 1 with it, or a method without heads (or auto)")
        heads = self.slot_heads()
        trees = bool(self.slot_tree_paths(exact))
        options = dataclasses.replace(self._drafter_options, ngram_cache=None, heads=heads,
                                      branches=self._drafter_options.branches if trees else 0,
                                      auto_heads=self._drafter_options.auto_heads if heads is not None else None,
                                      lookahead=None, auto_lookahead=False, learner=self._slot_learner(heads, method),
                                      draft_learner=None)
        return ChatSession(target, draft, method, system_prompt=self.system_prompt, drafter_options=options,
                           draft_len=self._draft_len, draft_min_prob=self._draft_min_prob, tuned=self._tuned,
                           threads=self._threads, chain=self._chain if trees else True,
                           tree_nodes=self._tree_nodes if trees else 0, tools=self.tools, tool_choice=self.tool_choice,
                           verification=self.engine.passes.verification, template_variables=self.template.variables)

    def total_stats(self) -> Stats:
        """Every answer's statistics added up."""
        last = self.answers[-1] if self.answers else Stats()
        total = Stats(method=self.method, drafters=last.drafters, draft_len=last.draft_len, adaptive=last.adaptive)
        for stats in self.answers:
            total.add(stats)
        return total

    # ---- lifetime -------------------------------------------------------------------
    def close(self) -> None:
        if self.answers and self.draft is not None:
            remember_run(self.engine, self.target, self.draft, self._threads, self._tuned,
                         busy=any(stats.busy_passes for stats in self.answers))
        if self.engine.drafter is not None:
            if self.engine.last_context:
                self.engine.drafter.finish(self.engine.last_context)  # the n-gram pool learns the last answer
            self.engine.drafter.close()
        self.target.close()
        if self.draft is not None:
            self.draft.close()

    def __enter__(self) -> ChatSession:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def open_chat(
    target_spec: str,
    draft_spec: str | None,
    method: str,
    options: LoadOptions,
    *,
    system_prompt: str | None = None,
    draft_len: int | None = None,
    draft_min_prob: float | None = None,
    ngram_cache: Path | None = None,
    branches: int = 0,
    heads: str | None = None,
    lookahead: LookaheadSizes | None = None,
    chain: bool = False,
    tree_nodes: int = 0,
    on_note: Callable[[str], None] | None = None,
    tools: Sequence[Tool] = (),
    tool_choice: ToolChoice = ToolChoice(),
    verification: Verification = Verification(),
    learn: Callable | None = None,
    window_alternative: bool = True,
    template_variables: dict | None = None,
    reasoning_budget: tuple[int, str] = (-1, ""),
) -> ChatSession:
    """Load the pair for ``method`` (the draft model only if it needs one) and start a session.

    With a ``draft_spec`` the method does not need yet, the draft is loaded on the
    first ``/method`` that does. ``ngram_cache``: the n-gram pool's file, loaded now and
    saved when the session closes (or switches method). ``branches``: second guesses a
    drafter may add (token trees; the target must be opened with tree paths). ``heads``: the
    heads file of a head method (--heads; None: found by alias), loaded when a method needs it.
    ``chain``, ``tree_nodes``: --chain and --tree-nodes (auto's lookahead window, where the
    stored costs add one, must fit them). ``on_note``: told what a first run measured of this
    machine (sessions/kernels.py) and the window auto drafts with. ``verification``: --verify and
    --accept (exact by default).
    """
    check_method(method)
    target, draft = open_pair(target_spec, draft_spec if needs_draft_model(method) else None, options, on_note)

    def opened_draft():  # for a /method that needs one: through the window tune kept, as one loaded now is
        loaded = open_settled_draft(target, target_spec, draft_spec, options, on_note)
        return tuned_window(loaded, load_tuned(target, loaded, options.threads), options, on_note)

    load_draft = opened_draft if draft is None and draft_spec is not None else None
    try:
        drafter_options = DrafterOptions(branches=branches, lookahead=lookahead)
        if ngram_cache is not None:
            drafter_options = DrafterOptions(ngram_cache, vocabulary_fingerprints(target), branches=branches,
                                             lookahead=lookahead)
        loaded: dict = {}  # heads read, by path: each /method's are read once a session
        if needs_heads(method):
            drafter_options = dataclasses.replace(drafter_options, heads=load_target_heads(
                target_spec, heads, target, options.registry, heads_kind(method), loaded, on_note))
        # auto's heads, checked now, kept below where the stored costs say they pay
        auto_heads = heads_for_auto(target_spec, heads, target, options.registry, on_note, loaded) \
            if is_adaptive(method) else None
        # The heads are good: flash attention by what it costs here (sessions/kernels.py), then the
        # stored costs found under the key it picks.
        settle_pair(target, draft, options, on_note)
        tuned = load_tuned(target, draft, options.threads)
        draft = tuned_window(draft, tuned, options, on_note)

        def paying(found):
            stored = tuned if tuned is not None else load_target_entry(target, options.threads)
            return paying_heads(found, heads, target, stored, on_note,
                                lambda costs: remember_probe(target, options.threads, costs))

        def load_heads(kind: str | None):
            if kind is None:
                return paying(heads_for_auto(target_spec, heads, target, options.registry, on_note, loaded))
            return load_target_heads(target_spec, heads, target, options.registry, kind, loaded, on_note)

        drafter_options = with_auto_heads(drafter_options, paying(auto_heads))
        return ChatSession(target, draft, method, system_prompt=system_prompt, load_draft=load_draft,
                           load_heads=load_heads,
                           draft_len=draft_len, draft_min_prob=draft_min_prob, tuned=tuned,
                           drafter_options=drafter_options,
                           find_tuned=lambda loaded: load_tuned(target, tuned_key_model(loaded), options.threads),
                           threads=options.threads, chain=chain, tree_nodes=tree_nodes, on_note=on_note,
                           tools=tools, tool_choice=tool_choice, verification=verification, learn=learn,
                           window_alternative=window_alternative and options.window is None,
                           template_variables=template_variables, reasoning_budget=reasoning_budget,
                           settle_context=lambda context, backends, empty: settle_for_context(
                               backends, options, context, empty, on_note),
                           find_settled_tuned=lambda loaded: load_tuned(
                               target, None if loaded is None else tuned_key_model(loaded), options.threads))
    except BaseException:
        target.close()
        if draft is not None:
            draft.close()
        raise



