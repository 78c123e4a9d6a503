"""GGUF metadata read key by key from the header, and a copy with one more key, without GGUFReader.

gguf.GGUFReader maps every field before answering: ~15 s for Gemma 3's 262,144-token vocabulary
(a numpy view per string), on every `--ctx` check, every refused conversion and every copy.
Architecture keys come before the tokenizer's arrays in the files llama.cpp's converters and
GGUFWriter write, so a reader that walks the keys in order answers those at once; a copy with
one more key moves the header's bytes as they are and the tensor data byte for byte.
"""

from __future__ import annotations

import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import gguf

_T = gguf.GGUFValueType
_SCALARS = {
    _T.UINT8: "<B", _T.INT8: "<b", _T.UINT16: "<H", _T.INT16: "<h", _T.UINT32: "<I", _T.INT32: "<i",
    _T.UINT64: "<Q", _T.INT64: "<q", _T.FLOAT32: "<f", _T.FLOAT64: "<d", _T.BOOL: "<?",
}
MAX_STRING = 1 << 24  # longer than any key or scalar string a sane header holds (chat templates included)


def header_values(path: Path) -> Iterator[tuple[str, object]]:
    """(key, value) for each metadata key of a little-endian GGUF v2/v3, in file order; arrays are
    skipped and yield None. Raises ValueError on a header that does not parse."""
    with Path(path).open("rb") as handle:
        _, _, _, n_keys = _header(handle)
        yield from _keys(handle, n_keys)


def copy_with_string_key(source: Path, dest: Path, key: str, value: str) -> None:
    """Write ``dest``: ``source`` with the string ``key`` added (``source`` must not have it); the
    other keys, the tensor infos and the tensor data are copied as they are, the data realigned."""
    with Path(source).open("rb") as handle:
        magic, version, n_tensors, n_keys = _header(handle)
        alignment = 32  # GGUF's default, unless general.alignment says otherwise
        for name, found in _keys(handle, n_keys):
            if name == key:
                raise ValueError(f"{source} already has {key}")
            if name == gguf.Keys.General.ALIGNMENT:
                alignment = int(found)
        keys_end = handle.tell()
        for _ in range(n_tensors):  # name, dimensions, type, offset into the data
            _string(handle)
            (n_dims,) = struct.unpack("<I", _read(handle, 4))
            handle.seek(8 * n_dims + 4 + 8, 1)
        infos_end = handle.tell()
        handle.seek(0)
        head = _read(handle, infos_end)
        with Path(dest).open("wb") as out:
            out.write(struct.pack("<4sIQQ", magic, version, n_tensors, n_keys + 1))
            out.write(head[24:keys_end])
            key_bytes, value_bytes = key.encode("utf-8"), value.encode("utf-8")
            out.write(struct.pack("<Q", len(key_bytes)) + key_bytes)
            out.write(struct.pack("<IQ", _T.STRING, len(value_bytes)) + value_bytes)
            out.write(head[keys_end:])
            out.write(bytes(-out.tell() % alignment))
            handle.seek(infos_end + (-infos_end % alignment))
            shutil.copyfileobj(handle, out, 1 << 20)


def _header(handle) -> tuple[bytes, int, int, int]:
    """(magic, version, tensor count, key count), checked."""
    magic, version, n_tensors, n_keys = struct.unpack("<4sIQQ", _read(handle, 24))
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"not a little-endian GGUF v2/v3 header ({magic!r}, version {version})")
    return magic, version, n_tensors, n_keys


def _keys(handle, n_keys: int) -> Iterator[tuple[str, object]]:
    for _ in range(n_keys):
        key = _string(handle)
        (kind,) = struct.unpack("<I", _read(handle, 4))
        if kind == _T.ARRAY:
            item_kind, count = struct.unpack("<IQ", _read(handle, 12))
            _skip_array(handle, item_kind, count)
            yield key, None
        else:
            yield key, _value(handle, kind)


def _read(handle, n: int) -> bytes:
    data = handle.read(n)
    if len(data) != n:
        raise ValueError("the GGUF header ends early")
    return data


def _string(handle) -> str:
    (length,) = struct.unpack("<Q", _read(handle, 8))
    if length > MAX_STRING:
        raise ValueError(f"a GGUF header string of {length} bytes")
    return _read(handle, length).decode("utf-8", "replace")


def _value(handle, kind: int) -> object:
    if kind == _T.STRING:
        return _string(handle)
    if kind not in _SCALARS:
        raise ValueError(f"unknown GGUF value type {kind}")
    fmt = _SCALARS[kind]
    return struct.unpack(fmt, _read(handle, struct.calcsize(fmt)))[0]


def _skip_array(handle, item_kind: int, count: int) -> None:
    if item_kind == _T.STRING:
        for _ in range(count):
            (length,) = struct.unpack("<Q", _read(handle, 8))
            handle.seek(length, 1)
    elif item_kind in _SCALARS:
        handle.seek(count * struct.calcsize(_SCALARS[item_kind]), 1)
    else:
        raise ValueError(f"a GGUF array of value type {item_kind}")
