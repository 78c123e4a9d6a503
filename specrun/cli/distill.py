"""``specrun distill``: a draft model trained on the target's own distributions (DistillSpec), on MLX."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from specrun.cli.common import PipeConsole, check_backend, check_outputs_apart, cli_errors
from specrun.cli.heads import run_training
from specrun.cli.options import RegistryOpt, ThreadsOpt


def distill_command(
    context: typer.Context,
    out: Annotated[Path, typer.Option(
        "--out", help="The MLX folder to write; the GGUF goes beside it as OUT.gguf (neither may exist).")],
    target: Annotated[str, typer.Option("--target", help="The model the student learns to draft for.")] = "demo-target",
    student: Annotated[str, typer.Option("--student", help=(
        "The draft to train: a model (alias or .gguf path; a quantized file is trained from its dequantized "
        "weights), or self:layers=N (the target's first N layers) or self:layers=0-5,9."))] = "demo-draft",
    minutes: Annotated[float, typer.Option("--minutes", help="Wall-clock budget; a second run resumes and trains on.")] = 10.0,
    prompts: Annotated[Optional[Path], typer.Option(
        "--prompts", help="One prompt per line (default: built-in questions, or Python for a completion model).")] = None,
    batch: Annotated[int, typer.Option("--batch", help="Prompts the student continues per step.")] = 8,
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", help="A prompt's last tokens kept, at most.")] = 64,
    sample_tokens: Annotated[int, typer.Option(
        "--sample-tokens", help="Tokens the student writes per prompt each step (and the target per held-out prompt).")] = 64,
    temperature: Annotated[float, typer.Option(
        "--temperature", help="The student's temperature for its own samples (0: its greedy text).")] = 0.0,
    divergence: Annotated[str, typer.Option("--divergence", help=(
        "tvd: total variation (1 - acceptance at T = 1); fkl: KL(target || student); jsd: Jensen-Shannon."))] = "tvd",
    lr: Annotated[float, typer.Option("--lr", help="AdamW learning rate.")] = 1e-4,
    held_out: Annotated[int, typer.Option("--held-out", help="Prompts kept out of training for the report.")] = 32,
    seed: Annotated[int, typer.Option("--seed", help="Shuffles the prompts and seeds the student's samples.")] = 0,
    gguf_type: Annotated[str, typer.Option("--gguf-type", help=(
        "The GGUF's weights: F16, or Q8_0 / Q4_0 by llama.cpp's quantizer (a draft costs what it reads). "
        "The MLX folder is float16."))] = "F16",
    registry: RegistryOpt = None,
    backend: Annotated[str, typer.Option("--backend", help=(
        "Where the target scores the student's text: auto (llama.cpp for a .gguf path; for an alias, MLX on "
        "Apple Silicon, llama.cpp for a GGUF elsewhere), mlx or llama. The student trains in MLX either way."))] = "auto",
    threads: ThreadsOpt = None,
    max_steps: Annotated[Optional[int], typer.Option("--max-steps", hidden=True)] = None,
) -> None:
    """Distill a draft model from the target's own distributions (on MLX); a second run resumes.

    The student writes, the target scores, the student learns the target's distributions; reports
    held-out acceptance before and after and writes an MLX folder and a GGUF, both loadable as
    --draft. The second run takes the same options."""
    with cli_errors():
        check_backend(backend)
        check_outputs_apart(context, "out")
        from specrun.training.distill import DistillRequest, check_request, distill

        request = DistillRequest(
            target=target, student=student, out=out.expanduser(), minutes=minutes, prompts_file=prompts, batch=batch,
            prompt_tokens=prompt_tokens, sample_tokens=sample_tokens, temperature=temperature,
            divergence=divergence, learning_rate=lr, held_out=held_out, seed=seed, registry=registry,
            gguf_type=gguf_type, backend=backend, threads=threads,
        )
        check_request(request)
        result = run_training(lambda **shown: distill(request, **shown), max_steps, data_label="held-out text")
        PipeConsole(file=sys.stdout).print(render(result), soft_wrap=True)
        typer.echo(f"wrote {result.out} and {result.gguf}; draft with it: specrun chat --target {target} "
                   f"--draft {result.gguf} (llama.cpp), or --draft {result.out} (MLX)", err=True)


def render(result) -> Group:
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1))
    table.add_column("held out")
    table.add_column("greedy acceptance", justify="right")
    table.add_column("acceptance at T=1", justify="right")
    for label, report in (("before", result.before), ("after", result.after)):
        table.add_row(label, f"{100 * report.greedy:.1f}%", f"{100 * report.sampled:.1f}%")
    resumed = f" (resumed at step {result.resumed_at})" if result.resumed_at is not None else ""
    return Group(
        Text(f"student: {result.student}; {result.before.positions} held-out positions of the target's own text"),
        table,
        Text(f"{result.steps} steps{resumed} in {result.seconds / 60:.1f} min, loss {result.final_loss:.4f}"),
    )
