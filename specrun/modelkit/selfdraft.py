"""A draft made from the target itself: ``--draft self:q4``, ``self:q8`` and ``self:layers=N``.

``self:layers=`` keeps some of the target's own layers (LayerDraft): nothing is written, the
MLX backend runs those layers of the loaded target as the draft. Bare ``self:layers`` keeps
the layers ``specrun tune`` chose for the target on this machine (modelkit/layer_choice.py).
The rest of this module is the quantized copies:

specrun writes a quantized copy of the target once, into its cache like the demo variants
(atomically, beside other copies of the same source), and loads it as the draft model. The
copy has the target's vocabulary by construction. GGUF targets are quantized by llama.cpp
(Q4_0, Q8_0), MLX folders by mlx-lm (affine 4 or 8 bits).

The cache key is a fingerprint of the source, not a hash of all of it: its size, its
modification time and SHA-256 of its first and last MiB (the whole file when it is smaller),
for each file of an MLX folder. Hashing a 40 GB target in full would cost most of a minute
on every run; the fingerprint costs a few milliseconds and still changes when the file is
rewritten (new mtime) or edited to another size, header or tail. A file touched without a
change is quantized again, the safe direction. Beside it the copy's folder is named for the
code and library versions that write copies (``demo.derivation_key``): an upgrade quantizes again.

A target stored at or below the precision asked for (a Q4_1 file and ``self:q4``) is refused:
its copy would read as many bytes per token as the target, so it could never pay as a draft.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from specrun.errors import UsageError
from specrun.modelkit.demo import cache_dir, derivation_key, derive_once

SELF_PREFIX = "self:"
FINGERPRINT_BLOCK = 1 << 20  # bytes hashed at each end of a file


@dataclass(frozen=True)
class SelfKind:
    """One ``self:`` draft: its weights' bits, and the GGUF type llama.cpp writes for it."""

    name: str
    bits: int
    gguf_type: str


SELF_KINDS = {kind.name: kind for kind in (SelfKind("q4", 4, "Q4_0"), SelfKind("q8", 8, "Q8_0"))}
ACCEPTED = ", ".join(SELF_PREFIX + name for name in SELF_KINDS)


def is_self_draft(spec: str | None) -> bool:
    return spec is not None and spec.startswith(SELF_PREFIX)


LAYERS = "layers="
TUNED_LAYERS = "layers"  # bare: the layers `specrun tune --draft self:layers` chose
LAYERS_FIX = ("pass --draft self:layers=N (the first N layers), self:layers=0-5,9 (those layers, from 0) "
              "or self:layers (the tuned ones)")


@dataclass(frozen=True)
class LayerDraft:
    """``self:layers=N``, the target's first N layers, or ``self:layers=0-5,9``, the layers
    named (from 0), with the target's final norm and output head: a draft that shares the
    target's weights and memory (layer skipping: Draft & Verify, LayerSkip, SWIFT)."""

    spec: str
    first: int = 0  # N of the first-N form (0: ``named`` instead)
    named: tuple[int, ...] = ()  # neither: bare ``self:layers``, the tuned layers

    @property
    def tuned(self) -> bool:
        """Bare ``self:layers``: the layers are those tuned for the target (layer_choice.tuned_layers)."""
        return not self.first and not self.named

    def kept(self, n_layers: int) -> tuple[int, ...]:
        """The layer indices the draft runs, in order, for a target of ``n_layers`` layers;
        a UsageError where they are out of range or all of them (no cheaper than the target).
        Not for a ``tuned`` draft, whose layers are read from the tuned choices."""
        kept = tuple(range(self.first)) if self.first else self.named
        if kept[-1] >= n_layers:
            fix = f"pass self:layers=N with N below {n_layers}" if self.first else f"name layers 0 to {n_layers - 1}"
            raise UsageError(f"--draft {self.spec} asks for layers the target does not have (it has {n_layers})", fix)
        if len(kept) == n_layers:
            raise UsageError(f"--draft {self.spec} keeps all {n_layers} of the target's layers: it would cost what "
                             "the target does", "keep fewer layers")
        return kept


WINDOW = "window"


@dataclass(frozen=True)
class WindowDraft:
    """``self:window``: the loaded target drafting for itself from a second, small cache of the
    context's first tokens and a recent window (MagicDec; backends/window.py), sized by --window
    and --sinks. Nothing is written and no weights are loaded twice."""

    spec: str


def parse_self_draft(spec: str) -> SelfKind | LayerDraft | WindowDraft:
    """The kind ``spec`` names (``self:q4``, ``self:layers=8``, ``self:window``), or a UsageError
    naming the accepted kinds."""
    name = spec.removeprefix(SELF_PREFIX)
    if name == WINDOW:
        return WindowDraft(spec)
    if name == TUNED_LAYERS:
        return LayerDraft(spec)
    if name.startswith(LAYERS):
        return _parse_layers(spec, name.removeprefix(LAYERS))
    if name not in SELF_KINDS:
        raise UsageError(f"unknown self draft {spec!r}",
                         f"use one of: {ACCEPTED}, self:layers=N, self:layers, self:{WINDOW}")
    return SELF_KINDS[name]


