"""One-shot generation: the library function behind ``specrun generate``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specrun.engine.loop import (
    DEFAULT_TREE_NODES, TIE_MARGIN, Finished, GenerationParams, GenerationResult, SpeculativeEngine, TextChunk,
    check_prompt,
)
from specrun.registry.loading import LoadOptions, open_pair, prompts_as_chat
from specrun.sessions.kernels import settle_pair
from specrun.drafters.methods import (
    AUTO_HEADS_ORDER,
    DrafterOptions,
    build_drafter,
    heads_kind,
    heads_of_kind,
    is_adaptive,
    needs_draft_model,
    needs_heads,
    uses_lookahead,
)
from specrun.drafters.lookahead import LADDER, LookaheadSizes
from specrun.control.adaptive import SpeculationGate
from specrun.errors import AnswerKeptError, SpecrunError, UsageError
from specrun.sampling import SamplingSettings


# Token trees, once asked for (--tree-nodes or --branches): the second guesses a drafter may add.
DEFAULT_BRANCHES = 4


@dataclass(frozen=True)
class TreeSettings:
    """A run's token trees: ``nodes``, the most drafted tokens a verify pass holds (0: chains);
    ``branches``, the second guesses a drafter may add beside its chain."""

    nodes: int = 0
    branches: int = 0
    min_paths: int = 0  # paths a lookahead window and its candidates bring, whatever ``branches`` says
    chain: bool = False  # --chain: never trees, not even a window auto would add

    @property
    def paths(self) -> int:
        """Root-to-leaf paths a tree may have: the chain's and one per second guess, or what a
        lookahead tree brings if more (0: chains)."""
        if not self.nodes:
            return 0
        return max(self.branches + 1 if self.branches else 0, self.min_paths)


def resolve_trees(
    chain: bool, tree_nodes: int | None, branches: int | None, lookahead: LookaheadSizes | None = None
) -> TreeSettings:
    """Chains unless --tree-nodes or --branches asks for trees (measured on this CPU, a pass's
    every extra token costs most of a plain step, so trees rarely pay: docs/perf.md; once the
    target is open, ``default_trees`` may still open them where stored costs say so), or a
    method drafts with a lookahead window (``lookahead``, its sizes): the window is a tree, so
    the pass holds at least its nodes and paths."""
    asked = tree_nodes is not None or bool(branches)  # trees the user asked for
    if chain or not (asked or lookahead is not None):
        return TreeSettings(chain=chain)
    asked_trees = TreeSettings()
    if asked:
        asked_trees = TreeSettings(tree_nodes or DEFAULT_TREE_NODES, DEFAULT_BRANCHES if branches is None else branches)
    if lookahead is None:
        return asked_trees
    return TreeSettings(max(asked_trees.nodes, lookahead.max_nodes), asked_trees.branches,
                        lookahead.window + lookahead.candidates)


def window_room(lookahead: LookaheadSizes | None, tree_nodes: int | None = None) -> LookaheadSizes:
    """The window a target is opened for: ``lookahead``, the sizes the user gave, else the widest
    of the sizes lookahead may choose from (the choice is made once the target is loaded: its
    pass costs decide) that ``tree_nodes`` (--tree-nodes) holds."""
    if lookahead is not None:
        return lookahead
    fitting = [sizes for sizes in LADDER if tree_nodes is None or sizes.max_nodes <= tree_nodes]
    return fitting[-1] if fitting else LADDER[0]


def method_trees(method: str, lookahead: LookaheadSizes | None = None) -> TreeSettings:
    """The trees a target must hold for ``method`` where no option asks for trees: a lookahead
    window's (``lookahead``, else room for any size it may choose), else none (chains)."""
    if not uses_lookahead(method):
        return TreeSettings()
    return resolve_trees(False, None, None, window_room(lookahead))


