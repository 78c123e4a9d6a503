"""A GGUF file checked whole before `models convert` reads it: every count, length and offset
against the file's size, every metadata field the conversion uses against its type and range,
every tensor against the shape and type the model's config gives it.

gguf.GGUFReader trusts the header: an array count of 2^62 hung it, a block count of 2^32 - 1 was a
MemoryError, a string length past the end or invalid UTF-8 an IndexError or UnicodeDecodeError;
and tensors that disagree with the config (swapped, halved, of another type than their tag)
converted with exit 0 into a folder mlx-lm refused or that computed garbage. ``read_layout`` walks
the header itself, bounded by the file; ``check_fields`` and ``check_tensors`` check what it read;
each raises one ValueError naming the first problem.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf

from .config import ModelConfig, weight_shapes
from .gguf_header import _SCALARS, _T
from .gguf_io import gguf_tensor_name

MAX_DIMS = 4  # GGML_MAX_DIMS
# The tensor types gguf.quants.dequantize reads (its table of block formats, plus the plain floats)
READABLE_TYPES = frozenset(getattr(gguf.quants, "_type_traits", {})) | {
    gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
# Bounds a convertible llama-family model stays far inside; past them a field is damaged or forged.
LIMITS = {"embedding_length": 1 << 16, "feed_forward_length": 1 << 20, "block_count": 1024, "head_count": 1024,
          "head_count_kv": 1024, "context_length": 1 << 24}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    kind: int
    offset: int  # into the data section

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(self.kind)]
        return math.prod(self.shape) // block * size


def read_layout(path: Path, tensors: bool = True) -> tuple[dict[str, object], list[TensorInfo]]:
    """Every metadata key's value (arrays as lists) and every tensor's info, each count, length
    and offset checked against the file; ValueError naming the first that does not fit.
    ``tensors`` False: the metadata alone (no tensor list: types this gguf-py does not know pass)."""
    data = Path(path).read_bytes() if Path(path).stat().st_size < (1 << 26) else None
    with Path(path).open("rb") as handle:
        reader = _Bounded(handle, Path(path).stat().st_size, data)
        magic, version, n_tensors, n_keys = struct.unpack("<4sIQQ", reader.read(24))
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"not a little-endian GGUF v2/v3 header (version {version})")
        reader.fits(n_keys, 13, "metadata keys")  # a key holds at least its length, a byte and its type
        fields: dict[str, object] = {}
        for _ in range(n_keys):
            key = reader.string("a metadata key")
            if key in fields:
                raise ValueError(f"the metadata key {key!r} appears twice")
            fields[key] = reader.value(struct.unpack("<I", reader.read(4))[0], key)
        reader.fits(n_tensors, 33, "tensors")
        if not tensors:
            return fields, []  # name length, a byte of name, dims, one dim, type, offset
        infos = [_tensor_info(reader) for _ in range(n_tensors)]
        alignment = fields.get(gguf.Keys.General.ALIGNMENT, 32)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or not 1 <= alignment <= 1 << 16 \
                or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        data_start = reader.position + (-reader.position % alignment)
        _check_offsets(infos, alignment, reader.size - data_start)
    return fields, infos


def check_fields(fields: dict, arch: str) -> None:
    """The fields ``read_config`` reads hold numbers in range, the vocabulary's lists agree and the
    special ids lie inside it; ValueError naming the first problem."""
    for name, limit in LIMITS.items():
        key = f"{arch}.{name}" if not name.startswith("head") else f"{arch}.attention.{name}"
        value = fields.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit):
            raise ValueError(f"{key} is {value!r}, not a count from 1 to {limit}")
    for key, default in ((f"{arch}.attention.layer_norm_rms_epsilon", None), (f"{arch}.rope.freq_base", 1e4)):
        value = fields.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not 0 < value < 1e12:
            raise ValueError(f"{key} is {value!r}, not a positive number")
    keys = gguf.Keys.Tokenizer
    tokens, types = fields.get(keys.LIST), fields.get(keys.TOKEN_TYPE)
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{keys.LIST} is not a list of token strings")
    declared = fields.get(f"{arch}.vocab_size", len(tokens))
    if isinstance(declared, bool) or declared != len(tokens):
        raise ValueError(f"{arch}.vocab_size is {declared!r}, but {keys.LIST} holds {len(tokens)} tokens")
    if not isinstance(types, list) or len(types) != len(tokens) or not all(isinstance(t, int) for t in types):
        raise ValueError(f"{keys.TOKEN_TYPE} does not give one type for each of the {len(tokens)} tokens")
    merges = fields.get(keys.MERGES, [])
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise ValueError(f"{keys.MERGES} is not a list of strings")
    known = set(tokens)
    for number, merge in enumerate(merges):  # a BPE merge joins two tokens into a third
        parts = merge.split(" ")
        if len(parts) != 2 or parts[0] not in known or parts[1] not in known or parts[0] + parts[1] not in known:
            raise ValueError(f"merge {number} ({merge[:40]!r}) does not join two of the vocabulary's tokens into a third")
    for key in (keys.BOS_ID, keys.EOS_ID, keys.EOT_ID, keys.EOM_ID, keys.PAD_ID, keys.UNK_ID):
        value = fields.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(tokens)):
            raise ValueError(f"{key} is {value!r}, not one of the {len(tokens)} token ids")
    for key in (keys.ADD_BOS, keys.ADD_EOS):  # a string "yes" read as true, an integer 0 as false
        value = fields.get(key)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{key} is {value!r}, not true or false")
    template = fields.get(keys.CHAT_TEMPLATE)  # an integer was copied into tokenizer_config.json
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{keys.CHAT_TEMPLATE} is {template!r}, not a template's text")


def check_tensors(infos: list[TensorInfo], config: ModelConfig) -> None:
    """Every tensor ``config`` names is there, with its shape and a type the conversion reads, and
    no other (layers past the block count would be dropped unseen, as llama.cpp refuses them)."""
    by_name = {info.name: info for info in infos}
    expected = {gguf_tensor_name(hf_name) for hf_name in weight_shapes(config)}
    extra = next((info.name for info in infos if info.name not in expected), None)
    if extra is not None:
        raise ValueError(f"it holds the tensor {extra}, which its config ({config.num_layers} layers) has no place for")
    readable = READABLE_TYPES
    for hf_name, hf_shape in weight_shapes(config).items():
        info = by_name.get(gguf_tensor_name(hf_name))
        if info is None:
            raise ValueError(f"it lacks the tensor {gguf_tensor_name(hf_name)}")
        if info.shape != tuple(reversed(hf_shape)):
            raise ValueError(f"the tensor {info.name} has shape {list(info.shape)}, "
                             f"the config gives it {list(reversed(hf_shape))}")
        if gguf.GGMLQuantizationType(info.kind) not in readable:
            raise ValueError(f"the tensor {info.name} is of type {gguf.GGMLQuantizationType(info.kind).name}, "
                             "which the conversion cannot read")


def _tensor_info(reader: _Bounded) -> TensorInfo:
    name = reader.string("a tensor name")
    (n_dims,) = struct.unpack("<I", reader.read(4))
    if not 1 <= n_dims <= MAX_DIMS:
        raise ValueError(f"the tensor {name} has {n_dims} dimensions")
    shape = struct.unpack(f"<{n_dims}Q", reader.read(8 * n_dims))
    kind, offset = struct.unpack("<IQ", reader.read(12))
    try:
        block, _ = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise ValueError(f"the tensor {name} has the unknown type {kind}") from None
    if any(n < 1 for n in shape) or math.prod(shape) > reader.size * block or shape[0] % block:
        raise ValueError(f"the tensor {name} has the impossible shape {list(shape)} for its type")
    return TensorInfo(name, tuple(shape), kind, offset)


def _check_offsets(infos: list[TensorInfo], alignment: int, data_size: int) -> None:
    """Tensors in the data section one after another, each filling the room to the next (padding
    aside): a type tag that does not fit its data (Q4_1 on F16 bytes) leaves a gap or overruns."""
    unaligned = next((info for info in infos if info.offset % alignment), None)
    if unaligned is not None:  # named before the overlap it also makes
        raise ValueError(f"the tensor {unaligned.name} starts at {unaligned.offset}, not a multiple of {alignment}")
    ordered = sorted(infos, key=lambda info: info.offset)
    for info, following in zip(ordered, [*ordered[1:], None]):
        end = info.offset + info.nbytes
        room = (following.offset if following is not None else data_size) - info.offset
        if end > data_size:
            raise ValueError(f"the tensor {info.name} runs past the end of the file")
        if info.nbytes > room:
            raise ValueError(f"the tensor {info.name} overlaps the one after it")
        if room - info.nbytes >= alignment:  # the last one too: writers pad the file only to the alignment
            raise ValueError(f"the tensor {info.name} holds {room} bytes, not the {info.nbytes} its type and "
                             "shape take")


class _Bounded:
    """Reads of a header that never go past the file: a length or count that would is an error."""

    def __init__(self, handle, size: int, data: bytes | None) -> None:
        self.handle, self.size, self.data, self.position = handle, size, data, 0

    def read(self, n: int) -> bytes:
        if n > self.size - self.position:
            raise ValueError("the header claims more bytes than the file holds")
        if self.data is not None:
            chunk = self.data[self.position:self.position + n]
        else:
            chunk = self.handle.read(n)
        self.position += n
        return chunk

    def fits(self, count: int, least_bytes: int, what: str) -> None:
        if count * least_bytes > self.size - self.position:
            raise ValueError(f"the header claims {count} {what}, more than the file holds")

    def string(self, what: str) -> str:
        (length,) = struct.unpack("<Q", self.read(8))
        raw = self.read(length)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{what} is not UTF-8 text") from None

    def value(self, kind: int, key: str) -> object:
        if kind == _T.STRING:
            return self.string(f"the value of {key}")
        if kind == _T.ARRAY:
            item_kind, count = struct.unpack("<IQ", self.read(12))
            least = 8 if item_kind == _T.STRING else struct.calcsize(_SCALARS.get(item_kind, "<B"))
            self.fits(count, least, f"items in {key}")
            if item_kind == _T.ARRAY:
                raise ValueError(f"{key} is an array of arrays")
            return [self.value(item_kind, key) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"{key} has the unknown value type {kind}")
        fmt = _SCALARS[kind]
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]
