"""`specrun tune`: calibrate this machine for a target/draft pair and save the best settings."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from specrun.cli_common import (
    BackendOpt,
    DraftOpt,
    MaxTokensOpt,
    RegistryOpt,
    TargetOpt,
    ThreadsOpt,
    check_range,
    cli_errors,
)


def tune(
    target: TargetOpt = None,
    draft: DraftOpt = None,
    backend: BackendOpt = "auto",
    prompts: Annotated[int, typer.Option("--prompts", help="Built-in prompts to calibrate on.")] = 4,
    max_tokens: MaxTokensOpt = 64,
    threads: ThreadsOpt = None,
    registry: RegistryOpt = None,
    show: Annotated[bool, typer.Option("--show", help="Print the saved settings and exit.")] = False,
) -> None:
    """Measure plain decoding, each draft length and confidence stops on this machine; later runs use the best."""
    with cli_errors():
        from specrun import tuning

        out = Console(file=sys.stdout)
        if show:
            out.print(render(tuning.load_all()))
            return
        check_range("--prompts", prompts, 1, 50)
        check_range("--max-tokens", max_tokens, 8, 4096)
        result = run_tune(target, draft, backend, prompts, max_tokens, threads, registry)
        path = tuning.save(result)
        out.print(render([result]))
        typer.echo(f"saved to {path}", err=True)


def run_tune(target, draft, backend, n_prompts, max_tokens, threads, registry):
    from specrun import tuning
    from specrun.errors import UsageError
    from specrun.loading import LoadOptions, choose_pair, open_pair
    from specrun.prompts import CODE_PROMPTS

    target, draft = choose_pair(target, draft, registry)
    if draft is None:
        raise UsageError(f"no draft model for {target}", "pass --draft MODEL")
    target_backend, draft_backend = open_pair(
        target, draft, LoadOptions(backend=backend, threads=threads, registry=registry)
    )
    try:
        prompts = [target_backend.tokenize(text) for text in CODE_PROMPTS[:n_prompts]]
        key = tuning.pair_key(target_backend, draft_backend, threads)
        err = Console(stderr=True)
        return tuning.calibrate(
            target_backend,
            draft_backend,
            prompts,
            max_tokens,
            key,
            on_progress=lambda round_number, done, total: err.print(
                f"round {round_number}: calibrated {done}/{total} prompts"
            ),
        )
    finally:
        target_backend.close()
        draft_backend.close()


def render(results) -> Table:
    table = Table(title="tuned settings (specrun tune)")
    for column in ("target", "draft", "best draft length", "confidence stop", "speed-up", "acceptance",
                   "tok/s by setting"):
        table.add_column(column)
    for result in results:
        rates = ", ".join(f"{name} {rate:.0f}" for name, rate in result.tokens_per_second.items())
        table.add_row(
            result.target,
            result.draft,
            str(result.best_draft_len) if result.best_draft_len else "0 (plain is fastest)",
            f"p < {result.best_min_prob:g}" if result.best_min_prob else "none",
            f"{result.speedup:.2f}×",
            f"{100 * result.acceptance:.0f}%"
            + (f" (first token {100 * result.first_acceptance:.0f}%)" if result.first_acceptance else ""),
            rates,
        )
    return table