def check_trees_for(method: str, target, lookahead: LookaheadSizes | None = None) -> None:
    """A UsageError where ``method`` drafts with a lookahead window and ``target`` cannot verify
    its tree (a model whose cache holds no trees, or a llama.cpp context opened for fewer paths):
    verified as a chain, its window would learn nothing and every pass would cost more for it."""
    needed = method_trees(method, lookahead or LADDER[0]).paths
    if not needed:
        return
    support = target.tree_support
    if not support.available:
        raise UsageError(f"method {method!r} verifies a token tree, and this target cannot: {support.reason}",
                         "pick another --method")
    if support.max_paths and support.max_paths < needed:
        raise UsageError(f"method {method!r} verifies a token tree of up to {needed} paths, and this target "
                         f"was opened for {support.max_paths}", f"start with --method {method}")


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    target: str
    draft: str | None
    method: str = "auto"
    max_new_tokens: int = 128
    draft_len: int | None = None  # None: chosen each step (adaptive), up to 16
    draft_min_prob: float | None = None  # None: the tuned confidence stop, else none
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    load: LoadOptions = field(default_factory=LoadOptions)
    drafter_options: DrafterOptions = field(default_factory=DrafterOptions)
    chat: bool | None = None  # the prompt as a user message in the chat template; None: see prompts_as_chat
    trees: TreeSettings = field(default_factory=TreeSettings)
    heads: str | None = None  # --heads: the heads file a head method drafts with (None: found by alias)
    on_note: Callable[[str], None] | None = None  # one-line notes for the user (stderr in the CLI)


DEFAULT_DRAFT_LEN = 4
# The longest draft auto may choose. Its controller picks the length from measured acceptance
# and costs, so the cap only matters where long drafts pay: a copy that lookup gets right on
# every token. There 16 against 8 measured +10% on the built-in chat and qa prompts (A/B,
# 3 repeats, tiny regime; docs/perf.md); where passes are memory-bound (a GPU, not measured
# here) 16 tokens should cost little more than 1. Elsewhere the controller stays short.
ADAPTIVE_MAX_DRAFT_LEN = 16


DEFAULT_DRAFT_MIN_PROB = 0.0

def load_tuned(target, draft, threads):
    """Settings saved by `specrun tune` for this pair on this machine; else what earlier
    runs of the pair learned (``tuning.learn_from_run``); else None."""
    if draft is None:
        return None
    from specrun.sessions import tuning

    key = tuning.pair_key(target, draft, threads)
    return tuning.load(key) or tuning.load(key, tuning.learned_path())


def load_target_entry(target, threads):
    """What earlier runs of ``target`` with no draft model learned on this machine (its pass
    costs, its gate), or None."""
    from specrun.sessions import tuning

    return tuning.load(tuning.pair_key(target, None, threads), tuning.learned_path())


def remember_run(engine, target, draft, threads, tuned) -> None:
    """Keep what this run measured for the next (unless `specrun tune` calibrated the pair);
    a run with no draft model keeps the target's pass costs and its gate, for lookahead."""
    if engine.drafter is None or (tuned is not None and not tuned.learned):
        return
    from specrun.sessions import tuning

    learned = tuning.learn_from_run(engine, target, draft, tuning.pair_key(target, draft, threads), tuned)
    if learned is None:
        return
    try:
        tuning.save(learned, tuning.learned_path())
    except SpecrunError:
        # A full disk or a read-only config folder: what a run learned is a cache of its
        # measurements (the next run measures again), never worth the answer; nothing is
        # half-written (write_atomically).
        pass


def choose_window(target, costs: dict[int, float] | None, fits, prompt_ids: list[int]):
    """Lookahead's sizes (a SizeChoice) from ``costs`` (earlier runs'), else from a probe of the
    target's passes after the start of ``prompt_ids``."""
    from specrun.sessions import lookahead_sizing as sizing
    from specrun.sessions.tuning import time_passes

    if costs is None:
        probe = prompt_ids[:sizing.PROBE_CONTEXT]
        costs = sizing.probe_costs(lambda counts: time_passes(target, probe, counts, sizing.PROBE_REPEATS), fits)
    return sizing.choose(costs, fits)


