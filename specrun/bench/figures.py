"""Bench figures per prompt, per category and overall, as plain rows every output shares.

Speed-up on a prompt is the ratio of the medians over repeats (variant / baseline);
over several prompts it is the geometric mean of those ratios. tokens/s is total
tokens / total generation seconds; median tokens/s is over prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from specrun.bench.runner import BenchResult
from specrun.sessions.compare import Comparison
from specrun.sessions.divergence import Mismatch
from specrun.wording import count_of

ALL_PROMPTS = "all prompts"  # the overall group, after the categories


@dataclass(frozen=True)
class Figures:
    """One variant over a set of prompts."""

    variant: str
    method: str
    draft_len: int
    prompts: int
    tokens: int
    seconds: float
    tokens_per_second: float
    median_tokens_per_second: float
    speedup: float
    acceptance_rate: float
    mean_tokens_per_step: float
    draft_share: float
    verify_share: float
    mismatches: int  # defects: outputs that differ from the baseline's beyond rounding (any, under --exact)
    near_ties: int  # outputs that differ only where the target's two tokens tie within batch rounding
    # under a lossy acceptance rule (else None): the share of plain decoding's tokens the texts
    # repeat before their first difference (greedy), and the target's mean log-likelihood per token
    agreement: float | None = None
    log_likelihood: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def figures_for(comparison: Comparison, variant: str, prompt_indices: Sequence[int], exact: bool = False) -> Figures:
    """Aggregate ``variant`` over the given prompts; ``exact``: every difference is a defect."""
    figures = comparison.figures[variant].subset(prompt_indices)
    spec = comparison.variants[variant]
    wanted = set(prompt_indices)
    differing = [m for m in comparison.mismatches[variant] if m.prompt_index in wanted]
    return Figures(
        variant=variant,
        method=spec.method,
        draft_len=spec.draft_len,
        prompts=len(figures.by_prompt),
        tokens=figures.total_tokens,
        seconds=figures.total_seconds,
        tokens_per_second=figures.tokens_per_second,
        median_tokens_per_second=figures.median_tokens_per_second,
        speedup=comparison.geomean_speedup(variant, prompt_indices),
        acceptance_rate=figures.acceptance_rate,
        mean_tokens_per_step=figures.mean_tokens_per_step,
        draft_share=figures.draft_share,
        verify_share=figures.verify_share,
        mismatches=sum(m.is_defect(exact) for m in differing),
        near_ties=sum(not m.is_defect(exact) for m in differing),
        agreement=comparison.agreement(variant, prompt_indices),
        log_likelihood=comparison.mean_log_likelihood(variant, prompt_indices),
    )


def by_category(result: BenchResult) -> dict[str, list[Figures]]:
    """Each category's figures for every variant, then ``all`` prompts together."""
    groups = result.category_indices()
    groups[ALL_PROMPTS] = list(range(len(result.prompts)))
    return {
        category: [
            figures_for(result.comparison, variant, indices, result.exact) for variant in result.comparison.figures
        ]
        for category, indices in groups.items()
    }


def per_prompt(result: BenchResult) -> list[tuple[int, Figures]]:
    """(prompt index, figures) for every variant on every prompt, prompt by prompt."""
    return [
        (index, figures_for(result.comparison, variant, [index], result.exact))
        for index in range(len(result.prompts))
        for variant in result.comparison.figures
    ]


def sweep_curve(result: BenchResult) -> dict[str, list[tuple[int, float]]]:
    """Per fixed-length method: (draft length, overall speed-up) in draft-length order.

    Adaptive methods choose their own draft lengths, so they have no curve.
    """
    everything = range(len(result.prompts))
    curves: dict[str, list[tuple[int, float]]] = {}
    for name, spec in result.comparison.variants.items():
        if name != result.comparison.baseline and not spec.adapts:
            speedup = result.comparison.geomean_speedup(name, everything)
            curves.setdefault(spec.method, []).append((spec.draft_len, speedup))
    return {method: sorted(points) for method, points in curves.items()}


def mismatch_rows(result: BenchResult) -> list[tuple[str, Mismatch]]:
    """Every located output difference as (variant, mismatch)."""
    return [(variant, m) for variant, found in result.comparison.mismatches.items() for m in found]


def same_output_label(figures: Figures, outputs_compared: bool, baseline: bool) -> str:
    """The table's verdict on a variant's outputs against the baseline's."""
    if baseline:
        return "baseline" if not (figures.mismatches or figures.near_ties) else "NOT REPEATABLE"
    if figures.log_likelihood is not None:  # a lossy rule: the text is not the target's own
        return "no: lossy" if figures.agreement is None else f"no: lossy ({100 * figures.agreement:.0f}% agree)"
    if not outputs_compared:
        return "n/a (sampled)"
    near_ties = count_of(figures.near_ties, "near-tie")
    if figures.mismatches:
        label = f"NO: {count_of(figures.mismatches, 'prompt')}"
        return f"{label} (+{near_ties})" if figures.near_ties else label
    return f"yes* ({near_ties})" if figures.near_ties else "yes"
