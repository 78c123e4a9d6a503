"""The speculative loop: plan → draft → verify → rewind → emit → observe, over any backend.

Three layers (mlx-lm's generate_step / stream_generate / generate shape):
``SpeculativeEngine.steps`` yields one ``Step`` per target verify pass,
``stream`` turns steps into typed events with text and running statistics,
``run`` returns the finished ``GenerationResult`` (the events: engine/events.py). How drafts
become target passes and a verdict is engine/passes.py. The engine never prints.
"""

from __future__ import annotations

import codecs
import dataclasses
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from time import perf_counter

import numpy as np

from specrun.allocator import keep_freed_arrays
from specrun.backends.base import Backend, near_tie_rows
from specrun.backends.kv import KVSequence, sequence_for
from specrun.control.policy import PLAIN, AdaptivePolicy, FixedPolicy, Plan, SpeculationPolicy, StepReport
from specrun.drafters.base import EMPTY_PROPOSAL, Drafter, Proposal
from specrun.drafters.methods import is_adaptive
from specrun.engine.constrained import ConstrainedRun, DraftGrammar
from specrun.engine.events import Finished, GenerationResult, Step, TextChunk, TokenLogprob
from specrun.engine.passes import DeferredDrafts, TargetPasses, Verification
from specrun.engine.stats import PLAIN as PLAIN_SOURCE, Stats
from specrun.errors import ContextFullError, UsageError
from specrun.grammar import Grammar
from specrun.reasoning_budget import BUDGET_SOURCE
from specrun.sampling import SamplingSettings, for_vocabulary, shaped_row, token_logprobs, with_drafting_state
from specrun.verify import TreeVerdict, Verdict


# The most drafted tokens a tree brings to one verify pass unless a run says otherwise: the
# policy keeps only the second guesses that pay on this machine's pass costs (control/trees.py),
# so the cap matters where passes are cheap (a GPU).
DEFAULT_TREE_NODES = 24
# A greedy choice within this many logits of the runner-up may differ from plain decoding's
# where a verify pass rounds otherwise: reading the same context in a batch moved logits by up
# to ~0.026 on the demo target (llama.cpp's F16 KV cache; sessions/divergence.py), and a gap
# moves by up to twice that.
TIE_MARGIN = 0.05


@dataclass(frozen=True)
class GenerationParams:
    """What to generate. ``draft_len`` 0 (or no drafter) is plain decoding.

    adaptive: choose the draft length each step (at most ``draft_len``) from measured
    acceptance and costs, and stop speculating while plain decoding is faster.
    tree_nodes: the most nodes a branching proposal may bring to one verify pass (0:
    chains only; a target that cannot hold the tree verifies the main chain). Drafters
    branch only when asked to (DrafterOptions.branches). Adaptive, the policy keeps the
    second guesses worth their place in the pass.
    tie_margin: see below; TIE_MARGIN is what the sessions pass.
    """

    max_new_tokens: int = 128
    draft_len: int = 4
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    stop_at_eos: bool = True
    adaptive: bool = False
    tree_nodes: int = DEFAULT_TREE_NODES
    # greedy: count the tokens chosen where another token's logit came within this margin of the
    # top (Stats.near_ties): where batched passes round differently from one-token ones, plain
    # decoding may choose otherwise there. 0: not counted (--exact, where kernels round alike).
    tie_margin: float = 0.0
    # What the output must follow (JSON schema, GBNF...), compiled for the target's vocabulary;
    # None: free text. Speculation stays lossless against constrained plain decoding.
    grammar: Grammar | None = None
    # each token's log-probability with this many likeliest alternatives (0: the token's alone;
    # None: not computed, and greedy passes read only the backend's argmax)
    logprobs: int | None = None
    # those log-probabilities after the sampling settings (top-k, top-p, min-p, temperature: the
    # distribution each token was drawn from, llama-server's post_sampling_probs), not at temperature 1
    logprobs_sampled: bool = False
    # control tokens whose text the answer's text shows (a reasoning model's <think> tags where they
    # are control tokens, as llama.cpp's preserved tokens): id -> its text's bytes
    shown_tokens: dict[int, bytes] = field(default_factory=dict)


def check_prompt(prompt: Sequence[int], n_ctx: int, fix: str = "shorten the prompt, or raise --ctx") -> None:
    """A prompt the engine can start from: not empty, and leaving room for a token (``fix``: what a
    prompt too long is told, sessions/setup.ctx_fix)."""
    if not prompt:
        raise UsageError("the prompt is empty", "give a prompt as an argument or on stdin")
    if len(prompt) >= n_ctx:
        raise ContextFullError(f"the prompt has {len(prompt)} tokens but the context holds {n_ctx}", fix)


