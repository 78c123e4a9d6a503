"""A llama.cpp model opened with slots: one context, one sequence per slot (backends/slots.py).

The context is created on the model already loaded (its weights are not loaded again), with
room for ``n_slots`` sequences of ``slot_ctx`` tokens each. A batch carries every waiting slot's
tokens, each at its own sequence's positions, in one ``llama_decode``; the logits of the rows
asked for come back contiguous in batch order and are split by slot.

The KV cache is unified (one pool of cells; llama-server's with `-np auto`, where `-np N` gives
each sequence a stream): a batch mixing a 1-token plain step with a 5-token verify pass runs as
one graph, where streams split a batch into equal shares of consecutive sequences, a graph each.
Measured on a server (bench-scale pair, Spec-Bench, session 58), streams ran plain batching
0.91x at 2 slots and 0.65x at 4, speculation 0.93x and 0.83x: though one 2-sequence pass alone
ran 6% faster on streams (52 against 56 ms; 68 against 70 at 4). benchmarks/kv_streams.py times
one step alone at 8 sequences of 512 tokens (session 83, bench-scale target, the machine quiet):
single tokens 0.93x on streams (each token reads its own sequence's cells, not all 4,096), one
5-token pass beside seven single tokens 0.99x; runs beside other work read anything from 0.83x
to 4.9x (llama.cpp's spinning threads): a server-level run at C = 8 would have to show streams
paying before the choice changes. With ``exact`` (F32
cache, flash attention off: ``--exact``) each sequence gets a cache stream of its own instead, so
a sequence's attention reads its cells at the positions they would hold alone and sums them in
the same order: its logits are the ones it gets alone, bit for bit, whatever shares the batch
(llama.cpp then splits a batch of unequal shares into several graphs).

A recurrent or hybrid model (Qwen3.5's Gated DeltaNet) keeps one state per sequence in a cell of
its own, with llama.cpp's snapshots after each of the last pass's final tokens (``n_rs_seq``): a
slot's rejected draft rolls back to one. Those snapshots stay where their cell is, and llama.cpp
moves cells to gather a batch's sequences side by side: a moved sequence loses them, and its
rollback then reads another's state (seen with three slots started at different times). So the
slots keep sequence i in cell i: opening them feeds one token to every sequence in one batch
(cells taken in order), and from then on every sequence always holds its cell. One started again
(a rewind past its snapshots and its kept state, a new text) is emptied only just before its next
pass, which runs alone: its cell is then the only empty one, and it takes it back. The passes go
to llama.cpp as runs of consecutive sequences, ascending, a batch each (a unified cache gathers a
batch's sequences from the lowest cell of theirs): with every sequence in its own cell, none
moves. A failure that may have emptied a sequence's cell (a decode, a restore) has it take its
cell back at once, a token fed alone: two empty cells would let a sequence started again take
the other's. A draft model's slot keeps its state before drafting (``keep``, as LlamaCppBackend's
keep_state): a rewind to it restores that state, and the tokens since are fed again at the head
of the slot's next pass.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from specrun.backends.base import TreeSupport
from specrun.backends.slots import SlotPass
from specrun.errors import ContextFullError, ModelFileError


# keep's: the recurrent part of a sequence's state alone, left on the device (LlamaCppBackend's flags)
_KEPT_STATE_FLAGS = 1 | 2  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY | LLAMA_STATE_SEQ_FLAGS_ON_DEVICE
_HOLDING_TOKEN = 0  # what opening feeds each sequence so that it takes its own cell


@dataclass
class _Recurrent:
    """A recurrent model's sequence: what its state has read and how it may go back."""

    fed: list[int] = field(default_factory=list)  # the tokens its state has read
    again: list[int] = field(default_factory=list)  # kept tokens to feed again at the head of its next pass
    fresh: bool = True  # its state starts again at its next pass (emptied then, the pass run alone)
    last_pass: int = 0  # the tokens its last pass fed (its snapshots' reach)
    rolled_back: bool = False  # llama.cpp takes one rollback between passes
    kept: tuple[int, object, int] | None = None  # keep's: (position, buffer, size)

    @property
    def length(self) -> int:
        return len(self.fed) + len(self.again)


