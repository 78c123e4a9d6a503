"""The one drafter interface and the proposal it returns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from specrun.sampling import SamplingSettings


@dataclass(frozen=True)
class Proposal:
    """Drafted tokens as a chain, with the drafter's distributions where it has them.

    tokens: (k,) proposed ids. p_draft: k rows, each (vocab,) or None when the
    proposal is deterministic (prompt lookup, n-gram: one-hot at the token).
    parents: index of each token's parent in ``tokens`` (-1: the current last
    token). A chain is parents = (-1, 0, 1, …); trees reuse the same shape.
    kind: what the drafter knows of this proposal's odds, where they differ by far
    (prompt lookup: ``"n2"`` for a match on the last 2 tokens); an adaptive engine
    estimates acceptance for each kind of a source apart. "" for one kind.
    """

    tokens: tuple[int, ...] = ()
    p_draft: tuple[np.ndarray | None, ...] = ()
    source: str = ""
    parents: tuple[int, ...] = field(default=())
    kind: str = ""

    def __post_init__(self) -> None:
        if not self.parents:
            object.__setattr__(self, "parents", tuple(range(-1, len(self.tokens) - 1)))
        if not self.p_draft:
            object.__setattr__(self, "p_draft", (None,) * len(self.tokens))

    def __len__(self) -> int:
        return len(self.tokens)

    def prefix(self, length: int) -> "Proposal":
        """The first ``length`` drafted tokens (a chain's prefix is still a chain)."""
        if length >= len(self.tokens):
            return self
        return Proposal(
            self.tokens[:length], self.p_draft[:length], self.source, self.parents[:length], self.kind
        )

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, len(self.tokens) - 1))


EMPTY_PROPOSAL = Proposal()


class Drafter(Protocol):
    """Proposes up to ``draft_len`` tokens that may follow ``context``."""

    name: str

    def propose(
        self,
        context: Sequence[int],
        draft_len: int,
        sampling: SamplingSettings,
        rng: np.random.Generator,
    ) -> Proposal: ...

    def finish(self, context: Sequence[int]) -> None:
        """Generation ended at ``context``: leave any cache holding exactly it."""
        ...

    def close(self) -> None: ...