def size_lookahead(method: str, target, options: DrafterOptions, params: GenerationParams, stored,
                   prompt_ids: list[int], chain: bool = False):
    """``options`` and ``params`` with lookahead's sizes chosen from this machine's pass costs,
    and the choice (None where nothing was chosen):

    - ``--method lookahead`` (or a chain with it) without ``--lookahead``: the sizes the costs
      favour, from ``stored`` (an earlier run's ``load_target_entry``) or a probe of a few passes.
    - ``auto`` (unless ``chain``, --chain) where the stored costs predict a window pays by
      ``AUTO_MARGIN``: auto drafts with one too (probing nothing), on a target that verifies
      trees or one opened for chains alone (llama.cpp's default context), re-created for the
      window's paths before anything is fed.
    """
    from specrun.sessions import lookahead_sizing as sizing

    costs = sizing.stored_costs(stored)
    support = target.tree_support
    fits = sizing.fitting(params.tree_nodes, support.max_paths)
    if uses_lookahead(method) and options.lookahead is None:
        choice = choose_window(target, costs, fits, prompt_ids)
        return dataclasses.replace(options, lookahead=choice.sizes), params, choice
    choice = None if chain else auto_window(method, target, costs, fits)
    if choice is None:
        return options, params, None
    options = dataclasses.replace(options, lookahead=choice.sizes, auto_lookahead=True)
    return options, dataclasses.replace(params, tree_nodes=max(params.tree_nodes, choice.sizes.max_nodes)), choice


def auto_window(method: str, target, costs: dict[int, float] | None, fits):
    """The lookahead window ``auto`` drafts with (a sizing choice), or None: where the target
    verifies trees, or can be re-created to (llama.cpp's chains context, before anything is
    fed), and the stored ``costs`` predict a window of the sizes that ``fits`` pays by
    ``AUTO_MARGIN``. Nothing is probed: without stored costs auto drafts without one."""
    from specrun.sessions import lookahead_sizing as sizing

    support = target.tree_support
    if not (is_adaptive(method) and (support.available or support.reopenable) and costs is not None):
        return None
    choice = sizing.choose(costs, fits)
    if choice.predicted < sizing.AUTO_MARGIN:
        return None
    if not support.available:
        try:
            target.open_for_trees(resolve_trees(False, None, None, choice.sizes).paths)
        except SpecrunError:  # no memory for the wider cache: auto goes on with chains, as before
            return None
    return choice


@dataclass(frozen=True)
class TreeChoice:
    """Token trees a run opened by itself: the settings and the speed-up predicted over chains."""

    trees: TreeSettings
    predicted: float

    def describe(self) -> str:
        return (f"token trees of up to {self.trees.nodes} nodes, {self.trees.branches} second guesses a position, "
                f"from this machine's pass costs: predicted {self.predicted:.2f}x the chain's speed")


def default_trees(method: str, target, stored, trees: TreeSettings) -> TreeChoice | None:
    """Token trees where the user asked for none (nor --chain) and ``stored``'s pass costs (an
    earlier run's entry) predict second guesses win ``TREE_MARGIN`` over chains
    (``control.trees.predicted_tree_gain``): the target opened for them (llama.cpp's chains
    context re-created before anything is fed), the drafters' second guesses and the pass's
    nodes set to the defaults --branches and --tree-nodes take; the policy still shapes each
    step's tree from measured acceptance. None elsewhere: on a CPU a node costs most of a
    plain step, so runs there keep chains by themselves. Nothing is probed."""
    from specrun.control.trees import TREE_MARGIN, TYPICAL_CHAIN, predicted_tree_gain
    from specrun.sessions.lookahead_sizing import relative_costs

    costs = stored.target_costs if stored is not None else None
    support = target.tree_support
    asked_otherwise = trees.chain or bool(trees.nodes) or method == "none" or uses_lookahead(method)
    known = bool(costs) and 1 in costs and max(costs) >= 2 + TYPICAL_CHAIN  # a pass wider than the chain's
    if asked_otherwise or not known or not (support.available or support.reopenable):
        return None
    chosen = TreeSettings(DEFAULT_TREE_NODES, DEFAULT_BRANCHES)
    predicted = predicted_tree_gain(relative_costs(costs), chosen.branches, chosen.nodes)
    if predicted < TREE_MARGIN:
        return None
    if not support.available:
        try:
            target.open_for_trees(chosen.paths)
        except SpecrunError:  # no memory for the wider cache: chains, as before
            return None
    elif support.max_paths and support.max_paths < chosen.paths:
        return None
    return TreeChoice(chosen, predicted)


