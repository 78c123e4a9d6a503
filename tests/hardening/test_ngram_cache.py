"""Issue 32, items 1 and 2: an n-gram cache file is untrusted input.

Token ids are checked against the target's vocabulary, counts and nesting are bounded,
and only regular files of a bounded size are read; a refused file is never written back.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from cli_checks import assert_one_line_error, invoke, ngram_cache_bytes
from specrun.backends.fake import FakeBackend
from specrun.drafters import ngram
from specrun.drafters.ngram import NgramCacheError, NgramPoolDrafter, vocabulary_fingerprint

VOCAB_SIZE = 32


@pytest.fixture(scope="module")
def fingerprint() -> str:
    backend = FakeBackend(lambda context: np.zeros(VOCAB_SIZE, np.float32), VOCAB_SIZE)
    return vocabulary_fingerprint(backend)


def load_contexts(tmp_path, fingerprint, contexts) -> NgramPoolDrafter:
    path = tmp_path / "crafted.ngram"
    path.write_bytes(ngram_cache_bytes({"max_order": 3, "vocabulary": fingerprint, "contexts": contexts}))
    return NgramPoolDrafter.open(path, vocabulary=fingerprint)


def test_ids_inside_the_vocabulary_load(tmp_path, fingerprint):
    pool = load_contexts(tmp_path, fingerprint, [[[3], [VOCAB_SIZE - 1, 5]], [[VOCAB_SIZE - 1, 3], [4, 1]]])
    assert pool.followers([3]) == {VOCAB_SIZE - 1: 5}
    assert pool.followers([VOCAB_SIZE - 1, 3]) == {4: 1}


@pytest.mark.parametrize("bad_id", [VOCAB_SIZE, 100_000, 10**9, 2**31, 2**63])
@pytest.mark.parametrize("where", ["context", "follower"])
def test_ids_outside_the_vocabulary_are_refused(tmp_path, fingerprint, bad_id, where):
    entry = [[1, bad_id], [2, 3]] if where == "context" else [[1, 2], [bad_id, 3]]
    with pytest.raises(NgramCacheError, match=f"token id {bad_id}") as caught:
        load_contexts(tmp_path, fingerprint, [entry])
    assert str(tmp_path / "crafted.ngram") in caught.value.one_line()
    assert caught.value.fix


@pytest.mark.parametrize(
    "payload, reason",
    [
        (b'{"vocabulary": "%s", "contexts": [[[1], [2, 1%s]]]}', "count"),  # a count of 10^400
        (b'{"vocabulary": "%s", "contexts": %s}', "nested"),  # JSON nested 200,000 deep
    ],
    ids=["huge count", "deep nesting"],
)
def test_overflowing_numbers_and_deep_nesting_are_refused(tmp_path, fingerprint, payload, reason):
    filler = b"0" * 400 if reason == "count" else b"[" * 200_000 + b"]" * 200_000
    path = tmp_path / "crafted.ngram"
    path.write_bytes(ngram_cache_bytes(payload % (fingerprint.encode(), filler)))
    with pytest.raises(NgramCacheError, match="corrupt") as caught:
        NgramPoolDrafter.open(path, vocabulary=fingerprint)
    assert str(path) in caught.value.one_line()


def test_files_of_an_older_fingerprint_still_load(tmp_path, fingerprint):
    """Caches written before the fingerprint named the vocabulary's size stay usable."""
    legacy = fingerprint.rsplit(":", 1)[-1]
    pool = load_contexts(tmp_path, legacy, [[[3], [4, 2]]])
    assert pool.followers([3]) == {4: 2}


def open_in_thread(path, fingerprint) -> list:
    """NgramPoolDrafter.open on a thread, so a read that would block fails the test instead of hanging it."""
    outcome: list = []

    def attempt():
        try:
            NgramPoolDrafter.open(path, vocabulary=fingerprint)
            outcome.append(None)
        except NgramCacheError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), f"opening {path} blocked"
    return outcome


