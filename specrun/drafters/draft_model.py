"""A smaller model with the target's vocabulary drafts autoregressively."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Protocol

import numpy as np

from specrun.backends.base import Backend
from specrun.drafters.base import EMPTY_PROPOSAL, Drafter, Proposal, second_guesses
from specrun.drafters.dynamic_tree import TOP_K, DraftTree, grow_tree
from specrun.backends.kv import KVSequence, common_prefix_len, sequence_for
from specrun.sampling import (
    SamplingSettings, infill_vocab_of, probabilities, sample, shaped_row, text_shaped_rows,
    top_probability,
)
from specrun.errors import SpecrunError
from specrun.grammar import mask_logits
from specrun.tree import TokenTree


# Between its own steps a draft model reads one token (the target's correction) or two
# (its last draft and the bonus token); more is catching up on context it did not draft.
CATCH_UP_TOKENS = 2
TIMED_READ = 16  # a catch-up of more tokens times what reading costs a token (fewer: per-pass costs weigh)
# A dynamic tree costs the draft a tree pass a level where a chain costs a one-token pass a
# position. It is grown while a tree pass costs at most this many one-token passes (a memory-
# bound draft); dearer (a CPU: demo-draft grew 1.08x the chain's tokens a pass at 0.69x its
# speed, docs/perf.md 3(f)), second guesses are leaves read off the chain's own rows.
TREE_PASS_LIMIT = 1.25
# From this many second guesses on, the dynamic tree expands twice EAGLE-2's 4 nodes a level.
WIDE_TREE_BRANCHES = 16

class DraftModelLearner(Protocol):
    """What learns from a draft model's verified text (training/online_draft.py's DraftLearner):
    told where a text begins, given the positions of the text the target generated, and asked for
    newer adapters between verify passes (loaded with the backend's ``adapt``)."""

    kind: str
    source: object  # the draft model (a Backend) it trains adapters for
    soft: bool  # does it learn the target's distributions too (observe_rows)?

    def watch(self, progress: Callable[[], int]) -> None: ...

    def start_text(self) -> None: ...

    def observe(self, first: int, context: Sequence[int]) -> None: ...

    def observe_rows(self, first: int, logits: np.ndarray) -> None: ...

    def latest(self, version: int) -> tuple[int, object] | None: ...

    def fail(self, why: str) -> None: ...


class DraftModelDrafter(Drafter):
    """Drafts with its own KV cache, kept in step with the target's context.

    The draft must also see tokens it did not draft: after a rejection the
    target's correction, and after a full accept both its own last draft (which
    it proposed but never fed) and the bonus token. ``propose`` handles both by
    rewinding to the longest cached prefix of the context and feeding the rest.

    ``min_prob`` is a confidence stop: drafting ends before a token whose draft
    probability (the top probability of the draft's distribution) is below it, since
    such a token is likely rejected and costs a draft pass and a verify position.
    0 drafts the full length. Stopping early never changes the output, only speed.

    Drafting also ends at an end-of-text token: what follows it is verified only if the
    target accepts the end too, and then generation stops there and throws it away (unless
    it was asked to go on past end tokens, where drafts are merely shorter). At the end of
    every answer the draft drafted on past it: on a 17-token answer of the real model, a
    draft of 8 tokens cost ~100 ms of a ~310 ms plain answer. Drafts left on the device
    (``propose_deferred``, MLX) are verified whole.
    """

    name = "draft"
    pays_per_token = True
    follows_grammar = True

    def __init__(self, backend: Backend, min_prob: float = 0.0, branches: int = 0) -> None:
        self.backend = backend
        self.owns_backend = False  # close it with this drafter (a windowed view opened for it)
        self.min_prob = min_prob
        # Token trees: second guesses beside the chain, at the positions where the draft was
        # least sure of its first (0: chains only; the greedy ids then stay on the device).
        self.branches = branches
        # Nodes expanded a level of its dynamic tree, and children each: EAGLE-2's 4 for a few
        # second guesses, twice that for many, which 4 x 4 candidates a level would leave to the
        # unlikely ones (demo-target-xl, -k 6, 40 beside the chain: 4.85 tokens a pass against
        # 4.78, 1.30x the chain's; docs/perf.md 3(f)).
        self.top_k = TOP_K if branches < WIDE_TREE_BRANCHES else 2 * TOP_K
        self.sequence = sequence_for(backend)
        self.target_vocab_size = backend.vocab.size  # the target's (bind), when padding makes it differ
        self.stop_ids: frozenset[int] = frozenset(backend.vocab.eos_ids)  # the target's (bind)
        self.clock: Callable[[], float] = perf_counter  # the engine's own clock (bind)
        # Of the latest call, the seconds spent reading context this model did not draft
        # (what other drafters proposed and the target accepted): a cost of switching to it,
        # not of the draft length it was asked for.
        self.catch_up_seconds = 0.0
        # Measured seconds of a tree pass (one level of a dynamic tree) and of a one-token pass,
        # which decide whether trees are grown (grows_trees).
        self.tree_pass = PassTiming()
        self.token_pass = PassTiming()
        self.target_trees = False  # does the target verify trees (bind)? Else a tree is wasted
        self.target: KVSequence | None = None  # the engine's (bind): is its pass shared?
        # seconds a token of reading text it did not draft costs (a decayed mean over catch-ups)
        self.read_timing = PassTiming()
        self.learner: DraftModelLearner | None = None  # set by build_drafter where the draft learns online
        self._learned_version = 0  # of the learner's adapters drafted with
        self._harvested = -1  # the first position of the text the learner has not had; -1: none to hand

    def bind(self, target: KVSequence, clock: Callable[[], float]) -> None:
        self.target = target
        self.target_vocab_size = target.backend.vocab.size
        self.stop_ids = frozenset(target.backend.vocab.eos_ids)
        self.clock = clock
        self.target_trees = target.backend.tree_support.available
        if self.learner is not None:  # generation goes on while the target's cache grows, drafted by this model or not
            self.learner.watch(lambda: len(target.tokens))
        support = self.backend.tree_support
        if self.branches and self.target_trees and not support.available and support.reopenable:
            # Greedy second guesses grow a dynamic tree, which the draft itself reads in tree
            # passes: llama.cpp's context is re-created for them (the prompt is read afresh
            # in ``prefill``). Where that fails, second guesses stay leaves beside the chain.
            self.sequence.reset()
            try:
                self.backend.open_for_trees(self.top_k + 1)
            except SpecrunError:  # no memory for the wider cache: leaves beside the chain, as before
                pass

    @property
    def reads_rows(self) -> bool:
        """It learns the target's distributions where its passes bring them (the learner's soft labels)."""
        return self.learner is not None and self.learner.soft

    def observe_rows(self, first: int, logits: np.ndarray) -> None:
        self.learner.observe_rows(first, logits)

    @property
    def grows_trees(self) -> bool:
        """Greedy second guesses grow an EAGLE-2 dynamic tree by the draft's own probabilities
        (``_dynamic_tree``) where the draft reads trees of ``top_k`` nodes' paths a pass, until
        its passes are timed and a tree pass costs more than ``TREE_PASS_LIMIT`` one-token ones."""
        support = self.backend.tree_support
        reads_trees = support.available and (not support.max_paths or support.max_paths > self.top_k)
        if not (self.branches and self.target_trees and reads_trees):
            return False
        timed = self.tree_pass.mean is not None and self.token_pass.mean is not None
        return not timed or self.tree_pass.mean <= TREE_PASS_LIMIT * self.token_pass.mean

    def propose(
        self,
        context: Sequence[int],
        draft_len: int,
        sampling: SamplingSettings,
        rng: np.random.Generator,
    ) -> Proposal:
        draft_len = min(draft_len, self.backend.n_ctx - len(context))
        self.catch_up_seconds = 0.0
        if self.learner is not None:
            self._learn(context)
        if draft_len <= 0:
            return EMPTY_PROPOSAL
        pending = self._catch_up(context)
        exact_vocab = self.target_vocab_size == self.backend.vocab.size
        grammar = self.grammar  # each token then drafted from its row masked by the grammar
        # penalties, a bias and a reasoning budget shape its rows as they shape the target's
        # (sampling.text_shaped_rows): each by the text it follows, the drafts before it included, so
        # it drafts what the target will choose (the tokens a budget forces, for one)
        shaping = sampling.shapes_rows
        if grammar is None and not shaping and sampling.greedy and exact_vocab and self.min_prob <= 0.0 \
                and not self.branches:
            # Greedy verification needs no draft distribution: argmax stays in the backend.
            return Proposal(self._greedy_ids(pending, draft_len), source=self.name)
        room = len(context) + (self.top_k + 1) * (draft_len - 1) <= self.backend.n_ctx  # its widest tree pass
        if grammar is None and sampling.greedy and self.min_prob <= 0.0 and room and self.grows_trees:
            return self._dynamic_tree(pending, draft_len, sampling if shaping else None, context)
        tokens: list[int] = []
        rows: list[np.ndarray | None] = []
        distributions: list[np.ndarray] = []  # the draft's own, for second guesses
        for _ in range(draft_len):
            logits = self._target_sized(self.sequence.feed(pending, [len(pending) - 1])[0])  # (V_target,)
            logits = shaped_row(logits, sampling, context, tokens)
            if sampling.reasoning_budget is not None and not np.isfinite(logits).any():
                break  # the budget forces a token past the draft's vocabulary
            if grammar is not None:
                # Drafted as the grammar allows (the target's rows are masked the same way): a
                # draft that wrote a line break where the schema takes none was cut there whole.
                # Sampled, the masked row is the one its token was drawn from: verification's q.
                allowed = grammar.allowed(context, tokens)
                if allowed is None or not allowed.any():
                    break
                logits = mask_logits(logits[None], allowed[None])[0]
                if not np.isfinite(logits).any():  # it allows only ids past the draft's vocabulary
                    break
            if sampling.greedy:
                token = int(logits.argmax())
                if self.min_prob > 0.0 and top_probability(logits) < self.min_prob:
                    break
                if self.branches:  # the draft's confidence in its argmax: softmax at temperature 1
                    shifted = np.exp(logits - logits.max())
                    distributions.append(shifted / shifted.sum())
            else:
                p_draft = self._p_draft(logits, sampling)
                if p_draft.max() < self.min_prob:
                    break
                token = sample(p_draft, rng)
                rows.append(p_draft)
                distributions.append(p_draft)
            tokens.append(token)
            if token in self.stop_ids:
                break
            pending = [token]
        proposal = Proposal(tuple(tokens), tuple(rows), source=self.name)
        return second_guesses(proposal, distributions, self.branches, sampling, rng) if self.branches else proposal

    def _dynamic_tree(self, pending: list[int], depth: int, shaping: SamplingSettings | None = None,
                      context: Sequence[int] = ()) -> Proposal:
        """EAGLE-2's tree, greedy (drafters/dynamic_tree.py): the draft's first pass reads
        ``pending`` and gives the first position's logits; each later level feeds the paths to
        the nodes chosen for expansion as one tree pass of the draft, reading each chosen
        node's next position along its own path. The cache keeps the context and, after the
        last level, the main chain but for its last node (as a chain's drafting leaves it), so
        the next call catches up only on the target's correction or bonus token. ``shaping``:
        settings that shape each node's row by ``context`` and its path (penalties, a bias, a
        reasoning budget), as the target's rows are shaped."""
        started = self.clock()
        root = self._target_sized(self.sequence.feed(pending, [len(pending) - 1])[0])
        self.token_pass.add(self.clock() - started)
        if shaping is not None:
            root = shaped_row(root, shaping, context)

        def expand(tree: DraftTree, chosen: list[int], level: int) -> np.ndarray:
            nodes = sorted({ancestor for node in chosen for ancestor in tree.lineage(node)},
                           key=lambda node: (tree.depths[node], node))
            index = {node: i for i, node in enumerate(nodes)}
            fed = TokenTree(tuple(tree.drafts[node] for node in nodes),
                            tuple(index.get(tree.parents[node], -1) for node in nodes))
            started = self.clock()
            logits = self.sequence.feed_tree((), fed, [index[node] for node in chosen])
            self.tree_pass.add(self.clock() - started)
            chain = tree.main_chain()[:level] if level == depth - 1 else []
            self.sequence.keep_path(fed, [index[node] for node in chain])
            rows = np.stack([self._target_sized(row) for row in logits])
            if shaping is None:
                return rows
            return text_shaped_rows(rows, shaping, context, [tree.path(node) for node in chosen])

        return grow_tree(root, depth, self.top_k, self.branches, expand, np.arange(self.target_vocab_size),
                         self.name)

    def _catch_up(self, context: Sequence[int]) -> list[int]:
        """Bring the cache to the context but for the tokens this call feeds with its first pass.

        Those are the last context token, or after a full accept the last draft and the
        bonus token. Anything more (what other drafters proposed and the target accepted
        while this model was not asked) is read first in one batch. Its time counts as
        drafting: it is what switching to the draft model costs at that point (the prompt
        itself is read in ``prefill``, timed as prefill, unless the policy left it unread:
        AdaptivePolicy.reads_prompt, read here then).
        """
        # Keep at least the last context token unfed so its logits come out of this pass.
        keep = self.sequence.rewind_to_prefix_of(context, limit=len(context) - 1)
        pending = list(context[keep:])  # always includes the last context token
        if len(pending) > CATCH_UP_TOKENS:
            started = self.clock()
            self.sequence.feed(pending[:-1])
            self.catch_up_seconds = self.clock() - started
            if len(pending) > TIMED_READ:
                self.read_timing.add(self.catch_up_seconds / (len(pending) - 1))
            pending = pending[-1:]
        # A recurrent model (llama.cpp) keeps its state here: the drafts after it are a pass each,
        # and the next step's rewind into them restores it rather than reading the whole text again.
        keep_state = getattr(self.backend, "keep_state", None)
        if keep_state is not None:
            keep_state()
        return pending

    def behind(self, context: Sequence[int]) -> int:
        """Tokens of ``context`` it would read before its first draft pass: what it did not read
        (the text decoded while it was not asked, a new text's prompt left unread)."""
        return max(len(context) - 1 - common_prefix_len(self.sequence.tokens, context), 0)

    @property
    def read_seconds(self) -> float | None:
        """Seconds a token of catching up costs it, as measured (None before enough reads)."""
        return self.read_timing.mean

    def can_defer(self, sampling: SamplingSettings) -> bool:
        """Can ``propose_deferred`` draft for these settings: greedy, the full length, no
        confidence stop, the target's vocabulary, on a backend that keeps ids on the device."""
        return (
            sampling.greedy
            and self.min_prob <= 0.0
            and not self.branches  # second guesses need the draft's rows
            and self.target_vocab_size == self.backend.vocab.size
            and getattr(self.backend, "can_defer", False)
        )

    def propose_deferred(self, context: Sequence[int], draft_len: int):
        """Greedy drafts left on the device (the backend's DeferredIds), or None for none.

        The target builds its verify pass on them before anything syncs (mlx-lm's loop
        does the same); only for ``can_defer`` settings.
        """
        draft_len = min(draft_len, self.backend.n_ctx - len(context))
        self.catch_up_seconds = 0.0
        if self.learner is not None:
            self._learn(context)
        if draft_len <= 0:
            return None
        pending = self._catch_up(context)
        return self.sequence.feed_greedy_deferred(pending, draft_len)

    def _greedy_ids(self, pending: list[int], draft_len: int) -> tuple[int, ...]:
        """``draft_len`` greedy ids, chained on the device where the backend can (one sync)."""
        if getattr(self.backend, "forward_greedy", None) is not None:
            ids = [int(t) for t in self.sequence.feed_greedy(pending, draft_len)]
            end = next((i for i, token in enumerate(ids) if token in self.stop_ids), None)
            return tuple(ids if end is None else ids[: end + 1])  # drafted on the device: verify no more
        tokens = []
        for _ in range(draft_len):
            token = int(self.sequence.feed_argmax(pending, [len(pending) - 1])[0])
            tokens.append(token)
            if token in self.stop_ids:
                break
            pending = [token]
        return tuple(tokens)

    def _p_draft(self, logits: np.ndarray, sampling: SamplingSettings) -> np.ndarray:
        """The row a sampled draft token is drawn from (V_target,): the user's settings, and
        llama.cpp's infill rule where the target's rows follow it (engine/passes.py), read in the
        target's ids. Any row is exact as long as the draft is drawn from the one verification
        is given; this one is the target's rule applied to the draft, so it accepts more."""
        vocab = infill_vocab_of(self.target.backend, len(logits)) if sampling.infill and self.target is not None else None
        return probabilities(logits, sampling, vocab)

    def _target_sized(self, logits: np.ndarray) -> np.ndarray:
        """Draft logits over the target's ids: padding ids beyond either vocabulary never win."""
        size = self.target_vocab_size
        if len(logits) >= size:
            return logits[:size]
        return np.concatenate([logits, np.full(size - len(logits), -np.inf, dtype=logits.dtype)])

    @property
    def defers_prompt(self) -> bool:
        return self.learner is None  # what it skipped, _catch_up reads; a learner starts a text here

    def prefill(self, context: Sequence[int]) -> None:
        """Read the prompt before generation starts (the engine times it as prefill, as it does
        the target's): all of it but the last token, which the first draft pass feeds. An
        alternative reads a prompt only from ``engages_from`` tokens (ENGAGE_SPANS): with a shorter
        one it never drafts for the text (AdaptivePolicy._rest_alternatives). Reading sinks + window
        of a long prompt costs a fraction of the full cache's reading it all; read at its first
        draft instead it cost more than the window saved on the rest of a 64-token answer (2,000
        tokens of context, the bench-scale pair: 1.8 s)."""
        if self.alternative_to is not None and len(context) < self.engages_from:
            return
        if self.learner is not None:  # a text begins: the target's tokens are those after its prompt
            self.learner.start_text()
            self._harvested = len(context)
        self.sequence.sync(context[:-1])

    def finish(self, context: Sequence[int]) -> None:
        """The text ends: the cache is brought to it, between answers (a chat's next turn then
        reads only what follows). Where the target's pass is shared (a server's slots) and the
        cache is more than a token or two behind (the draft was off for the end of the text), it
        catches up when next asked, if ever: reading an answer it did not draft cost the slots a
        batch pass per answer that the next request (another text) could not use."""
        if self.alternative_to is not None:  # it catches up when next asked, if ever
            return
        if self.learner is not None:  # the text's last tokens, and the unfinished window, to the learner
            if 0 <= self._harvested < len(context):
                self.learner.observe(self._harvested, context)
            self._harvested = -1
            self.learner.start_text()
        shared = self.target is not None and self.target.sharing > 0
        if not shared or len(context) - common_prefix_len(self.sequence.tokens, context) <= CATCH_UP_TOKENS:
            self.sequence.sync(context)

    def _learn(self, context: Sequence[int]) -> None:
        """Between verify passes: the target's newest tokens to the learner (a copy of a few ids),
        and adapters it has made since loaded. Drafts stay the target's to accept, so the
        weights they were drafted with change how many are accepted, never what is generated."""
        learner = self.learner
        if 0 <= self._harvested < len(context):
            learner.observe(self._harvested, context)
            self._harvested = len(context)
        fresh = learner.latest(self._learned_version)
        if fresh is not None:
            self._learned_version, weights = fresh
            try:
                self.backend.adapt(weights)
            except Exception as error:  # noqa: BLE001 — learning must never end a generation
                learner.fail(f"the draft model could not take the weights: {error}")

    def close(self) -> None:
        self.sequence.reset()
        if self.owns_backend:
            self.backend.close()


def window_alternative(view: Backend, min_prob: float = 0.0, branches: int = 0,
                       full: str = DraftModelDrafter.name) -> DraftModelDrafter:
    """The draft model drafting from ``view``, its cache of sinks and a recent window
    (backends/window.py), with the full cache's settings, as an alternative auto may ask in place
    of the drafter ``full`` (control/policy.py, AdaptivePolicy._rest_alternatives): named
    ``WINDOW_NAME``, reading a prompt only where it outgrows the window (``prefill``), closing
    ``view`` with itself."""
    drafter = DraftModelDrafter(view, min_prob=min_prob, branches=branches)
    drafter.owns_backend = True
    drafter.name = WINDOW_NAME
    drafter.alternative_to = full
    drafter.alike_below = view.sinks + view.window + view.block
    drafter.engages_from = window_engages_from(view.sinks, view.window, view.block)
    return drafter


def window_engages_from(sinks: int, window: int, block: int) -> int:
    """The prompt length from which a windowed alternative of these sizes reads a prompt and
    drafts for its text (ENGAGE_SPANS of what it holds)."""
    return ENGAGE_SPANS * (sinks + window + block)


WINDOW_NAME = "draft-window"
# A windowed alternative reads a prompt (and drafts for its text) from this many times what it holds.
# Reading it costs sinks + window tokens of prefill; what the window saves a draft pass is the cache
# past them. A 694-token prompt (window 512) took 1.1 s longer to read for nothing (the window never
# drafted); at 1,000 tokens it drafted nothing either, at 4,000 it ran 1.07x the full cache (perf.md
# 3(s)). Four spans: a judgment between, not tuned on those prompts.
ENGAGE_SPANS = 4


class PassTiming:
    """A decayed mean of a kind of pass's seconds, None until it stands on ``MIN_PASSES`` passes
    after the first (which pays for building the batch shape's graph: a cold start). Passes long
    enough that building their graph is lost in them (``cold_start`` False): from the first."""

    MIN_PASSES = 2

    def __init__(self, cold_start: bool = True) -> None:
        self.passes = 0
        self._mean: float | None = None
        self._skipped = 1 if cold_start else 0
        self._needed = self.MIN_PASSES if cold_start else 0

    def add(self, seconds: float) -> None:
        self.passes += 1
        if self.passes > self._skipped:
            self._mean = seconds if self._mean is None else 0.7 * self._mean + 0.3 * seconds

    @property
    def mean(self) -> float | None:
        return self._mean if self.passes > self._needed else None