def near_tie_note(stats) -> str:
    """What a greedy run without --exact says when some of its tokens were chosen at a near-tie:
    verify passes of several tokens round differently from one-token decoding, so plain decoding
    may choose otherwise there."""
    n = stats.near_ties
    return (f"{n} {'token' if n == 1 else 'tokens'} chosen at near-ties (top two logits within {TIE_MARGIN:g}) "
            "may differ from plain decoding's; --exact makes the output bit-identical on F16 and F32 targets")


def adapts_length(method: str, requested: int | None) -> bool:
    """Does ``method`` choose its draft length as it goes (gated on plain decoding, as auto)?

    auto always (``-k`` is then its longest draft); every other speculative method unless
    ``-k`` fixes its length. One length for every step either stops a long copy early or
    verifies long wrong guesses, and a draft model that does not pay on this machine
    drafts anyway (Spec-Bench, demo pair: lookup 1.90x adaptive against 1.47x at 4; the
    draft model alone 1.00x against 0.79x at 2; docs/perf.md, session 12). `specrun tune`
    seeds the controllers with its measured costs and acceptance; its best fixed length
    is for ``-k``.
    """
    return method != "none" and (is_adaptive(method) or requested is None)


def resolve_draft_len(method: str, requested: int | None) -> int:
    """The user's draft length (for an adaptive run, its longest); else, adaptive, the
    longest the controller may choose; else (plain decoding, which drafts nothing) 4."""
    if requested is not None:
        return requested
    return ADAPTIVE_MAX_DRAFT_LEN if adapts_length(method, requested) else DEFAULT_DRAFT_LEN


def resolve_min_prob(requested: float | None, tuned) -> float:
    """The user's confidence stop; else the tuned one; else none."""
    if requested is not None:
        return requested
    return tuned.best_min_prob if tuned is not None else DEFAULT_DRAFT_MIN_PROB


def load_target_heads(target_spec: str, explicit: str | None, target, registry=None, kind: str = "medusa",
                      loaded: dict | None = None, on_note: Callable[[str], None] | None = None):
    """The ``kind`` heads ("medusa", "hydra" or "eagle") for ``target`` (an open backend): --heads, else
    found by alias (registry/heads.py), checked against the target before anything drafts with them.
    ``loaded``: heads already read, by path, which this adds to (see ``read_heads``). Where heads found
    first cannot serve (damaged, made for another model) and later ones can, ``on_note`` says why."""
    from specrun.registry.heads import find_all_heads

    errors = []
    for path in find_all_heads(target_spec, explicit, kind, registry):  # yours, then shipped; EAGLE-3's first
        try:
            heads = _checked_heads(path, read_heads(path, loaded), kind, target)
        except SpecrunError as error:
            errors.append(error)
            continue
        if errors and on_note is not None:
            on_note(f"drafting with the {kind} heads in {path}: those found first cannot serve "
                    f"({errors[0].one_line()})")
        return heads
    raise errors[0]


def read_heads(path, loaded: dict | None):
    """The heads in ``path``, read once per ``loaded`` (a comparison's lines, or a chat session's
    methods, that draft with the same file share what was read: a published EAGLE-3 head's
    embedding table alone is ~1 GB)."""
    from specrun.heads.files import load_heads

    if loaded is None:
        return load_heads(path)
    key = Path(path).resolve()
    if key not in loaded:
        loaded[key] = load_heads(path)
    return loaded[key]


