"""Lookahead decoding (Fu et al. 2024): Jacobi iterations over a window of future positions
feed an n-gram pool, and the pool's n-grams that start with the last token are verified.

The window holds ``ngram - 1`` levels of ``window`` guessed tokens. Level j, column i sits
``i + j`` positions past the last context token: level 0 is a chain from it (its column 0 is
the last token itself), and each later level's token follows the token above it in its
column. Every one of these tokens attends to exactly its ancestors on those lines, so the
window is a token tree rooted at the last token (llama.cpp's sequence layout in
``llama-lookahead`` says the same), and it goes into the verify pass beside the pool's
candidates as one tree (``Proposal.parents``). The target's choice after each last-level
token is the next Jacobi guess for its column: after the pass the levels move up one, the
new last level is those choices, and each column read top to bottom (with the token that
just left level 0 in front) is an n-gram the pool keeps.

Every node is a deterministic proposal: the verifier accepts the longest path the target
agrees with (greedy) or samples through the tree (SpecInfer's rule, one-hot drafts), so the
output is the target's whatever the window holds. The window only decides how often the
pool's candidates are right; it learns from every node, accepted or not, which is why the
drafter reads the whole pass (``reads_pass``) and wants its proposal verified whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specrun.drafters.base import EMPTY_PROPOSAL, Drafter, Proposal
from specrun.sampling import SamplingSettings

# Sizes that fit the engine's default cap on a pass's nodes (24, DEFAULT_TREE_NODES):
# (window - 1) + window * (ngram - 2) window nodes and up to candidates * (ngram - 1) more.
DEFAULT_WINDOW = 5
DEFAULT_NGRAM = 4
DEFAULT_CANDIDATES = 3
# The sizes accepted (``--lookahead``): a wider window or longer n-grams than these cost a
# pass far more than they can win back on any machine specrun targets.
WINDOW_RANGE = (2, 32)
NGRAM_RANGE = (2, 8)
CANDIDATES_RANGE = (0, 32)


@dataclass(frozen=True)
class LookaheadSizes:
    """The window's columns, the n-gram length (levels + 1) and the most candidates verified."""

    window: int = DEFAULT_WINDOW
    ngram: int = DEFAULT_NGRAM
    candidates: int = DEFAULT_CANDIDATES

    def __post_init__(self) -> None:
        for name, (low, high) in (("window", WINDOW_RANGE), ("ngram", NGRAM_RANGE), ("candidates", CANDIDATES_RANGE)):
            value = getattr(self, name)
            if not low <= value <= high:
                raise ValueError(f"{name} must be {low} to {high}, got {value}")

    def __str__(self) -> str:
        return f"{self.window}:{self.ngram}:{self.candidates}"

    @property
    def levels(self) -> int:
        return self.ngram - 1

    @property
    def paths(self) -> int:
        """Root-to-leaf paths a proposal may have: one a window column, one a candidate."""
        return self.window + self.candidates

    @property
    def max_nodes(self) -> int:
        """The most drafted nodes one proposal brings (fewer where tokens repeat and share nodes)."""
        return (self.window - 1) + self.window * (self.levels - 1) + self.candidates * self.levels


# The sizes chosen from (control/forecasts.py, ``choose_sizes``), smallest first.
LADDER = (
    LookaheadSizes(3, 3, 2),
    LookaheadSizes(4, 3, 3),
    LookaheadSizes(5, 4, 3),
    LookaheadSizes(7, 4, 7),
    LookaheadSizes(10, 5, 10),
    LookaheadSizes(15, 5, 15),
)


