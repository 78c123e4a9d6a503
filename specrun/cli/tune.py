"""`specrun tune`: calibrate this machine for a target/draft pair and save the best settings;
with ``--draft self:layers``, search which of the target's layers its layer-skip draft keeps."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer
from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from specrun.cli.common import check_backend, PipeConsole, checked_flash_attn, check_range, checked_rpc, cli_errors
from specrun.cli.options import (
    BackendOpt,
    CtxOpt,
    DraftOpt,
    ExactOpt,
    FlashAttnOpt,
    MaxTokensOpt,
    RegistryOpt,
    RpcOpt,
    TargetOpt,
    ThreadsOpt,
    TunePromptsOpt,
)

# tokens a window search leaves free beside its prompt and --max-tokens: slack for drafts running ahead
ROOM_MARGIN = 16


def tune(
    target: TargetOpt = None,
    draft: DraftOpt = None,
    backend: BackendOpt = "auto",
    prompts: TunePromptsOpt = 4,
    max_tokens: MaxTokensOpt = 64,
    threads: ThreadsOpt = None,
    ctx: CtxOpt = None,
    rpc: RpcOpt = None,
    flash_attn: FlashAttnOpt = None,
    exact: ExactOpt = False,
    registry: RegistryOpt = None,
    show: Annotated[bool, typer.Option("--show", help="Print the saved settings and exit.")] = False,
    budget: Annotated[
        Optional[int],
        typer.Option("--budget", help="With --draft self:layers: seconds the layer search may take (default 120)."),
    ] = None,
    window_search: Annotated[
        bool,
        typer.Option("--window-search", help="Also time the draft model reading windowed caches (its first 4 tokens "
                     "and the last 128-1024) against its full cache after a long prompt (--window-context), and keep "
                     "the fastest: later runs that leave --window out draft with it."),
    ] = False,
    window_context: Annotated[
        Optional[int],
        typer.Option("--window-context", help="With --window-search: the prompt's tokens (default 4096, at most the "
                     "context less --max-tokens)."),
    ] = None,
    sinks: Annotated[Optional[int], typer.Option(
        "--sinks", help="With --window-search: the context's first tokens every windowed cache keeps (default 4)."
    )] = None,
) -> None:
    """Measure plain decoding, each draft length and confidence stops on this machine; later runs start from them.

    With --draft self:layers (MLX targets): search which of the target's layers its
    layer-skip draft keeps, within --budget seconds; --draft self:layers then uses them.
    --flash-attn and --exact tune for runs with those settings (their costs differ). On a
    CPU, llama.cpp's flash attention is timed after 4,096 tokens too (once per model and machine),
    so that long runs and requests choose by it rather than wait for it."""
    with cli_errors():
        check_backend(backend)
        from specrun.errors import UsageError
        from specrun.modelkit.layer_choice import load_choices
        from specrun.modelkit.selfdraft import is_tuned_layer_draft
        from specrun.registry.loading import LoadOptions
        from specrun.sessions import layer_search, tuning, window_tuning

        out = PipeConsole(file=sys.stdout)
        if show:
            given = [flag for flag, value in (("--target", target), ("--draft", draft)) if value is not None]
            if given:  # it printed every pair, the one named or not, exit 0
                raise UsageError(f"--show prints every pair's saved settings; it takes no {given[0]}",
                                 f"leave {given[0]} out")
            results, choices = tuning.load_all(), load_choices()  # both read before anything is printed
            if not results and not choices:  # it printed a heading over nothing
                out.print("no tuned settings on this machine yet: `specrun tune --target MODEL --draft DRAFT` "
                          "measures a pair and saves its settings")
                return
            if results or not choices:
                out.print(render(results))
            if choices:
                out.print(render_layer_choices(choices))
            return
        check_range("--prompts", prompts, 1, 50)
        check_range("--max-tokens", max_tokens, 8, 4096)
        check_range("--threads", threads, 1, 1024)  # before anything is timed or saved under it
        check_range("--ctx", ctx, 16, 1 << 20)
        rpc_servers = checked_rpc(rpc)
        flash_attn = checked_flash_attn(flash_attn, exact)
        if is_tuned_layer_draft(draft):
            if rpc_servers:
                raise UsageError("--rpc sends the target to llama.cpp, and the layer search runs on MLX",
                                 "drop --rpc")
            check_range("--budget", budget, layer_search.MIN_BUDGET, layer_search.MAX_BUDGET)
            choice, path = run_layer_search(target, backend, prompts, max_tokens, budget, registry)
            out.print(render_layer_choices([choice]))
            typer.echo(f"saved to {path}", err=True)
            return
        if budget is not None:
            raise UsageError("--budget is the layer search's (--draft self:layers)", "drop --budget")
        for given, value in (("--window-context", window_context), ("--sinks", sinks)):
            if value is not None and not window_search:
                raise UsageError(f"{given} sizes the window search, which is off", "add --window-search")
        if window_context is not None:
            check_range("--window-context", window_context, 256, 1 << 20)
        if sinks is not None:
            check_range("--sinks", sinks, 1, 1024)  # none at all: attention loses what it leans on
        load = LoadOptions(backend=backend, threads=threads, registry=registry, rpc=rpc_servers,
                           flash_attn=flash_attn, exact=exact, n_ctx=ctx)
        search = (window_context or window_tuning.DEFAULT_CONTEXT) if window_search else None
        results = run_tune(target, draft, prompts, max_tokens, load, search, sinks,
                           context_given=window_context is not None)
        for result in results:
            path = tuning.save(result)
        out.print(render(results))
        typer.echo(f"saved to {path}", err=True)


def run_tune(target, draft, n_prompts, max_tokens, load, window_context: int | None = None,
             sinks: int | None = None, context_given: bool = False) -> list:
    """The pair's tune entries: its calibration; with a window search, the entry long runs read
    too (``with_window``: under its own key where their kernels differ, else in the same one)."""
    from specrun.sessions import tuning
    from specrun.errors import UsageError
    from specrun.registry.loading import choose_pair
    from specrun.sessions.kernels import measure_deep, open_settled_pair
    from specrun.sessions.prompts import CODE_PROMPTS

    target, draft = choose_pair(target, draft, load.registry)
    if draft is None:
        raise UsageError(f"no draft model for {target}", "pass --draft MODEL")
    err = Console(stderr=True)
    target_backend, draft_backend = open_settled_pair(target, draft, load,
                                                      lambda note: err.print(f"note: {note}", highlight=False))
    try:
        # what long runs and requests read rather than wait for (sessions/kernels.py)
        measure_deep((target_backend, draft_backend), load, lambda note: err.print(f"note: {note}", highlight=False))
        prompts = [target_backend.tokenize(text) for text in CODE_PROMPTS[:n_prompts]]
        key = tuning.pair_key(target_backend, draft_backend, load.threads)
        result = tuning.calibrate(
            target_backend,
            draft_backend,
            prompts,
            max_tokens,
            key,
            on_progress=lambda round_number, done, total: err.print(
                f"round {round_number}: calibrated {done}/{total} prompts"
            ),
        )
        if window_context is None:
            return [result]
        windowed = with_window(result, target_backend, draft_backend, window_context, max_tokens, err, load, sinks,
                               context_given)
        return [windowed] if windowed.key == result.key else [result, windowed]
    finally:
        target_backend.close()
        draft_backend.close()


def with_window(result, target, draft, context: int, max_tokens: int, err, load, sinks: int | None = None,
                context_given: bool = False):
    """``result`` with the windowed cache the draft drafts fastest with after ``context`` tokens
    (sessions/window_tuning.py), at most the context less ``max_tokens``, keeping ``sinks`` first
    tokens (None: StreamingLLM's 4, then the other counts of SINK_CANDIDATES at the window kept).
    The search runs on the kernels a run reaching that context settles on (flash attention by the
    deep probe, sessions/kernels.py), and the result is keyed as such a run looks it up: where
    they differ from calibration's, a long run would otherwise never find the window. A
    ``context_given`` (--window-context) the context cannot hold is said as it is cut."""
    import dataclasses

    from specrun.backends.kv import sequence_for
    from specrun.backends.window import SINKS
    from specrun.errors import UsageError
    from specrun.sessions import tuning
    from specrun.sessions.kernels import settle_pair
    from specrun.sessions.window_tuning import SINK_CANDIDATES, long_prompt, search_window

    room = min(target.n_ctx, draft.n_ctx) - max_tokens - ROOM_MARGIN
    if room < 256 or not hasattr(draft, "open_window"):
        why = (f"a context of {target.n_ctx} leaves no long prompt" if room < 256
               else f"the {draft.name} backend keeps no windowed cache")
        raise UsageError(f"--window-search times windowed caches after a long prompt, and {why}",
                         "pass --ctx 8192 (or more), or drop --window-search")
    if context_given and context > room:
        err.print(f"note: --window-context {context} is more than a context of {min(target.n_ctx, draft.n_ctx)} "
                  f"holds beside --max-tokens {max_tokens} and {ROOM_MARGIN} tokens of margin: searching after "
                  f"{room:,} tokens (pass a larger --ctx for more)", highlight=False)
    prompt = long_prompt(target, min(context, room))
    for backend in (target, draft):
        sequence_for(backend).reset()  # flash attention is chosen with an empty cache
    settle_pair(target, draft, load, lambda note: err.print(f"note: {note}", highlight=False),
                len(prompt) + max_tokens, again=True)
    result = dataclasses.replace(result, key=tuning.pair_key(target, draft, load.threads),
                                 target=tuning.model_id(target), draft=tuning.model_id(draft))
    searched = [count for count in SINK_CANDIDATES if count != SINKS] if sinks is None else []
    err.print(f"window search: {len(prompt):,} tokens of prompt; full cache, windows 128-1024, "
              f"{SINKS if sinks is None else sinks} sinks", highlight=False)
    if searched:
        err.print(f"window search: then {' and '.join(map(str, searched))} sinks, if a window wins", highlight=False)
    choice = search_window(target, draft, prompt, max_tokens, result.best_draft_len or 4,
                           sinks=SINKS if sinks is None else sinks, sink_candidates=SINK_CANDIDATES if searched else (),
                           on_progress=lambda stage, done, total: err.print(f"{stage} search: round {done}/{total}"))
    rates = ", ".join(f"{name} {rate:.1f}" for name, rate in choice.rates.items())
    err.print(f"window search (tok/s after {choice.context:,} tokens): {rates}", highlight=False)
    return dataclasses.replace(result, window=choice.window, window_sinks=choice.sinks if choice.window else 0,
                               window_context=choice.context, window_speedup=choice.speedup)


def run_layer_search(target, backend, n_prompts, max_tokens, budget, registry):
    """Search the target's layers for its layer draft; the saved choice and where it was saved."""
    from specrun.modelkit.layer_choice import save_choice
    from specrun.registry.loading import DEFAULT_TARGET, LoadOptions, check_layer_target, open_backend
    from specrun.sessions import layer_search
    from specrun.sessions.prompts import CODE_PROMPTS

    target = target or DEFAULT_TARGET
    target_backend = open_backend(target, LoadOptions(backend=backend, registry=registry))
    err = Console(stderr=True)
    try:
        check_layer_target(target_backend, "self:layers")
        prompts = [target_backend.tokenize(text) for text in CODE_PROMPTS[:n_prompts]]
        budget = layer_search.DEFAULT_BUDGET if budget is None else budget
        err.print(f"searching which of {target}'s {target_backend.n_layers} layers its draft keeps "
                  f"(budget {budget:g} s)")
        choice, search = layer_search.tune_layers(target_backend, prompts, max_tokens, budget, target,
                                                  on_progress=err.print)
    finally:
        target_backend.close()
    ending = "down to one layer" if search.finished else "stopped at the budget"
    err.print(f"searched {search.searched} sets in {search.rounds} rounds ({search.seconds:.0f} s, {ending}); "
              f"the fewest layers scored: {search.fewest}")
    return choice, save_choice(choice)


def render_layer_choices(choices) -> Group:
    """Each saved layer choice: the layers, their agreement, modeled and measured speed-ups."""
    from specrun.modelkit.layer_choice import layer_ranges

    blocks: list = [Text("tuned layer choices (specrun tune --draft self:layers)", style="bold")]
    for choice in choices:
        plain, drafted = choice.tokens_per_second.get("none"), choice.tokens_per_second.get(
            f"draft k={choice.draft_len}")
        blocks.append(Text(f"\n{choice.target}", style="bold"))
        blocks.append(Text(f"  machine {choice.machine}"))
        blocks.append(Text(f"  keeps {len(choice.kept)} of {choice.n_layers} layers: {layer_ranges(choice.kept)}"))
        blocks.append(Text(f"  agreement {100 * choice.agreement:.0f}% on the calibration text; modeled speed-up "
                           f"{choice.modeled_speedup:.2f}× at draft length {choice.draft_len} "
                           "(a draft token's cost timed here: the head's share and each kept layer's)"))
        rates = f" ({drafted:.1f} against {plain:.1f} tok/s)" if plain and drafted else ""
        blocks.append(Text(f"  measured against plain decoding: {choice.measured_speedup:.2f}×{rates}"))
        if choice.measured_speedup < 1.0:
            blocks.append(Text("  plain decoding was faster here: with these layers, --draft self:layers cannot "
                               "speed generation up on this machine", style="yellow"))
        blocks.append(Text(f"  searched {choice.searched} sets in {choice.seconds:.0f} s"))
    return Group(*blocks)


def _model_shown(model_id: str) -> str:
    """A tuned model as a reader names it: its file, with what else tells its entry apart (flash
    attention, a layer draft's layers), not the file size its key holds."""
    name, _, variant = model_id.partition("|")
    shown = name.rsplit(":", 1)[0] if name.rsplit(":", 1)[-1].isdigit() else name
    if variant.startswith("flash="):
        return f"{shown} (flash attention {variant.removeprefix('flash=')})"
    return f"{shown} ({variant})" if variant else shown


def _round_one_best(rates: dict[str, float]) -> tuple[str, float] | None:
    """Round 1's fastest draft length and its ratio to round 1's plain decoding, where it beat it."""
    from specrun.sessions.tuning import baseline_of

    plain = rates.get("none")
    first = {name: rate for name, rate in rates.items() if name != "none" and baseline_of(name) == "none"}
    if not plain or not first:
        return None
    name = max(first, key=first.get)
    return (name, first[name] / plain) if first[name] > plain else None


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
        blocks.append(Text(f"\n{_model_shown(result.target)}  +  {_model_shown(result.draft)}", style="bold"))
        blocks.append(Text(f"  machine {result.machine}"))
        blocks.append(Text(f"  best fixed draft length (-k) {best}, confidence stop {stop}, speed-up {result.speedup:.2f}×"))
        if not result.best_draft_len and (round_one := _round_one_best(result.tokens_per_second)) is not None:
            name, ratio = round_one
            blocks.append(Text(f"  ({name} read {ratio:.2f}× in round 1, but not when timed again beside plain "
                               "decoding in round 2, which decides)"))
        blocks.append(Text(f"  draft tokens accepted {acceptance}"))
        if result.window_context:
            kept = (f"its first {result.window_sinks} tokens and the last {result.window}, "
                    f"{result.window_speedup:.2f}× the full cache" if result.window else "its full cache (no window beat every round of it)")
            blocks.append(Text(f"  draft cache after {result.window_context:,} tokens: {kept}"))
        if result.target_per_context or result.draft_per_context:
            blocks.append(Text(f"  1,000 more tokens of context: +{1e6 * result.target_per_context:.1f} ms a target "
                               f"pass, +{1e6 * result.draft_per_context:.1f} ms a step drafting "
                               f"{result.best_draft_len or 4} tokens (later runs weigh drafting at the context "
                               "they reach)"))
        if result.acceptance_by_position:
            curve = " ".join(f"{100 * share:.0f}%" for _, share in sorted(result.acceptance_by_position.items()))
            blocks.append(Text(f"  accepted by draft position (the ones before it accepted): {curve}"))
        table = Table(box=box.SIMPLE_HEAD, padding=(0, 1))
        table.add_column("setting")
        table.add_column("tok/s", justify="right")
        table.add_column("vs none", justify="right")
        for name, rate in result.tokens_per_second.items():
            plain = result.tokens_per_second.get(baseline_of(name))
            table.add_row(name, f"{rate:.0f}", f"{rate / plain:.2f}×" if plain else "–")
        blocks.append(table)
    return Group(*blocks)
