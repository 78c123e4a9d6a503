"""What every command shares: validation, the limits it checks and the one error handler
(the options themselves are declared in options.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import math
import os
import re
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import typer
from rich.console import Console

from specrun.cli.interrupts import INTERRUPTED_EXIT, say_interrupted
from specrun.errors import SpecrunError, UsageError
from specrun.fileio import config_dir, same_file

if TYPE_CHECKING:
    from specrun.sampling import SamplingSettings

MAX_NEW_TOKENS = 1_000_000
MAX_DRAFT_LEN = 64
MAX_BRANCHES = 8  # a tree's siblings; llama.cpp holds one sequence per root-to-leaf path
MAX_TREE_NODES = 64
FLASH_ATTN_CHOICES = ("auto", "on", "off")  # --flash-attn
# What a shell reports for a command a closed pipe stopped (128 + SIGPIPE): `specrun … | head`.
BROKEN_PIPE_EXIT = 141
FULL_DISK = (errno.ENOSPC, errno.EDQUOT)  # no room left for what a command writes


@contextlib.contextmanager
def cli_errors():
    """Errors in one place: a one-line message with the fix, exit 1 (usage: 2)."""
    try:
        check_environment()
        yield
    except SpecrunError as exc:
        if os.environ.get("SPECRUN_DEBUG") == "1":
            traceback.print_exc()
        typer.echo(f"error: {exc.one_line()}", err=True)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        say_interrupted()
        raise typer.Exit(INTERRUPTED_EXIT) from None
    except BrokenPipeError:
        silence_stdout()  # the reader has gone (`| head`): stop quietly
        raise typer.Exit(BROKEN_PIPE_EXIT) from None
    except (typer.Exit, typer.Abort):
        raise
    except OSError as exc:
        if exc.errno not in FULL_DISK:
            _internal_error(exc)
        if os.environ.get("SPECRUN_DEBUG") == "1":
            traceback.print_exc()
        problem = os.strerror(exc.errno).lower()
        if exc.filename is not None:  # a file no check of its own caught
            typer.echo(f"error: cannot write {exc.filename}: {problem}; free some space, or write it elsewhere", err=True)
            raise typer.Exit(1) from None
        silence_stdout()  # the output itself (stdout on a full disk, > /dev/full)
        typer.echo(f"error: cannot write the output: {problem}; free some space, or send the output elsewhere",
                   err=True)
        raise typer.Exit(1) from None
    except Exception as exc:  # noqa: BLE001 - an unexpected failure: still one line unless debugging
        _internal_error(exc)


def silence_stdout() -> None:
    """stdout pointed at /dev/null: it can take nothing more (a closed pipe, a full disk), and Python
    flushes it again at exit, which would print "Exception ignored … BrokenPipeError" (or OSError)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _internal_error(exc: Exception) -> NoReturn:
    """An unexpected failure (called while it is handled): one line unless debugging, exit 1."""
    if os.environ.get("SPECRUN_DEBUG") == "1":
        traceback.print_exc()
    typer.echo(f"error: internal error: {type(exc).__name__}: {exc}; rerun with SPECRUN_DEBUG=1 for a traceback",
               err=True)
    raise typer.Exit(1) from None


class PipeConsole(Console):
    """A Rich console whose closed pipe ends the run as any other command's does (cli_errors).

    Rich's own handler exits 1, which a caller cannot tell from a failure.
    """

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


# Options naming a model (or heads): a file where they name one (an alias names none), read by the
# command; an empty value of one is refused by name (cli/app.empty_option)
MODEL_OPTIONS = ("target", "draft", "heads", "student")


def check_outputs_apart(context: typer.Context, *outputs: str) -> None:
    """Before anything runs: no file an option of this command writes (``outputs``, its
    parameters' names) is one another of its options names, read or written. A --trace on the
    model or the tools file, --json on the --prompts file, --json and --report on one file: each
    overwrote the other in silence, exit 0; nor a file inside a model's or heads' folder, the .json
    beside heads' weights, or specrun's own settings. Read from the command's own context, so an
    option added later is covered (a str option counts where it names a model, ``MODEL_OPTIONS``)."""
    flags = {param.name: max(param.opts, key=len) for param in context.command.params
             if param.param_type_name == "option"}
    named = {name: Path(value) for name, value in context.params.items() if name in flags and value and (
        isinstance(value, Path) or (name in MODEL_OPTIONS and isinstance(value, str))) and str(value) != "-"}
    for output in outputs:
        path = named.get(output)
        if path is None or (path.exists() and not path.is_file()):  # /dev/null, /dev/stdout: written through
            continue
        fix = f"give {flags[output]} a file of its own"
        if _within(path, config_dir()) and path.name in SETTINGS_FILES:
            # a --trace on learned.json poisoned every later run
            raise UsageError(f"{flags[output]} names {path}, a file of specrun's own settings: writing it would "
                             "overwrite it", fix)
        for other, read in named.items():
            if other == output:
                continue
            # another output is written whether it exists or not; an input only where it is a file
            if (other in outputs or read.is_file()) and same_file(path, read):
                raise UsageError(f"{flags[output]} and {flags[other]} name one file, {read}: writing one "
                                 "would overwrite the other", fix)
            if other not in MODEL_OPTIONS:
                continue
            # a file a model's or heads' folder is read from (its config.json), not another beside them
            # (a trace written again into a folder that is the working folder, -t .)
            if read.is_dir() and _within(path, read) and _model_file(path.name):
                raise UsageError(f"{flags[output]} names {path}, a file of the folder {flags[other]} names: "
                                 "writing it would change that model", fix)
            if read.suffix == ".safetensors" and read.is_file() and same_file(path, read.with_suffix(".json")):
                raise UsageError(f"{flags[output]} names {path}, the file beside the weights {flags[other]} "
                                 "names that describes them: writing it would overwrite it", fix)


