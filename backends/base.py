"""The narrow interface the engine drives every model through."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from specrun.tree import TokenTree


@dataclass(frozen=True)
class VocabInfo:
    """Vocabulary facts that decide whether two models can speculate together."""

    size: int
    bos_id: int | None
    eos_ids: frozenset[int]  # every end-of-generation token
    add_bos: bool


@dataclass(frozen=True)
class TreeSupport:
    """Whether a backend verifies a token tree in one pass (``forward_tree``), and if not why.

    reason: one line for the user where trees are not available (chains are used instead).
    max_paths: the most root-to-leaf paths one tree may have (0: no limit).
    reopenable: not available only because the backend was opened for chains; its
    ``open_for_trees(paths)`` re-creates it, empty, for trees (llama.cpp sizes a context's
    sequences when it creates it).
    """

    available: bool
    reason: str = ""
    max_paths: int = 0
    reopenable: bool = False

    def check(self, tree: TokenTree) -> None:
        """Raise ValueError if this backend cannot take ``tree`` in one pass."""
        if not self.available:
            raise ValueError(f"this backend cannot verify trees: {self.reason}")
        if self.max_paths and len(tree.paths) > self.max_paths:
            raise ValueError(f"the tree has {len(tree.paths)} paths; this backend holds at most {self.max_paths}")


@dataclass(frozen=True)
class HiddenSupport:
    """Whether a backend gives the hidden states of its passes (``track_hidden``), and if not why."""

    available: bool
    size: int = 0  # the hidden size H
    reason: str = ""  # one line for the user where hidden states are not available
    layers: int = 0  # the model's layer count (0: not known), which heads files name
    # bytes of weights a one-token pass reads (0: not known): what a heads drafter's own reads
    # are weighed against before any pass is timed (control.forecasts)
    weight_bytes: int = 0
    # tracked passes can give the outputs of layers 0 .. layer_outputs - 1 instead (hidden_layers,
    # for EAGLE-3); 0: none, and layer_reason says why
    layer_outputs: int = 0
    layer_reason: str = ""

    def check(self) -> None:
        """Raise ValueError naming why not, if this backend gives no hidden states."""
        if not self.available:
            raise ValueError(f"this backend gives no hidden states: {self.reason}")

    def check_layers(self, layers: Sequence[int]) -> None:
        """Raise ValueError naming why not, if tracked passes cannot give these layers' outputs."""
        self.check()
        if not self.layer_outputs:
            raise ValueError(f"this backend gives no layer outputs: {self.layer_reason}")
        outside = [layer for layer in layers if not 0 <= layer < self.layer_outputs]
        if outside:
            raise ValueError(f"this backend gives the outputs of layers 0 to {self.layer_outputs - 1}, "
                             f"not of layer {outside[0]}{': ' + self.layer_reason if self.layer_reason else ''}")


@dataclass(frozen=True)
class HeldTree:
    """A tree a backend holds after ``forward_tree``, its nodes following ``n_past`` cached tokens."""

    n_past: int
    tree: TokenTree


def held_tree_for(held: HeldTree | None, n_past: int, path: Sequence[int]) -> TokenTree:
    """The held tree that ``path`` may be committed from, or a ValueError saying why not.

    Anything that moves the cache between ``forward_tree`` and ``keep_path`` drops the tree.
    """
    if held is None or held.n_past != n_past:
        raise ValueError("keep_path needs the tree of the last forward_tree, with the cache unmoved since")
    if not held.tree.is_path(path):
        raise ValueError(f"{list(path)} is not a root-to-node path of the held tree")
    return held.tree


def near_tie_rows(logits: np.ndarray, margin: float) -> np.ndarray:
    """For each row of ``logits`` (R, V): does a second token's logit come within ``margin`` of the top?"""
    if not len(logits):
        return np.zeros((0,), dtype=bool)
    top = logits.max(axis=-1, keepdims=True)
    return (logits >= top - margin).sum(axis=-1) > 1


