"""A run's setup before the engine starts: token trees, draft lengths, what earlier runs stored,
lookahead's sizes and the prompt's tokens (generate, chat, bench and serve share it)."""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

from specrun.drafters.lookahead import LADDER, LookaheadSizes
from specrun.drafters.methods import DrafterOptions, is_adaptive, uses_lookahead
from specrun.engine.loop import DEFAULT_TREE_NODES, TIE_MARGIN, GenerationParams
from specrun.errors import ContextFullError, ModelFileError, SpecrunError, UsageError
from specrun.wording import count_of


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


def check_trees_for(method: str, target, lookahead: LookaheadSizes | None = None, switch: str = "--method") -> None:
    """A UsageError where ``method`` drafts with a lookahead window and ``target`` cannot verify
    its tree (a model whose cache holds no trees, or a llama.cpp context opened for fewer paths):
    verified as a chain, its window would learn nothing and every pass would cost more for it.
    ``switch``: how the user picks another method where they are (a chat's /method)."""
    needed = method_trees(method, lookahead or LADDER[0]).paths
    if not needed:
        return
    support = target.tree_support
    if not support.available:
        raise UsageError(f"method {method!r} verifies a token tree, and this target cannot: {support.reason}",
                         f"pick another {switch}")
    if support.max_paths and support.max_paths < needed:
        raise UsageError(f"method {method!r} verifies a token tree of up to {needed} paths, and this target "
                         f"was opened for {support.max_paths}",
                         f"start with --method {method}" + (f", or pick another {switch}" if switch != "--method" else ""))


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


def tuned_window(draft, tuned, options, on_note=None):
    """``draft`` drafting from the windowed cache `specrun tune --window-search` kept for the pair
    (``tuned.window``), where the run left --window out and the draft model reads its full cache;
    else ``draft`` as it is. A note says so, and how to choose another."""
    if draft is None or tuned is None or not tuned.window or options.window is not None:
        return draft
    if not hasattr(draft, "open_window") or hasattr(draft, "parent"):  # a windowed or shared view already
        return draft
    from specrun.registry.loading import open_window_draft

    chosen = dataclasses.replace(options, window=tuned.window, sinks=tuned.window_sinks)
    windowed = open_window_draft(draft, chosen, owns=True, on_note=on_note)
    if windowed is not draft:
        windowed.tuned_window = True  # its settings are found under the draft model's own key (tuned_key_model)
    if windowed is not draft and on_note is not None:
        on_note(f"the draft reads its first {tuned.window_sinks} tokens and its last {tuned.window} "
                f"(`specrun tune --window-search` after {tuned.window_context:,} tokens: "
                f"{tuned.window_speedup:.2f}x its full cache); --window N sets another")
    return windowed


def auto_draft_window(method, draft, tuned, window, longest_prompt):
    """The draft model's windowed cache (its first SINKS tokens and its last DEFAULT_WINDOW) that
    auto holds beside its full cache and drafts from wherever it measures it faster (a long
    context: AdaptivePolicy._rest_alternatives), else None: not auto, no draft model, a window
    already chosen (``window``: --window, 0 for the full cache alone; or `specrun tune
    --window-search`, which also may have kept the full cache), a backend or cache that cannot
    keep one, or prompts of at most ``longest_prompt`` tokens (None: a chat's, unbounded) shorter
    than it engages from (draft_model.window_engages_from), or a draft context shorter. The caller closes
    it, or hands it to the drafter that does."""
    from specrun.backends.window import DEFAULT_WINDOW, SINKS, block_for
    from specrun.drafters.draft_model import window_engages_from

    if not is_adaptive(method) or draft is None or window is not None:
        return None
    if tuned is not None and (tuned.window or tuned.window_context):
        return None
    if not hasattr(draft, "open_window") or hasattr(draft, "parent") or getattr(draft, "recurrent", False):
        return None
    engages = window_engages_from(SINKS, DEFAULT_WINDOW, block_for(DEFAULT_WINDOW))
    if (longest_prompt is not None and longest_prompt < engages) or draft.n_ctx <= engages:
        return None
    try:
        return draft.open_window(SINKS, DEFAULT_WINDOW, owns=False)
    except ModelFileError:  # no memory for a second cache: the full cache alone, as before
        return None


def tuned_key_model(draft):
    """The draft whose tune entry a run reads: a window ``tuned_window`` opened reads its model's."""
    return draft.parent if getattr(draft, "tuned_window", False) else draft


def load_target_entry(target, threads):
    """What earlier runs of ``target`` with no draft model learned on this machine (its pass
    costs, its gate), or None."""
    from specrun.sessions import tuning

    return tuning.load(tuning.pair_key(target, None, threads), tuning.learned_path())


def remember_probe(target, threads, costs: dict[int, float]) -> None:
    """Keep pass costs timed before a run drafted (auto's heads: sessions/heads.probed_costs) as
    ``target``'s own entry where it has none, so the next process (a server restarted, a chat
    whose answers left nothing to learn from) reads them instead of timing the target again."""
    from specrun.sessions import tuning

    key = tuning.pair_key(target, None, threads)
    path = tuning.learned_path()
    try:
        if tuning.load(key, path) is not None:
            return
        tuning.save(tuning.TuneResult(key=key, target=tuning.model_id(target), draft=tuning.NO_DRAFT,
                                      machine=tuning.machine_id(), best_draft_len=0, speedup=0.0,
                                      target_costs=dict(costs), learned=True), path)
    except SpecrunError:  # a damaged store, a full disk: the next process times the target again
        pass


