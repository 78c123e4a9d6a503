"""The speculative loop: draft → verify → accept → rewind, over any backend.

Three layers (mlx-lm's generate_step / stream_generate / generate shape):
``SpeculativeEngine.steps`` yields one ``Step`` per target verify pass,
``stream`` turns steps into typed events with text and running statistics,
``run`` returns the finished ``GenerationResult``. The engine never prints.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from time import perf_counter

import numpy as np

from specrun.backends.base import Backend, near_tie_rows
from specrun.backends.kv import sequence_for
from specrun.control.policy import PLAIN, AdaptivePolicy, FixedPolicy, Plan, SpeculationPolicy, StepReport
from specrun.drafters.base import EMPTY_PROPOSAL, Drafter, Proposal
from specrun.drafters.methods import is_adaptive
from specrun.engine.stats import Stats
from specrun.errors import ContextFullError, UsageError
from specrun.sampling import SamplingSettings, probabilities, sample
from specrun.verify import TreeVerdict, Verdict, verify_greedy, verify_sampled, verify_tree_greedy, verify_tree_sampled


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


def check_prompt(prompt: Sequence[int], n_ctx: int) -> None:
    """A prompt the engine can start from: not empty, and leaving room for a token."""
    if not prompt:
        raise UsageError("the prompt is empty", "give a prompt as an argument or on stdin")
    if len(prompt) >= n_ctx:
        raise ContextFullError(
            f"the prompt has {len(prompt)} tokens but the context holds {n_ctx}",
            "shorten the prompt or raise --ctx",
        )


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
        self.policy = AdaptivePolicy(clock)
        self.set_drafter(drafter, method)

    def set_drafter(self, drafter: Drafter | None, method: str | None = None) -> None:
        """Speculate with ``drafter`` from the next run on (chat's /method); the caller closes the old
        one. A drafter that cannot serve the target raises from ``bind``, leaving the engine as it was."""
        if drafter is not None:
            drafter.bind(self.target, self.clock)
        self.drafter = drafter
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
        fusable = drafter.can_defer(params.sampling) and self.target.can_feed_after
        return FixedPolicy(drafter, fusable)

    # ---- layer 1: verify passes -------------------------------------------------
    def steps(self, prompt: Sequence[int], params: GenerationParams, stats: Stats) -> Iterator[Step]:
        """Yield one Step per target pass until max_new_tokens, EOS or a full context."""
        n_ctx = self.target.backend.n_ctx
        check_prompt(prompt, n_ctx)
        sampling = params.sampling
        rng = np.random.default_rng(sampling.seed)
        eos_ids = self.target.backend.vocab.eos_ids if params.stop_at_eos else frozenset()
        context = list(prompt)
        stats.prompt_tokens = len(prompt)
        policy = self.policy_for(params)
        if policy is not None and policy.measured:
            policy.start_text(len(context))

        # The drafters read the prompt first, timed as prefill like the target's: a draft
        # model's prompt pass is prompt processing, not the cost of drafting tokens.
        started = self.clock()
        if policy is not None and params.max_new_tokens > 1:
            self.drafter.prefill(context)
        # The first token comes from the prefill pass, as in plain decoding. Feeding the
        # prompt's last token with drafts for the first token instead (mlx-lm's way) yields
        # one token fewer for the same passes: that token costs the batched prefill next to
        # nothing (measured in an A/B on Spec-Bench: lookup+draft 1.01x, draft 1.014x,
        # auto 1.01x), and the first token matches plain decoding's batch shape exactly.
        prompt_logits, reused = self._prefill(context)  # (V,): the distribution after the prompt
        stats.prefill_seconds = self.clock() - started

        watch_ties = params.tie_margin > 0 and sampling.greedy
        # Until a pass of several tokens writes the cache, every pass is plain decoding's own, bit
        # for bit: no choice can part from it, and near-ties are looked for (0.1-0.2 ms a step of
        # a 49k vocabulary, ~1% of a plain step) only from then on; from the start where the text
        # began on a cache earlier passes wrote (a chat's next turn), or where passes keep hidden
        # states (head drafters: llama.cpp then outputs every row, the prompt's too).
        rounded_apart = reused or self.target.tracking
        started = self.clock()
        try:
            while (produced := len(context) - len(prompt)) < params.max_new_tokens and len(context) < n_ctx:
                remaining = params.max_new_tokens - produced
                t_draft, context_len = self.clock(), len(context)
                from_prefill = prompt_logits is not None
                prompt_row = None
                if from_prefill:  # the prefill's token, as llama.cpp takes it
                    plan, proposal = PLAIN, EMPTY_PROPOSAL
                    t_verify = self.clock()
                    verdict = Verdict(0, self._pick(prompt_logits, sampling, rng))
                    prompt_row, prompt_logits = prompt_logits, None
                else:  # plan → draft → verify
                    plan = policy.plan() if policy is not None else PLAIN
                    draft_len = min(params.draft_len, remaining - 1, n_ctx - context_len - 1)
                    if plan.fused:
                        proposal, verdict, t_verify = self._fused_greedy_step(context, draft_len, sampling, rng)
                    else:
                        proposal = self._draft(policy, plan, context, draft_len, sampling, rng)
                        if not proposal.is_chain:
                            proposal = self._verifiable(proposal, params)
                        t_verify = self.clock()
                        verdict = self._verify(context[-1], proposal, sampling, rng)
                    # Keep the fed last token and the accepted drafts; drop the rejected tail.
                    self.target.rewind(context_len + verdict.n_accepted)
                t_passed = self.clock()  # what follows is bookkeeping, neither drafting nor verifying
                emitted = [*(proposal.tokens[node] for node in verdict.path), verdict.next_token]
                hit_eos = next((i for i, t in enumerate(emitted) if t in eos_ids), None)
                if hit_eos is not None:
                    emitted = emitted[: hit_eos + 1]
                context.extend(emitted[:remaining])
                rounded_apart = rounded_apart or len(proposal) > 0
                if watch_ties and rounded_apart:
                    stats.near_ties += self._near_ties(prompt_row, verdict, len(context) - context_len, params)
                if policy is not None and policy.measured and not from_prefill:
                    policy.observe(StepReport(plan, proposal, tuple(verdict.path), t_draft, t_verify - t_draft,
                                              t_passed - t_verify, context, context_len))
                step = Step(tuple(context[context_len:]), len(proposal), verdict.n_accepted,
                            t_verify - t_draft, t_passed - t_verify, proposal.source)
                stats.generation_seconds = self.clock() - started
                yield step
                if hit_eos is not None:
                    break
        finally:
            # Rewind is explicit, also on interruption: the cache never holds rejected drafts.
            self.target.rewind_to_prefix_of(context, limit=len(context) - 1)
            stats.generation_seconds = self.clock() - started
        self.last_context = context

    def _near_ties(self, prompt_row, verdict, n_kept: int, params: GenerationParams) -> int:
        """How many of a step's ``n_kept`` tokens were chosen at a near-tie: from the prefill's
        row, else the pass's rows the tokens came from (the root's, then each accepted node's)."""
        if prompt_row is not None:
            return int(near_tie_rows(prompt_row[None], params.tie_margin)[0])
        indices = [0, *(1 + node for node in verdict.path)][:n_kept]
        return int(self.target.backend.last_pass_ties(indices, params.tie_margin).sum())

    def _draft(self, policy, plan: Plan, context, draft_len: int, sampling, rng) -> Proposal:
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

    def _fused_greedy_step(self, context, draft_len: int, sampling, rng) -> tuple[Proposal, Verdict, float]:
        """Draft and verify with one host sync: the target's pass is queued on the draft's ids
        while they are still being computed. Returns the proposal, the verdict and when the
        drafts were queued (the verify time then includes finishing the draft's passes)."""
        deferred = self.drafter.propose_deferred(context, draft_len)
        t_queued = self.clock()
        if deferred is None:
            return EMPTY_PROPOSAL, self._verify(context[-1], EMPTY_PROPOSAL, sampling, rng), t_queued
        target_argmax, ids = self.target.feed_argmax_after([context[-1]], deferred)  # (k+1,), (k,)
        drafts = tuple(int(t) for t in ids)
        return Proposal(drafts, source=self.drafter.name), verify_greedy(drafts, target_argmax), t_queued

    def _prefill(self, context: list[int]) -> tuple[np.ndarray, bool]:
        """Feed the prompt, reusing any cached prefix, and return the logits after its last
        token (V,), and whether a cached prefix was reused. The last token is always fed
        again (kept out of the reuse), so there is a row to read even when the whole prompt
        was cached."""
        keep = self.target.rewind_to_prefix_of(context, limit=len(context) - 1)
        return self.target.feed(context[keep:], [len(context) - keep - 1])[0], keep > 0

    @staticmethod
    def _pick(logits: np.ndarray, sampling: SamplingSettings, rng: np.random.Generator) -> int:
        """One token from a (V,) row of logits under the user's settings."""
        if sampling.greedy:
            return int(logits.argmax())
        return sample(probabilities(logits, sampling), rng)

    def _verify(
        self, last_token: int, proposal: Proposal, sampling: SamplingSettings, rng: np.random.Generator
    ) -> Verdict | TreeVerdict:
        """One target pass over the last token and the drafts, then the acceptance rule: a chain
        yields k + 1 distributions; a tree one per node, and the accepted path is kept."""
        if not proposal.is_chain:
            return self._verify_tree(last_token, proposal, sampling, rng)
        fed = [last_token, *proposal.tokens]
        rows = range(len(fed))
        if sampling.greedy:
            target_argmax = self.target.feed_argmax(fed, rows)  # (k+1,)
            self._show_pass(proposal, target_argmax)
            return verify_greedy(proposal.tokens, target_argmax)
        logits = self.target.feed(fed, rows)  # (k+1, V)
        self._show_pass(proposal, logits)
        p_target = probabilities(logits, sampling)
        return verify_sampled(proposal.tokens, p_target, proposal.p_draft, rng)

    def _verify_tree(
        self, last_token: int, proposal: Proposal, sampling: SamplingSettings, rng: np.random.Generator
    ) -> TreeVerdict:
        tree = proposal.tree
        rows = tree.logit_rows(1)  # the root's row, then one per node
        if sampling.greedy:
            target_argmax = self.target.feed_tree_argmax([last_token], tree, rows)  # (1+n,)
            self._show_pass(proposal, target_argmax)
            verdict = verify_tree_greedy(tree, target_argmax)
        else:
            logits = self.target.feed_tree([last_token], tree, rows)  # (1+n, V)
            self._show_pass(proposal, logits)
            verdict = verify_tree_sampled(tree, probabilities(logits, sampling), proposal.p_draft, rng)
        self.target.keep_path(tree, verdict.path)
        return verdict

    def _show_pass(self, proposal: Proposal, rows: np.ndarray) -> None:
        """Hand a drafter that reads the whole pass (Drafter.reads_pass) the target's choice
        after the root and each node: ``rows`` is that (1 + n,) argmax, or (1 + n, V) logits."""
        if proposal.tokens and self.drafter is not None and self.drafter.reads_pass:
            self.drafter.observe_pass(proposal, rows if rows.ndim == 1 else rows.argmax(axis=-1))

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
            draft_len=params.draft_len if self.drafter is not None else 0,
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