# specrun's own settings files (fileio.config_dir), and the names a model folder's loader reads
SETTINGS_FILES = ("tuned.json", "learned.json", "layers.json", "kernels.json", "models.toml")


def _model_file(name: str) -> bool:
    return (name in ("config.json", "generation_config.json", "chat_template.jinja") or name.startswith("tokenizer")
            or name.endswith((".safetensors", ".safetensors.index.json", ".gguf")))


def _within(path: Path, folder: Path) -> bool:
    """Is ``path`` (there or not) inside ``folder``, through links?"""
    try:
        return path.resolve().is_relative_to(folder.resolve())
    except OSError:
        return False


def check_environment() -> None:
    """Settings taken from the environment are input too: refuse one that would be ignored."""
    threads = os.environ.get("SPECRUN_THREADS", "")
    if threads and not (threads.isdigit() and 1 <= int(threads) <= 1024):
        raise UsageError(
            f"SPECRUN_THREADS must be a whole number of threads from 1 to 1024, got {threads!r}",
            "set it to a thread count, or unset it to use every core",
        )


def read_prompt(prompt: str | None) -> str:
    """The prompt argument, or the whole of a piped stdin when it is '-' or absent; never empty
    (the model would answer nothing at all: `specrun chat` refuses an empty stdin too)."""
    if prompt is not None and prompt != "-":
        text = checked_text(prompt, "the prompt argument")
    elif prompt is None and sys.stdin.isatty():
        raise UsageError("no prompt given", "pass PROMPT as an argument or pipe it on stdin")
    else:
        text = read_stdin_text()
    if not text.strip():  # `echo "$EMPTY" | specrun generate` sends a newline
        raise UsageError("the prompt is empty", "pass PROMPT as an argument or pipe some text on stdin")
    return text


NOT_UTF8_FIX = "convert it to UTF-8 first, e.g. iconv -f latin1 -t utf-8"


# More text than any model's context holds (a million tokens of 256 bytes): reading on would only
# fill memory (`yes | specrun generate` never ended).
MAX_STDIN_BYTES = 256 << 20


def read_stdin_text() -> str:
    """All of stdin as text; SpecrunError when it is not UTF-8 (whatever the locale says) or
    longer than any context holds."""
    data = sys.stdin.buffer.read(MAX_STDIN_BYTES + 1)
    if len(data) > MAX_STDIN_BYTES:
        raise SpecrunError(f"stdin holds more than {MAX_STDIN_BYTES >> 20} MiB, more text than a model's context holds",
                           "pipe in a shorter prompt (head -c 1M FILE keeps its first megabyte)")
    try:  # a byte-order mark a Windows editor wrote is no part of the prompt (it changed the answer)
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SpecrunError(f"stdin is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})",
                           NOT_UTF8_FIX) from None


