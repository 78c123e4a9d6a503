"""Prompt lookup: propose what followed the most recent earlier occurrence of the context's tail.

The index maps every n-gram of the context (n from ``min_ngram`` to ``max_ngram``)
to the position right after its most recent occurrence. It is updated as tokens
arrive: a step costs O(new tokens × orders + draft_len), whatever the context's
length (llama-cpp-python's prompt lookup rescans the whole context every step).
A long read (a prompt, a document, a chat turn's history) is indexed in bulk with
NumPy — its n-grams packed and grouped by a sort, the table updated in one C-level
call — instead of a Python loop over its tokens; the result is the same index.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Sequence
from itertools import compress, repeat

import numpy as np

from specrun.drafters.base import EMPTY_PROPOSAL, Drafter, Proposal
from specrun.backends.kv import common_prefix_len
from specrun.sampling import SamplingSettings

DEFAULT_MAX_NGRAM = 4
# One shared token is mostly coincidence in natural text, and a wrong draft still
# widens the target's verify pass: ask for two.
DEFAULT_MIN_NGRAM = 2
# Earlier occurrences of a matched n-gram looked at for branches (token trees), newest first.
MAX_OCCURRENCES = 16
# An n-gram is one int: its token ids side by side in this many bits each (token ids are
# below 2**32 in every vocabulary), built incrementally; no tuple per order per token.
TOKEN_BITS = 32
# Reads (and forgets) of at least this many tokens go through NumPy (``packed_windows``): below it
# the per-token path is as fast (a step reads 1 to 17 tokens).
BULK_TOKENS = 64


def _pack(tokens: Sequence[int]) -> int:
    key = 0
    for token in tokens:
        key = (key << TOKEN_BITS) | int(token)
    return key


def key_columns(tokens: np.ndarray, n: int) -> list[np.ndarray]:
    """Every n-token window of ``tokens`` (window i: tokens[i:i + n]) as uint64 columns, two tokens
    a column (the first column one token when n is odd): keys NumPy can sort and compare."""
    count = len(tokens) - n + 1
    columns: list[np.ndarray] = []
    start = 0
    for width in [1] * (n % 2) + [2] * (n // 2):
        column = tokens[start : start + count].astype(np.uint64)
        if width == 2:
            column = (column << np.uint64(TOKEN_BITS)) | tokens[start + 1 : start + 1 + count].astype(np.uint64)
        columns.append(column)
        start += width
    return columns


def sorted_rows(columns: list[np.ndarray]) -> np.ndarray:
    """Row indices ordered by key (spread over ``columns``, first column first), equal keys by row."""
    if len(columns) == 1:
        return np.argsort(columns[0], kind="stable")
    return np.lexsort(tuple(reversed(columns)))  # lexsort is stable


def packed_windows(tokens: np.ndarray, n: int) -> tuple[list[int], list[np.ndarray]]:
    """``_pack`` of every n-token window of ``tokens``, as Python ints, and ``key_columns``. No
    Python loop over the windows: keys wider than 64 bits are read from each window's bytes by
    ``map`` over a C-level call."""
    columns = key_columns(tokens, n)
    if len(columns) == 1:
        return columns[0].tolist(), columns
    windows = np.lib.stride_tricks.sliding_window_view(tokens.astype(">u4"), n)  # TOKEN_BITS each
    rows = np.ascontiguousarray(windows).view(f"V{4 * n}").ravel().tolist()
    return list(map(int.from_bytes, rows, repeat("big"))), columns


def previous_equal(columns: list[np.ndarray]) -> np.ndarray:
    """For each row (its key spread over ``columns``), the index of the nearest earlier row with the
    same key, -1 for a key's first row: one stable sort, no loop over the rows."""
    order = sorted_rows(columns)
    same = np.ones(max(len(order) - 1, 0), dtype=bool)
    for column in columns:
        ordered = column[order]
        same &= ordered[1:] == ordered[:-1]
    previous = np.full(len(order), -1, dtype=np.int64)
    previous[order[1:][same]] = order[:-1][same]
    return previous


