"""Load the pair once, run every method on every prompt interleaved, keep every raw figure.

Timing is generation only (prefill excluded), as specrun's Stats measure it. The
baseline is plain decoding (``none``) through the same engine, so speed-ups compare
like with like.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Protocol

from specrun.backends.base import Backend
from specrun.bench.machine import machine_info
from specrun.bench.suite import BenchPrompt
from specrun.sessions.compare import Comparison, Variant, compare_variants
from specrun.engine.events import GenerationResult
from specrun.engine.loop import GenerationParams
from specrun.engine.passes import Verification
from specrun.errors import UsageError
from specrun.sessions.heads import comparison_heads
from specrun.sessions.trace import TraceFile
from specrun.sessions.setup import (
    ctx_fix,
    ADAPTIVE_MAX_DRAFT_LEN,
    DEFAULT_DRAFT_LEN,
    TreeChoice,
    TreeSettings,
    adapts_length,
    check_trees_for,
    load_tuned,
    resolve_min_prob,
    tuned_window,
)
from specrun.sessions import setup
from specrun.control.forecasts import SizeChoice
from specrun.sessions.tuning import TuneResult
from specrun.registry.loading import LoadOptions, open_pair, prompts_as_chat
from specrun.sessions.kernels import settle_pair
from specrun.drafters.lookahead import LookaheadSizes
from specrun.drafters.methods import is_adaptive, needs_draft_model, uses_lookahead
from specrun.sampling import SamplingSettings

BASELINE = "none"


@dataclass(frozen=True)
class BenchConfig:
    """Everything that decides what a bench measures.

    methods: the baseline ``none`` first. draft_lens: one draft length, or several for
    a sweep (every method but auto then runs at each, fixed); empty: each method as
    `specrun generate` runs it (adaptive, up to ``adaptive_draft_len``).
    draft_min_prob: the draft model's confidence stop; None: generate's (tune's, else
    none). adaptive_draft_len: the longest draft an adaptive line may choose; it is not
    swept. chat: wrap each prompt as a user message in the target's chat template (None:
    as `specrun generate` decides, see ``prompts_as_chat``). suite: ``builtin`` or the
    JSONL path. use_tuned: controllers start from what `specrun tune` saved for the pair
    on this machine, as `specrun generate` does (False: from their priors).
    """

    target: str
    draft: str | None
    methods: tuple[str, ...]
    draft_lens: tuple[int, ...] = ()
    adaptive_draft_len: int = ADAPTIVE_MAX_DRAFT_LEN
    draft_min_prob: float | None = None  # the draft model's confidence stop, for every method with a draft
    max_new_tokens: int = 128
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    repeat: int = 1
    chat: bool | None = None
    template_variables: dict = field(default_factory=dict)  # --chat-template-kwargs, --reasoning
    suite: str = "builtin"
    load: LoadOptions = field(default_factory=LoadOptions)
    use_tuned: bool = True
    native: bool = False  # also run the backend's own plain loop beside the methods (a second model copy)
    heads: str | None = None  # --heads: the head methods' heads file (None: found by the target's alias)
    trees: TreeSettings = field(default_factory=TreeSettings)  # token trees (--tree-nodes, --branches); chains
    # --lookahead: the lookahead method's sizes (None: chosen from the target's pass costs, as generate
    # does; the result's config records the choice)
    lookahead: LookaheadSizes | None = None
    # --verify and --accept: how the lines that draft verify (exact by default; a lossy rule's texts
    # are then measured against the target's own: sessions/compare.py, TextQuality)
    verification: Verification = field(default_factory=Verification)

    @property
    def sweep(self) -> bool:
        return len(self.draft_lens) > 1

    def variants(self) -> list[Variant]:
        """The compared lines: the baseline, then each method at each draft length given,
        or (none given) adaptive as `specrun generate` runs it; auto always adaptive."""
        lines = [Variant(BASELINE, BASELINE, 0)]
        for method in self.methods:
            if method == BASELINE:
                continue
            if is_adaptive(method) or (not self.draft_lens and adapts_length(method, None)):
                lines.append(Variant(method, method, self.adaptive_draft_len, adaptive=True))
                continue
            for draft_len in self.draft_lens:
                name = f"{method} k={draft_len}" if self.sweep else method
                lines.append(Variant(name, method, draft_len))
        return lines


@dataclass(frozen=True)
class SkippedPrompt:
    prompt: BenchPrompt
    reason: str


@dataclass
class BenchResult:
    """A finished bench: ``prompts[i]`` is prompt index i of ``comparison``."""

    config: BenchConfig
    prompts: list[BenchPrompt]
    prompt_tokens: list[int]
    skipped: list[SkippedPrompt]
    comparison: Comparison
    machine: dict
    n_ctx: int
    started_at: str
    wall_seconds: float
    tuned: str | None = None  # the `specrun tune` key the controllers started from, if any
    draft_min_prob: float = 0.0  # the confidence stop the draft model ran with (config's, or tune's)
    # the target's flash attention: "on", "off", or "auto" (llama.cpp's choice: GPUs, MLX)
    flash_attn: str = "auto"
    notes: tuple[str, ...] = ()  # what the run measured of this machine first (sessions/kernels.py)
    tuned_by_runs: bool = False  # ``tuned`` is what earlier runs measured (learned.json), not `specrun tune`

    @property
    def exact(self) -> bool:
        """Run under --exact: output was promised bit-identical, so any difference is a defect."""
        return self.config.load.exact

    def category_indices(self) -> dict[str, list[int]]:
        """Prompt indices by category, categories in order of first appearance."""
        indices: dict[str, list[int]] = {}
        for index, prompt in enumerate(self.prompts):
            indices.setdefault(prompt.category, []).append(index)
        return indices


class Progress(Protocol):
    """What the front end is told while a bench runs."""

    def start(self, total_runs: int) -> None: ...

    def advance(self, prompt: BenchPrompt, variant: str) -> None: ...


def run_bench(config: BenchConfig, prompts: Sequence[BenchPrompt], progress: Progress | None = None,
              trace: TraceFile | None = None) -> BenchResult:
    """Load the pair, run the bench and close the models again; ``trace``: every run's steps
    (`bench --trace`, sessions/trace.py)."""
    if not prompts:
        raise UsageError("no prompts to run", "check --categories and --per-category")
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    wall_start = time.perf_counter()
    uses_draft = any(needs_draft_model(m) for m in config.methods)
    notes: list[str] = []
    target, draft = open_pair(config.target, config.draft if uses_draft else None, config.load, notes.append)
    try:
        chat = prompts_as_chat(config.target, config.load.registry, target, config.chat)
        config = dataclasses.replace(config, chat=chat)  # the result records what was done
        tokenized = [tokenize_prompt(target, p, config.chat, config.template_variables) for p in prompts]
        kept, skipped = _fit_context(prompts, tokenized, target.n_ctx, config.max_new_tokens)
        if not kept:
            raise UsageError(
                f"no prompt fits the context of {target.n_ctx} tokens with {config.max_new_tokens} new tokens",
                ctx_fix(target, "lower -n or leave the longest prompts out"),
            )
        # flash attention chosen for the context the longest prompt reaches, as generate chooses it
        reached = max(len(ids) for _, ids in kept) + config.max_new_tokens
        settle_pair(target, draft, config.load, notes.append, reached)
        tuned = load_tuned(target, draft, config.load.threads) if config.use_tuned else None
        draft = tuned_window(draft, tuned, config.load, notes.append)  # the draft cache tune kept, as generate's
        variants = config.variants()
        min_prob = resolve_min_prob(config.draft_min_prob, tuned)
        # auto's heads where they pay by the stored costs, as generate's (its own entry where it has no draft)
        stored = tuned if tuned is not None or not config.use_tuned else setup.load_target_entry(
            target, config.load.threads)
        with_heads = comparison_heads(config.target, config.heads, target, config.methods, config.load.registry,
                                      stored, notes.append)
        if with_heads.auto_heads is not None:
            notes.append(f"auto drafts with the target's {with_heads.auto_heads} heads too")
        if config.lookahead is None and any(uses_lookahead(method) for method in config.methods):
            config = dataclasses.replace(config, lookahead=chosen_window(target, config, kept[0][1]))
        window = auto_window_for(target, draft, config)
        if window is not None:  # auto drafts with a window too, as `specrun generate` would here
            notes.append(f"auto drafts with a {window.describe()}")
            config = dataclasses.replace(config, lookahead=config.lookahead or window.sizes)
            # and its controllers start from the target's stored costs, as generate's do
            tuned = setup.load_target_entry(target, config.load.threads)
        else:
            trees = default_trees_for(target, draft, tuned, config)
            if trees is not None:  # second guesses, as `specrun generate` would open them here
                notes.append(trees.describe())
                config = dataclasses.replace(config, trees=trees.trees)
        for method in config.methods:
            check_trees_for(method, target, config.lookahead)
        if progress is not None:
            progress.start(len(kept) * len(variants) * config.repeat)
        native = target.native_loop() if config.native else None
        try:
            comparison = compare_variants(
                target,
                draft,
                [ids for _, ids in kept],
                variants,
                # each variant sets its own draft length
                GenerationParams(config.max_new_tokens, DEFAULT_DRAFT_LEN, config.sampling,
                                 tree_nodes=max(config.trees.nodes, window.sizes.max_nodes if window else 0)),
                repeat=config.repeat,
                on_result=_reporter(progress, [p for p, _ in kept]),
                drafter_options=dataclasses.replace(
                    with_heads, draft_min_prob=min_prob, branches=config.trees.branches, lookahead=config.lookahead,
                    auto_lookahead=window is not None,
                ),
                tuned=tuned,
                native=native,
                verification=config.verification,
                # auto's window beside the draft's full cache, one for each auto line, as generate's
                draft_window=lambda: setup.auto_draft_window(
                    "auto", draft, tuned if config.use_tuned else None, config.load.window,
                    max(len(ids) for _, ids in kept)),
                trace=trace,
            )
        finally:
            if native is not None:
                native.close()  # a second copy of the model: freed before anything else runs
        machine = machine_info(_backend_name(target), _threads(target, config.load))
        n_ctx = target.n_ctx
        flash = getattr(target, "flash_attn", None)
        flash_attn = "auto" if flash is None else ("on" if flash else "off")
    finally:
        target.close()
        if draft is not None:
            draft.close()
    return BenchResult(
        config,
        [p for p, _ in kept],
        [len(ids) for _, ids in kept],
        skipped,
        comparison,
        machine,
        n_ctx,
        started_at,
        time.perf_counter() - wall_start,
        tuned.key if tuned is not None else None,
        min_prob,
        flash_attn,
        tuple(notes),
        tuned_by_runs=tuned is not None and tuned.learned,
    )


def auto_window_for(target: Backend, draft: Backend | None, config: BenchConfig) -> SizeChoice | None:
    """The lookahead window the ``auto`` line drafts with (a sizing choice), or None: as in
    `specrun generate`, without a draft model, unless --chain or --untuned, where the pass costs
    earlier runs stored predict one pays (sessions/setup.auto_window)."""
    from specrun.control.forecasts import fitting
    from specrun.sessions.lookahead_sizing import stored_costs

    if draft is not None or config.trees.chain or not config.use_tuned or "auto" not in config.methods:
        return None
    costs = stored_costs(setup.load_target_entry(target, config.load.threads))
    return setup.auto_window("auto", target, costs, fitting(config.trees.nodes, target.tree_support.max_paths))


def default_trees_for(target: Backend, draft: Backend | None, tuned: TuneResult | None,
                      config: BenchConfig) -> TreeChoice | None:
    """Token trees the lines draft where none were asked, as `specrun generate` opens them
    (sessions/setup.default_trees: where the stored pass costs predict they pay), or
    None; never --untuned (no stored costs are read)."""
    if not config.use_tuned:
        return None
    method = next((m for m in config.methods if m != "none" and not uses_lookahead(m)), "none")
    stored = tuned if draft is not None else setup.load_target_entry(target, config.load.threads)
    return setup.default_trees(method, target, stored, config.trees)


def chosen_window(target: Backend, config: BenchConfig, prompt_ids: list[int]) -> LookaheadSizes:
    """Lookahead's sizes as `specrun generate` chooses them for this target: from the pass costs
    earlier runs stored (unless --untuned), else from a probe of a few passes after the start
    of ``prompt_ids``; within the tree nodes the target was opened for."""
    from specrun.control.forecasts import fitting
    from specrun.sessions.setup import choose_window, load_target_entry
    from specrun.sessions.lookahead_sizing import stored_costs

    stored = load_target_entry(target, config.load.threads) if config.use_tuned else None
    costs = stored_costs(stored)
    fits = fitting(config.trees.nodes, target.tree_support.max_paths)
    return choose_window(target, costs, fits, prompt_ids).sizes


def tokenize_prompt(target: Backend, prompt: BenchPrompt, chat: bool, variables: dict | None = None) -> list[int]:
    """The prompt's token ids: its raw text, or one user message in the target's chat template
    (``variables``: the template's own)."""
    from specrun.sessions.setup import prompt_token_ids

    return prompt_token_ids(target, prompt.text, chat, variables)


def _fit_context(
    prompts: Sequence[BenchPrompt], tokenized: list[list[int]], n_ctx: int, max_new_tokens: int
) -> tuple[list[tuple[BenchPrompt, list[int]]], list[SkippedPrompt]]:
    """Split prompts into those with room for every new token and those skipped (with why)."""
    kept, skipped = [], []
    for prompt, ids in zip(prompts, tokenized):
        if len(ids) + max_new_tokens > n_ctx:
            reason = f"{len(ids)} prompt tokens + {max_new_tokens} new tokens exceed the context of {n_ctx}"
            skipped.append(SkippedPrompt(prompt, reason))
        else:
            kept.append((prompt, ids))
    return kept, skipped


def _reporter(progress: Progress | None, prompts: list[BenchPrompt]):
    def on_result(index: int, variant: str, result: GenerationResult) -> None:
        if progress is not None:
            progress.advance(prompts[index], variant)

    return on_result


def _backend_name(target: Backend) -> str:
    """'llama' or 'mlx', from the module the backend class lives in."""
    return type(target).__module__.rsplit(".", 1)[-1]


def _threads(target: Backend, load: LoadOptions) -> int | None:
    """CPU threads the backend was given (None where the backend does not take a count)."""
    if load.threads:
        return load.threads
    if _backend_name(target) == "llama":
        from specrun.backends.llama import default_threads

        return default_threads()
    return None
