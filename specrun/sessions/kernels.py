"""Kernel settings chosen by measurement: llama.cpp's flash attention on a CPU.

llama.cpp turns flash attention on wherever the device has it (its "auto"). On a CPU that is
a gamble: on the AMD EPYC this project was first measured on it made plain decoding 10-15%
faster; on an Intel Xeon (Sapphire Rapids) it is slower at every context length, 1.6-2.6x a
pass at 1,800 tokens, most for the batched passes speculation verifies with (docs/perf.md
3(d)). So where the user leaves ``--flash-attn`` at auto and every layer runs on this
machine's CPU, the first run of a model times passes of 1 and 6 tokens after 256 with it on
and off (``LlamaCppBackend.time_flash_attn``: two scratch contexts, passes alternated; about 1.5 s
for SmolLM2 on 2 cores, longer for a large model on a small CPU), keeps what it
measured by model file, machine, threads, KV cache type and llama-cpp-python version
(``kernels.json`` beside ``learned.json``), and later runs only read it. GPUs and RPC servers
keep llama.cpp's own choice, as do models nothing can be timed on (recurrent ones) and runs
where the timing fails: measuring never costs a run.

Which wins depends on the context too: on this project's 2-core Xeon, after 256 tokens on and off
run within a few percent, while after 4,096 tokens of the bench-scale target off ran a plain step
in 94 ms against 176 and a 5-token pass in 166 ms against 619 (docs/perf.md 3(s)). A run that
knows its context will pass ``DEEP_FROM`` tokens (a long prompt to `specrun generate`, a bench whose
longest prompt does) chooses by a probe after ``DEEP_DEPTH`` tokens instead, kept under a key of
its own: it costs two prefills of that depth once (tens of seconds for a large model on a small
CPU), against a decode up to twice as fast at every later long prompt. A chat cannot know its
length when it opens: it settles by the short probe, and once an answer's context may reach
``DEEP_FROM`` tokens chooses again by the deep one (``settle_for_context``, once a session);
where that choice differs, the models' caches are emptied, their contexts made again and the
prompt read again in full — one prefill, against every later step of a long conversation.
A run or a request never waits more than ``DEEP_WAIT_S`` for the deep probe: where the short
probe's costs put it above that (two prefills of DEEP_DEPTH tokens, each token at the 6-token
pass's cost: minutes for an 8B model on a laptop CPU), the run keeps the short probe's choice and
says that `specrun tune` measures it once; tune (and a bench, itself a measurement) waits for it.

The setting whose one-token pass and 6-token pass together cost less wins (a plain step and
a verify pass: what plain decoding and speculation pay); off must be ``MARGIN`` faster to
overrule llama.cpp's choice. One setting per model, whatever the method: plain decoding and
speculation then run the same kernels (their outputs differ at near-ties only where speculation
puts them), and what runs and `specrun tune` store is found under one key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specrun.errors import SpecrunError
from specrun.fileio import (
    MiB, checked_number, machine_id, read_settings_document, stored_entry, updating, write_atomically,
)
from specrun.registry.loading import LoadOptions, open_draft, open_pair
from specrun.sessions.tuning import config_path, model_id

KERNELS_VERSION = 1
PROBE_DEPTH = 256  # tokens before the timed passes: a short chat's context
PROBE_COUNTS = (1, 6)  # a plain step; a verify pass of a 5-token draft
PROBE_BUDGET_S = 2.0
DEEP_FROM = 2048  # a run whose context will reach this many tokens chooses by the deep probe
DEEP_DEPTH = 4096
DEEP_BUDGET_S = 600.0  # its prefill may take a quarter of this: a 4,096-token prefill on a slow CPU
DEEP_ROUNDS = 9  # the deep probe's timed rounds: its budget never cuts them short (backends' max_rounds)
DEEP_SLOWDOWN = 4.0  # a pass after DEEP_DEPTH tokens against one after PROBE_DEPTH: 2-11x measured here
DEEP_WAIT_S = 30.0  # the longest a run or a request waits for the deep probe; `specrun tune` waits for any
MARGIN = 0.03
MAX_KERNELS_BYTES = 4 * MiB
MAX_SECONDS = 1e6
MIN_SECONDS = 1e-9


@dataclass(frozen=True)
class FlashCosts:
    """Seconds of a pass over n tokens (n in PROBE_COUNTS) after ``depth`` tokens, with flash
    attention on and off, measured side by side on this machine."""

    model: str
    machine: str
    threads: int
    depth: int
    on: dict[int, float]
    off: dict[int, float]

    def flash_on(self) -> bool:
        """The faster setting over a plain step and a verify pass; llama.cpp's own choice, on,
        unless off is MARGIN faster."""
        on, off = (sum(costs[n] for n in PROBE_COUNTS) for costs in (self.on, self.off))
        return not off < on * (1.0 - MARGIN)

    def describe(self) -> str:
        """The one-line note a measuring run leaves: the choice and the costs behind it."""
        setting = "on" if self.flash_on() else "off"
        passes = ", ".join(f"{n}-token pass {self.on[n] * 1e3:.3g} ms on, {self.off[n] * 1e3:.3g} ms off"
                           for n in PROBE_COUNTS)
        return (f"flash attention {setting} for {self.model.split(':')[0]} on this CPU, measured once after "
                f"{self.depth} tokens ({passes}); --flash-attn on|off overrides")


def kernels_path() -> Path:
    """Where the measured costs are kept: beside tune's and the runs' own files."""
    return config_path().with_name("kernels.json")


FIX = "delete it (the next run measures again)"


def costs_key(model: str, machine: str, threads: int, settings: str = "") -> str:
    """An entry's key: the model file, the machine, the threads and what else changes the kernels
    (``settings``: the KV cache type, the llama.cpp build)."""
    return hashlib.sha256(f"{model}|{machine}|threads={threads}|{settings}".encode()).hexdigest()[:16]


def load_costs(key: str, path: Path | None = None) -> FlashCosts | None:
    """The costs stored for ``key``; None when there are none. A file or entry of the wrong
    shape raises SpecrunError naming the file and the fix."""
    path = path or kernels_path()
    return stored_entry(_read_all(path), key, _checked, path, "the kernel costs", FIX)


def save_costs(key: str, costs: FlashCosts, path: Path | None = None) -> Path:
    """Store ``costs`` (other models' are kept); written atomically."""
    path = path or kernels_path()
    with updating(path):  # another process's save in between is kept
        stored = _read_all(path)
        stored[key] = {"model": costs.model, "machine": costs.machine, "threads": costs.threads,
                       "depth": costs.depth, "on": costs.on, "off": costs.off}
        return write_atomically(path, json.dumps({"version": KERNELS_VERSION, "flash_attn": stored}, indent=2),
                                "kernel costs")


def _read_all(path: Path) -> dict:
    return read_settings_document(path, MAX_KERNELS_BYTES, "kernel costs", "kernel costs file", FIX,
                                  (KERNELS_VERSION,), "flash_attn")


def _checked(raw) -> FlashCosts:
    if not isinstance(raw, dict):
        raise TypeError("the entry is not an object")
    expected = {"model", "machine", "threads", "depth", "on", "off"}
    if set(raw) != expected:
        odd = sorted(set(raw) ^ expected)[0]
        raise ValueError(f"{'unknown' if odd in raw else 'missing'} field {odd!r}")
    for name in ("model", "machine"):
        if not isinstance(raw[name], str):
            raise TypeError(f"{name} is not a string")
    threads = checked_number("threads", raw["threads"], 1, 1 << 16, integer=True)
    depth = checked_number("depth", raw["depth"], 1, 1 << 20, integer=True)
    by_setting = {}
    for setting in ("on", "off"):
        value = raw[setting]
        if not isinstance(value, dict) or sorted(value) != sorted(str(n) for n in PROBE_COUNTS):
            raise ValueError(f"{setting} does not hold the costs of passes of {list(PROBE_COUNTS)} tokens")
        by_setting[setting] = {int(n): checked_number(f"{setting}[{n}]", seconds, MIN_SECONDS, MAX_SECONDS)
                               for n, seconds in value.items()}
    return FlashCosts(raw["model"], raw["machine"], threads, depth, by_setting["on"], by_setting["off"])


def settle_flash_attn(backend, options: LoadOptions, context: int | None = None, again: bool = False,
                      wait_s: float | None = None) -> str | None:
    """Turn flash attention on or off for ``backend`` by what it costs here, where the user
    left it to llama.cpp (module docstring): the stored costs, else a probe stored for the
    next run. ``context``: the tokens the run's context will reach, where known (a long one is
    chosen for by the deep probe). ``again``: settle a backend settled before, for another
    context (its cache empty). ``wait_s``: the longest the deep probe may take (``flash_costs``).
    Returns a note saying what was measured, when it measured, or why it did not; None otherwise."""
    if getattr(backend, "flash_attn", None) is not None and not again:  # MLX's have none
        return None
    costs, note = flash_costs(backend, options, context, wait_s=wait_s)
    if costs is None:
        return note
    try:
        backend.set_flash_attn(costs.flash_on())
    except SpecrunError:
        return None  # a context that failed (memory): the run goes on with llama.cpp's choice
    return note


def flash_costs(backend, options: LoadOptions, context: int | None = None,
                on_start: Callable[[str], None] | None = None,
                wait_s: float | None = None) -> tuple[FlashCosts | None, str | None]:
    """What flash attention costs ``backend`` here, for a run whose context reaches ``context``
    (the deep probe's key from DEEP_FROM tokens), and a note where it was measured now: stored,
    else probed and stored. (None, None) where the choice is not specrun's (a GPU, RPC, --exact,
    --flash-attn given, not llama.cpp) or nothing could be timed. ``on_start`` is told before the
    deep probe runs (two prefills of DEEP_DEPTH tokens: what a request waiting for it waits for).
    ``wait_s``: where the deep probe is not stored and would take longer than this by the short
    probe's costs (``deep_probe_seconds``), the short probe's costs and a note saying so and what
    measures it."""
    if getattr(backend, "name", None) != "llama" or options.flash_attn is not None or options.exact:
        return None, None
    if not backend.runs_on_cpu:
        return None, None
    deep = context is not None and context >= DEEP_FROM
    probe_depth, budget = (DEEP_DEPTH, DEEP_BUDGET_S) if deep else (PROBE_DEPTH, PROBE_BUDGET_S)
    model, machine, threads = _unsettled_id(backend), machine_id(), backend.n_threads
    costs = load_costs(_key(backend, deep))
    if costs is not None:
        return costs, None
    if deep and wait_s is not None:
        short, _ = flash_costs(backend, options)  # stored by the run's open; else measured now (seconds)
        if short is None:
            return None, None  # nothing can be timed on this model here
        seconds = deep_probe_seconds(short)
        if seconds > wait_s:
            return short, (f"flash attention {'on' if short.flash_on() else 'off'} for {model.split(':')[0]} as "
                           f"measured after {short.depth} tokens, in this long context too: timing it after "
                           f"{DEEP_DEPTH} tokens would take about {seconds:.0f} s here; `specrun tune` measures it "
                           f"once for later runs (or pass --flash-attn on|off)")
    if deep and on_start is not None:
        on_start(f"timing flash attention after {DEEP_DEPTH} tokens for {model.split(':')[0]}, once on this "
                 f"machine (up to {DEEP_BUDGET_S:.0f} s; stored for later runs): this answer waits for it")
    busy = backend.busy_now()
    try:
        # The scratch contexts are sized for the timing alone: --ctx does not limit the depth.
        depth, measured = backend.time_flash_attn(probe_depth, PROBE_COUNTS, budget)
    except SpecrunError:
        return None, None  # a pass or a context that failed (memory): llama.cpp's choice stands
    if not measured:
        return None, None  # nothing can be timed on this model here: llama.cpp's choice stands
    costs = FlashCosts(model, machine, threads, depth, measured[True], measured[False])
    if busy or backend.busy_now():  # timed while other processes held cores: this run's choice alone
        return costs, costs.describe() + "; not stored: other processes kept cores busy while it was timed"
    try:
        save_costs(_key(backend, deep), costs)
    except SpecrunError:
        pass  # a read-only config folder: the next run measures again (nothing half-written)
    return costs, costs.describe()


def _key(backend, deep: bool) -> str:
    """The key of ``backend``'s costs here: the short probe's, or the deep one's."""
    settings = f"kv={backend.kv_type}|{backend.library_version}" + (f"|depth={DEEP_DEPTH}" if deep else "")
    return costs_key(_unsettled_id(backend), machine_id(), backend.n_threads, settings)


def deep_probe_seconds(short: FlashCosts) -> float:
    """About how long the deep probe takes, by the short probe's costs: both settings' contexts
    fed DEEP_DEPTH tokens, each token at the slower setting's 6-token pass per token (the prefill
    stops at a quarter of DEEP_BUDGET_S), then its timed rounds, each pass DEEP_SLOWDOWN times
    what it cost after PROBE_DEPTH tokens. Measured here: demo-target (2 threads) 2.9 s estimated,
    3.3 s taken; SmolLM2-135M F16 (1 thread) 29.0 s estimated, 28.6 s taken."""
    per_token = max(short.on[6], short.off[6]) / 6
    passes = sum(short.on[n] + short.off[n] for n in PROBE_COUNTS)
    return min(2 * DEEP_DEPTH * per_token, DEEP_BUDGET_S / 4) + DEEP_ROUNDS * DEEP_SLOWDOWN * passes


def measure_deep(backends, options: LoadOptions, on_note: Callable[[str], None]) -> None:
    """The deep probe for each llama.cpp model of ``backends`` whose context can reach DEEP_FROM
    tokens, measured now however long it takes, and stored (`specrun tune`: later long runs and
    requests then read it rather than wait). A windowed draft decodes in its window's few cells."""
    for backend in backends:
        if backend is None or hasattr(backend, "reopen") or getattr(backend, "n_ctx", 0) < DEEP_FROM:
            continue
        _, note = flash_costs(backend, options, DEEP_DEPTH, on_start=on_note)
        if note is not None:
            on_note(note)


def settle_for_context(backends, options: LoadOptions, context: int, empty_caches: Callable[[], None],
                       on_note=None) -> list[str]:
    """A conversation settled at the open (a short chat's probe) whose context now reaches
    ``context`` (from DEEP_FROM tokens): each llama.cpp model's flash attention chosen again by the
    deep probe's costs (stored, else measured now: two prefills of DEEP_DEPTH tokens, once per
    model and machine), and where that choice differs from the one it runs with, the caches
    emptied (``empty_caches``, once: the next prompt is read again in full) and its context made
    again with it. A windowed draft (its few cells) and a model whose context cannot be made again
    now (heads reading its states) keep theirs, unmeasured. Returns the names of the models switched."""
    switched: list[str] = []
    emptied = False
    for backend in backends:
        if backend is None or hasattr(backend, "reopen") or getattr(backend, "flash_attn", None) is None:
            continue
        if getattr(backend, "tracking_hidden", False):
            continue  # heads read its states: its context is not made again mid-conversation
        costs, note = flash_costs(backend, options, context, on_start=on_note, wait_s=DEEP_WAIT_S)
        if note is not None and on_note is not None:
            on_note(note)
        if costs is None or costs.flash_on() == backend.flash_attn:
            continue
        if not emptied:
            empty_caches()
            emptied = True
        previous = backend.flash_attn
        try:
            backend.set_flash_attn(costs.flash_on())
        except SpecrunError:
            continue  # a context that failed (memory): it keeps the one it had
        if on_note is not None:
            on_note(f"this answer's context may pass {DEEP_FROM} tokens: flash attention "
                    f"{'on' if backend.flash_attn else 'off'} (was {'on' if previous else 'off'}), as measured "
                    f"after {costs.depth} tokens here; the conversation is read again once")
        switched.append(str(getattr(backend, "path", backend)))
    return switched


def _unsettled_id(backend) -> str:
    """The model's id as before any flash choice: one settled before (``again``) carries its first
    choice in its tuning variant, which the costs' key must not (a run settles from unsettled)."""
    if backend.flash_attn is None:
        return model_id(backend)
    return model_id(backend).removesuffix(f"|flash={'on' if backend.flash_attn else 'off'}")


def open_settled_pair(target_spec: str, draft_spec: str | None, options: LoadOptions, on_note=None):
    """``open_pair``, then flash attention settled for each model (``settle_pair``)."""
    target, draft = open_pair(target_spec, draft_spec, options, on_note)
    try:
        settle_pair(target, draft, options, on_note)
    except BaseException:
        target.close()
        if draft is not None:
            draft.close()
        raise
    return target, draft


def settle_pair(target, draft, options: LoadOptions, on_note=None, context: int | None = None,
                again: bool = False, wait_s: float | None = None) -> None:
    """``settle_flash_attn`` for the target and a draft model (each measured apart); ``on_note``
    is told what was measured; ``context``: the tokens the run's context will reach, where known;
    ``wait_s``: the longest a deep probe may take (None: any, as a bench and tune wait).
    Before anything is fed (``again``: or with the caches emptied, settled once before)."""
    for backend in (target, draft):
        if backend is None:
            continue
        note = _settle(backend, options, context, again, wait_s)
        if note is not None and on_note is not None:
            on_note(note)


def _settle(backend, options: LoadOptions, context: int | None = None, again: bool = False,
            wait_s: float | None = None) -> str | None:
    """``settle_flash_attn``; a windowed draft's model is settled for its window's few cells, then
    its window cache made again with the model's settings (backends/window.py)."""
    if hasattr(backend, "reopen"):
        note = settle_flash_attn(backend.parent, options, again=again)
        backend.reopen()
        return note
    return settle_flash_attn(backend, options, context, again, wait_s)


def open_settled_draft(target, target_spec: str, draft_spec: str, options: LoadOptions, on_note=None):
    """``open_draft`` (a draft model loaded later, on chat's first /method that needs one), its
    flash attention settled as ``open_settled_pair`` settles a draft's."""
    draft = open_draft(target, target_spec, draft_spec, options, on_note=on_note)
    try:
        note = _settle(draft, options)
    except BaseException:
        draft.close()
        raise
    if note is not None and on_note is not None:
        on_note(note)
    return draft
