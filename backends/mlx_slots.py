"""An MLX model opened with slots: one cache for every slot's cells, one model call a batch
(backends/slots.py).

mlx-lm's caches hold one sequence, or a left-padded batch that rewinds as a whole; slots rewind
each on its own. So the slots share one ``KVCache`` per layer, as llama.cpp's unified cache does:
a batch appends every pass's tokens, each cell remembers its sequence and position, and one call
runs the batch as a single row, a packed pass (backends/mlx_common.py, the tree pass's way): the
mask shows each token the cells of its own sequence at or before its position (a sliding-window
layer's, the last ``window`` of them: its cache is a plain one here), and RoPE places it at its
own position. The weights are read once for every slot's tokens.

A removed cell leaves a hole. Before the next batch the cells after the first hole move down over
it: mostly the last batch's rejected drafts, so a short move at the end of the cache; a slot
emptied for its next request moves the cells after it once.

A hybrid's Gated DeltaNet layers (Qwen3.5's, Qwen3-Next's) keep a recurrent state, which a packed
row cannot share: there each sequence's tokens run through the layer's mixer on a state of the
sequence's own (an ``ArraysCache`` per sequence and layer; the mixer shadowed on the layer for the
call), while the attention layers run the packed row as ever. MLX arrays are never written into,
so a sequence keeps, for nothing, its state before its last pass's own tokens, and where its draft
model's slot asks (``keep``), its state then. A rewind restores the newest of them at or before
where it goes, drops the attention cells from there and feeds the tokens between at the head of the
sequence's next pass, whose mixer call runs them apart first (the state after them is the next
one kept); with neither, the sequence starts again and its kept tokens are fed so.

Opened with ``trees``, a slot's verify pass may carry a token tree after its tokens in the same
packed call: its nodes' cells belong to no sequence yet (tagged ``TREE_TAG - seq``), each node's
row sees its sequence's cells and its own ancestors among the nodes, at its depth's position;
``keep_path`` gives the kept path's cells to the sequence at the positions they were computed at,
and the other nodes' become holes the next batch closes; a tree no path was kept of goes as its
slot's next pass runs (a hybrid's state holds one path: chains).

Opened with ``hidden`` (heads drafting for the slots), the body runs the packed row and the head
only the rows asked for, and each pass gets its tokens' hidden states (or the layers' outputs
EAGLE-3 reads, recorded as the body calls them); a hybrid's kept tokens fed again are cut off.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from specrun.backends.base import TreeSupport
from specrun.backends.mlx_common import MODEL_CALLS, packed_pass, packed_problem, recording_body
from specrun.backends.mlx_snapshots import mixer_of
from specrun.backends.slots import SlotPass
from specrun.errors import ContextFullError, ModelFileError

SLOTS_FIX = "serve it with --parallel 1"


# A sliding-window layer's cache (RotatingKVCache) becomes a plain one here, its window kept by
# the mask: each token sees its sequence's last ``max_size`` positions (and the first ``keep``).
SLOT_CACHES = ("KVCache", "RotatingKVCache")


def recurrent_mixers(parent) -> dict[int, str]:
    """The layers of ``parent``'s model whose cache is a recurrent state (ArraysCache) run by a Gated
    DeltaNet mixer: layer index -> the mixer's name on its layer."""
    found = {}
    layers = getattr(parent.model, "layers", ())
    for index, layer_cache in enumerate(parent._cache):
        if type(layer_cache).__name__ == "ArraysCache" and index < len(layers):
            mixer = mixer_of(layers[index])
            name = next((key for key, child in layers[index].children().items() if child is mixer), None)
            if mixer is not None and name is not None:
                found[index] = name
    return found


def slots_problem(parent) -> str | None:
    """Why the model of ``parent`` (an MlxBackend) cannot decode several sequences together."""
    return packed_problem(parent.model, parent._cache, "several sequences", SLOT_CACHES,
                          apart=frozenset(recurrent_mixers(parent)))


TREE_TAG = -2  # a cell of sequence s's tree not kept yet is tagged TREE_TAG - s (-1: a hole)


def _nodes(slot_pass: SlotPass) -> int:
    return len(slot_pass.tree) if slot_pass.tree is not None else 0