def _parse_layers(spec: str, text: str) -> LayerDraft:
    def number(part: str) -> int:
        if not (part.isascii() and part.isdigit()):
            raise UsageError(f"--draft {spec}: {part!r} is not a layer number", LAYERS_FIX)
        return int(part)

    if "," not in text and "-" not in text:
        first = number(text)
        if first == 0:
            raise UsageError(f"--draft {spec} keeps no layer", LAYERS_FIX)
        return LayerDraft(spec, first=first)
    named: list[int] = []
    for part in text.split(","):
        if part.startswith("-"):  # "-1": no layer is numbered below 0 (it read as '' and 1)
            raise UsageError(f"--draft {spec}: {part!r} is not a layer number (they count from 0)", LAYERS_FIX)
        low, dash, high = part.partition("-")
        start, stop = number(low), number(high) if dash else number(low)
        if stop < start:
            raise UsageError(f"--draft {spec}: the range {part!r} runs backwards", LAYERS_FIX)
        named.extend(range(start, stop + 1))
    if named != sorted(set(named)):
        raise UsageError(f"--draft {spec} names layers out of order or twice", LAYERS_FIX)
    return LayerDraft(spec, named=tuple(named))


def is_layer_draft(spec: str | None) -> bool:
    name = spec.removeprefix(SELF_PREFIX) if is_self_draft(spec) else ""
    return name == TUNED_LAYERS or name.startswith(LAYERS)


def is_window_draft(spec: str | None) -> bool:
    return is_self_draft(spec) and spec.removeprefix(SELF_PREFIX) == WINDOW


def is_tuned_layer_draft(spec: str | None) -> bool:
    return is_self_draft(spec) and spec.removeprefix(SELF_PREFIX) == TUNED_LAYERS


def self_draft_gguf(source: Path, kind: SelfKind, target_spec: str) -> Path:
    """The ``kind`` copy of the GGUF ``source`` (the target ``target_spec``), derived on first use."""
    from specrun.backends.llama import quantize_gguf

    _check_precision(gguf_weight_bits(source), kind, target_spec)
    path = _copy_path(source, f"{source.stem}.self-{kind.gguf_type.lower()}.gguf")
    return derive_once(path, lambda tmp: quantize_gguf(source, tmp, kind.gguf_type))


def self_draft_mlx_dir(source: Path, kind: SelfKind, target_spec: str) -> Path:
    """The ``kind`` copy of the MLX folder ``source`` (the target ``target_spec``), derived on first use."""
    from specrun.backends.mlx import quantize_mlx_folder

    _check_precision(mlx_weight_bits(source), kind, target_spec)
    path = _copy_path(source, f"{source.name}-self-{kind.name}-mlx")
    return derive_once(path, lambda tmp: quantize_mlx_folder(source, tmp, kind.bits))


def _check_precision(bits: tuple[int, str], kind: SelfKind, target_spec: str) -> None:
    held, type_name = bits
    if held > kind.bits:
        return
    cheaper = [SELF_PREFIX + other.name for other in SELF_KINDS.values() if other.bits < held]
    fix = f"use --draft {cheaper[0]}" if cheaper else "pass a target stored in more bits (F16, say), or a draft model"
    raise UsageError(
        f"--draft {SELF_PREFIX}{kind.name}: {target_spec} already holds {held}-bit weights ({type_name}), "
        "so a copy in fewer bits would be no cheaper than the target",
        f"{fix} (self drafts: {ACCEPTED})",
    )


def gguf_weight_bits(path: Path) -> tuple[int, str]:
    """The bits of the type holding most of a GGUF's weights, with that type's name
    (Q4_1: 4, Q8_0: 8, F16: 16): the first number in ggml's name for it."""
    import gguf

    elements: Counter[str] = Counter()
    for tensor in gguf.GGUFReader(str(path)).tensors:
        elements[tensor.tensor_type.name] += int(tensor.n_elements)
    type_name = elements.most_common(1)[0][0]
    return int(re.search(r"\d+", type_name).group()), type_name


def mlx_weight_bits(folder: Path) -> tuple[int, str]:
    """The bits of an MLX folder's weights: its quantization's, else its float type's."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    quantization = config.get("quantization") or config.get("quantization_config") or {}
    if "bits" in quantization:
        return int(quantization["bits"]), f"{quantization['bits']}-bit MLX"
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float16")
    return (32 if dtype == "float32" else 16), dtype


def fingerprint(source: Path) -> str:
    """A short hex key for a file, or for an MLX folder from each of its files (see the module doc)."""
    digest = hashlib.sha256()
    files = sorted(p for p in source.iterdir() if p.is_file()) if source.is_dir() else [source]
    for path in files:
        stat = path.stat()
        name = path.name if source.is_dir() else ""  # a file's own name is not its content
        digest.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        with path.open("rb") as handle:
            digest.update(handle.read(FINGERPRINT_BLOCK))
            if stat.st_size > 2 * FINGERPRINT_BLOCK:
                handle.seek(-FINGERPRINT_BLOCK, 2)
            digest.update(handle.read(FINGERPRINT_BLOCK))
    return digest.hexdigest()[:16]


def _copy_path(source: Path, filename: str) -> Path:
    return cache_dir() / "derived" / "self" / fingerprint(source) / derivation_key() / filename
