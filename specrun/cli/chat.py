"""``specrun chat``: a REPL on a terminal, a filter on a pipe.

On a terminal: type a message, read the streamed answer (text the drafter got right
is marked), then a statistics line on stderr. A line ending in ``\\`` continues on
the next line; a message may also be a block that opens with ``\"\"\"`` and ends at a
line ending in ``\"\"\"``. Ctrl-C stops an answer (it is dropped, with its question);
Ctrl-C or Ctrl-D at the prompt exits. Slash commands: see ``HELP``.

On a pipe: all of stdin is one message (``--each-line``: every non-empty line is a
message in its own conversation); answers go to stdout, statistics to stderr.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.text import Text

from specrun.cli.common import (
    check_backend,
    check_outputs_apart,
    PipeConsole,
    PrefillBar,
    check_generation_options,
    checked_learning,
    checked_flash_attn,
    check_kv_type,
    check_window_use,
    checked_sampling,
    checked_verification,
    checked_rpc,
    checked_lookahead,
    uses_window,
    checked_trees,
    gpu_layers_note,
    checked_text,
    checked_reasoning_budget,
    checked_template_variables,
    checked_tools,
    cli_errors,
    read_stdin_text,
)
from specrun.cli.options import (
    AcceptOpt,
    BackendOpt,
    BranchesOpt,
    ChainOpt,
    ChatJsonOpt,
    ChatTemplateKwargsOpt,
    CtxOpt,
    DeltaOpt,
    DraftLenOpt,
    DraftMinProbOpt,
    DraftOpt,
    EpsilonOpt,
    ExactOpt,
    FlashAttnOpt,
    GpuLayersOpt,
    HeadsOpt,
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
from specrun.errors import SpecrunError, UsageError
from specrun.wording import count_of

HELP = """\
/stats          statistics of the last answer and of the whole chat
/reset          start a new conversation (the system prompt stays)
/system TEXT    set the system prompt (/system alone shows it, /system - removes it)
/method NAME    switch the speculation method (/method alone lists them)
/tool RESULT    answer the first tool call still open with its RESULT, by its id (a chat with --tools)
/help           this list
/exit           leave (so do Ctrl-D and Ctrl-C at the prompt)
A line ending in \\ continues on the next line; \"\"\" opens a block that ends at a line ending in \"\"\".
Ctrl-C inside such a message drops it; Ctrl-D there drops it and leaves.
Ctrl-C during an answer stops it; the answer and its question are dropped from the conversation.
Start a message with // to send a line that begins with /."""

DRAFTED_STYLE = "green"
THINKING_STYLE = "dim italic"  # a reasoning model's thinking, before its answer
# Model output shown on a terminal must not drive it: control characters become visible symbols.
_CONTROL_SYMBOLS = {
    **{code: 0x2400 + code for code in range(32) if chr(code) not in "\t\n"},
    0x7F: 0x2421,
    **{code: 0xFFFD for code in range(0x80, 0xA0)},
}
PROMPT = "> "
CONTINUE_PROMPT = "... "
BLOCK_QUOTE = '"""'
HISTORY_LENGTH = 1000

EachLineOpt = Annotated[
    bool, typer.Option("--each-line", help="Piped input: every line is a message in its own conversation.")
]
ShowAcceptOpt = Annotated[
    Optional[bool],
    typer.Option("--show-accept/--no-show-accept", help="Mark text the drafter got right (default: on a terminal)."),
]
SystemOpt = Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt.")]