def remember_run(engine, target, draft, threads, tuned, busy: bool = False) -> None:
    """Keep what this run measured for the next (unless `specrun tune` calibrated the pair);
    a run with no draft model keeps the target's pass costs and its gate, for lookahead. A run
    with a lossy acceptance rule keeps nothing: its acceptance is not what exact runs would see;
    nor does one whose passes ran on fewer threads while other processes held cores (``busy``,
    Stats.busy_passes): its costs are of a machine the next run may not find."""
    if engine.drafter is None or engine.passes.acceptance is not None or (tuned is not None and not tuned.learned):
        return
    if busy:
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
    from specrun.control import forecasts
    from specrun.sessions import lookahead_sizing as sizing
    from specrun.sessions.tuning import time_passes

    if costs is None:
        probe = prompt_ids[:sizing.PROBE_CONTEXT]
        costs = sizing.probe_costs(lambda counts: time_passes(target, probe, counts, sizing.PROBE_REPEATS), fits)
    return forecasts.choose(costs, fits)


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
    from specrun.control import forecasts
    from specrun.sessions import lookahead_sizing as sizing

    costs = sizing.stored_costs(stored)
    support = target.tree_support
    fits = forecasts.fitting(params.tree_nodes, support.max_paths)
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
    from specrun.control import forecasts

    support = target.tree_support
    if not (is_adaptive(method) and (support.available or support.reopenable) and costs is not None):
        return None
    choice = forecasts.choose(costs, fits)
    if choice.predicted < forecasts.AUTO_MARGIN:
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
    (``control.forecasts.predicted_tree_gain``): the target opened for them (llama.cpp's chains
    context re-created before anything is fed), the drafters' second guesses and the pass's
    nodes set to the defaults --branches and --tree-nodes take; the policy still shapes each
    step's tree from measured acceptance. None elsewhere: on a CPU a node costs most of a
    plain step, so runs there keep chains by themselves. Nothing is probed."""
    from specrun.control.forecasts import TREE_MARGIN, TYPICAL_CHAIN, predicted_tree_gain, relative_costs

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
    return (f"{count_of(n, 'token')} chosen at near-ties (top two logits within {TIE_MARGIN:g}) "
            "may differ from plain decoding's; --exact makes the output bit-identical on F16 and F32 targets "
            "where the CPU's kernels allow (README)")


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


def prompt_token_ids(target, prompt: str, chat: bool, variables: dict | None = None) -> list[int]:
    """The prompt as one user message in the target's chat template, as ``mlx_lm.generate``
    and ``llama-cli`` send it, or (``chat`` false) as is: a raw prompt is the user's whole text,
    markers included, and its control-token text becomes control tokens (``<|im_start|>``,
    ``<|fim_prefix|>``), as llama-cli, llama-server, mlx_lm and vLLM read a raw prompt. (In a
    template, what the user typed stays text: templates.tokenize_chat.) ``variables``: the
    template's own (--chat-template-kwargs, --reasoning)."""
    if not chat:
        return target.tokenize(prompt, add_bos=target.vocab.add_bos, special=True)
    from specrun.sessions.templates import render_user_prompt

    return render_user_prompt(target, prompt, variables)[1]


# A prompt of up to this many bytes a context token is tokenized without a second look: no real
# vocabulary's tokens average more, so only a prompt past it can be refused by its size alone.
CHEAP_BYTES_PER_TOKEN = 16
_longest_tokens: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> its longest token in bytes


def ctx_fix(target, instead: str, raise_it: str = "raise --ctx") -> str:
    """What a context too small for the text is told: ``instead`` (shorten the prompt, /reset),
    and ``raise_it`` (a server: restart it with a larger --ctx) where the model takes more than it
    holds (its training context, where its files say it); where --ctx already holds all of it,
    that it does ("raise --ctx" sent users to a refusal)."""
    trained = getattr(target, "n_ctx_train", 0) or 0
    if trained and target.n_ctx >= trained:
        return f"{instead} (--ctx already holds the {trained:,} tokens the model was trained with)"
    return f"{instead}, or {raise_it}" + (f" (up to {trained:,})" if trained else "")


def check_prompt_size(target, text: str) -> None:
    """Refuse, before tokenizing it, a prompt that cannot fit the context whatever tokens it
    becomes: even cut into the vocabulary's longest tokens it would fill the context (tokenizing
    a 50 MB prompt took 45 s before the context check refused it)."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size < target.n_ctx * CHEAP_BYTES_PER_TOKEN:
        return
    longest = _longest_tokens.get(target)
    if longest is None:
        longest = max(1, max(len(target.token_bytes(token)) for token in range(target.vocab.size)))
        _longest_tokens[target] = longest
    fewest = -(-size // longest)
    if fewest >= target.n_ctx:
        raise ContextFullError(
            f"the prompt is {size:,} bytes, at least {fewest:,} tokens (the model's longest token is {longest} "
            f"bytes), but the context holds {target.n_ctx:,}",
            ctx_fix(target, "shorten the prompt"),
        )
