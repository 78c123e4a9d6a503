"""Several sequences decoded together: slots that share each pass of one model.

A model opened with slots holds one sequence per slot in one cache (llama.cpp: a context with
a sequence id per slot). Each slot is a Backend of its own (``Slot``), so an engine, a drafter
and a chat session drive it as they drive any model, one thread per slot. What makes the
passes shared is the ``Rendezvous``: a slot's pass is handed to it and waits; once every slot
that is generating waits, the last one to arrive runs what they handed in, one batch per model
(the target's verify passes together, the draft model's passes together), and wakes them. No
slot waits for a pass that is not coming: a slot counts only while it generates (``joined``),
and a slot that leaves lets the others' passes run without it.

A long prompt is fed in chunks of ``PREFILL_CHUNK`` tokens, each a pass of its own, so the
other slots keep decoding beside it instead of waiting for the whole prompt.

Rewinds are recorded, not run, while other threads may be decoding: a slot's dropped cells are
removed just before the next batch of its model runs, under the rendezvous' lock; so is a recurrent
model's kept state (``keep_state``: a draft model keeps it before drafting), after the removals.
A removal that fails is tried once more, before the sequence's next pass; failing again (or failing
to clear what a failed batch wrote), the sequence is emptied whole and its slot told: its request
fails, and the next one reads its prompt afresh — never a pass over cells its slot let go.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Protocol

import numpy as np

import dataclasses

from specrun.backends.base import (
    ArgmaxFromLogits, HeldTree, HiddenSupport, HiddenTracking, ParentsModel, TreeSupport, held_tree_for,
)
from specrun.tree import TokenTree
from specrun.backends.mlx_common import release_thread_streams
from specrun.errors import ContextFullError

PREFILL_CHUNK = 256  # prompt tokens per pass while other slots decode
VERIFIER = "target"  # the label of the model whose passes verify (the others draft for it)
SLOTS_REASON = "a slot shares each pass with the other slots' sequences"
# slots opened for the output head's input give no layer outputs (those opened for layers, EAGLE-3's, do)
SLOT_LAYERS_REASON = "slots opened for the output head's input give no layer outputs"


def slot_hidden_support(model, parent) -> HiddenSupport:
    """What a slot of ``model`` gives of hidden states where the model was opened with ``hidden``
    (every pass fills them): its parent's, the layers it was opened for (``layers``) or the output
    head's input alone; else none, saying why."""
    support = getattr(parent, "hidden_support", None)
    if not getattr(model, "hidden", False) or support is None or not support.available:
        return HiddenSupport(False, reason=f"{SLOTS_REASON}, and these slots give no hidden states")
    if getattr(model, "layers", ()):
        return support
    return dataclasses.replace(support, layer_outputs=0, layer_reason=SLOT_LAYERS_REASON)


def _named(layers: tuple[int, ...]) -> str:
    return f"the outputs of layers {', '.join(map(str, layers))}" if layers else "the output head's input"


@dataclass
class SlotPass:
    """One slot's share of a batched pass: ``tokens`` at positions start, start+1, ... of
    sequence ``seq``, logits wanted at ``rows`` (indices into tokens)."""

    seq: int
    start: int
    tokens: Sequence[int]
    rows: Sequence[int]
    tree: TokenTree | None = None  # held after the tokens (rows index the tokens, then the nodes)
    logits: np.ndarray | None = None  # (len(rows), V), once run
    hidden: np.ndarray | None = None  # (rows fed, H), once run on a model opened with ``hidden``
    error: BaseException | None = None
    done: bool = False

    @property
    def fed(self) -> int:
        """The rows the pass feeds: its tokens, and its tree's nodes."""
        return len(self.tokens) + (len(self.tree) if self.tree is not None else 0)


