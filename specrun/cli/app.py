"""The command line: parse, validate, call one library function, render its result.

Data goes to stdout; progress, warnings and statistics go to stderr.
"""

from __future__ import annotations

import inspect
import json
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Optional

import typer

from specrun.cli.bench import bench
from specrun.cli.chat import chat_command
from specrun.cli.distill import distill_command
from specrun.cli.heads import heads_app
from specrun.cli.common import (
    checked_reasoning_budget,
    checked_template_variables,
    check_backend,
    check_bias_beside_grammar,
    MODEL_OPTIONS,
    check_outputs_apart,
    MAX_DRAFT_LEN,
    PipeConsole,
    check_draft_len_use,
    check_drafter_options_used,
    gpu_layers_note,
    unused_draft_note,
    check_generation_options,
    checked_chat,
    checked_learning,
    checked_flash_attn,
    PrefillBar,
    check_kv_type,
    check_window_use,
    check_range,
    comma_list,
    checked_grammar,
    checked_tools,
    checked_sampling,
    checked_verification,
    checked_rpc,
    checked_lookahead,
    check_heads_used,
    uses_window,
    checked_trees,
    cli_errors,
    read_prompt,
)
from specrun.cli.options import (
    AcceptOpt,
    BackendOpt,
    BranchesOpt,
    ChainOpt,
    ChatOpt,
    ChatTemplateKwargsOpt,
    CtxOpt,
    DeltaOpt,
    DemoDraftOpt,
    DemoMethodsOpt,
    DemoPromptsOpt,
    DemoTargetOpt,
    DraftLenOpt,
    DraftMinProbOpt,
    DraftOpt,
    EpsilonOpt,
    ExactOpt,
    FlashAttnOpt,
    GpuLayersOpt,
    GrammarOpt,
    HeadsOpt,
    JsonOpt,
    JsonSchemaOpt,
    KeepLearnedOpt,
    KvTypeOpt,
    LearnBudgetOpt,
    LearnBufferOpt,
    LearnLabelsOpt,
    LearnOpt,
    LookaheadOpt,
    MarginOpt,
    MaxTokensOpt,
    MethodOpt,
    NgramCacheOpt,
    NoLearnOpt,
    RawOpt,
    ReasoningBudgetMessageOpt,
    ReasoningBudgetOpt,
    ReasoningOpt,
    RegistryOpt,
    RpcOpt,
    SamplingOptions,
    SinksOpt,
    TargetOpt,
    ThreadsOpt,
    ToolChoiceOpt,
    ToolsOpt,
    TraceOpt,
    TreeNodesOpt,
    VerifyOpt,
    WindowOpt,
    takes_sampling_options,
)
from specrun.cli.models import models_app
from specrun.cli.rpc import rpc_server_command
from specrun.cli.serve import serve_command
from specrun.cli.tune import tune
from specrun.drafters.methods import check_method
from specrun.errors import AnswerKeptError, SpecrunError, UsageError
from specrun.wording import count_of

def _flags_show_no_value() -> None:
    """Typer (0.29) shows a flag's type in the help as if it took a value (``--exact <bool>``),
    which it refuses ("unexpected extra argument"): a flag, --help too, shows none."""
    option = getattr(typer.core, "TyperOption", None)
    shown = getattr(option, "display_type_rich", None)
    if shown is None or getattr(shown, "flags_show_none", False):
        return

    def display_type_rich(self, ctx):
        return None if getattr(self, "is_flag", False) or getattr(self, "count", False) else shown(self, ctx)

    display_type_rich.flags_show_none = True
    option.display_type_rich = display_type_rich


_flags_show_no_value()

