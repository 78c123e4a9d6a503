"""The speculation policy: what the loop does each step, and what it learns from each.

The engine asks its policy once a step (``plan``: a plain step, or which drafters to ask
with what draft length), asks it again as the drafters answer (``budget`` before a
drafter that pays per token drafts, ``takes`` after each proposal, ``chosen`` for the
proposal that goes to the target) and tells it what the step cost and yielded
(``observe``). Drafters get their budget as an argument and never call back up.

``FixedPolicy`` is ``-k N`` with a lone drafter: nothing measured, every step drafts.
``AdaptivePolicy`` measures acceptance and pass costs and chooses draft lengths (auto,
``--adaptive``); it also gates a fixed chain's draft model, which must never make a
chain slower than its cheap drafters alone. Where the target verifies trees it merges a
chain's proposals of one step into one tree (``chosen``), crediting each draft model with
its own nodes on the accepted path. It keeps what it measured across texts
(control/memory.py): the pass costs belong to the machine, acceptance to the text
(``forget_acceptance``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Protocol

from specrun.control.batch import BatchDrafts
from specrun.control.costs import DraftCosts, TargetCosts
from specrun.control.draft_length import (
    CHEAP_PROBE_LEN, PAID_PROBE_LEN, DraftLengthController, ProposalScores, expected_tokens,
)
from specrun.control.gate import IdleBackoff, SpeculationGate
from specrun.control.memory import PolicyMemory
from specrun.control.trees import BranchRates, TreeScores, merged_values, node_values, select_merged, shape_tree
from specrun.drafters.base import Drafter, Proposal
from specrun.drafters.chain import MergedProposal, merge_proposals

# A step that spent more than this share of a plain pass proposing counts as speculating's
# for auto's SpeculationGate, even when nothing was verified (a cheap drafter that keeps
# looking and finding nothing, or proposals the controllers declined).
PROPOSING_SHARE = 0.02

@dataclass(frozen=True)
class Plan:
    """One step's decision. ``draft``: ask the drafters (else a plain step, none asked);
    ``fused``: the lone draft model and the target run as one device graph (greedy, MLX)."""

    draft: bool = False
    fused: bool = False


PLAIN = Plan()


@dataclass(frozen=True)
class StepReport:
    """What one verify pass cost and yielded, for the policy to learn from.

    started: the clock when the step began (where plain steps read ahead, when the step before
    yielded: every step a whole cycle, the caller's time in it); draft_seconds: asking the drafters and cutting
    the proposal; verify_seconds: the pass and the rewind after it. context: prompt and
    output so far, this step's tokens included; context_len: its length before them.
    queued: a plain step whose pass the step before queued (it read ahead): its verify time
    is what was left of the pass, not a pass's cost. forced: the grammar's tokens the pass held
    before the proposal (engine/loop.py ``_after_forced``); ``context_len`` is then after them.
    """

    plan: Plan
    proposal: Proposal
    path: tuple[int, ...]  # the accepted nodes (a chain's: its first n_accepted)
    started: float
    draft_seconds: float
    verify_seconds: float
    context: Sequence[int]
    context_len: int
    queued: bool = False
    forced: int = 0  # tokens a grammar forced ahead of the proposal, in the same pass (accepted)

    @property
    def n_accepted(self) -> int:
        return len(self.path)

    @property
    def chain_accepted(self) -> int:
        """Accepted nodes on the proposal's main chain (all of them, for a chain)."""
        return next((i for i, node in enumerate(self.path) if node != i), len(self.path))


class SpeculationPolicy(Protocol):
    """What the engine asks each step; see the module docstring."""

    measured: bool  # does it learn from steps (else the engine skips ``observe``'s timing)

    def start_text(self, context_len: int) -> None: ...

    def end_text(self) -> None:
        """The text's last step has run (or it was interrupted)."""
        ...

    def plan(self) -> Plan: ...

    def plan_after_forced(self) -> Plan:
        """``plan`` for a step that verifies a grammar's forced tokens first: the drafters may
        continue after them, but a plain step that would time plain decoding waits for a step
        without them (its pass would not be a plain one)."""
        ...

    def skip_pass(self) -> None:
        """A pass the policy is not told of (forced tokens alone): the shape change it causes
        the next pass is charged to no choice of the policy's."""
        ...

    def plain_next(self) -> bool:
        """After a plain step: will the next step be plain too, whatever this one shows? Then this
        one may queue the next one's pass (the engine's plain steps read ahead where they can)."""
        ...

    def budget(self, drafter: Drafter, draft_len: int) -> int: ...

    def takes(self, proposal: Proposal, member: int, draft_len: int) -> bool: ...

    def chosen(self, proposal: Proposal, passed_over: Sequence[Proposal], context_len: int) -> Proposal: ...

    def observe(self, report: StepReport) -> None: ...

    def reads_prompt(self, drafter: Drafter) -> bool:
        """Should this drafter read the prompt before the text is generated (Drafter.prefill)?"""
        ...

    def share(self, others: int, others_tokens: int = 0) -> None:
        """The next pass carries ``others`` other sequences besides this run's (a server's slots),
        feeding ``others_tokens`` tokens."""

    def at_context(self, length: int, text: Sequence[int] | None = None, remaining: int | None = None) -> None:
        """The next pass reads ``length`` tokens of context (TargetCosts.at_context)."""


def takes_at_least(proposal: Proposal, drafter: Drafter, draft_len: int) -> bool:
    """The fixed rule of a chain: a proposal of ``min_tokens`` (at most the length asked)."""
    return len(proposal) >= min(drafter.min_tokens, draft_len)


class FixedPolicy:
    """``-k N`` with a lone drafter (or a chain without a draft model): every step asks the
    drafters for ``draft_len`` tokens; nothing is measured, so draft and verify may fuse. A
    chain here verifies one member's proposal a pass: merging (AdaptivePolicy._merged) is for
    chains whose draft model the adaptive policy gates."""

    measured = False

    def __init__(self, drafter: Drafter, fusable: bool) -> None:
        self.drafter = drafter
        self._plan = Plan(draft=True, fused=fusable)

    def start_text(self, context_len: int) -> None:
        pass

    def end_text(self) -> None:
        pass

    def plan(self) -> Plan:
        return self._plan

    def plan_after_forced(self) -> Plan:
        return self._plan

    def skip_pass(self) -> None:
        pass

    def plain_next(self) -> bool:
        return False  # every step drafts

    def budget(self, drafter: Drafter, draft_len: int) -> int:
        return draft_len

    def takes(self, proposal: Proposal, member: int, draft_len: int) -> bool:
        return takes_at_least(proposal, self.drafter, draft_len)

    def chosen(self, proposal: Proposal, passed_over: Sequence[Proposal], context_len: int) -> Proposal:
        return proposal

    def observe(self, report: StepReport) -> None:
        pass

    def reads_prompt(self, drafter: Drafter) -> bool:
        return True  # every step drafts

    def share(self, others: int, others_tokens: int = 0) -> None:
        """Fixed lengths do not yield to other sequences in the pass."""

    def at_context(self, length: int, text: Sequence[int] | None = None, remaining: int | None = None) -> None:
        """Fixed lengths do not follow the context."""


class AdaptivePolicy:
    """Draft lengths (and whether to speculate at all) from measured acceptance and costs.

    One ``DraftLengthController`` per proposal source (and kind), sharing the target's
    pass costs; ``SpeculationGate`` (auto) checks that speculating, every cost counted,
    beats plain decoding; ``IdleBackoff`` asks cheap drafters less often while they find
    nothing; ``ProposalScores`` scores cheap proposals against the output for free.
    ``set_drafter`` and ``configure`` set it up for the engine's drafter and a run's settings.
    What it keeps across texts and takes from earlier processes is its ``PolicyMemory``.
    """

    measured = True

    def __init__(self, clock: Callable[[], float] = perf_counter) -> None:
        self.clock = clock
        self.memory = PolicyMemory()  # the pass costs, priors and start-offs kept across texts
        self.controllers: dict[str, DraftLengthController] = {}  # by source, or "source:kind"
        self.gate = SpeculationGate()
        self._scores = ProposalScores()  # cheap proposals awaiting the output that settles them
        self.branch_rates: dict[str, BranchRates] = {}  # by source: how often its second guesses are right
        self._tree_scores = TreeScores()  # branching proposals awaiting the output
        self.max_nodes = 0  # the most nodes a verified tree may have (0: chains only)
        self.max_paths = 0  # …and root-to-leaf paths (0: no cap)
        self.merge_chains = True  # merge a chain's proposals where trees are on (off: to measure what it brings)
        self._previous_pass: int | None = None  # tokens fed to the latest pass (None: the prefill)
        self.drafter: Drafter | None = None
        self.adaptive = True  # else fixed lengths, with a chain's paid drafters gated
        self.max_draft_len = 0
        self.paid: set[str] = set()  # drafters whose length this policy chooses before they draft
        self._idle: IdleBackoff | None = None
        self._plain_timing = 0  # timed plain passes still wanted at this text's context
        self._plain_timing_steps = 0  # plain steps left to get them in (a pass may go untimed)
        self._context_len = 0  # of the step being planned
        self._text: Sequence[int] | None = None  # its context, and the tokens the run may still generate
        self._remaining: int | None = None
        self._prompt_len = 0  # the context the text started from (start_text)
        self._picks: dict[str, AlternativePick] = {}  # by alternative drafter: which of the two drafts
        self._resting: set[str] = set()  # paid drafters not asked this step (an alternative's other)
        # a server's slots decoding together: the draft model's length they share
        self.batch: BatchDrafts | None = None

    # ---- what earlier texts and processes measured (memory.py) ---------------------------
    @property
    def target_costs(self) -> TargetCosts:
        """T_target(n), shared by every controller: the machine's, kept across texts."""
        return self.memory.target_costs

    @property
    def draft_costs(self) -> dict[str, DraftCosts]:
        """T_draft(k) by drafter name, kept across texts."""
        return self.memory.draft_costs

    def use_tuned(
        self,
        target_costs: dict[int, float],
        draft_costs: dict[str, dict[int, float]],
        prior_accepts: dict[str, float] | None = None,
        start_off: dict[str, int] | None = None,
        prior_curves: dict[str, dict[int, float]] | None = None,
    ) -> None:
        """Start from what `specrun tune` (or earlier runs) measured: the target's verify costs
        and, by drafter name, seconds to draft k tokens and how often its first token is
        accepted (its controllers' prior, in place of the optimistic
        DraftLengthController.prior_accept). ``start_off``: drafters that earlier runs left
        switched off, and the probe gap they had reached: the first text starts them off.
        ``prior_curves``: by drafter name, the acceptance measured at each draft position
        (DraftLengthController.prior_curve)."""
        self.memory.use_tuned(target_costs, draft_costs, prior_accepts, start_off, prior_curves)
        self.controllers.clear()  # rebuilt on the new priors

    def start_gate_off(self, gap: int) -> None:
        """Start the next text decoding plainly for ``gap`` steps, then retry speculating: where
        an earlier process ended with the gate off for a drafter whose cost is its proposals'
        fixed size (a lookahead window), or the measured pass costs say it cannot pay."""
        self.memory.gate_off = gap

    @property
    def fixed_size_drafter(self) -> bool:
        """Is the drafter one whose every proposal is verified whole (a lone lookahead window)?
        Its loss, where it loses, is the machine's price of its pass, not the text's: a text that
        ended with the gate off starts the next one off too."""
        return self.drafter is not None and all(member.whole_proposals for member in self.drafter.members)

    @property
    def gate_off_gap(self) -> int:
        """The plain steps the gate had to wait when the latest text ended with it off for a
        fixed-size drafter (0: on, or a drafter whose cost follows the text)."""
        return self.gate.gap if self.fixed_size_drafter and not self.gate.speculating else 0

    def forget_acceptance(self) -> None:
        """Drop what the controllers learned about acceptance (it belongs to the text); keep
        the target's and the drafters' costs (the machine's, which `specrun tune` gives a
        fresh run) and the tuned priors. Dropping draft costs too made auto time its draft
        lengths again on every bench prompt (session 6: lengths 4, 1 and 8)."""
        # A chain's draft model that ended the text switched off starts the next one off too
        # (PolicyMemory.end_text says why); alone, a draft model starts every text on.
        members = self.drafter.members if self.drafter is not None else ()
        paid = {m.name for m in members if m.pays_per_token} if len(members) > 1 else set()
        self.memory.end_text(self.controllers, paid)
        if self.memory.gate_off is None and self.gate_off_gap:  # a window left off starts the next text off
            self.memory.gate_off = self.gate_off_gap
        self.controllers.clear()
        self._scores.clear()
        self._tree_scores.clear()
        self.branch_rates.clear()
        self.gate = SpeculationGate()

    def seen_counts(self, key: str) -> tuple[list[float], list[float]]:
        """Tries and acceptances by draft position (index 0 unused) of a controller's source and
        kind over every text since the drafter or the priors were set, undecayed."""
        return self.memory.seen_counts(key, self.controllers.get(key))

    def explain(self) -> dict:
        """Why the next step does what it does, for a trace (`--trace`): the gate on realised speed
        (on, or the plain steps left in its stretch off) and each drafter's controller
        (DraftLengthController.describe), keyed by source (and kind); where slots decode together,
        the batch's latest length for as many (BatchDrafts.describe). Reads, never decides."""
        explained = {
            "gate": {"on": self.gate.speculating, "plain_steps_left": self.gate.plain_steps_left()},
            "drafters": {key: controller.describe() for key, controller in self.controllers.items()},
        }
        if self.batch is not None and self.target_costs.sharing:
            explained["batch"] = self.batch.describe(self.target_costs.sharing + 1)
        return explained

    # ---- one text -----------------------------------------------------------------------
    def set_drafter(self, drafter: Drafter | None) -> None:
        """Speculate with ``drafter`` from the next text on (what the old one left off is dropped)."""
        self.drafter = drafter
        self.memory.forget_drafter()
        self.paid = {member.name for member in drafter.members if member.pays_per_token} if drafter else set()

    def configure(self, max_draft_len: int, adaptive: bool, max_nodes: int = 0, max_paths: int = 0) -> None:
        """A run's settings: lengths chosen up to ``max_draft_len`` (``adaptive``), or fixed
        at it with a chain's draft model gated; trees of up to ``max_nodes`` nodes and
        ``max_paths`` paths (0 nodes: chains only)."""
        self.max_draft_len, self.adaptive = max_draft_len, adaptive
        self.max_nodes, self.max_paths = max_nodes, max_paths

    # Where plain decoding's cost is stale (TargetCosts.plain_stale_at) a text starts plain until
    # one plain pass is timed as T(1). The first after the prompt's pays a graph rebuild and is not
    # (note_pass), nor one after a grammar's forced tokens or a queued one: the text stays plain
    # for at most PLAIN_TIMING_CAP steps waiting (alternating forced and plain passes could
    # otherwise leave T(1) stale, or keep the drafters off).
    PLAIN_TIMING_STEPS = 1
    PLAIN_TIMING_CAP = 4

    def start_text(self, context_len: int) -> None:
        self._context_len = self._prompt_len = context_len
        self._picks.clear()  # which cache drafts faster belongs to the text and its length
        self._scores.clear()
        self._tree_scores.clear()
        self._previous_pass = None
        self.target_costs.at_context(context_len)
        # Plain decoding's cost here is unknown: time it before weighing speculation against it. A
        # preloaded cost contradicted at a longer context was dropped with every other untimed one,
        # and the line through a single 9-token pass then read a plain step as 5x dearer than it was:
        # the draft model ran 0.84x plain decoding at 4k tokens, drafting every step.
        stale = self.adaptive and self.target_costs.plain_stale_at(context_len)
        self._plain_timing = self.PLAIN_TIMING_STEPS if stale else 0
        self._plain_timing_steps = self.PLAIN_TIMING_CAP
        if self.adaptive:
            carried, self.memory.gate_off = self.memory.gate_off, None
            if carried is None and self.gate_off_gap:
                carried = self.gate_off_gap
            self.gate.reset()
            if carried is not None:
                self.gate.start_off(carried)
        # Drafters that keep finding nothing are asked less often (a lone draft model finds
        # nothing only while its controller has it off, and is then asked on its probes).
        self._idle = IdleBackoff() if self.adaptive else None

    def end_text(self) -> None:
        """The text's steps are over: a slot's curve leaves the batch's mean at once (an idle
        slot's would stand in it for FRESH_SECONDS while the batch no longer counts it)."""
        if self.batch is not None:
            self.batch.drop(id(self))

    def share(self, others: int, others_tokens: int = 0) -> None:
        """The next pass carries ``others`` other sequences feeding ``others_tokens`` tokens
        (TargetCosts.sharing, TargetCosts.share); called again once a pass has run, with what it held."""
        self.target_costs.sharing = others
        self.target_costs.share(others_tokens)

    def reads_prompt(self, drafter: Drafter) -> bool:
        """A draft model for which no draft could pay, were every token accepted (a server's slots
        filling the machine: DraftLengthController.could_pay), leaves the prompt unread: it drafts
        nothing until that changes, and then catches up on the text. Read at once, 16 answers
        with 8 slots had the draft model read ~7 tokens a token it drafted. On slots sharing a
        draft length (``batch``) it reads it when first asked to draft, if ever: the read is a draft
        pass every other slot's pass waits for, and with 4 slots whose batch then drafted nothing
        the reads took a tenth of a Spec-Bench phase. So also where other slots are generating
        though no pass was shared yet: 8 requests opening together each read their prompt into the
        draft model before the target's first pass (first tokens at 8.2 s against plain batching's 4.5)."""
        if not (self.adaptive and drafter.name in self.paid and drafter.defers_prompt):
            return True
        if self.batch is not None and (self.target_costs.sharing or self.batch.generating() >= 2):
            return False
        return self._controller_for(drafter.name).could_pay()

    def at_context(self, length: int, text: Sequence[int] | None = None, remaining: int | None = None) -> None:
        """The next pass reads ``length`` tokens of context: the target's costs and every drafter's
        follow it (TargetCosts.at_context). ``text``: that context, and ``remaining``: the tokens
        the run may still generate (a draft model's catch-up on slots is priced against them)."""
        self._context_len = length
        self._text, self._remaining = text, remaining
        self.target_costs.at_context(length)
        for costs in self.memory.draft_costs.values():
            costs.at_context(length)

    def plan(self) -> Plan:
        self._rest_alternatives()
        if self._timing_plain():
            self._plain_timing_steps -= 1
            return PLAIN
        if (
            (self.adaptive and not self.gate.speculating)
            or (self._idle is not None and not self._idle.ask() and self._paid_may_pass())
        ):
            return PLAIN
        return Plan(draft=True)

    def plan_after_forced(self) -> Plan:
        return PLAIN if self._timing_plain() else self.plan()

    def _timing_plain(self) -> bool:
        """Is plain decoding still to be timed at this text's context (start_text), within the cap?"""
        return bool(self._plain_timing and self._plain_timing_steps > 0)

    def skip_pass(self) -> None:
        self._previous_pass = None  # the next pass's shape change is no choice's (TargetCosts.note_pass)

    def plain_next(self) -> bool:
        # Not where the next step times plain decoding (a queued pass is not a pass's cost:
        # ``StepReport.queued``); within the gate's plain stretch, not its last step; or where the
        # idle drafters wait another step and no draft model is due.
        if self._timing_plain():
            return False
        if self.adaptive and self.gate.plain_steps_left() > 1:
            return True
        return self._idle is not None and self._idle.waiting and self._paid_all_may_pass()

    def budget(self, drafter: Drafter, draft_len: int) -> int:
        """A paid drafter's length, chosen just before it drafts (its controller's probes count
        the steps it is asked on); a cheap drafter's whole proposal, cut in ``chosen``."""
        if not drafter.pays_per_token or draft_len <= 0:
            return draft_len
        if drafter.name in self._resting:
            return 0
        controller = self._controller_for(drafter.name, fixed=not self.adaptive)
        shared = self._batch_length(controller)
        if shared is not None:
            return min(shared, draft_len) if shared and self._catch_up_pays(drafter) else 0
        return controller.choose(draft_len)

    def _catch_up_pays(self, drafter: Drafter) -> bool:
        """On slots decoding together: does the rest of this text repay what the draft model reads
        before it drafts (the text decoded while it was not asked, a new text's prompt left
        unread: ``reads_prompt``)? The read is a pass every other slot waits for: the batch loses
        its seconds, at the draft's measured seconds a token; drafting the batch's length, each
        token left of this text saves the batch its share of a plain pass's gain (BatchDrafts.saving),
        the run's token limit bounding the tokens left. A token's read costs what the batch timed
        of the draft model's reads (BatchDrafts.read_seconds), or before it knows, what this
        drafter's own catch-ups took; a read whose cost neither knows yet is made (and timed)."""
        if self._text is None or self._remaining is None or not self.target_costs.sharing:
            return True
        unread = drafter.behind(self._text)
        per_token = self.batch.read_seconds()
        if per_token is None:
            per_token = drafter.read_seconds
        saving = self.batch.saving(self.target_costs.sharing + 1)
        if unread <= 0 or per_token is None or saving is None:
            return True
        return unread * per_token <= self._remaining * saving

    def _batch_length(self, controller: DraftLengthController) -> int | None:
        """Slots decoding together (``batch``): the length every slot drafts, the one the whole
        batch gains most by, this slot's expected tokens posted first (control/batch.py); 0 where
        the slots generating are held plain, even on a pass alone; None alone or where not yet told."""
        if self.batch is None or not self.adaptive:
            return None
        limit = controller.max_draft_len
        if self.target_costs.sharing:
            self.batch.post(id(self), expected_tokens(controller.acceptances(limit), limit))
        return self.batch.length(self.target_costs.sharing + 1, limit)

    def takes(self, proposal: Proposal, member: int, draft_len: int) -> bool:
        """Adaptive, with a draft model behind: a cheap proposal is taken when it promises more
        than asking the draft model; otherwise a chain's ``min_tokens`` rule. An alternative
        (the draft model's windowed cache) was picked to draft this step in place of the full
        cache after it (``_rest_alternatives``): what it drafts is taken."""
        if self.drafter.members[member].alternative_to is not None:
            return bool(proposal.tokens)
        if self.adaptive and self.paid and member < len(self.drafter.members) - 1:
            return bool(proposal.tokens) and self._cheap_worth_taking(proposal)
        return takes_at_least(proposal, self.drafter, draft_len)

    def chosen(self, proposal: Proposal, passed_over: Sequence[Proposal], context_len: int) -> Proposal:
        """The proposal cut to the nodes worth verifying; every cheap proposal made is scored
        against the output to come (a proposal cut to nothing or passed over included), and
        every branching one's second guesses. Where the target verifies trees, the proposals
        passed over are merged in rather than dropped (``_merged``)."""
        cheap = [each for each in (*passed_over, proposal) if each.tokens and each.source not in self.paid]
        if self._idle is not None:
            self._idle.found(bool(cheap))
        if self.adaptive and (proposal.tokens or cheap):
            for each in cheap:
                self._scores.add(self._controller_for(each.source, kind=each.kind), context_len, each.main_chain.tokens)
            for each in (*passed_over, proposal):
                if self.max_nodes and not each.is_chain:
                    self._tree_scores.add(self._branch_rates(each.source), context_len, each.tree)
        shaped = self._cut(proposal)
        if not self.max_nodes or not passed_over or not self.merge_chains:
            return shaped
        return self._merged(shaped, [self._cut(each) for each in passed_over])

    def _cut(self, proposal: Proposal) -> Proposal:
        """One member's proposal cut to the nodes worth verifying (adaptive; else as made)."""
        if not self.adaptive or not proposal.tokens:
            return proposal
        member = self._member(proposal.source)
        if member is not None and member.whole_proposals:  # whole or not at all: the gate decides
            return proposal
        controller = self._controller_for(proposal.source, kind=proposal.kind)
        if proposal.source in self.paid:  # drafted at the length chosen for it (budget)
            return self._shaped(proposal, len(proposal.main_chain), controller)
        # A cheap drafter's tokens cost nothing to drop: keep the worthwhile part.
        return self._shaped(proposal, controller.choose(len(proposal.main_chain)), controller)

    def _merged(self, chosen: Proposal, others: Sequence[Proposal]) -> Proposal:
        """A chain's proposals of this step as one token tree (drafters/chain.py, merge_proposals):
        the one the walk took (``chosen``) and those it passed over, each already cut by its own
        controller, so that a lookup branch and the draft model's chain are verified in the same
        pass. Only where the target verifies trees (``max_nodes``), and only proposals the walk
        made anyway: the draft model is asked exactly as often as without merging.

        The draft model's proposal goes in first, then the cheap ones in the chain's order: its
        rows stay the distributions its tokens were drawn from, the verifier tries its node
        before a cheap sibling (its acceptance statistics are what they would be alone), and the
        merge is exact at any temperature. The draft model's nodes and the chosen proposal's are
        kept; another proposal's nodes join while each raises the expected tokens a second of
        the pass (control/trees.py, select_merged; with fixed lengths, all within the caps).
        Proposals of drafters that read the whole pass (a lookahead window) are never merged.
        """
        parts = [each for each in (chosen, *others) if each.tokens and self._mergeable(each.source)]
        if len(parts) < 2 or not self._mergeable(chosen.source):
            return chosen
        order = {member.name: index for index, member in enumerate(self.drafter.members)}
        parts.sort(key=lambda each: (each.source not in self.paid, order.get(each.source, len(order))))
        merged = merge_proposals(parts)
        if len(merged) == len(chosen) and parts[0] is chosen:
            return chosen  # the others' nodes are all in it already
        forced_parts = [index for index, part in enumerate(parts) if part is chosen or part.source in self.paid]
        forced = [False] * len(merged)
        for index in forced_parts:
            for node in merged.part_nodes[index]:
                forced[node] = True
        values, fixed = None, 0.0
        if self.adaptive:
            part_values = [node_values(part.tree, self._acceptances(self._controller_for(part.source, kind=part.kind)),
                                       self._branch_rates(part.source)) for part in parts]
            values = merged_values(merged, part_values)
            fixed = self.target_costs.switch_charge
            for part in parts:
                if part.source in self.paid:  # spent whatever is verified: it dilutes the pass's cost
                    controller, chain_len = self._controller_for(part.source), len(part.main_chain)
                    fixed += controller.draft_costs.table(chain_len)[chain_len] or 0.0
        costs = self.target_costs.table(self.max_nodes + 1)
        kept = select_merged(merged.tree, forced, values, costs, fixed, self.max_nodes, self.max_paths)
        result = merged.select(kept)
        if len(result) == len(chosen) and parts[0] is chosen and all(node >= 0 for node in result.part_nodes[0]):
            return chosen  # nothing of the others was worth its place
        return result

    def _mergeable(self, source: str) -> bool:
        member = self._member(source)
        return member is not None and not member.reads_pass and not member.whole_proposals

    def _shaped(self, proposal: Proposal, chain_len: int, controller: DraftLengthController) -> Proposal:
        """``chain_len`` nodes of the main chain, and the second guesses worth verifying with
        it (control/trees.py); a chain where trees are off."""
        if proposal.is_chain or not self.max_nodes:
            return proposal.main_chain.prefix(chain_len)
        values = node_values(proposal.tree, self._acceptances(controller), self._branch_rates(proposal.source))
        drafting = 0.0
        if proposal.source in self.paid:  # spent whatever is verified: it dilutes the pass's cost
            drafting = controller.draft_costs.table(chain_len)[chain_len] or 0.0
        costs = self.target_costs.table(self.max_nodes + 1)
        fixed = self.target_costs.switch_charge + drafting
        return shape_tree(proposal, chain_len, values, costs, fixed, self.max_nodes, self.max_paths)

    @staticmethod
    def _acceptances(controller: DraftLengthController) -> list[float]:
        """A controller's acceptance by depth, as deep as it plans (a drafter's own depth where
        that is less than the run's: ``_longest``)."""
        return controller.acceptances(controller.max_draft_len)

    def _branch_rates(self, source: str) -> BranchRates:
        return self.branch_rates.setdefault(source, BranchRates())

    def observe(self, report: StepReport) -> None:
        self._observe_pass(report)
        if self._picks and report.proposal.tokens:
            proposal = report.proposal
            parts = proposal.parts if isinstance(proposal, MergedProposal) else (proposal,)
            for pick in self._picks.values():
                pick.drafted({part.source for part in parts})
        self._scores.score(report.context)
        self._tree_scores.score(report.context)
        if not self.adaptive or report.forced:  # the gate weighs speculating against plain steps,
            return  # not against passes of forced tokens, which run whatever it decides
        plain = self.target_costs.plain
        proposing = report.draft_seconds  # asking the drafters (about none where nothing is asked)
        engaged = bool(report.proposal.tokens) or (plain is not None and proposing > PROPOSING_SHARE * plain)
        emitted = len(report.context) - report.context_len
        self.gate.record(emitted, self.clock() - report.started, engaged, plain)
        if self.batch is not None:  # what the batch gets, measured (control/batch.Realised)
            self.batch.emitted(self.target_costs.sharing + 1, emitted)

    # ---- the controllers ----------------------------------------------------------------
    def _observe_pass(self, report: StepReport) -> None:
        proposal = report.proposal
        n_fed = report.forced + len(proposal.tokens) + 1
        # after forced tokens the next pass's shape change is the grammar's, charged to no choice
        previous, self._previous_pass = self._previous_pass, None if report.forced else n_fed
        if not self.target_costs.note_pass(n_fed, report.verify_seconds, previous):
            return  # a plain pass that paid for the speculative one before it: timed as switching back
        if isinstance(proposal, MergedProposal):
            self._observe_merged(report, proposal)
        elif not proposal.tokens:
            if not report.queued:  # a queued pass ran beside the step before: the gate sees it whole
                self.target_costs.observe(1, report.verify_seconds)  # what speculating must beat
                self._plain_timing = max(self._plain_timing - 1, 0)
        elif not self.adaptive and proposal.source not in self.paid:
            # A fixed chain's cheap drafter is not gated: its pass only times T_target(n).
            self.target_costs.observe(n_fed, report.verify_seconds)
        else:
            controller = self._controller_for(proposal.source, fixed=not self.adaptive, kind=proposal.kind)
            if self.adaptive and proposal.source not in self.paid:  # its acceptance comes from ProposalScores
                controller.observe_costs(len(proposal.tokens), report.draft_seconds, report.verify_seconds,
                                         n_fed - 1)
            else:
                # T_draft(k) is what drafting k tokens costs. A draft model skipped for a while
                # first reads what it missed, whatever k: charged to k, that made one draft call
                # look dearer by the catch-up (a fresh run's first draft follows two plain
                # steps). The gate still sees the whole step's time.
                drafting = report.draft_seconds - self._member(proposal.source).catch_up_seconds
                # a tree: acceptance and drafting by its main chain, the pass by all its nodes
                chain = len(proposal.main_chain)
                controller.observe(chain, report.chain_accepted, drafting, report.verify_seconds, n_fed - 1)

    def _observe_merged(self, report: StepReport, proposal: MergedProposal) -> None:
        """A merged tree's pass: each draft model among its parts learns from the nodes of its
        own chain that the accepted path went through (MergedProposal.accepted_by_part), as a
        chain of that many verified nodes; the pass's cost counts once, for all its nodes. The
        cheap parts learn their acceptance from the output, as every cheap proposal does
        (ProposalScores), so a part is credited where its branch holds the accepted path."""
        credits = proposal.accepted_by_part(report.path)
        timed = False
        for index, part in enumerate(proposal.parts):
            verified = proposal.verified_chain(index)
            if part.source not in self.paid or not verified:
                continue
            controller = self._controller_for(part.source, fixed=not self.adaptive, kind=part.kind)
            drafting = report.draft_seconds - self._member(part.source).catch_up_seconds
            if timed:  # one pass: its cost is observed once
                controller.observe_acceptance(verified, credits[index])
            else:
                controller.observe(verified, credits[index], drafting, report.verify_seconds, len(proposal))
                timed = True
        if timed:
            return
        if not self.adaptive:
            self.target_costs.observe(len(proposal) + 1, report.verify_seconds)
            return
        main = proposal.parts[0]
        self._controller_for(main.source, kind=main.kind).observe_costs(
            len(main.main_chain), report.draft_seconds, report.verify_seconds, len(proposal))

    def _paid_may_pass(self) -> bool:
        """May the drafters go unasked on this step, as far as the draft models are concerned
        (not while one is on or due for a probe)? If so, the step counts towards their probes."""
        if not self._paid_all_may_pass():
            return False
        for controller in self._paid_controllers():
            controller.pass_step()
        return True

    def _paid_all_may_pass(self) -> bool:
        """Would every draft model's controller let its drafter go unasked on this step?"""
        return all(controller.may_pass() for controller in self._paid_controllers())

    def _paid_controllers(self) -> list[DraftLengthController]:
        return [self._controller_for(source, fixed=not self.adaptive) for source in self.paid
                if source not in self._resting]

    # ---- alternatives: one draft model, two caches ----------------------------------------
    def _rest_alternatives(self) -> None:
        """For each drafter that is an alternative to another (the draft model with a windowed
        cache beside its full one: Drafter.alternative_to), which of the two rests this step:
        the alternative while the context is short enough for both to read the same tokens, and
        for the rest of a text whose prompt is shorter than it engages from (it then read no
        prompt: DraftModelDrafter.prefill); else the one AlternativePick does not choose.

        An answer that outgrows the window does not turn to it: its first draft would read the
        window's tokens (sinks + window) where it saves only the few the context has passed them
        by. On the bench-scale pair a forced tool call's ~500-token prompt crossed 580 tokens
        mid-answer and that first window draft took 1.25 s, a third of the answer's time. The
        next text (a chat's next turn, its prompt the whole conversation) reads it in its prefill."""
        self._resting = set()
        if self.drafter is None:
            return
        for member in self.drafter.members:
            other = member.alternative_to
            if other is None or self._member(other) is None:
                continue
            if self._prompt_len < member.engages_from or self._context_len <= member.alike_below:
                self._resting.add(member.name)
                continue
            pick = self._picks.setdefault(member.name, AlternativePick(member.name, other))
            chosen = pick.choose(self._best_rate)
            self._resting.add(other if chosen == member.name else member.name)

    def _best_rate(self, source: str) -> float | None:
        """The most tokens per second a paid drafter's controller expects at any draft length
        (0.0 while it has it switched off; None before it was timed)."""
        controller = self._controller_for(source, fixed=not self.adaptive)
        if not controller.speculating:
            return 0.0
        rates = controller.expected_rates(self.max_draft_len)[1:]
        return None if not rates or None in rates else max(rates)

    def _cheap_worth_taking(self, proposal: Proposal) -> bool:
        """Does this cheap proposal promise more tokens per second than asking the draft model?

        Both sides from measured figures: the cheap source's acceptance by position and
        the target's verify costs, against the best rate the draft model's controller
        expects. Unmeasured sides are explored. A declined proposal is still scored
        against the output (ProposalScores), so the cheap source's estimates stay current.
        """
        paid_controllers = self._paid_controllers()
        if not any(controller.speculating for controller in paid_controllers):
            # Switched off, the draft model would propose nothing: the cheap proposal is all
            # there is (and weighing it cost ~25 us a step, 2% of a tiny-regime step).
            return True
        cheap = self._controller_for(proposal.source, kind=proposal.kind)
        # a tree's lengths as the cut reads them (``chosen``): its main chain's
        cheap_rates = cheap.expected_rates(min(len(proposal.main_chain), self.max_draft_len))
        paid_rates = [controller.expected_rates(self.max_draft_len) for controller in paid_controllers]
        if None in cheap_rates:
            return True
        if any(None in rates for rates in paid_rates):
            return False  # the draft model has not been timed yet: try it
        return max(cheap_rates) >= max(max(rates[1:]) for rates in paid_rates)

    def _member(self, source: str) -> Drafter | None:
        """The drafter (or chain member) whose proposals carry ``source``, if any."""
        return next((m for m in self.drafter.members if m.name == source), None)

    def _counts_draft_time(self, source: str) -> bool:
        """Is a source's drafting time charged to the lengths it drafts (a draft model), or
        sunk before its proposal is cut (a cheap drafter)?"""
        return source in self.paid

    def _longest(self, member: Drafter | None) -> int:
        """The longest draft a source's controller plans: the run's, or the drafter's own depth where
        that is less (heads: a head a depth). Planned to the run's 16, a controller weighed depths its
        drafter never reaches at the acceptance it presumes there, inherited from the positions it
        had drafted, and its gate kept drafting on the strength of drafts no step could make."""
        bound = member.most_tokens if member is not None else None
        return self.max_draft_len if bound is None else min(self.max_draft_len, bound)

    def _controller_for(self, source: str, fixed: bool = False, kind: str = "") -> DraftLengthController:
        """The controller of a source's proposals of one kind (Proposal.kind), made on first use."""
        key = f"{source}:{kind}" if kind else source
        controller = self.controllers.get(key)
        member = self._member(source)
        longest = self._longest(member)
        if controller is None or (controller.max_draft_len, controller.fixed) != (longest, fixed):
            if controller is not None:  # other settings: what it saw stays counted
                self.memory.keep_seen(key, controller)
                del self.controllers[key]
            paid = self._counts_draft_time(source)
            # the drafter's priors by kind, else measured ones (PolicyMemory.prior)
            prior, measured, curve = self.memory.prior(source, kind, member.kind_priors if member is not None else {})
            controller = DraftLengthController(
                max_draft_len=longest,
                fixed=fixed,
                target_costs=self.target_costs,
                draft_costs=self.memory.draft_costs_of(source),
                ramp_up=True,  # lengths grow with the evidence, not the prior
                # A cheap drafter's proposal is made before it is cut: its time is sunk, and a
                # wrong first try costs only verify positions (CHEAP_PROBE_LEN: why 4 of them).
                sunk_draft_cost=not paid,
                probe_len=PAID_PROBE_LEN if paid else CHEAP_PROBE_LEN,
                prior_accept=prior,
                prior_measured=measured,
                prior_curve=curve,
            )
            carried = self.memory.probe_gap_for(key, fixed)
            if carried is not None:
                controller.start_off(carried)
            self.controllers[key] = controller
        return controller


class AlternativePick:
    """Which of two drafters of one model drafts a step: the one whose controller expects more
    tokens per second (``rate``, at this step's context: a full cache's draft cost grows with it),
    one never timed first (the alternative before the original), the original on a tie. The
    resting one's estimates stand still while the other's move, so after ``RETRY_GAP`` drafting
    steps of one in a row the other is chosen until it has drafted once (unless its controller
    has it switched off: rate 0): a choice that only the resting one's stale figures keep is
    tried again."""

    RETRY_GAP = 32

    def __init__(self, alternative: str, original: str) -> None:
        self.alternative, self.original = alternative, original
        self.last = ""  # the one that drafted last…
        self.streak = 0  # …and its drafting steps in a row

    def choose(self, rate: Callable[[str], float | None]) -> str:
        """The one that drafts this step."""
        alternative_rate, original_rate = rate(self.alternative), rate(self.original)
        if alternative_rate is None:
            best = self.alternative
        elif original_rate is None:
            best = self.original
        else:
            best = self.alternative if alternative_rate > original_rate else self.original
        other = self.original if best == self.alternative else self.alternative
        other_rate = original_rate if other == self.original else alternative_rate
        if best == self.last and self.streak >= self.RETRY_GAP and other_rate != 0.0:
            return other
        return best

    def drafted(self, sources: set[str]) -> None:
        """A verified proposal was made by (or merged from) ``sources``."""
        for name in (self.alternative, self.original):
            if name in sources:
                self.streak = self.streak + 1 if name == self.last else 1
                self.last = name
