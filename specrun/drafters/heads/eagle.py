"""EAGLE: drafts made one token at a time by a single layer over the target's own features.

Between verify passes the target's cache holds the context but its last token, and it has kept
its features (hidden states) for them. The drafter keeps the layer's keys and values for the last
``window`` positions of the context (each from the target's real feature there and the token
after it, computed once, as the context grows), runs the layer at the context's second-to-last
position (real feature, real last token: its predicted feature gives the first draft), then on
its own predictions (the feature it predicted, the token it drafted), reading the context's
entries and its own draft's (specrun.heads.eagle).

Greedy with ``branches``, it grows EAGLE-2's dynamic tree: at each depth the ``top_k`` likeliest
nodes (by the product of the drafter's probabilities along their path) are expanded, each by its
``top_k`` likeliest tokens, and the tree proposed is the main chain (the first guess at every
depth) and the ``branches`` likeliest other nodes. Sampled, a chain of draws from the layer's
distributions (reported, so rejection sampling keeps the output the target's) with second
guesses where its drafter was least sure (drafters.base.second_guesses): a node kept for its
own drawn value would bias what the verifier accepts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from specrun.backends.kv import KVSequence, common_prefix_len
from specrun.drafters.base import EMPTY_PROPOSAL, Proposal, second_guesses
from specrun.drafters.dynamic_tree import TOP_K, DraftTree, grow_tree
from specrun.drafters.heads.base import HeadsDrafter, check_heads_target, target_rows
from specrun.errors import UsageError
from specrun.heads.eagle import EagleHeads
from specrun.heads.eagle3 import Eagle3Heads
from specrun.heads.config import default_aux_layer_ids
from specrun.sampling import SamplingSettings, sample

# A verify pass feeds at most 1 + 64 tokens; a prompt pass keeps the features of its last ``window``.
VERIFY_ROWS = 65


@dataclass
class LayerEntries:
    """The layer's keys and values (C, nh, hd) of context positions first .. first + C - 1, and the
    context they were made from. ``floor``: where they began, the target's features before it
    unknown (the head of a long prompt pass), so entries from there on are all there are; -1
    where earlier features are known."""

    first: int = 0
    keys: np.ndarray | None = None
    values: np.ndarray | None = None
    context: list[int] = field(default_factory=list)
    floor: int = -1

    @property
    def end(self) -> int:
        return self.first + (0 if self.keys is None else len(self.keys))

    def keep_before(self, position: int) -> None:
        if self.keys is not None and position < self.end:
            count = max(position - self.first, 0)
            self.keys, self.values = self.keys[:count], self.values[:count]
            if count == 0:  # nothing left: what the floor said of earlier features no longer holds
                self.first, self.floor = position, -1

    def keep_from(self, position: int) -> None:
        if self.keys is not None and position > self.first:
            drop = min(position - self.first, len(self.keys))
            self.keys, self.values = self.keys[drop:], self.values[drop:]
            self.first += drop


class SharedEmbedding:
    """A target's input embedding as EAGLE-3 heads without their own read it (``rows[ids]``,
    (N, H)): each row asked from the backend once (Backend.token_embeddings)."""

    def __init__(self, backend, size: int) -> None:
        self._backend, self._size = backend, size
        self._rows: dict[int, np.ndarray] = {}

    def __getitem__(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        missing = sorted({int(token) for token in ids} - self._rows.keys())
        if missing:
            self._rows.update(zip(missing, self._backend.token_embeddings(missing)))
        if not len(ids):
            return np.zeros((0, self._size), np.float32)
        return np.stack([self._rows[int(token)] for token in ids])


def _shared_embedding(heads: Eagle3Heads, backend, named: str = "these EAGLE-3 heads") -> SharedEmbedding:
    """The target's embedding for ``heads`` that hold none, or the UsageError saying why it cannot serve."""
    fix = "use EAGLE-3 heads that hold their embed_tokens.weight"
    support = backend.hidden_support
    if heads.draft_hidden_size != support.size:
        raise UsageError(f"{named} hold no embed_tokens and are {heads.draft_hidden_size} wide, so they "
                         f"cannot read the target's embedding ({support.size} wide)", fix)
    embedding = SharedEmbedding(backend, support.size)
    try:
        embedding[[0]]
    except ValueError as error:
        raise UsageError(f"{named} hold no embed_tokens, and the target's cannot be read: {error}", fix) from None
    return embedding


