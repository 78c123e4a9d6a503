"""A backend's KV cache seen as a token list, so rewinds are explicit and checkable."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np

from specrun.backends.base import Backend
from specrun.penalties import AheadShaping
from specrun.sampling import AheadSampling
from specrun.tree import TokenTree


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists.

    Slice comparisons run in C; the mismatch is found by bisection, so the cost is
    O(n log n) element comparisons at C speed rather than a Python loop over n.
    """
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class HiddenStore:
    """Hidden states (H,) by cache position in a float32 buffer that doubles as it fills.

    Positions [0, length) have been accounted for; ``known`` says which of them hold a
    state (a position fed while tracking was off holds none: unknown, never stale).
    """

    def __init__(self, size: int, capacity: int = 256, dtype=np.float32) -> None:
        self.states = np.zeros((capacity, size), dtype)  # (capacity, H)
        self.known = np.zeros(capacity, bool)  # (capacity,)
        self.length = 0

    def put(self, start: int, rows: np.ndarray) -> None:
        """Store ``rows`` (n, H) at positions start … start+n-1; any gap before them is unknown."""
        stop = start + len(rows)
        if stop > len(self.states):
            capacity = max(stop, 2 * len(self.states))
            self.states = np.concatenate([self.states, np.zeros((capacity - len(self.states), self.states.shape[1]),
                                                                self.states.dtype)])
            self.known = np.concatenate([self.known, np.zeros(capacity - len(self.known), bool)])
        self.known[self.length : start] = False
        self.states[start:stop] = rows
        self.known[start:stop] = True
        self.length = stop

    def truncate(self, n_keep: int) -> None:
        self.length = min(self.length, n_keep)

    def get(self, start: int, stop: int) -> np.ndarray | None:
        """A copy of the states (stop-start, H) at positions [start, stop), or None if any is unknown."""
        if stop > self.length or not self.known[start:stop].all():
            return None
        return self.states[start:stop].astype(np.float32)  # a copy


