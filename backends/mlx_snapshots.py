"""A Gated DeltaNet's recurrent state rolled back within the last pass on MLX: a rejected draft on
a hybrid model (Qwen3.5's and Qwen3-Next's linear attention beside full attention) is undone
without feeding the accepted tokens through the model again.

mlx-lm's Gated DeltaNet mixer keeps two arrays in its ``ArraysCache``: the convolution's last
``conv_kernel_size - 1`` inputs and the recurrent state, both replaced by a pass, never cut. The
backend restores them from a checkpoint taken before the pass and feeds the kept tokens again
(backends/mlx.py): on a memory-bound Mac that replay reads every weight once more, about another
step after each partly rejected draft. llama.cpp keeps the state after each token of the last pass
(``n_rs_seq``). Here a pass keeps what its mixers computed on the way, without changing mlx-lm's
code or its kernels:

- the mixer's ``conv1d`` is shadowed on the instance (the real one stays its child in the parameter
  tree) by a recorder that keeps the convolution's input, the old conv state then the pass's rows:
  the conv state after m tokens is rows m .. m + kernel - 2 of it;
- the module's ``gated_delta_update`` is wrapped: while a pass records, it keeps its arguments
  (queries, keys, values, gates and the state before the pass; activations, no weights) and runs
  as before.

A rewind to m tokens into the pass then runs only the recurrence again, ``gated_delta_update``
on the first m rows of what it kept from the state before the pass (the recurrence is causal and
steps token by token, so its state after m tokens is the pass's own), and cuts the convolution's
rows. ``Snapshotter.for_model`` checks it on a probe (the state after two tokens of a four-token
pass against a fresh cache fed two) and gives None where anything differs or a cache that cannot
be cut is not such a mixer's (Mamba, sliding windows: replay).
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field

# Passes since a checkpoint feeding more tokens than this keep nothing (a prompt's chunks: their
# activations would be held to the next pass): a rewind into them replays from the checkpoint as
# before. A verify pass is a draft of up to 16 and its bonus token; a draft model's greedy passes,
# its catch-up and up to 16 drafts; Qwen3.5-27B keeps ~1 MB a token.
SNAPSHOT_TOKENS = 32
PROBE = (3, 17, 29, 41)
# How far apart the probe's states may lie, as a share of their largest value: OpenBLAS's batched
# and shorter passes put them ~1e-6 apart, a state one token off ~1 (tests' hybrids, session 72).
PROBE_TOLERANCE = 2e-2
_WRAPPED = "_specrun_recording"
_recording = threading.local()  # .sink: the _Recording of the model call building its graph, or None


@dataclass
class _Recording:
    """What one model call's recurrent mixers kept, in the order they ran: per mixer, its conv
    recorder, the convolution's input (1, kernel - 1 + T, C) and the recurrence's call (_Update)."""

    calls: list[list] = field(default_factory=list)  # [recorder, conv input, _Update or None]


@dataclass(frozen=True)
class _Update:
    """A ``gated_delta_update`` call as made: the arrays with a time axis (B, T, ...), the rest."""

    update: object  # the unwrapped function
    timed: tuple  # q, k, v, a, b
    fixed: tuple  # A_log, dt_bias
    state: object  # (B, H, Dv, Dk) before the call, or None (zeros)
    mask: object  # (B, T) or None
    options: dict

    def state_after(self, n_tokens: int):
        """The recurrent state after the call's first ``n_tokens`` tokens (lazy)."""
        rows = slice(0, n_tokens)
        timed = [array[:, rows] for array in self.timed]
        mask = None if self.mask is None else self.mask[:, rows]
        return self.update(*timed, *self.fixed, self.state, mask, **self.options)[1]


class _ConvRecorder:
    """A mixer's ``conv1d`` that, while a call records, keeps its input (see the module docstring)."""

    def __init__(self, conv) -> None:
        self._conv = conv

    def __call__(self, x):
        sink = getattr(_recording, "sink", None)
        if sink is not None:
            sink.calls.append([self, x, None])
        return self._conv(x)

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "_conv":  # copy's probes of a bare instance: no recursion
            raise AttributeError(name)
        return getattr(self._conv, name)


