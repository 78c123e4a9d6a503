"""``specrun serve``: the loaded pair behind an OpenAI-compatible HTTP API (specrun/server/)."""

from __future__ import annotations

import os
import re
import sys
from typing import Annotated, Optional

import typer

from specrun.cli.common import (
    check_backend,
    check_outputs_apart,
    check_draft_len_use,
    check_drafter_options_used,
    gpu_layers_note,
    unused_draft_note,
    check_generation_options,
    checked_learning,
    checked_flash_attn,
    check_kv_type,
    check_window_use,
    check_range,
    checked_sampling,
    listed_samplers,
    checked_reasoning_budget,
    checked_reasoning_format,
    checked_template_variables,
    checked_verification,
    checked_rpc,
    checked_lookahead,
    check_heads_used,
    checked_trees,
    cli_errors,
    uses_window,
)
from specrun.cli.options import (
    AcceptOpt,
    BackendOpt,
    BranchesOpt,
    ChainOpt,
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
    MethodOpt,
    NgramCacheOpt,
    NoLearnOpt,
    ReasoningBudgetMessageOpt,
    ReasoningBudgetOpt,
    ReasoningFormatOpt,
    ReasoningOpt,
    RegistryOpt,
    RpcOpt,
    SamplingOptions,
    ServeHostOpt,
    ServeMaxTokensOpt,
    ServePortOpt,
    ServeTraceOpt,
    SinksOpt,
    TargetOpt,
    ThreadsOpt,
    TreeNodesOpt,
    VerifyOpt,
    WindowOpt,
    takes_sampling_options,
)
from specrun.errors import UsageError

ApiKeyOpt = Annotated[
    Optional[str],
    typer.Option("--api-key", envvar="SPECRUN_API_KEY",
                 help="Require 'Authorization: Bearer KEY' on /v1 requests (or set SPECRUN_API_KEY)."),
]
AliasOpt = Annotated[Optional[list[str]], typer.Option(
    "--alias", help="A name clients may give as the model (repeatable; the first is the one /v1/models lists), "
                    "beside --target's: for clients that remember one name, such as gpt-4o.")]
CorsOpt = Annotated[Optional[list[str]], typer.Option(
    "--cors", help="Let scripts of this web origin call the server from a browser (repeatable; e.g. "
                   "http://localhost:3000; * for any page the browser opens, which --api-key then guards).")]
MaxBodyOpt = Annotated[int, typer.Option("--max-body", help="Largest request body in bytes (larger: 413).")]
MaxQueueOpt = Annotated[int, typer.Option("--max-queue", help="Requests that may wait (more: 429).")]
ParallelOpt = Annotated[str, typer.Option(
    "--parallel", help="Requests decoded together, each in a slot of its own sharing every pass (llama.cpp and "
                       "MLX; lookup, ngram, draft, heads, MTP or auto); auto (the default): up to 4 as memory "
                       "allows, 1 where a slot would draft with less (a lookahead window, trees where slots hold "
                       "none, a draft model learning with --learn) or its model cannot share a pass.")]
MAX_PARALLEL = 64


def checked_parallel(value: str) -> int | None:
    """--parallel as a number of slots, or None for auto (sessions/slots.default_slots)."""
    if value.strip().lower() == "auto":
        return None
    try:
        slots = int(value)
    except ValueError:
        raise UsageError(f"--parallel {value!r} is neither a number of slots nor auto",
                         "pass --parallel N (1-64), or --parallel auto") from None
    check_range("--parallel", slots, 1, MAX_PARALLEL)
    return slots


def checked_aliases(aliases: list[str]) -> tuple[str, ...]:
    """--alias names as a request's ``model`` may give them: printable, without spaces around."""
    for name in aliases:
        if not name.strip() or name != name.strip() or not name.isprintable():
            raise UsageError(f"--alias {name!r} is no name a client could send as its model",
                             "give a name of printable characters without spaces around it")
    return tuple(dict.fromkeys(aliases))


def checked_origins(origins: list[str]) -> tuple[str, ...]:
    """--cors origins as a browser sends them (scheme://host[:port], no path), or *."""
    for origin in origins:
        if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
            raise UsageError(f"--cors {origin!r} is not a web origin",
                             "give scheme://host[:port] without a path, e.g. --cors http://localhost:3000, or *")
    return tuple(dict.fromkeys(origins))