class _RecurrentLayer:
    """What a recurrent layer's cache is in the packed call: nothing of its own (each sequence's
    state is elsewhere); ``make_mask`` is set by the packed pass (None: no mask)."""


@dataclass
class _Segment:
    """One pass's rows in the packed call: ``first`` to ``end``, the first ``again`` of them kept
    tokens fed again."""

    seq: int
    first: int
    end: int
    again: int


class _SegmentedMixer:
    """A recurrent layer's mixer for one packed call: each segment's rows on its sequence's own
    state, kept tokens first and apart (the state after them noted in ``before``)."""

    def __init__(self, mx, mixer, layer: int, segments: list[_Segment], states, before) -> None:
        self._mx, self._mixer, self._layer = mx, mixer, layer
        self._segments, self._states, self._before = segments, states, before

    def __call__(self, x, mask=None, cache=None):  # noqa: ARG002 - the packed row's: each sequence has its own
        outputs = []
        for segment in self._segments:
            state = self._states[segment.seq][self._layer]
            split = segment.first + segment.again
            if segment.again:
                outputs.append(self._mixer(x[:, segment.first : split], None, state))
            self._before.setdefault(segment.seq, {})[self._layer] = (state[0], state[1])
            if segment.end > split:
                outputs.append(self._mixer(x[:, split : segment.end], None, state))
        return self._mx.concatenate(outputs, axis=1)


@contextmanager
def _mixers_apart(mx, model, mixers: dict[int, str], segments, states, before) -> Iterator[None]:
    """During one packed call (MODEL_CALLS held): each recurrent layer's mixer runs sequence by
    sequence (_SegmentedMixer shadows it on the layer instance; the parameter tree is untouched)."""
    layers = model.layers
    try:
        for index, name in mixers.items():
            mixer = getattr(layers[index], name)
            object.__setattr__(layers[index], name, _SegmentedMixer(mx, mixer, index, segments, states, before))
        yield
    finally:
        for index, name in mixers.items():
            layers[index].__dict__.pop(name, None)


