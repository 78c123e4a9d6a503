"""Will it pay, before anything is timed: forecasts from a target's stored pass costs.

Each forecast weighs what a method yields a pass (a property of the text and the drafter)
against what a pass of its tokens costs on this machine, in plain steps (``relative_costs``,
from the target's pass costs that earlier runs or a probe measured). A run takes a method in
by itself, or sizes it, only where its forecast says it pays:

- token trees where none were asked: second guesses over a chain (``predicted_tree_gain``);
- a target's own heads beside auto's other drafters (``predicted_heads_gain``);
- lookahead's window and n-gram length (``choose_sizes``, ``choose``), and whether auto drafts
  with a window at all (``AUTO_MARGIN``).

Pure arithmetic: what times the target (lookahead's probe) stays with the sessions
(sessions/lookahead_sizing.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specrun.control.costs import TargetCosts
from specrun.control.trees import BranchRates
from specrun.drafters.lookahead import LADDER, LookaheadSizes


def relative_costs(seconds: dict[int, float]) -> Callable[[int], float]:
    """A pass over n tokens in one-token passes, from measured seconds (a line through them
    where n was not measured, never decreasing in n: ``TargetCosts``)."""
    costs = TargetCosts()
    costs.preload(seconds)
    plain = costs.plain
    return lambda n: costs(n) / plain


# ---- token trees where none were asked --------------------------------------------------------
# Trees where none were asked: a tree context costs llama.cpp ~2% on every pass (docs/perf.md
# 3(f)), so a run opens one by itself only where second guesses are predicted to win more.
TREE_MARGIN = 1.05
TYPICAL_CHAIN = 4  # the chain a prediction adds second guesses to, at TYPICAL_ACCEPTANCE a position
TYPICAL_ACCEPTANCE = 0.7


def predicted_tree_gain(relative: Callable[[int], float], branches: int, max_nodes: int,
                        acceptance: float = TYPICAL_ACCEPTANCE, chain_len: int = TYPICAL_CHAIN) -> float:
    """Tokens a second of a chain of ``chain_len`` drafts with the most valuable second guesses
    added (up to ``branches`` beside each position, ``max_nodes`` in all, each while it raises
    the rate, as ``shape_tree`` adds them), over the chain's alone; ``relative(n)``: a pass over
    n tokens in plain steps. Values at ``acceptance`` a position and ``BranchRates``' prior
    for a sibling: where one more token in a pass costs most of a plain step (a CPU) this is
    1.0, where a pass costs about the same whatever it holds (a GPU) well above it."""
    sibling = BranchRates().prior
    values = sorted(
        (acceptance ** (depth - 1) * (1 - acceptance) * (1 - sibling) ** (rank - 1) * sibling
         for depth in range(1, chain_len + 1) for rank in range(1, branches + 1)),
        reverse=True,
    )
    tokens = sum(acceptance ** depth for depth in range(chain_len + 1))
    nodes = chain_len
    chain_rate = best = tokens / relative(1 + nodes)
    for value in values:
        if nodes >= max_nodes:
            break
        rate = (tokens + value) / relative(2 + nodes)
        if rate <= best:
            break
        tokens, nodes, best = tokens + value, nodes + 1, rate
    return best / chain_rate


# ---- a target's own heads ---------------------------------------------------------------------
# A heads drafter is a paid drafter like the draft model: its policy weighs it step by step and
# keeps it off where it loses. But asking costs even then: the target's passes carry hidden
# states for it (a plain step's bookkeeping, ~4% on the demo target), and each probe drafts. So
# ``auto`` takes heads in only where they are predicted to win ``HEADS_MARGIN`` over plain
# decoding by themselves: tokens a pass from the heads' own held-out report (`specrun heads
# train` writes it), over the cost of a pass of k + 1 tokens (the target's stored costs, in plain
# steps) and k depths of the heads, each costing what its weights weigh against the target's
# (both passes read their weights once: memory-bound). On a 2-core CPU, where a 5-token pass
# costs ~3 plain steps, no heads qualify; on a GPU, where it costs ~1.1, heads a tenth of the
# target's size do. Before any run has stored the target's costs, none are taken in.
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


# ---- lookahead's sizes ------------------------------------------------------------------------
# A lookahead pass verifies every node of its window and candidates, so what a size yields
# (tokens a pass, below) is weighed against what a pass of its nodes costs here, in plain steps.
# ``--method lookahead`` without ``--lookahead`` runs the size with the most tokens a second;
# ``auto`` drafts with a window beside its other drafters only where it is predicted to pay by
# AUTO_MARGIN (sessions/lookahead_sizing.py says where the costs come from).

# Tokens a verify pass yields at each size (the target's own token included): the mean over
# 11 Spec-Bench chat prompts (11 categories), 128 tokens each, SmolLM2-135M-Instruct, greedy,
# depth 16 (benchmarks/lookahead_sizes.py; docs/perf.md 3(i)). A property of the text and the
# window, not of the machine; the machine's side is what a pass of each size costs.
TOKENS_PER_PASS = {
    LADDER[0]: 1.31,
    LADDER[1]: 1.36,
    LADDER[2]: 1.37,
    LADDER[3]: 1.49,
    LADDER[4]: 1.56,
    LADDER[5]: 1.56,
}

# auto adds a lookahead window only where it is predicted this much faster than plain decoding:
# the prediction counts neither asking the drafters nor the tokens lookup would have copied anyway.
AUTO_MARGIN = 1.15


def predicted_speedup(sizes: LookaheadSizes, relative_cost: Callable[[int], float]) -> float:
    """Tokens a second at ``sizes`` over plain decoding's: tokens a pass over what a pass of
    its nodes costs in plain steps (``relative_cost(n)``: a pass over n tokens, in one-token
    passes; it counts the token verified before the drafted ones)."""
    return TOKENS_PER_PASS[sizes] / relative_cost(1 + sizes.max_nodes)


def choose_sizes(relative_cost: Callable[[int], float],
                 fits: Callable[[LookaheadSizes], bool] = lambda sizes: True) -> tuple[LookaheadSizes, float]:
    """The size on the ladder that ``fits`` (the pass the target was opened for) with the most
    tokens a second on this machine, and its predicted speed-up over plain decoding (below 1:
    none pays here). Where a wide pass costs about a narrow one (a GPU), the wider windows win;
    where each token of a pass costs most of a plain step (a CPU), the smallest does."""
    candidates = [sizes for sizes in LADDER if fits(sizes)] or [LADDER[0]]
    best = max(candidates, key=lambda sizes: predicted_speedup(sizes, relative_cost))
    return best, predicted_speedup(best, relative_cost)


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


def covers(seconds: dict[int, float] | None) -> bool:
    """Do stored costs say enough to choose: plain decoding's pass and a pass at least as wide
    as the smallest size's?"""
    return bool(seconds) and 1 in seconds and max(seconds) >= 1 + LADDER[0].max_nodes


def fitting(max_nodes: int, max_paths: int) -> Callable[[LookaheadSizes], bool]:
    """The sizes a run's trees can hold: at most ``max_nodes`` drafted nodes (0: any) and
    ``max_paths`` root-to-leaf paths (0: any; a llama.cpp context's sequence ids)."""
    return lambda sizes: (not max_nodes or sizes.max_nodes <= max_nodes) and (not max_paths or sizes.paths <= max_paths)


def choose(costs: dict[int, float], fits: Callable[[LookaheadSizes], bool]) -> SizeChoice:
    """The sizes with the most tokens a second at these measured costs (tokens fed -> seconds)."""
    sizes, predicted = choose_sizes(relative_costs(costs), fits)
    return SizeChoice(sizes, predicted, dict(costs))
