"""The speculative loop: draft → verify → accept → rewind, over any backend.

Three layers (mlx-lm's generate_step / stream_generate / generate shape):
``SpeculativeEngine.steps`` yields one ``Step`` per target verify pass,
``stream`` turns steps into typed events with text and running statistics,
``run`` returns the finished ``GenerationResult``. The engine never prints.
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from time import perf_counter

import numpy as np

from specrun.control.adaptive import (
    CHEAP_PROBE_LEN,
    PAID_PROBE_LEN,
    DraftCosts,
    DraftLengthController,
    IdleBackoff,
    ProposalScores,
    SpeculationGate,
    TargetCosts,
)
from specrun.backends.base import Backend
from specrun.drafters.base import EMPTY_PROPOSAL, Drafter, Proposal
from specrun.errors import ContextFullError, UsageError
from specrun.backends.kv import sequence_for
from specrun.drafters.methods import is_adaptive
from specrun.sampling import SamplingSettings, probabilities, sample
from specrun.engine.stats import Stats
from specrun.verify import Verdict, verify_greedy, verify_sampled


# A step that spent more than this share of a plain pass proposing counts as speculating's
# for auto's SpeculationGate, even when nothing was verified (a cheap drafter that keeps
# looking and finding nothing, or proposals the controllers declined).
PROPOSING_SHARE = 0.02


@dataclass(frozen=True)
class GenerationParams:
    """What to generate. ``draft_len`` 0 (or no drafter) is plain decoding.

    adaptive: choose the draft length each step (at most ``draft_len``) from measured
    acceptance and costs, and stop speculating while plain decoding is faster.
    """

    max_new_tokens: int = 128
    draft_len: int = 4
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    stop_at_eos: bool = True
    adaptive: bool = False


@dataclass(frozen=True)
class Step:
    """One verify pass: the tokens it emitted; the first ``n_accepted`` came from the drafter.

    draft_seconds: from the step's start to the pass (asking the drafters, cutting the
    proposal); verify_seconds: the pass and the rewind after it. The step's bookkeeping
    after the pass (the controllers, the gate) is in neither.
    """

    tokens: tuple[int, ...]
    n_drafted: int
    n_accepted: int
    draft_seconds: float
    verify_seconds: float
    source: str = ""  # the drafter that proposed the drafts ("" for none)

    @property
    def from_draft(self) -> tuple[bool, ...]:
        return (True,) * self.n_accepted + (False,) * (len(self.tokens) - self.n_accepted)


@dataclass(frozen=True)
class TextChunk:
    """Event: text produced by one verify pass, with which tokens the drafter got right."""

    text: str
    token_ids: tuple[int, ...]
    from_draft: tuple[bool, ...]
    stats: Stats


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: Stats
    finish_reason: str  # "length", "eos" or "context"


@dataclass(frozen=True)
class Finished:
    """Event: the last one of a stream."""

    result: GenerationResult


class SpeculativeEngine:
    """A target backend and an optional drafter, with the target's cache kept across calls.

    The first token comes from the prefill pass, whatever the drafter: the prompt's last
    token costs a batched pass next to nothing, and drafting starts from a known token.
    From then on, between verify passes, the target's cache holds the context minus its
    last token, which is fed together with the drafts so one pass yields k + 1
    distributions. After a finished run both caches hold exactly prompt + output.
    """

    def __init__(
        self,
        target: Backend,
        drafter: Drafter | None = None,
        method: str | None = None,
        clock: Callable[[], float] = perf_counter,
    ) -> None:
        self.target = sequence_for(target)
        self.clock = clock  # injectable so tests can give fake models exact costs
        self.last_context: list[int] = []  # prompt + output of the latest run
        self._scores = ProposalScores()  # cheap proposals awaiting the output that settles them
        self._previous_pass: int | None = None  # tokens fed to the target's latest pass (None: the prefill)
        self.gate = SpeculationGate()  # auto: speculate only while it is measured faster than plain
        # Adaptive draft lengths, one controller per proposal source; kept across runs. Costs
        # belong to the machine, so they outlive the controllers: the target's verify costs
        # and each drafter's drafting costs, by drafter name.
        self.target_costs = TargetCosts()
        self.draft_costs: dict[str, DraftCosts] = {}
        self.controllers: dict[str, DraftLengthController] = {}  # by source, or "source:kind"
        self.prior_accepts: dict[str, float] = {}  # by drafter name: measured first-token acceptance
        self._carried_gaps: dict[str, int] = {}  # a chain's paid drafters left off by the last text (forget_acceptance)
        self._start_off: dict[str, int] = {}  # drafters earlier processes left off (use_tuned): for the first text
        self.set_drafter(drafter, method)

    def use_tuned(
        self,
        target_costs: dict[int, float],
        draft_costs: dict[str, dict[int, float]],
        prior_accepts: dict[str, float] | None = None,
        start_off: dict[str, int] | None = None,
    ) -> None:
        """Start from what `specrun tune` (or earlier runs) measured: the target's verify costs
        and, by drafter name, seconds to draft k tokens and how often its first token is
        accepted (its controllers' prior, in place of the optimistic
        DraftLengthController.prior_accept). ``start_off``: drafters that earlier runs left
        switched off, and the probe gap they had reached: the first text starts them off."""
        self.target_costs.preload(target_costs)
        for source, seconds in draft_costs.items():
            self.draft_costs.setdefault(source, DraftCosts()).preload(seconds)
        self.prior_accepts.update(prior_accepts or {})
        self._start_off = dict(start_off or {})
        self.controllers.clear()  # rebuilt on the new priors

    def forget_acceptance(self) -> None:
        """Drop what the controllers learned about acceptance (it belongs to the text); keep
        the target's and the drafters' costs (the machine's, which `specrun tune` gives a
        fresh run) and the tuned priors. Dropping draft costs too made auto time its draft
        lengths again on every bench prompt (session 6: lengths 4, 1 and 8)."""
        # A chain's draft model that ended the text switched off starts the next one off too,
        # probed after the gap it had reached: its first try in every text, and its probes
        # every 8 steps, cost a verify pass and draft passes each (~3 ms against a 1 ms plain
        # step on the demo pair), which it seldom won back where lookup had done the copying.
        # A/B on Spec-Bench (59 prompts x 3): auto 2.170x against 2.102x, lookup+draft 2.167x
        # against 2.134x. Alone, a draft model starts every text on: kept off, it gave up
        # qa's 1.77x on the built-in suite (0.98x), where it is right on almost every token.
        paid = self._paid_sources() if len(self._drafter_members()) > 1 else set()
        self._carried_gaps = {
            source: controller.probe_gap
            for source, controller in self.controllers.items()
            if source in paid and not controller.speculating
        }
        self.controllers.clear()
        self._scores.clear()
        self.gate = SpeculationGate()

    def set_drafter(self, drafter: Drafter | None, method: str | None = None) -> None:
        """Speculate with ``drafter`` from the next run on (chat's /method); the caller closes the old one."""
        self.drafter = drafter
        self.method = method or (drafter.name if drafter else "none")
        self._carried_gaps = {}
        for member in self._drafter_members():
            if hasattr(member, "target_vocab_size"):  # draft logits must cover the target's ids
                member.target_vocab_size = self.target.backend.vocab.size
            if hasattr(member, "catch_up_seconds"):  # a draft model times its catch-up on the engine's clock
                member.clock = self.clock

    def _paid_sources(self) -> set[str]:
        """Drafters that spend per drafted token (a draft model: it drafts only the length
        chosen), as against cheap ones whose whole proposal is made before it is cut."""
        return {member.name for member in self._drafter_members() if hasattr(member, "length_policy")}

    def _drafter_members(self) -> tuple:
        if self.drafter is None:
            return ()
        return tuple(getattr(self.drafter, "drafters", (self.drafter,)))

    # ---- layer 1: verify passes -------------------------------------------------
    def steps(self, prompt: Sequence[int], params: GenerationParams, stats: Stats) -> Iterator[Step]:
        """Yield one Step per target pass until max_new_tokens, EOS or a full context."""
        n_ctx = self.target.backend.n_ctx
        if not prompt:
            raise UsageError("the prompt is empty", "give a prompt as an argument or on stdin")
        if len(prompt) >= n_ctx:
            raise ContextFullError(
                f"the prompt has {len(prompt)} tokens but the context holds {n_ctx}",
                "shorten the prompt or raise --ctx",
            )
        sampling = params.sampling
        rng = np.random.default_rng(sampling.seed)
        eos_ids = self.target.backend.vocab.eos_ids if params.stop_at_eos else frozenset()
        context = list(prompt)
        stats.prompt_tokens = len(prompt)
        adaptive = self._adapts(params)
        policy_sources = self._install_length_policies(params.draft_len, adaptive)
        measured = adaptive or bool(policy_sources)  # steps feed the controllers
        fused = not measured and self._can_fuse(sampling)
        self._scores.clear()
        self._previous_pass = None
        gate = self.gate if adaptive else None
        if gate is not None:
            gate.reset()
        # Cheap drafters that keep finding nothing are asked less often. Not a lone draft model,
        # which proposes nothing only while its controller has it off and probes on its own
        # schedule: resting it too read 0.8% and 1.9% slower on Spec-Bench (two A/Bs, within
        # the noise), so it is asked as before.
        cheap = any(member.name not in policy_sources for member in self._drafter_members())
        idle = IdleBackoff() if adaptive and cheap else None
        if measured:  # plain decoding timed on a far shorter or longer context first times it again
            self.target_costs.start_text(len(context))

        # The drafters read the prompt first, timed as prefill like the target's: a draft
        # model's prompt pass is prompt processing, not the cost of drafting tokens.
        started = self.clock()
        drafter_prefill = getattr(self.drafter, "prefill", None)
        if drafter_prefill is not None and params.max_new_tokens > 1 and params.draft_len > 0:
            drafter_prefill(context)
        stats.prefill_seconds = self.clock() - started

        # The first token comes from the prefill pass, as in plain decoding. Feeding the
        # prompt's last token with drafts for the first token instead (mlx-lm's way) yields
        # one token fewer for the same passes: that token costs the batched prefill next to
        # nothing (measured in an A/B on Spec-Bench: lookup+draft 1.01x, draft 1.014x,
        # auto 1.01x), and the first token matches plain decoding's batch shape exactly.
        started = self.clock()
        prompt_logits = self._prefill(context)  # (V,): the distribution after the prompt
        stats.prefill_seconds += self.clock() - started

        started = self.clock()
        try:
            while (produced := len(context) - len(prompt)) < params.max_new_tokens and len(context) < n_ctx:
                remaining = params.max_new_tokens - produced
                t_draft = self.clock()
                from_pass = prompt_logits is None
                retiming = False
                if prompt_logits is not None:
                    # The first token from the prefill pass, as llama.cpp takes it: the same
                    # batch shape, so plain decoding matches other tools token for token.
                    proposal = EMPTY_PROPOSAL
                    t_verify = self.clock()
                    verdict = Verdict(0, self._pick(prompt_logits, sampling, rng))
                    prompt_logits = None
                    t_passed = self.clock()
                else:
                    retiming = measured and self.target_costs.retiming  # timing plain decoding afresh
                    if (
                        retiming
                        or (gate is not None and not gate.speculating)
                        or (idle is not None and not idle.ask() and self._paid_pass(params.draft_len, policy_sources))
                    ):  # plain, no drafter asked
                        proposal = EMPTY_PROPOSAL
                        t_verify = self.clock()
                        verdict = self._verify(context[-1], (), (), sampling, rng)
                    elif fused:
                        proposal, verdict, t_verify = self._fused_greedy_step(context, remaining, params, rng)
                    else:
                        proposal, found = self._propose(context, remaining, params, sampling, rng, adaptive, policy_sources)
                        if idle is not None:
                            idle.found(found)
                        t_verify = self.clock()
                        verdict = self._verify(context[-1], proposal.tokens, proposal.p_draft, sampling, rng)
                    # Keep the fed last token and the accepted drafts; drop the rejected tail.
                    self.target.rewind(len(context) + verdict.n_accepted)
                    # The pass ends here: what follows is the engine's bookkeeping, neither
                    # drafting nor verifying (Stats counts it in neither, so it shows as the rest).
                    t_passed = self.clock()
                    if measured:
                        draft_seconds = t_verify - t_draft  # a draft model's catch-up included (_observe takes it out)
                        self._observe(
                            proposal,
                            verdict,
                            draft_seconds,
                            t_passed - t_verify,
                            params,
                            adaptive,
                            policy_sources,
                            len(context),
                        )
                emitted = [*proposal.tokens[: verdict.n_accepted], verdict.next_token]
                hit_eos = next((i for i, t in enumerate(emitted) if t in eos_ids), None)
                if hit_eos is not None:
                    emitted = emitted[: hit_eos + 1]
                emitted = emitted[:remaining]
                context.extend(emitted)
                self._scores.score(context)
                # The prefill's token says nothing of speculating, nor does a pass timing T(1).
                if gate is not None and from_pass and not retiming:
                    plain = self.target_costs.plain
                    proposing = t_verify - t_draft  # asking the drafters (about none where nothing is asked)
                    engaged = bool(proposal.tokens) or (plain is not None and proposing > PROPOSING_SHARE * plain)
                    gate.record(len(emitted), self.clock() - t_draft, engaged, plain)
                step = Step(
                    tuple(emitted),
                    len(proposal.tokens),
                    verdict.n_accepted,
                    t_verify - t_draft,
                    t_passed - t_verify,
                    proposal.source,
                )
                stats.generation_seconds = self.clock() - started
                yield step
                if hit_eos is not None:
                    break
        finally:
            # Rewind is explicit, also on interruption: the cache never holds rejected drafts.
            self.target.rewind_to_prefix_of(context, limit=len(context) - 1)
            stats.generation_seconds = self.clock() - started
        self.last_context = context

    def _adapts(self, params: GenerationParams) -> bool:
        """Does this run choose its draft lengths as it goes (auto, or params.adaptive)?"""
        return self.drafter is not None and (params.adaptive or is_adaptive(self.method))

    def _draft_len(self, context, remaining: int, params) -> int:
        """The longest draft worth making: within the answer's length and the context."""
        return min(params.draft_len, remaining - 1, self.target.backend.n_ctx - len(context) - 1)

    def _can_fuse(self, sampling: SamplingSettings) -> bool:
        """Can draft and verify run as one device graph (greedy, a lone draft model and a
        target that both keep ids on the device: MLX)?"""
        drafter = self.drafter
        return (
            hasattr(drafter, "propose_deferred")
            and drafter.can_defer(sampling)
            and hasattr(self.target.backend, "forward_argmax_after")
        )

    def _fused_greedy_step(self, context, remaining: int, params, rng) -> tuple[Proposal, Verdict, float]:
        """Draft and verify with one host sync: the target's pass is queued on the draft's ids
        while they are still being computed. Returns the proposal, the verdict and when the
        drafts were queued (the verify time then includes finishing the draft's passes)."""
        deferred = self.drafter.propose_deferred(context, self._draft_len(context, remaining, params))
        t_queued = self.clock()
        if deferred is None:
            return EMPTY_PROPOSAL, self._verify(context[-1], (), (), params.sampling, rng), t_queued
        target_argmax, ids = self.target.feed_argmax_after([context[-1]], deferred)  # (k+1,), (k,)
        drafts = tuple(int(t) for t in ids)
        return Proposal(drafts, source=self.drafter.name), verify_greedy(drafts, target_argmax), t_queued

    def _propose(
        self, context, remaining: int, params, sampling, rng, adaptive: bool, policy_sources
    ) -> tuple[Proposal, bool]:
        """The drafter's proposal for the next verify pass, cut to what is worth verifying, and
        whether the cheap drafters found anything (a proposal cut to nothing or passed over
        included; a draft model's say nothing of them: IdleBackoff)."""
        draft_len = self._draft_len(context, remaining, params)
        if self.drafter is None or draft_len <= 0:
            return EMPTY_PROPOSAL, False
        proposal = self.drafter.propose(context, draft_len, sampling, rng)
        made = (*getattr(self.drafter, "passed_over", ()), proposal)
        cheap = [each for each in made if each.tokens and each.source not in policy_sources]
        if not adaptive or not cheap:
            return proposal, bool(cheap)
        for each in cheap:  # a cheap drafter's proposal: scored whole against the output
            controller = self._controller_for(each.source, params.draft_len, kind=each.kind)
            self._scores.add(controller, len(context), each.tokens)
        if proposal.tokens and proposal.source not in policy_sources:
            # A cheap drafter's tokens cost nothing to drop: keep the worthwhile prefix.
            keep = self._controller_for(proposal.source, params.draft_len, kind=proposal.kind).choose(len(proposal))
            proposal = proposal.prefix(keep)
        return proposal, True

    def _paid_pass(self, max_draft_len: int, paid: set[str]) -> bool:
        """May the drafters go unasked on this step, as far as the draft models are concerned
        (not while one is on or due for a probe)? If so, the step counts towards their probes."""
        controllers = self._paid_controllers(max_draft_len, paid)
        if not all(controller.may_pass() for controller in controllers):
            return False
        for controller in controllers:
            controller.pass_step()
        return True

    def _paid_controllers(self, max_draft_len: int, paid: set[str]) -> list[DraftLengthController]:
        """The controllers of the drafters that pay per drafted token (their length policies)."""
        return [self._controller_for(source, max_draft_len) for source in paid]

    def _prior(self, source: str, kind: str) -> tuple[float, bool]:
        """The acceptance a controller presumes before evidence, and whether it was measured.

        The drafter's prior for the proposal's kind where it declares one (prompt lookup, by
        the length of the n-gram matched); else what `specrun tune` measured for the drafter;
        else the drafter's own ``prior_accept`` (the n-gram pool); else the controllers' default.
        """
        member = self._member(source)
        declared = getattr(member, "kind_priors", {}).get(kind)
        if declared is not None:
            return declared, False
        if source in self.prior_accepts:
            return self.prior_accepts[source], True
        return getattr(member, "prior_accept", DraftLengthController.prior_accept), False

    def _member(self, source: str):
        """The drafter (or chain member) whose proposals carry ``source``, if any."""
        return next((m for m in self._drafter_members() if m.name == source), None)

    def _controller_for(
        self, source: str, max_draft_len: int, fixed: bool = False, kind: str = ""
    ) -> DraftLengthController:
        """The controller of a source's proposals of one kind (Proposal.kind), made on first use."""
        key = f"{source}:{kind}" if kind else source
        controller = self.controllers.get(key)
        if controller is None or (controller.max_draft_len, controller.fixed) != (max_draft_len, fixed):
            paid = source in self._paid_sources()
            prior, measured = self._prior(source, kind)
            controller = DraftLengthController(
                max_draft_len=max_draft_len,
                fixed=fixed,
                target_costs=self.target_costs,
                draft_costs=self.draft_costs.setdefault(source, DraftCosts()),
                ramp_up=True,  # lengths grow with the evidence, not the prior
                # A cheap drafter's proposal is made before it is cut: its time is sunk, and a
                # wrong first try costs only verify positions (CHEAP_PROBE_LEN: why 4 of them).
                sunk_draft_cost=not paid,
                probe_len=PAID_PROBE_LEN if paid else CHEAP_PROBE_LEN,
                prior_accept=prior,
                prior_measured=measured,
            )
            carried = self._carried_gaps.pop(key, None)
            if carried is None and not fixed:  # a length the user fixed (-k) drafts until this run says otherwise
                carried = self._start_off.pop(key, None)
            if carried is not None:
                controller.start_off(carried)
            self.controllers[key] = controller
        return controller

    def _install_length_policies(self, draft_len: int, adaptive: bool) -> set[str]:
        """Give every drafter that pays per drafted token (a draft model) a policy for its length.

        Adaptive: its controller's choice before it drafts, and a chain the choice between
        its members. Fixed, inside a chain behind cheap drafters: the fixed length while it
        is measured to beat plain decoding, else nothing (probed again later), so a chain is
        never slower for a draft model that does not pay. Alone at a fixed length, a draft
        model drafts as told. Returns the sources with a policy (empty: nothing measured).
        """
        members = self._drafter_members()
        gate_fixed = not adaptive and len(members) > 1
        sources = set()
        for member in members:
            if hasattr(member, "length_policy"):
                policy = None
                if adaptive or gate_fixed:
                    policy = self._controller_for(member.name, draft_len, fixed=not adaptive).choose
                    sources.add(member.name)
                member.length_policy = policy
        if hasattr(self.drafter, "worth_taking"):
            self.drafter.worth_taking = (
                functools.partial(self._cheap_worth_taking, max_draft_len=draft_len, paid=sources)
                if adaptive and sources else None
            )
        return sources

    def _cheap_worth_taking(self, proposal, max_draft_len: int, paid: set[str]) -> bool:
        """Does this cheap proposal promise more tokens per second than asking the draft model?

        Both sides from measured figures: the cheap source's acceptance by position and
        the target's verify costs, against the best rate the draft model's controller
        expects. Unmeasured sides are explored. A declined proposal is still scored
        against the output (ProposalScores), so the cheap source's estimates stay current.
        """
        paid_controllers = self._paid_controllers(max_draft_len, paid)
        if not any(controller.speculating for controller in paid_controllers):
            # Switched off, the draft model would propose nothing: the cheap proposal is all
            # there is (and weighing it cost ~25 us a step, 2% of a tiny-regime step).
            return True
        cheap = self._controller_for(proposal.source, max_draft_len, kind=proposal.kind)
        cheap_rates = cheap.expected_rates(min(len(proposal), max_draft_len))
        paid_rates = [controller.expected_rates(max_draft_len) for controller in paid_controllers]
        if None in cheap_rates:
            return True
        if any(None in rates for rates in paid_rates):
            return False  # the draft model has not been timed yet: try it
        return max(cheap_rates) >= max(max(rates[1:]) for rates in paid_rates)

    def _observe(
        self,
        proposal,
        verdict: Verdict,
        draft_s: float,
        verify_s: float,
        params,
        adaptive: bool,
        paid: set[str],
        context_len: int,
    ) -> None:
        n_fed = len(proposal.tokens) + 1
        previous, self._previous_pass = self._previous_pass, n_fed
        if not self.target_costs.note_pass(n_fed, verify_s, previous):
            return  # a plain pass that paid for the speculative one before it: timed as switching back
        if not proposal.tokens:
            self.target_costs.observe(1, verify_s, context_len)  # a plain pass: what speculating must beat
        elif not adaptive and proposal.source not in paid:
            # A fixed chain's cheap drafter is not gated: its pass only times T_target(n).
            self.target_costs.observe(len(proposal.tokens) + 1, verify_s)
        else:
            controller = self._controller_for(proposal.source, params.draft_len, fixed=not adaptive, kind=proposal.kind)
            if adaptive and proposal.source not in paid:  # its acceptance comes from ProposalScores
                controller.observe_costs(len(proposal.tokens), draft_s, verify_s)
            else:
                # T_draft(k) is what drafting k tokens costs. A draft model skipped for a while
                # first reads what it missed, whatever k: charged to k, that made one draft call
                # look dearer by the catch-up (a fresh run's first draft follows two plain
                # steps). The gate still sees the whole step's time.
                drafting = draft_s - getattr(self._member(proposal.source), "catch_up_seconds", 0.0)
                controller.observe(len(proposal.tokens), verdict.n_accepted, drafting, verify_s)

    def _prefill(self, context: list[int]) -> np.ndarray:
        """Feed the prompt, reusing any cached prefix, and return the logits after its last
        token (V,). The last token is always fed again (kept out of the reuse), so there is
        a row to read even when the whole prompt was cached."""
        keep = self.target.rewind_to_prefix_of(context, limit=len(context) - 1)
        return self.target.feed(context[keep:], [len(context) - keep - 1])[0]

    @staticmethod
    def _pick(logits: np.ndarray, sampling: SamplingSettings, rng: np.random.Generator) -> int:
        """One token from a (V,) row of logits under the user's settings."""
        if sampling.greedy:
            return int(logits.argmax())
        return sample(probabilities(logits, sampling), rng)

    def _verify(
        self,
        last_token: int,
        draft_tokens: tuple[int, ...],
        p_draft: tuple[np.ndarray | None, ...],
        sampling: SamplingSettings,
        rng: np.random.Generator,
    ) -> Verdict:
        """One target pass over [last_token, *drafts]: k + 1 distributions, then the acceptance rule."""
        fed = [last_token, *draft_tokens]
        rows = range(len(fed))
        if sampling.greedy:
            target_argmax = self.target.feed_argmax(fed, rows)  # (k+1,)
            return verify_greedy(draft_tokens, target_argmax)
        logits = self.target.feed(fed, rows)  # (k+1, V)
        p_target = probabilities(logits, sampling)
        return verify_sampled(draft_tokens, p_target, p_draft, rng)

    # ---- layer 2: events --------------------------------------------------------
    def stream(
        self, prompt: Sequence[int], params: GenerationParams, *, complete_cache: bool = True
    ) -> Iterator[TextChunk | Finished]:
        """Yield a TextChunk per verify pass, then Finished with the result and statistics.

        complete_cache: after the last token, feed it to both models so their caches
        hold exactly prompt + output (what a next chat turn reuses).
        """
        backend = self.target.backend
        min_prob = max((getattr(m, "min_prob", 0.0) for m in self._drafter_members()), default=0.0)
        stats = Stats(
            method=self.method,
            draft_len=params.draft_len if self.drafter else 0,
            adaptive=self._adapts(params),
            draft_min_prob=min_prob,
        )
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        output: list[int] = []
        pieces: list[str] = []
        for step in self.steps(prompt, params, stats):
            stats.record_step(
                step.n_drafted, step.n_accepted, len(step.tokens), step.draft_seconds, step.verify_seconds, step.source
            )
            output.extend(step.tokens)
            text = decoder.decode(b"".join(backend.token_bytes(t) for t in step.tokens))
            pieces.append(text)
            yield TextChunk(text, step.tokens, step.from_draft, stats)
        tail = decoder.decode(b"", final=True)
        if tail:
            pieces.append(tail)
            yield TextChunk(tail, (), (), stats)
        if complete_cache:
            self.complete_caches()
        yield Finished(GenerationResult("".join(pieces), output, stats, self._finish_reason(prompt, output, params)))

    def complete_caches(self) -> None:
        """Feed the pending last token so both caches hold exactly the full context."""
        context = self.last_context
        self.target.sync(context)
        if self.drafter is not None:
            self.drafter.finish(context)

    def _finish_reason(self, prompt: Sequence[int], output: list[int], params: GenerationParams) -> str:
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