def _checked_heads(path, heads, kind: str, target):
    """``heads`` (loaded from ``path``) if they are ``kind`` heads made for ``target``; else the
    one-line error naming the file and both sides."""
    from specrun.drafters.ngram import vocabulary_fingerprint
    from specrun.heads.files import check_heads_for_target

    if heads_of_kind(heads, kind) is None:
        raise UsageError(f"{path} holds {heads.config.kind} heads, not {kind} heads",
                         f"pass {kind} heads with --heads, or train them with specrun heads train --kind {kind}")
    support = target.hidden_support
    check_heads_for_target(heads, hidden_size=support.size or heads.config.hidden_size, vocab_size=target.vocab.size,
                           num_layers=support.layers, vocabulary=vocabulary_fingerprint(target), path=path)
    from specrun.drafters.heads.eagle import check_eagle3_target

    check_eagle3_target(heads, target, path)
    return heads


def heads_for_auto(target_spec: str, explicit: str | None, target, registry=None,
                   on_note: Callable[[str], None] | None = None, loaded: dict | None = None):
    """The heads ``auto`` may draft with beside its other drafters (``heads_pay`` decides, once
    the stored costs are read): --heads, else the first kind of AUTO_HEADS_ORDER found for the
    target by alias; None where there are none or the target gives no hidden states. Heads found
    by alias that cannot serve this target (made for another model, damaged) leave auto drafting
    without them, said in a note; --heads that cannot is an error, as for a head method.
    ``loaded``: as for ``load_target_heads``."""
    from specrun.registry.heads import find_heads, head_kinds_available

    if explicit is not None:
        path = find_heads(target_spec, explicit, "eagle", registry)
        heads = read_heads(path, loaded)
        return _checked_heads(path, heads, heads.config.kind, target)
    if not target.hidden_support.available:
        return None
    found = head_kinds_available(target_spec, None, registry)
    for kind in (kind for kind in AUTO_HEADS_ORDER if kind in found):
        try:
            return load_target_heads(target_spec, None, target, registry, kind, loaded, on_note)
        except SpecrunError as error:  # the next kind found, if any
            if on_note is not None:
                on_note(f"auto drafts without the {kind} heads found: {error.one_line()}")
    return None


def heads_pay(heads, target, stored) -> bool:
    """Are ``heads`` predicted to win HEADS_MARGIN over plain decoding on ``target``
    (control.heads): their held-out acceptance by depth (a prior for published heads), their
    weights against the target's, and a pass's cost by its tokens from ``stored`` (an earlier
    run's entry). Where no run has measured the target's passes yet, no: as token trees, heads
    join auto by themselves only once this machine's costs say they pay (a first run of the demo
    target with them read 0.70x on one prompt, where its later runs leave them out)."""
    from specrun.control.heads import HEADS_MARGIN, PRIOR_ACCEPTANCE, predicted_heads_gain
    from specrun.heads.files import held_out_acceptance
    from specrun.sessions.lookahead_sizing import relative_costs

    costs = stored.target_costs if stored is not None else None
    if not costs or 1 not in costs:
        return False
    relative = relative_costs(costs)
    acceptance = held_out_acceptance(heads.config) or (PRIOR_ACCEPTANCE,) * heads.config.num_heads
    weights = target.hidden_support.weight_bytes
    depth_cost = heads.depth_bytes / weights if weights else 0.0
    return predicted_heads_gain(relative, acceptance, depth_cost) >= HEADS_MARGIN


def paying_heads(heads, explicit: str | None, target, stored):
    """``heads`` (``heads_for_auto``'s) where auto keeps them: given with --heads, or ``heads_pay``
    on ``stored``; else None."""
    if heads is None or explicit is not None or heads_pay(heads, target, stored):
        return heads
    return None


