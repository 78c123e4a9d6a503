"""A smaller model with the target's vocabulary drafts autoregressively."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from specrun.backends.base import Backend
from specrun.drafters.base import EMPTY_PROPOSAL, Proposal
from specrun.kv import sequence_for
from specrun.sampling import SamplingSettings, probabilities, sample


class DraftModelDrafter:
    """Drafts with its own KV cache, kept in step with the target's context.

    The draft must also see tokens it did not draft: after a rejection the
    target's correction, and after a full accept both its own last draft (which
    it proposed but never fed) and the bonus token. ``propose`` handles both by
    rewinding to the longest cached prefix of the context and feeding the rest.
    """

    name = "draft"

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.sequence = sequence_for(backend)
        # Set by an adaptive engine: maps the longest allowed draft to the one worth drafting.
        self.length_policy: Callable[[int], int] | None = None
        # Set by the engine: the target's vocabulary size, when padding makes it differ.
        self.target_vocab_size = backend.vocab.size

    def propose(
        self,
        context: Sequence[int],
        draft_len: int,
        sampling: SamplingSettings,
        rng: np.random.Generator,
    ) -> Proposal:
        draft_len = min(draft_len, self.backend.n_ctx - len(context))
        if self.length_policy is not None and draft_len > 0:
            draft_len = self.length_policy(draft_len)
        if draft_len <= 0:
            return EMPTY_PROPOSAL
        # Keep at least the last context token unfed so its logits come out of this pass.
        keep = self.sequence.rewind_to_prefix_of(context, limit=len(context) - 1)
        pending = list(context[keep:])  # always includes the last context token
        tokens: list[int] = []
        rows: list[np.ndarray | None] = []
        for _ in range(draft_len):
            if sampling.greedy and self.target_vocab_size == self.backend.vocab.size:
                # Greedy verification needs no draft distribution: argmax stays in the backend.
                token = int(self.sequence.feed_argmax(pending, [len(pending) - 1])[0])
            elif sampling.greedy:
                token = int(self._target_sized(self.sequence.feed(pending, [len(pending) - 1])[0]).argmax())
            else:
                logits = self._target_sized(self.sequence.feed(pending, [len(pending) - 1])[0])  # (V_target,)
                p_draft = probabilities(logits, sampling)
                token = sample(p_draft, rng)
                rows.append(p_draft)
            tokens.append(token)
            pending = [token]
        return Proposal(tuple(tokens), tuple(rows), source=self.name)

    def _target_sized(self, logits: np.ndarray) -> np.ndarray:
        """Draft logits over the target's ids: padding ids beyond either vocabulary never win."""
        size = self.target_vocab_size
        if len(logits) >= size:
            return logits[:size]
        return np.concatenate([logits, np.full(size - len(logits), -np.inf, dtype=logits.dtype)])

    def finish(self, context: Sequence[int]) -> None:
        self.sequence.sync(context)

    def close(self) -> None:
        self.sequence.reset()