def check_bias(sampling: SamplingSettings, vocab_size: int) -> None:
    """A logit bias on tokens the target has, and a reasoning budget forcing only such tokens (the
    server checks its requests' biases before they queue)."""
    bad = next((token for token, _ in sampling.logit_bias if token >= vocab_size), None)
    if bad is not None:
        raise UsageError(f"--logit-bias names token {bad}, outside the target's vocabulary (0 to {vocab_size - 1})",
                         "give a token id the target has")
    budget = sampling.reasoning_budget
    bad = next((token for token in budget.forced if token >= vocab_size), None) if budget is not None else None
    if bad is not None:  # a forced row keeps that token's logit: it must have one
        raise UsageError(f"--reasoning-budget forces token {bad}, outside the target's vocabulary "
                         f"(0 to {vocab_size - 1})", "tokenize the tags with the target's own vocabulary")


def _deepest(draft_len: int, drafter: Drafter | None) -> int:
    """The draft length a run's statistics report: the length asked, or the drafter's own bound
    where it is lower (MTP heads asked for 16 draft at most their depth)."""
    if drafter is None:
        return 0
    bound = drafter.most_tokens
    return draft_len if bound is None else min(draft_len, bound)


def _drafters_part(report: StepReport, n_forced: int, more: Proposal | None) -> StepReport | None:
    """The step as the policy learns from it where a grammar forced ``n_forced`` tokens first:
    the drafters' chain after them (what pruning kept of ``more``), its accepted part and the
    context from after them. None where the pass alone is noted (``skip_pass``): forced tokens
    alone, a tree or merged proposals after them, or forced tokens the target did not all take."""
    kept = len(report.proposal) - n_forced
    if more is None or kept <= 0 or type(more) is not Proposal or not more.is_chain or report.n_accepted < n_forced:
        return None
    return dataclasses.replace(report, proposal=more.prefix(kept), path=tuple(range(report.n_accepted - n_forced)),
                               context_len=report.context_len + n_forced, forced=n_forced)


def _emit(
    context: list[int], proposal: Proposal, verdict: Verdict | TreeVerdict, room: int, eos_ids: Collection[int]
) -> bool:
    """Extend ``context`` by a verdict's tokens (the accepted drafts, then the target's own), up to
    and including an EOS and at most ``room`` of them. Returns whether an EOS was among them."""
    emitted = [*(proposal.tokens[node] for node in verdict.path), verdict.next_token]
    hit_eos = next((i for i, t in enumerate(emitted) if t in eos_ids), None)
    if hit_eos is not None:
        emitted = emitted[: hit_eos + 1]
    context.extend(emitted[:room])
    return hit_eos is not None


def _logprobs(rows: np.ndarray, indices: Sequence[int], tokens: Sequence[int], top: int) -> tuple[TokenLogprob, ...]:
    """Each emitted token's log-probability under the pass's row it was chosen from (``indices``:
    the root's row, then each accepted node's), with the ``top`` likeliest tokens'."""
    return tuple(TokenLogprob(token, *token_logprobs(rows[index], token, top)) for index, token in zip(indices, tokens))


def trace_record(step: Step, context_len: int, plan: str, policy: SpeculationPolicy | None,
                 queued: bool = False) -> dict:
    """A step as `--trace` writes it: the context it began at, what was planned ("prefill" for the
    first token, "draft", "plain": the policy asked no drafter, or "forced": a grammar's forced
    tokens drafted in the drafters' place), who drafted, what was drafted
    and kept, its two clocks in milliseconds, and the adaptive policy's state after it (its gate
    and each drafter's controller: AdaptivePolicy.explain), which says why the next step does what
    it does. ``queued``: the pass was queued by the step before (a backend reading ahead), so its
    verify_ms is the wait for it, not its cost; said only where true."""
    record = {
        "context": context_len,
        "plan": plan,
        "source": step.source or PLAIN_SOURCE,
        "drafted": step.n_drafted,
        "accepted": step.n_accepted,
        "emitted": len(step.tokens),
        "draft_ms": round(1e3 * step.draft_seconds, 3),
        "verify_ms": round(1e3 * step.verify_seconds, 3),
        "policy": policy.explain() if isinstance(policy, AdaptivePolicy) else None,
    }
    if queued:
        record["queued"] = True
    return record


