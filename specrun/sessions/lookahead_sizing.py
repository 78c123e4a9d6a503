"""Lookahead's window and n-gram length from this machine's pass costs (issue 30).

A lookahead pass verifies every node of its window and candidates, so what a size yields (tokens
a pass: ``drafters.lookahead.TOKENS_PER_PASS``, a property of the text) is weighed against what
a pass of its nodes costs here, in plain steps. The costs come from earlier runs of the target
on this machine (learned.json, ``tuning.learn_from_run``), else from a probe of a few passes
before the first run: the ladder's sizes smallest first, stopping once a pass costs more plain
steps than any wider size could yield tokens (on a 2-core CPU after the first size, ~0.1 s).

``--method lookahead`` without ``--lookahead`` runs the size with the most tokens a second, and
where even that one is predicted slower than plain decoding its gate starts off (it retries
after a stretch of plain steps, as a gate that found it losing would). ``auto`` drafts with a
lookahead window beside its other drafters only where the costs earlier runs measured predict
it pays by a margin; it probes nothing (auto must never cost a user time to find out).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specrun.control.adaptive import TargetCosts
from specrun.drafters.lookahead import LADDER, TOKENS_PER_PASS, LookaheadSizes, choose_sizes

# auto adds a lookahead window only where it is predicted this much faster than plain decoding:
# the prediction counts neither asking the drafters nor the tokens lookup would have copied anyway.
AUTO_MARGIN = 1.15
PROBE_REPEATS = 3
PROBE_CONTEXT = 32  # tokens of the prompt the probe's passes follow


@dataclass(frozen=True)
class SizeChoice:
    """The sizes chosen, the speed-up over plain decoding they are predicted, and the costs
    (tokens fed -> seconds) the prediction rests on."""

    sizes: LookaheadSizes
    predicted: float
    costs: dict[int, float]

    def describe(self) -> str:
        return (f"lookahead {self.sizes} (window:ngram:candidates) chosen from this machine's pass costs, "
                f"predicted {self.predicted:.2f}x plain decoding")


def relative_costs(seconds: dict[int, float]) -> Callable[[int], float]:
    """A pass over n tokens in one-token passes, from measured seconds (a line through them
    where n was not measured, never decreasing in n: ``TargetCosts``)."""
    costs = TargetCosts()
    costs.preload(seconds)
    plain = costs.plain
    return lambda n: costs(n) / plain


def stored_costs(stored) -> dict[int, float] | None:
    """An earlier run's entry's (tuning.TuneResult or None) target pass costs, where they say
    enough to choose a size; else None (then a probe measures them)."""
    return stored.target_costs if stored is not None and covers(stored.target_costs) else None


def covers(seconds: dict[int, float] | None) -> bool:
    """Do stored costs say enough to choose: plain decoding's pass and a pass at least as wide
    as the smallest size's?"""
    return bool(seconds) and 1 in seconds and max(seconds) >= 1 + LADDER[0].max_nodes


def fitting(max_nodes: int, max_paths: int) -> Callable[[LookaheadSizes], bool]:
    """The sizes a run's trees can hold: at most ``max_nodes`` drafted nodes (0: any) and
    ``max_paths`` root-to-leaf paths (0: any; a llama.cpp context's sequence ids)."""
    return lambda sizes: (not max_nodes or sizes.max_nodes <= max_nodes) and (not max_paths or sizes.paths <= max_paths)


def probe_costs(time_passes: Callable[[list[int]], dict[int, float]], fits: Callable[[LookaheadSizes], bool]
                ) -> dict[int, float]:
    """T(1) and T(1 + nodes) of each size that fits, smallest first, as ``time_passes(counts)``
    times them; stops once a pass costs more plain steps than any size from there on yields."""
    costs = time_passes([1])
    for index, sizes in enumerate(LADDER):
        if not fits(sizes):
            continue
        n = 1 + sizes.max_nodes
        costs.update(time_passes([n]))
        best_left = max(TOKENS_PER_PASS[wider] for wider in LADDER[index:])
        if costs[n] / costs[1] >= best_left:
            break
    return costs


def choose(costs: dict[int, float], fits: Callable[[LookaheadSizes], bool]) -> SizeChoice:
    sizes, predicted = choose_sizes(relative_costs(costs), fits)
    return SizeChoice(sizes, predicted, dict(costs))