@pytest.mark.parametrize("special", ["/dev/full", "/dev/zero", "fifo"])
def test_devices_and_fifos_are_refused_without_reading(tmp_path, fingerprint, special):
    if special == "fifo":
        special = tmp_path / "cache.fifo"
        os.mkfifo(special)
    elif not os.path.exists(special):
        pytest.skip(f"{special} does not exist here")
    outcome = open_in_thread(special, fingerprint)
    assert isinstance(outcome[0], NgramCacheError), outcome
    assert "not a regular file" in outcome[0].one_line()
    assert str(special) in outcome[0].one_line()


def test_oversized_files_are_refused(tmp_path, fingerprint, monkeypatch):
    path = tmp_path / "big.ngram"
    path.write_bytes(ngram_cache_bytes({"vocabulary": fingerprint, "contexts": [[[1], [2, 1]]] * 1000}))
    monkeypatch.setattr(ngram, "MAX_CACHE_BYTES", 4096)
    with pytest.raises(NgramCacheError, match="more than the 4096") as caught:
        NgramPoolDrafter.open(path, vocabulary=fingerprint)
    assert str(path) in caught.value.one_line()


@pytest.fixture(scope="module")
def llama_pair(tiny_llama):
    pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")
    return ["-t", str(tiny_llama.gguf_path), "-d", str(tiny_llama.gguf_path), "--backend", "llama"]


def test_poisoned_cache_is_refused_and_never_written_back(llama_pair, tmp_path):
    """The issue's crafted file: a valid checksum and vocabulary, one id far past the vocabulary."""
    cache = tmp_path / "pool.ngram"
    first = invoke("generate", "def f():\n    return 1\n" * 3, *llama_pair, "-n", "8", "-m", "ngram",
                   "--ngram-cache", str(cache))
    assert first.exit_code == 0, first.output
    import json

    stored = json.loads(cache.read_bytes()[ngram.HEADER.size :])
    stored["contexts"].append([[1, 2], [100_000, 3]])
    cache.write_bytes(ngram_cache_bytes(stored))
    poisoned = cache.read_bytes()
    result = invoke("generate", "def f():\n", *llama_pair, "-n", "8", "-m", "ngram", "--ngram-cache", str(cache))
    assert_one_line_error(result.exit_code, result.stderr, 1, str(cache), "token id 100000")
    assert result.stdout == ""
    assert cache.read_bytes() == poisoned  # not rewritten


def test_an_unwritable_cache_is_refused_before_generating(tmp_path):
    """Item 6: the folder is checked when the pool is opened, not when it is saved after the run
    (which lost a --json answer). A regular file as the parent folder fails even for root."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    cache = blocker / "pool.ngram"
    with pytest.raises(NgramCacheError, match="cannot write the n-gram cache") as caught:
        NgramPoolDrafter.open(cache, vocabulary="v")
    assert str(cache) in caught.value.one_line() and caught.value.fix


def test_generate_json_with_an_unwritable_cache_fails_in_one_line(llama_pair, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    cache = blocker / "pool.ngram"
    result = invoke("generate", "def f():\n", *llama_pair, "-n", "8", "-m", "ngram", "--json", "--ngram-cache", str(cache))
    assert_one_line_error(result.exit_code, result.stderr, 1, str(cache), "--ngram-cache")
    assert result.stdout == ""


def test_a_damaged_header_is_told_from_a_file_cut_short(tmp_path, fingerprint):
    """A length field past anything a cache could hold is a damaged header, not a truncated file
    ("476 of 18446744073709551615 payload bytes" was shown); a file really cut short still says so."""
    whole = ngram_cache_bytes({"max_order": 3, "vocabulary": fingerprint, "contexts": [[[3], [4, 5]]]})
    path = tmp_path / "crafted.ngram"
    damaged = bytearray(whole)
    length_at = ngram.HEADER.size - 32 - 8  # the header ends with the payload's length, then its sha256
    damaged[length_at : length_at + 8] = b"\xff" * 8
    path.write_bytes(bytes(damaged))
    with pytest.raises(NgramCacheError, match="its header claims 18,446,744,073,709,551,615 payload bytes"):
        NgramPoolDrafter.open(path, vocabulary=fingerprint)
    path.write_bytes(whole[:-5])
    with pytest.raises(NgramCacheError, match="truncated"):
        NgramPoolDrafter.open(path, vocabulary=fingerprint)
