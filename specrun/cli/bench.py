"""`specrun bench`: every method on a prompt suite, interleaved, with tables, JSON and an HTML report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from specrun.cli.common import (
    checked_template_variables,
    check_backend,
    check_outputs_apart,
    MAX_DRAFT_LEN,
    MAX_NEW_TOKENS,
    PipeConsole,
    checked_chat,
    check_draft_len_use,
    check_drafter_options_used,
    gpu_layers_note,
    unused_draft_note,
    checked_flash_attn,
    check_kv_type,
    check_window_use,
    check_range,
    comma_list,
    checked_lookahead,
    check_heads_used,
    uses_window,
    checked_sampling,
    checked_verification,
    checked_rpc,
    checked_trees,
    cli_errors,
)
from specrun.cli.options import (
    AcceptOpt,
    BackendOpt,
    BenchDraftLenOpt,
    BenchJsonOpt,
    BenchMethodsOpt,
    BenchMinProbOpt,
    BenchPromptsOpt,
    BranchesOpt,
    ChainOpt,
    ChatOpt,
    ChatTemplateKwargsOpt,
    CtxOpt,
    DeltaOpt,
    DraftOpt,
    EpsilonOpt,
    ExactOpt,
    FlashAttnOpt,
    GpuLayersOpt,
    HeadsOpt,
    KvTypeOpt,
    LookaheadOpt,
    MarginOpt,
    MaxTokensOpt,
    RawOpt,
    ReasoningOpt,
    RegistryOpt,
    RpcOpt,
    SamplingOptions,
    SinksOpt,
    TargetOpt,
    ThreadsOpt,
    TraceOpt,
    TreeNodesOpt,
    VerifyOpt,
    WindowOpt,
    takes_sampling_options,
)
from specrun.errors import UsageError
from specrun.fileio import check_writable_folder, write_atomically
from specrun.sampling import SAMPLER_ORDER

MAX_REPEAT = 100
PIPE_WIDTH = 120
BUILTIN = "builtin"

SuiteOpt = Annotated[Optional[str], typer.Option("--suite", help="Prompt suite: builtin (the default).")]
CategoriesOpt = Annotated[Optional[str], typer.Option("--categories", help="Comma-separated categories to run.")]
PerCategoryOpt = Annotated[Optional[int], typer.Option("--per-category", help="At most this many prompts each.")]
SweepOpt = Annotated[Optional[str], typer.Option("--sweep-draft-len", help="Draft lengths to sweep: 1..8 or 2,4,6.")]
RepeatOpt = Annotated[int, typer.Option("--repeat", help="Runs per prompt and method; medians are compared.")]
ReportOpt = Annotated[Optional[Path], typer.Option("--report", help="Write a self-contained HTML report here.")]
NativeOpt = Annotated[
    bool,
    typer.Option(
        "--native",
        help="Also time the backend's own plain loop (llama-cpp-python's Llama.generate) on every prompt, "
        "interleaved, and report every method against it (loads the target twice).",
    ),
]
UntunedOpt = Annotated[
    bool, typer.Option("--untuned", help="Ignore what `specrun tune` saved: controllers start from their priors.")
]


@takes_sampling_options()
def bench(
    context: typer.Context,
    target: TargetOpt = None,
    draft: DraftOpt = None,
    methods: BenchMethodsOpt = None,
    suite: SuiteOpt = None,
    prompts_file: BenchPromptsOpt = None,
    categories: CategoriesOpt = None,
    per_category: PerCategoryOpt = None,
    max_tokens: MaxTokensOpt = 128,
    draft_len: BenchDraftLenOpt = None,
    sweep_draft_len: SweepOpt = None,
    draft_min_prob: BenchMinProbOpt = None,
    sampling_options: SamplingOptions = SamplingOptions(),
    repeat: RepeatOpt = 1,
    chat: ChatOpt = False,
    raw: RawOpt = False,
    json_out: BenchJsonOpt = None,
    report_out: ReportOpt = None,
    untuned: UntunedOpt = False,
    native: NativeOpt = False,
    backend: BackendOpt = "auto",
    ctx: CtxOpt = None,
    threads: ThreadsOpt = None,
    gpu_layers: GpuLayersOpt = None,
    rpc: RpcOpt = None,
    kv_type: KvTypeOpt = None,
    flash_attn: FlashAttnOpt = None,
    exact: ExactOpt = False,
    window: WindowOpt = None,
    sinks: SinksOpt = None,
    registry: RegistryOpt = None,
    heads: HeadsOpt = None,
    branches: BranchesOpt = None,
    tree_nodes: TreeNodesOpt = None,
    chain_only: ChainOpt = False,
    lookahead: LookaheadOpt = None,
    verify: VerifyOpt = "block",
    accept: AcceptOpt = "exact",
    epsilon: EpsilonOpt = None,
    delta: DeltaOpt = None,
    margin: MarginOpt = None,
    trace: TraceOpt = None,
    chat_template_kwargs: ChatTemplateKwargsOpt = None,
    reasoning: ReasoningOpt = None,
) -> None:
    """Which speculation method is fastest on this machine? Tables to stdout, progress to stderr.

    Every method runs on every prompt, interleaved with plain decoding (none) through the
    same engine; greedy outputs are checked against plain decoding's. Built-in categories:
    code-completion, code-editing, chat, summarisation, qa, rewriting.
    """
    with cli_errors():
        check_outputs_apart(context, "json_out", "report_out", "trace")
        check_backend(backend)
        from specrun.bench.runner import BenchConfig
        from specrun.sessions.setup import ADAPTIVE_MAX_DRAFT_LEN
        from specrun.registry.loading import DEFAULT_TARGET, LoadOptions
        from specrun.drafters.methods import is_adaptive
        from specrun.registry.heads import head_kinds_available

        check_range("--max-tokens", max_tokens, 1, MAX_NEW_TOKENS)
        check_range("--repeat", repeat, 1, MAX_REPEAT)
        check_range("--per-category", per_category, 1, 1_000_000)
        check_range("--ctx", ctx, 16, 1 << 20)
        check_range("--threads", threads, 1, 1024)
        check_range("--draft-min-prob", draft_min_prob, 0.0, 1.0)
        check_kv_type(kv_type, exact)
        chat_template = checked_chat(chat, raw)
        template_variables = checked_template_variables(chat_template_kwargs, reasoning)
        if template_variables and chat_template is False:
            raise UsageError("--chat-template-kwargs and --reasoning set the chat template's variables, which --raw "
                             "leaves out", "drop --raw")
        flash_attn = checked_flash_attn(flash_attn, exact)
        rpc_servers = checked_rpc(rpc)
        if native and rpc_servers:
            raise UsageError("--native runs llama-cpp-python's own loop on a copy of the target here, and --rpc "
                             "sends the target to other machines", "drop --native or --rpc")
        sampling = checked_sampling("bench", sampling_options)
        if native and sampling.shapes_rows:
            raise UsageError("--native times llama-cpp-python's own plain loop, which applies no logit bias or DRY and "
                             "counts penalties over the answer alone (specrun and llama.cpp's tools count the prompt too)",
                             "drop --native, or the penalties, DRY and --logit-bias")
        if native and sampling.order != SAMPLER_ORDER:
            raise UsageError("--native times llama-cpp-python's own plain loop, which samples in llama.cpp's default "
                             "order", "drop --native, or --samplers")
        if native and (sampling.typical_p < 1.0 or sampling.top_n_sigma > 0.0 or sampling.xtc_on
                       or sampling.dynatemp_on or sampling.mirostat.on or sampling.adaptive_p.on):
            raise UsageError("--native times llama-cpp-python's own plain loop, which is given temperature, top-k, "
                             "top-p and min-p only",
                             "drop --native, or --typical, --top-nsigma, --xtc-probability, --dynatemp-range, "
                             "--mirostat and --adaptive-target")
        verification = checked_verification("bench", verify, accept, epsilon, delta, margin, exact)
        target = target or DEFAULT_TARGET
        given_draft = draft
        draft = draft or suggested_draft(target, registry)
        from specrun.registry.loading import check_draft_spec

        check_draft_spec(draft)  # a malformed self: draft, before the run says what it will run
        method_list = parse_methods(methods, has_draft=draft is not None,
                                    head_kinds=head_kinds_available(target, heads, registry))
        lookahead_sizes = checked_lookahead(lookahead, method_list)
        check_window_use(window, method_list, draft, "--methods", sinks=sinks)
        check_heads_used(heads, method_list)
        trees = checked_trees(chain_only, tree_nodes, branches, lookahead_sizes, window=uses_window(method_list))
        check_draft_len_use(draft_len, method_list, "--methods", draft_min_prob=draft_min_prob, branches=branches,
                            tree_nodes=tree_nodes)
        check_drafter_options_used(method_list, "--methods", draft_min_prob=draft_min_prob)
        draft_lens = parse_draft_lens(draft_len, sweep_draft_len)
        if len(draft_lens) > 1 and not any(m != "none" and not is_adaptive(m) for m in method_list):
            raise UsageError(
                "--sweep-draft-len needs a method with a fixed draft length", "add one with --methods, e.g. none,draft"
            )
        check_writable(json_out, "--json")
        if report_out is not None and str(report_out) == "-":  # it wrote an HTML file named "-"
            raise UsageError("--report writes an HTML file, and - (stdout) is for --json alone",
                             "give --report a file name, e.g. --report bench.html")
        check_writable(report_out, "--report")
        bench_prompts, suite_name = choose_prompts(suite, prompts_file, categories, per_category)
        end_notes = [note for note in (unused_draft_note(given_draft, method_list, "--methods"),  # after the tables
                                       gpu_layers_note(gpu_layers, rpc_servers, backend)) if note is not None]
        config = BenchConfig(
            target=target,
            draft=draft,
            methods=method_list,
            draft_lens=draft_lens,
            adaptive_draft_len=draft_len or ADAPTIVE_MAX_DRAFT_LEN,
            draft_min_prob=draft_min_prob,
            max_new_tokens=max_tokens,
            sampling=sampling,
            repeat=repeat,
            chat=chat_template,
            template_variables=template_variables,
            suite=suite_name,
            use_tuned=not untuned,
            native=native,
            heads=heads,
            trees=trees,
            lookahead=lookahead_sizes,
            verification=verification,
            load=LoadOptions(backend=backend, n_ctx=ctx, threads=threads, gpu_layers=gpu_layers,
                             rpc=rpc_servers, registry=registry, kv_type=kv_type,
                             flash_attn=flash_attn, exact=exact, window=window, sinks=sinks, tree_paths=trees.paths),
        )
        from specrun.sessions.trace import open_trace

        with open_trace(trace) as tracing:
            if tracing is not None:
                tracing.header(target=target, draft=draft, methods=list(method_list), prompts=len(bench_prompts),
                               max_new_tokens=max_tokens, repeat=repeat, **sampling.fields())
            run_and_show(config, bench_prompts, json_out, report_out, tracing)
        for note in end_notes:
            typer.echo(note, err=True)


def suggested_draft(target: str, registry: Path | None) -> str | None:
    """The registry's first suggested draft for ``target`` (None for a path or an alias without one)."""
    from specrun.registry.catalog import load_registry

    entry = load_registry(registry).get(target)
    return entry.drafts[0] if entry is not None and entry.drafts else None