def _recording_update(update):
    """``gated_delta_update`` that, while a call records, hands its arguments to the mixer's record."""

    def recording_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, **options):  # noqa: N803 - mlx-lm's
        sink = getattr(_recording, "sink", None)
        if sink is not None and sink.calls and sink.calls[-1][2] is None:
            sink.calls[-1][2] = _Update(update, (q, k, v, a, b), (A_log, dt_bias), state, mask, options)
        return update(q, k, v, a, b, A_log, dt_bias, state, mask, **options)

    setattr(recording_update, _WRAPPED, update)
    return recording_update


def mixer_of(layer):
    """The Gated DeltaNet mixer of an mlx-lm decoder layer (a child module with ``conv1d`` and
    ``conv_kernel_size`` whose module runs ``gated_delta_update``), or None."""
    for child in layer.children().values():
        if hasattr(child, "conv1d") and hasattr(child, "conv_kernel_size"):
            module = sys.modules.get(type(child).__module__)
            if module is not None and callable(getattr(module, "gated_delta_update", None)):
                return child
    return None


@dataclass
class PassStates:
    """What the recurrent mixers kept of the passes since ``start`` (a checkpoint's position),
    ``count`` tokens in all (-1: a pass kept nothing, so none of them can be rewound into):
    per recurrent cache index, each call's first position (from start), conv input and _Update."""

    start: int
    calls: dict[int, list] = field(default_factory=dict, repr=False)
    count: int = 0

    def arrays(self) -> list:
        """Every array kept: evaluated with the pass that made them, so a rewind reads them, not
        the model again."""
        kept = []
        for calls in self.calls.values():
            for _, conv_input, update in calls:
                kept += [conv_input, *update.timed] + ([] if update.state is None else [update.state])
        return kept

    def drop(self) -> None:
        """Nothing kept from here to the next checkpoint (a pass that could not be kept)."""
        self.calls.clear()
        self.count = -1

    def cut(self, n_kept: int) -> None:
        """Forget what came after the first ``n_kept`` tokens (a rewind to start + n_kept)."""
        for index, calls in self.calls.items():
            self.calls[index] = [call for call in calls if call[0] < n_kept]
        self.count = min(self.count, n_kept)