class SlotModel(Protocol):
    """A model holding one sequence per slot, whose passes take several sequences at once."""

    n_slots: int
    slot_ctx: int  # the tokens each slot's sequence may hold
    # every pass fills its hidden states too (the output head's input at each token fed: heads
    # drafting for the slots); the model's whole context outputs every row then
    hidden: bool

    def run(self, passes: Sequence[SlotPass]) -> None:
        """Run every pass (at most one per sequence) as one batch, filling each one's logits (and
        hidden states, ``hidden``); raise if the batch failed as a whole (each pass is then tried alone)."""

    def remove(self, seq: int, n_keep: int) -> None:
        """Drop sequence ``seq``'s cached tokens from position n_keep on (and any tree it holds)."""

    def close(self) -> None: ...


class TreeSlotModel(SlotModel, Protocol):
    """A SlotModel whose passes may hold a token tree after their tokens (``tree_support``)."""

    tree_support: TreeSupport

    def keep_path(self, seq: int, start: int, tree: TokenTree, path: Sequence[int]) -> None:
        """Sequence ``seq`` keeps the nodes ``path`` of the tree its last pass held at ``start``;
        every other node goes."""


class KeepingSlotModel(SlotModel, Protocol):
    """A SlotModel of a recurrent model, whose sequences keep their state to rewind to."""

    recurrent: bool

    def keep(self, seq: int) -> None:
        """Sequence ``seq`` keeps its state as it is now."""


@dataclass
class RendezvousCounts:
    """Totals for /metrics: batched passes run, the sequences and tokens they held."""

    passes: int = 0
    sequences: int = 0
    tokens: int = 0
    seconds: float = 0.0


