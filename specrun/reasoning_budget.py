"""llama.cpp's reasoning budget: the thinking between a start and an end tag capped at a number
of tokens, then a fixed sequence forced, as an exact rule on the target's rows.

llama.cpp's ``--reasoning-budget N`` (llama-server's ``reasoning_budget_tokens``) adds a sampler
(common/reasoning-budget.cpp) that reads the text from the generation prompt on, token by token:

- IDLE: until a start tag (any of ``starts``) ends at a token; then COUNTING with N tokens left
  (N = 0: FORCING at once).
- COUNTING: a token that ends an end tag (any of ``ends``) ends the block (DONE); any other
  spends one token, and the one that spends the last moves on to FORCING, or to WAITING_UTF8
  where its piece leaves a UTF-8 character unfinished (``incomplete``).
- WAITING_UTF8: an end tag ends the block; else the first token whose piece is complete moves
  on to FORCING.
- FORCING: every row's logits but ``forced[i]``'s are -inf, i the tokens forced so far; after
  the last, DONE.
- DONE: as IDLE, a new start tag starting a fresh count (models think more than once).

The tags are found by an Aho-Corasick automaton over token ids (llama.cpp's common/trie.h) that
starts afresh after each match, and the end tags' automaton afresh wherever the count runs out.
Each state is one of a finite machine's, read from the text alone, so a verify pass's rows are
forced each by its own text (the context, then the path to its row), as the penalties shape
them (specrun/penalties.py): verification sees plain decoding's rows and stays exact.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

IDLE, COUNTING, WAITING_UTF8, FORCING, DONE = range(5)
BUDGET_SOURCE = "budget"  # the source of a proposal of the tokens the rule forces (drafted for free)

# (mode, the start tags' automaton state, the end tags', tokens left to count, tokens forced so far)
State = tuple[int, int, int, int, int]
INITIAL: State = (IDLE, 0, 0, 0, 0)


class TagMatcher:
    """Aho-Corasick over token sequences, as a table: ``step(state, token)`` gives the state after
    ``token`` and whether a tag ends there (then the state is the root again, as llama.cpp's
    matcher restarts after each match)."""

    def __init__(self, tags: Iterable[Sequence[int]]) -> None:
        children: list[dict[int, int]] = [{}]
        ends = [False]
        for tag in tags:
            node = 0
            for token in tag:
                if token not in children[node]:
                    children[node][token] = len(children)
                    children.append({})
                    ends.append(False)
                node = children[node][token]
            if tag:
                ends[node] = True
        # breadth first: each node's moves are its children's, then its failure link's (shorter) ones
        moves: list[dict[int, int]] = [dict(children[0])]
        moves.extend({} for _ in children[1:])
        failure = [0] * len(children)
        queue = list(children[0].values())
        for node in queue:
            ends[node] = ends[node] or ends[failure[node]]  # a tag ending at a suffix ends here too
            moves[node] = {**moves[failure[node]], **children[node]}
            for token, child in children[node].items():
                failure[child] = moves[failure[node]].get(token, 0)
                queue.append(child)
        self.moves = moves  # state -> {token: state}; a token not listed leads to the root
        self.ends = ends

    def step(self, state: int, token: int) -> tuple[int, bool]:
        state = self.moves[state].get(token, 0)
        if self.ends[state]:
            return 0, True
        return state, False


@dataclass(frozen=True)
class ReasoningBudget:
    """llama.cpp's reasoning budget (module docstring), in the target's token ids.

    ``starts``/``ends``: the tags that open and close the thinking, each as tokenized with special
    tokens parsed; ``forced``: what is forced once ``budget`` tokens are spent (llama-server's
    budget message, then the first end tag); ``start_at``: where in the token text the rule
    begins reading (the generation prompt's first token: a prompt that opens the block, as
    Qwen3's template with thinking on does, starts the count); ``incomplete``: the ids whose piece
    is not a whole UTF-8 sequence (``incomplete_tokens``; empty: every piece counts as whole)."""

    starts: tuple[tuple[int, ...], ...]
    ends: tuple[tuple[int, ...], ...]
    forced: tuple[int, ...]
    budget: int
    start_at: int = 0
    incomplete: frozenset[int] = field(default=frozenset(), repr=False)  # a vocabulary's worth: not shown
    # the text before start_at opened the block: the count starts at start_at (the answer's first
    # token), not at a start tag read there. llama.cpp reads the generation prompt's tokens after its
    # tag (DeepSeek-R1's and Qwen3's "<think>\n") as thinking, the "\n" then taken as the first forced
    # token: budget 0 forced nothing and a message lost its first token.
    opened: bool = False
    # the tags' automata, and the text last read (after start_at) with the state it left: a context
    # only grows within a generation, so each pass reads only what it added (one entry, replaced
    # whole: threads may share a rule)
    _starts: TagMatcher = field(init=False, repr=False, compare=False)
    _ends: TagMatcher = field(init=False, repr=False, compare=False)
    _last_read: list = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_starts", TagMatcher(self.starts))
        object.__setattr__(self, "_ends", TagMatcher(self.ends))
        object.__setattr__(self, "_last_read", [((), self.initial)])

    @property
    def initial(self) -> State:
        """The state at start_at: counting (forcing, at budget 0) where the block opened before it."""
        if not self.opened:
            return INITIAL
        return (FORCING, 0, 0, 0, 0) if self.budget <= 0 else (COUNTING, 0, 0, self.budget, 0)

    def problems(self) -> list[str]:
        """What is out of range, as option-named messages (empty if fine)."""
        problems = []
        if self.budget < 0:
            problems.append(f"--reasoning-budget must be 0 or more tokens (-1: off), got {self.budget}")
        if not any(self.starts):
            problems.append("--reasoning-budget needs a start tag of at least one token")
        if not any(self.ends):
            problems.append("--reasoning-budget needs an end tag of at least one token")
        if not self.forced:
            problems.append("--reasoning-budget needs a sequence to force of at least one token")
        if self.start_at < 0:
            problems.append(f"--reasoning-budget starts reading at token {self.start_at}: positions are 0 or more")
        tokens = [token for tag in (*self.starts, *self.ends, self.forced) for token in tag]
        if any(token < 0 for token in tokens):
            problems.append(f"--reasoning-budget names token {min(tokens)}: token ids are 0 or more")
        return problems

    def describe(self) -> str:
        """In words, for a footnote."""
        return f"reasoning budget {self.budget} tokens"

    def fields(self) -> dict:
        """For a trace's header (``incomplete`` left out: the vocabulary's, not the run's)."""
        return {"budget": self.budget, "starts": [list(tag) for tag in self.starts],
                "ends": [list(tag) for tag in self.ends], "forced": list(self.forced), "start_at": self.start_at,
                **({"opened": True} if self.opened else {})}

    def read(self, state: State, tokens: Iterable[int]) -> State:
        """The state after reading ``tokens`` from ``state`` (llama.cpp's ``accept``, token by token)."""
        starts, ends = self._starts, self._ends
        mode, start_state, end_state, left, done = state
        for token in tokens:
            if mode == IDLE or mode == DONE:
                start_state, opened = starts.step(start_state, token)
                if opened:
                    mode, end_state, left, done = (FORCING, 0, 0, 0) if self.budget <= 0 else (COUNTING, 0,
                                                                                                self.budget, 0)
            elif mode == FORCING:
                end_state, _ = ends.step(end_state, token)
                done += 1
                if done >= len(self.forced):
                    mode = DONE
            else:  # COUNTING or WAITING_UTF8
                end_state, closed = ends.step(end_state, token)
                if closed:
                    mode = DONE
                    continue
                whole = token not in self.incomplete
                if mode == COUNTING:
                    left -= 1
                    if left > 0:
                        continue
                    mode = FORCING if whole else WAITING_UTF8
                elif not whole:
                    continue
                else:
                    mode = FORCING
                end_state, done = 0, 0
        return mode, start_state, end_state, left, done

    def forced_run(self, context: Sequence[int]) -> tuple[int, ...]:
        """Every token the rule forces from ``context`` on: once it forces, the rest of ``forced``
        follows token by token whatever the rows, so the engine drafts it for free (empty: none)."""
        mode, _, _, _, done = self.context_state(context)
        return self.forced[done:] if mode == FORCING else ()

    def forced_after(self, state: State) -> int | None:
        """The token the rule forces next in ``state``, or None where it leaves the row alone."""
        return self.forced[state[4]] if state[0] == FORCING else None

    def context_state(self, context: Sequence[int]) -> State:
        """The state after ``context``, continued from the last text read where ``context`` starts
        with it (the context of the pass before, the draft model's drafts aside)."""
        seen = context[self.start_at:]
        if not isinstance(seen, (list, tuple)):
            seen = list(seen)
        read, state = self._last_read[0]
        if len(read) <= len(seen) and type(read) is type(seen) and seen[: len(read)] == read:
            seen_from = len(read)
        else:
            state, seen_from = self.initial, 0
        if seen_from < len(seen):
            state = self.read(state, seen[seen_from:])
            self._last_read[0] = (seen, state)
        return state

    def forced_tokens(self, context: Sequence[int], paths: Sequence[Sequence[int]]) -> list[int | None]:
        """For each path, the token the rule forces after ``context`` then the path (None: no token
        forced). The context is read once; a path whose parent (the path less its last token) came
        before it is read from the parent's state, as chain_paths and tree_paths list them."""
        root = self.context_state(context)
        skip = max(0, self.start_at - len(context))  # a path that begins before start_at: unread there
        states: dict[tuple[int, ...], State] = {(): root}
        forced = []
        for path in paths:
            path = tuple(path[skip:])
            state = states.get(path)
            if state is None:
                parent = states.get(path[:-1])
                state = self.read(root, path) if parent is None else self.read(parent, path[-1:])
                states[path] = state
            forced.append(self.forced_after(state))
        return forced

    def forced_next(self, text: Sequence[int]) -> int | None:
        """The token the rule forces after ``text``, or None."""
        return self.forced_tokens(text, [()])[0]


def forced_rows(logits: np.ndarray, budget: ReasoningBudget, context: Sequence[int],
                paths: Sequence[Sequence[int]], in_place: bool = False) -> np.ndarray:
    """A pass's logits (n, V) with each row whose text (``context`` then ``paths[i]``) the rule is
    forcing set to -inf but at the forced token, which keeps its logit (llama.cpp's apply). A new
    array where a row is forced (``in_place``: ``logits`` itself, written over), else ``logits``."""
    forced = budget.forced_tokens(context, paths)
    if all(token is None for token in forced):
        return logits
    rows = logits if in_place else np.array(logits)
    for row, token in zip(rows, forced):
        if token is not None:
            kept = row[token]
            row.fill(-np.inf)
            row[token] = kept
    return rows


def utf8_whole(piece: bytes) -> bool:
    """Does ``piece`` end where a UTF-8 character ends? llama.cpp's ``common_utf8_is_complete``:
    the last byte that is not a continuation byte, among the last four, must have as many bytes
    after it as its character needs, or more (an empty piece is whole, a run of continuation
    bytes alone is not)."""
    for back in range(1, min(4, len(piece)) + 1):
        byte = piece[-back]
        if byte & 0xC0 != 0x80:
            return back >= (4 if byte >= 0xF0 else 3 if byte >= 0xE0 else 2 if byte >= 0xC0 else 1)
    return not piece


def incomplete_tokens(token_bytes: Callable[[int], bytes], size: int) -> frozenset[int]:
    """The ids below ``size`` whose piece (``token_bytes``: special tokens not rendered, as
    llama.cpp's ``common_token_to_piece(vocab, token, false)``) is not whole UTF-8 (``utf8_whole``)."""
    return frozenset(token for token in range(size) if not utf8_whole(token_bytes(token)))


_incomplete: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backend -> its incomplete ids


def incomplete_tokens_of(backend) -> frozenset[int]:
    """``incomplete_tokens`` over ``backend``'s vocabulary, asked of it once per model (about 0.2 s
    for 49,152 tokens on llama.cpp)."""
    backend = getattr(backend, "parent", backend)  # a slot's, a window's: its model's, built once
    found = _incomplete.get(backend)
    if found is None:
        found = _incomplete[backend] = incomplete_tokens(backend.token_bytes, backend.vocab.size)
    return found
