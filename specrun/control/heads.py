"""Whether a target's own heads can pay beside auto's other drafters, before anything is timed.

A heads drafter is a paid drafter like the draft model: its policy weighs it step by step and
keeps it off where it loses. But asking costs even then: the target's passes carry hidden
states for it (a plain step's bookkeeping, ~4% on the demo target), and each probe drafts. So
``auto`` takes heads in only where they are predicted to win ``HEADS_MARGIN`` over plain
decoding by themselves: tokens a pass from the heads' own held-out report (`specrun heads
train` writes it), over the cost of a pass of k + 1 tokens (the target's stored costs, in plain
steps) and k depths of the heads, each costing what its weights weigh against the target's
(both passes read their weights once: memory-bound). On a 2-core CPU, where a 5-token pass
costs ~3 plain steps, no heads qualify; on a GPU, where it costs ~1.1, heads a tenth of the
target's size do. Before any run has stored the target's costs, none are taken in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

HEADS_MARGIN = 1.05  # predicted over plain decoding, for auto to take heads in
PRIOR_ACCEPTANCE = 0.6  # a depth's acceptance where the heads carry no held-out report (published files)


def predicted_heads_gain(relative: Callable[[int], float], acceptance: Sequence[float], depth_cost: float) -> float:
    """Tokens a second drafting with the heads alone at their best depth k, over plain decoding's:
    (1 + the chance of reaching each depth) / (relative(k + 1) + k · depth_cost), at least 1.0
    (k = 0, plain decoding). ``relative(n)``: a target pass over n tokens in one-token passes;
    ``acceptance[i]``: depth i + 1's chance given the depths before it were accepted;
    ``depth_cost``: a depth's drafting in one-token passes."""
    best, tokens, reach = 1.0, 1.0, 1.0
    for depth, chance in enumerate(acceptance, start=1):
        reach *= chance
        tokens += reach
        best = max(best, tokens / (relative(depth + 1) + depth * depth_cost))
    return best