class StepClock:
    """The clocks of a run: generation since it started, and each step's three readings.

    A step drafts from ``start_step`` to ``verifying`` (asking the drafters, cutting the
    proposal) and verifies from there to ``passed`` (the pass and the rewind after it); its
    bookkeeping after ``passed`` (the controllers, the gate) is in neither.
    """

    __slots__ = ("clock", "started", "step_started", "verify_started", "passed_at", "yielded_at")

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.started = clock()
        self.step_started = self.verify_started = self.passed_at = self.yielded_at = self.started

    def start_step(self) -> None:
        self.step_started = self.clock()

    def yielding(self) -> float:
        """The step's tokens go to the caller (its time until the next step starts is the caller's):
        the seconds since generation started."""
        self.yielded_at = self.clock()
        return self.yielded_at - self.started

    def left_out(self, work: Callable[[], None]) -> None:
        """Run ``work`` on no clock of the run's: generation's seconds and the cycle the next step is
        timed from (``yielded_at``, where plain steps read ahead) move on past it (a trace's record)."""
        before = self.clock()
        work()
        took = self.clock() - before
        self.started += took
        self.yielded_at += took

    def verifying(self) -> None:
        self.verify_started = self.clock()

    def passed(self) -> None:
        self.passed_at = self.clock()

    @property
    def draft_seconds(self) -> float:
        return self.verify_started - self.step_started

    @property
    def verify_seconds(self) -> float:
        return self.passed_at - self.verify_started

    def elapsed(self) -> float:
        """Seconds since generation started."""
        return self.clock() - self.started


class NearTieWatch:
    """Counts a greedy run's tokens chosen at a near-tie (GenerationParams.tie_margin).

    Until a pass of several tokens writes the cache, every pass is plain decoding's own, bit
    for bit: no choice can part from it, and near-ties are looked for (0.1-0.2 ms a step of a
    49k vocabulary, ~1% of a plain step) only from then on; from the start where the text
    began on a cache earlier passes wrote (a chat's next turn), or where passes keep hidden
    states (head drafters: llama.cpp then outputs every row, the prompt's too); and from the
    first pass that carried other sequences beside this one (a server's slots: the batch's shape
    moves its rounding, so a lone plain run may choose otherwise at a near-tie).
    """

    def __init__(self, target: KVSequence, margin: float, rounded_apart: bool) -> None:
        self.target = target
        self.margin = margin
        self.rounded_apart = rounded_apart  # may a pass have rounded otherwise than plain decoding's?

    @classmethod
    def of_run(cls, target: KVSequence, params: GenerationParams, reused: bool) -> NearTieWatch | None:
        """The watch of a run whose prefill ``reused`` a cached prefix, or None where near-ties
        are not counted (sampling, or no margin)."""
        if params.tie_margin > 0 and params.sampling.greedy:
            return cls(target, params.tie_margin, reused or target.tracking or target.sharing > 0)
        return None

    def in_prefill(self, prompt_logits: np.ndarray) -> int:
        """1 where the first token was chosen at a near-tie of the prefill's row (V,), else 0."""
        if not self.rounded_apart:
            return 0
        return int(near_tie_rows(prompt_logits[None], self.margin)[0])

    def in_pass(self, proposal: Proposal, verdict: Verdict | TreeVerdict, n_kept: int,
                rows: np.ndarray | None = None) -> int:
        """How many of a step's ``n_kept`` tokens were chosen at a near-tie of the pass's rows they
        came from (the root's, then each accepted node's): ``rows`` where the pass read them (under a
        grammar, masked: the choice was among the tokens it allows), else the backend's last argmax pass."""
        self.rounded_apart = self.rounded_apart or len(proposal) > 0 or self.target.sharing > 0
        if not self.rounded_apart:
            return 0
        indices = [0, *(1 + node for node in verdict.path)][:n_kept]
        if rows is not None:
            return int(near_tie_rows(rows[indices], self.margin).sum())
        return int(self.target.backend.last_pass_ties(indices, self.margin).sum())