class MlxSlots:
    """``n_slots`` sequences of ``slot_ctx`` tokens on the model of ``parent`` (an MlxBackend).
    ``hidden``: every pass gives the hidden state of each token it feeds too, for heads drafting
    for the slots: the model's body run and its head applied to the rows asked for (as the parent's
    tracked passes: backends/mlx.split_model), or with ``layers`` those layers' outputs side by side."""

    def __init__(self, parent, n_slots: int, slot_ctx: int | None = None, hidden: bool = False,
                 layers: Sequence[int] = (), trees: bool = False) -> None:
        problem = slots_problem(parent)
        if problem:
            raise ModelFileError(f"{parent.path.name}: {problem}", SLOTS_FIX)
        # trees: a slot's pass may hold one after its tokens (not a hybrid's: MlxBackend.slots_tree_problem)
        self.tree_support = TreeSupport(True) if trees else TreeSupport(False, "these slots were opened for chains")
        self._mx = parent._mx
        self.parent = parent
        self.n_slots = n_slots
        self.hidden = hidden and parent.hidden_support.available
        self.layers = tuple(layers) if self.hidden else ()
        self._sink: list = []  # the recorded layers' outputs of a pass
        self._body = None
        if self.hidden:
            parent.hidden_support.check_layers(self.layers) if self.layers else None
            self._body = recording_body(parent._split.body, self.layers, self._sink) if self.layers else parent._split.body
        self.slot_ctx = slot_ctx or parent.n_ctx
        self.n_vocab = parent.vocab.size
        self._mixers = recurrent_mixers(parent)
        self.recurrent = bool(self._mixers)
        self._cache = [_RecurrentLayer() if index in self._mixers else parent._lm_cache.KVCache()
                       for index in range(len(parent._cache))]
        # a hybrid's, per sequence: its recurrent states by layer, the tokens they read, kept
        # tokens to feed again, and the states kept (before its last pass's own tokens; keep's)
        self._states = [{index: parent._lm_cache.ArraysCache(2) for index in self._mixers} for _ in range(n_slots)]
        self._fed: list[list[int]] = [[] for _ in range(n_slots)]
        self._again: list[list[int]] = [[] for _ in range(n_slots)]
        self._before_pass: list[tuple[int, dict] | None] = [None] * n_slots
        self._kept: list[tuple[int, dict] | None] = [None] * n_slots
        self._keep_after_again = [False] * n_slots  # keep's, once the next pass has fed the tokens again
        # per layer: (window, kept first positions) of a sliding-window layer, None for a full one
        self._windows = [(layer.max_size, layer.keep) if type(layer).__name__ == "RotatingKVCache" else None
                         for layer in parent._cache]
        self._seqs = np.zeros(0, np.int64)  # per cell: its sequence, -1 once removed
        self._positions = np.zeros(0, np.int64)  # per cell: its position in its sequence
        # A first pass here, on the thread opening the slots: arrays the model computes lazily
        # (Llama 3 RoPE's frequencies) are evaluated on it, not first on the slots' runner thread.
        probe = SlotPass(0, 0, [0], [0])
        self.run([probe])
        self.remove(0, 0)

    @property
    def cells(self) -> int:
        """Cells the cache holds, holes included (until the next batch closes them)."""
        return len(self._seqs)

    def run(self, passes: Sequence[SlotPass]) -> None:
        """Every pass in one model call: their tokens one after another in one row (none: the
        holes closed only); a hybrid's passes with their kept tokens at their head."""
        if not self.recurrent:
            self._run(passes, [])
            return
        full = []
        for slot_pass in passes:
            fed, again = self._fed[slot_pass.seq], self._again[slot_pass.seq]
            if slot_pass.start != len(fed) + len(again):
                raise ValueError(f"sequence {slot_pass.seq} holds {len(fed) + len(again)} tokens, not the "
                                 f"{slot_pass.start} its pass continues from")
            full.append(SlotPass(slot_pass.seq, len(fed), [*again, *slot_pass.tokens],
                                 [row + len(again) for row in slot_pass.rows]))
        self._run(full, [len(self._again[slot_pass.seq]) for slot_pass in passes])
        for slot_pass, ran in zip(passes, full):
            slot_pass.logits = ran.logits
            if ran.hidden is not None:  # the pass's own rows: its kept tokens fed again are cut off
                slot_pass.hidden = ran.hidden[len(ran.tokens) - len(slot_pass.tokens):]

    def _run(self, passes: Sequence[SlotPass], again: list[int]) -> None:
        for slot_pass in passes:
            if slot_pass.start + len(slot_pass.tokens) > self.slot_ctx:
                raise ContextFullError(f"the context of {self.slot_ctx} tokens is full", "shorten the prompt or raise --ctx")
        for slot_pass in passes:  # a tree its slot let go (no path kept before this pass of its own)
            self._seqs[self._seqs == TREE_TAG - slot_pass.seq] = -1
        self._close_holes()
        for slot_pass in passes:
            held = int(np.count_nonzero(self._seqs == slot_pass.seq))
            if slot_pass.start != held:  # its tokens would sit beside cells it did not drop, or after a gap
                raise ValueError(f"sequence {slot_pass.seq} holds {held} tokens, not the {slot_pass.start} its pass "
                                 "continues from")
        if not passes:
            return
        mx, parent = self._mx, self.parent
        for slot_pass in passes:
            if slot_pass.tree is not None:
                self.tree_support.check(slot_pass.tree)
        # a tree's nodes are cells of no sequence (tagged TREE_TAG - seq) until keep_path gives the
        # kept path's to it; each node sees its sequence's cells and its own ancestors in the tree
        seqs = np.concatenate([np.concatenate([np.full(len(p.tokens), p.seq, np.int64),
                                               np.full(_nodes(p), TREE_TAG - p.seq, np.int64)]) for p in passes])
        positions = np.concatenate([np.concatenate([p.start + np.arange(len(p.tokens), dtype=np.int64),
                                                    p.start + len(p.tokens) + (p.tree.depth if p.tree is not None
                                                                               else np.zeros(0, np.int64))])
                                    for p in passes])
        all_seqs = np.concatenate([self._seqs, seqs])
        all_positions = np.concatenate([self._positions, positions])
        owners = np.concatenate([np.full(p.fed, p.seq, np.int64) for p in passes])  # each row's sequence
        visible = (all_seqs[None, :] == owners[:, None]) & (all_positions[None, :] <= positions[:, None])  # (L, cells + L)
        row = 0
        for slot_pass in passes:
            if slot_pass.tree is not None:  # its nodes' rows: their ancestors and themselves among its nodes
                nodes = row + len(slot_pass.tokens) + np.arange(len(slot_pass.tree))
                visible[np.ix_(nodes, self.cells + nodes)] = slot_pass.tree.ancestor_mask
            row += slot_pass.fed
        masks = {None: mx.array(visible)}
        for window in set(self._windows) - {None}:
            size, keep = window
            recent = positions[:, None] - all_positions[None, :] < size
            masks[window] = mx.array(visible & (recent | (all_positions[None, :] < keep)))
        ids = [int(token) for p in passes
               for token in [*p.tokens, *(p.tree.tokens if p.tree is not None else ())]]
        firsts = np.cumsum([0] + [p.fed for p in passes])
        wanted = [int(first + row) for p, first in zip(passes, firsts) for row in p.rows]
        n_cells = self.cells
        segments = [_Segment(p.seq, int(first), int(first) + p.fed, kept)
                    for p, first, kept in zip(passes, firsts, again)]
        states = {p.seq: {index: (state[0], state[1]) for index, state in self._states[p.seq].items()} for p in passes}
        before: dict[int, dict] = {}  # per sequence: its states before its pass's own tokens
        attention = [layer for layer in self._cache if not isinstance(layer, _RecurrentLayer)]
        try:
            with packed_pass(parent.model, self._cache, [masks[window] for window in self._windows], mx.array(positions)):
                with _mixers_apart(mx, parent.model, self._mixers, segments, self._states, before):
                    if self.hidden:  # the body, its head on the rows asked for only
                        self._sink.clear()
                        body = self._body(mx.array(ids)[None], cache=self._cache)  # (1, L, H)
                        recorded = dict(self._sink)
                        self._sink.clear()
                        rows = (mx.concatenate([recorded[layer][0] for layer in self.layers], axis=-1)
                                if self.layers else body[0])
                        logits = parent._split.head(body[:, mx.array(wanted)]) if wanted else None
                    else:
                        rows = None
                        logits = parent.model(mx.array(ids)[None], cache=self._cache)  # (1, L, V)
                        logits = logits[:, mx.array(wanted)] if wanted else None
            picked = parent._fit_vocab(logits[0]).astype(mx.float32) if wanted else None
            rows = rows.astype(mx.float32) if rows is not None else None
            recurrent = [array for p in passes for state in self._states[p.seq].values() for array in state.cache
                         if array is not None]
            mx.eval([layer.state for layer in attention] + recurrent + [array for array in (picked, rows)
                                                                          if array is not None])
        except BaseException:  # a failure mid-pass: the cells as before it (what the pass wrote lies past
            # each layer's offset; a graph left unevaluated only rewrites those columns), and the states
            for layer in attention:
                layer.trim(layer.offset - n_cells)
            for seq, layers in states.items():
                for index, (conv, recurrence) in layers.items():
                    self._states[seq][index][0], self._states[seq][index][1] = conv, recurrence
            raise
        for segment, slot_pass in zip(segments, passes):
            if self.recurrent:
                fed = self._fed[slot_pass.seq]
                fed.extend(int(token) for token in slot_pass.tokens)
                self._again[slot_pass.seq] = []
                self._before_pass[slot_pass.seq] = (slot_pass.start + segment.again, before[slot_pass.seq])
                if self._keep_after_again[slot_pass.seq]:
                    self._kept[slot_pass.seq] = self._before_pass[slot_pass.seq]
                    self._keep_after_again[slot_pass.seq] = False
        self._seqs, self._positions = all_seqs, all_positions
        outputs = np.array(picked) if picked is not None else np.zeros((0, self.n_vocab), np.float32)
        fed = np.array(rows) if rows is not None else None  # (L, H): every token's, in pass order
        first_row = 0
        for slot_pass, first in zip(passes, firsts):
            slot_pass.logits = outputs[first_row : first_row + len(slot_pass.rows)]
            first_row += len(slot_pass.rows)
            if fed is not None:  # its tokens', then its tree's nodes'
                slot_pass.hidden = fed[first : first + slot_pass.fed]

    def keep_path(self, seq: int, start: int, tree, path: Sequence[int]) -> None:
        """Sequence ``seq`` keeps the nodes ``path`` of the tree its last pass held at ``start``: their
        cells become its own at start, start + 1, ... (each was computed there, reading its
        ancestors); every other node's cell is a hole the next batch closes."""
        nodes = np.flatnonzero(self._seqs == TREE_TAG - seq)
        if len(nodes) != len(tree):  # the rendezvous empties the sequence and tells its slot
            self._seqs[nodes] = -1
            raise RuntimeError(f"sequence {seq} holds {len(nodes)} cells of its last tree, not its {len(tree)} nodes")
        for index, node in enumerate(path):
            cell = nodes[int(node)]
            self._seqs[cell], self._positions[cell] = seq, start + index
        self._seqs[self._seqs == TREE_TAG - seq] = -1

    def remove(self, seq: int, n_keep: int) -> None:
        if self.recurrent:
            n_keep = self._rewind_recurrent(seq, n_keep)
            if n_keep is None:
                return
        self._seqs[((self._seqs == seq) & (self._positions >= n_keep)) | (self._seqs == TREE_TAG - seq)] = -1

    def _rewind_recurrent(self, seq: int, n_keep: int) -> int | None:
        """A hybrid's sequence back to n_keep tokens (module docstring): its states as the newest
        kept at or before n_keep, the tokens after them to feed again; the position from which its
        attention cells go (None: nothing to drop)."""
        fed, again = self._fed[seq], self._again[seq]
        if n_keep >= len(fed) + len(again):
            return None
        self._keep_after_again[seq] = False  # what keep asked for is gone
        if again and n_keep >= len(fed):
            del again[n_keep - len(fed) :]
            return None
        kept = [state for state in (self._before_pass[seq], self._kept[seq]) if state is not None and state[0] <= n_keep]
        if self._before_pass[seq] is not None and self._before_pass[seq][0] > n_keep:
            self._before_pass[seq] = None
        if self._kept[seq] is not None and self._kept[seq][0] > n_keep:
            self._kept[seq] = None
        at, layers = max(kept, key=lambda state: state[0]) if kept else (0, {})
        for index, state in self._states[seq].items():
            state[0], state[1] = layers.get(index, (None, None))
        self._again[seq] = fed[at:n_keep]
        del fed[at:]
        return at

    def keep(self, seq: int) -> None:
        """A hybrid's sequence keeps its states as they are now (a draft model's slot, before it
        drafts). While a rewind has left tokens to feed again, the states after them are kept
        instead, once its next pass has fed them (its mixers keep them anyway, before the pass's own
        tokens): what is kept is where the round starts, at no model call of its own (else each
        round's first pass would feed again every token since the first keep)."""
        if not self.recurrent:
            return
        if self._again[seq]:
            self._keep_after_again[seq] = True
            return
        self._kept[seq] = (len(self._fed[seq]), {index: (state[0], state[1]) for index, state in self._states[seq].items()})

    def _close_holes(self) -> None:
        """Move the cells after the first removed one down over the holes (not over a tree's cells,
        whose path its slot may still keep: a batch retried pass by pass runs others' passes first)."""
        holes = np.flatnonzero(self._seqs == -1)
        if not len(holes):
            return
        first = int(holes[0])
        kept = first + np.flatnonzero(self._seqs[first:] != -1)
        mx = self._mx
        moved = mx.array(kept)
        with MODEL_CALLS:
            for layer in self._cache:
                if isinstance(layer, _RecurrentLayer):
                    continue
                if len(kept):
                    layer.keys[..., first : first + len(kept), :] = layer.keys[..., moved, :]
                    layer.values[..., first : first + len(kept), :] = layer.values[..., moved, :]
                layer.offset = first + len(kept)
            # the cells' tags follow the arrays' graph at once: an evaluation that fails here is
            # retried by the next one, never a second move over cells already moved
            self._seqs = np.concatenate([self._seqs[:first], self._seqs[kept]])
            self._positions = np.concatenate([self._positions[:first], self._positions[kept]])
            mx.eval([layer.state for layer in self._cache if not isinstance(layer, _RecurrentLayer)])

    def close(self) -> None:
        self._cache = []
        self._states = [{} for _ in self._states]
        self._before_pass = [None] * len(self._before_pass)
        self._kept = [None] * len(self._kept)
        self._seqs = self._positions = np.zeros(0, np.int64)
