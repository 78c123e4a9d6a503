"""A model folder's safetensors read by tensor name, whichever shard holds each, as float arrays:
float checkpoints as stored, and matrices mlx-lm quantized (``NAME.weight`` as packed 32-bit
words beside ``NAME.scales`` and ``NAME.biases``, its affine scheme) dequantized, so that a layer
the model carries beside what mlx-lm loads (its MTP layers, modelkit/mtp.py) reads alike from a
Hugging Face checkpoint and from a quantized MLX folder.

mlx-lm's affine quantization stores each row's values as a little-endian stream of ``bits``-bit
integers q packed into 32-bit words, every ``group`` of them with a scale and a bias:
value = scale * q + bias. The bits and the group size follow from the shapes (the words, the
scales and the matrix's own), so per-layer settings in the config need not be read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrun.errors import ModelFileError

BITS = (2, 3, 4, 5, 6, 8)
GROUPS = (32, 64, 128)
_ROWS = 4096  # rows dequantized at a time (a vocabulary-sized table unpacks to 8 bytes a bit)


def dequantize_affine(words: np.ndarray, scales: np.ndarray, biases: np.ndarray, columns: int,
                      dtype=np.float32) -> np.ndarray:
    """The (rows, columns) matrix mlx-lm's affine quantization packed into ``words`` (rows, W)
    uint32, with ``scales`` and ``biases`` (rows, groups) as float arrays."""
    rows, bits = words.shape[0], words.shape[1] * 32 // columns
    group = columns // scales.shape[1]
    out = np.empty((rows, columns), dtype)
    powers = (1 << np.arange(bits, dtype=np.uint32))
    for start in range(0, rows, _ROWS):
        part = np.ascontiguousarray(words[start : start + _ROWS], np.uint32)
        stream = np.unpackbits(part.view(np.uint8).reshape(len(part), -1), axis=1, bitorder="little")
        q = (stream.reshape(len(part), columns, bits) * powers).sum(-1, dtype=np.uint32).astype(np.float32)
        scale = np.asarray(scales[start : start + _ROWS], np.float32)[..., None]
        bias = np.asarray(biases[start : start + _ROWS], np.float32)[..., None]
        out[start : start + _ROWS] = (q.reshape(len(part), -1, group) * scale + bias).reshape(len(part), columns)
    return out


@dataclass(frozen=True)
class StoredMatrix:
    """An array as its file holds it, for a backend that computes with it so (MLX holds a model's
    MTP block this way: backends/mtp_mlx.py): ``values`` float32 or float16 as stored, or
    bfloat16's 16 bits (``bfloat16``); or mlx-lm's affine quantization of a (..., rows, columns)
    matrix: ``values`` its packed words (..., rows, W) uint32 beside ``scales`` and ``biases``
    (..., rows, groups) float32, ``bits`` a value in groups of ``group``."""

    values: np.ndarray
    bfloat16: bool = False
    scales: np.ndarray | None = None
    biases: np.ndarray | None = None
    bits: int = 0
    group: int = 0

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    @property
    def shape(self) -> tuple[int, ...]:
        """The array's own shape (a quantized matrix's, not its words')."""
        if not self.quantized:
            return tuple(self.values.shape)
        return (*self.values.shape[:-1], self.values.shape[-1] * 32 // self.bits)

    def floats(self) -> np.ndarray:
        """The array as float32 (dequantized as MLX dequantizes)."""
        if self.bfloat16:
            return (np.asarray(self.values, np.uint32) << 16).view(np.float32)
        if not self.quantized:
            return np.asarray(self.values, np.float32)
        shape, columns = self.shape, self.shape[-1]
        rows = int(np.prod(shape[:-1]))
        return dequantize_affine(self.values.reshape(rows, -1), self.scales.reshape(rows, -1),
                                 self.biases.reshape(rows, -1), columns).reshape(shape)

    def rows(self, start: int, stop: int) -> StoredMatrix:
        """Rows ``start:stop`` of every (rows, columns) matrix it holds (axis -2)."""
        def cut(part: np.ndarray | None) -> np.ndarray | None:
            return None if part is None else np.ascontiguousarray(part[..., start:stop, :])

        return StoredMatrix(cut(self.values), self.bfloat16, cut(self.scales), cut(self.biases), self.bits, self.group)

    @staticmethod
    def stack(parts: Sequence[StoredMatrix]) -> StoredMatrix:
        """Matrices stored alike stacked along a new first axis (experts held one by one)."""
        first = parts[0]
        if any((p.quantized, p.bfloat16, p.bits, p.group, p.values.dtype) !=
               (first.quantized, first.bfloat16, first.bits, first.group, first.values.dtype) for p in parts):
            return StoredMatrix(np.stack([part.floats() for part in parts]))

        def stacked(name: str) -> np.ndarray | None:
            return None if getattr(first, name) is None else np.stack([getattr(part, name) for part in parts])

        return StoredMatrix(stacked("values"), first.bfloat16, stacked("scales"), stacked("biases"), first.bits,
                            first.group)


class FolderTensors:
    """The tensors of a folder's safetensors, ``files`` giving the shard that holds each name.
    ``quantization``: the config's ``quantization`` entry (None for a float checkpoint); only
    mlx-lm's affine mode is read."""

    def __init__(self, folder: Path, files: dict[str, Path], quantization: object = None) -> None:
        self.folder, self.files = folder, files
        mode = quantization.get("mode", "affine") if isinstance(quantization, dict) else "affine"
        if mode != "affine":
            raise ModelFileError(f"{folder.name} is quantized as {mode}: specrun reads the MTP layers of float "
                                 f"checkpoints and of mlx-lm's affine quantization only",
                                 "use the model's float checkpoint with --heads, or another method")
        self._opened: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def quantized(self, name: str) -> bool:
        """``name`` (a NAME.weight) is a matrix mlx-lm quantized: its scales and biases lie beside it."""
        return name.endswith(".weight") and f"{name[:-7]}.scales" in self.files and f"{name[:-7]}.biases" in self.files

    def _file(self, name: str):
        from specrun.heads.files import TensorsFile

        path = self.files[name]
        if path not in self._opened:
            self._opened[path] = TensorsFile(path)
        return self._opened[path]

    def _stored_shape(self, name: str) -> tuple[int, ...]:
        entry = self._file(name).tensors.get(name)
        if entry is None:
            raise ModelFileError(f"{self.files[name].name} lacks {name}, which its folder's index places there",
                                 "download the model again")
        return tuple(entry.shape)

    def check(self, name: str, shape: tuple[int, ...], values: bool = False) -> int:
        """Refuse ``name`` as ``read`` would for its header alone (missing, of another shape, or
        quantized into another), reading none of its data; with ``values``, where its values (or
        its scales and biases) are not finite too, holding none of them. The bytes it is stored in."""
        if self.quantized(name):
            parts = self._quantized_parts(name, shape)
            for part in parts[1:] if values else ():  # the scales and biases: any word is a value
                dtype, raw = self._file(part).float_view(part, self._stored_shape(part))
                self._refuse_unfinite(part, raw.reshape(-1), dtype == "BF16")
            return sum(self._file(part).tensors[part].end - self._file(part).tensors[part].start for part in parts)
        entry = self._file(name).tensors.get(name)
        if entry is None or tuple(entry.shape) != tuple(shape) or entry.dtype not in ("F64", "F32", "F16", "BF16"):
            self._file(name).floats(name, shape)  # its one-line refusal
        if values:
            dtype, raw = self._file(name).float_view(name, shape)
            self._refuse_unfinite(name, raw.reshape(-1), dtype == "BF16")
        return entry.end - entry.start

    def _refuse_unfinite(self, name: str, values: np.ndarray, bfloat16: bool) -> None:
        """One line where ``values`` (flat, as stored: bfloat16 as its bits) hold NaN or infinities,
        read a slice at a time (a vocabulary-sized table's mask would be its size again)."""
        step = 1 << 22
        for start in range(0, len(values), step):
            part = values[start : start + step]
            bad = ((part & 0x7F80) == 0x7F80).any() if bfloat16 else not np.isfinite(part).all()
            if bad:
                raise ModelFileError(f"{self.files[name].name} holds NaN or infinite weights in {name}",
                                     "download the model again")

    def first(self, names: tuple[str, ...], shape: tuple[int, ...], required: bool = True) -> np.ndarray | None:
        """The first of ``names`` the folder holds, read as ``read`` reads it; None where it holds
        none and the array is optional, else one line saying the MTP layer lacks it."""
        for name in names:
            if name in self.files:
                return self.read(name, shape)
        if required:
            raise ModelFileError(f"{self.folder.name} says it carries MTP layers but lacks {names[0]}",
                                 "download the model again with its MTP layers, or use another method")
        return None

    def read(self, name: str, shape: tuple[int, ...], half: bool = False) -> np.ndarray:
        """``name`` as a float32 array of ``shape`` (float16 with ``half``: a vocabulary-sized
        table), dequantized where quantized; ModelFileError where it is missing, of another shape
        or quantized in a way that gives another."""
        if self.quantized(name):
            return self._dequantized(name, shape, half)
        stored = self._file(name)
        return stored.halves(name, shape) if half else stored.floats(name, shape)

    def stored(self, name: str, shape: tuple[int, ...]) -> StoredMatrix:
        """``name`` as the folder stores it (for a backend computing with it so), checked as ``read``
        checks it; refused in one line where its values are not finite."""
        if self.quantized(name):
            _, scales_name, biases_name = self._quantized_parts(name, shape)
            packed, grouped = self._stored_shape(name), self._stored_shape(scales_name)
            scales = self._file(scales_name).floats(scales_name, grouped)
            biases = self._file(biases_name).floats(biases_name, grouped)
            bits = packed[-1] * 32 // shape[-1]
            return StoredMatrix(np.array(self._file(name).words(name, packed)), scales=scales, biases=biases,
                                bits=bits, group=shape[-1] // grouped[-1])
        stored = self._file(name)
        dtype, raw = stored.float_view(name, shape)
        if dtype in ("F64", "F32"):
            return StoredMatrix(stored.floats(name, shape))
        matrix = StoredMatrix(np.array(raw), bfloat16=dtype == "BF16")
        self._refuse_unfinite(name, matrix.values.reshape(-1), matrix.bfloat16)  # bfloat16's by its exponent bits
        return matrix

    def _quantized_parts(self, name: str, shape: tuple[int, ...]) -> tuple[str, str, str]:
        """The words, scales and biases of the quantized ``name``, checked to make ``shape``."""
        base, columns = name[:-7], shape[-1]
        packed, grouped = self._stored_shape(name), self._stored_shape(f"{base}.scales")
        lead = tuple(shape[:-1])
        bits = packed[-1] * 32 // columns if columns else 0
        groups = grouped[-1]
        fits = (packed[:-1] == lead and grouped[:-1] == lead and bits in BITS and packed[-1] * 32 == bits * columns
                and groups and columns % groups == 0 and columns // groups in GROUPS
                and self._stored_shape(f"{base}.biases") == grouped)
        if not fits:
            raise ModelFileError(f"{self.folder.name}: {name} is quantized as {list(packed)} words with "
                                 f"{list(grouped)} scales, which do not make {list(shape)}",
                                 "convert the model again, or use another method")
        return name, f"{base}.scales", f"{base}.biases"

    def _dequantized(self, name: str, shape: tuple[int, ...], half: bool) -> np.ndarray:
        _, scales_name, biases_name = self._quantized_parts(name, shape)
        packed, grouped = self._stored_shape(name), self._stored_shape(scales_name)
        rows = int(np.prod(shape[:-1]))
        words = self._file(name).words(name, packed).reshape(rows, packed[-1])
        scales = self._file(scales_name).floats(scales_name, grouped).reshape(rows, grouped[-1])
        biases = self._file(biases_name).floats(biases_name, grouped).reshape(rows, grouped[-1])
        values = dequantize_affine(words, scales, biases, shape[-1], np.float16 if half else np.float32)
        return values.reshape(shape)


@dataclass(frozen=True)
class Deferred:
    """An array read only when first asked for: ``read`` it as float arrays (float32, or float16
    for a vocabulary-sized table), ``nbytes`` what it is stored in, and ``stored`` (where given)
    it as stored, read afresh on each call and never held (StoredMatrix)."""

    read: Callable[[], np.ndarray]
    nbytes: int
    stored: Callable[[], StoredMatrix] | None = None


class DeferredArrays(Mapping):
    """Arrays by name, some ``ready`` and some read only when first asked for (``deferred``: by
    name, a Deferred): a vocabulary-sized table a backend may never read in NumPy
    (MlxBackend.mtp_layer uses the target's own), and a layer's matrices a backend that holds them
    as stored (``stored``: MLX, quantized or in half precision) never reads as NumPy floats."""

    def __init__(self, ready: dict[str, np.ndarray], deferred: dict[str, Deferred]) -> None:
        self._ready, self._deferred = dict(ready), dict(deferred)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._ready:
            self._ready[name] = self._deferred[name].read()  # KeyError for a name it has not
        return self._ready[name]

    def __iter__(self):
        return iter({**self._deferred, **self._ready})

    def __len__(self) -> int:
        return len(set(self._ready) | set(self._deferred))

    def loaded(self, name: str) -> bool:
        return name in self._ready

    def nbytes(self, name: str) -> int:
        """What ``name`` weighs: a deferred array as stored (read or not), an array as held."""
        if name in self._deferred:
            return self._deferred[name].nbytes
        array = self._ready.get(name)
        return 0 if array is None else array.nbytes

    def stored(self, name: str) -> StoredMatrix:
        """``name`` as its file stores it, not held here (an array read already or held ready
        as it is held)."""
        entry = self._deferred.get(name)
        if name in self._ready or entry is None or entry.stored is None:
            return StoredMatrix(self[name])
        return entry.stored()


def deferred_matrix(make: Callable[[], StoredMatrix], nbytes: int) -> Deferred:
    """A matrix the folder holds, ``make`` reading it as stored (and so, dequantized, as floats)."""
    return Deferred(lambda: make().floats(), nbytes, make)


def tables(reader: FolderTensors, candidates: dict[str, tuple[str, ...]], shape: tuple[int, ...],
           reads: dict[str, Callable[[], np.ndarray]] | None = None) -> dict:
    """For DeferredArrays: each of ``candidates`` (an array's name: the tensor names that may hold
    it, in order) as a Deferred read as float16 (held by DeferredArrays) or as stored (not held),
    checked now and read when first asked for; arrays found under the same tensor share one
    float16 read (across calls given the same ``reads``: a model's MTP layers share its tables).
    Absent where none is held."""
    reads = {} if reads is None else reads
    found = {}
    for key, names in candidates.items():
        name = next((name for name in names if name in reader), None)
        if name is None:
            continue
        if name not in reads:
            held: list[np.ndarray] = []

            def read(name=name, held=held) -> np.ndarray:
                if not held:
                    held.append(reader.read(name, shape, half=True))
                return held[0]

            reads[name] = read
        found[key] = Deferred(reads[name], reader.check(name, shape), lambda name=name: reader.stored(name, shape))
    return found