class ContextMirror:
    """A drafter's own copy of the context it has read, kept in step without rescans.

    The engine hands one list to every call of a generation and only appends to
    it. When ``context`` is the list seen last time and still ends, at the copy's
    length, with the copy's last token, only the appended tail is new: one
    comparison. Any other sequence (a new prompt, the next chat turn, a rewound
    or caller-made copy) is compared once in full to find where it departs from
    the copy: O(n) per generation, never per step. In-place edits of the same
    list other than appends are not looked for; the engine makes none.
    """

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.ops = 0  # token comparisons made to find the shared prefix
        self._source: Sequence[int] | None = None

    def shared_prefix(self, context: Sequence[int]) -> int:
        """How many leading tokens of ``context`` the copy already holds."""
        held = len(self.tokens)
        if context is self._source and len(context) >= held and (held == 0 or context[held - 1] == self.tokens[-1]):
            self.ops += 1
            return held
        self.ops += min(held, len(context))
        return common_prefix_len(self.tokens, context)

    def truncate(self, n_keep: int) -> None:
        del self.tokens[n_keep:]

    def follow(self, context: Sequence[int]) -> None:
        """Remember ``context`` as the sequence the copy now mirrors (its fast path)."""
        self._source = context

    def reset(self) -> None:
        self.tokens.clear()
        self._source = None


