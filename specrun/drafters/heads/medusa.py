"""Medusa's drafter (specrun.heads.medusa.MedusaHeads): between verify passes the target's cache
holds the context but its last token, and the hidden state at the last cached position is what
the target's own head turned into that token. Head i reads it and guesses the token i + 1 places
after the context's end; the heads run in NumPy (a few small matrix-vector products), so a
proposal costs next to nothing beside a target pass."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specrun.drafters.heads.base import HeadsDrafter, target_rows
from specrun.drafters.base import EMPTY_PROPOSAL, Proposal, second_guesses
from specrun.drafters.dynamic_tree import TOP_K, grow_tree
from specrun.heads.medusa import MedusaHeads
from specrun.sampling import SamplingSettings, sample


class MedusaDrafter(HeadsDrafter):
    """Medusa heads over the target's last hidden state: head i's guess is draft i.

    Greedy, each head's argmax (over its draft vocabulary, mapped to target ids); sampled, a
    draw from each head's row under the user's settings, reported as the draft distribution
    so rejection sampling keeps the output the target's. With ``branches`` N, greedy, Medusa's
    sparse tree grown by path probability (drafters.dynamic_tree: the main chain and the N
    likeliest other nodes): head i's guesses hang under every node expanded at depth i, a
    second guess as well as the chain's node, since no head reads the drafts before its own.
    Sampled, up to N second guesses beside the chain where the heads were least sure
    (drafters.base.second_guesses).
    """

    name = "medusa"
    heads: MedusaHeads

    def head_logits(self, hidden: np.ndarray, n_heads: int) -> np.ndarray:
        """(n_heads, Vd) float32: the first ``n_heads`` heads' logits over the draft vocabulary
        for one hidden state (H,)."""
        rows = []
        for blocks, projection in zip(self.heads.blocks[:n_heads], self.heads.lm_heads[:n_heads]):
            x = hidden
            for weight, bias in blocks:
                z = weight @ x + bias
                x = x + z / (1.0 + np.exp(-z))  # silu
            rows.append(projection @ x)
        return np.stack(rows)

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
        n_heads, hidden = found
        logits = self.head_logits(hidden, n_heads)  # (n, Vd)
        if sampling.greedy and self.branches:  # every node at depth `level` reads head `level`'s row
            return grow_tree(logits[0], n_heads, TOP_K, self.branches,
                             lambda tree, chosen, level: np.repeat(logits[level][None], len(chosen), axis=0),
                             self._d2t, self.name)
        return self._chain(context, logits, sampling, rng)

    def _chain(self, context: Sequence[int], logits: np.ndarray, sampling: SamplingSettings,
               rng: np.random.Generator) -> Proposal:
        """Each head's first guess (greedy) or draw (sampled, with its row), its row masked under a
        run's grammar by what it allows after the heads before it (grammar_allows), until it allows
        none of the heads' tokens."""
        tokens, rows = [], []
        for head_logits in logits:
            head_logits = self.shaped(head_logits, sampling, context, tokens)
            if head_logits is None:
                break
            allowed = self.grammar_allows(context, tokens)
            if allowed is not None:
                if not allowed.any():
                    break
                head_logits = np.where(allowed, head_logits, -np.inf).astype(np.float32)
            if sampling.greedy:
                tokens.append(int(self._d2t[head_logits.argmax()]))
                continue
            row = target_rows(head_logits[None, :], sampling, self._d2t, self._vocab_size)[0]
            tokens.append(sample(row, rng))
            rows.append(row)
        if sampling.greedy:
            return Proposal(tuple(tokens), source=self.name)
        chain = Proposal(tuple(tokens), tuple(rows), source=self.name)
        return second_guesses(chain, rows, self.branches, sampling, rng) if self.branches else chain
