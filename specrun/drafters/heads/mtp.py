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
proposal); the NumPy layer drafts the trees. Both give the same drafts (tests/heads/test_mtp.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from specrun.backends.kv import KVSequence, common_prefix_len
from specrun.drafters.base import EMPTY_PROPOSAL, Proposal, second_guesses
from specrun.drafters.heads.base import target_rows
from specrun.drafters.heads.eagle import EagleDrafter
from specrun.heads.mtp import MtpHeads
from specrun.modelkit.mtp import gguf_model_key
from specrun.sampling import SamplingSettings, sample


class MtpDrafter(EagleDrafter):
    """A target's own MTP layer (see the module's docstring)."""

    name = "mtp"
    heads: MtpHeads
    _own_file = False  # were the heads read from the target's own GGUF (bind)?

    def bind(self, target: KVSequence, clock: Callable[[], float]) -> None:
        super().bind(target, clock)
        self._native, self._native_context = None, []
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
        native = self._native_mtp()
        trees = sampling.greedy and self.branches and self.target.backend.tree_support.available
        if native is None or trees:  # a tree the target cannot verify would be its main chain: drafted natively
            return super().propose(context, draft_len, sampling, rng)
        depth = min(draft_len, self.heads.config.num_heads)
        if depth <= 0 or len(context) < 2:
            return EMPTY_PROPOSAL
        root = len(context) - 2
        tokens, rows = [], []
        try:
            logits = self._native_root(native, context)
            if logits is None:  # fed while tracking was off (a cache from before the heads were in use)
                return EMPTY_PROPOSAL
            for step in range(depth):
                if sampling.greedy:
                    tokens.append(int(logits.argmax()))
                else:
                    row = target_rows(logits[None, :], sampling, self._d2t, self._vocab_size)[0]
                    tokens.append(sample(row, rng))
                    rows.append(row)
                if step + 1 == depth:
                    break
                logits = native.feed(tokens[-1:], native.own_state()[None, :], logits=True)
        except RuntimeError:  # llama.cpp refused a pass (memory): draft nothing now, catch up afresh next time
            native.keep(0)
            self._native_context = []
            return EMPTY_PROPOSAL
        finally:
            native.keep(root + 1)  # the chain's own pairs go; the context's stay
        if sampling.greedy:
            return Proposal(tuple(tokens), source=self.name)
        chain = Proposal(tuple(tokens), tuple(rows), source=self.name)
        return second_guesses(chain, rows, self.branches, sampling, rng) if self.branches else chain

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

    def close(self) -> None:
        super().close()
        self._native, self._native_context = None, []