class SpeculativeEngine:
    """A target backend and an optional drafter, with the target's cache kept across calls.

    The first token comes from the prefill pass, whatever the drafter: the prompt's last
    token costs a batched pass next to nothing, and drafting starts from a known token.
    From then on, between verify passes, the target's cache holds the context minus its
    last token, which is fed together with the drafts so one pass yields k + 1
    distributions. After a finished run both caches hold exactly prompt + output.

    Each step the speculation policy (control/policy.py) plans: a plain step or which
    drafters to ask; ``policy`` is the adaptive one, which keeps the machine's measured
    costs across runs (``policy.use_tuned``, ``policy.forget_acceptance``).
    ``verification``: how drafts are verified (engine/passes.py): exact by default; a lossy rule
    there labels every run's statistics (``Stats.acceptance``).
    """

    def __init__(
        self,
        target: Backend,
        drafter: Drafter | None = None,
        method: str | None = None,
        clock: Callable[[], float] = perf_counter,
        verification: Verification = Verification(),
    ) -> None:
        keep_freed_arrays()  # each pass's rows in memory already mapped (specrun/allocator.py)
        self.target = sequence_for(target)
        self.passes = TargetPasses(self.target, verification)
        self.clock = clock  # injectable so tests can give fake models exact costs
        self.last_context: list[int] = []  # prompt + output of the latest run
        self.grammar_blocked = False  # did the latest run end where its grammar allowed no token?
        self.grammar_problem = ""  # why, where it did: llguidance's error, or that no token was allowed
        self.policy = AdaptivePolicy(clock)
        # told (tokens read, prompt tokens) as a long prompt is read: a progress bar (TargetPasses.prefill)
        self.on_prefill: Callable[[int, int], None] | None = None
        # told each step's record (``trace_record``: what it did and the policy's state after it), for
        # `--trace`; tracing reads the policy, never moves it
        self.on_trace: Callable[[dict], None] | None = None
        self.set_drafter(drafter, method)

    def set_drafter(self, drafter: Drafter | None, method: str | None = None) -> None:
        """Speculate with ``drafter`` from the next run on (chat's /method); the caller closes the old
        one. A drafter that cannot serve the target raises from ``bind``, leaving the engine as it was."""
        if drafter is not None:
            drafter.bind(self.target, self.clock)
        self.drafter = drafter
        self.passes.drafter = drafter
        self.method = method or (drafter.name if drafter else "none")
        self.policy.set_drafter(drafter)

    def policy_for(self, params: GenerationParams) -> SpeculationPolicy | None:
        """This run's policy: None without a drafter; adaptive lengths (auto, ``adaptive``),
        or fixed ones, measured only where a chain's draft model must be gated."""
        drafter = self.drafter
        if drafter is None or params.draft_len <= 0:
            return None
        adaptive = self._adapts(params)
        if adaptive or (len(drafter.members) > 1 and self.policy.paid):
            max_paths = self.target.backend.tree_support.max_paths
            self.policy.configure(params.draft_len, adaptive, self._tree_nodes(params), max_paths)
            return self.policy
        # a fused pass is read as greedy ids: a grammar must mask its rows first, a lossy rule read them
        fusable = (drafter.can_defer(params.sampling) and self.target.can_feed_after and params.grammar is None
                   and params.logprobs is None and self.passes.acceptance is None
                   and not params.sampling.shapes_rows)  # penalties shape the rows by their text
        return FixedPolicy(drafter, fusable)

    # ---- layer 1: verify passes -------------------------------------------------
    def steps(self, prompt: Sequence[int], params: GenerationParams, stats: Stats) -> Iterator[Step]:
        """Yield one Step per target pass until max_new_tokens, EOS or a full context."""
        n_ctx = self.target.backend.n_ctx
        check_prompt(prompt, n_ctx)
        # DRY's sequence breakers looked up in the target's vocabulary, for every row shaped below
        params = dataclasses.replace(params, sampling=for_vocabulary(params.sampling, self.target.backend))
        sampling = params.sampling
        check_bias(sampling, self.target.backend.vocab.size)
        rng = np.random.default_rng(sampling.seed)
        eos_ids = self.target.backend.vocab.eos_ids if params.stop_at_eos else frozenset()
        context = list(prompt)
        stats.prompt_tokens = len(prompt)
        policy = self.policy_for(params)
        measured = policy is not None and policy.measured
        if measured:
            policy.start_text(len(context))
            # as the last pass found it: whether drafters read the prompt
            policy.share(self.target.sharing, self.target.shared_tokens)
        prompt_logits, reused = self._prefill(context, policy, params, stats)  # (V,): after the prompt
        ties = NearTieWatch.of_run(self.target, params, reused)  # None: not counted
        constrained = ConstrainedRun(params.grammar) if params.grammar is not None else None
        # drafters that draft within the grammar read it, from the step's context on (every run
        # sets it, None without a grammar: a run left unfinished cannot hand its own to the next)
        followers = [member for member in self.drafter.members if member.follows_grammar] if (
            self.drafter is not None) else []
        draft_grammar = DraftGrammar(constrained) if constrained is not None and policy is not None else None
        for member in followers:
            member.grammar = draft_grammar
        # drafters learning the target's distributions read every pass's rows that come to the host
        # (the first token's, the prompt's last row, where the passes' will: not plain greedy passes')
        row_readers = [member for member in self.drafter.members if member.reads_rows] if (
            self.drafter is not None) else []
        rows_come = (not sampling.greedy or params.logprobs is not None or constrained is not None
                     or self.passes.acceptance is not None or sampling.shapes_rows)
        self.grammar_blocked = False
        self.grammar_problem = ""
        self.passes.keep_rows = params.logprobs is not None
        # plain greedy steps read one token ahead where the target can (KVSequence.feed_argmax_ahead),
        # rows shaped by their text (penalties, a bias) where it shapes them on its device too
        # and sampled ones where it draws their tokens on its device too (one uniform a step, as the host)
        shaped_ahead = sampling.shapes_ahead and self.target.can_shape_ahead
        drawn = sampling.ahead_sampling(rng.random) if not sampling.greedy else None  # one for the run
        sampled_ahead = drawn is not None and self.target.can_sample_ahead and self.passes.acceptance is None
        reads_ahead = (self.target.can_read_ahead and (sampling.greedy or sampled_ahead) and constrained is None
                       and params.logprobs is None and (not sampling.shapes_rows or shaped_ahead))
        self.passes.start_text(sampling)
        clock = StepClock(self.clock)  # generation starts
        try:
            hit_eos = False
            # drafters learning the target's rows read them unshaped: a draft model applies the
            # penalties and bias itself as it drafts (drafters/draft_model.py)
            own_row = prompt_logits
            if params.max_new_tokens > 0:  # penalties and a bias shape the first token's row by the prompt
                prompt_logits = shaped_row(prompt_logits, sampling, context)
            if constrained is not None and params.max_new_tokens > 0:
                shaped = own_row is not prompt_logits
                prompt_logits = constrained.masked(prompt_logits)
                own_row = constrained.masked(own_row) if shaped and prompt_logits is not None else prompt_logits
                self.grammar_blocked = prompt_logits is None
            if params.max_new_tokens > 0 and not self.grammar_blocked:  # the first token (check_prompt left room)
                step, hit_eos = self._prefill_token_step(prompt_logits, context, eos_ids, params, rng, clock)
                if params.logprobs is not None:
                    step = dataclasses.replace(step, logprobs=_logprobs(
                        self._logprob_rows(prompt_logits[None], params, [0]), [0], step.tokens, params.logprobs))
                if constrained is not None:
                    self.grammar_blocked = not constrained.advance(step.tokens)
                if row_readers and rows_come:  # the first token's row: the prompt's last
                    for member in row_readers:
                        member.observe_rows(len(context) - 1, own_row[None])
                if ties is not None:
                    stats.near_ties += ties.in_prefill(prompt_logits)
                stats.generation_seconds = clock.yielding()
                if self.on_trace is not None:
                    prompt_len = len(context) - len(step.tokens)
                    clock.left_out(lambda: self.on_trace(trace_record(step, prompt_len, "prefill", policy)))
                yield step
            while (not hit_eos and not self.grammar_blocked
                   and (produced := len(context) - len(prompt)) < params.max_new_tokens and len(context) < n_ctx):
                remaining = params.max_new_tokens - produced
                context_len = len(context)
                clock.start_step()
                draft_len = min(params.draft_len, remaining - 1, n_ctx - context_len - 1)
                if draft_grammar is not None:
                    draft_grammar.base = context_len
                # tokens the grammar forces are drafted for free, in place of asking the drafters
                forced = constrained.forced(draft_len) if constrained is not None and policy is not None else None
                if forced is None and policy is not None and sampling.reasoning_budget is not None:
                    run = sampling.reasoning_budget.forced_run(context)[: max(draft_len, 0)]  # the budget's end
                    forced = Proposal(run, source=BUDGET_SOURCE) if run else None
                if measured:
                    policy.share(self.target.sharing, self.target.shared_tokens)  # as the last pass found it
                    policy.at_context(context_len, context, remaining)
                after_forced = None  # what the drafters proposed after forced tokens
                if forced is None:
                    plan = PLAIN if policy is None else policy.plan()
                    drafts = self._draft(policy, plan, context, draft_len, params, rng)
                else:  # the drafters continue after them, from the context the grammar leads to
                    plan = PLAIN if policy is None else policy.plan_after_forced()
                    drafts, after_forced = self._after_forced(forced, policy, plan, context, draft_len, params, rng)
                allowed = None
                if constrained is not None:
                    drafts, allowed = constrained.prune(drafts, sampling)
                    if not allowed[0].any():  # the grammar allows nothing: the answer ends here
                        self.grammar_blocked = True
                        break
                clock.verifying()
                queued = False  # was this step's pass queued by the step before (not timed as a pass)?
                # a plain step (planned, or nothing drafted) reads ahead where the next will be plain too
                plain_step = reads_ahead and isinstance(drafts, Proposal) and not drafts.tokens
                ahead = plain_step and remaining > 1 and (policy is None or policy.plain_next())
                if plain_step and (ahead or self.target.reading_ahead):
                    proposal = drafts
                    shaping = sampling.ahead_shaping(context) if shaped_ahead else None
                    verdict, queued = self.passes.plain_ahead(context[-1], ahead, shaping,
                                                              drawn if sampled_ahead else None)
                else:
                    proposal, verdict = self.passes.verify(context[-1], drafts, sampling, rng, allowed, context)
                # Keep the fed last token and the accepted drafts; drop the rejected tail.
                self.target.rewind(context_len + verdict.n_accepted)
                clock.passed()  # what follows is bookkeeping, neither drafting nor verifying
                hit_eos = _emit(context, proposal, verdict, remaining, eos_ids)
                if constrained is not None:
                    self.grammar_blocked = not constrained.advance(context[context_len:])
                if row_readers and self.passes.last_rows is not None:
                    kept_rows = [0, *(1 + node for node in verdict.path)][: len(context) - context_len]
                    for member in row_readers:
                        member.observe_rows(context_len, self.passes.own_rows()[kept_rows])
                if ties is not None:
                    stats.near_ties += ties.in_pass(proposal, verdict, len(context) - context_len,
                                                    self.passes.last_rows)
                if measured:
                    # a queued pass runs while the caller has the last step's tokens: where plain
                    # steps read ahead, every step is timed from then, speculating's as plain
                    # decoding's whole cycle (the caller's time left out of one kind only favoured it)
                    started = clock.yielded_at if reads_ahead else clock.step_started
                    policy.share(self.target.sharing, self.target.shared_tokens)  # what this pass held
                    report = StepReport(plan, proposal, tuple(verdict.path), started, clock.draft_seconds,
                                        clock.verify_seconds, context, context_len, queued)
                    if forced is not None:
                        report = _drafters_part(report, len(forced), after_forced)
                    if report is None:
                        policy.skip_pass()
                    else:
                        policy.observe(report)
                emitted = tuple(context[context_len:])
                read = [0, *(1 + node for node in verdict.path)][: len(emitted)]  # the root's row, the kept nodes'
                logprobs = () if params.logprobs is None else _logprobs(
                    self._logprob_rows(self.passes.last_rows[read], params, read), range(len(read)), emitted,
                    params.logprobs)
                step = Step(emitted, len(proposal), verdict.n_accepted, clock.draft_seconds, clock.verify_seconds,
                            proposal.source, logprobs)
                stats.generation_seconds = clock.yielding()
                if self.on_trace is not None:
                    planned = "forced" if forced is not None else "draft" if plan.draft else "plain"
                    clock.left_out(lambda: self.on_trace(trace_record(step, context_len, planned, policy, queued)))
                yield step
        finally:
            # Rewind is explicit, also on interruption: the cache never holds rejected drafts.
            self.target.rewind_to_prefix_of(context, limit=len(context) - 1)
            for member in followers:
                if member.grammar is draft_grammar:  # its own (a later run's stays)
                    member.grammar = None
            stats.generation_seconds = clock.elapsed()
            if measured:
                policy.end_text()
            if self.grammar_blocked:
                self.grammar_problem = constrained.problem
        self.last_context = context

    def _logprob_rows(self, rows: np.ndarray, params: GenerationParams, read: Sequence[int]) -> np.ndarray:
        """A pass's rows as its tokens' log-probabilities read them: as verified (log-softmax at
        temperature 1), or the log of the distribution the settings sample from (``logprobs_sampled``:
        a token they leave out at -inf, one-hot where greedy; under a sampler that carries a state
        along the text the pass's own, rows ``read`` of it, each at its text's state)."""
        if not params.logprobs_sampled:
            return rows
        sampled = (self.passes.last_p_target[list(read)] if params.sampling.carries_state
                   else self.passes.p_target(rows, params.sampling))
        with np.errstate(divide="ignore"):
            return np.log(sampled)

    def _prefill(
        self, context: list[int], policy: SpeculationPolicy | None, params: GenerationParams, stats: Stats
    ) -> tuple[np.ndarray, bool]:
        """Read the prompt, timed as prefill (Stats.prefill_seconds): the drafters first, as a draft
        model's prompt pass is prompt processing, not the cost of drafting tokens; then the target.
        Returns the target's logits after the prompt (V,) and whether a cached prefix was reused."""
        started = self.clock()
        if policy is not None and params.max_new_tokens > 1:
            for member in self.drafter.members:
                if policy.reads_prompt(member):
                    member.prefill(context)
        prompt_logits, reused = self.passes.prefill(context, self.on_prefill)
        stats.prefill_seconds = self.clock() - started
        return prompt_logits, reused

    def _prefill_token_step(
        self, prompt_logits: np.ndarray, context: list[int], eos_ids: Collection[int], params: GenerationParams,
        rng: np.random.Generator, clock: StepClock,
    ) -> tuple[Step, bool]:
        """The first token, taken from the prefill's row as plain decoding (and llama.cpp) takes it:
        a Step with no drafts and no pass of its own; and whether that token is an EOS.

        Feeding the prompt's last token with drafts for the first token instead (mlx-lm's way)
        yields one token fewer for the same passes: that token costs the batched prefill next to
        nothing (measured in an A/B on Spec-Bench: lookup+draft 1.01x, draft 1.014x, auto 1.01x),
        and the first token matches plain decoding's batch shape exactly."""
        clock.start_step()
        clock.verifying()
        verdict = Verdict(0, self.passes.pick(prompt_logits, params.sampling, rng))
        clock.passed()
        hit_eos = _emit(context, EMPTY_PROPOSAL, verdict, params.max_new_tokens, eos_ids)
        return Step(tuple(context[-1:]), 0, 0, clock.draft_seconds, clock.verify_seconds), hit_eos

    def _draft(
        self, policy: SpeculationPolicy | None, plan: Plan, context: list[int], draft_len: int,
        params: GenerationParams, rng: np.random.Generator,
    ) -> Proposal | DeferredDrafts:
        """The step's drafts: the planned drafters' proposal (none for a plain step), a tree cut to
        what the target verifies; for a fused plan, the lone draft model's greedy drafts left on
        the device, for the verify pass to be queued on (one host sync for both models)."""
        if plan.fused:
            deferred = self.drafter.propose_deferred(context, draft_len)
            return EMPTY_PROPOSAL if deferred is None else DeferredDrafts(deferred, self.drafter.name)
        proposal = self._ask_drafters(policy, plan, context, draft_len, self._drafting(params.sampling), rng)
        return proposal if proposal.is_chain else self._verifiable(proposal, params)

    def _after_forced(
        self, forced: Proposal, policy: SpeculationPolicy, plan: Plan, context: list[int], draft_len: int,
        params: GenerationParams, rng: np.random.Generator,
    ) -> tuple[Proposal, Proposal | None]:
        """The tokens a grammar forces, then what the planned drafters propose after them in the
        room ``draft_len`` leaves (a tree's nodes within the run's cap), for one pass; and that
        proposal of the drafters' (None: none asked). Not lookahead: it reads its own pass whole."""
        room = draft_len - len(forced)
        if room <= 0 or not plan.draft or self.drafter.reads_pass:
            return forced, None
        more = self._ask_drafters(policy, plan, [*context, *forced.tokens], room, self._drafting(params.sampling), rng)
        if not more.is_chain:
            nodes = self._tree_nodes(params) - len(forced)
            more = more.main_chain if nodes <= 0 else self._verifiable(more, dataclasses.replace(params, tree_nodes=nodes))
        return (forced.followed_by(more), more) if more.tokens else (forced, None)

    def _drafting(self, sampling: SamplingSettings) -> SamplingSettings:
        """The settings drafters draw under: the user's, a sampler that carries a state along the text
        at the state the text reached (a draft drawn from any row is exact; the text's state brings
        the draft's rows nearer the target's, each at the state its own path reaches)."""
        return with_drafting_state(sampling, self.passes.text_state) if sampling.carries_state else sampling

    def _ask_drafters(self, policy, plan: Plan, context, draft_len: int, sampling, rng) -> Proposal:
        """Ask the planned drafters in turn, each for the length the policy gives it; the first
        proposal the policy takes, else the longest made, cut by the policy (which, where the
        target verifies trees, merges the proposals passed over into it)."""
        if not plan.draft or draft_len <= 0:
            return EMPTY_PROPOSAL if not plan.draft else policy.chosen(EMPTY_PROPOSAL, (), len(context))
        best, made = EMPTY_PROPOSAL, []
        for member, drafter in enumerate(self.drafter.members):
            proposal = self.drafter.ask(member, context, policy.budget(drafter, draft_len), sampling, rng)
            if policy.takes(proposal, member, draft_len):
                best = proposal
                break
            if proposal.tokens:
                made.append(proposal)
            if len(proposal) > len(best):
                best = proposal
        passed_over = [each for each in made if each is not best]
        return policy.chosen(best, passed_over, len(context))

    def _tree_nodes(self, params: GenerationParams) -> int:
        """The most nodes a tree may have in this run: 0 where the target verifies chains only."""
        return params.tree_nodes if self.target.backend.tree_support.available else 0

    def _verifiable(self, proposal: Proposal, params: GenerationParams) -> Proposal:
        """A branching proposal within the run's node cap, or its main chain where the target
        cannot hold it (the session said why) or trees are off."""
        nodes = self._tree_nodes(params)
        if not nodes:
            return proposal.main_chain
        proposal = proposal.prefix(nodes)
        max_paths = self.target.backend.tree_support.max_paths
        if len(proposal.main_chain) == len(proposal) or (max_paths and len(proposal.tree.paths) > max_paths):
            return proposal.main_chain
        return proposal

    def _adapts(self, params: GenerationParams) -> bool:
        """Does this run choose its draft lengths as it goes (auto, or params.adaptive)?"""
        return self.drafter is not None and (params.adaptive or is_adaptive(self.method))

    # ---- layer 2: events --------------------------------------------------------
    def stream(
        self, prompt: Sequence[int], params: GenerationParams, *, complete_cache: bool = True
    ) -> Iterator[TextChunk | Finished]:
        """Yield a TextChunk per verify pass, then Finished with the result and statistics.

        complete_cache: after the last token, feed it to both models so their caches
        hold exactly prompt + output (what a next chat turn reuses).
        """
        backend = self.target.backend
        min_prob = self.drafter.min_prob if self.drafter is not None else 0.0
        stats = Stats(
            method=self.method,
            drafters="+".join(member.name for member in self.drafter.members) if self.drafter is not None else "",
            draft_len=_deepest(params.draft_len, self.drafter),
            adaptive=self._adapts(params),
            draft_min_prob=min_prob,
            acceptance=self.passes.verification.label,
        )
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        output: list[int] = []
        pieces: list[str] = []
        before = self.target.thread_tally()  # llama.cpp's thread count following the load
        for step in self.steps(prompt, params, stats):
            stats.record_step(
                step.n_drafted, step.n_accepted, len(step.tokens), step.draft_seconds, step.verify_seconds, step.source
            )
            if before is not None:  # each step: a stop string may end the answer at any chunk
                stats.count_threads(self.target.thread_tally().since(before))
            output.extend(step.tokens)
            shown = params.shown_tokens
            text = decoder.decode(b"".join(shown.get(t) or backend.token_bytes(t) for t in step.tokens))
            pieces.append(text)
            yield TextChunk(text, step.tokens, step.from_draft, stats, step.logprobs)
        tail = decoder.decode(b"", final=True)
        if tail:
            pieces.append(tail)
            yield TextChunk(tail, (), (), stats)
        if complete_cache:
            self.complete_caches()
        if before is not None:
            stats.count_threads(self.target.thread_tally().since(before))  # the caches' completing pass too
        yield Finished(GenerationResult("".join(pieces), output, stats, self._finish_reason(prompt, output, params),
                                        grammar_problem=self.grammar_problem))

    def complete_caches(self) -> None:
        """Feed the pending last token so both caches hold exactly the full context."""
        context = self.last_context
        self.target.sync(context)
        if self.drafter is not None:
            self.drafter.finish(context)

    def _finish_reason(self, prompt: Sequence[int], output: list[int], params: GenerationParams) -> str:
        if self.grammar_blocked:
            return "grammar"
        if output and params.stop_at_eos and output[-1] in self.target.backend.vocab.eos_ids:
            return "eos"
        if len(output) >= params.max_new_tokens:
            return "length"
        return "context"

    # ---- layer 3: the finished result -------------------------------------------
    def run(self, prompt: Sequence[int], params: GenerationParams, *, complete_cache: bool = True) -> GenerationResult:
        """Generate to the end and return text, token ids and statistics."""
        for event in self.stream(prompt, params, complete_cache=complete_cache):
            if isinstance(event, Finished):
                return event.result
        raise AssertionError("stream ended without Finished")