def checked_text(text: str, where: str) -> str:
    """``text`` when it is valid Unicode; argv bytes that are not UTF-8 reach Python as lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raw = text[exc.start].encode("utf-8", "surrogateescape")
        raise SpecrunError(f"{where} is not UTF-8 text (byte 0x{raw[0]:02x} at character {exc.start})",
                           NOT_UTF8_FIX) from None
    return text


def checked_chat(chat: bool, raw: bool) -> bool | None:
    """--chat and --raw as one choice: True (the chat template), False (as typed), or None (the
    model's kind decides); a usage error when both are given."""
    if chat and raw:
        raise UsageError("--chat and --raw contradict each other", "drop one of them")
    return True if chat else False if raw else None


def check_range(name: str, value: int | float | None, low: float, high: float) -> None:
    if value is not None and not (low <= value <= high):
        raise UsageError(f"{name} must be between {_bound(low)} and {_bound(high)}, got {value}", f"pass a valid {name}")


def comma_list(name: str, text: str, example: str, known: Sequence[str] = ()) -> list[str]:
    """A comma-separated option's items, stripped and in order, duplicates dropped; an empty list
    or item (``none,,draft``, a trailing comma: a name lost in the shell) is a usage error, whose
    fix lists the ``known`` names where given."""
    items = [item.strip() for item in text.split(",")]
    some = f"use some of: {', '.join(known)}" if known else f"name at least one, e.g. {name} {example}"
    if not any(items):
        raise UsageError(f"{name} is empty", some)
    if not all(items):
        raise UsageError(f"{name} {text!r} has an empty name (two commas together, or one at an end)",
                         f"separate the names with single commas, e.g. {name} {example}")
    return list(dict.fromkeys(items))


def _bound(value: float) -> str:
    """A range's end as written: 1048576, not 1.04858e+06."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def checked_trees(chain: bool, tree_nodes: int | None, branches: int | None, lookahead=None, window: bool = False):
    """The token-tree options as TreeSettings, or a usage error naming the bad or clashing one.
    ``window``: a method in the run drafts with a lookahead window (a tree) of the sizes
    ``lookahead`` (--lookahead), or of sizes chosen once the target is loaded (None)."""
    from specrun.sessions.setup import resolve_trees, window_room

    if chain and (tree_nodes is not None or branches):
        clash = "--tree-nodes" if tree_nodes is not None else "--branches"
        raise UsageError(f"--chain and {clash} contradict each other", "drop one of them")
    if chain and window:
        raise UsageError("--chain contradicts --method lookahead: its window is verified as a token tree",
                         "drop --chain, or pick another method")
    check_range("--tree-nodes", tree_nodes, 1, MAX_TREE_NODES)
    check_range("--branches", branches, 0, MAX_BRANCHES)
    room = window_room(lookahead, tree_nodes) if window else None
    if room is not None and tree_nodes is not None and tree_nodes < room.max_nodes:
        if lookahead is not None:
            raise UsageError(f"--tree-nodes {tree_nodes} cannot hold the lookahead window and candidates "
                             f"({room.max_nodes} nodes)", "drop --tree-nodes (the window sizes its pass), or shrink "
                             "--lookahead")
        raise UsageError(f"--tree-nodes {tree_nodes} cannot hold the smallest lookahead window ({room.max_nodes} "
                         "nodes)", f"drop --tree-nodes (the window sizes its pass), or pass at least {room.max_nodes}")
    return resolve_trees(chain, tree_nodes, branches, room)


def uses_window(methods: Sequence[str]) -> bool:
    """Does a method of ``methods`` draft with a lookahead window (a tree every pass)?"""
    from specrun.drafters.methods import uses_lookahead

    return any(uses_lookahead(method) for method in methods)


def check_heads_used(heads: str | None, methods: Sequence[str]) -> None:
    """A usage error for --heads where no method of ``methods`` drafts with heads (it was ignored,
    a path that does not exist too)."""
    from specrun.drafters.methods import is_adaptive, needs_heads

    if heads is not None and not any(needs_heads(method) or is_adaptive(method) for method in methods):
        raise UsageError("--heads is for the head methods (medusa, hydra, eagle) and auto, and no method here "
                         "drafts with heads", "drop --heads, or pass e.g. --method eagle")


def checked_lookahead(text: str | None, methods: Sequence[str]):
    """The lookahead sizes given (``--lookahead WINDOW:NGRAM:CANDIDATES``) when one of ``methods``
    drafts with a lookahead window; None when none was given (they are then chosen from the
    target's pass costs) or no method uses one; a usage error for a bad value or one given to
    methods that do not use it."""
    from specrun.drafters.lookahead import LookaheadSizes
    from specrun.drafters.methods import uses_lookahead

    if not any(uses_lookahead(method) for method in methods):
        if text is not None:
            raise UsageError("--lookahead sets the lookahead method's window, and no method here uses it",
                             "drop --lookahead, or pass --method lookahead")
        return None
    if text is None:
        return None
    parts = text.split(":")
    if len(parts) != 3 or not all(part.isascii() and part.isdigit() for part in parts):
        raise UsageError(f"--lookahead takes WINDOW:NGRAM:CANDIDATES, got {text!r}", "pass e.g. --lookahead 5:4:3")
    try:
        return LookaheadSizes(*(int(part) for part in parts))
    except ValueError as exc:
        raise UsageError(f"--lookahead {exc}", "pass e.g. --lookahead 5:4:3") from None


MAX_GRAMMAR_BYTES = 1 << 20  # a grammar or schema file larger than this is not one a person wrote


def checked_grammar(grammar: Path | None, json_schema: Path | None):
    """--grammar (GBNF, or Lark for a .lark file) or --json-schema as a GrammarSpec checked to
    compile (None: neither); a usage error naming the file and what is wrong with it."""
    from specrun.fileio import read_limited
    from specrun.grammar import GrammarError, GrammarSpec

    if grammar is not None and json_schema is not None:
        raise UsageError("--grammar and --json-schema both constrain the answer", "give one of them")
    path = grammar if grammar is not None else json_schema
    if path is None:
        return None
    option = "--grammar" if grammar is not None else "--json-schema"
    data = read_limited(Path(path), MAX_GRAMMAR_BYTES, f"{option} file", f"give {option} a text file",
                        error=UsageError)
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark is no part of the grammar
    except UnicodeDecodeError as exc:
        raise UsageError(f"the {option} file {path} is not UTF-8 text (byte {exc.start})",
                         "save it as UTF-8") from None
    kind = "json_schema" if json_schema is not None else ("lark" if Path(path).suffix == ".lark" else "gbnf")
    spec = GrammarSpec(kind, text)
    try:
        spec.check()
    except GrammarError as exc:
        raise UsageError(f"{option} {path}: {exc.problem}", exc.fix) from None
    return spec


MAX_TOOLS_BYTES = 4 << 20


def checked_tools(path: Path | None, choice: str):
    """--tools FILE (OpenAI's tools list, or an object holding one under "tools") and --tool-choice,
    checked: (tools, ToolChoice); a usage error naming the file and the definition at fault."""
    import json

    from specrun.fileio import json_problem, read_limited
    from specrun.sessions.tools import ToolChoice, ToolDefinitionError, tool_choice_of, tool_definitions

    if path is None:
        if choice != "auto":
            raise UsageError("--tool-choice needs --tools", "give the tools file with --tools")
        return (), ToolChoice()
    data = read_limited(Path(path), MAX_TOOLS_BYTES, "--tools file", "give --tools a JSON file", error=UsageError)
    try:
        value = json.loads(data.decode("utf-8-sig"))  # a byte-order mark, as bench --prompts takes it
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise UsageError(f"the --tools file {path} is not JSON: {json_problem(exc)}",
                         "give a JSON list of tool definitions") from None
    if isinstance(value, dict) and "tools" in value:
        value = value["tools"]
    try:
        tools = tool_definitions(value)
        if not tools:
            raise UsageError(f"the --tools file {path} defines no tools", "give at least one tool definition")
        named = {"type": "function", "function": {"name": choice}}
        return tools, tool_choice_of(choice if choice in ("auto", "none", "required") else named, tools)
    except ToolDefinitionError as exc:
        raise UsageError(f"--tools {path}: {exc.problem}".replace("tool_choice", "--tool-choice"), exc.fix) from None


def checked_verification(command: str, verify: str, accept: str, epsilon: float | None, delta: float | None,
                         margin: float | None, exact: bool = False):
    """--verify and --accept (with --epsilon, --delta, --margin) as the engine's Verification, or a
    usage error naming the bad or clashing option."""
    from specrun.engine.passes import CHAIN_RULES, Verification
    from specrun.verify import ACCEPTANCE_RULES, EXACT, LossyAcceptance

    if verify not in CHAIN_RULES:
        raise UsageError(f"unknown --verify {verify!r}", f"use --verify {' or '.join(CHAIN_RULES)}")
    if accept not in ACCEPTANCE_RULES:
        raise UsageError(f"unknown --accept {accept!r}", f"use --accept {', '.join(ACCEPTANCE_RULES)}")
    owners = {"--epsilon": (epsilon, "typical"), "--delta": (delta, "typical"), "--margin": (margin, "margin")}
    for option, (value, rule) in owners.items():
        if value is not None and accept != rule:
            raise UsageError(f"{option} sets --accept {rule}, and the acceptance here is {accept}",
                             f"drop {option}, or pass --accept {rule}")
    if accept == EXACT:
        return Verification(verify)
    if exact:
        raise UsageError(f"--exact contradicts --accept {accept}: a lossy rule changes the text",
                         f"drop --accept {accept} (or drop --exact)")
    given = {name: value for name, value in (("epsilon", epsilon), ("delta", delta), ("factor", margin))
             if value is not None}
    acceptance = LossyAcceptance(accept, **given)
    problems = acceptance.validate()
    if problems:
        raise UsageError(problems[0], f"see `specrun {command} --help`")
    return Verification(verify, acceptance)


def checked_template_variables(chat_template_kwargs: str | None, reasoning: str | None) -> dict:
    """--chat-template-kwargs (a JSON object of template variables) and --reasoning (on/off: the
    template's enable_thinking; auto: the template's own default) as the variables every rendering
    gives the chat template; a usage error naming the option where either is wrong."""
    import json

    from specrun.sessions.templates import template_variables_problem

    variables = {}
    if chat_template_kwargs is not None:
        try:
            variables = json.loads(chat_template_kwargs)
        except ValueError as exc:
            raise UsageError(f"--chat-template-kwargs is not JSON: {exc}",
                             "pass a JSON object, e.g. '{\"enable_thinking\": false}'") from None
        problem = template_variables_problem(variables)
        if problem:
            raise UsageError(f"--chat-template-kwargs: {problem}", "pass a JSON object of the template's variables")
    if reasoning is not None:
        if reasoning not in ("on", "off", "auto"):
            raise UsageError(f"--reasoning must be on, off or auto, got {reasoning!r}",
                             "pass --reasoning off to turn a model's thinking off")
        if reasoning != "auto":
            if "enable_thinking" in variables and variables["enable_thinking"] != (reasoning == "on"):
                raise UsageError(f"--reasoning {reasoning} and --chat-template-kwargs' enable_thinking disagree",
                                 "give one of them")
            variables["enable_thinking"] = reasoning == "on"
    return variables


def checked_reasoning_budget(budget: int, message: str | None, serve: bool = False) -> tuple[int, str]:
    """--reasoning-budget (-1: no limit) and --reasoning-budget-message, checked; ``serve``: a
    message alone is the one forced where a request sets a budget (as llama-server takes it)."""
    if budget < -1:
        raise UsageError(f"--reasoning-budget must be -1 (no limit), 0 or a count of tokens, got {budget}",
                         "pass --reasoning-budget 0 to end the thinking at once")
    if message is not None and budget < 0 and not serve:
        raise UsageError("--reasoning-budget-message is forced when --reasoning-budget runs out, and there is none",
                         "give --reasoning-budget N beside it")
    return budget, checked_text(message, "--reasoning-budget-message") if message is not None else ""


def checked_reasoning_format(reasoning_format: str) -> str:
    from specrun.sessions.reasoning import REASONING_FORMATS

    if reasoning_format not in REASONING_FORMATS:
        raise UsageError(f"--reasoning-format must be one of {', '.join(REASONING_FORMATS)}, got {reasoning_format!r}",
                         "pass --reasoning-format none to keep the thinking in the answer's text")
    return reasoning_format


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """The sampling options as given, not yet checked (``checked_sampling`` makes them
    SamplingSettings): what ``options.takes_sampling_options`` gathers for a command. Each field is the
    option of its name (options.SAMPLING_OPTIONS), in the order --help lists them, with its default."""

    temp: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical: float = 1.0
    top_nsigma: float = 0.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dynatemp_range: float = 0.0
    dynatemp_exp: float = 1.0
    mirostat: int = 0
    mirostat_lr: float = 0.1
    mirostat_ent: float = 5.0
    adaptive_target: float = -1.0
    adaptive_decay: float = 0.9
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64
    dry_sequence_breaker: list[str] | None = None
    samplers: str | None = None
    seed: int | None = None
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: list[str] | None = None


def checked_sampling(command: str, options: SamplingOptions) -> SamplingSettings:
    """The sampling options (options.takes_sampling_options) as SamplingSettings, or a usage error
    naming the first bad one."""
    from specrun.adaptive_p import AdaptiveP
    from specrun.mirostat import Mirostat
    from specrun.penalties import Penalties
    from specrun.sampling import SamplingSettings

    if options.mirostat in (1, 2):
        _check_off_under_mirostat(options)
    penalties = Penalties(options.repeat_penalty, options.frequency_penalty, options.presence_penalty,
                          options.repeat_last_n)
    sampling = SamplingSettings(options.temp, options.top_k, options.top_p, options.min_p, options.seed,
                                penalties=penalties,
                                logit_bias=tuple(_logit_bias(value) for value in options.logit_bias or ()),
                                typical_p=options.typical, top_n_sigma=options.top_nsigma,
                                xtc_probability=options.xtc_probability, xtc_threshold=options.xtc_threshold,
                                dry=_dry(options.dry_multiplier, options.dry_base, options.dry_allowed_length,
                                         options.dry_penalty_last_n, options.dry_sequence_breaker),
                                dynatemp_range=options.dynatemp_range, dynatemp_exponent=options.dynatemp_exp,
                                mirostat=Mirostat(options.mirostat, options.mirostat_ent, options.mirostat_lr),
                                adaptive_p=AdaptiveP(options.adaptive_target, options.adaptive_decay))
    problems = sampling.validate()
    if problems:
        raise UsageError(problems[0], f"see `specrun {command} --help`")
    if options.samplers is not None:
        sampling = dataclasses.replace(sampling, order=_samplers_order(options.samplers, sampling))
    return sampling


def _check_off_under_mirostat(options: SamplingOptions) -> None:
    """The samplers llama.cpp's chain leaves out under mirostat (the truncations, XTC, a dynamic
    temperature, the penalties and DRY; it keeps a bias), refused where given beside it."""
    given = [flag for flag, on in (
        ("--top-k", options.top_k > 0), ("--top-p", options.top_p < 1.0), ("--min-p", options.min_p > 0.0),
        ("--typical", options.typical < 1.0), ("--top-nsigma", options.top_nsigma > 0.0),
        ("--xtc-probability", options.xtc_probability > 0.0), ("--dynatemp-range", options.dynatemp_range > 0.0),
        ("--repeat-penalty", options.repeat_penalty != 1.0), ("--presence-penalty", options.presence_penalty != 0.0),
        ("--frequency-penalty", options.frequency_penalty != 0.0), ("--dry-multiplier", options.dry_multiplier > 0.0),
        ("--adaptive-target", options.adaptive_target >= 0.0), ("--samplers", options.samplers is not None)) if on]
    if given:
        raise UsageError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} off under --mirostat, which "
                         "samples as llama.cpp's chain does: the temperature, then mirostat alone",
                         f"drop {' and '.join(given)}, or --mirostat")


def _dry(multiplier: float, base: float, allowed_length: int, last_n: int, breakers: list[str] | None):
    """The --dry-* options as dry.Dry: the breakers llama.cpp's unless given ('none': none)."""
    from specrun.dry import DRY_BREAKERS, Dry

    listed = list(DRY_BREAKERS) if breakers is None else []  # given, they replace the defaults
    for breaker in breakers or ():
        if not breaker:
            raise UsageError("--dry-sequence-breaker takes a non-empty string", "give the string, or 'none' for none")
        try:
            breaker.encode()
        except UnicodeEncodeError:
            raise UsageError(f"--dry-sequence-breaker {breaker!r} is not text (bytes that are not UTF-8)",
                             "give it as UTF-8 text") from None
        if breaker == "none":  # as llama.cpp's: none so far
            listed.clear()
        else:
            listed.append(breaker)
    # a base under 1 is llama.cpp's default, as llama-cli and llama-server read it
    return Dry(multiplier, Dry.base if base < 1.0 else base, allowed_length, last_n, tuple(listed))


def listed_samplers(text: str, sampling: SamplingSettings) -> tuple[str, ...]:
    """--samplers as the samplers it names, in its order, as llama.cpp names them: its names
    separated by ; (or commas), or a string of their letters, naming each sampler that is on in
    ``sampling`` (greedy runs: none), the penalties where on; llama.cpp's other samplers may be
    named and change nothing."""
    from specrun.sampling import SAMPLER_LETTERS, named_samplers, sampler_named

    parts = [part.strip() for part in re.split(r"[;,]", text) if part.strip()]
    letters = len(parts) == 1 and sampler_named(parts[0]) is None and set(parts[0]) <= set(SAMPLER_LETTERS)
    try:
        names = named_samplers(parts[0] if letters else parts)
    except ValueError as error:
        raise UsageError(f"--samplers: {error}", f"or name them by their letters ({''.join(SAMPLER_LETTERS)})") from None
    if "infill" in names:
        raise UsageError("--samplers names infill, llama.cpp's rule for code fills, which a fill request to "
                         "`specrun serve` asks for itself", "leave infill out")
    on = [] if sampling.greedy else [*sampling.chain, *(["adaptive_p"] if sampling.adaptive_on else [])]
    shaping = [*(["penalties"] if sampling.penalties.on else []), *(["dry"] if sampling.dry.on else [])]
    missing = [name for name in (*shaping, *on) if name not in names]
    if missing:
        raise UsageError(f"--samplers leaves out {', '.join(missing)}, which the options turn on: it sets the order "
                         "the samplers apply in", f"name each sampler that is on, {SAMPLERS_HINT}")
    return tuple(names)


SAMPLERS_HINT = "like --samplers 'top_k;top_p;min_p;temperature' (--top-k 0, --top-p 1 and the like turn one off)"


def _samplers_order(text: str, sampling: SamplingSettings) -> tuple[str, ...]:
    """--samplers as SamplingSettings.order (``listed_samplers``, a sampler named twice or one
    before the penalties where on refused)."""
    from specrun.sampling import listed_order

    try:
        return listed_order(listed_samplers(text, sampling), sampling.penalties.on, sampling.dry.on)
    except ValueError as error:
        raise UsageError(f"--samplers: {error}", SAMPLERS_HINT) from None


def check_bias_beside_grammar(sampling, constrained: bool) -> None:
    """A bias that forbids a token (-inf) beside a grammar or a required tool call could forbid every
    token the grammar allows at some step: refused, as the server refuses it."""
    if constrained and any(amount == -math.inf for _, amount in sampling.logit_bias):
        raise UsageError("--logit-bias forbids a token (-inf) beside a grammar, which could forbid every token the "
                         "grammar allows", "give a finite bias (such as 15043-100), or drop the grammar")


def _logit_bias(value: str) -> tuple[int, float]:
    """One --logit-bias as llama.cpp writes it: TOKEN_ID+BIAS or TOKEN_ID-BIAS (BIAS may be inf)."""
    match = re.fullmatch(r"\s*(\d{1,10})\s*([+-])\s*(\S+)\s*", value)  # ten digits: past any vocabulary
    try:
        amount = float(match.group(3)) if match else math.nan
    except ValueError:
        amount = math.nan
    if match is None or math.isnan(amount) or amount < 0:
        raise UsageError(f"--logit-bias {value!r} is not TOKEN_ID+BIAS or TOKEN_ID-BIAS",
                         "write it as llama.cpp does, like 15043+1.5, or 2-inf to forbid token 2")
    amount = -amount if match.group(2) == "-" else amount
    if amount == math.inf:
        raise UsageError(f"--logit-bias {value!r} would force its token at every step", "give a finite bias, or -inf to forbid it")
    return int(match.group(1)), amount


def checked_rpc(rpc: str | None) -> tuple[str, ...]:
    """--rpc as a tuple of HOST:PORT endpoints (empty without it)."""
    if rpc is None:
        return ()
    from specrun.backends.llama_rpc import parse_endpoints

    return parse_endpoints(rpc)


# A prompt this long (tokens still to read) gets a progress bar on a terminal: a few seconds' reading
PREFILL_BAR_MIN = 2048


class PrefillBar:
    """A progress bar on stderr while a long prompt is read (SpeculativeEngine.on_prefill), on a
    terminal only; gone once the prompt is read, so the answer follows where it began."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self._progress = None
        self._task = None

    def __call__(self, fed: int, total: int) -> None:
        if self._progress is None:
            if not self.console.is_terminal or total - fed < PREFILL_BAR_MIN:
                return
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("reading the prompt"), BarColumn(), MofNCompleteColumn(),
                                      TimeRemainingColumn(), console=self.console, transient=True)
            self._progress.start()
            self._task = self._progress.add_task("prompt", total=total, completed=fed)
        self._progress.update(self._task, completed=fed)
        if fed >= total:
            self.close()

    def close(self) -> None:
        progress, self._progress = self._progress, None
        if progress is not None:
            progress.stop()


def check_window_use(window: int | None, methods: Sequence[str], draft: str | None, flag: str = "--method",
                     sinks: int | None = None) -> None:
    """--window sizes a draft model's cache (or the target's own with --draft self:window): refused,
    with --sinks, where no method named drafts with a draft model (--draft self:window alone is
    noted, as any --draft is); --sinks where no cache is windowed (--draft self:window is, at its
    default window). Their ranges are LoadOptions'."""
    from specrun.drafters.methods import is_adaptive, needs_draft_model
    from specrun.modelkit.selfdraft import is_window_draft

    if sinks is not None and window is None and not is_window_draft(draft):
        raise UsageError("--sinks sizes a windowed draft cache, and there is none",
                         "pass --window N (or --draft self:window), or drop --sinks")
    if window is None and not is_window_draft(draft):
        return
    if window == 0 and is_window_draft(draft):
        raise UsageError(f"--draft {draft} drafts from a windowed cache, and --window 0 keeps none",
                         "pass --window N (512, say), or leave --window out")
    if not any(needs_draft_model(method) or is_adaptive(method) for method in methods):
        if window is None and sinks is None:
            return  # --draft self:window alone: like any --draft, a note after the run (unused_draft_note)
        given = "--window" if window is not None else "--sinks"
        raise UsageError(f"{given} sets up a draft model's cache, and {flag} {','.join(methods)} drafts without one",
                         f"drop {given}, or pass --method draft (or auto)")


def check_draft_len_use(draft_len: int | None, methods: Sequence[str], flag: str = "--method", *,
                        draft_min_prob: float | None = None, branches: int | None = None,
                        tree_nodes: int | None = None) -> None:
    """-k (or --draft-min-prob, --branches, --tree-nodes) where every method named is plain decoding
    (none): it would be ignored. Not in chat, whose /method may turn to a method that drafts later."""
    if not all(method == "none" for method in methods):
        return
    given = [(name, what) for name, what, value in (
        ("--draft-len (-k)", "sets the draft length", draft_len),
        ("--draft-min-prob", "cuts drafts at a probability", draft_min_prob),
        ("--branches", "drafts trees", branches),
        ("--tree-nodes", "sizes the draft trees", tree_nodes)) if value is not None]
    if given:
        name, what = given[0]
        raise UsageError(f"{name} {what}, and {flag} none drafts nothing",
                         f"drop {name.split()[0]}, or choose a method that drafts ({flag} auto, say)")


def check_drafter_options_used(methods: Sequence[str], flag: str = "--method", *,
                               draft_min_prob: float | None = None, ngram_cache: Path | None = None) -> None:
    """--draft-min-prob (a draft model's confidence stop) or --ngram-cache (the n-gram pool's file)
    where no method of ``methods`` drafts with what they shape: each would be ignored, as --window,
    --heads and --lookahead would be. Not in chat, whose /method may turn to such a method later.
    --draft itself is taken with any method, with a note (unused_draft_note)."""
    from specrun.drafters.methods import is_adaptive, needs_draft_model, resolve_method

    named = ",".join(methods)
    verb = "drafts" if len(methods) == 1 else "draft"
    if draft_min_prob is not None and not any(needs_draft_model(method) or is_adaptive(method) for method in methods):
        raise UsageError(f"--draft-min-prob cuts a draft model's drafts at a probability, and {flag} {named} {verb} "
                         "without one", f"drop --draft-min-prob, or choose a method with a draft model ({flag} draft "
                         "or auto, say)")
    if ngram_cache is not None and not any(
            "ngram" in resolve_method(method).split("+") or is_adaptive(method) for method in methods):
        raise UsageError(f"--ngram-cache keeps the n-gram pool's counts, and {flag} {named} {verb} without the pool",
                         f"drop --ngram-cache, or choose a method with the pool ({flag} ngram or auto, say)")


def unused_draft_note(draft: str | None, methods: Sequence[str], flag: str = "--method") -> str | None:
    """A note where --draft names a model no method of the run drafts with: it is not loaded (a
    script runs one pair through several methods, --method none among them, so it is no error;
    nor is it checked: a name on the Hub would be downloaded). Not in chat, whose /method may
    turn to it later."""
    from specrun.drafters.methods import is_adaptive, needs_draft_model

    if draft is None or any(needs_draft_model(method) or is_adaptive(method) for method in methods):
        return None
    verb = "drafts" if len(methods) == 1 else "draft"
    return f"note: --draft {draft} is not loaded: {flag} {','.join(methods)} {verb} without a draft model"


def gpu_layers_note(gpu_layers: int | None, rpc: Sequence[str], backend: str) -> str | None:
    """A note where --gpu-layers asks for layers on a GPU that llama.cpp does not see here (and no
    --rpc server lends one): every layer runs on the CPU, as without it."""
    if not gpu_layers or rpc or backend == "mlx":
        return None
    from specrun.backends.llama import has_local_gpu

    try:
        if has_local_gpu():
            return None
    except Exception:  # noqa: BLE001 - no llama.cpp to ask: its loading says what is wrong
        return None
    return f"note: --gpu-layers {gpu_layers}: llama.cpp sees no GPU on this machine, so every layer runs on the CPU"


def check_backend(backend: str) -> None:
    """--backend auto, llama or mlx: refused before anything is said or loaded (demo and bench
    printed their pair and prompts first)."""
    from specrun.registry.loading import BACKENDS

    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}", f"use one of: {', '.join(BACKENDS)}")


