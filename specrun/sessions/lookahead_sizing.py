"""The pass costs lookahead's window and n-gram length are chosen from (issue 30).

A lookahead pass verifies every node of its window and candidates, so what a size yields (tokens
a pass: ``control.forecasts.TOKENS_PER_PASS``, a property of the text) is weighed against what
a pass of its nodes costs here, in plain steps (``control.forecasts.choose``). The costs come
from earlier runs of the target on this machine (learned.json, ``tuning.learn_from_run``), else
from a probe of a few passes before the first run: the ladder's sizes smallest first, stopping
once a pass costs more plain steps than any wider size could yield tokens (on a 2-core CPU after
the first size, ~0.1 s).

``--method lookahead`` without ``--lookahead`` runs the size with the most tokens a second, and
where even that one is predicted slower than plain decoding its gate starts off (it retries
after a stretch of plain steps, as a gate that found it losing would). ``auto`` drafts with a
lookahead window beside its other drafters only where the costs earlier runs measured predict
it pays by a margin; it probes nothing (auto must never cost a user time to find out).
"""

from __future__ import annotations

from collections.abc import Callable

from specrun.control.forecasts import TOKENS_PER_PASS, covers
from specrun.drafters.lookahead import LADDER, LookaheadSizes

PROBE_REPEATS = 3
PROBE_CONTEXT = 32  # tokens of the prompt the probe's passes follow


def stored_costs(stored) -> dict[int, float] | None:
    """An earlier run's entry's (tuning.TuneResult or None) target pass costs, where they say
    enough to choose a size; else None (then a probe measures them)."""
    return stored.target_costs if stored is not None and covers(stored.target_costs) else None


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