@takes_sampling_options(seed=False)
def serve_command(
    context: typer.Context,
    target: TargetOpt = None,
    draft: DraftOpt = None,
    backend: BackendOpt = "auto",
    method: MethodOpt = "auto",
    host: ServeHostOpt = "127.0.0.1",
    port: ServePortOpt = 8080,
    api_key: ApiKeyOpt = None,
    max_tokens: ServeMaxTokensOpt = 512,
    sampling_options: SamplingOptions = SamplingOptions(),
    draft_len: DraftLenOpt = None,
    draft_min_prob: DraftMinProbOpt = None,
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
    heads: HeadsOpt = None,
    branches: BranchesOpt = None,
    tree_nodes: TreeNodesOpt = None,
    chain_only: ChainOpt = False,
    lookahead: LookaheadOpt = None,
    max_body: MaxBodyOpt = 4 * 1024 * 1024,
    max_queue: MaxQueueOpt = 64,
    parallel: ParallelOpt = "auto",
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
    trace: ServeTraceOpt = None,
    alias: AliasOpt = None,
    cors: CorsOpt = None,
    chat_template_kwargs: ChatTemplateKwargsOpt = None,
    reasoning: ReasoningOpt = None,
    reasoning_format: ReasoningFormatOpt = "auto",
    reasoning_budget: ReasoningBudgetOpt = -1,
    reasoning_budget_message: ReasoningBudgetMessageOpt = None,
) -> None:
    """Serve the pair over an OpenAI-compatible API until Ctrl-C.

    /v1/chat/completions, /v1/completions, /v1/responses, /v1/models, /health and /metrics. --temp, --top-k,
    --top-p, --min-p and -n are the defaults of requests that do not set them."""
    with cli_errors():
        check_outputs_apart(context, "trace", "ngram_cache")
        check_backend(backend)
        aliases = checked_aliases(alias or [])
        cors_origins = checked_origins(cors or [])
        from specrun.drafters.methods import check_method, check_slots_method, needs_draft_model
        from specrun.registry.loading import LoadOptions, choose_pair
        from specrun.server.app import HttpOptions, serve
        from specrun.server.requests import ServeDefaults
        from specrun.server.worker import PairOptions
        from specrun.modelkit.selfdraft import is_window_draft

        check_method(method)
        check_generation_options(max_tokens, draft_len, draft_min_prob, ctx, threads)
        check_draft_len_use(draft_len, (method,), draft_min_prob=draft_min_prob, branches=branches,
                            tree_nodes=tree_nodes)
        check_kv_type(kv_type, exact)
        check_window_use(window, (method,), draft, sinks=sinks)
        check_drafter_options_used((method,), draft_min_prob=draft_min_prob, ngram_cache=ngram_cache)
        flash_attn = checked_flash_attn(flash_attn, exact)
        rpc_servers = checked_rpc(rpc)
        check_range("--port", port, 0, 65535)
        check_range("--max-body", max_body, 1024, 1 << 34)
        check_range("--max-queue", max_queue, 1, 1 << 20)
        parallel = checked_parallel(parallel)
        if parallel is not None and parallel > 1:
            check_slots_method(method)
            # what each option asks of a slot that a pass shared by several cannot give
            # (heads of a kind slots draft with read the target slots' hidden states, and llama.cpp's slots
            # hold trees: checked once loaded; --exact gives each sequence a cache stream a tree cannot share)
            asked = (("--branches", branches if exact else None, "drafts trees with --exact"),
                     ("--tree-nodes", tree_nodes if exact else None, "drafts trees with --exact"),
                     ("--lookahead", lookahead, "drafts with a lookahead window"),
                     ("--window", window or None, "drafts from a windowed cache"),
                     (f"--draft {draft}", True if is_window_draft(draft) else None, "drafts from a windowed cache"))
            refused = next(((name, why) for name, value, why in asked if value is not None), None)
            if refused is not None:
                given, why = refused
                raise UsageError(f"{given} {why}, which --parallel slots sharing a pass cannot do",
                                 f"leave {given} out, or serve with --parallel 1")
        sampling = checked_sampling("serve", sampling_options)
        # the list a request without its own is read with, as llama-server reads its --samplers: what
        # it leaves out is off, the temperature too (a request's would then be 1)
        listed = (listed_samplers(sampling_options.samplers, sampling)
                  if sampling_options.samplers is not None else None)
        if listed is not None and "temperature" not in listed:
            raise UsageError("--samplers leaves out temperature: a request's temperature applies only where the "
                             "list names it, as llama-server reads it", "name temperature in --samplers")
        verification = checked_verification("serve", verify, accept, epsilon, delta, margin, exact)
        template_variables = checked_template_variables(chat_template_kwargs, reasoning)
        reasoning_format = checked_reasoning_format(reasoning_format)
        budget, budget_message = checked_reasoning_budget(reasoning_budget, reasoning_budget_message, serve=True)
        lookahead_sizes = checked_lookahead(lookahead, (method,))
        check_heads_used(heads, (method,))
        trees = checked_trees(chain_only, tree_nodes, branches, lookahead_sizes, window=uses_window((method,)))
        if api_key is None and os.environ.get("SPECRUN_API_KEY") == "":  # Click reads an empty variable as unset
            raise UsageError("SPECRUN_API_KEY is set but empty: every client would be let in",
                             "set it to a key, or unset SPECRUN_API_KEY on a loopback host")
        if api_key is not None and not api_key.strip():
            raise UsageError("--api-key (or SPECRUN_API_KEY) is empty: every client would be let in",
                             "pass a key of some length, or leave it unset on a loopback host")
        if api_key is not None and api_key != api_key.strip():  # a header's value loses them: no client got in
            raise UsageError("--api-key (or SPECRUN_API_KEY) begins or ends with a space, which no client's header "
                             "can carry, so every request would be refused", "remove the spaces around the key")
        if api_key is not None and not (api_key.isascii() and api_key.isprintable()):
            raise UsageError("--api-key (or SPECRUN_API_KEY) holds characters other than printable ASCII: "
                             "HTTP headers carry ASCII, so no client could send it",
                             "choose a key of printable ASCII characters")
        for note in (unused_draft_note(draft, (method,)), gpu_layers_note(gpu_layers, rpc_servers, backend)):
            if note is not None:
                _log(note)
        target, draft = choose_pair(target, draft, registry)
        learning = checked_learning("serve", learn, no_learn, learn_budget, learn_buffer, keep_learned, target, heads,
                                    lambda note: _log(f"note: {note}"), labels=learn_labels)
        from specrun.sessions.trace import open_server_trace

        tracing = open_server_trace(trace)  # an unwritable FILE refused before anything loads
        pair = PairOptions(
            target=target,
            draft=draft if needs_draft_model(method) else None,
            method=method,
            load=LoadOptions(backend=backend, n_ctx=ctx, threads=threads, gpu_layers=gpu_layers,
                             rpc=rpc_servers, registry=registry, kv_type=kv_type,
                             flash_attn=flash_attn, exact=exact, window=window, sinks=sinks, tree_paths=trees.paths),
            draft_len=draft_len,
            draft_min_prob=draft_min_prob,
            ngram_cache=ngram_cache,
            heads=heads,
            trees=trees,
            lookahead=lookahead_sizes,
            verification=verification,
            parallel=parallel,
            learn=learning,
            trace=tracing if trace is not None else None,
        )
        http = HttpOptions(host=host, port=port, api_key=api_key, max_body_bytes=max_body,
                           max_queue=max_queue, model_names=(*aliases, target), cors_origins=cors_origins)
        with tracing:
            try:
                serve(pair, http, ServeDefaults(max_tokens, sampling, template_variables, reasoning_format, budget,
                                                budget_message, samplers=listed), log=_log)
            finally:  # the learners stop, and write the heads where asked, however the server ended
                for report in learning.finish() if learning is not None else []:
                    _log(report.summary())


def _log(line: str) -> None:
    """One line on stderr, written whole: slots' threads log side by side, and print's separate
    write of the newline let two lines run together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