app = typer.Typer(
    name="specrun",
    help="Lossless speculative decoding for local LLMs (llama.cpp and MLX).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

@app.callback()
def _root() -> None:
    """Lossless speculative decoding for local LLMs (llama.cpp and MLX).

    With no --target/--draft, every command uses the demo pair that ships with specrun.
    """


@app.command()
@takes_sampling_options()
def generate(
    context: typer.Context,
    prompt: Annotated[Optional[str], typer.Argument(help="Prompt text, or - to read stdin.")] = None,
    target: TargetOpt = None,
    draft: DraftOpt = None,
    backend: BackendOpt = "auto",
    method: MethodOpt = "auto",
    max_tokens: MaxTokensOpt = 128,
    sampling_options: SamplingOptions = SamplingOptions(),
    draft_len: DraftLenOpt = None,
    draft_min_prob: DraftMinProbOpt = None,
    json_output: JsonOpt = False,
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
    ngram_cache: NgramCacheOpt = None,
    chat: ChatOpt = False,
    raw: RawOpt = False,
    branches: BranchesOpt = None,
    tree_nodes: TreeNodesOpt = None,
    chain_only: ChainOpt = False,
    heads: HeadsOpt = None,
    lookahead: LookaheadOpt = None,
    grammar: GrammarOpt = None,
    json_schema: JsonSchemaOpt = None,
    tools: ToolsOpt = None,
    tool_choice: ToolChoiceOpt = "auto",
    verify: VerifyOpt = "block",
    accept: AcceptOpt = "exact",
    epsilon: EpsilonOpt = None,
    delta: DeltaOpt = None,
    margin: MarginOpt = None,
    learn: LearnOpt = False,
    no_learn: NoLearnOpt = False,
    learn_budget: LearnBudgetOpt = None,
    learn_buffer: LearnBufferOpt = None,
    learn_labels: LearnLabelsOpt = None,
    keep_learned: KeepLearnedOpt = False,
    trace: TraceOpt = None,
    chat_template_kwargs: ChatTemplateKwargsOpt = None,
    reasoning: ReasoningOpt = None,
    reasoning_budget: ReasoningBudgetOpt = -1,
    reasoning_budget_message: ReasoningBudgetMessageOpt = None,
) -> None:
    """Answer PROMPT: text to stdout, statistics to stderr.

    PROMPT is a chat message; with --raw, or for a completion model, it is continued as it is."""
    with cli_errors():
        check_outputs_apart(context, "trace", "ngram_cache")
        check_backend(backend)
        from specrun.sessions.generation import GenerateRequest, generate_text
        from specrun.registry.loading import LoadOptions, choose_pair
        from specrun.drafters.methods import DrafterOptions, needs_draft_model
        from specrun.sessions.trace import open_trace

        check_method(method)
        check_generation_options(max_tokens, draft_len, draft_min_prob, ctx, threads)
        check_draft_len_use(draft_len, (method,), draft_min_prob=draft_min_prob, branches=branches,
                            tree_nodes=tree_nodes)
        check_kv_type(kv_type, exact)
        chat_template = checked_chat(chat, raw)
        check_window_use(window, (method,), draft, sinks=sinks)
        check_drafter_options_used((method,), draft_min_prob=draft_min_prob, ngram_cache=ngram_cache)
        flash_attn = checked_flash_attn(flash_attn, exact)
        rpc_servers = checked_rpc(rpc)
        lookahead_sizes = checked_lookahead(lookahead, (method,))
        check_heads_used(heads, (method,))
        trees = checked_trees(chain_only, tree_nodes, branches, lookahead_sizes, window=uses_window((method,)))
        sampling = checked_sampling("generate", sampling_options)
        verification = checked_verification("generate", verify, accept, epsilon, delta, margin, exact)
        grammar_spec = checked_grammar(grammar, json_schema)
        tool_list, choice = checked_tools(tools, tool_choice)
        if tool_list and chat_template is False:
            raise UsageError("--tools renders the tools through the chat template, which --raw leaves out",
                             "drop --raw")
        check_bias_beside_grammar(sampling, grammar_spec is not None or choice.forces_a_call)
        template_variables = checked_template_variables(chat_template_kwargs, reasoning)
        budget = checked_reasoning_budget(reasoning_budget, reasoning_budget_message)
        if (template_variables or budget[0] >= 0) and chat_template is False:
            raise UsageError("--chat-template-kwargs, --reasoning and --reasoning-budget are the chat template's, "
                             "which --raw leaves out", "drop --raw")
        if choice.forces_a_call and grammar_spec is not None:
            raise UsageError("a required tool call and --grammar/--json-schema both constrain the answer",
                             "give one of them")
        text = read_prompt(prompt)
        # said after the answer: an error stays one line
        end_notes = [note for note in (unused_draft_note(draft, (method,)),
                                       gpu_layers_note(gpu_layers, rpc_servers, backend)) if note is not None]
        target, draft = choose_pair(target, draft, registry)
        learning = checked_learning("generate", learn, no_learn, learn_budget, learn_buffer, keep_learned, target,
                                    heads, lambda note: typer.echo(f"note: {note}", err=True),
                                    labels=learn_labels)
        bar = None if json_output else PrefillBar()  # a long prompt's reading, on a terminal
        with open_trace(trace) as tracing:  # closed after the learners, however the run ends
            answer_out = _AnswerOut()  # notes made while the answer streams start a line of their own
            request = GenerateRequest(
                prompt=text,
                target=target,
                draft=draft if needs_draft_model(method) else None,
                method=method,
                max_new_tokens=max_tokens,
                draft_len=draft_len,
                draft_min_prob=draft_min_prob,
                sampling=sampling,
                load=LoadOptions(backend=backend, n_ctx=ctx, threads=threads, gpu_layers=gpu_layers,
                                 rpc=rpc_servers, registry=registry, kv_type=kv_type,
                                 flash_attn=flash_attn, exact=exact, window=window, sinks=sinks,
                                 tree_paths=trees.paths),
                drafter_options=DrafterOptions(ngram_cache=ngram_cache, branches=trees.branches,
                                               lookahead=lookahead_sizes),
                chat=chat_template,
                trees=trees,
                heads=heads,
                grammar=grammar_spec,
                tools=tool_list,
                tool_choice=choice,
                template_variables=template_variables,
                reasoning_budget=budget,
                verification=verification,
                on_note=answer_out.note,
                on_prefill=bar,
                learn=learning,
                trace=tracing,
            )
            kept = None  # the answer is printed even when the n-gram cache could not be saved after it
            learned = []
            try:
                if json_output:
                    try:
                        result = generate_text(request)
                    except AnswerKeptError as exc:
                        result, kept = exc.result, exc
                    learned = learning.finish() if learning is not None else []
                    # a reasoning model's answer and thinking read apart, as chat --json gives them
                    answer = {"text": result.content if result.content is not None else result.text,
                              "finish_reason": result.finish_reason, "stats": result.stats.to_dict()}
                    if result.reasoning:
                        answer["reasoning_content"] = result.reasoning
                    if result.grammar_problem:
                        answer["grammar_problem"] = result.grammar_problem
                    if tool_list:
                        answer["tool_calls"] = [call.as_openai() for call in result.tool_calls]
                        if result.tool_call_cut:
                            answer["tool_call_cut"] = True
                    if learning is not None:
                        answer["learning"] = [report.to_dict() for report in learned]
                    typer.echo(json.dumps(answer))
                    for note in end_notes:
                        typer.echo(note, err=True)
                else:
                    try:
                        result = generate_text(request, on_text=answer_out.write)
                    except AnswerKeptError as exc:
                        result, kept = exc.result, exc
                    finally:
                        bar.close()  # an error or Ctrl-C while the prompt was read: the bar goes before the message
                    answer_out.end_line()
                    typer.echo(result.stats.summary(), err=True)
                    for note in end_notes:
                        typer.echo(note, err=True)
                    if result.finish_reason == "context":  # -n asked for more than the context holds
                        size = f" of {request.load.n_ctx} tokens" if request.load.n_ctx else ""
                        typer.echo(f"note: the context{size} is full, so the answer stops here; {result.context_fix}",
                                   err=True)
                    if result.tool_call_cut:
                        from specrun.sessions.tools import TOOL_CALL_CUT_NOTE

                        typer.echo(f"note: {TOOL_CALL_CUT_NOTE}", err=True)
                    learned = learning.finish() if learning is not None else []
                    for report in learned:
                        typer.echo(report.summary(), err=True)
            finally:
                if learning is not None:
                    learning.finish()  # stopped on an error or Ctrl-C too (a second finish finds nothing)
        if kept is not None:
            raise kept
        if result.finish_reason == "grammar":  # the text so far follows no grammar: not an answer
            count = result.stats.new_tokens
            raise SpecrunError(f"the grammar stopped the answer after {count_of(count, 'token')}: "
                               f"{result.grammar_problem}", "simplify the grammar (what was printed does not follow it)")


@app.command()
def demo(
    target: DemoTargetOpt = None,
    draft: DemoDraftOpt = None,
    methods: DemoMethodsOpt = None,
    prompts: DemoPromptsOpt = 6,
    max_tokens: MaxTokensOpt = 96,
    draft_len: DraftLenOpt = None,
    backend: BackendOpt = "auto",
    threads: ThreadsOpt = None,
    exact: ExactOpt = False,
) -> None:
    """Plain vs speculative decoding on a real pair, side by side: is it faster, identical, and why."""
    with cli_errors():
        check_backend(backend)
        from specrun.heads.kinds import AUTO_HEADS_ORDER
        from specrun.registry.heads import head_kinds_available
        from specrun.sessions.demo_report import default_pair, run_demo

        given_draft = draft
        target, draft = default_pair(target, draft)
        if methods is None:  # plain, the draft model, the best heads the target has, auto
            found = head_kinds_available(target)
            best = [kind for kind in AUTO_HEADS_ORDER if kind in found][:1]
            methods = ",".join(["none", "draft", *best, "auto"])
        method_list = comma_list("--methods", methods, "none,draft,auto")
        for method in method_list:
            check_method(method)
        check_range("--prompts", prompts, 1, 100)
        check_range("--max-tokens", max_tokens, 1, 4096)
        check_range("--draft-len", draft_len, 0, MAX_DRAFT_LEN)
        check_draft_len_use(draft_len, method_list, "--methods")
        check_range("--threads", threads, 1, 1024)
        draft_note = unused_draft_note(given_draft, method_list, "--methods")
        run_demo(target, draft, method_list, prompts, max_tokens, draft_len, backend, threads, console=PipeConsole,
                 exact=exact)
        if draft_note is not None:  # after the table: an error stays one line
            typer.echo(draft_note, err=True)


@app.command("trace")
def trace_command(
    file: Annotated[Path, typer.Argument(help="A file written by --trace (generate, bench, chat or serve); - reads stdin.")],
    events: Annotated[int, typer.Option("--events", help="Turns of the policy shown a run (0: none).")] = 12,
) -> None:
    """Tell a --trace file in words: what drafted, what was kept, where the time went.

    Each run's passes, when and why the policy switched a drafter off or on, and how the run ended."""
    with cli_errors():
        from specrun.sessions.trace_reading import describe_header, explain, read_trace

        check_range("--events", events, 0, 1_000_000)
        header, runs = read_trace(file)
        lines = [describe_header(header)]
        for run in runs:
            lines.extend(explain(run, events, live=bool(header.get("serve"))))
        _write_stdout("\n".join(lines) + "\n")


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


class _AnswerOut:
    """The answer streamed to stdout, and notes to stderr that never share its last line: a note
    made before the answer ended (a first run's kernel timing, a near tie) starts on a line of its
    own where a terminal shows both streams."""

    def __init__(self) -> None:
        self.open_line = False  # the answer's last line not ended yet

    def write(self, text: str) -> None:
        if text:
            _write_stdout(text)
            self.open_line = not text.endswith("\n")

    def end_line(self) -> None:
        if self.open_line:
            _write_stdout("\n")
            self.open_line = False

    def note(self, note: str) -> None:
        self.end_line()
        typer.echo(f"note: {note}", err=True)


# Sub-command groups from their own modules are registered here, one line each.
app.command("bench")(bench)
app.command("chat")(chat_command)
app.command("distill")(distill_command)
app.add_typer(heads_app, name="heads")
app.add_typer(models_app, name="models")
app.command("serve")(serve_command)
app.command("rpc-server")(rpc_server_command)
app.command("tune")(tune)


def _reflow_help(group: typer.Typer) -> None:
    """Each command's help as its docstring's paragraphs, each one line: Typer's rich help keeps a
    docstring's line breaks, which break its sentences wherever the source wrapped them (a
    paragraph marked ``\\b``, Click's "keep as written", stays as written)."""
    for info in group.registered_commands:
        if info.help is None and info.callback is not None and info.callback.__doc__:
            paragraphs = inspect.getdoc(info.callback).split("\n\n")
            info.help = "\n\n".join(each if each.startswith("\b") else " ".join(map(str.strip, each.splitlines()))
                                    for each in paragraphs)
    for sub in group.registered_groups:
        _reflow_help(sub.typer_instance)


_reflow_help(app)


def empty_option(argv: Sequence[str]) -> str | None:
    """What to say of the first option of the command in ``argv`` naming a file or a model that
    was given an empty value (``''``, ``--out=``: an unset shell variable), None where none was:
    Typer reads an empty path as the current folder ('the trace . is a folder'), and an empty -d
    went unnoticed as no draft at all."""
    words, group, callback = list(argv), app, None
    while words and callback is None:  # the command's path: generate, models convert
        name = words.pop(0)
        callback = next((info.callback for info in group.registered_commands
                         if (info.name or info.callback.__name__.replace("_", "-")) == name), None)
        if callback is None:
            sub = next((each for each in group.registered_groups if each.name == name), None)
            if sub is None:
                return None  # Typer's own usage error says what is wrong
            group = sub.typer_instance
    if callback is None:
        return None
    options, taking_values = _named_options(callback), _options_taking_values(callback)
    if "--" in words:  # what follows is arguments, not options
        words = words[: words.index("--")]
    at = 0
    while at < len(words):
        word = words[at]
        flag, equals, value = word.partition("=")
        if word.startswith("--") and equals and flag in options and not value.strip():
            return options[flag].format(flag)
        if word in taking_values:  # its value is the next word, whatever it looks like (--system -t)
            if word in options and at + 1 < len(words) and not words[at + 1].strip():
                return options[word].format(word)
            at += 1
        at += 1
    return None


def _options_taking_values(callback) -> set[str]:
    """The command's option flags that take a value (not a bool's flags, not a count)."""
    taking = set()
    for hint in typing.get_type_hints(callback, include_extras=True).values():
        if typing.get_origin(hint) is not Annotated:
            continue
        base, *declared = typing.get_args(hint)
        if bool in (base, *typing.get_args(base)):
            continue
        for option in declared:
            if isinstance(option, typer.models.OptionInfo) and not option.count:
                for decl in (option.default, *(option.param_decls or ())):
                    if isinstance(decl, str) and decl.startswith("-"):
                        taking.add(decl)
    return taking


def _named_options(callback) -> dict[str, str]:
    """A command's options that take a path (annotated ``Path``) or name a model, by each flag:
    what an empty value of it gets told ({} the flag)."""
    defaults = inspect.signature(callback).parameters
    said = {}
    for name, hint in typing.get_type_hints(callback, include_extras=True).items():
        if typing.get_origin(hint) is not Annotated:
            continue
        base, *declared = typing.get_args(hint)
        if name == "heads":
            fix = "name the heads' file or folder"
        elif name in MODEL_OPTIONS:
            fix = "name a model (an alias, a .gguf path or an MLX folder)"
        elif Path in (base, *typing.get_args(base)):
            fix = "give it a path"
        else:
            continue
        if defaults[name].default is not inspect.Parameter.empty:
            fix += ", or leave the option out"
        for option in declared:
            if isinstance(option, typer.models.OptionInfo):
                for decl in (option.default, *(option.param_decls or ())):
                    if isinstance(decl, str) and decl.startswith("-"):
                        said[decl] = "{} is empty; " + fix
    return said


def main() -> None:
    """The console script: Typer's usage errors in one line, as every other error is."""
    from rich.console import Console

    from specrun.cli.common import BROKEN_PIPE_EXIT, silence_stdout
    from specrun.cli.interrupts import INTERRUPTED_EXIT, raise_on_interrupt, say_interrupted_once

    raise_on_interrupt()
    try:
        empty = empty_option(sys.argv[1:])
    except Exception:  # noqa: BLE001 - a scan that cannot read a command's options leaves it to Typer
        empty = None
    if empty is not None:
        typer.echo(f"error: {empty}", err=True)
        raise SystemExit(2)
    # Typer's help is printed by a Rich console of its own, whose closed pipe exits 1
    # (`specrun generate --help | head -c 5`): every console's ends as cli_errors ends ours.
    Console.on_broken_pipe = PipeConsole.on_broken_pipe
    try:
        status = app(prog_name="specrun", standalone_mode=False)
    except KeyboardInterrupt:  # while Typer builds the command, before its own handler
        status = INTERRUPTED_EXIT
    except BrokenPipeError:  # the reader has gone: quietly
        silence_stdout()
        status = BROKEN_PIPE_EXIT
    except typer.Abort:
        typer.echo("error: aborted", err=True)
        status = 1
    except typer.TyperException as exc:  # a usage error: an unknown option or command, a bad value
        status = exc.exit_code
        message = " ".join(exc.format_message().split())
        if message:  # empty when Typer has shown the help instead (no arguments)
            context = getattr(exc, "ctx", None)
            command = context.command_path if context is not None else "specrun"
            typer.echo(f"error: {message.rstrip('.')}; see `{command} --help`", err=True)
    if status == INTERRUPTED_EXIT:
        say_interrupted_once()
    raise SystemExit(status if isinstance(status, int) else 0)


if __name__ == "__main__":
    main()