class KVSequence:
    """A backend plus the exact tokens its KV cache holds.

    With ``track_hidden(True)`` it also keeps the hidden state of every position committed
    while tracking (``hidden``), for drafters that read the target's states.

    Plain greedy steps may read one token ahead (``feed_argmax_ahead``, where the backend can):
    the id a step returns is then in the backend's cache already, beyond ``tokens``, and the
    next step's pass was queued on it. It joins ``tokens`` when the next step or a rewind to a
    prefix of the text continues with it; any other feed or rewind drops it first.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.tokens: list[int] = []
        self._tracking = False
        self._hidden: HiddenStore | None = None  # from the first track_hidden(True) on
        self._layers: tuple[int, ...] = ()  # what the store holds: track_hidden's layers
        self._hidden_tail: int | None = None  # a longer pass keeps the hidden states of its last this many
        self._tree_rows = 0  # the tokens the last tree pass fed before its nodes
        self._ahead: int | None = None  # the id read ahead: in the backend's cache, not yet in tokens
        if backend.n_past:
            backend.rewind(0)  # we cannot know what an adopted cache holds: start empty

    def __len__(self) -> int:
        return len(self.tokens)

    def _check_in_step(self) -> None:
        tracked = len(self.tokens) + (self._ahead is not None)
        if self.backend.n_past != tracked:
            raise RuntimeError(
                f"{self.backend.name} cache holds {self.backend.n_past} tokens but this sequence "
                f"tracks {tracked}: two sequences are driving one backend"
            )

    def thread_tally(self):
        """The backend's passes and those run on fewer threads (cpu_load.ThreadTally), where it
        follows the machine's load (llama.cpp on the CPU); None elsewhere."""
        tally = getattr(self.backend, "thread_tally", None)
        return tally() if tally is not None else None

    # ---- plain steps that read ahead ----------------------------------------------------
    @property
    def can_read_ahead(self) -> bool:
        """Can plain greedy steps read one token ahead here (``feed_argmax_ahead``)?"""
        return getattr(self.backend, "reads_ahead", False)

    @property
    def can_shape_ahead(self) -> bool:
        """Can those steps' rows be shaped by their text on the backend's device (``shapes_ahead``:
        penalties and a bias, penalties.AheadShaping)?"""
        return self.can_read_ahead and getattr(self.backend, "shapes_ahead", False)

    @property
    def can_sample_ahead(self) -> bool:
        """Can those steps draw their tokens on the backend's device (``samples_ahead``: temperature,
        top-k and min-p, sampling.AheadSampling)?"""
        return self.can_read_ahead and getattr(self.backend, "samples_ahead", False)

    @property
    def reading_ahead(self) -> bool:
        """Is an id read ahead, with the pass after it queued (the next ``feed_argmax_ahead``'s)?"""
        return self._ahead is not None

    def feed_argmax_ahead(self, token: int, ahead: bool = True, shaping: AheadShaping | None = None,
                          drawn: AheadSampling | None = None) -> tuple[int, bool]:
        """Append ``token`` and return the argmax after it, as ``feed_argmax([token], [0])`` does,
        and whether its pass had been queued by the call before. With ``ahead`` the id is fed
        too, beyond ``tokens``, and the pass after it queued (the backend's
        ``forward_argmax_ahead``), for a next call with that id. Needs ``can_read_ahead``. While
        tracking, the token's hidden state is kept as ``feed_argmax``'s would be. ``shaping``
        (needs ``can_shape_ahead``): each row's argmax is taken after the penalties and bias it
        names, the text so far its ``context``; ``drawn`` (needs ``can_sample_ahead``): each row's
        token drawn under its settings instead of its argmax."""
        token = int(token)
        queued = self._ahead is not None and self._ahead == token
        extra = {key: value for key, value in (("shaping", shaping), ("drawn", drawn)) if value is not None}
        try:
            if queued:
                self._ahead = None
                value, fed = self.backend.forward_argmax_ahead(None, ahead, **extra)
            else:
                self._drop_ahead()
                self._check_in_step()
                value, fed = self.backend.forward_argmax_ahead(token, ahead, **extra)
            self.tokens.append(token)
            if self._tracking:  # the queued pass kept the state of the token it fed
                self._hidden.put(len(self.tokens) - 1, self.backend.hidden_rows(range(1)))
        except BaseException:
            self.repair()
            raise
        self._ahead = value if fed else None
        return value, queued

    def _drop_ahead(self) -> None:
        """Take the id read ahead out of the backend's cache (a pass or rewind comes that does not continue it)."""
        if self._ahead is not None:
            self._ahead = None
            self.backend.rewind(len(self.tokens))

    def feed(self, tokens: Sequence[int], logit_rows: Sequence[int] = ()) -> np.ndarray:
        """Append tokens; logits (len(logit_rows), vocab) for the rows asked for."""
        return self._feed_tracked(self.backend.forward, tokens, logit_rows)

    def feed_argmax(self, tokens: Sequence[int], logit_rows: Sequence[int]) -> np.ndarray:
        """Append tokens; the argmax ids (len(logit_rows),) at the rows asked for."""
        return self._feed_tracked(self.backend.forward_argmax, tokens, logit_rows)

    def _feed_tracked(self, forward, tokens: Sequence[int], logit_rows: Sequence[int]) -> np.ndarray:
        """``_append``; while tracking with a tail, a pass longer than the tail (a prompt) feeds
        its head untracked, then the tail tracked: llama.cpp outputs every row of a tracked pass
        (a prompt pass cost 18-23% more), and a drafter with a tail never reads the head's."""
        tail = self._hidden_tail
        # Layer outputs cost a pass no logits (llama.cpp copies them out for every row anyway): kept whole.
        if not self._tracking or tail is None or len(tokens) <= tail or self._layers:
            return self._append(forward, tokens, logit_rows)
        cut = len(tokens) - tail
        rows = list(logit_rows)
        self.backend.track_hidden(False)
        self._tracking = False
        try:
            head = self._append(forward, tokens[:cut], [row for row in rows if row < cut])
        finally:
            self.backend.track_hidden(True)
            self._tracking = True
        rest = self._append(forward, tokens[cut:], [row - cut for row in rows if row >= cut])
        merged = np.concatenate([head, rest])  # head's rows, then the tail's, each in the order asked
        order = [i for i, row in enumerate(rows) if row < cut] + [i for i, row in enumerate(rows) if row >= cut]
        out = np.empty_like(merged)
        out[order] = merged
        return out

    def feed_greedy(self, tokens: Sequence[int], n_new: int) -> np.ndarray:
        """Append tokens and extend them greedily: ``n_new`` argmax ids (n_new,) from one call.

        Needs a backend with ``forward_greedy``. The cache ends as ``n_new`` successive
        ``feed_argmax`` calls leave it: ``tokens`` plus all but the last new id.
        """
        self._check_untracked("feed_greedy")
        self._drop_ahead()
        self._check_in_step()
        try:
            ids = self.backend.forward_greedy(tokens, n_new)
            self.tokens.extend(tokens)
            self.tokens.extend(int(t) for t in ids[:-1])
        except BaseException:
            self.repair()
            raise
        return ids

    def feed_greedy_deferred(self, tokens: Sequence[int], n_new: int):
        """``feed_greedy`` whose ids stay on the device (a backend's DeferredIds): they are
        recorded here when they resolve, in the target's ``feed_argmax_after`` or on the
        backend's next use."""
        self._check_untracked("feed_greedy_deferred")
        self._drop_ahead()
        self._check_in_step()
        try:
            deferred = self.backend.forward_greedy_deferred(tokens, n_new)
        except BaseException:
            self.repair()
            raise
        self.tokens.extend(tokens)
        deferred.add_hook(lambda ids: self.tokens.extend(int(t) for t in ids[:-1]))
        return deferred

    @property
    def sharing(self) -> int:
        """The other sequences the backend's last pass carried (a slot's, backends/slots.py); 0 alone."""
        return getattr(self.backend, "others_in_pass", 0)

    @property
    def shared_tokens(self) -> int:
        """The tokens the other sequences fed the backend's last pass (a slot's); 0 alone."""
        return getattr(self.backend, "others_tokens_in_pass", 0)

    @property
    def can_feed_after(self) -> bool:
        """Can this model queue a pass on another model's deferred ids (``feed_argmax_after``)?"""
        return hasattr(self.backend, "forward_argmax_after")

    def feed_argmax_after(self, tokens: Sequence[int], deferred) -> tuple[np.ndarray, np.ndarray]:
        """Append ``tokens`` and then another backend's deferred ids in one pass: the argmax
        at every row fed (len(tokens) + n,) and the ids (n,), with one host sync for both."""
        self._check_untracked("feed_argmax_after")
        self._drop_ahead()
        self._check_in_step()
        try:
            argmax, ids = self.backend.forward_argmax_after(tokens, deferred)
            self.tokens.extend(tokens)
            self.tokens.extend(int(t) for t in ids)
        except BaseException:
            self.repair()
            raise
        return argmax, ids

    def feed_tree(self, tokens: Sequence[int], tree: TokenTree, logit_rows: Sequence[int]) -> np.ndarray:
        """Append ``tokens``, then hold ``tree``'s nodes after them (``keep_path`` commits one
        path); logits (len(logit_rows), vocab) at rows indexing ``tokens`` followed by the nodes."""
        self._tree_rows = len(tokens)
        return self._append(lambda fed, rows: self.backend.forward_tree(fed, tree, rows), tokens, logit_rows)

    def feed_tree_argmax(self, tokens: Sequence[int], tree: TokenTree, logit_rows: Sequence[int]) -> np.ndarray:
        """Like ``feed_tree`` but only the argmax ids (len(logit_rows),)."""
        self._tree_rows = len(tokens)
        return self._append(lambda fed, rows: self.backend.forward_tree_argmax(fed, tree, rows), tokens, logit_rows)

    def keep_path(self, tree: TokenTree, path: Sequence[int]) -> None:
        """Commit the held tree's nodes ``path`` (root-to-node) to the cache, dropping the rest."""
        try:
            self.backend.keep_path(path)
            start = len(self.tokens)
            self.tokens.extend(tree.tokens[node] for node in path)
            if self._tracking:  # node i's row follows the tokens the tree pass fed
                self._hidden.put(start, self.backend.hidden_rows([self._tree_rows + node for node in path]))
        except BaseException:
            self.repair()
            raise

    def _append(self, forward, tokens: Sequence[int], logit_rows: Sequence[int]) -> np.ndarray:
        self._drop_ahead()
        self._check_in_step()
        try:
            out = forward(tokens, logit_rows)
            start = len(self.tokens)
            self.tokens.extend(tokens)
            if self._tracking:
                self._hidden.put(start, self.backend.hidden_rows(range(len(tokens))))
        except BaseException:
            # Ctrl-C or a failed decode can land between the backend and this list.
            self.repair()
            raise
        return out

    def repair(self) -> None:
        """Bring list and backend back in step after an interruption: keep what both agree on."""
        self._ahead = None
        keep = min(len(self.tokens), self.backend.n_past)
        self.backend.rewind(keep)
        del self.tokens[keep:]
        if self._hidden is not None:
            self._hidden.truncate(keep)

    def rewind(self, n_keep: int) -> None:
        """Keep the first ``n_keep`` cached tokens and drop the rest, in the backend too (an id
        read ahead stays while every token is kept)."""
        self._check_in_step()
        if n_keep < len(self.tokens):
            self._ahead = None
            self.backend.rewind(n_keep)
            del self.tokens[n_keep:]
            if self._hidden is not None:
                self._hidden.truncate(n_keep)

    def rewind_to_prefix_of(self, context: Sequence[int], limit: int | None = None) -> int:
        """Rewind to the longest cached prefix of ``context`` (at most ``limit`` tokens)."""
        keep = common_prefix_len(self.tokens, context)
        if (keep == len(self.tokens) and self._ahead is not None and keep < len(context)
                and context[keep] == self._ahead and (limit is None or keep < limit)):
            self._check_in_step()
            if self._tracking:  # its queued pass holds its state: read it (the pass after it is not queued)
                try:
                    self.backend.forward_argmax_ahead(None, False)
                    self._hidden.put(keep, self.backend.hidden_rows(range(1)))
                except BaseException:
                    self.repair()
                    raise
            self.tokens.append(self._ahead)  # the text goes on with the id read ahead: it stays
            self._ahead = None
            return keep + 1
        if limit is not None:
            keep = min(keep, limit)
        self.rewind(keep)
        return keep

    def sync(self, context: Sequence[int]) -> None:
        """Make the cache hold exactly ``context``, reusing the longest cached prefix."""
        keep = self.rewind_to_prefix_of(context)
        if keep < len(context):
            self.feed(context[keep:])

    def reset(self) -> None:
        self.rewind(0)

    # ---- hidden states ----------------------------------------------------------------
    def track_hidden(self, on: bool, tail: int | None = None, layers: Sequence[int] = ()) -> None:
        """Keep (or stop keeping) the hidden state of every position fed from now on; the
        backend records them for its passes meanwhile. ValueError if it cannot, naming why.
        ``tail``: of a pass longer than this, only its last ``tail`` positions are kept (the
        others read as unknown), for a reader of recent positions only. ``layers``: keep the
        outputs of these layers side by side instead of the output head's input
        (Backend.hidden_layers, for EAGLE-3); states kept for other layers read as unknown from
        then on. One kind at a time: engines of a comparison that share a target re-assert their
        drafters' before each run (sessions/compare.track_as_drafted)."""
        layers = tuple(layers)
        support = self.backend.hidden_support
        self._drop_ahead()  # a queued pass was built tracked or not: none crosses the change
        if on and not support.available:
            raise ValueError(f"{self.backend.name} gives no hidden states: {support.reason}")
        if on and layers:
            support.check_layers(layers)  # before anything changes: ValueError naming why
        # Two readers of one sequence (a bench of medusa and eagle): the longer tail serves both.
        if on and self._tracking and tail is not None:
            tail = None if self._hidden_tail is None else max(tail, self._hidden_tail)
        self._hidden_tail = tail if on else None
        if on and layers != self._layers:
            self._tracking = False
            self.backend.track_hidden(False)
            self.backend.hidden_layers(layers)  # ValueError naming why where it cannot
            self._layers, self._hidden = layers, None
        self.backend.track_hidden(on)
        self._tracking = on
        if on and self._hidden is None:
            # Layer outputs are kept in float16, as `specrun heads train` keeps them: three layers of
            # a wide target at every cached position add up (an 8B target at 32k tokens: 0.8 GB).
            self._hidden = HiddenStore(support.size * max(len(layers), 1), dtype=np.float16 if layers else np.float32)

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers whose outputs the kept states are (track_hidden's); () the output head's input."""
        return self._layers

    @property
    def tracking(self) -> bool:
        """Are hidden states kept for the positions fed (``track_hidden``)?"""
        return self._tracking

    def hidden(self, start: int, stop: int) -> np.ndarray | None:
        """Float32 hidden states (stop-start, H; with layers, len(layers) * H) of the cached
        positions [start, stop), or None
        if any of them was fed while tracking was off (or is not cached)."""
        if self._hidden is None or not 0 <= start <= stop <= len(self.tokens):
            return None
        return self._hidden.get(start, stop)

    def _check_untracked(self, method: str) -> None:
        if self._tracking:
            raise ValueError(f"{method} cannot keep hidden states: feed or feed_argmax while tracking")


_SEQUENCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def sequence_for(backend: Backend) -> KVSequence:
    """The one KVSequence of ``backend``: every engine and drafter driving it shares this view."""
    sequence = _SEQUENCES.get(backend)
    if sequence is None:
        sequence = _SEQUENCES[backend] = KVSequence(backend)
    return sequence
