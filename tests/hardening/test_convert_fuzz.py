"""`specrun models convert` on crafted GGUF headers (issue 56): 500 seeded mutations of a tiny
model's header, each converted as the command converts it. Every one either converts or is one
ModelFileError naming the problem; none is an internal error, a hang or a scratch folder left
behind. The crafted cases the issue found by hand are here by name too."""

from __future__ import annotations

import random
import struct
import time

import pytest

from specrun.errors import ModelFileError
from specrun.modelkit.demo import derive_once
from specrun.modelkit.gguf_check import read_layout
from specrun.modelkit.gguf_convert import convert_gguf_to_mlx

CASES = 500
SEED = 56
MAX_CASE_SECONDS = 10.0
LOADED_CONVERSIONS = 20  # of the cases that convert (about 1 in 12), the first 20 are loaded by mlx-lm


def header_end(path) -> int:
    """Where the tensor data starts: the file less its data section."""
    _, infos = read_layout(path)
    return path.stat().st_size - max(info.offset + info.nbytes for info in infos)


def overwrite_after(data: bytes, name: bytes, skip: int, value: bytes) -> bytes:
    """``data`` with ``value`` written ``skip`` bytes after the first ``name`` (a key or a tensor's name)."""
    at = data.index(name) + len(name) + skip
    return data[:at] + value + data[at + len(value):]


# The crafted files the issue named, each written over the tiny model's header
CRAFTED = {
    "an array count of 2^62": lambda d: overwrite_after(d, b"tokenizer.ggml.tokens", 8, struct.pack("<Q", 2**62)),
    "a block count of 2^32 - 1": lambda d: overwrite_after(d, b"llama.block_count", 4, struct.pack("<I", 2**32 - 1)),
    "zero key/value heads": lambda d: overwrite_after(d, b"llama.attention.head_count_kv", 4, struct.pack("<I", 0)),
    "a BOS id past the vocabulary": lambda d: overwrite_after(d, b"tokenizer.ggml.bos_token_id", 4,
                                                              struct.pack("<I", 10**6)),
    "a string length past the end": lambda d: overwrite_after(d, b"general.architecture", 4, struct.pack("<Q", 2**40)),
    "invalid UTF-8 in a token": lambda d: overwrite_after(d, b"tokenizer.ggml.tokens", 20, b"\xff\xfe"),
    "a tensor halved": lambda d: overwrite_after(d, b"blk.0.attn_q.weight", 4, struct.pack("<Q", 32)),
    "a tensor of three dimensions": lambda d: overwrite_after(d, b"blk.0.ffn_up.weight", 0, struct.pack("<I", 3)),
    "a Q4_1 tag on F16 data": lambda d: overwrite_after(d, b"blk.0.ffn_down.weight", 4 + 16, struct.pack("<I", 3)),
    "an unaligned tensor offset": lambda d: overwrite_after(d, b"blk.1.attn_k.weight", 4 + 16 + 4,
                                                            struct.pack("<Q", 7)),
}


@pytest.mark.parametrize("case", CRAFTED)
def test_a_crafted_header_is_one_line(case, tiny_llama, tmp_path):
    path = tmp_path / "crafted.gguf"
    path.write_bytes(CRAFTED[case](tiny_llama.gguf_path.read_bytes()))
    line = convert_case(path, tmp_path)
    assert line != "converted" and "\n" not in line and str(path) in line, line


def mutate(data: bytes, end: int, rng: random.Random) -> bytes:
    """One of: bytes flipped in the header, a count or length overwritten with an absurd number,
    the file cut short."""
    out = bytearray(data)
    kind = rng.randrange(3)
    if kind == 0:
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(8, end)] = rng.randrange(256)
    elif kind == 1:
        at = rng.randrange(8, end - 8)
        value = rng.choice([2**62, 2**32 - 1, 2**63 - 1, 0, 1 << 24, rng.randrange(1 << 16)])
        out[at:at + 8] = struct.pack("<Q", value)
    else:
        del out[rng.randrange(24, len(out)):]
    return bytes(out)


def convert_case(path, tmp_path) -> str:
    """What the command does with ``path``: 'converted' or the ModelFileError's line; a scratch
    folder left behind is a failure."""
    out = tmp_path / f"{path.stem}-mlx"
    try:
        derive_once(out, lambda scratch: convert_gguf_to_mlx(path, scratch))
        return "converted"
    except ModelFileError as exc:
        assert not out.exists()
        return exc.one_line()
    finally:
        assert not list(tmp_path.glob(".deriving-*")), "a scratch folder was left behind"


def test_500_mutated_headers_convert_or_are_one_line(tiny_llama, tmp_path):
    source = tiny_llama.gguf_path
    data = source.read_bytes()
    end = header_end(source)
    rng = random.Random(SEED)
    outcomes = {"converted": 0, "refused": 0}
    for case in range(CASES):
        path = tmp_path / f"case{case}.gguf"
        path.write_bytes(mutate(data, end, rng))
        started = time.monotonic()
        try:
            line = convert_case(path, tmp_path)
        except Exception as exc:  # noqa: BLE001 - what the test is looking for
            pytest.fail(f"case {case}: {type(exc).__name__}: {exc}")
        assert time.monotonic() - started < MAX_CASE_SECONDS, f"case {case} took too long"
        outcomes["converted" if line == "converted" else "refused"] += 1
        if line != "converted":
            assert "\n" not in line and str(path) in line, line
        elif outcomes["converted"] <= LOADED_CONVERSIONS:  # what converts is a folder mlx-lm loads
            loaded = pytest.importorskip("mlx_lm").load(str(tmp_path / f"{path.stem}-mlx"))
            assert loaded[0] is not None
        path.unlink()
    assert outcomes["refused"] >= CASES // 3, outcomes  # the mutations reach what is checked
