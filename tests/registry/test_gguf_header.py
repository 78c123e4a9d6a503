"""The header reader answers what gguf.GGUFReader answers, key by key, without mapping the vocabulary."""

from __future__ import annotations

import gguf
import pytest

from specrun.modelkit.gguf_header import header_values


def test_every_key_reads_as_gguf_reader_reads_it(random_model):
    reader = gguf.GGUFReader(str(random_model.gguf_path))
    expected = {name: (None if field.types[0] == gguf.GGUFValueType.ARRAY else field.contents())
                for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    read = dict(header_values(random_model.gguf_path))
    assert read.keys() == expected.keys()
    for key, value in expected.items():
        assert read[key] == pytest.approx(value) if isinstance(value, float) else read[key] == value, key
    assert read["general.architecture"] == random_model.config.arch


def test_a_file_that_is_not_gguf_raises_value_error(tmp_path):
    path = tmp_path / "not.gguf"
    path.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not a little-endian GGUF"):
        list(header_values(path))
    path.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="ends early"):
        list(header_values(path))