class PromptLookupDrafter(Drafter):
    """Matches the last n tokens (longest n first) against prompt + output.

    Of several earlier occurrences the most recent wins: the text being edited or
    repeated is usually the nearest, and keeping one position per n-gram keeps
    updates O(1). After a match the drafter copies up to ``draft_len`` tokens from
    there; a copy that runs into the end of the context continues from its own
    copied tokens (LZ77-style), so a repeating pattern such as 1 2 1 2 1 yields a
    full-length proposal 2 1 2 1.

    ``ops`` counts elementary index operations (prefix comparisons, n-gram
    registrations and lookups, copied tokens) so tests can check the per-step
    cost without timing anything.
    """

    name = "lookup"
    # A proposal's kind is the length of the n-gram it matched ("n2"..."n4"): how often its
    # first token is right differs by far with it. Measured against plain decoding's output
    # (demo pair; built-in suite / Spec-Bench): 2 tokens 54% / 58%, 3 tokens 68% / 80%,
    # 4 tokens 97% / 98%. Each prompt's first proposal matches just 2 tokens of the prompt's
    # end, and was right in 1 of 21 built-in prompts: tried at once under the optimistic
    # prior (0.9), it cost a wide verify pass per prompt where a pass over 5 tokens costs 2.5
    # plain ones. The priors of an adaptive engine's controllers, by kind (others: 0.9):
    kind_priors = {"n2": 0.5, "n3": 0.7}

    def __init__(
        self, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = DEFAULT_MIN_NGRAM, branches: int = 0
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        # Token trees: continuations of up to this many earlier occurrences of the matched
        # n-gram that differ from the latest one join its chain as branches (0: chains only).
        self.branches = branches
        self.orders = tuple(range(max_ngram, min_ngram - 1, -1))  # longest first
        self.mirror = ContextMirror()
        # _latest[j]: orders[j]-gram (packed, see _pack) -> position of the token that
        # followed its most recent occurrence. One table per order, so keys never collide.
        self._latest: list[dict[int, int]] = [{} for _ in self.orders]
        # _replaced[j][c]: what _latest[j] held for the orders[j]-gram ending before c
        # until position c was read (-1: nothing). Undoing a rewind replays it backwards.
        self._replaced: list[list[int]] = [[] for _ in self.orders]
        # _tails[j]: the packed last orders[j] tokens read (meaningful once that many were read):
        # the key registered for the next token, and the key a proposal looks up.
        self._tails = [0] * len(self.orders)
        self._masks = tuple((1 << (TOKEN_BITS * n)) - 1 for n in self.orders)
        self._index_ops = 0

    @property
    def ops(self) -> int:
        return self.mirror.ops + self._index_ops

    def propose(
        self,
        context: Sequence[int],
        draft_len: int,
        sampling: SamplingSettings,
        rng: np.random.Generator,
    ) -> Proposal:
        """One-hot proposal copied from the most recent match; empty when nothing matches."""
        self._read(context)
        if draft_len <= 0:
            return EMPTY_PROPOSAL
        match = self._match()
        if match is None:
            return EMPTY_PROPOSAL
        start, order = match
        chain = self._copy_from(start, draft_len)
        if not self.branches:
            return Proposal(chain, source=self.name, kind=f"n{order}")
        tokens, parents = self._branches(chain, start, self.orders.index(order), draft_len)
        return Proposal(tokens, source=self.name, parents=parents, kind=f"n{order}")

    def _branches(
        self, chain: tuple[int, ...], start: int, order_index: int, draft_len: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The latest occurrence's continuation as the chain, then the continuations of earlier
        occurrences merged in as a trie, newest first, those of the matched n-gram before
        those of its shorter tails: each that differs somewhere adds one branch from where it
        parts (at most ``branches``; MAX_OCCURRENCES looked at).

        ``_replaced`` already links every occurrence of an n-gram to the one before it (what
        the index held before it was registered), so the walk costs no index of its own."""
        tokens, parents = list(chain), list(range(-1, len(chain) - 1))
        node_of = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, tokens))}
        added, looked = 0, 0
        for j in range(order_index, len(self.orders)):
            replaced = self._replaced[j]
            position = self._latest[j].get(self._tails[j], -1) if j > order_index else replaced[start]
            while position >= 0 and added < self.branches and looked < MAX_OCCURRENCES:
                looked += 1
                node, parted = -1, False
                for token in self._copy_from(position, draft_len):
                    child = node_of.get((node, token))
                    if child is None:
                        tokens.append(token)
                        parents.append(node)
                        child = node_of[(node, token)] = len(tokens) - 1
                        parted = True
                    node = child
                added += parted
                position = replaced[position]
        return tuple(tokens), tuple(parents)

    def finish(self, context: Sequence[int]) -> None:
        self._read(context)

    prefill = finish  # the prompt is indexed before generation, timed as prefill

    def close(self) -> None:
        self.mirror.reset()
        self._latest = [{} for _ in self.orders]
        self._replaced = [[] for _ in self.orders]
        self._tails = [0] * len(self.orders)

    def recover(self) -> None:
        """After an interruption (Ctrl-C can land inside an index update): start the index over.

        The next proposal reads the whole context again, once.
        """
        self.close()

    def _read(self, context: Sequence[int]) -> None:
        """Index what ``context`` adds to what was read before; forget what it no longer holds."""
        keep = self.mirror.shared_prefix(context)
        if keep == len(self.mirror.tokens) == len(context) - 1:  # a step's one new token: no slice
            self._read_token(int(context[keep]))
        else:
            self._forget_from(keep)
            if len(context) - keep >= BULK_TOKENS:
                self._read_bulk(context[keep:])
            else:
                for token in context[keep:]:
                    self._read_token(int(token))
        self.mirror.follow(context)

    def _read_bulk(self, new: Sequence[int]) -> None:
        """``_read_token`` of every token of ``new`` in turn, done by NumPy: for each order, the keys
        of the windows ending before each new position, the position each replaces (the nearest
        earlier window with its key; before the first, what the table held), then the table
        updated in one call (of equal keys the latest position is the one kept)."""
        tokens = self.mirror.tokens
        start = len(tokens)
        longest = self.orders[0]
        held = tokens[max(0, start - longest) :]  # what the first new windows reach back into
        offset = start - len(held)  # position of seq[0]
        seq = np.concatenate([np.asarray(held, dtype=np.int64), np.asarray(new, dtype=np.int64)])
        end = offset + len(seq)
        for j, n in enumerate(self.orders):
            first = max(start, n)  # the first new position an n-gram ends before
            self._replaced[j].extend(repeat(-1, min(first, end) - start))
            if first >= end:
                continue
            keys, columns = packed_windows(seq[first - n - offset : end - 1 - offset], n)
            positions = np.arange(first, end)
            previous = previous_equal(columns)
            replaced = np.where(previous >= 0, positions[np.maximum(previous, 0)], -1)
            latest = self._latest[j]
            firsts = np.flatnonzero(previous < 0)  # each key's first new window: what the table held
            replaced[firsts] = list(map(latest.get, map(keys.__getitem__, firsts.tolist()), repeat(-1)))
            self._replaced[j].extend(replaced.tolist())
            latest.update(zip(keys, positions.tolist()))
            self._index_ops += len(keys)
        tokens.extend(seq[start - offset :].tolist())
        self._tails = [_pack(tokens[-n:]) & mask for n, mask in zip(self.orders, self._masks)]

    def _read_token(self, token: int) -> None:
        """Append ``token`` at position c: every n-gram ending just before c now has c as its continuation."""
        tokens = self.mirror.tokens
        position = len(tokens)
        tails = self._tails
        for j, n in enumerate(self.orders):
            if n <= position:
                latest, key = self._latest[j], tails[j]
                self._replaced[j].append(latest.get(key, -1))
                latest[key] = position
                self._index_ops += 1
            else:
                self._replaced[j].append(-1)
        tokens.append(token)
        for j, mask in enumerate(self._masks):
            tails[j] = ((tails[j] << TOKEN_BITS) | token) & mask

    def _forget_from(self, n_keep: int) -> None:
        """Undo the registrations of positions n_keep and later, newest first, then drop them."""
        tokens = self.mirror.tokens
        if n_keep >= len(tokens):
            return
        if len(tokens) - n_keep >= BULK_TOKENS:
            self._forget_bulk(n_keep)
            return
        for position in range(len(tokens) - 1, n_keep - 1, -1):
            for j, n in enumerate(self.orders):
                if n > position:
                    continue
                latest, key = self._latest[j], _pack(tokens[position - n : position])
                previous = self._replaced[j][position]
                if previous < 0:
                    del latest[key]
                else:
                    latest[key] = previous
                self._index_ops += 1
        for replaced in self._replaced:
            del replaced[n_keep:]
        self.mirror.truncate(n_keep)
        self._tails = [_pack(tokens[-n:]) for n in self.orders]  # shorter while fewer were read

    def _forget_bulk(self, n_keep: int) -> None:
        """``_forget_from`` by NumPy: undoing positions newest first leaves each key what its
        earliest forgotten position replaced (deleted where that was nothing)."""
        tokens = self.mirror.tokens
        end = len(tokens)
        seq = np.asarray(tokens[max(0, n_keep - self.orders[0]) :], dtype=np.int64)
        offset = end - len(seq)
        for j, n in enumerate(self.orders):
            first = max(n_keep, n)
            if first < end:
                keys, _ = packed_windows(seq[first - n - offset : end - 1 - offset], n)
                # Of equal keys the earliest position's record is the one kept (reversed: it comes last).
                restore = dict(zip(reversed(keys), reversed(self._replaced[j][first:end])))
                latest = self._latest[j]
                latest.update(restore)
                deque(map(latest.pop, compress(restore, map(operator.gt, repeat(0), restore.values()))), maxlen=0)
                self._index_ops += len(keys)
            del self._replaced[j][n_keep:]
        self.mirror.truncate(n_keep)
        self._tails = [_pack(tokens[-n:]) for n in self.orders]

    def _match(self) -> tuple[int, int] | None:
        """Start of the continuation of the longest tail n-gram seen before, and its n; if any."""
        length = len(self.mirror.tokens)
        for j, n in enumerate(self.orders):
            if n >= length:
                continue  # an n-gram needs an earlier occurrence with a token after it
            self._index_ops += 1
            start = self._latest[j].get(self._tails[j])
            if start is not None:
                return start, n
        return None

    def _copy_from(self, start: int, draft_len: int) -> tuple[int, ...]:
        """tokens[start:start + draft_len], continuing into the copy itself past the end."""
        tokens = self.mirror.tokens
        draft: list[int] = []
        for j in range(draft_len):
            source = start + j
            # source - len(tokens) < j because start < len(tokens): that draft token exists.
            draft.append(tokens[source] if source < len(tokens) else draft[source - len(tokens)])
        self._index_ops += draft_len
        return tuple(draft)