def with_auto_heads(options: DrafterOptions, heads) -> DrafterOptions:
    """``options`` with ``heads`` as the heads auto drafts with (None: auto drafts without),
    beside those a head method has (one kind's own file kept where a head method has one)."""
    if heads is None:
        return dataclasses.replace(options, auto_heads=None)
    kind = heads.config.kind
    have = () if options.heads is None else options.heads if isinstance(options.heads, tuple) else (options.heads,)
    if heads_of_kind(options.heads, kind) is None:
        have = (*have, heads)
    return dataclasses.replace(options, heads=have[0] if len(have) == 1 else have, auto_heads=kind)


def load_heads_for_methods(target_spec: str, explicit: str | None, target, methods, registry=None,
                           loaded: dict | None = None, on_note: Callable[[str], None] | None = None):
    """The heads every head method of ``methods`` drafts with (one object for one kind, a tuple
    for several; None for none). ``explicit`` (--heads) serves the kind its file holds."""
    kinds = list(dict.fromkeys(kind for kind in map(heads_kind, methods) if kind is not None))
    given = {kind: explicit for kind in kinds}
    if explicit is not None and len(kinds) > 1:
        try:  # the kind the file holds, read once (each kind asked read it again)
            held = read_heads(Path(explicit).expanduser(), loaded).config.kind
        except SpecrunError:  # reported where the heads are loaded for their method
            held = None
        given = {kind: explicit if kind == held else None for kind in kinds}
    found = tuple(load_target_heads(target_spec, given[kind], target, registry, kind, loaded, on_note)
                  for kind in kinds)
    return None if not found else found[0] if len(found) == 1 else found


def comparison_heads(target_spec: str, explicit: str | None, target, methods, registry, stored,
                     on_note: Callable[[str], None] | None = None) -> DrafterOptions:
    """The drafter options a comparison of ``methods`` (bench, demo) gives every line: the heads
    its head methods draft with, and auto's, where auto is one of them and its heads pay
    (``heads_pay`` on ``stored``, or --heads), as `specrun generate` would choose them here."""
    loaded: dict = {}  # a head line and auto's heads are often the same file: read once
    options = DrafterOptions(heads=load_heads_for_methods(target_spec, explicit, target, methods, registry, loaded,
                                                          on_note))
    if not any(map(is_adaptive, methods)):
        return options
    auto = heads_for_auto(target_spec, explicit, target, registry, on_note, loaded)
    return with_auto_heads(options, paying_heads(auto, explicit, target, stored))


def prompt_token_ids(target, prompt: str, chat: bool) -> list[int]:
    """The prompt as one user message in the target's chat template, as ``mlx_lm.generate``
    and ``llama-cli`` send it, or (``chat`` false) as is."""
    if not chat:
        return target.tokenize(prompt, add_bos=target.vocab.add_bos)
    from specrun.sessions.templates import render_user_prompt

    return render_user_prompt(target, prompt)[1]