class HiddenTracking:
    """``track_hidden`` and ``hidden_rows`` for a backend that records its passes' hidden states
    while ``_tracking``: ``_hidden`` holds the last pass's (n_fed, H), None where it ran untracked."""

    _tracking = False
    _hidden: np.ndarray | None = None
    _layers: tuple[int, ...] = ()  # hidden_layers': () the output head's input

    def track_hidden(self, on: bool) -> None:
        if on:
            self.hidden_support.check()
        self._tracking = on

    @property
    def tracking_hidden(self) -> bool:
        """Do its passes record hidden states now (heads drafting from them)?"""
        return self._tracking

    def hidden_layers(self, layers: Sequence[int]) -> None:
        if tuple(layers) == self._layers:
            return
        if self._tracking:
            raise ValueError("choose the layers tracked passes record before tracking (track_hidden(False) first)")
        if layers:
            self.hidden_support.check_layers(layers)
        self._layers = tuple(layers)
        self._choose_layers(self._layers)

    def _choose_layers(self, layers: tuple[int, ...]) -> None:
        """A backend's own preparation for recording ``layers`` (checked; () the head's input)."""

    def native_mtp(self):
        """The model's own MTP layers run by the backend's library beside this context
        (backends/llama_mtp.NativeMtp), where the model carries them and the library runs them;
        None elsewhere (an MTP drafter then runs the layer in NumPy)."""
        return None

    def mtp_layer(self, heads):
        """``heads`` (MTP heads read as NumPy arrays) run in the backend's own arrays, answering a
        drafter as they do (backends/mtp_mlx.MlxMtpLayer); None where the backend has none (NumPy)."""
        return None

    def hidden_rows(self, rows: Sequence[int]) -> np.ndarray:
        if self._hidden is None:
            raise ValueError("the last pass ran with hidden-state tracking off (track_hidden(True) first)")
        if isinstance(rows, range) and rows == range(len(self._hidden)):  # every row (what a sequence keeps): as held
            return self._hidden
        rows = list(rows)
        if any(not 0 <= row < len(self._hidden) for row in rows):
            raise ValueError(f"hidden rows {rows} fall outside the {len(self._hidden)} rows the last pass fed")
        return self._hidden[rows]


class ArgmaxFromLogits:
    """``forward_argmax`` and ``last_pass_ties`` for a backend whose passes give whole logit rows
    anyway (``forward``): the rows are kept for the ties."""

    _last_logits: np.ndarray

    def forward_argmax(self, tokens: Sequence[int], logit_rows: Sequence[int]) -> np.ndarray:
        self._last_logits = self.forward(tokens, logit_rows)
        return self._last_logits.argmax(axis=-1)

    def last_pass_ties(self, indices: Sequence[int], margin: float) -> np.ndarray:
        return near_tie_rows(self._last_logits[list(indices)], margin)


class ParentsModel:
    """What a backend over another's model (a slot, a windowed cache) answers from ``parent``, the
    model opened as a single sequence: vocabulary, template, tokenizing. No native loop or MTP."""

    parent: object

    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        return self.parent.tokenize(text, add_bos, special)

    def thread_tally(self):
        """The parent's (its passes follow the load with the parent's count: llama.cpp's slots and
        windowed caches); None where it has none."""
        tally = getattr(self.parent, "thread_tally", None)
        return tally() if tally is not None else None

    def token_bytes(self, token: int) -> bytes:
        return self.parent.token_bytes(token)

    def token_text(self, token: int) -> str:
        return self.parent.token_text(token)

    def fill_token_ids(self) -> dict[str, int] | None:
        """The parent's fill-in-the-middle tokens where it says them (llama.cpp's); None elsewhere."""
        found = getattr(self.parent, "fill_token_ids", None)
        return found() if found is not None else None

    def control_texts(self) -> frozenset[str]:
        return self.parent.control_texts()

    def chat_template(self) -> str | None:
        return self.parent.chat_template()

    def metadata(self, key: str) -> str | None:
        return self.parent.metadata(key) if hasattr(self.parent, "metadata") else None

    def native_loop(self):
        return None

    def native_mtp(self):
        return None

    def mtp_layer(self, heads):
        return None

    @property
    def runs_on_cpu(self) -> bool:
        return getattr(self.parent, "runs_on_cpu", True)


