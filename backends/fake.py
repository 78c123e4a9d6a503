"""A table-driven fake backend: tabulated next-token distributions, no weights.

Used by the tests to prove losslessness statistically: the logits for any context
come from a plain Python function, so exact joint distributions are computable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from specrun.backends.base import (
    ArgmaxFromLogits, HeldTree, HiddenSupport, HiddenTracking, TreeSupport, VocabInfo, held_tree_for,
)
from specrun.penalties import AheadShaping
from specrun.sampling import AheadSampling
from specrun.tree import TokenTree

LogitTable = Callable[[tuple[int, ...]], np.ndarray]
HiddenTable = Callable[[tuple[int, ...]], np.ndarray]  # context -> (H,) hidden state of its last token


class FakeBackend(ArgmaxFromLogits, HiddenTracking):
    """A model whose next-token logits are ``table(context)``; the cache is a token list.

    hidden_table: the hidden state (hidden_size,) of a context's last token, for
    ``track_hidden``; without one the fake declares no hidden states. n_layers: with a hidden
    table, the fake has this many layers, and layer l's output (``hidden_layers``) is the hidden
    state scaled by (l + 1) / n_layers, the last layer's the state itself. reads_ahead: plain
    greedy steps read one token ahead (``forward_argmax_ahead``), as MLX's do.
    """

    name = "fake"
    tree_support = TreeSupport(True)  # the reference every real backend's trees are compared with

    def __init__(
        self,
        table: LogitTable,
        vocab_size: int,
        *,
        n_ctx: int = 4096,
        bos_id: int | None = None,
        eos_ids: Sequence[int] = (),
        hidden_table: HiddenTable | None = None,
        hidden_size: int = 0,
        n_layers: int = 0,
        reads_ahead: bool = False,
    ) -> None:
        self.table = table
        self._reads_ahead = reads_ahead
        self._ahead: int | None = None  # the argmax after the id read ahead (forward_argmax_ahead)
        self._ahead_hidden: np.ndarray | None = None  # that pass's hidden state, while tracking
        self.ahead_passes = 0  # the passes queued by a step for the next
        self.ahead_dropped = 0  # of them, those a pass or rewind threw away unused
        self.hidden_table = hidden_table
        self.hidden_support = (
            HiddenSupport(True, hidden_size, layers=n_layers, layer_outputs=n_layers,
                          layer_reason="" if n_layers else "this fake backend has no layers")
            if hidden_table is not None else HiddenSupport(False, reason="this fake backend has no hidden table")
        )
        self.vocab = VocabInfo(vocab_size, bos_id, frozenset(eos_ids), add_bos=bos_id is not None)
        self.n_ctx = n_ctx
        self.cache: list[int] = []
        self.forward_calls = 0
        self.forwarded_tokens = 0
        self._held_tree: HeldTree | None = None
        self.adapter: np.ndarray | None = None  # (V, V) logits added after each last token (``adapt``)

    @property
    def n_past(self) -> int:
        return len(self.cache)

    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        ids = [b % self.vocab.size for b in text.encode()]
        return ([self.vocab.bos_id] if add_bos and self.vocab.bos_id is not None else []) + ids

    def token_bytes(self, token: int) -> bytes:
        return b"" if token in self.vocab.eos_ids or token == self.vocab.bos_id else bytes([token % 256])

    def token_text(self, token: int) -> str:
        return f"<{token}>"

    def control_texts(self) -> frozenset[str]:
        return frozenset()  # tokenize reads every byte as text

    def native_loop(self) -> None:
        return None

    def chat_template(self) -> str | None:
        return None

    @property
    def reads_ahead(self) -> bool:
        return self._reads_ahead

    @property
    def shapes_ahead(self) -> bool:
        return self._reads_ahead

    @property
    def samples_ahead(self) -> bool:
        return self._reads_ahead

    def forward_argmax_ahead(self, token: int | None, ahead: bool = True, shaping: AheadShaping | None = None,
                             drawn: AheadSampling | None = None) -> tuple[int, bool]:
        """MlxBackend.forward_argmax_ahead's contract, each pass run at once (``hidden_rows``: the
        state of the token fed, while tracking; ``shaping``: rows shaped on the host, by
        AheadShaping.row, the queued one after the id picked; ``drawn``: each token drawn on the
        host by AheadSampling.pick, a uniform a row)."""
        def argmax_after(fed: int, picked: int | None = None) -> int:
            if shaping is None and drawn is None:
                return int(self.forward_argmax([fed], [0])[0])
            logits = self.forward([fed], [0])[0]
            if shaping is not None:
                logits = shaping.row(logits, picked)
            return int(np.argmax(logits)) if drawn is None else drawn.pick(logits, drawn.draw())

        if token is None:
            if self._ahead is None:
                raise ValueError("no id was read ahead to continue from")
            value, hidden = self._ahead, self._ahead_hidden
        else:
            value = argmax_after(token)
            hidden = self._hidden
        self._ahead = self._ahead_hidden = None
        fed = ahead and self.n_past + 1 < self.n_ctx
        if fed:
            after = argmax_after(value, value)
            self._ahead, self._ahead_hidden = after, self._hidden
            self.ahead_passes += 1
        self._hidden = hidden
        return value, fed

    def forward(self, tokens: Sequence[int], logit_rows: Sequence[int]) -> np.ndarray:
        if self.n_past + len(tokens) > self.n_ctx:
            raise ValueError("fake backend context overflow")
        self._drop_ahead()
        start = len(self.cache)
        self.cache.extend(int(t) for t in tokens)
        self.forward_calls += 1
        self.forwarded_tokens += len(tokens)
        self._hidden = self._hidden_of(lambda row: tuple(self.cache[: start + row + 1]), len(tokens))
        rows = [self._row(tuple(self.cache[: start + r + 1])) for r in logit_rows]
        return np.array(rows) if rows else np.zeros((0, self.vocab.size), np.float32)  # (R, V) float32

    def _row(self, context: tuple[int, ...]) -> np.ndarray:
        row = np.asarray(self.table(context), dtype=np.float32)
        return row if self.adapter is None else row + self.adapter[context[-1]]

    def rewind(self, n_keep: int) -> None:
        if n_keep < len(self.cache):
            self._drop_ahead()
        del self.cache[n_keep:]

    def _drop_ahead(self) -> None:
        if self._ahead is not None:
            self._ahead = None
            self.ahead_dropped += 1

    def forward_tree(self, tokens: Sequence[int], tree: TokenTree, logit_rows: Sequence[int]) -> np.ndarray:
        self.tree_support.check(tree)
        if self.n_past + len(tokens) + tree.max_depth > self.n_ctx:
            raise ValueError("fake backend context overflow")
        if any(not 0 <= row < len(tokens) + len(tree) for row in logit_rows):
            raise ValueError(f"logit rows {list(logit_rows)} fall outside the tokens and nodes fed")
        self._drop_ahead()
        self.cache.extend(int(t) for t in tokens)
        self.forward_calls += 1
        self.forwarded_tokens += len(tokens) + len(tree)
        self._held_tree = HeldTree(self.n_past, tree)
        start = self.n_past - len(tokens)

        def context_of(row: int) -> tuple[int, ...]:
            if row < len(tokens):
                return tuple(self.cache[: start + row + 1])
            return (*self.cache, *(tree.tokens[i] for i in tree.path_to(row - len(tokens))))  # ancestors only

        self._hidden = self._hidden_of(context_of, len(tokens) + len(tree))
        rows = [self._row(context_of(row)) for row in logit_rows]
        return np.array(rows) if rows else np.zeros((0, self.vocab.size), np.float32)  # (R, V) float32

    def forward_tree_argmax(self, tokens: Sequence[int], tree: TokenTree, logit_rows: Sequence[int]) -> np.ndarray:
        self._last_logits = self.forward_tree(tokens, tree, logit_rows)
        return self._last_logits.argmax(axis=-1)

    def keep_path(self, path: Sequence[int]) -> None:
        tree = held_tree_for(self._held_tree, self.n_past, path)
        self._held_tree = None
        self.cache.extend(tree.tokens[node] for node in path)

    def _hidden_of(self, context_of: Callable[[int], tuple[int, ...]], n_rows: int) -> np.ndarray | None:
        """While tracking, the hidden states (n_rows, H) of a pass's rows, row i's context
        ``context_of(i)``; None otherwise."""
        if not self._tracking:
            return None
        support = self.hidden_support
        states = np.array([self.hidden_table(context_of(row)) for row in range(n_rows)], np.float32)
        states = states.reshape(n_rows, support.size)
        if not self._layers:
            return states
        return np.concatenate([states * np.float32((layer + 1) / support.layers) for layer in self._layers], axis=1)

    def token_embeddings(self, ids: Sequence[int]) -> np.ndarray:
        """The fake's embedding table: a row of normal draws seeded by each id."""
        if not self.hidden_support.available:
            raise ValueError("this fake backend has no hidden table")
        size = self.hidden_support.size
        return np.array([np.random.default_rng(1000 + int(token)).normal(0, 1, size) for token in ids], np.float32)

    def output_rows(self, ids: Sequence[int]) -> np.ndarray:
        """The fake's output head: a row of normal draws seeded by each id (its logits do not come
        from its states: the distributions these give its states are the fake's made-up teacher)."""
        if not self.hidden_support.available:
            raise ValueError("this fake backend has no hidden table")
        size = self.hidden_support.size
        return np.array([np.random.default_rng(2000 + int(token)).normal(0, 1, size) for token in ids], np.float32)

    def logits_beyond_rows(self) -> str:
        return ""

    def open_window(self, sinks: int, window: int, owns: bool = False):
        """This fake drafting from a FakeWindowCache of its first tokens and a recent window."""
        from specrun.backends.window import WindowedBackend

        return WindowedBackend(self, lambda cells: FakeWindowCache(self, cells), sinks, window, owns=owns)

    def online_trainer(self, learning_rate: float, seed: int = 0) -> FakeAdapterTrainer:
        """A trainer of an adapter for this fake drafting (training/online_draft.py)."""
        return FakeAdapterTrainer(self, learning_rate)

    def adapt(self, weights: np.ndarray) -> None:
        """Draft with the adapter a FakeAdapterTrainer published."""
        self.adapter = weights

    def close(self) -> None:
        self.cache.clear()