class Rendezvous:
    """Where slots' passes meet (module docstring). One per server, shared by every model.

    The batches run on a thread of the rendezvous' own, always the same one: llama.cpp's CPU
    threads (an OpenMP team) belong to the thread that calls it, and a team per calling slot,
    each spinning after its pass, left two slots at 0.4x one on a 2-core machine. Even an idle
    second team slows the first one's passes (likely libgomp's barriers spinning less once a
    process holds more team threads than cores; GOMP_SPINCOUNT does not help): a 1-token pass
    of smollm2-135m-x2 on 2 cores, 40 ms after no other thread's pass, 56-95 ms after one on the
    main thread. So no other thread of a server may run a pass on several CPU threads (checked:
    `serve --parallel 2` on that pair, loaded, holds no team but this thread's)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._joined = 0  # slots generating: each will hand in a pass or leave
        self._waiting: list[tuple[SlotModel, SlotPass]] = []
        self._removals: dict[int, dict[int, int]] = {}  # id(model) -> seq -> n_keep, run before its next batch
        self._keeps: dict[int, set[int]] = {}  # id(model) -> seqs keeping their state, after the removals
        # id(model) -> seq -> (start, tree, path): a tree's accepted path, kept before the removals
        self._paths: dict[int, dict[int, tuple[int, TokenTree, tuple[int, ...]]]] = {}
        self._failed_removals: set[tuple[int, int]] = set()  # (id(model), seq) whose last removal failed
        self._emptied: set[tuple[int, int]] = set()  # (id(model), seq) emptied whole: its slot not told yet
        self._models: dict[int, SlotModel] = {}
        self._labels: dict[int, str] = {}  # id(model) -> what /metrics calls it
        self._local = threading.local()
        self._runner: threading.Thread | None = None
        self._closed = False
        self.counts: dict[str, RendezvousCounts] = {}  # by model label
        self.last_sequences: dict[int, int] = {}  # id(model) -> sequences its last batch held
        self.last_tokens: dict[int, int] = {}  # id(model) -> tokens its last batch held, all sequences'
        # told of each batch that ran whole, on the runner's thread: its model's label, each pass's
        # tokens (one pass a sequence), seconds
        self.observer: Callable[[str, list[int], float], None] | None = None
        self.observer_error: BaseException | None = None  # what stopped it being told, if anything

    # ---- slots come and go ----------------------------------------------------------
    def join(self) -> None:
        """The calling thread generates from now on: the others' passes wait for its pass."""
        with self._cond:
            if getattr(self._local, "joined", False):
                raise RuntimeError("this thread has joined the rendezvous already")
            self._local.joined = True
            self._joined += 1

    def leave(self) -> None:
        """The calling thread stops generating; passes that waited only for it run now."""
        with self._cond:
            if not getattr(self._local, "joined", False):
                return
            self._local.joined = False
            self._joined -= 1
            self._cond.notify_all()

    @property
    def joined(self) -> int:
        return self._joined

    def close(self) -> None:
        """Stop the runner thread (no pass may be waiting)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._runner is not None:
            self._runner.join()

    # ---- passes --------------------------------------------------------------------
    def submit(self, model: SlotModel, slot_pass: SlotPass, label: str = "") -> np.ndarray:
        """Hand in one pass and wait until it has run; its logits (len(rows), V)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the slots are closed")
            alone = not getattr(self._local, "joined", False)
            if alone:  # a thread outside any generation (a probe, a warm-up) runs at once, counted for the call
                self._joined += 1
            self._models[id(model)] = model
            self._labels[id(model)] = label or type(model).__name__
            self._waiting.append((model, slot_pass))
            if self._runner is None:
                self._runner = threading.Thread(target=self._run, name="specrun-slots", daemon=True)
                self._runner.start()
            self._cond.notify_all()
            try:
                while not slot_pass.done:
                    self._cond.wait()
            finally:
                if alone:
                    self._joined -= 1
                    self._cond.notify_all()
        if slot_pass.error is not None:
            raise slot_pass.error
        return slot_pass.logits

    def remove(self, model: SlotModel, seq: int, n_keep: int) -> None:
        """Record that ``seq`` drops its cells from ``n_keep`` on, run before its model's next batch."""
        with self._cond:
            removals = self._removals.setdefault(id(model), {})
            removals[seq] = min(n_keep, removals.get(seq, n_keep))
            self._models[id(model)] = model

    def keep_path(self, model: TreeSlotModel, seq: int, start: int, tree: TokenTree, path: Sequence[int]) -> None:
        """Record that ``seq`` keeps ``path`` of the tree its last pass held, before its model's next batch."""
        with self._cond:
            self._paths.setdefault(id(model), {})[seq] = (start, tree, tuple(path))
            self._models[id(model)] = model

    def keep(self, model: KeepingSlotModel, seq: int) -> None:
        """Record that ``seq`` keeps its state as it will be before its model's next batch."""
        with self._cond:
            self._keeps.setdefault(id(model), set()).add(seq)
            self._models[id(model)] = model

    def _run(self) -> None:
        """The runner: once every joined slot waits, run the waiting passes, model by model (each
        model's recorded removals first), outside the lock, then wake the slots. Once closed, the
        MLX streams this thread made go with it (mlx_common.release_thread_streams)."""
        try:
            self._run_batches()
        finally:
            release_thread_streams()

    def _run_batches(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not (self._waiting and len(self._waiting) >= self._joined):
                    self._cond.wait()
                if self._closed:
                    return
                waiting = self._take_waiting()
                by_model: dict[int, list[SlotPass]] = {}
                for model, slot_pass in waiting:
                    by_model.setdefault(id(model), []).append(slot_pass)
                removals = {key: self._removals.pop(key, {}) for key in by_model}
                keeps = {key: self._keeps.pop(key, set()) for key in by_model}
                paths = {key: self._paths.pop(key, {}) for key in by_model}
            try:
                for key, passes in by_model.items():
                    model = self._models[key]
                    ready = self._prepared(model, passes, removals[key], keeps[key], paths[key])
                    if ready:
                        self._run_batch(model, ready)
            except Exception:  # noqa: BLE001 - the runner outlives any failure: the passes fail, not every slot
                error = _failure()
                for _, slot_pass in waiting:
                    if slot_pass.logits is None and slot_pass.error is None:
                        slot_pass.error = error
            finally:  # whatever happened, no slot waits for good
                with self._cond:
                    for _, slot_pass in waiting:
                        if not slot_pass.done and slot_pass.logits is None and slot_pass.error is None:
                            slot_pass.error = RuntimeError("the slots' pass did not run")
                        slot_pass.done = True
                    self._cond.notify_all()

    def _prepared(self, model: SlotModel, passes: list[SlotPass], removals: dict[int, int],
                  keeps: set[int], paths: dict[int, tuple[int, TokenTree, tuple[int, ...]]] | None = None
                  ) -> list[SlotPass]:
        """Run ``model``'s recorded tree paths kept, its removals, then its keeps; the passes whose
        sequence's came through (one whose removal or keep failed fails with it: what its cache
        holds is unknown). A removal that failed is recorded again, to be tried before the
        sequence's next pass (its slot already counts the tokens as gone), whether or not the
        sequence had a pass in this batch; failing a second time, the sequence is emptied whole
        (``_empty``), as one whose path could not be kept is at once."""
        failed: dict[int, BaseException] = {}
        for seq, (start, tree, path) in (paths or {}).items():
            try:
                model.keep_path(seq, start, tree, path)
            except Exception:  # noqa: BLE001 - its cells are unknown: emptied, its request fails
                failed[seq] = _failure()
                self._empty(model, seq)
        for seq, n_keep in removals.items():
            if seq in failed:
                continue
            key = (id(model), seq)
            try:
                model.remove(seq, n_keep)
                self._failed_removals.discard(key)
            except Exception:  # noqa: BLE001 - this sequence's request fails, not the others'
                failed[seq] = _failure()
                if key in self._failed_removals:
                    self._failed_removals.discard(key)
                    self._empty(model, seq)
                    continue
                self._failed_removals.add(key)
                with self._cond:
                    later = self._removals.setdefault(id(model), {})
                    later[seq] = min(n_keep, later.get(seq, n_keep))
        for seq in sorted(keeps - failed.keys()):
            try:
                model.keep(seq)
            except Exception:  # noqa: BLE001
                failed[seq] = _failure()
        for slot_pass in passes:
            if slot_pass.seq in failed:
                slot_pass.error = failed[slot_pass.seq]
        return [slot_pass for slot_pass in passes if slot_pass.seq not in failed]

    def _empty(self, model: SlotModel, seq: int) -> None:
        """``seq`` emptied whole, where a removal of part of it failed (what its cells hold is
        unknown), and its slot told at its next pass (``take_emptied``). Where even that fails, the
        whole removal is recorded, to be tried before the sequence's next pass."""
        try:
            model.remove(seq, 0)
        except Exception:  # noqa: BLE001 - the model is failing: its next pass tries again
            with self._cond:
                self._removals.setdefault(id(model), {})[seq] = 0
        with self._cond:
            self._emptied.add((id(model), seq))

    def emptied(self, model: SlotModel, seq: int) -> bool:
        """Was ``seq`` of ``model`` emptied whole since its slot last asked (``take_emptied``)?"""
        with self._cond:
            return (id(model), seq) in self._emptied

    def take_emptied(self, model: SlotModel, seq: int) -> bool:
        """Whether ``seq`` of ``model`` was emptied whole since its slot last asked (``_empty``)."""
        with self._cond:
            key = (id(model), seq)
            emptied = key in self._emptied
            self._emptied.discard(key)
            return emptied

    def _take_waiting(self) -> list[tuple[SlotModel, SlotPass]]:
        """Under the lock: the passes to run now. The target's passes wait while any draft model's
        are waiting: the slots drafting will hand in their verify passes next, and all of them then
        share one target batch (slots in step: draft, then verify, as llama-server's are), where a
        target pass run beside another slot's drafting would leave that slot's for a batch alone."""
        verifying = [entry for entry in self._waiting if self._labels[id(entry[0])] == VERIFIER]
        drafting = [entry for entry in self._waiting if self._labels[id(entry[0])] != VERIFIER]
        if drafting:
            self._waiting = verifying
            return drafting
        self._waiting = []
        return verifying

    def _run_batch(self, model: SlotModel, passes: list[SlotPass]) -> None:
        """One batch of ``model``; where it fails as a whole, each pass alone, so that only the
        pass at fault fails (a sequence whose cache is full, say) and the others' go on."""
        started = perf_counter()
        whole = True
        try:
            model.run(passes)
        except Exception:  # noqa: BLE001 - the batch failed: find the pass that did
            whole = False
            if len(passes) == 1:
                passes[0].error = _failure()
            else:
                for slot_pass in passes:
                    try:
                        model.remove(slot_pass.seq, slot_pass.start)  # whatever the failed batch wrote of it
                    except Exception:  # noqa: BLE001 - what its cells hold is unknown: emptied, it fails
                        slot_pass.error = _failure()
                        self._empty(model, slot_pass.seq)
                        continue
                    try:
                        model.run([slot_pass])
                    except Exception:  # noqa: BLE001 - this request alone fails
                        slot_pass.error = _failure()
        seconds = perf_counter() - started
        tokens = sum(slot_pass.fed for slot_pass in passes)  # a tree's nodes are rows the pass computes
        self.last_sequences[id(model)] = len(passes)
        self.last_tokens[id(model)] = tokens
        counts = self.counts.setdefault(self._labels[id(model)], RendezvousCounts())
        counts.passes += 1
        counts.sequences += len(passes)
        counts.tokens += tokens
        counts.seconds += seconds
        if whole and self.observer is not None:
            try:
                self.observer(self._labels[id(model)], [slot_pass.fed for slot_pass in passes], seconds)
            except Exception as exc:  # noqa: BLE001 - what prices drafts must never stop every slot's passes
                self.observer, self.observer_error = None, exc


def _failure() -> BaseException:
    """The exception being handled."""
    return sys.exc_info()[1]


class Slot(ParentsModel, ArgmaxFromLogits, HiddenTracking):
    """One slot of a SlotModel as a Backend: its sequence, fed through the rendezvous.

    ``parent``: the model opened as a single sequence, which answers everything about the model
    (vocabulary, template, tokenizing) and names it to the stored costs with ``variant`` telling
    slots apart: a slot's passes cost what the batch around them costs. Where the model was
    opened with ``hidden``, a tracking slot keeps its last forward's hidden states (``hidden_rows``)
    for heads drafting from them. Where it holds trees (``tree_support``), a slot's verify pass may
    carry a tree after its tokens, in the same shared batch; the path it keeps is recorded and
    kept before the model's next batch, as rewinds are.
    """

    def __init__(self, model: SlotModel, seq: int, rendezvous: Rendezvous, parent, label: str) -> None:
        self.model = model
        self.seq = seq
        self.rendezvous = rendezvous
        self.parent = parent
        self.label = label
        self.name = parent.name
        self.vocab = parent.vocab
        self.n_ctx = model.slot_ctx
        self.path = getattr(parent, "path", None)
        parent_variant = getattr(parent, "variant", "")
        self.variant = f"{parent_variant};slots={model.n_slots}" if parent_variant else f"slots={model.n_slots}"
        self._n_past = 0
        self._last_fed = 0  # tokens this slot's last pass fed (its last chunk's)
        self._last_logits = np.zeros((0, self.vocab.size), np.float32)
        self.hidden_support = slot_hidden_support(model, parent)
        self.tree_support = getattr(model, "tree_support", None) or TreeSupport(False, SLOTS_REASON)
        self._held_tree: HeldTree | None = None

    @property
    def n_past(self) -> int:
        return self._n_past

    @property
    def others_in_pass(self) -> int:
        """The other sequences the last batch of this model held (0 alone)."""
        return max(self.rendezvous.last_sequences.get(id(self.model), 1) - 1, 0)

    @property
    def others_tokens_in_pass(self) -> int:
        """The tokens the other sequences fed the last batch of this model (0 alone): what a
        pass costs is read by the batch's tokens (TargetCosts.others_tokens)."""
        batch = self.rendezvous.last_tokens.get(id(self.model), self._last_fed)
        return max(batch - self._last_fed, 0)

    # ---- the sequence ------------------------------------------------------------------
    def forward(self, tokens: Sequence[int], logit_rows: Sequence[int]) -> np.ndarray:
        rows = list(logit_rows)
        if self._n_past + len(tokens) > self.n_ctx:
            raise ContextFullError(f"the context of {self.n_ctx} tokens is full", "shorten the prompt or raise --ctx")
        self._held_tree = None
        if not tokens:
            width = self.hidden_support.size * max(len(self._layers), 1)
            self._hidden = np.zeros((0, width), np.float32) if self._tracking else None
            return np.zeros((0, self.vocab.size), np.float32)
        last_start = (len(tokens) - 1) // PREFILL_CHUNK * PREFILL_CHUNK
        if rows and min(rows) < last_start:
            raise ValueError(f"logit rows must fall in the last {PREFILL_CHUNK} tokens of a slot's forward")
        if self.rendezvous.take_emptied(self.model, self.seq):
            self._n_past = 0
            raise RuntimeError("this slot's cache was emptied after a rewind of it failed: this request fails, "
                               "the next one reads its prompt afresh")
        out = None
        self._hidden = None
        states = []  # each chunk's hidden states, while tracking
        for start in range(0, len(tokens), PREFILL_CHUNK):
            chunk = tokens[start : start + PREFILL_CHUNK]
            wanted = [row - last_start for row in rows] if start == last_start else []
            slot_pass = SlotPass(self.seq, self._n_past, chunk, wanted)
            try:
                out = self.rendezvous.submit(self.model, slot_pass, self.label)
            except BaseException:
                if self.rendezvous.take_emptied(self.model, self.seq):  # emptied as its pass failed
                    self._n_past = 0
                raise
            self._n_past += len(chunk)
            self._last_fed = len(chunk)
            if self._tracking:
                states.append(slot_pass.hidden)
        if self._tracking:
            self._hidden = states[0] if len(states) == 1 else np.concatenate(states)
        return out

    @property
    def emptied(self) -> bool:
        """Was this slot's sequence emptied whole while it waited (a rewind of it that failed twice)?
        Its next request starts afresh (ChatSession.new_text empties its account) rather than fail."""
        return self.rendezvous.emptied(self.model, self.seq)

    def rewind(self, n_keep: int) -> None:
        # always recorded, even at n_past: a pass cut short may have left cells n_past does not count
        self.rendezvous.remove(self.model, self.seq, n_keep)
        self._n_past = min(self._n_past, n_keep)
        self._held_tree = None  # the model's removal drops the tree's cells too
        if n_keep == 0:
            self.rendezvous.take_emptied(self.model, self.seq)  # empty either way: nothing to tell

    def keep_state(self) -> None:
        """A recurrent model's slot keeps its state as it is now (LlamaCppBackend.keep_state); for
        other models nothing happens."""
        if getattr(self.model, "recurrent", False):
            self.rendezvous.keep(self.model, self.seq)

    def forward_tree(self, tokens: Sequence[int], tree: TokenTree, logit_rows: Sequence[int]) -> np.ndarray:
        """``tokens`` appended and ``tree`` held after them in one pass of the shared batch (rows
        index the tokens, then the nodes); ``keep_path`` commits a path of it."""
        self.tree_support.check(tree)
        rows, n_fed = list(logit_rows), len(tokens) + len(tree)
        if n_fed > PREFILL_CHUNK:
            raise ValueError(f"a tree pass feeds {n_fed} tokens; a slot's pass holds {PREFILL_CHUNK}")
        if self._n_past + n_fed > self.n_ctx:
            raise ContextFullError(f"the context of {self.n_ctx} tokens is full", "shorten the prompt or raise --ctx")
        if any(not 0 <= row < n_fed for row in rows):
            raise ValueError(f"logit rows {rows} fall outside the {n_fed} tokens and nodes fed")
        if self.rendezvous.take_emptied(self.model, self.seq):
            self._n_past = 0
            raise RuntimeError("this slot's cache was emptied after a rewind of it failed: this request fails, "
                               "the next one reads its prompt afresh")
        self._held_tree, self._hidden = None, None
        slot_pass = SlotPass(self.seq, self._n_past, [int(token) for token in tokens], rows, tree=tree)
        try:
            out = self.rendezvous.submit(self.model, slot_pass, self.label)
        except BaseException:
            if self.rendezvous.take_emptied(self.model, self.seq):
                self._n_past = 0
            raise
        self._n_past += len(tokens)
        self._last_fed = n_fed
        self._held_tree = HeldTree(self._n_past, tree)
        if self._tracking:
            self._hidden = slot_pass.hidden  # (len(tokens) + nodes, H)
        return out

    def forward_tree_argmax(self, tokens: Sequence[int], tree: TokenTree, logit_rows: Sequence[int]) -> np.ndarray:
        self._last_logits = self.forward_tree(tokens, tree, logit_rows)
        return self._last_logits.argmax(axis=-1)

    def keep_path(self, path: Sequence[int]) -> None:
        """Commit the held tree's nodes ``path`` (recorded: run before the model's next batch)."""
        tree = held_tree_for(self._held_tree, self._n_past, path)
        self._held_tree = None
        self.rendezvous.keep_path(self.model, self.seq, self._n_past, tree, path)
        self._n_past += len(path)

    def hidden_layers(self, layers) -> None:
        """What the slot's passes give is what its model was opened for: other layers are a ValueError."""
        layers, opened = tuple(layers), tuple(getattr(self.model, "layers", ()))
        if layers == self._layers:
            return
        if self._tracking:
            raise ValueError("choose the layers tracked passes record before tracking (track_hidden(False) first)")
        if layers:
            self.hidden_support.check_layers(layers)
        if layers != opened:
            raise ValueError(f"these slots give {_named(opened)}, not {_named(layers)}")
        self._layers = layers

    def track_hidden(self, on: bool) -> None:
        opened = tuple(getattr(self.model, "layers", ()))
        if on and self.hidden_support.available and self._layers != opened:
            raise ValueError(f"these slots give {_named(opened)}: ask for them (hidden_layers) before tracking")
        super().track_hidden(on)

    def token_embeddings(self, ids):
        self.hidden_support.check()
        return self.parent.token_embeddings(ids)

    def output_rows(self, ids):
        self.hidden_support.check()
        return self.parent.output_rows(ids)

    def logits_beyond_rows(self) -> str:
        return self.parent.logits_beyond_rows()

    def native_mtp(self):
        """This slot's sequence of the MTP context the slots' model runs natively (llama.cpp's:
        LlamaSlots.native_mtp), or None."""
        opened = getattr(self.model, "native_mtp", None)
        return opened(self.seq) if opened is not None and self.hidden_support.available else None

    def mtp_layer(self, heads):
        """The MTP layer in the model's own arrays (MLX's, one the slots share, its calls under
        MODEL_CALLS), or None: the drafter then runs it in NumPy."""
        return self.parent.mtp_layer(heads) if self.hidden_support.available else None

    def close(self) -> None:
        """The slot's sequence is emptied; the model is closed by whoever opened the slots."""
        self.rewind(0)
