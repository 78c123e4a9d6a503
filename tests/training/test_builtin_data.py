"""The built-in requests `heads train` and `distill` have an instruct target continue: many, unique,
of every kind, and none from the parts of the standard library the benchmarks hold out."""

from __future__ import annotations

import sysconfig

import pytest

from specrun.training import data

PROSE = "This paragraph explains what the helper does, why it exists and what its callers must know. " * 3


@pytest.fixture
def fake_stdlib(tmp_path, monkeypatch):
    """A standard library of three modules: one kept, one in idlelib/, one in test/ (what is read of
    it is cached a process: cleared before and after)."""
    def module(folder, word):
        folder.mkdir(parents=True, exist_ok=True)
        body = "\n".join(f"    x_{k} = {k}" for k in range(5))
        (folder / f"{word}.py").write_text(
            f'"""{word.upper()} {PROSE}"""\n\n\ndef {word}_function():\n    """{word} helper."""\n{body}\n    return x_0\n'
        )

    module(tmp_path / "email", "kept")
    module(tmp_path / "idlelib", "idle")
    module(tmp_path / "test", "tested")
    module(tmp_path / "lib2to3" / "tests", "tested")  # a package's own tests too
    (tmp_path / "broken.py").write_text("def (:\n")  # a file Python cannot parse is passed over
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    data._stdlib_passages_and_functions.cache_clear()
    yield
    data._stdlib_passages_and_functions.cache_clear()


def test_requests_are_unique_until_they_run_out_and_the_order_follows_the_seed(fake_stdlib):
    unique = len(set(data.builtin_questions(10_000, seed=3)))
    assert unique > len(data.TOPICS) * len(data.QUESTION_FORMS) + 2 + len(data.ARITHMETIC_FORMS) * 39
    first = data.builtin_questions(unique, seed=3)
    assert len(set(first)) == unique  # every request once before any repeats
    assert data.builtin_questions(unique, seed=3) == first
    assert data.builtin_questions(unique, seed=4) != first
    assert sorted(data.builtin_questions(unique, seed=4)) == sorted(first)  # the same requests, reordered
    more = data.builtin_questions(unique + 5, seed=3)
    assert len(set(more)) == unique and more[:unique] == first


def test_every_kind_of_request_is_asked_and_held_out_modules_are_not_read(fake_stdlib):
    requests = set(data.builtin_questions(10_000, seed=0))
    passages = [r for r in requests if PROSE.strip() in r]
    functions = [r for r in requests if "```python" in r and "_function" in r]
    assert len(passages) == 1 and "KEPT" in passages[0]
    assert passages[0].split("\n\n", 1)[0] in {form.split("\n\n")[0] for form in data.PASSAGE_FORMS}
    assert len(functions) == 1 and "def kept_function" in functions[0]
    assert not any("IDLE" in r or "idle_function" in r or "TESTED" in r or "tested_function" in r for r in requests)
    assert any("Solve for x" in r for r in requests) and any("photosynthesis" in r for r in requests)


def test_the_sums_have_whole_answers_and_classes_hold_their_absent(fake_stdlib):
    import re

    requests = data.builtin_questions(10_000, seed=0)
    equations = [re.search(r"Solve for x: (\d+)x \+ (\d+) = (\d+)", r) for r in requests]
    solved = [tuple(map(int, m.groups())) for m in equations if m]
    assert solved and all((c - b) % a == 0 for a, b, c in solved)
    classes = [re.search(r"A class has (\d+) students and (\d+) of them", r) for r in requests]
    assert all(int(m[2]) < int(m[1]) for m in classes if m) and any(classes)


def test_the_real_standard_library_gives_thousands_of_requests():
    requests = data.builtin_questions(20_000, seed=0)
    unique = set(requests)
    assert len(unique) > 3000  # was 400 questions, repeated: a greedy target added no data past them
    passages, functions = data._stdlib_passages_and_functions()
    assert all(data.PASSAGE_CHARS[0] <= len(p) <= data.PASSAGE_CHARS[1] for p in passages)
    assert all(data.CODE_LINES[0] <= f.count("\n") <= data.CODE_LINES[1] for f in functions)


@pytest.mark.parametrize("chars", [1, 3, 16, 256])
def test_text_is_cut_into_pieces_that_join_back_to_it(chars):
    """Runs of whole lines, a longer line cut after a space in its second half (else anywhere): every
    piece within ``chars`` and the pieces the text again, a line of a megabyte among them (it was
    cut by copying its rest for each piece: a 16 MB line took 39 s)."""
    import random

    from specrun.training.data import text_pieces

    rng = random.Random(chars)
    texts = ["", "a\n", "one line\nand another\n", "word " * 200_000 + "\nend",
             "".join(rng.choice("ab \n") for _ in range(5000)), "x" * 1000]
    for text in texts:
        pieces = text_pieces(text, chars)
        assert "".join(pieces) == text and all(0 < len(piece) <= chars for piece in pieces)
    long = text_pieces("word " * 1000, 256)
    assert all(piece.endswith(" ") for piece in long)  # cut after a space, never inside a word
    assert text_pieces("line one\nline two\n", 256) == ["line one\nline two\n"]  # whole lines stay together