class FakeAdapterTrainer:
    """The fake's stand-in for LoRA (backends/mlx_lora.py): a (V, V) table of logits added after each
    last token, trained by gradient descent on the cross-entropy of a window's labelled tokens."""

    def __init__(self, fake: FakeBackend, learning_rate: float) -> None:
        self._fake = fake
        self._rate = learning_rate
        self._adapter = np.zeros((fake.vocab.size, fake.vocab.size), np.float32)

    def _logits(self, tokens: np.ndarray, at: int) -> np.ndarray:
        context = tuple(int(token) for token in tokens[: at + 1])
        return np.asarray(self._fake.table(context), np.float32) + self._adapter[context[-1]]

    def predict(self, tokens: np.ndarray) -> np.ndarray:
        return np.array([int(self._logits(tokens, at).argmax()) for at in range(len(tokens) - 1)], np.int64)

    def step(self, windows) -> float:
        """Each window (tokens, first) or (tokens, first, soft), as LoraTrainer.step takes them."""
        gradient = np.zeros_like(self._adapter)
        losses = []
        for tokens, first, *rest in windows:
            soft = rest[0] if rest else None
            for at in range(first - 1, len(tokens) - 1):
                logits = self._logits(tokens, at)
                probabilities = np.exp(logits - logits.max())
                probabilities /= probabilities.sum()
                label = np.zeros_like(probabilities)  # the target's token, or its soft label there
                if soft is None:
                    label[tokens[at + 1]] = 1.0
                else:
                    np.add.at(label, soft[0][at + 1 - first], soft[1][at + 1 - first])
                losses.append(-float((label * np.log(np.maximum(probabilities, 1e-30))).sum()))
                gradient[tokens[at]] += probabilities - label
        self._adapter = self._adapter - self._rate * gradient / max(len(losses), 1)
        return float(np.mean(losses)) if losses else 0.0

    def weights(self) -> np.ndarray:
        return self._adapter  # replaced, never changed in place, by each step



