"""The layers ``specrun tune --draft self:layers`` chose for a target on this machine, and
how ``--draft self:layers`` finds them again.

They are kept in ``layers.json`` beside ``tuned.json`` in the user config, one entry per
target and machine, written atomically. The target is known by ``selfdraft.fingerprint`` of
its MLX folder (each file's size, mtime and ends): an MLX target is a folder, and a folder's
own size says nothing of the weights in it. The registry reads this file when it opens the
draft, so it lives below the sessions (the search itself is sessions/layer_search.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from specrun.errors import SpecrunError, UsageError
from specrun.fileio import MiB, checked_number, config_dir, machine_id, read_settings_document, updating, write_atomically
from specrun.modelkit.selfdraft import LAYERS, SELF_PREFIX, fingerprint

CHOICES_VERSION = 1
MAX_CHOICES_BYTES = 4 * MiB  # a few hundred bytes a target
MAX_LAYERS = 1 << 16
MAX_MEASURE = 1e9  # seconds, rates and speed-ups; past this a file is damaged or forged
MAX_DRAFT_LEN = 8


def tune_command(target_spec: str) -> str:
    return f"specrun tune --target {target_spec} --draft {SELF_PREFIX}layers --backend mlx"


@dataclass(frozen=True)
class LayerChoice:
    """One search's result: the layers the draft keeps and what they were measured to do."""

    target: str  # the target's folder name, for people
    fingerprint: str  # the target's files (selfdraft.fingerprint)
    machine: str
    n_layers: int  # the target's
    kept: tuple[int, ...]
    agreement: float  # share of calibration positions where the draft's argmax is the target's
    draft_len: int  # the draft length the modeled speed-up is best at
    modeled_speedup: float
    measured_speedup: float  # the draft at draft_len against plain decoding, interleaved on the prompts
    tokens_per_second: dict[str, float] = field(default_factory=dict)  # "none", "draft k=3"
    searched: int = 0  # kept-layer sets scored
    seconds: float = 0.0  # the search's wall-clock time

    @property
    def key(self) -> str:
        return choice_key(self.fingerprint, self.machine)

    @property
    def spec(self) -> str:
        """The explicit ``--draft`` spec for these layers (``self:layers=0-13,18-29``)."""
        return SELF_PREFIX + LAYERS + layer_ranges(self.kept)


def layer_ranges(kept: tuple[int, ...]) -> str:
    """``0-13,18-29`` for those layers: the form ``self:layers=`` parses."""
    parts: list[str] = []
    start = previous = kept[0]
    for layer in (*kept[1:], None):
        if layer is not None and layer == previous + 1:
            previous = layer
            continue
        parts.append(f"{start}-{previous}" if previous > start else str(start))
        if layer is not None:
            start = previous = layer
    return ",".join(parts)


def choice_key(target_fingerprint: str, machine: str) -> str:
    return hashlib.sha256(f"{target_fingerprint}|{machine}".encode()).hexdigest()[:16]


def choices_path() -> Path:
    return config_dir() / "layers.json"


def _fix(path: Path) -> str:
    return f"delete {path} and run `specrun tune --draft {SELF_PREFIX}layers` again"


def save_choice(choice: LayerChoice, path: Path | None = None) -> Path:
    """Store ``choice`` (other targets' and machines' choices are kept); written atomically."""
    path = path or choices_path()
    with updating(path):  # another process's save in between is kept
        stored = _read_all(path)
        stored[choice.key] = asdict(choice)
        document = {"version": CHOICES_VERSION, "choices": stored}
        return write_atomically(path, json.dumps(document, indent=2), "tuned layer choices")


def load_choices(path: Path | None = None) -> list[LayerChoice]:
    """Every stored choice, each checked; a damaged file or entry raises SpecrunError naming the fix."""
    path = path or choices_path()
    return [_checked(key, raw, path) for key, raw in _read_all(path).items()]


def saved_choice(folder: Path, path: Path | None = None) -> LayerChoice | None:
    """The choice stored for the target in ``folder`` on this machine, or None."""
    path = path or choices_path()
    key = choice_key(fingerprint(folder), machine_id())
    raw = _read_all(path).get(key)
    return None if raw is None else _checked(key, raw, path)


def tuned_layers(folder: Path, n_layers: int, target_spec: str, path: Path | None = None) -> tuple[int, ...]:
    """The layers bare ``--draft self:layers`` keeps for the target in ``folder`` (``n_layers``
    layers): those tuned on this machine, or a UsageError saying how to tune them."""
    path = path or choices_path()
    choice = saved_choice(folder, path)
    if choice is None:
        raise UsageError(f"no tuned layer choice for {target_spec} on this machine",
                         f"run `{tune_command(target_spec)}`, or pass self:layers=N")
    if choice.n_layers != n_layers:
        raise SpecrunError(f"{path}: the layer choice for {target_spec} is for {choice.n_layers} layers, "
                           f"and the target has {n_layers}", _fix(path))
    return choice.kept


def _read_all(path: Path) -> dict:
    return read_settings_document(path, MAX_CHOICES_BYTES, "the tuned layer choices", "layer-choice file", _fix(path),
                                  (CHOICES_VERSION,), "choices")


def _checked(key: str, raw, path: Path) -> LayerChoice:
    try:
        choice = _checked_choice(raw)
        if choice.key != key:
            raise ValueError("it is stored under another target's or machine's key")
    except (TypeError, ValueError) as exc:
        raise SpecrunError(f"{path}: the layer choice {key} is malformed ({exc})", _fix(path)) from exc
    return choice


def _checked_choice(raw) -> LayerChoice:
    """A LayerChoice from a stored entry, every field checked; TypeError/ValueError otherwise."""
    if not isinstance(raw, dict):
        raise TypeError("the entry is not an object")
    names = [item.name for item in fields(LayerChoice)]
    unknown, missing = sorted(set(raw) - set(names)), [name for name in names if name not in raw]
    if unknown or missing:
        raise ValueError(f"unknown field {unknown[0]!r}" if unknown else f"missing field {missing[0]!r}")
    values = dict(raw)
    for name in ("target", "fingerprint", "machine"):
        if not isinstance(values[name], str):
            raise TypeError(f"{name} is not a string")
    n_layers = values["n_layers"] = checked_number("n_layers", values["n_layers"], 2, MAX_LAYERS, integer=True)
    kept = values["kept"]
    if not isinstance(kept, list) or not kept:
        raise TypeError("kept is not a list of layers")
    values["kept"] = tuple(checked_number("kept", layer, 0, n_layers - 1, integer=True) for layer in kept)
    if list(values["kept"]) != sorted(set(values["kept"])) or len(kept) == n_layers:
        raise ValueError("kept names layers out of order, twice, or all of them")
    values["draft_len"] = checked_number("draft_len", values["draft_len"], 1, MAX_DRAFT_LEN, integer=True)
    values["searched"] = checked_number("searched", values["searched"], 0, MAX_MEASURE, integer=True)
    values["agreement"] = checked_number("agreement", values["agreement"], 0, 1)
    for name in ("modeled_speedup", "measured_speedup", "seconds"):
        values[name] = checked_number(name, values[name], 0, MAX_MEASURE)
    rates = values["tokens_per_second"]
    if not isinstance(rates, dict):
        raise TypeError("tokens_per_second is not an object")
    values["tokens_per_second"] = {str(name): checked_number(f"tokens_per_second[{name}]", rate, 0, MAX_MEASURE)
                                   for name, rate in rates.items()}
    return LayerChoice(**values)
