"""MTP: drafts from the multi-token-prediction layer the target carries (specrun.heads.mtp).

The layer reads what EAGLE's reads (the target's state at p beside the token at p + 1) and feeds
on its own output state and guess from the second step on, as llama.cpp's draft-mtp drives a
one-layer head, so EAGLE's drafter drives it: the context's entries kept as the context grows,
chains (draws with their rows at T > 0) and, greedy with ``branches``, EAGLE-2's dynamic tree from
its top-k rows.

On MLX the layer runs in MLX arrays (Backend.mtp_layer: backends/mtp_mlx.py). Where the backend
runs the model's MTP layers itself (Backend.native_mtp: llama.cpp), chains are
drafted there, the layer's entries held in its own cache and kept in step with the context as
the NumPy entries are (dropped from where the context changed, the chain's own dropped after each
proposal). Greedy trees grow there too, a level's chosen nodes in one batch, each node in a
sequence of its own copied from its parent's (the context's sequence 0 for the root's children),
so it reads the context and its ancestors, its own state read back by its row
(``llama_get_embeddings_nextn_ith``); the tree's sequences are emptied after. The NumPy layer
grows the trees of a server slot's drafter (the slots' sequences leave none spare) and of layers
chained one a depth. Both give the same drafts (tests/heads/test_mtp.py).

A model with several MTP layers, one trained for each draft depth (MtpHeads.chained), drafts as
llama.cpp's draft-mtp chains such heads (common/speculative.cpp, ``chain_heads``): every layer
keeps its own entries of the context, made from the target's states as the first layer's are;
the first layer drafts the first token from the root pair, and layer i the token after the
i-th from the root pair and the draft so far, its row t reading the state layer t - 1 gave the
row before and the t-th draft token. A chain is at most as deep as there are layers. Greedy
trees grow the same way, a node at depth i read by layer i along its own path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from specrun.backends.kv import KVSequence, common_prefix_len
from specrun.drafters.base import EMPTY_PROPOSAL, Proposal
from specrun.drafters.dynamic_tree import DraftTree, grow_tree
from specrun.drafters.heads.eagle import EagleDrafter, LayerEntries
from specrun.heads.mtp import MtpHeads
from specrun.modelkit.mtp import gguf_model_key
from specrun.sampling import SamplingSettings


class _NoSequences(Exception):
    """A native tree would need more sequences than its MTP context holds."""


class MtpDrafter(EagleDrafter):
    """A target's own MTP layer (see the module's docstring)."""

    name = "mtp"
    heads: MtpHeads
    _own_file = False  # were the heads read from the target's own GGUF (bind)?

    def bind(self, target: KVSequence, clock: Callable[[], float]) -> None:
        super().bind(target, clock)
        self._native, self._native_context = None, []
        self._later: list[LayerEntries] = []  # the context's entries of each chained layer after the first
        layer = target.backend.mtp_layer(self._own_heads)  # MLX: the layer in its arrays
        if layer is not None:
            self.heads = layer
        # llama.cpp's MTP context runs the target file's own layer: heads read from another file
        # (--heads) draft in NumPy
        path = getattr(target.backend, "path", None)
        source = getattr(self._own_heads, "source", "")
        self._own_file = bool(source) and path is not None and source == gguf_model_key(path)

    def _native_mtp(self):
        return self.target.backend.native_mtp() if self.target is not None and self._own_file else None

    def propose(
        self,
        context: Sequence[int],
        draft_len: int,
        sampling: SamplingSettings,
        rng: np.random.Generator,
    ) -> Proposal:
        self._drafting_after = context
        native = self._native_mtp()
        trees = sampling.greedy and self.branches and self.target.backend.tree_support.available
        # a tree the target cannot verify would be its main chain: drafted natively; layers chained
        # one a depth are drafted here (llama.cpp's graphs for these layouts run one MTP block), and
        # trees where the context has no sequences for them (a server slot's)
        native_trees = trees and native is not None and getattr(native, "tree_seqs", 0) > 0
        if native is None or (trees and not native_trees) or self.heads.chained:
            return super().propose(context, draft_len, sampling, rng)
        depth = min(draft_len, self.heads.config.num_heads)
        if depth <= 0 or len(context) < 2:
            return EMPTY_PROPOSAL
        if native_trees:
            tree = self._natively(native, context, lambda logits: self._native_tree(native, context, depth, logits))
            return tree if tree is not None else super().propose(context, draft_len, sampling, rng)

        def chain(logits: np.ndarray) -> Proposal:
            tokens, rows = [], []
            for step in range(depth):
                if not self._draw(logits, sampling, rng, tokens, rows):
                    break
                if step + 1 == depth:
                    break
                logits = native.feed(tokens[-1:], native.own_state()[None, :], logits=True)
            return self._chain_proposal(tokens, rows, sampling, rng)

        return self._natively(native, context, chain)

    def _natively(self, native, context: Sequence[int], draft: Callable[[np.ndarray], Proposal | None]):
        """``draft(the root's logits)`` in llama.cpp's MTP context, under its lock (a server's slots
        share it: the states read are this draft's own). Nothing drafted where the target has no
        states (fed while tracking was off) or llama.cpp refuses a pass (memory: the context catches
        up afresh next time); the pairs drafted after the root go, the context's stay."""
        root = len(context) - 2
        with native.lock:
            try:
                logits = self._native_root(native, context)
                return EMPTY_PROPOSAL if logits is None else draft(logits)
            except RuntimeError:
                native.keep(0)
                self._native_context = []
                return EMPTY_PROPOSAL
            finally:
                native.keep(root + 1)

    def _native_tree(self, native, context: Sequence[int], depth: int, logits: np.ndarray) -> Proposal | None:
        """EAGLE-2's dynamic tree (greedy) from the root's ``logits`` in llama.cpp's MTP context (held
        by ``_natively``): each level's chosen nodes in one batch, every node in a sequence of its own
        made from its parent's (the context's for the root's children), so it reads the context and
        its own ancestors; the tree's sequences emptied after. None where the tree would need more
        sequences than the context has (the NumPy layer grows it then)."""
        root = len(context) - 2
        made: list[int] = []
        states, seqs = {-1: native.own_state()}, {-1: 0}

        def expand(tree: DraftTree, chosen: list[int], level: int) -> np.ndarray:
            first = len(made) + 1
            if first + len(chosen) - 1 > native.tree_seqs:
                raise _NoSequences
            ids = list(range(first, first + len(chosen)))
            parents = [tree.parents[node] for node in chosen]
            made.extend(ids)  # before the pass: a level that fails is emptied with the rest
            rows, out = native.tree_rows([seqs[parent] for parent in parents], ids,
                                         self._d2t[[tree.drafts[node] for node in chosen]],
                                         np.stack([states[parent] for parent in parents]), root + 1 + level)
            seqs.update(zip(chosen, ids))
            states.update(zip(chosen, out))
            return rows

        try:
            return grow_tree(logits, depth, self.top_k, self.branches, expand, self._d2t, self.name)
        except _NoSequences:
            return None
        finally:
            native.drop_tree(made)

    def _native_root(self, native, context: Sequence[int]) -> np.ndarray | None:
        """The native layer's logits (V,) at the root pair (the target's state at the context's
        second-to-last position, its last token), the pairs before it brought up to date on the way
        and the root's fed alone (its own state is read next); None where the target has no states."""
        if native is not self._native:  # a new context (the target's was made again): it holds nothing
            self._native, self._native_context = native, []
        root = len(context) - 2
        native.keep(min(native.end, max(common_prefix_len(self._native_context, context) - 1, 0), root))
        start = native.end
        features = self._features(start, root + 1, context)
        if features is None:
            start = self._first_known(start, root + 1, context)
            if start is None:
                return None
            native.keep(0)  # begin again where the states are known
            features = self._features(start, root + 1, context)
        self._native_context = list(context)
        if root > start:
            native.feed(context[start + 1 : root + 1], features[:-1], at=start)
        return native.feed(context[root + 1 : root + 2], features[-1:], logits=True, at=root)

    # ---- several layers, one a depth ----------------------------------------------------------
    def _root(self, context: Sequence[int]) -> np.ndarray | None:
        """The first layer's root feature (EagleDrafter's); with chained layers, every later layer's
        entries of the context (the root pair's too) brought up to date beside it."""
        feature = super()._root(context)
        layers = self.heads.layers
        if feature is not None and len(layers) > 1:
            self._later.extend(LayerEntries() for _ in range(len(layers) - 1 - len(self._later)))
            for index in range(1, len(layers)):
                _, self._later[index - 1] = self._layer_root(context, layers[index], self._later[index - 1])
        return feature

    def _chain(self, feature: np.ndarray, root: int, depth: int, sampling: SamplingSettings,
               rng: np.random.Generator) -> Proposal:
        if self.heads.chained:
            return self._chained_chain(feature, root, depth, sampling, rng)
        return super()._chain(feature, root, depth, sampling, rng)

    def _tree(self, feature: np.ndarray, root: int, depth: int) -> Proposal:
        if self.heads.chained:
            return self._chained_tree(feature, root, depth)
        return super()._tree(feature, root, depth)

    def _chained_rows(self, index: int, features: np.ndarray, drafts: np.ndarray, positions: np.ndarray,
                      reads: np.ndarray) -> np.ndarray:
        """Layer ``index``'s states (N, H) for draft rows: their parents' states ``features`` (N, H)
        and target ids ``drafts`` (N,) at ``positions`` (N,), each reading the layer's entries of the
        context in the window and the rows ``reads`` (N, N) marks (its ancestors and itself)."""
        heads, entries = self.heads.layers[index], self._later[index - 1]
        earlier = np.arange(entries.first, entries.end)
        attend = np.concatenate([positions[:, None] - earlier[None, :] < heads.window, reads], axis=1)
        fused = heads.fuse(features, heads.embedding_rows(drafts))
        out, _, _ = heads.layer(fused, positions, entries.keys, entries.values, attend)
        return out

    def _chained_chain(self, feature: np.ndarray, root: int, depth: int, sampling: SamplingSettings,
                       rng: np.random.Generator) -> Proposal:
        """The chain of first guesses (greedy) or draws (sampled, with their rows), token i + 1 by
        layer i over the draft's first i tokens."""
        layers = self.heads.layers
        states, tokens, rows = [feature[0]], [], []
        for step in range(depth):
            if not self._draw(layers[step].logits(states[-1][None, :])[0], sampling, rng, tokens, rows):
                break
            if step + 1 == depth:
                break
            count = step + 1  # rows 1 .. count: (the state before, the token drafted there)
            out = self._chained_rows(count, np.stack(states), np.array(tokens), root + 1 + np.arange(count),
                                     np.tri(count, dtype=bool))
            states.append(out[-1])
        return self._chain_proposal(tokens, rows, sampling, rng)

    def _chained_tree(self, feature: np.ndarray, root: int, depth: int) -> Proposal:
        """EAGLE-2's dynamic tree (greedy), the nodes at depth i expanded by layer i along their paths."""
        layers = self.heads.layers
        states = {-1: feature[0]}

        def expand(tree: DraftTree, chosen: list[int], level: int) -> np.ndarray:
            rows = sorted({node for each in chosen for node in tree.lineage(each)}, key=lambda node: tree.depths[node])
            reads = np.array([[other == node or tree.is_ancestor(other, node) for other in rows] for node in rows],
                             bool).reshape(len(rows), len(rows))
            out = self._chained_rows(level, np.stack([states[tree.parents[node]] for node in rows]),
                                     self._d2t[[tree.drafts[node] for node in rows]],
                                     root + np.array([tree.depths[node] for node in rows]), reads)
            at = {node: i for i, node in enumerate(rows)}
            states.update((node, out[at[node]]) for node in chosen)
            return layers[level].logits(np.stack([states[node] for node in chosen]))

        return grow_tree(layers[0].logits(feature)[0], depth, self.top_k, self.branches, expand, self._d2t, self.name)

    def swap_heads(self, heads) -> None:
        super().swap_heads(heads)
        self._later = []

    def close(self) -> None:
        super().close()
        self._native, self._native_context = None, []
        self._later = []
