"""`specrun models convert` on crafted GGUF headers (issue 56): 500 seeded mutations of a tiny
model's header, each converted as the command converts it. Every one either converts or is one
ModelFileError naming the problem; none is an internal error, a hang or a scratch folder left
behind. The crafted cases the issue found by hand are here by name too."""

from __future__ import annotations

import random
import struct
import time

import gguf
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


def rename_key(data: bytes, key: bytes, other: bytes) -> bytes:
    """``data`` with the first ``key`` renamed ``other`` (of the same length)."""
    assert len(key) == len(other)
    return data.replace(key, other, 1)


def u32(value: int) -> bytes:
    return struct.pack("<I", value)


def u64(value: int) -> bytes:
    return struct.pack("<Q", value)


# The crafted files the issue named, each written over the tiny model's header, with what the
# one line must say (the field or tensor at fault).
CRAFTED = {
    "an array count of 2^62": (lambda d: overwrite_after(d, b"tokenizer.ggml.tokens", 8, u64(2**62)),
                               "items in tokenizer.ggml.tokens"),
    "a tensor count of 2^62": (lambda d: d[:8] + u64(2**62) + d[16:], "4611686018427387904 tensors"),
    "a block count of 2^32 - 1": (lambda d: overwrite_after(d, b"llama.block_count", 4, u32(2**32 - 1)),
                                  "llama.block_count is 4294967295"),
    "a block count one short": (lambda d: overwrite_after(d, b"llama.block_count", 4, u32(1)),
                                "blk.1.attn_norm.weight, which its config (1 layers) has no place for"),
    "zero key/value heads": (lambda d: overwrite_after(d, b"llama.attention.head_count_kv", 4, u32(0)),
                             "llama.attention.head_count_kv is 0"),
    "an embedding length of -128": (lambda d: overwrite_after(d, b"llama.embedding_length", 0, u32(5) + u32(2**32 - 128)),
                                    "llama.embedding_length is -128"),
    "a BOS id past the vocabulary": (lambda d: overwrite_after(d, b"tokenizer.ggml.bos_token_id", 4, u32(10**6)),
                                     "tokenizer.ggml.bos_token_id is 1000000"),
    "a padding id past the vocabulary": (lambda d: overwrite_after(d, b"tokenizer.ggml.padding_token_id", 4,
                                                                   u32(512)), "tokenizer.ggml.padding_token_id is 512"),
    "a duplicate key": (lambda d: rename_key(d, b"tokenizer.ggml.bos_token_id", b"tokenizer.ggml.eos_token_id"),
                        "'tokenizer.ggml.eos_token_id' appears twice"),
    "a vocabulary size that lies": (lambda d: overwrite_after(d, b"llama.vocab_size", 4, u32(1000)),
                                    "llama.vocab_size is 1000, but tokenizer.ggml.tokens holds 512"),
    "a string length past the end": (lambda d: overwrite_after(d, b"general.architecture", 4, u64(2**40)),
                                     "claims more bytes than the file holds"),
    "a string of 16 MB": (lambda d: overwrite_after(d, b"general.name", 4, u64(16 << 20)),
                          "claims more bytes than the file holds"),
    "invalid UTF-8 in a token": (lambda d: overwrite_after(d, b"tokenizer.ggml.tokens", 25, b"\xff\xfe"),
                                 "tokenizer.ggml.tokens is not UTF-8"),
    "invalid UTF-8 in the template": (lambda d: overwrite_after(d, b"tokenizer.chat_template", 15, b"\xff\xfe"),
                                      "tokenizer.chat_template is not UTF-8"),
    "a tensor halved": (lambda d: overwrite_after(d, b"blk.0.attn_q.weight", 4, u64(32)), "blk.0.attn_q.weight"),
    "a tensor doubled": (lambda d: overwrite_after(d, b"blk.0.attn_q.weight", 4, u64(256)), "blk.0.attn_q.weight"),
    "a tensor of zero rows": (lambda d: overwrite_after(d, b"blk.0.attn_q.weight", 4, u64(0)),
                              "blk.0.attn_q.weight has the impossible shape [0, 128]"),
    "a tensor's shape swapped": (lambda d: overwrite_after(d, b"blk.0.ffn_up.weight", 4, u64(256) + u64(128)),
                                 "blk.0.ffn_up.weight has shape [256, 128], the config gives it [128, 256]"),
    "a tensor of three dimensions": (lambda d: overwrite_after(d, b"blk.0.ffn_up.weight", 0, u32(3)),
                                     "blk.0.ffn_up.weight"),
    "overlapping tensors": (lambda d: overwrite_after(d, b"blk.0.attn_k.weight", 4 + 16 + 4, u64(263680)),
                            "blk.0.attn_q.weight overlaps the one after it"),
    "a Q4_1 tag on F16 data": (lambda d: overwrite_after(d, b"blk.0.ffn_down.weight", 4 + 16, u32(3)),
                               "blk.0.ffn_down.weight holds 65536 bytes, not the 20480"),
    "a Q4_1 tag on the last tensor's F16 data": (lambda d: overwrite_after(d, b"blk.1.ffn_down.weight", 4 + 16, u32(3)),
                                                 "blk.1.ffn_down.weight holds 65536 bytes, not the 20480"),
    "an unaligned tensor offset": (lambda d: overwrite_after(d, b"blk.1.attn_k.weight", 4 + 16 + 4, u64(7)),
                                   "blk.1.attn_k.weight starts at 7"),
}


