"""What an adaptive policy carries from one text to the next, and from earlier processes.

Acceptance belongs to the text: the draft-length controllers, the scores awaiting the output
and the gate are the policy's own and start again with each text. What ``PolicyMemory``
holds outlives them: the pass costs (the machine's), the priors `specrun tune` or earlier
runs measured for each drafter, the tries and acceptances by draft position of the texts
already forgotten (what a run keeps for the next: tuning.learn_from_run), and which drafters
start the next text off, and for how long.
"""

from __future__ import annotations

import itertools

from specrun.control.costs import DraftCosts, TargetCosts
from specrun.control.draft_length import DraftLengthController


class PolicyMemory:
    """The measurements an ``AdaptivePolicy`` keeps when it forgets a text's acceptance."""

    def __init__(self) -> None:
        self.target_costs = TargetCosts()
        self.draft_costs: dict[str, DraftCosts] = {}  # by drafter name
        self.prior_accepts: dict[str, float] = {}  # by drafter name: measured first-token acceptance
        self.prior_curves: dict[str, dict[int, float]] = {}  # by drafter name: measured acceptance by position
        # By controller key: tries and acceptances by draft position of the texts already forgotten
        # (AdaptivePolicy.forget_acceptance), undecayed, for what a run keeps for the next (seen_counts).
        self.seen: dict[str, tuple[list[float], list[float]]] = {}
        self.carried_gaps: dict[str, int] = {}  # a chain's paid drafters left off by the last text
        self.start_off: dict[str, int] = {}  # drafters earlier processes left off: for the first text
        self.gate_off: int | None = None  # plain steps the next text starts with (start_gate_off)

    def use_tuned(
        self,
        target_costs: dict[int, float],
        draft_costs: dict[str, dict[int, float]],
        prior_accepts: dict[str, float] | None = None,
        start_off: dict[str, int] | None = None,
        prior_curves: dict[str, dict[int, float]] | None = None,
    ) -> None:
        """Start from what `specrun tune` (or earlier runs) measured (AdaptivePolicy.use_tuned)."""
        self.target_costs.preload(target_costs)
        for source, seconds in draft_costs.items():
            self.draft_costs.setdefault(source, DraftCosts()).preload(seconds)
        self.prior_accepts.update(prior_accepts or {})
        self.prior_curves.update(prior_curves or {})
        self.start_off = dict(start_off or {})
        self.seen.clear()  # another pair's

    def forget_drafter(self) -> None:
        """Another drafter: what the old one left off, and what it saw, no longer apply."""
        self.carried_gaps = {}
        self.seen.clear()

    def end_text(self, controllers: dict[str, DraftLengthController], chain_paid: set[str]) -> None:
        """A text ends with these controllers: a paid drafter of a chain (``chain_paid``) left
        switched off starts the next text off too, probed after the gap it had reached (a gap
        the last text never reached its drafter with stays); what every controller saw is kept.

        Why a chain's draft model stays off: its first try in every text, and its probes every
        8 steps, cost a verify pass and draft passes each (~3 ms against a 1 ms plain step on
        the demo pair), which it seldom won back where lookup had done the copying. A/B on
        Spec-Bench (59 prompts x 3): auto 2.170x against 2.102x, lookup+draft 2.167x against
        2.134x. Alone, a draft model starts every text on: kept off, it gave up qa's 1.77x on
        the built-in suite (0.98x), where it is right on almost every token.
        """
        unused = {source: gap for source, gap in self.carried_gaps.items() if source not in controllers}
        self.carried_gaps = unused | {
            source: controller.probe_gap
            for source, controller in controllers.items()
            if source in chain_paid and not controller.speculating
        }
        for key, controller in controllers.items():
            self.keep_seen(key, controller)

    def seen_counts(self, key: str, controller: DraftLengthController | None) -> tuple[list[float], list[float]]:
        """Tries and acceptances by draft position (index 0 unused) under a controller key over
        every text since the drafter or the priors were set, ``controller`` (the current
        text's, if any) included, undecayed."""
        tried, accepted = self.seen.get(key, ([], []))
        if controller is None:
            return list(tried), list(accepted)
        return ([a + b for a, b in itertools.zip_longest(tried, controller.seen_tried, fillvalue=0.0)],
                [a + b for a, b in itertools.zip_longest(accepted, controller.seen_accepted, fillvalue=0.0)])

    def keep_seen(self, key: str, controller: DraftLengthController) -> None:
        """A controller is dropped: what it saw stays counted under its key."""
        self.seen[key] = self.seen_counts(key, controller)

    def probe_gap_for(self, key: str, fixed: bool) -> int | None:
        """The gap a new controller starts off with (used up by asking): what the last text
        left it at, else what earlier processes did (not for a length the user fixed, -k, which
        drafts until this run says otherwise); None: it starts on."""
        carried = self.carried_gaps.pop(key, None)
        if carried is None and not fixed:
            carried = self.start_off.pop(key, None)
        return carried

    def prior(self, source: str, kind: str, declared: dict[str, float]) -> tuple[float, bool, dict[int, float]]:
        """The acceptance a controller presumes before evidence, whether it was measured, and
        the acceptance measured by draft position (empty if none).

        The drafter's prior for the proposal's kind where it declares one (``declared``, its
        kind_priors: prompt lookup, by the length of the n-gram matched); else what `specrun
        tune` or earlier runs measured for the drafter (its first token's, and its curve by
        position); else the prior the drafter declares for all its proposals (kind ""; the
        n-gram pool); else the controllers' default.
        """
        if kind and kind in declared:
            return declared[kind], False, {}
        curve = self.prior_curves.get(source, {})
        if source in self.prior_accepts:
            return self.prior_accepts[source], True, curve
        if curve:
            return curve.get(1, DraftLengthController.prior_accept), True, curve
        return declared.get("", DraftLengthController.prior_accept), False, {}

    def draft_costs_of(self, source: str) -> DraftCosts:
        """T_draft of a drafter, made on first use."""
        return self.draft_costs.setdefault(source, DraftCosts())