def check_kv_type(kv_type: str | None, exact: bool = False) -> None:
    if kv_type is not None and kv_type not in ("f16", "f32"):
        raise UsageError(f"unknown KV cache type {kv_type!r}", "use --kv-type f16 or --kv-type f32")
    if exact and kv_type == "f16":
        raise UsageError(
            "--exact contradicts --kv-type f16: bit-identical output needs an F32 KV cache",
            "drop --kv-type f16 (or drop --exact)",
        )


def checked_flash_attn(flash_attn: str | None, exact: bool = False) -> str | None:
    """LoadOptions.flash_attn for --flash-attn: "on", "off", or None for auto (measured on a CPU:
    sessions/kernels.py; llama.cpp's choice elsewhere)."""
    if flash_attn is not None and flash_attn not in FLASH_ATTN_CHOICES:
        raise UsageError(f"unknown flash attention setting {flash_attn!r}", "use --flash-attn auto, on or off")
    if exact and flash_attn == "on":
        raise UsageError(
            "--exact contradicts --flash-attn on: bit-identical output needs flash attention off",
            "drop --flash-attn on (or drop --exact)",
        )
    return None if flash_attn in (None, "auto") else flash_attn


def check_generation_options(
    max_tokens: int, draft_len: int | None, draft_min_prob: float | None, ctx: int | None, threads: int | None
) -> None:
    """The range checks ``generate`` and ``chat`` share."""
    check_range("--max-tokens", max_tokens, 1, MAX_NEW_TOKENS)
    check_range("--draft-len", draft_len, 0, MAX_DRAFT_LEN)
    check_range("--draft-min-prob", draft_min_prob, 0.0, 1.0)
    check_range("--ctx", ctx, 16, 1 << 20)
    check_range("--threads", threads, 1, 1024)