class LookaheadDrafter(Drafter):
    """Jacobi window + n-gram pool; proposes the pool's candidates and the window as one tree.

    ``pool`` maps a first token to up to ``candidates`` continuations of ``ngram - 1``
    tokens, newest last (an n-gram seen again is not added twice). It outlives runs, as
    llama-lookahead's does within one. The window restarts from the context's tail whenever
    a run starts (``prefill``) or the context is not the one it followed.
    """

    name = "lookahead"
    reads_pass = True
    whole_proposals = True

    def __init__(self, sizes: LookaheadSizes | None = None) -> None:
        self.sizes = sizes or LookaheadSizes()
        self.pool: dict[int, list[tuple[int, ...]]] = {}
        self.levels: list[list[int]] = []  # levels[j][i]: the window's token at level j, column i
        self._seen = 0  # context length at the latest proposal (or prefill)
        self._seen_last = -1  # …and its last token
        # The latest proposal's trie: (parent node, token) -> node, and each window cell's node
        # (-1: the root, the last context token); the target's choice after each last-level cell.
        self._trie: dict[tuple[int, int], int] = {}
        self._cell_nodes: list[list[int]] = []
        self._choices: list[int | None] = []

    # ---- the engine's calls ----------------------------------------------------------------
    def prefill(self, context: Sequence[int]) -> None:
        self._restart(context)

    def propose(
        self,
        context: Sequence[int],
        draft_len: int,
        sampling: SamplingSettings,
        rng: np.random.Generator,
    ) -> Proposal:
        """The pool's candidates after the last token, then the window, as a trie, no node
        deeper than ``draft_len``: candidates first, newest first, so the main chain is the newest."""
        if not context or draft_len <= 0:
            return EMPTY_PROPOSAL
        self._follow(context)
        self.levels[0][0] = context[-1]  # level 0's column 0 is the last token: its column's n-gram starts there
        tokens: list[int] = []
        parents: list[int] = []
        self._trie = {}

        def node_for(parent: int, token: int) -> int:
            key = (parent, token)
            node = self._trie.get(key)
            if node is None:
                node = self._trie[key] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            return node

        for candidate in reversed(self.pool.get(context[-1], ())):
            parent = -1
            for token in candidate[:draft_len]:
                parent = node_for(parent, token)
        # Level j, column i sits i + j positions on: cells deeper than ``draft_len`` stay out
        # (the engine's bound on the context left), and so do the cells below them (-2).
        levels = self.levels
        cells = [[-2] * self.sizes.window for _ in levels]
        cells[0][0] = -1
        for level in range(len(levels)):
            for column in range(self.sizes.window):
                above = cells[0][column - 1] if level == 0 else cells[level - 1][column]
                if (level or column) and above != -2 and level + column <= draft_len:
                    cells[level][column] = node_for(above, levels[level][column])
        self._cell_nodes = cells
        self._choices = [None] * self.sizes.window
        return Proposal(tuple(tokens), source=self.name, parents=tuple(parents))

    def observe_pass(self, proposal: Proposal, target_argmax: np.ndarray) -> None:
        """The target's choice after the root and each node of the verified proposal ((1 + n,)):
        kept for the last-level cells the pass held (the engine may have verified a part)."""
        if proposal.source != self.name or not self._cell_nodes:
            return
        row_of = {-1: 0}  # my node -> its row in target_argmax
        mine: list[int] = []
        for given, (token, parent) in enumerate(zip(proposal.tokens, proposal.parents)):
            node = self._trie.get((mine[parent] if parent >= 0 else -1, token), -2)
            mine.append(node)
            if node >= 0:
                row_of[node] = 1 + given
        last = self._cell_nodes[-1]
        self._choices = [int(target_argmax[row_of[node]]) if node in row_of else None for node in last]

    # ---- the window ------------------------------------------------------------------------
    def _restart(self, context: Sequence[int]) -> None:
        """A fresh window: the context's last tokens, in order, level by level (cycled if short)."""
        size = self.sizes.levels * self.sizes.window
        tail = list(context[-size:]) or [0]
        self.levels = [
            [tail[(level * self.sizes.window + column) % len(tail)] for column in range(self.sizes.window)]
            for level in range(self.sizes.levels)
        ]
        self._cell_nodes, self._choices = [], []
        self._seen, self._seen_last = len(context), (context[-1] if context else -1)

    def _follow(self, context: Sequence[int]) -> None:
        """Move the window on by the tokens emitted since the latest proposal: first with the
        target's choices for the last level (the n-grams they complete go to the pool), then
        once more per further token, the last level refilled from level 0 (llama.cpp's way)."""
        if not (self._seen and len(context) >= self._seen and context[self._seen - 1] == self._seen_last):
            self._restart(context)
            return
        emitted = len(context) - self._seen
        if not emitted:  # asked again before a pass (a chain's member asked twice)
            return
        if any(choice is not None for choice in self._choices):
            refill = self._refill()
            choices = self._choices
            departing = self._shift([c if c is not None else refill[i] for i, c in enumerate(choices)])
            self._learn(departing, [column for column, choice in enumerate(choices) if choice is not None])
            emitted -= 1
        if emitted > len(self.levels):  # plain steps went by (the gate): refills would only copy stale guesses
            self._restart(context)
            return
        for _ in range(emitted):
            self._shift(self._refill())
        self._choices = []
        self._seen, self._seen_last = len(context), context[-1]

    def _refill(self) -> list[int]:
        """The last level's tokens where the target said nothing: level 0's after the move."""
        return list(self.levels[1 if len(self.levels) > 1 else 0])

    def _shift(self, new_last: list[int]) -> list[int]:
        """Levels move up one, ``new_last`` becomes the last; returns the level that left."""
        departing = self.levels[0]
        self.levels = [*self.levels[1:], new_last]
        return departing

    def _learn(self, departing: list[int], columns: Sequence[int]) -> None:
        """Each of ``columns`` (those the target chose for), read down from the token that left
        level 0, is an n-gram for the pool."""
        cap = self.sizes.candidates
        if cap == 0:
            return
        for column in columns:
            first = departing[column]
            continuation = tuple(level[column] for level in self.levels)
            known = self.pool.setdefault(first, [])
            if continuation in known:
                continue
            known.append(continuation)
            if len(known) > cap:
                del known[0]
