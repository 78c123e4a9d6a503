"""Hydra: Medusa's heads made sequentially dependent (specrun.heads.hydra says what they are).

Between verify passes the target's cache holds the context but its last token; the hidden state
at the last cached position is what the target turned into that last token. Head i reads it with
the last token and the drafts before its own, and guesses the next. Only the heads' own small
arrays are read (NumPy), never the target.

Greedy with ``branches``, the drafter grows EAGLE-2's dynamic tree by path probability
(drafters.dynamic_tree): every expanded node's children come from the head of its depth reading
that node's own path. Sampled, a chain of draws, each from its head's row given the draws before
it (reported, so rejection sampling keeps the output the target's), with second guesses where the
heads were least sure (drafters.base.second_guesses), as EAGLE's drafter does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specrun.drafters.base import EMPTY_PROPOSAL, Proposal, second_guesses
from specrun.drafters.dynamic_tree import TOP_K, DraftTree, grow_tree
from specrun.drafters.heads.base import HeadsDrafter, target_rows
from specrun.heads.hydra import HydraHeads, head_logits, root_terms
from specrun.sampling import SamplingSettings, sample


class HydraDrafter(HeadsDrafter):
    """Hydra heads over the target's last hidden state (see the module's docstring)."""

    name = "hydra"
    heads: HydraHeads

    def __init__(self, heads: HydraHeads, branches: int = 0, top_k: int = TOP_K) -> None:
        super().__init__(heads, branches)
        self.top_k = top_k

    def propose(
        self,
        context: Sequence[int],
        draft_len: int,
        sampling: SamplingSettings,
        rng: np.random.Generator,
    ) -> Proposal:
        found = self.last_state(context, draft_len)
        if found is None:
            return EMPTY_PROPOSAL
        depth, hidden = found
        state = hidden.astype(self.heads.embed.dtype)  # (H,)
        last = int(self.heads.draft_ids(np.array([context[-1]]))[0])
        if sampling.greedy and self.branches:
            return self._tree(state, last, depth)
        return self._chain(state, last, depth, sampling, rng, context)

    def _logits(self, head: int, state: np.ndarray, paths: np.ndarray) -> np.ndarray:
        """Head ``head``'s logits (N, Vd) for the embedding rows ``paths`` (N, head + 1)."""
        return head_logits(self.heads, head, state, root_terms(self.heads, head, state), paths)

    def _chain(self, state: np.ndarray, last: int, depth: int, sampling: SamplingSettings,
               rng: np.random.Generator, context: Sequence[int] = ()) -> Proposal:
        """The chain of first guesses (greedy) or draws (sampled, with their rows), within a run's
        grammar where it has one (grammar_allows, after ``context``)."""
        path, tokens, rows = [last], [], []
        for head in range(depth):
            logits = self.shaped(self._logits(head, state, np.array([path]))[0], sampling, context, tokens)  # (Vd,)
            if logits is None:
                break
            allowed = self.grammar_allows(context, tokens)
            if allowed is not None:
                if not allowed.any():
                    break
                logits = np.where(allowed, logits, -np.inf).astype(np.float32)
            if sampling.greedy:
                draft = int(logits.argmax())
            else:
                row = target_rows(logits[None, :], sampling, self._d2t, self._vocab_size)[0]
                rows.append(row)
                draft = int(self.heads.draft_ids(np.array([sample(row, rng)]))[0])
            path.append(draft)
            tokens.append(int(self._d2t[draft]))
        if sampling.greedy:
            return Proposal(tuple(tokens), source=self.name)
        chain = Proposal(tuple(tokens), tuple(rows), source=self.name)
        return second_guesses(chain, rows, self.branches, sampling, rng) if self.branches else chain

    def _tree(self, state: np.ndarray, last: int, depth: int) -> Proposal:
        """The dynamic tree (greedy): the main chain, then the ``branches`` likeliest other nodes."""

        def expand(tree: DraftTree, chosen: list[int], level: int) -> np.ndarray:
            paths = np.array([[last, *tree.path(node)] for node in chosen])  # (N, level + 1)
            return self._logits(level, state, paths)

        root_logits = self._logits(0, state, np.array([[last]]))[0]
        return grow_tree(root_logits, depth, self.top_k, self.branches, expand, self._d2t, self.name)