@takes_sampling_options()
def chat_command(
    context: typer.Context,
    target: TargetOpt = None,
    draft: DraftOpt = None,
    backend: BackendOpt = "auto",
    method: MethodOpt = "auto",
    max_tokens: MaxTokensOpt = 512,
    sampling_options: SamplingOptions = SamplingOptions(),
    draft_len: DraftLenOpt = None,
    draft_min_prob: DraftMinProbOpt = None,
    system: SystemOpt = None,
    each_line: EachLineOpt = False,
    show_accept: ShowAcceptOpt = None,
    json_output: ChatJsonOpt = False,
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
    branches: BranchesOpt = None,
    tree_nodes: TreeNodesOpt = None,
    chain_only: ChainOpt = False,
    heads: HeadsOpt = None,
    lookahead: LookaheadOpt = None,
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
    """Chat with the target model: a REPL on a terminal; on a pipe, stdin is the message and stdout the answer.

    A reasoning model's thinking shows dimmed before its answer on a terminal; a pipe gets the answer
    alone (--json: both, the thinking as reasoning_content)."""
    with cli_errors():
        check_outputs_apart(context, "trace", "ngram_cache")
        check_backend(backend)
        from specrun.sessions.chat import open_chat
        from specrun.engine.loop import TIE_MARGIN, GenerationParams
        from specrun.registry.loading import LoadOptions, choose_pair
        from specrun.drafters.methods import check_method

        check_method(method)
        check_generation_options(max_tokens, draft_len, draft_min_prob, ctx, threads)
        check_kv_type(kv_type, exact)
        check_window_use(window, (method,), draft, sinks=sinks)
        flash_attn = checked_flash_attn(flash_attn, exact)
        rpc_servers = checked_rpc(rpc)
        # The session fills in the draft length: the user's, else the longest an adaptive run may choose.
        lookahead_sizes = checked_lookahead(lookahead, (method,))
        trees = checked_trees(chain_only, tree_nodes, branches, lookahead_sizes, window=uses_window((method,)))
        sampling = checked_sampling("chat", sampling_options)
        params = GenerationParams(max_tokens, 0, sampling,
                                  tree_nodes=trees.nodes, tie_margin=0.0 if exact else TIE_MARGIN)
        verification = checked_verification("chat", verify, accept, epsilon, delta, margin, exact)
        template_variables = checked_template_variables(chat_template_kwargs, reasoning)
        budget = checked_reasoning_budget(reasoning_budget, reasoning_budget_message)
        interactive = sys.stdin.isatty()
        if each_line and interactive:
            raise UsageError("--each-line reads messages from a pipe", "pipe the messages in, one per line")
        messages = None if interactive else _piped_messages(read_stdin_text(), each_line)
        if show_accept is None:
            show_accept = sys.stdout.isatty() and not json_output
        view = AnswerView(show_accept, json_output, interactive=interactive)
        options = LoadOptions(backend=backend, n_ctx=ctx, threads=threads, gpu_layers=gpu_layers,
                              rpc=rpc_servers, registry=registry, kv_type=kv_type,
                              flash_attn=flash_attn, exact=exact, window=window, sinks=sinks, tree_paths=trees.paths)
        tool_list, choice = checked_tools(tools, tool_choice)
        if (gpu_note := gpu_layers_note(gpu_layers, rpc_servers, backend)) is not None:
            view.note(gpu_note.removeprefix("note: "))  # after the first answer
        target, draft = choose_pair(target, draft, registry)
        learning = checked_learning("chat", learn, no_learn, learn_budget, learn_buffer, keep_learned, target, heads,
                                    view.note, labels=learn_labels)
        from specrun.sessions.trace import open_trace

        with open_trace(trace) as tracing:  # closed after the learners, however the chat ends
            try:
                with open_chat(target, draft, method, options,
                               system_prompt=None if system is None else checked_text(system, "--system"),
                               draft_len=draft_len, draft_min_prob=draft_min_prob, ngram_cache=ngram_cache,
                               branches=trees.branches, heads=heads, lookahead=lookahead_sizes,
                               chain=trees.chain, tree_nodes=trees.nodes, on_note=view.note, tools=tool_list,
                               tool_choice=choice, verification=verification, learn=learning,
                               template_variables=template_variables, reasoning_budget=budget) as session:
                    if tracing is not None:
                        tracing.header(target=target, draft=draft, method=method,
                                       max_new_tokens=max_tokens, **params.sampling.fields())
                        session.trace = tracing
                    session.engine.on_prefill = view.prefill
                    if messages is None:
                        ChatRepl(session, params, view, model=Path(target).name if os.sep in target else target).run()
                    else:
                        answer_each(session, messages, params, view, new_conversation_each=each_line)
            finally:  # the learners stop, and write the heads where asked, however the chat ended
                view.stop_prefill()
                for report in learning.finish() if learning is not None else []:
                    print(report.summary(), file=sys.stderr, flush=True)


def _piped_messages(text: str, each_line: bool) -> list[str]:
    """The messages a pipe holds: all of it, or each non-empty line."""
    messages = [line.strip() for line in text.splitlines()] if each_line else [text.strip("\r\n")]
    messages = [message for message in messages if message.strip()]
    if not messages:
        raise UsageError("stdin holds no message", "pipe some text in, or run specrun chat in a terminal")
    return messages


class AnswerView:
    """Renders chat events: answer text to stdout (or one JSON object per answer), the rest to stderr."""

    def __init__(self, show_accept: bool, json_output: bool, interactive: bool = True) -> None:
        self.show_accept = show_accept
        self.json_output = json_output
        self.interactive = interactive  # /tool answers a call; a pipe's messages cannot
        self.for_display = show_accept or sys.stdout.isatty()
        # Marked text goes through Rich (styled even on a pipe when asked for); plain text is written as is.
        self.out = _console(force_terminal=True) if show_accept else None
        # a reasoning model's thinking, dimmed where it is shown (a terminal, or --show-accept)
        self._styled = self.out or (_console(force_terminal=True) if self.for_display else None)
        self._thought = False  # the answer's thinking was shown, and its answer has not begun
        self.err = _console(stderr=True)
        # a long message's reading (a pasted document), on a terminal
        self.prefill = None if json_output else PrefillBar(self.err)
        self._ends_with_newline = True
        self._notes: list[str] = []  # what loading measured (sessions/kernels.py): after the first answer

    def note(self, text: str) -> None:
        """A note for after the next answer's statistics (a run that fails says its error alone)."""
        self._notes.append(text)

    def show(self, event) -> None:
        """One event from ``ChatSession.ask``."""
        from specrun.sessions.chat import AnswerDone, AnswerText, ContextFullNotice

        if isinstance(event, AnswerText) and not self.json_output:
            if event.thinking and not self.for_display:
                return  # a pipe gets the answer alone
            text = event.text.translate(_CONTROL_SYMBOLS) if self.for_display else event.text
            if event.thinking:
                self._thought = True
                self._write(text, THINKING_STYLE, styled=True)
                return
            if self._thought:  # the answer starts a paragraph of its own after the thinking
                self._thought = False
                self._write("\n" if self._ends_with_newline else "\n\n", None)
            self._write(text, DRAFTED_STYLE if event.from_draft and self.show_accept else None)
        elif isinstance(event, ContextFullNotice):
            self.end_line()
            self.err.print(f"notice: {event.message}", style="yellow")
        elif isinstance(event, AnswerDone):
            self._thought = False
            if self.json_output:
                self._write(json.dumps(event.to_dict()) + "\n", None)
            self.end_line()
            hint = "answer it with /tool RESULT" if self.interactive else (
                "a piped chat cannot answer it: run specrun chat in a terminal, or send the result to specrun serve")
            for call in event.tool_calls:
                self.err.print(f"tool call: {call.name} {call.arguments} ({hint})", style="cyan", highlight=False)
            if event.tool_call_cut:
                from specrun.sessions.tools import TOOL_CALL_CUT_NOTE

                self.err.print(f"note: {TOOL_CALL_CUT_NOTE}", style="yellow", highlight=False)
            self.err.print(stats_line(event), style="dim")
            if event.stats.near_ties and event.stats.drafted:
                from specrun.sessions.setup import near_tie_note

                self.err.print(f"note: {near_tie_note(event.stats)}", style="dim")
            for note in self._notes:
                self.err.print(f"note: {note}", style="dim", highlight=False)
            self._notes.clear()

    def _write(self, text: str, style: str | None, styled: bool = False) -> None:
        """``styled``: through Rich where the text is marked (--show-accept), or on a terminal."""
        if not text:
            return
        rendered = text
        out = self._styled if styled else self.out
        if out is not None:
            # Rendered into a capture, not Rich's own buffer: a Ctrl-C landing mid-print must not
            # leave text there that the next answer's first print would flush.
            with out.capture() as captured:
                out.print(Text(text, style=style or ""), end="")
            rendered = captured.get()
        self._ends_with_newline = text.endswith("\n")  # set first: a Ctrl-C may land in the write
        sys.stdout.write(rendered)
        sys.stdout.flush()

    def end_line(self) -> None:
        """Finish the answer's last line, so what follows starts on its own."""
        if not self._ends_with_newline:
            self._write("\n", None)

    def interrupted(self) -> None:
        self.stop_prefill()
        sys.stdout.flush()  # what the interrupted answer wrote shows before the notice, not in the next answer
        self.end_line()
        self.err.print("interrupted: the answer and its question are dropped from the conversation", style="yellow")

    def error(self, exc: SpecrunError) -> None:
        self.stop_prefill()
        self.end_line()
        self.err.print(f"error: {exc.one_line()}", style="red")

    def info(self, text: str) -> None:
        self.err.print(text)

    def stop_prefill(self) -> None:
        """The prompt's progress bar gone (an answer interrupted or failed while its prompt was read)."""
        if self.prefill is not None:
            self.prefill.close()


def _console(**options) -> Console:
    """A Rich console that prints text verbatim: no markup, emoji codes, highlighting or wrapping."""
    return PipeConsole(highlight=False, markup=False, emoji=False, soft_wrap=True, **options)


def stats_line(done) -> str:
    """The one line after each answer: speed, acceptance, and how much of the prompt came from the cache."""
    return f"{done.stats.summary()}; prompt {done.prompt_tokens} tokens, {done.reused_tokens} from the cache"


def answer_each(session, messages: list[str], params, view: AnswerView, *, new_conversation_each: bool) -> None:
    """Answer piped messages in order; with ``new_conversation_each`` every one starts afresh."""
    for message in messages:
        if new_conversation_each:
            session.reset()
        for event in session.ask(message, params):
            view.show(event)


class ChatRepl:
    """The interactive loop: read a message or a slash command, stream the answer, repeat."""

    def __init__(self, session, params, view: AnswerView, model: str = "") -> None:
        self.session = session
        self.model = model  # the target as the user named it (the banner's; the backend is said beside it)
        self.params = params
        self.view = view
        self.commands = {
            "/stats": self._stats,
            "/reset": self._reset,
            "/system": self._system,
            "/method": self._method,
            "/tool": self._tool,
            "/help": self._help,
        }

    def run(self) -> None:
        """Until /exit, Ctrl-D or Ctrl-C at the prompt."""
        history = _open_history()
        self._banner()
        try:
            while True:
                try:
                    message = read_message()
                except (EOFError, KeyboardInterrupt):
                    self.view.info("")
                    return
                if message is None or not message.strip():
                    continue
                if message.startswith("/") and not message.startswith("//"):
                    if self._command(message):
                        return
                    continue
                self._answer(message.removeprefix("/") if message.startswith("//") else message)
        finally:
            _save_history(history)

    def _banner(self) -> None:
        session = self.session
        draft = "" if session.method == "none" else f", draft_len {session.draft_len}"
        marking = f"; text the drafter got right is {DRAFTED_STYLE}" if self.view.show_accept else ""
        self.view.info(
            f"specrun chat with {self.model or 'the target'} on {session.target.name}: method {session.method}"
            f"{draft}{marking}. "
            "/help lists commands; Ctrl-D exits."
        )

    def _answer(self, message: str, role: str = "user") -> None:
        events = self.session.ask(message, self.params, role)
        try:
            for event in events:
                self.view.show(event)
        except KeyboardInterrupt:
            events.close()
            self.view.interrupted()
        except SpecrunError as exc:
            self.view.error(exc)

    def _command(self, line: str) -> bool:
        """Run a slash command; True when it asks to leave."""
        name, _, argument = line.partition(" ")
        if name in ("/exit", "/quit"):
            return True
        handler = self.commands.get(name)
        if handler is None:
            self.view.info(f"unknown command {name}; /help lists the commands")
            return False
        try:
            handler(argument.strip())
        except SpecrunError as exc:
            self.view.error(exc)
        return False

    def _stats(self, _argument: str) -> None:
        session = self.session
        if not session.answers:
            self.view.info("no answers yet")
            return
        last = session.answers[-1]
        self.view.info(f"last answer: {last.summary()}")
        self.view.info(
            f"  prompt {last.prompt_tokens} tokens, prefill {last.prefill_seconds:.3f} s, "
            f"{last.steps} verify steps (by drafts accepted, 0 1 2 …: {last.accepted_hist})"
        )
        count = len(session.answers)
        self.view.info(f"whole chat, {count_of(count, 'answer')}: {session.total_stats().summary()}")

    def _reset(self, _argument: str) -> None:
        self.session.reset()
        self.view.info("new conversation")

    def _system(self, argument: str) -> None:
        if not argument:
            self.view.info(f"system prompt: {self.session.system_prompt or '(none)'}")
            return
        self.session.set_system_prompt(None if argument == "-" else argument)
        self.view.info("system prompt removed" if argument == "-" else "system prompt set")

    def _method(self, argument: str) -> None:
        from specrun.drafters.methods import METHODS

        if argument:
            self.session.set_method(argument)
        self.view.info(f"method {self.session.method} (methods: {', '.join(METHODS)}; those needing a draft model, "
                       "heads or MTP layers only where this chat has them)")

    def _tool(self, argument: str) -> None:
        if not argument:
            raise UsageError("/tool needs the call's result", "type /tool RESULT, e.g. /tool {\"temperature\": 21}")
        self._answer(argument, role="tool")

    def _help(self, _argument: str) -> None:
        self.view.info(HELP)


def read_message() -> str | None:
    """One message from the terminal; None when a multi-line message was cancelled with Ctrl-C.

    EOFError or KeyboardInterrupt at the first prompt mean: leave. Ctrl-D inside a multi-line
    message leaves too (it was read as Ctrl-C, and the chat went on), saying the message was not
    sent.
    """
    line = _input(PROMPT)
    try:
        if line.lstrip().startswith(BLOCK_QUOTE):
            return _read_block(line.lstrip()[len(BLOCK_QUOTE):])
        lines = []
        while line.endswith("\\"):
            lines.append(line[:-1])
            line = _input(CONTINUE_PROMPT)
        return "\n".join([*lines, line])
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return None
    except EOFError:
        print("\nthe unfinished message was not sent", file=sys.stderr)
        raise


def _input(prompt: str) -> str:
    """input() with readline; the prompt goes to stderr when stdout is redirected, keeping the file answers-only."""
    if sys.stdout.isatty():
        return input(prompt)
    sys.stderr.write(prompt)
    sys.stderr.flush()
    return input()


def _read_block(first: str) -> str:
    """The rest of a \"\"\" block whose first line (after the quotes) is ``first``."""
    lines = [first]
    while not lines[-1].rstrip().endswith(BLOCK_QUOTE):
        lines.append(_input(CONTINUE_PROMPT))
    lines[-1] = lines[-1].rstrip()[: -len(BLOCK_QUOTE)]
    return "\n".join(lines).strip("\n")


def _history_path() -> Path:
    from specrun.modelkit.demo import cache_dir

    return cache_dir() / "chat_history"


def _open_history():
    """readline with the saved input history, or None where readline is missing."""
    try:
        import readline
    except ImportError:
        return None
    readline.set_history_length(HISTORY_LENGTH)
    try:
        readline.read_history_file(_history_path())
    except OSError:
        pass  # no history yet
    return readline


def _save_history(readline) -> None:
    if readline is None:
        return
    try:
        _history_path().parent.mkdir(parents=True, exist_ok=True)
        readline.write_history_file(_history_path())
    except OSError:
        pass  # history is a convenience: a read-only cache folder must not break the chat