class LlamaSlots:
    """``n_slots`` sequences of ``slot_ctx`` tokens on the model of ``parent`` (a LlamaCppBackend).
    ``hidden``: every pass gives the hidden state of each token it feeds too, for heads drafting
    for the slots: the output head's input (as the parent's tracked passes: embeddings on, so
    llama.cpp outputs every row of every batch), or with ``layers`` those layers' outputs side by
    side (llama.cpp's layer-input extension copies them out for every row fed; logits only where
    asked), as EAGLE-3 reads them."""

    def __init__(self, parent, n_slots: int, slot_ctx: int | None = None, exact: bool = False,
                 hidden: bool = False, layers: Sequence[int] = (), tree_paths: int = 0) -> None:
        lib = self._lib = parent._lib
        self.recurrent = parent.recurrent
        self.hidden = hidden
        self.layers = tuple(layers) if hidden else ()
        if self.layers:  # before any context is made: ValueError naming why where it cannot
            parent.hidden_support.check_layers(self.layers)
        self.parent = parent
        self.n_slots = n_slots
        self.slot_ctx = slot_ctx or parent.n_ctx
        self.n_vocab = parent.n_vocab
        # trees: path p of slot s's tree is sequence n_slots + s * tree_paths + p (as a single sequence's
        # are 1 + p), its nodes' cells beside the slots' in the unified cache; not with --exact (a
        # stream a sequence: a path would copy its whole stream) nor a recurrent model
        self.tree_paths, self.tree_support = 0, TreeSupport(False, "these slots were opened for chains")
        if tree_paths and parent.slots_tree_problem(exact):
            self.tree_support = TreeSupport(False, parent.slots_tree_problem(exact))
        elif n_slots * (1 + tree_paths) > lib.llama_max_parallel_sequences():
            self.tree_support = TreeSupport(False, f"{n_slots} slots' trees of {tree_paths} paths need more sequences "
                                                   f"than llama.cpp's {lib.llama_max_parallel_sequences()}")
        elif tree_paths:
            self.tree_paths, self.tree_support = tree_paths, TreeSupport(True, max_paths=tree_paths)
        self._held_paths = [0] * n_slots  # the path sequences each slot's last tree used (0: none held)
        params = type(parent._ctx_params).from_buffer_copy(parent._ctx_params)
        params.n_seq_max = n_slots * (1 + self.tree_paths)
        params.kv_unified = not exact
        # a batch: every slot's verify pass, or a prompt chunk beside the others' steps
        self.n_batch = max(parent.n_batch, 512)
        # spare cells for trees left unkept before a slot's next pass frees them (a slot's own tree
        # fits its slot_ctx: Slot.forward_tree checks it)
        params.n_ctx = self.slot_ctx * n_slots + (self.n_batch if self.tree_paths else 0)
        params.n_batch = params.n_ubatch = self.n_batch
        self._ctx = lib.llama_init_from_model(parent._model, params)
        if not self._ctx:
            raise ModelFileError(f"llama.cpp could not create a context of {n_slots} slots of {self.slot_ctx} tokens "
                                 f"for {parent.path.name}", "lower --parallel or --ctx, or free memory")
        self._memory = lib.llama_get_memory(self._ctx)
        self._batch = lib.llama_batch_init(self.n_batch, 0, 1 + self.tree_paths)
        self._params = params
        self._threads_now = params.n_threads  # the parent's follow_load sets it (backends/cpu_load.py)
        self._parent = parent
        self._mtp, self._mtp_tried, self._mtp_lock = None, False, threading.Lock()
        self._logits_address = parent._logits_address
        if hidden:
            self._embeddings_address, self._hidden_size = parent._embeddings_address, parent.hidden_support.size
        if self.layers:
            self._layer_input = parent._layer_input
            for layer in self.layers:  # the inputs of the layers after them, for every row fed
                parent._set_layer_input(self._ctx, layer + 1, True)
        elif hidden:
            lib.llama_set_embeddings(self._ctx, True)
        self._snapshots = int(getattr(params, "n_rs_seq", 0)) if self.recurrent else 0  # the parent's n_rs_seq
        self._sequences = [_Recurrent() for _ in range(n_slots)] if self.recurrent else []
        if self.recurrent:
            try:  # sequence i in cell i (the cells are taken in order), each to start again at its first pass
                self._decode([SlotPass(seq, 0, [_HOLDING_TOKEN], []) for seq in range(n_slots)])
            except Exception:
                self.close()
                raise
            for sequence in self._sequences:
                self._start_again(sequence, 0)

    def run(self, passes: Sequence[SlotPass]) -> None:
        """One llama_decode per n_batch tokens, the passes packed in order (each fits one)."""
        if self.recurrent:
            self._run_recurrent(passes)
            return
        self._run_packed(passes)

    def _run_packed(self, passes: Sequence[SlotPass]) -> None:
        group: list[SlotPass] = []
        fill = 0
        for slot_pass in passes:
            size = len(slot_pass.tokens) + (len(slot_pass.tree) if slot_pass.tree is not None else 0)
            if fill + size > self.n_batch and group:
                self._decode(group)
                group, fill = [], 0
            group.append(slot_pass)
            fill += size
        if group:
            self._decode(group)

    def _decode(self, passes: list[SlotPass]) -> None:
        batch = self._batch
        every_row = self.hidden and not self.layers
        i = 0
        for slot_pass in passes:
            if slot_pass.start + len(slot_pass.tokens) > self.slot_ctx:
                raise ContextFullError(f"the context of {self.slot_ctx} tokens is full", "shorten the prompt or raise --ctx")
            wanted = set(slot_pass.rows)
            for offset, (token, position, seqs) in enumerate(self._entries(slot_pass)):
                batch.token[i] = token
                batch.pos[i] = position
                batch.n_seq_id[i] = len(seqs)
                for slot, seq in enumerate(seqs):
                    batch.seq_id[i][slot] = seq
                batch.logits[i] = every_row or offset in wanted  # embeddings on: llama.cpp outputs every row
                i += 1
        batch.n_tokens = i
        self._parent.follow_load(self)
        status = self._lib.llama_decode(self._ctx, batch)
        if status != 0:
            raise ContextFullError(f"llama.cpp decode failed with status {status} in a batch of {i} tokens",
                                   "lower --parallel or raise --ctx")
        n_rows = i if every_row else sum(len(slot_pass.rows) for slot_pass in passes)
        outputs = np.zeros((0, self.n_vocab), np.float32)
        if n_rows:
            address = self._logits_address(self._ctx)
            outputs = np.frombuffer((ctypes.c_float * (n_rows * self.n_vocab)).from_address(address),
                                    dtype=np.float32).reshape(n_rows, self.n_vocab)
        states = self._output_layers(i) if self.layers else self._output_hidden(i) if self.hidden else None
        first = fed = 0  # the outputs and the tokens before this pass's
        for slot_pass in passes:
            rows = list(slot_pass.rows)
            if every_row:  # every row an output, in batch order: the pass's rows where asked
                slot_pass.logits = outputs[[fed + row for row in rows]] if rows else outputs[:0].copy()
            else:
                # the outputs of a pass's flagged rows, in position order; back to the order asked for
                mine = outputs[first : first + len(rows)]
                order = np.argsort(np.argsort(rows)) if rows != sorted(rows) else slice(None)
                slot_pass.logits = mine[order].copy()
                first += len(rows)
            n_fed = len(slot_pass.tokens) + (len(slot_pass.tree) if slot_pass.tree is not None else 0)
            if states is not None:
                slot_pass.hidden = states[fed : fed + n_fed]
            fed += n_fed
            if self.recurrent:
                self._fed(slot_pass)

    def _path_seq(self, seq: int, path: int) -> int:
        return self.n_slots + seq * self.tree_paths + path

    def _entries(self, slot_pass: SlotPass) -> list[tuple[int, int, list[int]]]:
        """(token, position, sequence ids) of each row a pass feeds: its tokens, in its sequence
        (and every path of its tree, which sees them), then its tree's nodes, each in the paths
        through it at its depth after the tokens. A tree's paths first hold the sequence's cells
        before the pass (shared, not copied: one unified cache)."""
        tokens, tree, seq, start = slot_pass.tokens, slot_pass.tree, slot_pass.seq, slot_pass.start
        if tree is None:
            return [(int(token), start + offset, [seq]) for offset, token in enumerate(tokens)]
        self.tree_support.check(tree)
        paths = [self._path_seq(seq, path) for path in range(len(tree.paths))]
        self._drop_paths(seq)  # a tree left unkept before
        self._held_paths[seq] = len(paths)
        for path_seq in paths:
            self._lib.llama_memory_seq_cp(self._memory, seq, path_seq, 0, start)
        entries = [(int(token), start + offset, [seq, *paths]) for offset, token in enumerate(tokens)]
        after = start + len(tokens)
        for node in range(len(tree)):
            through = [paths[path] for path in np.flatnonzero(tree.path_mask[:, node]).tolist()]
            entries.append((int(tree.tokens[node]), after + int(tree.depth[node]), through))
        return entries

    def keep_path(self, seq: int, start: int, tree, path: Sequence[int]) -> None:
        """The cells of ``path``'s nodes given to the sequence (a path through its last node holds
        them at their positions), then every path's cells freed."""
        lib = self._lib
        if path:
            through = int(np.flatnonzero(tree.path_mask[:, path[-1]])[0])
            lib.llama_memory_seq_cp(self._memory, self._path_seq(seq, through), seq, start, start + len(path))
        self._drop_paths(seq)

    def _drop_paths(self, seq: int) -> None:
        """The path sequences of ``seq``'s last tree freed (each removal scans the whole cache: only
        those its tree used, none where it holds no tree)."""
        for path in range(self._held_paths[seq] if self.tree_paths else 0):
            self._lib.llama_memory_seq_rm(self._memory, self._path_seq(seq, path), 0, -1)
        if self.tree_paths:
            self._held_paths[seq] = 0

    def _output_hidden(self, n_rows: int) -> np.ndarray:
        """A copy of the last decode's hidden states (n_rows, H), every row an output in batch order."""
        address = self._embeddings_address(self._ctx, 0)
        if not address:
            raise RuntimeError("llama.cpp returned no embeddings for a slots' decode")
        buffer = (ctypes.c_float * (n_rows * self._hidden_size)).from_address(address)
        return np.frombuffer(buffer, dtype=np.float32).reshape(n_rows, self._hidden_size).copy()

    def _output_layers(self, n_rows: int) -> np.ndarray:
        """A copy of the last decode's layer outputs (n_rows, len(layers) * H), every row fed in batch order."""
        size = self._hidden_size
        states = np.empty((n_rows, size * len(self.layers)), np.float32)
        for column, layer in enumerate(self.layers):
            address = self._layer_input(self._ctx, layer + 1)
            if not address:
                raise RuntimeError(f"llama.cpp returned no output of layer {layer} for a slots' decode")
            buffer = (ctypes.c_float * (n_rows * size)).from_address(address)
            states[:, column * size : (column + 1) * size] = np.frombuffer(buffer, np.float32).reshape(n_rows, size)
        return states

    def remove(self, seq: int, n_keep: int) -> None:
        if self.recurrent:
            self._remove_recurrent(self._sequences[seq], seq, n_keep)
            return
        self._lib.llama_memory_seq_rm(self._memory, seq, n_keep, -1)
        self._drop_paths(seq)  # a tree the slot let go

    # ---- recurrent and hybrid models (module docstring) --------------------------------
    def _run_recurrent(self, passes: Sequence[SlotPass]) -> None:
        """Each pass with its sequence's kept tokens at its head; a sequence started again first,
        alone (emptied just before: it takes its own cell back), the others packed as ever."""
        full = {}
        for slot_pass in passes:
            sequence = self._sequences[slot_pass.seq]
            if slot_pass.start + len(slot_pass.tokens) > self.slot_ctx:  # before any cell is emptied
                raise ContextFullError(f"the context of {self.slot_ctx} tokens is full", "shorten the prompt or raise --ctx")
            if slot_pass.start != sequence.length:
                raise RuntimeError(f"sequence {slot_pass.seq} holds {sequence.length} tokens, its pass starts at "
                                   f"{slot_pass.start}")
            again = sequence.again
            full[id(slot_pass)] = SlotPass(slot_pass.seq, len(sequence.fed), [*again, *slot_pass.tokens],
                                           [row + len(again) for row in slot_pass.rows])
        alone = sorted((p for p in passes if self._sequences[p.seq].fresh), key=lambda p: p.seq)
        together = [p for p in passes if not self._sequences[p.seq].fresh]
        for slot_pass in alone:
            self._lib.llama_memory_seq_rm(self._memory, slot_pass.seq, 0, -1)  # the only empty cell: its own
            self._run_alone(full[id(slot_pass)])
            self._results(slot_pass, full[id(slot_pass)])
        long = [p for p in together if len(full[id(p)].tokens) > self.n_batch]
        for slot_pass in long:
            self._run_alone(full[id(slot_pass)])
            self._results(slot_pass, full[id(slot_pass)])
        packed = sorted((p for p in together if len(full[id(p)].tokens) <= self.n_batch), key=lambda p: p.seq)
        try:
            # a run of consecutive sequences, ascending, a batch each: with one unified cache llama.cpp
            # gathers any sequences of a batch into cells side by side from the lowest of theirs, and a
            # gap or another order would move a sequence outside the batch away from its snapshots
            run: list[SlotPass] = []
            for slot_pass in packed:
                if run and slot_pass.seq != run[-1].seq + 1:
                    self._run_packed(run)
                    run = []
                run.append(full[id(slot_pass)])
            if run:
                self._run_packed(run)
        except Exception:
            # how far the failed run got is unknown, and llama.cpp empties the cells of the sequences
            # of a batch whose compute failed: each of them holds its cell again at once, ascending
            # (a cell taken alone is the next empty one from the failed batch's lowest: its own)
            for slot_pass in packed:
                if full[id(slot_pass)].logits is None:
                    sequence = self._sequences[slot_pass.seq]
                    self._hold(slot_pass.seq, sequence.fed + sequence.again)
            raise
        for slot_pass in packed:
            self._results(slot_pass, full[id(slot_pass)])

    @staticmethod
    def _results(slot_pass: SlotPass, full: SlotPass) -> None:
        """A slot's pass given what its full pass (its kept tokens fed again at its head) gave."""
        slot_pass.logits = full.logits
        if full.hidden is not None:
            slot_pass.hidden = full.hidden[len(full.tokens) - len(slot_pass.tokens):]

    def _run_alone(self, slot_pass: SlotPass) -> None:
        """One sequence's pass in n_batch chunks, its rows in the last; if it fails, the sequence
        starts again, holding its cell (a token fed alone takes it back)."""
        sequence = self._sequences[slot_pass.seq]
        before = sequence.fed + sequence.again  # what the sequence holds before the pass
        tokens, rows = list(slot_pass.tokens), list(slot_pass.rows)
        last_start = max(len(tokens) - self.n_batch, 0)
        states = []
        try:
            for start in [*range(0, last_start, self.n_batch), last_start]:
                end = len(tokens) if start == last_start else min(start + self.n_batch, last_start)
                chunk = SlotPass(slot_pass.seq, slot_pass.start + start, tokens[start:end],
                                 [row - last_start for row in rows] if start == last_start else [])
                self._decode([chunk])
                states.append(chunk.hidden)
            slot_pass.logits = chunk.logits
            if self.hidden:
                slot_pass.hidden = states[0] if len(states) == 1 else np.concatenate(states)
        except Exception:
            self._hold(slot_pass.seq, before)
            raise

    def _fed(self, slot_pass: SlotPass) -> None:
        """Bookkeeping of a recurrent sequence's pass that ran."""
        sequence = self._sequences[slot_pass.seq]
        del sequence.fed[slot_pass.start :]
        sequence.fed.extend(int(token) for token in slot_pass.tokens)
        sequence.again, sequence.fresh = [], False
        sequence.last_pass, sequence.rolled_back = len(slot_pass.tokens), False

    def _hold(self, seq: int, text: list[int]) -> None:
        """After a failure that may have emptied the sequence's cell (a decode, a restore): it starts
        again at its next pass with ``text``, and holds its cell until then, emptied and fed one
        token alone. Two empty cells at once would let a sequence started again take the other's
        cell, out of order. If that feed fails too, its cell stays empty: its next pass, alone,
        takes it back (the only empty one)."""
        sequence = self._sequences[seq]
        try:
            self._lib.llama_memory_seq_rm(self._memory, seq, 0, -1)
            self._decode([SlotPass(seq, 0, [_HOLDING_TOKEN], [])])
        except ContextFullError:
            pass
        finally:
            sequence.fed, sequence.again = list(text), []
            self._start_again(sequence, len(text))

    def _start_again(self, sequence: _Recurrent, n_keep: int) -> None:
        """The sequence's state starts again at its next pass, which feeds its first n_keep tokens first."""
        kept = (sequence.fed + sequence.again)[:n_keep]
        sequence.fed, sequence.again, sequence.fresh = [], kept, True
        sequence.last_pass, sequence.rolled_back, sequence.kept = 0, False, None

    def _remove_recurrent(self, sequence: _Recurrent, seq: int, n_keep: int) -> None:
        """Drop to n_keep tokens: within the kept tokens not yet fed again, cut them; within the
        last pass's snapshots, llama.cpp's rollback; else the kept state, the tokens since fed
        again; else the sequence starts again."""
        if n_keep >= sequence.length:
            return
        if sequence.fresh or (sequence.again and n_keep >= len(sequence.fed)):
            del sequence.again[n_keep - len(sequence.fed) :]
            return
        sequence.again = []  # below the restored state: what it restored is dropped too
        lib = self._lib
        drop = len(sequence.fed) - n_keep
        if (drop < sequence.last_pass and drop <= self._snapshots and not sequence.rolled_back
                and lib.llama_memory_seq_rm(self._memory, seq, n_keep, -1)):
            del sequence.fed[n_keep:]
            sequence.rolled_back = True
            return
        kept = sequence.kept
        if kept is not None and kept[0] <= n_keep:
            at, buffer, size = kept
            # the recurrent part back to position at - 1 (llama.cpp empties the sequence's cell and
            # fills the only empty one: its own), then the attention cells from at dropped
            if (lib.llama_state_seq_set_data_ext(self._ctx, buffer, size, seq, _KEPT_STATE_FLAGS)
                    and lib.llama_memory_seq_rm(self._memory, seq, at, -1)):
                sequence.again = sequence.fed[at:n_keep]
                del sequence.fed[at:]
                sequence.last_pass, sequence.rolled_back = 0, False
                return
            self._hold(seq, sequence.fed[:n_keep])  # a failed restore empties the cell
            return
        self._start_again(sequence, n_keep)

    def keep(self, seq: int) -> None:
        """A recurrent sequence keeps its state as it is now (module docstring), its kept tokens fed
        first; nothing happens for other models, or while the sequence starts again."""
        if not self.recurrent:
            return
        sequence = self._sequences[seq]
        if sequence.fresh:
            return
        if sequence.again:  # fed now, alone (its cell held: nothing moves), so that what is kept advances
            self._run_alone(SlotPass(seq, len(sequence.fed), list(sequence.again), []))
        if not sequence.fed:
            sequence.kept = None
            return
        lib = self._lib
        size = lib.llama_state_seq_get_size_ext(self._ctx, seq, _KEPT_STATE_FLAGS)
        buffer = (ctypes.c_uint8 * max(size, 1))()
        written = lib.llama_state_seq_get_data_ext(self._ctx, buffer, size, seq, _KEPT_STATE_FLAGS) if size else 0
        sequence.kept = (len(sequence.fed), buffer, written) if written else None

    def native_mtp(self, seq: int):
        """Slot ``seq``'s sequence of llama.cpp's MTP context against these slots (llama_mtp.NativeMtp,
        a sequence a slot, made on first use), where the parent drafts with its model's own MTP
        layers natively (LlamaCppBackend.native_mtp) and the slots give hidden states; None else (a
        slot's MTP drafter then runs the layer in NumPy)."""
        with self._mtp_lock:  # the slots' threads ask at once
            if not self._mtp_tried and self.hidden and not self.layers and self._ctx:
                self._mtp_tried = True
                if getattr(self.parent, "_mtp_arch", None) is not None:
                    from specrun.backends.llama_mtp import NativeMtp

                    try:
                        self._mtp = NativeMtp(self._lib, self.parent._model, self._ctx, self._params,
                                              self._lib.llama_model_n_embd(self.parent._model), self.n_vocab,
                                              n_seq=self.n_slots, follow_load=self.parent.follow_load)
                    except (AttributeError, RuntimeError):  # no nextn extension, or no memory for it
                        self._mtp = None
            return self._mtp.sequence(seq) if self._mtp is not None else None

    def close(self) -> None:
        if self._mtp is not None:  # made against this context: freed first
            native, self._mtp = self._mtp, None
            native.close()
        ctx, batch = self._ctx, self._batch
        self._ctx = self._batch = None
        free_context(self._lib, ctx, batch)


def free_context(lib, ctx, batch) -> None:
    """Free a second context and its batch (the handles already cleared by the caller)."""
    if batch is not None:
        lib.llama_batch_free(batch)
    if ctx:
        lib.llama_free(ctx)