@pytest.mark.parametrize("case", CRAFTED)
def test_a_crafted_header_is_one_line_naming_the_field(case, tiny_llama, tmp_path):
    craft, names = CRAFTED[case]
    path = tmp_path / "crafted.gguf"
    path.write_bytes(craft(tiny_llama.gguf_path.read_bytes()))
    line = convert_case(path, tmp_path)
    assert "\n" not in line and line.startswith(str(path)) and names in line, line
    assert line.endswith("; download or convert the file again"), line


def test_an_embedding_length_written_as_text_is_one_line(tiny_llama, tmp_path, monkeypatch):
    """The whole header written again, the embedding length a string field ('128')."""
    from model_factory import tiny_config, tiny_tokenizer_json, random_weights
    from specrun.modelkit.gguf_io import write_gguf

    monkeypatch.setattr(gguf.GGUFWriter, "add_embedding_length",
                        lambda writer, n: writer.add_string(f"{writer.arch}.embedding_length", str(n)))
    config = tiny_config("llama")
    path = write_gguf(tmp_path / "text.gguf", config, random_weights(config, 0), tiny_tokenizer_json(config.vocab_size))
    line = convert_case(path, tmp_path)
    assert line == (f"{path} cannot be converted: llama.embedding_length is '128', not a count from 1 to 65536; "
                    "download or convert the file again")


@pytest.mark.parametrize(("method", "written", "said"), [
    ("add_add_bos_token", lambda writer, value: writer.add_string("tokenizer.ggml.add_bos_token", "yes"),
     "tokenizer.ggml.add_bos_token is 'yes', not true or false"),
    ("add_add_bos_token", lambda writer, value: writer.add_uint32("tokenizer.ggml.add_bos_token", 0),
     "tokenizer.ggml.add_bos_token is 0, not true or false"),
    ("add_chat_template", lambda writer, value: writer.add_uint32("tokenizer.chat_template", 7),
     "tokenizer.chat_template is 7, not a template's text"),
])
def test_a_tokenizer_flag_or_template_of_the_wrong_type_is_one_line(tmp_path, monkeypatch, method, written, said):
    """A string "yes" for add_bos_token was read as true, an integer template copied into
    tokenizer_config.json: each is a damaged field, named, and no folder is written."""
    from model_factory import tiny_config, tiny_tokenizer_json, random_weights
    from specrun.modelkit.gguf_io import write_gguf

    monkeypatch.setattr(gguf.GGUFWriter, method, written)
    config = tiny_config("llama")
    path = write_gguf(tmp_path / "typed.gguf", config, random_weights(config, 0), tiny_tokenizer_json(config.vocab_size),
                      chat_template="{{ messages }}")
    monkeypatch.undo()
    line = convert_case(path, tmp_path)
    assert line == f"{path} cannot be converted: {said}; download or convert the file again", line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["typed.gguf"]


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