def eagle3_layers(heads: Eagle3Heads, backend) -> tuple[int, ...]:
    """The target layers EAGLE-3 ``heads`` read: those their file names, else SGLang's for its depth."""
    return heads.aux_layer_ids or default_aux_layer_ids(backend.hidden_support.layers)


def check_eagle3_target(heads, backend, path=None) -> None:
    """For EAGLE-3 heads (others pass), the UsageError naming ``path`` where ``backend`` cannot give
    the layers they read, or they hold no embedding and the target's cannot serve them: checked
    where heads are chosen, so a run (auto) can go on without them."""
    if not isinstance(heads, Eagle3Heads) or not backend.hidden_support.available:
        return
    named = f"the EAGLE-3 heads in {path}" if path is not None else "these EAGLE-3 heads"
    layers = eagle3_layers(heads, backend)
    try:
        backend.hidden_support.check_layers(layers)
    except ValueError as error:
        raise UsageError(f"{named} read the outputs of the target's layers {', '.join(map(str, layers))}, and "
                         f"{backend.name} {str(error).removeprefix('this backend ')}",
                         "use another method with this target") from None
    if heads.embed_tokens is None:
        _shared_embedding(heads, backend, named)


class EagleDrafter(HeadsDrafter):
    """EAGLE heads over the target's features (see the module's docstring)."""

    name = "eagle"
    heads: EagleHeads | Eagle3Heads
    _drafting_after: Sequence[int] = ()  # the context of the proposal being drafted (_draw's grammar)

    def __init__(self, heads: EagleHeads | Eagle3Heads, branches: int = 0, top_k: int = TOP_K) -> None:
        super().__init__(heads, branches)
        self._own_heads = heads  # as given: bind may lend EAGLE-3 heads the target's embedding
        self.top_k = top_k
        # The layer reads the target's features ``window`` positions back (a verify pass's rows at least).
        self.hidden_tail = max(VERIFY_ROWS, heads.window)
        self._entries = LayerEntries()
        self._dtype = heads.dtype

    def bind(self, target: KVSequence, clock: Callable[[], float]) -> None:
        """Read the target's features from now on: turns its tracking on. EAGLE-3 heads without
        an embedding of their own (SpecForge's export for SGLang leaves it to the target) read the
        target's."""
        self.heads = self._own_heads
        if isinstance(self.heads, Eagle3Heads) and self.heads.embed_tokens is None:
            check_heads_target(self.name, self.heads.config, target, self.target_layers(target))  # its own words first
            self.heads = dataclasses.replace(self.heads, embed_tokens=_shared_embedding(self.heads, target.backend))
        super().bind(target, clock)
        self._entries = LayerEntries()

    def swap_heads(self, heads: EagleHeads | Eagle3Heads) -> None:
        """Newer weights: the context's keys and values are the old layer's, so they are made again
        (from the target's features, which the drafter keeps ``window`` back); EAGLE-3 heads
        without an embedding of their own keep reading the target's."""
        if isinstance(heads, Eagle3Heads) and heads.embed_tokens is None:
            heads = dataclasses.replace(heads, embed_tokens=self.heads.embed_tokens)
        self.heads = heads
        self._dtype = heads.dtype
        self._entries = LayerEntries()

    def target_layers(self, target: KVSequence) -> tuple[int, ...]:
        """EAGLE-3's: the layers its file names, else those SGLang reads for a target this deep."""
        return eagle3_layers(self.heads, target.backend) if isinstance(self.heads, Eagle3Heads) else ()

    # ---- the context's entries ---------------------------------------------------------------
    def _root(self, context: Sequence[int]) -> np.ndarray | None:
        """The feature (1, H) the layer predicts at the context's second-to-last position, its
        entries brought up to date on the way; None where the target has no features for it."""
        out, self._entries = self._layer_root(context, self.heads, self._entries)
        return out

    def _layer_root(self, context: Sequence[int], heads,
                    entries: LayerEntries) -> tuple[np.ndarray | None, LayerEntries]:
        """``_root`` for the layer ``heads`` keeping ``entries``: its root feature (or None) and its
        entries as they now are (new ones where they began again)."""
        window = heads.window
        root = len(context) - 2
        # The root's entry is made again each time: its predicted feature is the draft's first.
        entries.keep_before(min(common_prefix_len(entries.context, context) - 1, root))
        lowest = max(root + 1 - window, 0)
        reusable = (entries.keys is not None and lowest <= entries.end
                    and (entries.first <= lowest or entries.first == entries.floor))
        start = entries.end if reusable else lowest
        features = self._features(start, root + 1, context)
        if features is None:
            start = self._first_known(start, root + 1, context)
            if start is None:
                return None, LayerEntries()
            features = self._features(start, root + 1, context)
        if not reusable or start > entries.end:  # begin again where the features are
            entries = LayerEntries(start, heads.no_entries(self._dtype), heads.no_entries(self._dtype),
                               floor=start if start > lowest else -1)
        entries.keep_from(root + 1 - window)
        positions = np.arange(start, root + 1)
        following = heads.embedding_rows(np.asarray(context[start + 1 : root + 2]))  # the token after each
        fused = heads.fuse(heads.target_features(features), following)
        earlier = np.arange(entries.first, entries.end)
        attend = np.concatenate([
            positions[:, None] - earlier[None, :] < window,
            (positions[:, None] >= positions[None, :]) & (positions[:, None] - positions[None, :] < window),
        ], axis=1)
        out, keys, values = heads.layer(fused, positions, entries.keys, entries.values, attend)
        entries.keys = np.concatenate([entries.keys, keys])
        entries.values = np.concatenate([entries.values, values])
        entries.context = list(context)
        return out[-1:], entries

    def _features(self, start: int, stop: int, context: Sequence[int]) -> np.ndarray | None:
        """The target's features at positions [start, stop) as this context's, or None."""
        target = self.target
        if stop > len(target.tokens) or list(target.tokens[start:stop]) != list(context[start:stop]):
            return None
        features = target.hidden(start, stop)
        return None if features is None else features.astype(self._dtype)

    def _first_known(self, start: int, stop: int, context: Sequence[int]) -> int | None:
        """The lowest position from ``start`` whose features, and all after it to ``stop``, are known."""
        if self._features(stop - 1, stop, context) is None:
            return None
        low, high = start, stop - 1  # high is known
        while low < high:
            middle = (low + high) // 2
            if self._features(middle, stop, context) is None:
                low = middle + 1
            else:
                high = middle
        return high

    # ---- drafting ------------------------------------------------------------------------------
    def propose(
        self,
        context: Sequence[int],
        draft_len: int,
        sampling: SamplingSettings,
        rng: np.random.Generator,
    ) -> Proposal:
        self.learn(context)
        self._drafting_after = context
        depth = min(draft_len, self.heads.config.num_heads)
        if depth <= 0 or self.target is None or len(context) < 2:
            return EMPTY_PROPOSAL
        root = self._root(context)
        if root is None:  # fed while tracking was off (a cache from before the heads were in use)
            return EMPTY_PROPOSAL
        if sampling.greedy and self.branches:
            return self._tree(root, len(context) - 2, depth)
        return self._chain(root, len(context) - 2, depth, sampling, rng)

    def _step(self, features: np.ndarray, drafts: np.ndarray, position: int,
              own_keys: np.ndarray, own_values: np.ndarray, own_reads: np.ndarray):
        """The layer at ``position`` for N nodes: their parents' predicted features (N, H) and
        the target ids they drafted (N,), each reading the context's entries in the window and, of
        the draft's entries so far (D, nh, hd), those ``own_reads`` (N, D) marks (its ancestors)."""
        heads = self.heads
        entries = self._entries
        earlier = np.arange(entries.first, entries.end)
        count = len(drafts)
        attend = np.concatenate([
            np.broadcast_to(position - earlier[None, :] < heads.window, (count, len(earlier))),
            own_reads, np.eye(count, dtype=bool),
        ], axis=1)
        fused = heads.fuse(features, heads.embedding_rows(drafts))
        return heads.layer(fused, np.full(count, position), np.concatenate([entries.keys, own_keys]),
                           np.concatenate([entries.values, own_values]), attend)

    def _chain(self, feature: np.ndarray, root: int, depth: int, sampling: SamplingSettings,
               rng: np.random.Generator) -> Proposal:
        """The chain of first guesses (greedy) or draws (sampled, with their rows)."""
        keys, values = self.heads.no_entries(self._dtype), self.heads.no_entries(self._dtype)
        tokens, rows = [], []
        for step in range(depth):
            if not self._draw(self.heads.logits(feature)[0], sampling, rng, tokens, rows):
                break
            if step + 1 == depth:
                break
            reads = np.ones((1, len(keys)), bool)
            feature, key, value = self._step(feature, np.array(tokens[-1:]), root + 1 + step, keys, values, reads)
            keys, values = np.concatenate([keys, key]), np.concatenate([values, value])
        return self._chain_proposal(tokens, rows, sampling, rng)

    def _draw(self, logits: np.ndarray, sampling: SamplingSettings, rng: np.random.Generator, tokens: list[int],
              rows: list[np.ndarray]) -> bool:
        """The next token of a chain from the layer's ``logits`` (Vd,): its first guess (greedy), or a
        draw with the row it was drawn from (sampled), appended to ``tokens`` (and ``rows``). Under a
        run's grammar (``follows_grammar``) the logits are masked by what it allows after the chain so
        far, and False (nothing drawn) where it allows none of the heads' tokens, or a reasoning
        budget forces a token past them (``shaped``): the chain ends."""
        logits = self.shaped(logits, sampling, self._drafting_after, tokens)
        if logits is None:
            return False
        allowed = self.grammar_allows(self._drafting_after, tokens)
        if allowed is not None:
            if not allowed.any():
                return False
            logits = np.where(allowed, logits, -np.inf).astype(np.float32)
        if sampling.greedy:
            tokens.append(int(self._d2t[logits.argmax()]))
        else:
            row = target_rows(logits[None, :], sampling, self._d2t, self._vocab_size)[0]
            tokens.append(sample(row, rng))
            rows.append(row)
        return True

    def _chain_proposal(self, tokens: list[int], rows: list[np.ndarray], sampling: SamplingSettings,
                        rng: np.random.Generator) -> Proposal:
        """The chain drawn, with its rows where sampled and second guesses where the drafter branches."""
        if sampling.greedy:
            return Proposal(tuple(tokens), source=self.name)
        chain = Proposal(tuple(tokens), tuple(rows), source=self.name)
        return second_guesses(chain, rows, self.branches, sampling, rng) if self.branches else chain

    def _tree(self, feature: np.ndarray, root: int, depth: int) -> Proposal:
        """EAGLE-2's dynamic tree (greedy): the main chain, then the ``branches`` likeliest other nodes."""
        keys, values = self.heads.no_entries(self._dtype), self.heads.no_entries(self._dtype)
        expanded: list[int] = []  # the nodes with entries, in the order of keys
        features = {-1: feature[0]}

        def expand(tree: DraftTree, chosen: list[int], level: int) -> np.ndarray:
            nonlocal keys, values
            parents = np.array([tree.parents[node] for node in chosen])
            reads = np.array([[tree.is_ancestor(other, node) for other in expanded] for node in chosen], bool)
            reads = reads.reshape(len(chosen), len(expanded))
            out, key, value = self._step(np.stack([features[parent] for parent in parents]),
                                         self._d2t[[tree.drafts[node] for node in chosen]],
                                         root + level, keys, values, reads)
            keys, values = np.concatenate([keys, key]), np.concatenate([values, value])
            expanded.extend(chosen)
            features.update(zip(chosen, out))
            return self.heads.logits(out)  # (N, Vd)

        return grow_tree(self.heads.logits(feature)[0], depth, self.top_k, self.branches, expand,
                         self._d2t, self.name)

    def close(self) -> None:
        super().close()
        self._entries = LayerEntries()