def generate_text(request: GenerateRequest, on_text: Callable[[str], None] | None = None) -> GenerationResult:
    """Load the pair, generate, and return the result; ``on_text`` receives text as it streams."""
    draft_spec = request.draft if needs_draft_model(request.method) else None
    target, draft = open_pair(request.target, draft_spec, request.load)
    drafter = None
    try:
        options = request.drafter_options
        if options.ngram_cache is not None and not options.vocabulary:
            from specrun.drafters.ngram import vocabulary_fingerprint

            options = dataclasses.replace(options, vocabulary=vocabulary_fingerprint(target))
        if needs_heads(request.method):
            options = dataclasses.replace(options, heads=load_target_heads(
                request.target, request.heads, target, request.load.registry, heads_kind(request.method),
                on_note=request.on_note))
        auto_heads = None
        if is_adaptive(request.method):  # read and checked now; kept where they pay (below)
            auto_heads = heads_for_auto(request.target, request.heads, target, request.load.registry,
                                        request.on_note)
        check_trees_for(request.method, target, options.lookahead)
        chat = prompts_as_chat(request.target, request.load.registry, target, request.chat)
        prompt_ids = prompt_token_ids(target, request.prompt, chat)
        check_prompt(prompt_ids, target.n_ctx)
        # The input is good: flash attention by what it costs here (a first run measures it and
        # notes so after the answer), which also picks the tuning key of the run's stored costs.
        kernel_notes: list[str] = []
        settle_pair(target, draft, request.load, kernel_notes.append)
        tuned = load_tuned(target, draft, request.load.threads)
        options = dataclasses.replace(options, draft_min_prob=resolve_min_prob(request.draft_min_prob, tuned))
        params = GenerationParams(
            request.max_new_tokens,
            resolve_draft_len(request.method, request.draft_len),
            request.sampling,
            adaptive=adapts_length(request.method, request.draft_len),
            tree_nodes=request.trees.nodes,
            # where kernels round batched passes otherwise (not --exact), count the choices that could flip
            tie_margin=0.0 if request.load.exact or request.method == "none" else TIE_MARGIN,
        )
        choice = None
        stored = tuned
        if draft is None:  # lookahead's sizes (and whether auto drafts with a window) from the pass costs
            tuned = stored = load_target_entry(target, request.load.threads)
            options, params, choice = size_lookahead(request.method, target, options, params, tuned, prompt_ids,
                                                     chain=request.trees.chain)
            if choice is not None and request.on_note is not None:
                request.on_note(choice.describe())
            if tuned is not None and choice is None:
                tuned = None  # no window: the target's own entry says nothing this run uses
        if auto_heads is not None:
            options = with_auto_heads(options, paying_heads(auto_heads, request.heads, target, stored))
        trees = None if choice is not None else default_trees(request.method, target, stored, request.trees)
        if trees is not None:  # second guesses, where the stored pass costs say they pay
            options = dataclasses.replace(options, branches=trees.trees.branches)
            params = dataclasses.replace(params, tree_nodes=trees.trees.nodes)
            if request.on_note is not None:
                request.on_note(trees.describe())
        drafter = build_drafter(request.method, draft, options)
        if request.trees.paths and not target.tree_support.available and request.on_note is not None:
            request.on_note(f"token trees are off: {target.tree_support.reason}; verifying chains")
        engine = SpeculativeEngine(target, drafter, method=request.method)
        if tuned is not None:
            tuned.apply(engine)  # the controllers start from measured costs
        if choice is not None:
            engine.policy.target_costs.preload(choice.costs)  # a probe's too: remembered for the next run
        if draft is None and choice is not None and params.adaptive and choice.predicted < 1.0 and \
                (tuned is None or not tuned.gate_off_gap):
            engine.policy.start_gate_off(SpeculationGate.FIRST_GAP)  # predicted slower: find out later, not first
        for event in engine.stream(prompt_ids, params, complete_cache=False):
            if isinstance(event, TextChunk) and on_text is not None and event.text:
                on_text(event.text)
            elif isinstance(event, Finished):
                remember_run(engine, target, draft, request.load.threads, tuned)
                if drafter is not None:
                    drafter.finish(engine.last_context)  # the n-gram pool learns the last tokens too
                    closing, drafter = drafter, None
                    try:
                        closing.close()  # saves the n-gram pool when it has a cache file
                    except SpecrunError as exc:  # a full disk: the answer still reaches the user
                        raise AnswerKeptError(event.result, exc) from exc
                if request.on_note is not None and event.result.stats.near_ties and event.result.stats.drafted:
                    request.on_note(near_tie_note(event.result.stats))
                if request.on_note is not None:
                    for note in kernel_notes:
                        request.on_note(note)
                return event.result
        raise AssertionError("stream ended without Finished")
    finally:
        if drafter is not None:
            drafter.close()  # saves the n-gram pool when it has a cache file
        target.close()
        if draft is not None:
            draft.close()
