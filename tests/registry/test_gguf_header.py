"""The header reader answers what gguf.GGUFReader answers, key by key, without mapping the vocabulary."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from specrun.modelkit.gguf_header import copy_with_string_key, header_values


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


def test_a_copy_with_one_more_key_keeps_every_key_and_tensor(tiny_llama, tmp_path):
    source, dest = tiny_llama.gguf_path, tmp_path / "with-key.gguf"
    copy_with_string_key(source, dest, "specrun.note", "héllo\n{{ template }}")
    before, after = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(dest))
    added = {name: field for name, field in after.fields.items() if name not in before.fields}
    assert list(added) == ["specrun.note"] and added["specrun.note"].contents() == "héllo\n{{ template }}"
    for name, field in before.fields.items():
        if not name.startswith("GGUF."):
            assert after.fields[name].contents() == field.contents(), name
    assert [t.name for t in after.tensors] == [t.name for t in before.tensors]
    for old, new in zip(before.tensors, after.tensors):
        assert new.tensor_type == old.tensor_type and np.array_equal(new.data, old.data), old.name
    with pytest.raises(ValueError, match="already has"):
        copy_with_string_key(dest, tmp_path / "twice.gguf", "specrun.note", "again")
