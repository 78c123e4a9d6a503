"""The bench on a terminal: one Rich table per category, then all prompts together."""

from __future__ import annotations

from rich import box
from rich.table import Table

from specrun.bench.figures import ALL_PROMPTS, Figures, by_category, mismatch_rows, same_output_label
from specrun.bench.runner import BenchResult
from specrun.blas import REFERENCE_BLAS_NOTE
from specrun.sessions.divergence import NEAR_TIE_NOTE, difference_line
from specrun.drafters.methods import needs_draft_model
from specrun.engine.stats import Stats
from specrun.wording import count_of

COLUMNS = ("method", "tok/s", "speed-up", "accepted", "tokens/step", "draft/verify", "same output")


def category_tables(result: BenchResult) -> list[Table]:
    """A table per category, the last one over every prompt with the geometric-mean speed-up."""
    return [_table(result, category, rows) for category, rows in by_category(result).items()]


def _table(result: BenchResult, category: str, rows: list[Figures]) -> Table:
    prompts = count_of(rows[0].prompts if rows else 0, "prompt")
    title = f"all {prompts}: geometric-mean speed-up" if category == ALL_PROMPTS else f"{category} ({prompts})"
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    cells = [row_cells(result, figures) for figures in rows]
    for i, column in enumerate(COLUMNS):
        # A narrow terminal shortens the headers and the verdicts, never a method's name or a figure.
        widest = max((len(row[i]) for row in cells), default=0)
        table.add_column(
            column,
            justify="left" if column in ("method", "same output") else "right",
            min_width=None if column == "same output" else widest,
            no_wrap=True,
        )
    for figures, row in zip(rows, cells):
        table.add_row(*row, style=_style(figures))
    return table


def row_cells(result: BenchResult, figures: Figures) -> tuple[str, ...]:
    """One variant's figures as the text of the COLUMNS."""
    comparison = result.comparison
    is_baseline = figures.variant == comparison.baseline
    drafted = figures.method != comparison.baseline
    return (
        figures.variant,
        f"{figures.tokens_per_second:.1f}",
        f"{figures.speedup:.2f}×",
        f"{100 * figures.acceptance_rate:.0f}%" if drafted else "–",
        f"{figures.mean_tokens_per_step:.2f}",
        f"{100 * figures.draft_share:.0f}%/{100 * figures.verify_share:.0f}%",
        same_output_label(figures, comparison.outputs_compared, is_baseline),
    )


def difference_lines(result: BenchResult) -> list[tuple[str, bool]]:
    """(line, is a defect) for every output that differs from plain decoding, where it first does."""
    exact = result.exact
    return [
        (difference_line(variant, result.prompts[m.prompt_index].prompt_id, m, exact), m.is_defect(exact))
        for variant, m in mismatch_rows(result)
    ]


def _style(figures: Figures) -> str | None:
    return "bold red" if figures.mismatches else None


def _busy(result: BenchResult) -> str | None:
    """Where other processes kept cores busy during the runs: how many of the target's passes ran
    on fewer threads (Stats.busy_note); None on a quiet machine or a fixed thread count."""
    total = Stats()
    for figures in result.comparison.figures.values():
        for runs in figures.by_prompt.values():
            for run in runs:
                total.add(run.stats)
    return total.busy_note() if total.busy_passes else None


def _tuned_settings(result: BenchResult) -> str:
    """What tune chose for this bench's lines, where the user did not: the draft model's
    confidence stop (every line with a draft model). Lengths adapt (tune's costs and
    acceptance seed the controllers) unless -k fixes them."""
    if result.config.draft_min_prob is None and result.draft_min_prob > 0.0:
        return f"draft model stops below p={result.draft_min_prob:g}"
    return ""


def footnotes(result: BenchResult) -> list[str]:
    """What the tables' figures mean, and anything the reader must know about them."""
    config = result.config
    repeats = f"median of {config.repeat} repeats" if config.repeat > 1 else "one run"
    notes = [
        f"{config.target} + {config.draft or 'no draft model'}, {config.max_new_tokens} new tokens, "
        f"{config.sampling.describe()}; generation time only (prefill excluded); methods "
        f"interleaved per prompt; speed-up per prompt = {repeats} vs the baseline, geometric mean over prompts",
        "draft/verify: share of generation time spent drafting and in the target's verify passes",
    ]
    adaptive = [v for v in result.comparison.variants.values() if v.adapts]
    if adaptive:
        names = ", ".join(v.name for v in adaptive)
        notes.append(f"adaptive (draft length chosen each step, up to {max(v.draft_len for v in adaptive)}, and "
                     f"speculation gated on plain decoding's speed): {names}; -k fixes the others' length")
    overall = by_category(result)[ALL_PROMPTS]
    if result.comparison.quality:
        notes.append(f"acceptance {result.comparison.acceptance} on every line that drafts: its texts are not the "
                     "target's own; same output: the share of plain decoding's tokens they repeat before the first "
                     "difference (greedy)")
    if any(f.near_ties for f in overall):
        notes.append(f"{NEAR_TIE_NOTE} (on llama.cpp an F32 KV cache, --kv-type f32, narrows it)")
    if (busy := _busy(result)) is not None:
        notes.append(f"{busy}: these figures are of a busy machine (llama.cpp's threads gave way, and the lines "
                     "shared it unevenly); on a quiet one they differ")
    if any(f.mismatches for f in overall):
        reason = "under --exact (identical output promised)" if result.exact else "where the target had a clear choice"
        notes.append(f"NO: an output differs from plain decoding {reason}: a DEFECT, located above")
    if result.tuned is not None:
        source = ("what earlier runs of this pair measured on this machine (learned.json)" if result.tuned_by_runs
                  else "`specrun tune`'s measurements for this pair")
        notes.append(f"controllers started from {source} ({result.tuned}); --untuned starts them from their priors")
        tuned_lines = _tuned_settings(result)
        if tuned_lines:
            whose = "the settings earlier runs learned" if result.tuned_by_runs else "tune's settings"
            notes.append(f"as `specrun generate` runs them, with {whose}: {tuned_lines}; --draft-min-prob sets it")
    elif result.config.use_tuned and any(needs_draft_model(m) for m in result.config.methods):
        notes.append("no `specrun tune` settings for this pair on this machine: controllers started from their priors")
    if (result.machine or {}).get("mlx_blas") == "reference":
        notes.append(REFERENCE_BLAS_NOTE)
    for skipped in result.skipped:
        notes.append(f"skipped {skipped.prompt.prompt_id} ({skipped.prompt.category}): {skipped.reason}")
    return notes
