"""``specrun heads``: self-drafting heads for a target (``train``: Medusa, Hydra or EAGLE heads, on this machine)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from specrun.cli.common import check_backend, PipeConsole, check_outputs_apart, cli_errors
from specrun.cli.options import BackendOpt, HeadsPromptsOpt, HeadsSeedOpt, HeadsTargetOpt, RegistryOpt, ThreadsOpt
from specrun.cli.interrupts import INTERRUPTED_EXIT, say_interrupted
from specrun.errors import UsageError

heads_app = typer.Typer(help="Self-drafting heads for a target: train them on this machine.", no_args_is_help=True)


@heads_app.command("train")
def train(
    context: typer.Context,
    target: HeadsTargetOpt = "demo-target",
    kind: Annotated[str, typer.Option("--kind", help=(
        "Heads to train: medusa, hydra, eagle, or eagle3 (for --method eagle: EAGLE-3 over three of the target's "
        "layers, written as SpecForge exports it)."))] = "medusa",
    heads_out: Annotated[Optional[Path], typer.Option(
        "--heads-out", help="Where to write the heads (default: specrun's cache, where --heads finds them).")] = None,
    num_heads: Annotated[int, typer.Option("--num-heads", help="Heads: tokens guessed beyond the target's own (eagle, eagle3: the depth it drafts to; eagle3 trains 4 steps of it "
        "and drafts deeper on its own).")] = 4,
    num_layers: Annotated[int, typer.Option("--num-layers", help=(
        "Layers per head (medusa: residual blocks; hydra: one reading the drafted tokens, then blocks; "
        "eagle and eagle3 heads are one layer)."))] = 1,
    draft_vocab: Annotated[int, typer.Option(
        "--draft-vocab", help="Tokens the heads can guess: the target's most frequent in the data.")] = 4096,
    minutes: Annotated[float, typer.Option("--minutes", help="Wall-clock budget, data and training together.")] = 10.0,
    text: Annotated[Optional[Path], typer.Option(
        "--text", help="Learn from the text files in this folder (default: the target's own continuations).")] = None,
    prompts: HeadsPromptsOpt = None,
    eval_prompts: Annotated[Optional[Path], typer.Option(
        "--eval-prompts", help="Also report on these prompts, one a line, never trained on (the kind you will "
        "draft for, unlike the data; continued after training, at most 256): auto then expects what they show.")] = None,
    lr: Annotated[float, typer.Option("--lr", help="AdamW learning rate.")] = 1e-3,
    seed: HeadsSeedOpt = 0,
    registry: RegistryOpt = None,
    backend: BackendOpt = "auto",
    threads: ThreadsOpt = None,
    max_steps: Annotated[Optional[int], typer.Option("--max-steps", hidden=True)] = None,
) -> None:
    """Train heads that guess the target's next tokens from its hidden states.

    A second run with the same options resumes from the checkpoint a stopped one left."""
    with cli_errors():
        check_outputs_apart(context, "heads_out")
        check_backend(backend)
        from specrun.training.run import HeadsTrainRequest, check_request, train_heads

        request = HeadsTrainRequest(
            target=target, kind=kind, out=heads_out, num_heads=num_heads, num_layers=num_layers,
            draft_vocab=draft_vocab, minutes=minutes, text_dir=text, prompts_file=prompts,
            eval_prompts_file=eval_prompts, learning_rate=lr, seed=seed, registry=registry, backend=backend, threads=threads,
        )
        check_request(request)
        result = run_training(lambda **shown: train_heads(request, **shown), max_steps)
        PipeConsole(file=sys.stdout).print(render(result), soft_wrap=True)
        typer.echo(f"wrote {result.path}", err=True)


def run_training(train, max_steps: int | None, data_label: str = "gathering data"):
    """``train(on_progress=, on_note=, max_steps=)`` with its progress on stderr; a Ctrl-C ends the
    command with the one line saying which checkpoint was kept (exit 130)."""
    from specrun.training.run import TrainingInterrupted

    if max_steps is not None and max_steps < 1:  # 0 or fewer steps wrote weights that never trained
        raise UsageError(f"--max-steps must be at least 1, got {max_steps}", "pass a step count, e.g. --max-steps 100")
    try:
        progress = TrainingProgress(Console(stderr=True), data_label)
        with progress.shown():
            return train(on_progress=progress.update, on_note=progress.note, max_steps=max_steps)
    except TrainingInterrupted as exc:
        say_interrupted(exc.where())
        raise typer.Exit(INTERRUPTED_EXIT) from None


class TrainingProgress:
    """Rich bars on a terminal (data, then training: steps, loss, time left); on a pipe, a line
    at each note and every ~30 s."""

    PIPE_EVERY = 30.0

    def __init__(self, console: Console, data_label: str = "gathering data") -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.console = console
        self.data_label = data_label
        self.enabled = console.is_terminal
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TimeRemainingColumn(),
                            TextColumn("{task.fields[detail]}"), console=console, transient=True)
        self.tasks: dict[str, int] = {}
        self.last_line = 0.0

    def shown(self):
        """The bars on screen while the run lasts (a terminal only)."""
        return self.bar if self.enabled else contextlib.nullcontext()

    def note(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False)

    def update(self, progress) -> None:
        left = max(0.0, progress.budget - progress.elapsed)
        if progress.phase == "data":
            detail = f"{progress.tokens} tokens"
        else:
            steps = f"step {progress.step}" + (f"/{progress.max_steps}" if progress.max_steps else "")
            detail = f"{steps}  loss {progress.loss:.3f}"
        if not self.enabled:
            if progress.elapsed - self.last_line >= self.PIPE_EVERY:
                self.last_line = progress.elapsed
                self.note(f"{progress.phase}: {detail}, {left / 60:.1f} min left")
            return
        task = self.tasks.get(progress.phase)
        if progress.phase == "train" and "data" in self.tasks:  # gathering is over
            self.bar.remove_task(self.tasks.pop("data"))
        if task is None:
            label = self.data_label if progress.phase == "data" else "training"
            task = self.tasks[progress.phase] = self.bar.add_task(label, total=progress.budget, detail="")
        self.bar.update(task, completed=progress.elapsed, detail=detail)


def render(result) -> Group:
    """The held-out report: each head's accuracy alone and in a chain, and tokens per verify pass."""
    report = result.report
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1))
    table.add_column("head")
    table.add_column("guesses", justify="right")
    table.add_column("top-1", justify="right")
    table.add_column("in the chain", justify="right")
    for i, (alone, chained) in enumerate(zip(report.head_accuracy, report.chain_accuracy)):
        table.add_row(str(i), f"p+{i + 2}", f"{100 * alone:.1f}%", f"{100 * chained:.1f}%")
    other = result.other
    unseen = [] if other is None else [Text(
        f"on the --eval-prompts: {other.positions} positions, {other.tokens_per_pass:.2f} tokens per verify pass "
        f"(chain {', '.join(f'{100 * value:.1f}%' for value in other.chain_accuracy)}); auto expects these")]
    return Group(
        Text(f"held out: {report.positions} positions, {report.tokens_per_pass:.2f} tokens per verify pass "
             "with the heads' top-1 chain"),
        table,
        *unseen,
        Text(f"{result.steps} steps in {result.seconds / 60:.1f} min, loss {result.final_loss:.3f}; "
             f"data: {result.source}"),
    )