@runtime_checkable
class Backend(Protocol):
    """One loaded model with a KV cache holding ``n_past`` tokens.

    ``forward`` appends ``tokens`` to the cache at positions n_past … n_past+len-1 and
    returns logits only for the rows asked for (indices into ``tokens``), never for
    the whole context. ``rewind(n_keep)`` drops every cached token from n_keep on.

    Trees (a declared capability, ``tree_support``): ``forward_tree`` appends ``tokens``
    like ``forward`` and then holds the nodes of a TokenTree provisionally, each at
    position n_past + depth and attending to the context and its own ancestors only;
    ``keep_path`` then commits one root-to-node path and drops the other nodes. Until it
    does, ``n_past`` counts only the committed tokens; a forward or rewind that moves the
    cache in between drops the tree (``keep_path`` then refuses). Check
    ``tree_support.available`` first: a backend without trees says why in its ``reason``.

    Hidden states (a declared capability, ``hidden_support``): while ``track_hidden(True)``
    holds, every pass records the hidden state of each row it fed, the output head's input
    (after the final norm), and ``hidden_rows`` reads them back until the next pass. Off by
    default, and a pass with it off costs what it always did.

    Reading ahead (optional: ``reads_ahead`` true, else absent or false; MLX's): a plain greedy
    step's ``forward_argmax_ahead`` queues the next step's pass on its own argmax before the host
    reads it (``KVSequence.feed_argmax_ahead`` keeps the cache's account); while tracking,
    ``hidden_rows`` after it reads the state of the token it fed.

    Thread following (optional: ``thread_tally``, llama.cpp's on the CPU): a ``cpu_load.ThreadTally``
    of its passes and of those run on fewer threads while other processes kept cores busy; None
    where the count is fixed.
    """

    name: str
    vocab: VocabInfo
    n_ctx: int
    tree_support: TreeSupport
    hidden_support: HiddenSupport

    @property
    def n_past(self) -> int: ...

    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of ``text``; ``special`` turns special-token text (``<|im_start|>``) into
        those tokens, as a rendered chat template needs."""
        ...

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token contributes to output text (b"" for control tokens)."""
        ...

    def control_texts(self) -> frozenset[str]:
        """The texts that ``tokenize(..., special=True)`` turns into control tokens
        (``<|im_start|>``, ``</s>``): never to be read that way from a user's text."""
        ...

    def token_text(self, token: int) -> str:
        """The token's vocabulary entry, for comparing vocabularies."""
        ...

    def chat_template(self) -> str | None: ...

    def native_loop(self):
        """The backend library's own plain decoding loop on the same model (an object with
        ``name``, ``tokens_per_second(prompt_ids, max_new_tokens)`` and ``close()``), to
        report specrun against; None where none is compared."""
        ...

    def forward(self, tokens: Sequence[int], logit_rows: Sequence[int]) -> np.ndarray:
        """Append ``tokens`` to the cache; return float32 logits (len(logit_rows), vocab)."""
        ...

    def forward_argmax(self, tokens: Sequence[int], logit_rows: Sequence[int]) -> np.ndarray:
        """Like ``forward`` but return only the argmax ids (len(logit_rows),)."""
        ...

    def rewind(self, n_keep: int) -> None: ...

    def forward_tree(self, tokens: Sequence[int], tree: TokenTree, logit_rows: Sequence[int]) -> np.ndarray:
        """Append ``tokens``, then hold ``tree``'s nodes after them; float32 logits
        (len(logit_rows), vocab) at rows indexing ``tokens`` followed by the nodes: row
        len(tokens) - 1 is the root's, row len(tokens) + i node i's. On a chain-shaped tree
        this returns what ``forward(tokens + tree.tokens, logit_rows)`` would."""
        ...

    def forward_tree_argmax(self, tokens: Sequence[int], tree: TokenTree, logit_rows: Sequence[int]) -> np.ndarray:
        """Like ``forward_tree`` but return only the argmax ids (len(logit_rows),)."""
        ...

    def last_pass_ties(self, indices: Sequence[int], margin: float) -> np.ndarray:
        """For entries ``indices`` of the last argmax pass's result (``forward_argmax``,
        ``forward_tree_argmax``, ``forward_argmax_after``): did another token's logit come within
        ``margin`` of the top one's (bool, (len(indices),))? Read before the next pass."""
        ...

    def keep_path(self, path: Sequence[int]) -> None:
        """Commit the held tree's nodes ``path`` (root-to-node, e.g. a TreeVerdict's path) to the
        cache after the tokens of ``forward_tree``, and drop every other node."""
        ...

    def track_hidden(self, on: bool) -> None:
        """Record (or stop recording) the hidden states of every row each pass feeds: forward,
        forward_argmax, forward_tree and forward_tree_argmax (a greedy extension may refuse
        with ValueError while on). ValueError if ``hidden_support`` is not available."""
        ...

    def hidden_layers(self, layers: Sequence[int]) -> None:
        """What tracked passes record from now on: () the output head's input (H wide, the
        default), else the outputs of ``layers`` (0-based) side by side (len(layers) * H wide),
        as EAGLE-3 reads them. While not tracking only; ValueError naming why where this backend
        cannot (``hidden_support.layer_outputs``)."""

    def token_embeddings(self, ids: Sequence[int]) -> np.ndarray:
        """Float32 rows (len(ids), H) of the model's input embedding table, as its weights hold
        them (unscaled), for heads that share it (EAGLE-3 files without their own); ValueError
        naming why where this backend cannot."""

    def output_rows(self, ids: Sequence[int]) -> np.ndarray:
        """Float32 rows (len(ids), H) of the model's output head (the tied embedding's where it
        has none of its own), as its weights hold them; ValueError naming why where this backend
        cannot. Where ``logits_beyond_rows`` says nothing, the final-normed hidden state times
        their transpose is the model's logits over ``ids`` (online heads learn the target's
        distributions so: training/online.py)."""

    def logits_beyond_rows(self) -> str:
        """What the model does to its logits after the output rows' product (a final soft-cap, a
        logit scale, an output bias), "" where nothing."""

    def hidden_rows(self, rows: Sequence[int]) -> np.ndarray:
        """Float32 hidden states (len(rows), H) of the last pass, ``rows`` indexing the fed
        tokens followed by the tree's nodes as ``logit_rows`` do (row len(tokens) + i is node
        i). ValueError if tracking was off during that pass or a row is out of range;
        ``keep_path`` leaves them readable."""
        ...

    def native_mtp(self):
        """The model's own MTP layers run by the backend's library (HiddenTracking's says more)."""

    def mtp_layer(self, heads):
        """MTP heads run in the backend's own arrays, or None (HiddenTracking's says more)."""

    def close(self) -> None: ...