class FakeSlots:
    """A fake model holding one sequence per slot (backends/slots.SlotModel): each batch's passes
    read ``table`` as FakeBackend's do; ``batches`` records every batch's (seq, tokens fed)."""

    name = "fake"

    def __init__(self, parent: FakeBackend, n_slots: int, slot_ctx: int | None = None, hidden: bool = False,
                 layers: Sequence[int] = (), trees: bool = False) -> None:
        self.parent = parent
        self.n_slots = n_slots
        self.tree_support = TreeSupport(True) if trees else TreeSupport(False, "these fake slots hold chains")
        self.hidden = hidden and parent.hidden_support.available  # passes give the parent's hidden table
        self.layers = tuple(layers) if self.hidden else ()  # its layers' outputs, as FakeBackend's
        self.slot_ctx = slot_ctx or parent.n_ctx
        self.caches: list[list[int]] = [[] for _ in range(n_slots)]
        self.batches: list[tuple[tuple[int, int], ...]] = []
        self.kept_paths: list[tuple[int, int, tuple[int, ...]]] = []  # (seq, tree size, path) of each tree pass

    def run(self, passes) -> None:
        for slot_pass in passes:
            cache = self.caches[slot_pass.seq]
            if len(cache) != slot_pass.start:
                raise ValueError(f"sequence {slot_pass.seq} holds {len(cache)} tokens, not {slot_pass.start}")
            if slot_pass.start + len(slot_pass.tokens) > self.slot_ctx:
                raise ValueError("fake slot context overflow")
            if slot_pass.tree is not None:
                self.tree_support.check(slot_pass.tree)
        self.batches.append(tuple((p.seq, len(p.tokens) + (len(p.tree) if p.tree is not None else 0)) for p in passes))
        for slot_pass in passes:
            cache = self.caches[slot_pass.seq]
            cache.extend(int(t) for t in slot_pass.tokens)
            tree, fed = slot_pass.tree, len(slot_pass.tokens)

            def context(row: int, cache=cache, start=slot_pass.start, tree=tree, fed=fed) -> tuple[int, ...]:
                if row < fed:  # a token's: the cache up to it
                    return tuple(cache[: start + row + 1])
                node = row - fed  # a node's: the cache, then its path from the root
                return (*cache[: start + fed], *(tree.tokens[n] for n in tree.path_to(node)))

            rows = [np.asarray(self.parent.table(context(r)), np.float32) for r in slot_pass.rows]
            slot_pass.logits = np.stack(rows) if rows else np.zeros((0, self.parent.vocab.size), np.float32)
            if self.hidden:
                n_rows = fed + (len(tree) if tree is not None else 0)
                states = np.array([self.parent.hidden_table(context(r)) for r in range(n_rows)], np.float32)
                scales = [(layer + 1) / self.parent.hidden_support.layers for layer in self.layers]
                slot_pass.hidden = np.concatenate([states * np.float32(s) for s in scales], axis=1) if scales else states

    def remove(self, seq: int, n_keep: int) -> None:
        del self.caches[seq][n_keep:]

    def keep_path(self, seq: int, start: int, tree, path) -> None:
        if len(self.caches[seq]) != start:
            raise ValueError(f"sequence {seq} holds {len(self.caches[seq])} tokens, not the {start} its tree follows")
        self.caches[seq].extend(int(tree.tokens[node]) for node in path)
        self.kept_paths.append((seq, len(tree), tuple(path)))

    def close(self) -> None:
        self.caches = [[] for _ in range(self.n_slots)]


