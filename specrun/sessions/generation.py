"""One-shot generation: the library function behind ``specrun generate``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from specrun.engine.events import Finished, GenerationResult, TextChunk
from specrun.engine.loop import TIE_MARGIN, GenerationParams, SpeculativeEngine, check_prompt
from specrun.engine.passes import Verification
from specrun.registry.loading import LoadOptions, open_pair, prompts_as_chat
from specrun.sessions.kernels import DEEP_WAIT_S, settle_pair
from specrun.drafters.methods import (
    DrafterOptions,
    build_drafter,
    heads_kind,
    is_adaptive,
    needs_draft_model,
    needs_heads,
)
from specrun.control.gate import SpeculationGate
from specrun.errors import AnswerKeptError, SpecrunError
from specrun.grammar import Grammar, GrammarSpec
from specrun.sessions.reasoning import (
    ThinkTags, budget_rule, check_forced_allowed, generation_prompt, grammar_after_thinking, opens_thinking, shown_tags,
    split_reasoning, thinking_tags,
)
from specrun.sessions.templates import ChatTemplate, render_with_spans, tokenize_rendered
from specrun.sessions.trace import TraceFile
from specrun.sessions.tools import CUT_REASONS, Tool, ToolChoice, render_conversation, style_for
from specrun.sampling import SamplingSettings
from specrun.sessions.heads import heads_for_auto, load_target_heads, paying_heads, with_auto_heads, with_learner
from specrun.sessions.setup import (
    ctx_fix,
    TreeSettings,
    adapts_length,
    auto_draft_window,
    check_prompt_size,
    check_trees_for,
    default_trees,
    load_target_entry,
    load_tuned,
    remember_probe,
    tuned_window,
    near_tie_note,
    prompt_token_ids,
    remember_run,
    resolve_draft_len,
    resolve_min_prob,
    size_lookahead,
)


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    target: str
    draft: str | None
    method: str = "auto"
    max_new_tokens: int = 128
    draft_len: int | None = None  # None: chosen each step (adaptive), up to 16
    draft_min_prob: float | None = None  # None: the tuned confidence stop, else none
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    load: LoadOptions = field(default_factory=LoadOptions)
    drafter_options: DrafterOptions = field(default_factory=DrafterOptions)
    chat: bool | None = None  # the prompt as a user message in the chat template; None: see prompts_as_chat
    trees: TreeSettings = field(default_factory=TreeSettings)
    heads: str | None = None  # --heads: the heads file a head method drafts with (None: found by alias)
    grammar: GrammarSpec | None = None  # --grammar / --json-schema: what the answer must follow
    verification: Verification = field(default_factory=Verification)  # --verify, --accept: exact by default
    tools: tuple[Tool, ...] = ()  # --tools: functions the model may call (rendered through its template)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    template_variables: dict = field(default_factory=dict)  # --chat-template-kwargs, --reasoning
    reasoning_budget: tuple[int, str] = (-1, "")  # --reasoning-budget (-1: no limit) and its message
    on_note: Callable[[str], None] | None = None  # one-line notes for the user (stderr in the CLI)
    on_prefill: Callable[[int, int], None] | None = None  # (tokens read, prompt tokens) of a long prompt
    # --learn: the learner of the heads drafted with (heads, target) -> HeadsLearner (training/online.py)
    learn: Callable | None = None
    # --trace: where each step goes (sessions/trace.TraceFile); the caller closes it
    trace: TraceFile | None = None


def tool_prompt(target, request: GenerateRequest) -> tuple[list[int], GrammarSpec | None]:
    """The prompt as a user message beside the tools, in the target's template (the tools in its
    system message where the template takes none), and the grammar of a required call."""
    template = ChatTemplate.for_backend(target).with_variables(request.template_variables)
    offered = () if request.tool_choice.mode == "none" else request.tools  # "none": the model is not told of them
    text, spans = render_conversation(template, [{"role": "user", "content": request.prompt}], offered)
    grammar = request.grammar
    if request.tool_choice.forces_a_call:
        grammar = style_for(template).grammar(request.tools, request.tool_choice, backend=target)
    return tokenize_rendered(target, template, text, spans), grammar


def _thinking_rules(target, request: GenerateRequest, prompt_ids: list[int], grammar: GrammarSpec | None
                    ) -> tuple[SamplingSettings, dict, GrammarSpec | None, tuple[ThinkTags, bool] | None]:
    """For a reasoning model's chat prompt (sessions/reasoning.py): the sampling settings with
    --reasoning-budget's rule, its thinking tags that are control tokens (shown in the text, as
    llama-cli shows them), the grammar held after the thinking, and its tags with whether the
    prompt opened the block (None: the model thinks between no tags)."""
    template = ChatTemplate.for_backend(target).with_variables(request.template_variables)
    tags = thinking_tags(template)
    if tags is None:
        return request.sampling, {}, grammar, None
    text, spans = render_with_spans(template, [{"role": "user", "content": request.prompt}])
    opened = opens_thinking(tags, generation_prompt(text, spans))
    sampling = request.sampling
    budget, message = request.reasoning_budget
    if budget >= 0:
        sampling = dataclasses.replace(sampling, reasoning_budget=budget_rule(target, tags, prompt_ids, opened,
                                                                              budget, message))
        check_forced_allowed(sampling)
    if grammar is not None:
        grammar = grammar_after_thinking(grammar, target, tags, opened)
    return sampling, shown_tags(target, tags), grammar, (tags, opened)


def generate_text(request: GenerateRequest, on_text: Callable[[str], None] | None = None) -> GenerationResult:
    """Load the pair, generate, and return the result; ``on_text`` receives text as it streams."""
    draft_spec = request.draft if needs_draft_model(request.method) else None
    target, draft = open_pair(request.target, draft_spec, request.load, request.on_note)
    drafter = None
    try:
        options = request.drafter_options
        if options.ngram_cache is not None and not options.vocabulary:
            from specrun.drafters.ngram import vocabulary_fingerprints

            options = dataclasses.replace(options, vocabulary=vocabulary_fingerprints(target))
        if needs_heads(request.method):
            options = dataclasses.replace(options, heads=load_target_heads(
                request.target, request.heads, target, request.load.registry, heads_kind(request.method),
                on_note=request.on_note))
        auto_heads = None
        if is_adaptive(request.method):  # read and checked now; kept where they pay (below)
            auto_heads = heads_for_auto(request.target, request.heads, target, request.load.registry,
                                        request.on_note)
        check_trees_for(request.method, target, options.lookahead)
        chat = prompts_as_chat(request.target, request.load.registry, target, request.chat)
        check_prompt_size(target, request.prompt)  # before tokenizing megabytes that cannot fit
        if request.tools:
            prompt_ids, grammar = tool_prompt(target, request)
        else:
            prompt_ids = prompt_token_ids(target, request.prompt, chat, request.template_variables)
            grammar = request.grammar
        check_prompt(prompt_ids, target.n_ctx, ctx_fix(target, "shorten the prompt"))
        sampling, shown, grammar, thinking = _thinking_rules(target, request, prompt_ids, grammar) \
            if chat or request.tools else (request.sampling, {}, grammar, None)
        # The input is good: flash attention by what it costs here (a first run measures it and
        # notes so after the answer), which also picks the tuning key of the run's stored costs.
        kernel_notes: list[str] = []
        settle_pair(target, draft, request.load, kernel_notes.append, len(prompt_ids) + request.max_new_tokens,
                    wait_s=DEEP_WAIT_S)
        tuned = load_tuned(target, draft, request.load.threads)
        draft = tuned_window(draft, tuned, request.load, request.on_note)
        options = dataclasses.replace(options, draft_min_prob=resolve_min_prob(request.draft_min_prob, tuned))
        params = GenerationParams(
            request.max_new_tokens,
            resolve_draft_len(request.method, request.draft_len),
            sampling,
            adaptive=adapts_length(request.method, request.draft_len),
            tree_nodes=request.trees.nodes,
            # where kernels round batched passes otherwise (not --exact), count the choices that could flip
            tie_margin=0.0 if request.load.exact or request.method == "none" else TIE_MARGIN,
            grammar=Grammar.compile(grammar, target) if grammar is not None else None,
            shown_tokens=shown,
        )
        choice = None
        stored = tuned
        if draft is None:  # lookahead's sizes (and whether auto drafts with a window) from the pass costs
            tuned = stored = load_target_entry(target, request.load.threads)
            options, params, choice = size_lookahead(request.method, target, options, params, tuned, prompt_ids,
                                                     chain=request.trees.chain)
            if choice is not None and request.on_note is not None:
                request.on_note(choice.describe())
            if tuned is not None and choice is None:
                tuned = None  # no window: the target's own entry says nothing this run uses
        if auto_heads is not None:
            options = with_auto_heads(options, paying_heads(
                auto_heads, request.heads, target, stored, request.on_note,
                lambda costs: remember_probe(target, request.load.threads, costs)))
        trees = None if choice is not None else default_trees(request.method, target, stored, request.trees)
        if trees is not None:  # second guesses, where the stored pass costs say they pay
            options = dataclasses.replace(options, branches=trees.trees.branches)
            params = dataclasses.replace(params, tree_nodes=trees.trees.nodes)
            if request.on_note is not None:
                request.on_note(trees.describe())
        options = with_learner(options, request.method, target, request.learn, draft)
        if options.draft_learner is None:  # a draft learning online drafts from the cache it learns with
            options = dataclasses.replace(options, draft_window=auto_draft_window(
                request.method, draft, tuned, request.load.window, len(prompt_ids)))
        drafter = build_drafter(request.method, draft, options)
        if request.trees.paths and not target.tree_support.available and request.on_note is not None:
            request.on_note(f"token trees are off: {target.tree_support.reason}; verifying chains")
        engine = SpeculativeEngine(target, drafter, method=request.method, verification=request.verification)
        engine.on_prefill = request.on_prefill
        if request.trace is not None:
            request.trace.header(target=request.target, draft=draft_spec, method=request.method,
                                 drafters=drafter.name if drafter is not None else "none",
                                 **request.sampling.fields(), prompt_tokens=len(prompt_ids),
                                 max_new_tokens=request.max_new_tokens, adaptive=params.adaptive,
                                 draft_len=params.draft_len)
            engine.on_trace = request.trace.step
        if tuned is not None:
            tuned.apply(engine)  # the controllers start from measured costs
        if choice is not None:
            engine.policy.target_costs.preload(choice.costs)  # a probe's too: remembered for the next run
        if draft is None and choice is not None and params.adaptive and choice.predicted < 1.0 and \
                (tuned is None or not tuned.gate_off_gap):
            engine.policy.start_gate_off(SpeculationGate.FIRST_GAP)  # predicted slower: find out later, not first
        for event in engine.stream(prompt_ids, params, complete_cache=False):
            if isinstance(event, TextChunk) and on_text is not None and event.text:
                on_text(event.text)
            elif isinstance(event, Finished):
                if request.trace is not None:
                    request.trace.finish(event.result.stats)
                remember_run(engine, target, draft, request.load.threads, tuned,
                             busy=event.result.stats.busy_passes > 0)
                if event.result.finish_reason == "context":  # said before a save below can fail
                    event.result.context_fix = ctx_fix(target, "a shorter prompt leaves room for more")
                # the answer read apart from its thinking, and the calls it made after it (before a save
                # below can fail: the answer kept then is read the same)
                if thinking is not None:
                    offered = [] if request.tool_choice.mode == "none" else [tool.name for tool in request.tools]
                    event.result.reasoning, event.result.content = split_reasoning(event.result.text, *thinking,
                                                                                   offered)
                if request.tools and request.tool_choice.mode != "none":
                    template = ChatTemplate.for_backend(target)
                    names = [tool.name for tool in request.tool_choice.callable(request.tools)]
                    answer = event.result.content if event.result.content is not None else event.result.text
                    event.result.tool_calls, event.result.tool_call_cut = style_for(template).read_answer(
                        answer, names, cut=event.result.finish_reason in CUT_REASONS)
                if drafter is not None:
                    drafter.finish(engine.last_context)  # the n-gram pool learns the last tokens too
                    closing, drafter = drafter, None
                    try:
                        closing.close()  # saves the n-gram pool when it has a cache file
                    except SpecrunError as exc:  # a full disk: the answer still reaches the user
                        raise AnswerKeptError(event.result, exc) from exc
                if request.on_note is not None and event.result.stats.near_ties and event.result.stats.drafted:
                    request.on_note(near_tie_note(event.result.stats))
                if request.on_note is not None:
                    for note in kernel_notes:
                        request.on_note(note)
                return event.result
        raise AssertionError("stream ended without Finished")
    finally:
        if drafter is not None:
            drafter.close()  # saves the n-gram pool when it has a cache file
        target.close()
        if draft is not None:
            draft.close()