def parse_methods(methods: str | None, has_draft: bool, head_kinds: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The methods to run, baseline ``none`` first (added when missing).

    Default: every known method the pair can run (head methods where the target has heads of
    their kind, ``head_kinds``) but lookahead, run only when named: its window opens the target
    for token trees, which would change every other line's pass (~2% on plain decoding here).
    A method that needs a draft model when there is none is a usage error.
    """
    from specrun.drafters.methods import (
        METHODS, check_method, heads_kind, needs_draft_model, needs_heads, resolve_method, uses_lookahead
    )

    def runnable(method: str) -> bool:
        return has_draft or not needs_draft_model(resolve_method(method, has_draft))

    def default(method: str) -> bool:
        heads_ok = not needs_heads(method) or heads_kind(method) in head_kinds
        return runnable(method) and heads_ok and not uses_lookahead(method)

    if methods is None:
        chosen = [m for m in METHODS if default(m)]
    else:
        chosen = comma_list("--methods", methods, "none,draft", METHODS)
        for method in chosen:
            check_method(method)
            if not runnable(method):
                raise UsageError(f"method {method!r} needs a draft model", "pass --draft MODEL")
    return ("none", *(m for m in chosen if m != "none"))


def parse_draft_lens(draft_len: int | None, sweep: str | None) -> tuple[int, ...]:
    """One draft length, or the swept lengths from ``A..B`` or ``A,B,C``; none given: () (each
    method at the length `specrun generate` gives it)."""
    if sweep is None:
        check_range("--draft-len", draft_len, 1, MAX_DRAFT_LEN)
        return (draft_len,) if draft_len is not None else ()
    if draft_len is not None:
        raise UsageError("--draft-len and --sweep-draft-len exclude each other", "pass one of them")
    text = sweep.replace(" ", "")
    try:
        if ".." in text:
            first, last = (int(part) for part in text.split(".."))
            # checked before the range is built: 1..100000000 took 4 GB and 22 s to refuse
            lengths = tuple(range(first, last + 1)) if 1 <= first <= last <= MAX_DRAFT_LEN else ()
        else:
            lengths = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise UsageError(f"--sweep-draft-len {sweep!r} is not A..B or A,B,C", "e.g. --sweep-draft-len 1..8") from None
    if ".." in text and 1 <= last < first <= MAX_DRAFT_LEN:
        raise UsageError(f"--sweep-draft-len {sweep!r} runs backwards", f"e.g. --sweep-draft-len {last}..{first}")
    if not lengths or min(lengths) < 1 or max(lengths) > MAX_DRAFT_LEN:
        raise UsageError(
            f"--sweep-draft-len {sweep!r} must list draft lengths from 1 to {MAX_DRAFT_LEN}",
            "e.g. --sweep-draft-len 1..8",
        )
    return lengths


def check_writable(path: Path | None, option: str) -> None:
    """Refuse an output path that could not be written before spending minutes on the bench."""
    if path is None or str(path) == "-":
        return
    if path.is_dir():
        raise UsageError(f"{option} {path} is a folder", f"give a file name for {option}")
    if not path.parent.is_dir():
        state = "is a file, not a folder" if path.parent.exists() else "does not exist"
        raise UsageError(f"{option}: the folder {path.parent} {state}", "create it or pick another path")
    check_writable_folder(path, f"{option} file", through_special=True)


def choose_prompts(suite: str | None, prompts_file: Path | None, categories: str | None, per_category: int | None):
    """The prompts to run and the suite's name: the built-in suite or a JSONL file, filtered."""
    from specrun.bench.suite import BUILTIN_SUITE, load_jsonl, select

    if suite is not None and prompts_file is not None:
        raise UsageError("--suite and --prompts exclude each other", "pass one of them")
    if suite not in (None, BUILTIN):
        raise UsageError(f"unknown suite {suite!r}", f"use --suite {BUILTIN} or --prompts FILE.jsonl")
    prompts = load_jsonl(prompts_file) if prompts_file is not None else list(BUILTIN_SUITE)
    wanted = comma_list("--categories", categories, "chat,qa") if categories is not None else None
    return select(prompts, wanted, per_category), str(prompts_file) if prompts_file is not None else BUILTIN


def run_and_show(config, prompts, json_out: Path | None, report_out: Path | None, trace=None) -> None:
    """Run the bench with a progress bar on a terminal; print tables; write the JSON and report."""
    import json
    import sys

    from rich.console import Console

    from specrun.bench.export import bench_to_dict
    from specrun.wording import count_of
    from specrun.bench.report import write_html_report
    from specrun.bench.runner import run_bench
    from specrun.bench.tables import category_tables, difference_lines, footnotes

    # A pipe gets Rich's 80 columns by default, too few for the tables.
    err = Console(stderr=True, width=None if sys.stderr.isatty() else PIPE_WIDTH)
    json_to_stdout = json_out is not None and str(json_out) == "-"
    out = err if json_to_stdout else PipeConsole(file=sys.stdout, width=None if sys.stdout.isatty() else PIPE_WIDTH)
    lines = "methods × draft lengths" if config.sweep else "methods"
    err.print(
        f"{config.target} + {config.draft or 'no draft model'}: {count_of(len(prompts), 'prompt')} × "
        f"{len(config.variants())} {lines} × {count_of(config.repeat, 'run')}, {config.max_new_tokens} tokens each",
        highlight=False,
    )
    with _ProgressBar(err) as progress:
        result = run_bench(config, prompts, progress, trace)
    for note in result.notes:
        err.print(f"note: {note}", highlight=False)
    if config.lookahead is None and result.config.lookahead is not None:
        err.print(f"note: lookahead window {result.config.lookahead} (chosen from this machine's pass costs; "
                  "--lookahead sets it)", highlight=False)
    for table in category_tables(result):
        out.print(table)
    if result.comparison.quality:
        from specrun.sessions.compare import quality_line

        out.print(quality_line(result.comparison), highlight=False, markup=False, soft_wrap=True)
    if result.comparison.native:
        from specrun.sessions.compare import native_line

        out.print(native_line(result.comparison), highlight=False)
    elif config.native:
        err.print("note: --native compared nothing: the backend has no plain loop of its own to time here "
                  "(MLX, or a llama.cpp built with AMX kernels, whose Llama class would load them)", highlight=False)
    for line, defect in difference_lines(result):
        out.print(line, style="bold red" if defect else None, highlight=False, markup=False, soft_wrap=True)
    for note in footnotes(result):
        err.print(note, style="dim", highlight=False)
    if json_out is not None:
        document = json.dumps(bench_to_dict(result), indent=2)
        if json_to_stdout:
            sys.stdout.write(document + "\n")
        else:
            write_atomically(json_out, document + "\n", "--json file", through_special=True)
            err.print(f"wrote {json_out}")
    if report_out is not None:
        write_html_report(result, report_out)
        err.print(f"wrote {report_out}")


class _ProgressBar:
    """A Rich progress bar on stderr when it is a terminal; silent otherwise."""

    def __init__(self, console) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.enabled = console.is_terminal
        self.bar = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=console, transient=True,
        )
        self.task = None

    def __enter__(self) -> _ProgressBar:
        if self.enabled:
            self.bar.start()
        return self

    def __exit__(self, *exc_info) -> None:
        if self.enabled:
            self.bar.stop()

    def start(self, total_runs: int) -> None:
        if self.enabled:
            self.task = self.bar.add_task("warming up", total=total_runs)

    def advance(self, prompt, variant: str) -> None:
        if self.enabled and self.task is not None:
            self.bar.update(self.task, advance=1, description=f"{prompt.category}: {variant}")
