"""`specrun tune`: calibrate this machine for a target/draft pair and save the best settings."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from specrun.cli.common import (
    BackendOpt,
    DraftOpt,
    MaxTokensOpt,
    PipeConsole,
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
    """Measure plain decoding, each draft length and confidence stops on this machine; later runs start from them."""
    with cli_errors():
        from specrun.sessions import tuning

        out = PipeConsole(file=sys.stdout)
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
    from specrun.sessions import tuning
    from specrun.errors import UsageError
    from specrun.registry.loading import LoadOptions, choose_pair, open_pair
    from specrun.sessions.prompts import CODE_PROMPTS

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


def render(results) -> Group:
    """Each tuned pair: its chosen settings on a few lines, then every setting's rate in a
    narrow table of its own (one long cell of rates wrapped into an unreadable column at 80)."""
    from specrun.sessions.tuning import baseline_of

    blocks: list = [Text("tuned settings (specrun tune)", style="bold")]
    for result in results:
        best = str(result.best_draft_len) if result.best_draft_len else "0 (plain is fastest)"
        stop = f"p < {result.best_min_prob:g}" if result.best_min_prob else "none"
        acceptance = f"{100 * result.acceptance:.0f}%" + (
            f" (first token {100 * result.first_acceptance:.0f}%)" if result.first_acceptance else ""
        )
        blocks.append(Text(f"\n{result.target}  +  {result.draft}", style="bold"))
        blocks.append(Text(f"  machine {result.machine}"))
        blocks.append(Text(f"  best fixed draft length (-k) {best}, confidence stop {stop}, speed-up {result.speedup:.2f}×"))
        blocks.append(Text(f"  draft tokens accepted {acceptance}"))
        table = Table(box=box.SIMPLE_HEAD, padding=(0, 1))
        table.add_column("setting")
        table.add_column("tok/s", justify="right")
        table.add_column("vs none", justify="right")
        for name, rate in result.tokens_per_second.items():
            plain = result.tokens_per_second.get(baseline_of(name))
            table.add_row(name, f"{rate:.0f}", f"{rate / plain:.2f}×" if plain else "–")
        blocks.append(table)
    return Group(*blocks)