class FakeWindowCache:
    """A fake model's second cache of ``cells`` positions (backends/window.WindowCache): each row's
    logits read ``table`` over the tokens held at or before its position, so a windowed draft sees
    only its sinks and recent run. Refuses what llama.cpp refuses: a gap before a feed, overflow."""

    def __init__(self, parent: FakeBackend, cells: int) -> None:
        self.parent = parent
        self.cells = cells
        self.held: list[tuple[int, int]] = []  # (position, token), positions 0, 1, ... in order
        self.decodes = 0
        self.decoded_tokens = 0

    def decode(self, tokens: Sequence[int], start: int, rows: Sequence[int]) -> np.ndarray:
        if start != len(self.held) or any(position != i for i, (position, _) in enumerate(self.held)):
            raise ValueError(f"positions must continue at {len(self.held)}, got {start}")
        if start + len(tokens) > self.cells:
            raise ValueError("fake window cache overflow")
        self.held.extend((start + i, int(token)) for i, token in enumerate(tokens))
        self.decodes += 1
        self.decoded_tokens += len(tokens)
        context = tuple(token for _, token in self.held)
        out = [self.parent._row(context[: start + row + 1]) for row in rows]
        return np.stack(out) if out else np.zeros((0, self.parent.vocab.size), np.float32)

    def remove(self, start: int, stop: int) -> None:
        stop = len(self.held) if stop < 0 else stop
        self.held = [(p, t) for p, t in self.held if not start <= p < stop]

    def shift(self, start: int, stop: int, delta: int) -> None:
        self.held = sorted((p + delta if start <= p < stop else p, t) for p, t in self.held)

    def close(self) -> None:
        self.held = []