def checked_learning(command: str, learn: bool, no_learn: bool, budget: float | None, buffer: int | None,
                     keep: bool, target: str, heads: str | None, on_note, *, labels: str | None = None):
    """The learning a command runs with (training/online.py's Learning), or None: --learn or
    --no-learn, by default on for chat and serve (they read much text of one user) and off for
    generate; --keep-learned turns it on. Usage errors for both flags, a budget or buffer out of
    range, labels unknown, or any of them given with learning off."""
    from specrun.training.learner import DEFAULT_BUFFER, DEFAULT_SHARE, LearnSettings, check_learn_settings
    from specrun.training.online import LEARN_LABELS, Learning

    if learn and no_learn:
        raise UsageError("--learn and --no-learn contradict each other", "drop one of them")
    learn = True if learn else False if no_learn else None

    if labels is not None and labels not in LEARN_LABELS:
        raise UsageError(f"unknown --learn-labels {labels!r}", f"use --learn-labels {' or '.join(LEARN_LABELS)}")

    if keep and learn is False:
        raise UsageError("--keep-learned keeps what learning learned, and --no-learn turns learning off",
                         "drop one of them")
    share = DEFAULT_SHARE if budget is None else budget
    tokens = DEFAULT_BUFFER if buffer is None else buffer
    check_learn_settings(share, tokens)
    on = learn if learn is not None else keep or command in ("chat", "serve")
    if not on:
        given = ("--learn-budget" if budget is not None else "--learn-buffer" if buffer is not None
                 else "--learn-labels" if labels is not None else None)
        if given is not None:
            raise UsageError(f"{given} shapes online learning, which is off for this run",
                             f"add --learn, or drop {given}")
        return None
    return Learning(LearnSettings(share, tokens, keep), lambda found: learned_heads_path(found, target, heads),
                    on_note, explicit=bool(learn) or keep,
                    draft_keep_path=lambda draft: learned_adapters_path(target, draft),
                    soft_labels=labels == "distributions")


def learned_adapters_path(target: str, draft) -> Path:
    """Where --keep-learned keeps a draft model's adapters, learned against ``target``: specrun's
    cache for the target, beside its heads, named for the draft."""
    from specrun.registry.heads import adapters_cache_path
    from specrun.training.online import draft_name

    return adapters_cache_path(target, draft_name(draft))


def learned_heads_path(heads, target: str, explicit: str | None) -> Path:
    """Where --keep-learned writes ``heads``: the --heads file they were read from (specrun's own
    file, or an EAGLE-3 folder), else specrun's cache for the target, which is looked in first."""
    from specrun.heads.kinds import kind_of
    from specrun.training.run import default_heads_path

    kind = kind_of(heads)
    if explicit is not None:
        given = Path(explicit).expanduser()
        if (given.suffix == ".safetensors") if kind.stored == "file" else given.is_dir():
            return given
    return default_heads_path(target, kind.name)