class Snapshotter:
    """Keeps what a model's Gated DeltaNet mixers compute in a pass, and gives their caches after
    any of its tokens (see the module docstring)."""

    def __init__(self, mx, model, recorders: dict, kernels: dict[int, int]) -> None:
        self._mx = mx
        self.model = model
        # a mixer's conv recorder -> its cache index in this model (a layer draft shares the
        # target's mixers at other indices)
        self._recorders = recorders
        self.recurrent = sorted(recorders.values())
        self._kernels = kernels  # cache index -> conv kernel size

    @classmethod
    def for_model(cls, mx, lm_cache, model) -> Snapshotter | None:
        """A snapshotter for ``model`` where every cache that cannot be cut is a Gated DeltaNet's
        and the probe agrees; None otherwise (those models replay)."""
        caches = lm_cache.make_prompt_cache(model)
        layers = getattr(model, "layers", None)
        if layers is None or len(layers) != len(caches):
            return None
        mixers = {}
        for index, (layer, cache) in enumerate(zip(layers, caches)):
            if isinstance(cache, lm_cache.ArraysCache):
                mixer = mixer_of(layer)
                if mixer is None or len(cache.cache) != 2:
                    return None
                mixers[index] = mixer
            elif type(cache).__name__ not in ("KVCache", "QuantizedKVCache", "ConcatenateKVCache"):
                return None  # a sliding window's cache: restored from checkpoints as before
        if not mixers:
            return None
        installed = {index: _install(mixer) for index, mixer in mixers.items()}
        snapshotter = cls(mx, model, {recorder: index for index, recorder in installed.items()},
                          {index: int(mixer.conv_kernel_size) for index, mixer in mixers.items()})
        if snapshotter._probe_agrees(lm_cache):
            return snapshotter
        for mixer in mixers.values():  # the model as it was (the module's wrapper calls through)
            _uninstall(mixer)
        return None

    def record(self, run, states: PassStates, n_tokens: int):
        """``run()``, one model call over ``n_tokens`` tokens after ``states.count`` of them, with
        what its mixers compute kept in ``states``; returns run's result. A call whose mixers did
        not all record leaves ``states`` unusable (``count`` -1)."""
        recording = _Recording()
        _recording.sink = recording
        try:
            result = run()
        finally:
            _recording.sink = None
        calls = recording.calls
        if (len(calls) != len(self._recorders) or {call[0] for call in calls} != set(self._recorders)
                or any(call[2] is None or call[2].timed[0].shape[1] != n_tokens for call in calls)):
            states.drop()
            return result
        for recorder, conv_input, update in calls:
            states.calls.setdefault(self._recorders[recorder], []).append((states.count, conv_input, update))
        states.count += n_tokens
        return result

    def cache_state(self, states: PassStates, index: int, n_tokens: int) -> list:
        """The ArraysCache contents [conv state, recurrent state] of cache ``index`` after
        ``n_tokens`` (1 .. count) tokens of ``states``: the recurrence run again over the rows of
        the call that fed the last of them (lazy)."""
        first, conv_input, update = next(call for call in reversed(states.calls[index]) if call[0] < n_tokens)
        rows = n_tokens - first
        width = self._kernels[index] - 1
        return [self._mx.contiguous(conv_input[:, rows : rows + width, :]), update.state_after(rows)]

    def _probe_agrees(self, lm_cache) -> bool:
        """The caches after two tokens of a recorded four-token pass equal a fresh cache's fed two,
        and after all four the recorded cache's own, within PROBE_TOLERANCE of the largest value:
        a batched pass rounds apart from a shorter one (OpenBLAS, Metal: sums follow a matrix's
        shape; 16-bit models), a row read wrongly differs by about the values themselves."""
        mx = self._mx
        tokens = mx.array(PROBE)[None]
        recorded = lm_cache.make_prompt_cache(self.model)
        states = PassStates(0)
        self.record(lambda: self.model(tokens, cache=recorded), states, len(PROBE))
        if states.count != len(PROBE):
            return False
        fed = lm_cache.make_prompt_cache(self.model)
        self.model(tokens[:, :2], cache=fed)
        for index in self.recurrent:
            for n_tokens, cache in ((2, fed[index]), (len(PROBE), recorded[index])):
                for mine, theirs in zip(self.cache_state(states, index, n_tokens), cache.cache):
                    if mine.shape != theirs.shape:
                        return False
                    mine, theirs = mine.astype(mx.float32), theirs.astype(mx.float32)
                    apart = mx.max(mx.abs(mine - theirs)).item()
                    if not apart <= PROBE_TOLERANCE * mx.max(mx.abs(theirs)).item() + 1e-6:
                        return False
        return True


def _uninstall(mixer) -> None:
    """``mixer`` without its conv recorder (the module's wrapper stays: it calls through)."""
    if isinstance(mixer.__dict__.get("conv1d"), _ConvRecorder):
        del mixer.__dict__["conv1d"]


def _install(mixer) -> _ConvRecorder:
    """The recorders on ``mixer`` and its module's ``gated_delta_update`` (once each); the conv's."""
    recorder = mixer.__dict__.get("conv1d")
    if not isinstance(recorder, _ConvRecorder):
        # Set on the instance, past nn.Module.__setattr__, which would move the child out of the
        # parameter tree: the real conv1d stays the module's child (weights, quantization, saving).
        recorder = _ConvRecorder(mixer["conv1d"])
        object.__setattr__(mixer, "conv1d", recorder)
    module = sys.modules[type(mixer).__module__]
    if not hasattr(module.gated_delta_update, _WRAPPED):
        module.gated_delta_update = _recording_update(module.gated_delta_update)
    return recorder
