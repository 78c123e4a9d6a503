"""Draft-free drafters: prompt lookup, the n-gram pool, chains, and methods built from them."""

from __future__ import annotations

import hashlib
import itertools
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from fake_models import REPEATING_PROMPT, copying_logits, hashed_logits, noisy_copy
from heads_factory import fitted_heads_for, random_eagle, random_heads, random_hydra, random_mtp
from lossless_harness import assert_few_prompts_diverge, greedy_divergences
from specrun.backends.base import Backend
from specrun.backends.fake import FakeBackend
from specrun.drafters.base import EMPTY_PROPOSAL, Drafter, Proposal
from specrun.drafters.chain import ChainDrafter
from specrun.drafters.draft_model import DraftModelDrafter
from specrun.drafters.lookup import PromptLookupDrafter
from specrun.drafters.ngram import HEADER, MAGIC, NgramCacheError, NgramPoolDrafter, vocabulary_fingerprint
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.errors import UsageError
from specrun.heads.kinds import HEAD_METHODS
from specrun.sessions.setup import adapts_length, method_trees
from specrun.registry.loading import LoadOptions, open_backend
from specrun.drafters.methods import METHODS, DrafterOptions, build_drafter, is_adaptive, needs_draft_model, needs_heads
from specrun.sampling import SamplingSettings

GREEDY = SamplingSettings()
RNG = np.random.default_rng(0)
VOCAB = 50
SPECULATIVE_METHODS = [method for method in METHODS if method != "none"]


def lookup_tokens(context, draft_len=4, **settings) -> tuple[int, ...]:
    return PromptLookupDrafter(**settings).propose(list(context), draft_len, GREEDY, RNG).tokens


# ---- prompt lookup ---------------------------------------------------------------
def test_lookup_without_a_match_proposes_nothing():
    assert lookup_tokens([1, 2, 3, 4, 5, 6]) == ()
    assert lookup_tokens([7]) == ()
    assert lookup_tokens([1, 2, 9, 1, 2], draft_len=0) == ()


def test_lookup_most_recent_match_wins():
    assert lookup_tokens([1, 2, 5, 1, 2, 6, 9, 1, 2], draft_len=2) == (6, 9)


def test_lookup_longest_match_beats_a_more_recent_shorter_one():
    # (1 2 3) occurred once, followed by 10; (2 3) more recently, followed by 11.
    assert lookup_tokens([1, 2, 3, 10, 2, 3, 11, 1, 2, 3], draft_len=1) == (10,)
    assert lookup_tokens([1, 2, 3, 10, 2, 3, 11, 1, 2, 3], draft_len=1, max_ngram=2) == (11,)


def test_lookup_tells_the_length_of_the_n_gram_it_matched_as_the_proposal_s_kind():
    def kind(context, **settings) -> str:
        return PromptLookupDrafter(**settings).propose(list(context), 2, GREEDY, RNG).kind

    assert kind([1, 2, 3, 10, 2, 3, 11, 1, 2, 3]) == "n3"
    assert kind([1, 2, 3, 10, 2, 3, 11, 1, 2, 3], max_ngram=2) == "n2"
    assert kind([5, 6, 7, 8, 9, 5, 6, 7, 8]) == "n4"
    assert kind([4, 8, 1, 4], min_ngram=1) == "n1"
    assert PromptLookupDrafter().propose([1, 2, 3, 1, 2], 3, GREEDY, RNG).prefix(1).kind == "n2"  # kept when cut


def test_lookup_min_ngram_one_matches_single_tokens():
    assert lookup_tokens([4, 8, 1, 4], min_ngram=1) == (8, 1, 4, 8)
    assert lookup_tokens([4, 8, 1, 4], min_ngram=2) == ()


def test_lookup_overlapping_matches_continue_the_pattern():
    assert lookup_tokens([1, 2, 1, 2, 1], draft_len=4) == (2, 1, 2, 1)
    assert lookup_tokens([3, 3, 3], draft_len=5) == (3, 3, 3, 3, 3)


def test_lookup_match_at_the_very_end_of_the_context():
    # The earlier occurrence ends right where the current tail begins.
    assert lookup_tokens([1, 2, 3, 1, 2, 3], draft_len=4) == (1, 2, 3, 1)
    assert lookup_tokens([5, 6, 7, 8, 5, 6, 7], draft_len=6) == (8, 5, 6, 7, 8, 5)


def test_lookup_proposals_are_one_hot():
    proposal = PromptLookupDrafter().propose([1, 2, 3, 1, 2], 3, SamplingSettings(temperature=1.0), RNG)
    assert proposal.p_draft == (None, None, None) and proposal.source == "lookup"


def test_lookup_index_after_a_rewind_equals_a_fresh_index():
    """New prompts, rewinds and chat turns re-index from the first differing position only."""
    rng = np.random.default_rng(1)
    drafter = PromptLookupDrafter(max_ngram=3, min_ngram=1)
    context = list(rng.integers(0, 6, 300))
    for _ in range(40):
        keep = int(rng.integers(0, len(context) + 1))
        context = context[:keep] + list(rng.integers(0, 6, int(rng.integers(0, 60))))
        if not context:
            continue
        got = drafter.propose(context, 5, GREEDY, RNG)
        fresh = PromptLookupDrafter(max_ngram=3, min_ngram=1)
        assert got == fresh.propose(context, 5, GREEDY, RNG)
        assert drafter._latest == fresh._latest


def test_lookup_reads_each_appended_token_once():
    drafter = PromptLookupDrafter(max_ngram=3, min_ngram=2)
    context = [1, 2, 3, 4]
    drafter.propose(context, 4, GREEDY, RNG)
    before = drafter.ops
    context.extend([5, 6])
    drafter.propose(context, 4, GREEDY, RNG)
    # 1 prefix check + 2 tokens x 2 orders registered + 2 failed lookups.
    assert drafter.ops - before == 1 + 4 + 2


def step_ops(drafter, context_len: int, steps: int = 150) -> list[int]:
    """Operations per step of a simulated generation after a random context of ``context_len``.

    The generated tokens come from ids the context never uses, so both context sizes
    see the same matches and only the context's length differs.
    """
    rng = np.random.default_rng(context_len)
    context = [int(t) for t in rng.integers(0, 1000, context_len)]
    drafter.propose(context, 4, GREEDY, RNG)
    generated = [5000 + t for t in [1, 2, 3, 4, 5, 6, 7, 8] * 40]
    per_step = []
    for step in range(steps):
        context.extend(generated[2 * step : 2 * step + 2])  # the engine grows one list in place
        before = drafter.ops
        drafter.propose(context, 4, GREEDY, RNG)
        per_step.append(drafter.ops - before)
    return per_step


@pytest.mark.parametrize("make_drafter", [PromptLookupDrafter, NgramPoolDrafter], ids=["lookup", "ngram"])
def test_per_step_cost_does_not_grow_with_the_context(make_drafter):
    short, long = step_ops(make_drafter(), 1_000), step_ops(make_drafter(), 100_000)
    assert long == short  # step for step, whatever the context's length
    assert max(long) <= 20  # a handful of operations per token


# ---- n-gram pool -----------------------------------------------------------------
def learn(pool: NgramPoolDrafter, *texts: list[int]) -> None:
    for text in texts:
        pool.finish(list(text))


def pool_tokens(pool: NgramPoolDrafter, context, draft_len=4) -> tuple[int, ...]:
    return pool.propose(list(context), draft_len, GREEDY, RNG).tokens


def test_pool_proposes_the_most_frequent_continuation():
    pool = NgramPoolDrafter()
    learn(pool, [1, 2, 3, 7], [5, 1, 2, 3, 7], [1, 2, 4, 8], [9, 9, 9, 9])
    assert pool.followers([1, 2]) == {3: 2, 4: 1}
    assert pool_tokens(pool, [5, 1, 2]) == (3, 7)


def test_pool_backs_off_to_shorter_contexts_and_stops_when_unsure():
    pool = NgramPoolDrafter(max_order=3)
    learn(pool, [10, 20, 30], [11, 20, 30])
    assert pool_tokens(pool, [12, 20]) == (30,)  # (12 20) is unknown; (20) -> 30 twice
    learn(pool, [40, 41])
    assert pool_tokens(pool, [40]) == ()  # after one token, one sighting is not enough
    learn(pool, [50, 60], [50, 61], [50, 62])
    assert pool_tokens(pool, [50]) == ()  # no follower has half of the sightings


def test_pool_learns_across_runs_and_chat_turns_without_double_counting():
    pool = NgramPoolDrafter()
    turn = [1, 2, 3, 4]
    pool.propose(turn, 4, GREEDY, RNG)
    turn = turn + [5, 6]  # the next turn repeats the conversation so far
    pool.propose(turn, 4, GREEDY, RNG)
    pool.finish(turn)
    assert pool.followers([2, 3]) == {4: 1}
    assert pool_tokens(pool, [9, 1, 2, 3]) == (4, 5, 6)


def test_pool_evicts_the_least_recently_used_context_at_the_cap():
    pool = NgramPoolDrafter(max_order=1, max_contexts=2)
    learn(pool, [1, 2, 1, 5])  # (1) -> 2, (2) -> 1, then (1) used again -> 5
    learn(pool, [1, 2, 1, 5, 7])  # (5) is new: (2) is the least recently used
    assert len(pool) == 2 and pool.evictions == 1
    assert pool.followers([2]) == {}
    assert pool.followers([1]) == {2: 1, 5: 1}


def test_pool_memory_stays_at_the_cap():
    pool = NgramPoolDrafter(max_contexts=100, max_followers=2)
    learn(pool, [int(t) for t in np.random.default_rng(0).integers(0, 30, 5000)])
    assert len(pool) == 100
    assert all(len(pool.followers([t])) <= 2 for t in range(30))


def test_pool_keeps_frequent_followers_when_a_context_is_full():
    pool = NgramPoolDrafter(max_order=1, max_followers=2)
    learn(pool, [1, 2, 1, 2, 1, 3, 1, 4])
    assert pool.followers([1]) == {2: 2, 4: 2}  # 4 replaced the weakest (3) and took its count + 1


# ---- n-gram persistence ----------------------------------------------------------
def trained_pool(**settings) -> NgramPoolDrafter:
    pool = NgramPoolDrafter(vocabulary="vocab-a", **settings)
    learn(pool, [int(t) for t in np.random.default_rng(3).integers(0, 40, 3000)], [1, 2, 3, 1, 2, 3])
    return pool


def test_pool_save_and_load_round_trip(tmp_path):
    pool = trained_pool()
    first = pool.save(tmp_path / "pool.ngram")
    assert first.read_bytes()[:20] == MAGIC + struct.pack("<I", 1)  # the documented header
    loaded = NgramPoolDrafter(vocabulary="vocab-a")
    loaded.load(first)
    assert len(loaded) == len(pool)
    assert pool_tokens(loaded, [1, 2]) == pool_tokens(pool, [1, 2]) == (3, 1, 2, 3)
    second = NgramPoolDrafter(vocabulary="vocab-a")
    second.load(first)
    assert second.save(tmp_path / "again.ngram").read_bytes() == first.read_bytes()  # order and counts kept
    assert sorted(os.listdir(tmp_path)) == ["again.ngram", "pool.ngram"]  # no temporary files left


def test_pool_open_loads_and_close_saves(tmp_path):
    path = tmp_path / "sub" / "pool.ngram"
    pool = NgramPoolDrafter.open(path, vocabulary="v")
    assert len(pool) == 0
    pool.close()
    assert not path.exists()  # nothing learned, nothing written
    learn(pool, [4, 5, 6, 4, 5, 6])
    pool.close()
    reopened = NgramPoolDrafter.open(path, vocabulary="v")
    assert pool_tokens(reopened, [4, 5]) == (6, 4, 5, 6)


def with_version(data: bytes, version: int) -> bytes:
    magic, _, length, checksum = HEADER.unpack_from(data)
    return HEADER.pack(magic, version, length, checksum) + data[HEADER.size :]


def with_payload(payload: bytes) -> bytes:
    """A well-formed header around ``payload``: only the contents are wrong."""
    return HEADER.pack(MAGIC, 1, len(payload), hashlib.sha256(payload).digest()) + payload


BAD_FILES = {
    "empty": (lambda good: b"", "truncated"),
    "truncated header": (lambda good: good[:20], "truncated"),
    "truncated payload": (lambda good: good[:-10], "truncated"),
    "flipped byte": (lambda good: good[:-5] + bytes([good[-5] ^ 1]) + good[-4:], "corrupt"),
    "trailing bytes": (lambda good: good + b"x", "corrupt"),
    "foreign (GGUF)": (lambda good: b"GGUF" + b"\0" * 100, "not a specrun n-gram cache"),
    "foreign (text)": (lambda good: b"hello", "not a specrun n-gram cache"),
    "future version": (lambda good: with_version(good, 2), "newer than this specrun reads"),
    "bad JSON": (lambda good: with_payload(b"{not json"), "corrupt"),
    "bad ids": (lambda good: with_payload(b'{"vocabulary":"vocab-a","contexts":[[[-1],[2,1]]]}'), "corrupt"),
    "bad counts": (lambda good: with_payload(b'{"vocabulary":"vocab-a","contexts":[[[1],[2,0]]]}'), "corrupt"),
    "bad shape": (lambda good: with_payload(b'[1, 2]'), "corrupt"),
}


@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_unusable_cache_files_are_refused_with_a_fix(tmp_path, kind):
    good = trained_pool().save(tmp_path / "good.ngram").read_bytes()
    make_bad, reason = BAD_FILES[kind]
    path = tmp_path / "bad.ngram"
    path.write_bytes(make_bad(good))
    pool = NgramPoolDrafter(vocabulary="vocab-a")
    learn(pool, [7, 8, 9, 7, 8, 9])
    with pytest.raises(NgramCacheError, match=reason) as caught:
        pool.load(path)
    assert str(path) in caught.value.one_line()
    assert "delete it or pass another --ngram-cache" in caught.value.fix
    assert pool_tokens(pool, [7, 8]) == (9, 7, 8, 9)  # the pool was not touched
    with pytest.raises(NgramCacheError):
        build_drafter("ngram", None, DrafterOptions(ngram_cache=path, vocabulary="vocab-a"))


def test_cache_for_another_vocabulary_is_refused(tmp_path):
    path = trained_pool().save(tmp_path / "pool.ngram")
    with pytest.raises(NgramCacheError, match="another vocabulary"):
        NgramPoolDrafter.open(path, vocabulary="vocab-b")


def test_failed_save_keeps_the_old_file(tmp_path, monkeypatch):
    path = trained_pool().save(tmp_path / "pool.ngram")
    before = path.read_bytes()

    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(NgramCacheError, match="No space left") as caught:
        trained_pool(max_order=2).save(path)
    assert str(path) in caught.value.one_line()
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["pool.ngram"]


def test_vocabulary_fingerprint_tells_vocabularies_apart():
    a = FakeBackend(hashed_logits(VOCAB, 1), VOCAB)
    assert vocabulary_fingerprint(a) == vocabulary_fingerprint(FakeBackend(hashed_logits(VOCAB, 3), VOCAB))
    assert vocabulary_fingerprint(a) != vocabulary_fingerprint(FakeBackend(hashed_logits(VOCAB, 2), VOCAB, bos_id=1))
    assert vocabulary_fingerprint(a) != vocabulary_fingerprint(FakeBackend(hashed_logits(VOCAB + 1, 2), VOCAB + 1))


def test_backends_that_end_generations_on_other_tokens_share_a_fingerprint(tmp_path):
    """llama.cpp counts SmolLM2's <reponame> among the tokens that end a generation, mlx-lm does not:
    the ids and texts are the same, and a pool (or heads) made on one serves the other. Files made
    before the fingerprint left those tokens out are still read, by the backend that made them."""
    import dataclasses

    from specrun.drafters.ngram import vocabulary_fingerprints

    llama = FakeBackend(hashed_logits(VOCAB, 1), VOCAB)
    mlx = FakeBackend(hashed_logits(VOCAB, 1), VOCAB)
    mlx.vocab = dataclasses.replace(llama.vocab, eos_ids=frozenset({VOCAB - 1}))
    assert vocabulary_fingerprint(llama) == vocabulary_fingerprint(mlx)
    assert vocabulary_fingerprints(llama)[1] != vocabulary_fingerprints(mlx)[1]
    made = trained_pool(max_order=2)
    made.vocabulary = vocabulary_fingerprint(llama)
    made.save(tmp_path / "new.ngram")
    NgramPoolDrafter(vocabulary=vocabulary_fingerprints(mlx)).load(tmp_path / "new.ngram")
    made.vocabulary = vocabulary_fingerprints(llama)[1]  # a file from before
    made.save(tmp_path / "old.ngram")
    NgramPoolDrafter(vocabulary=vocabulary_fingerprints(llama)).load(tmp_path / "old.ngram")
    with pytest.raises(NgramCacheError, match="another vocabulary"):
        NgramPoolDrafter(vocabulary=vocabulary_fingerprints(mlx)).load(tmp_path / "old.ngram")
    written = NgramPoolDrafter(vocabulary=vocabulary_fingerprints(llama))
    assert written.vocabulary == vocabulary_fingerprint(llama)  # what a save writes


# ---- chains ----------------------------------------------------------------------
class CountingDrafter(Drafter):
    """Proposes fixed tokens and counts every call."""

    def __init__(self, name: str, tokens=()):
        self.name = name
        self.tokens = tuple(tokens)
        self.proposed = self.finished = self.closed = 0

    def propose(self, context, draft_len, sampling, rng):
        self.proposed += 1
        return Proposal(self.tokens[:draft_len], source=self.name)

    def finish(self, context):
        self.finished += 1

    def close(self):
        self.closed += 1


def test_chain_asks_the_draft_model_only_when_the_cheap_drafters_have_too_little():
    cases = [  # lookup's and ngram's proposals -> who answers
        ((1, 2, 3), (), "lookup"),
        ((), (4, 5), "ngram"),
        ((), (), "draft"),
        ((1,), (), "draft"),  # one token is below the minimum of two
    ]
    for from_lookup, from_ngram, answer in cases:
        model = CountingDrafter("draft", (9, 9, 9, 9))
        chain = ChainDrafter([CountingDrafter("lookup", from_lookup), CountingDrafter("ngram", from_ngram), model])
        assert chain.name == "lookup+ngram+draft"
        assert chain.propose([0], 4, GREEDY, RNG).source == answer
        assert model.proposed == (answer == "draft")


def test_chain_without_a_draft_model_takes_the_longest_short_proposal():
    chain = ChainDrafter([CountingDrafter("lookup", ()), CountingDrafter("ngram", (7,))])
    assert chain.propose([0], 4, GREEDY, RNG).tokens == (7,)
    assert ChainDrafter([CountingDrafter("lookup", ())]).propose([0], 4, GREEDY, RNG) == EMPTY_PROPOSAL
    # With draft_len 1 a single token is enough.
    model = CountingDrafter("draft", (9,))
    assert ChainDrafter([CountingDrafter("lookup", (3,)), model]).propose([0], 1, GREEDY, RNG).tokens == (3,)
    assert model.proposed == 0


def test_chain_finish_and_close_reach_every_member():
    members = [CountingDrafter("lookup"), CountingDrafter("draft")]
    chain = ChainDrafter(members)
    chain.finish([1, 2])
    chain.close()
    assert [(m.finished, m.closed) for m in members] == [(1, 1), (1, 1)]


# ---- methods ---------------------------------------------------------------------
def test_every_method_builds_its_drafter():
    draft = FakeBackend(hashed_logits(VOCAB, 1), VOCAB)
    assert build_drafter("none", None) is None
    for method in SPECULATIVE_METHODS:
        if method == "auto":
            continue
        heads = (random_heads(8, VOCAB), random_hydra(8, VOCAB), random_eagle(8, VOCAB),
                 random_mtp(8, VOCAB)) if needs_heads(method) else None
        drafter = build_drafter(method, draft if needs_draft_model(method) else None, DrafterOptions(heads=heads))
        assert drafter.name == method
        assert isinstance(drafter, ChainDrafter) == ("+" in method)
    # auto is the full chain, or the draft-free part of it when there is no draft model.
    assert build_drafter("auto", draft).name == "lookup+ngram+draft"
    assert build_drafter("auto", None).name == "lookup+ngram"
    with pytest.raises(UsageError, match="needs a draft model"):
        build_drafter("lookup+draft", None)
    with pytest.raises(UsageError, match="asks a dearer drafter before a cheaper one"):
        build_drafter("draft+lookup", draft)
    with pytest.raises(UsageError, match="unknown method"):
        build_drafter("draft+magic", draft)
    for method in HEAD_METHODS:
        with pytest.raises(UsageError, match="needs heads"):
            build_drafter(method, None)
    with_draft = ["auto", "draft", "lookup+draft", "ngram+draft", "lookup+ngram+draft"]
    assert [method for method in METHODS if needs_draft_model(method)] == with_draft


def test_ngram_method_saves_its_cache_on_close(tmp_path):
    path = tmp_path / "pool.ngram"
    options = DrafterOptions(ngram_cache=path, vocabulary="v")
    drafter = build_drafter("lookup+ngram", None, options)
    drafter.finish([3, 4, 5, 3, 4, 5])
    drafter.close()
    assert pool_tokens(build_drafter("ngram", None, options), [3, 4]) == (5, 3, 4, 5)


# ---- losslessness through the engine ---------------------------------------------
def plain_tokens(target_table, prompt, n) -> list[int]:
    return SpeculativeEngine(FakeBackend(target_table, VOCAB)).run(prompt, GenerationParams(n, draft_len=0)).token_ids


class Recording(Drafter):
    """Wraps a drafter and records the length of every proposal it makes."""

    def __init__(self, drafter):
        self.drafter, self.name, self.sizes = drafter, drafter.name, []

    def propose(self, context, draft_len, sampling, rng):
        proposal = self.drafter.propose(context, draft_len, sampling, rng)
        self.sizes.append(len(proposal))
        return proposal

    def finish(self, context):
        self.drafter.finish(context)

    def close(self):
        self.drafter.close()


def test_lookup_first_chain_asks_the_draft_model_only_when_lookup_has_nothing():
    table = copying_logits(salt=5)
    lookup = Recording(PromptLookupDrafter())
    draft_backend = FakeBackend(noisy_copy(5), VOCAB)
    draft = Recording(DraftModelDrafter(draft_backend))
    chain = ChainDrafter([lookup, draft])
    engine = SpeculativeEngine(FakeBackend(table, VOCAB), chain)
    result = engine.run(REPEATING_PROMPT, GenerationParams(150, draft_len=4))
    assert result.token_ids == plain_tokens(table, REPEATING_PROMPT, 150)
    assert len(draft.sizes) == lookup.sizes.count(0)
    assert 0 < len(draft.sizes) < len(lookup.sizes)
    assert draft_backend.cache == REPEATING_PROMPT + result.token_ids  # skipped steps caught up by finish


# ---- losslessness on the real backends -------------------------------------------
REAL_PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
]
REAL_NEW = 40
BACKEND_MODULES = {"llama": "llama_cpp", "mlx": "mlx_lm"}


@pytest.fixture(scope="module", params=list(BACKEND_MODULES))
def backend_kind(request: pytest.FixtureRequest) -> str:
    """Each real backend in turn, skipped with a reason when it is not installed."""
    pytest.importorskip(BACKEND_MODULES[request.param], reason=f"the {request.param} backend is not installed")
    return request.param


def source_of(model, kind: str) -> Path:
    """The file a backend opens for a tiny model: the F32 GGUF for llama.cpp, the HF folder for MLX."""
    return model.gguf_f32_path if kind == "llama" else model.hf_dir


def open_real(kind: str, source: Path, tree_paths: int = 0) -> Backend:
    # One thread: the tiny models gain nothing from two, and spinning threads stall on a busy machine.
    # Exact (llama.cpp: F32 KV cache, flash attention off) on float32 weights: one-token and
    # batched passes then agree to ~1e-5 in the logits, so a divergence the harness lets through
    # is a true near-tie; in F16 they round apart by ~1e-2 on an AVX2-only CPU.
    options = LoadOptions(backend=kind, n_ctx=512, threads=1, tree_paths=tree_paths, exact=kind == "llama")
    return open_backend(str(source), options, entries={})


@pytest.fixture(scope="module")
def real_targets(backend_kind, tiny_llama, looping_llama) -> dict[str, tuple[Path, list]]:
    """Per target kind: its source, and per prompt the prompt ids and the plain greedy output."""
    sources = {"random": source_of(tiny_llama, backend_kind), "looping": looping_llama[backend_kind]}
    targets = {}
    for target_kind, source in sources.items():
        target = open_real(backend_kind, source)
        engine = SpeculativeEngine(target)
        plain = []
        for text in REAL_PROMPTS:
            ids = target.tokenize(text)
            result = engine.run(ids, GenerationParams(REAL_NEW, draft_len=0), complete_cache=False)
            plain.append((ids, result.token_ids))
        target.close()
        targets[target_kind] = (source, plain)
    return targets


def diverges_at_near_ties_only(kind: str, source: Path, prompt: list[int], plain: list[int], spec: list[int]) -> bool:
    """Token-identical (False), or diverging (True) only at near-ties, every divergence along
    the output examined (lossless_harness.greedy_divergences)."""
    if spec == plain:
        return False
    fresh = open_real(kind, source)
    divergences = greedy_divergences(fresh, prompt, spec)
    fresh.close()
    assert divergences, f"{kind}: the output differs from plain decoding's yet is the argmax everywhere"
    return True


# Each method on the target where its drafts get accepted: the random target drafts
# with itself; the looping one repeats itself, so lookup catches it, and drafts with qwen2.
REAL_CASES = [
    ("draft", "random"),
    ("lookup", "looping"),
    ("ngram", "random"),  # each prompt's second run is drafted from what the first taught the pool
    ("lookup+ngram", "looping"),
    ("lookup+draft", "looping"),
    ("ngram+draft", "random"),
    ("lookup+ngram+draft", "looping"),
    ("auto", "looping"),  # adaptive draft lengths over the full chain
    ("medusa", "looping"),  # heads fitted to the target's own output (tests/heads_factory.py)
    ("hydra", "looping"),
    ("eagle", "looping"),
    ("mtp", "looping"),  # an MTP layer fitted likewise (the llama target carries none of its own)
    ("lookahead", "random"),  # the window's n-grams of what the random model repeats
]


def test_real_backend_cases_cover_every_method():
    assert sorted(method for method, _ in REAL_CASES) == sorted(SPECULATIVE_METHODS)


@pytest.mark.parametrize(("method", "target_kind"), REAL_CASES)
def test_greedy_output_is_identical_for_every_method_on_real_backends(
    method, target_kind, backend_kind, real_targets, tiny_llama, tiny_qwen2
):
    """Every prompt with one drafter, twice when it holds an n-gram pool (a chat asking again),
    as `specrun generate` runs the method (adaptive) and, but for auto, at a fixed length of 4
    (-k 4)."""
    target_source, plain_outputs = real_targets[target_kind]
    # opened for the trees lookahead's window makes, as `generate --method lookahead` opens it
    target = open_real(backend_kind, target_source, method_trees(method).paths)
    draft_model = tiny_llama if target_kind == "random" else tiny_qwen2
    draft = open_real(backend_kind, source_of(draft_model, backend_kind)) if needs_draft_model(method) else None
    heads = fitted_heads_for(method, target, [*plain_outputs[0][0], *plain_outputs[0][1]]) if needs_heads(method) else None
    drafter = build_drafter(method, draft, DrafterOptions(heads=heads))
    engine = SpeculativeEngine(target, drafter)
    accepted = diverging = runs = 0
    modes = {adapts_length(method, None), is_adaptive(method)}
    for ids, plain in plain_outputs:
        for adaptive, _ in itertools.product(sorted(modes), range(2 if "ngram" in method else 1)):
            params = GenerationParams(REAL_NEW, draft_len=8 if adaptive else 4, adaptive=adaptive)
            result = engine.run(ids, params)
            assert result.stats.adaptive == adaptive
            diverging += diverges_at_near_ties_only(backend_kind, target_source, ids, plain, result.token_ids)
            accepted += result.stats.accepted
            runs += 1
    assert_few_prompts_diverge(diverging, runs)
    assert accepted > 0
    drafter.close()
    for backend in (target, draft):
        if backend is not None:
            backend.close()


def test_comparisons_start_every_run_with_an_empty_pool():
    """Benchmarks measure what `specrun generate` gets: a pool learned on an earlier run flatters."""
    from specrun.sessions.compare import Variant, compare_variants

    target = FakeBackend(hashed_logits(VOCAB, salt=6, spread=3.0), VOCAB)  # output the prompt cannot predict
    variants = [Variant("none", "none", 0), Variant("ngram", "ngram", 4)]
    comparison = compare_variants(target, None, [[1, 2, 3], [1, 2, 3]], variants,
                                  GenerationParams(60, draft_len=4), repeat=2)
    runs = [run for index in (0, 1) for run in comparison.figures["ngram"].by_prompt[index]]
    assert runs[0].stats.accepted < 30  # a pool that had seen this output would predict most of it
    assert len({(r.stats.drafted, r.stats.accepted, tuple(r.token_ids)) for r in runs}) == 1  # no run learned from another


# ---- chains beyond the named methods ---------------------------------------------------------
@pytest.mark.parametrize("method", ["lookup+medusa", "ngram+hydra", "lookup+ngram+eagle+draft", "lookup+lookahead",
                                    "lookahead+draft", "lookup+ngram+lookahead+hydra+draft"])
def test_chains_of_drafters_cheapest_first_are_methods(method):
    from specrun.drafters.methods import PARTS, check_method, heads_kind

    check_method(method)
    parts = method.split("+")
    assert parts == sorted(parts, key=PARTS.index)
    assert heads_kind(method) in (None, *parts)


@pytest.mark.parametrize(("method", "problem", "fix"), [
    ("medusa+lookup", "asks a dearer drafter before a cheaper one", "use --method lookup+medusa"),
    ("draft+ngram+lookup", "asks a dearer drafter before a cheaper one", "use --method lookup+ngram+draft"),
    ("lookup+medusa+eagle", "drafts with medusa and eagle heads", "keep one of medusa, eagle"),
    ("lookup+lookup", "names a drafter twice", "name each drafter once"),
    ("lookup+magic", "unknown method", "joined by +"),
    ("auto+lookup", "unknown method", "joined by +"),
    ("none+draft", "unknown method", "joined by +"),
    ("eagle3", "EAGLE-3 heads draft with --method eagle", "use --method eagle"),
])
def test_bad_chains_are_usage_errors_naming_the_fix(method, problem, fix):
    from specrun.drafters.methods import check_method

    with pytest.raises(UsageError) as caught:
        check_method(method)
    assert problem in caught.value.problem and fix in caught.value.fix


# ---- long reads indexed in bulk (NumPy) --------------------------------------------
def index_state(drafter: PromptLookupDrafter) -> tuple:
    return (drafter.mirror.tokens, drafter._latest, drafter._replaced, drafter._tails, drafter._index_ops)


@pytest.mark.parametrize("orders", [(1, 1), (2, 4), (1, 5), (3, 6)])
def test_lookup_bulk_reads_and_rewinds_build_the_token_by_token_index(monkeypatch, orders):
    """Long reads (prompts, a chat's history) and long rewinds go through NumPy: the index,
    its undo records, tails and operation count are those of reading a token at a time, over
    repetitive and random text, large token ids (packed keys past 64 bits) and n-gram orders
    of odd and even length."""
    import specrun.drafters.lookup as lookup_module

    min_ngram, max_ngram = orders
    rng = np.random.default_rng(sum(orders))
    bulk = PromptLookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
    stepwise = PromptLookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
    motif = [int(t) for t in rng.integers(2**32 - 9, 2**32, 12)]
    context: list[int] = []
    for round_ in range(30):
        keep = int(rng.integers(0, len(context) + 1)) if round_ % 3 else len(context)
        grown = int(rng.integers(0, 300))
        fresh = [motif[i % len(motif)] if rng.random() < 0.7 else int(rng.integers(2**32 - 9, 2**32))
                 for i in range(int(rng.integers(0, 12)), grown)]
        context = context[:keep] + fresh
        got = bulk.propose(context, 5, GREEDY, RNG)
        monkeypatch.setattr(lookup_module, "BULK_TOKENS", 10**9)
        expected = stepwise.propose(context, 5, GREEDY, RNG)
        monkeypatch.undo()
        assert got == expected
        assert index_state(bulk) == index_state(stepwise)
    assert bulk.propose(context + motif[:4], 5, GREEDY, RNG) == stepwise.propose(context + motif[:4], 5, GREEDY, RNG)


def test_a_long_prompt_is_indexed_without_a_python_step_a_token(monkeypatch):
    """The per-token updates (lookup's _read_token, the pool's _learn_next) are not called for a
    long read; a step's few tokens still take them."""
    from specrun.drafters import ngram as ngram_module

    def per_token(*_):
        raise AssertionError("a long read went token by token")

    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 50, 8192)]
    for drafter, method in ((PromptLookupDrafter(), "_read_token"), (NgramPoolDrafter(), "_learn_next")):
        monkeypatch.setattr(type(drafter), method, per_token)
        drafter.propose(prompt, 4, GREEDY, RNG)
        assert drafter.mirror.tokens == prompt
        monkeypatch.undo()
        drafter.propose(prompt + [7, 8], 4, GREEDY, RNG)  # a step: token by token
        assert drafter.mirror.tokens == prompt + [7, 8]
    assert ngram_module.BULK_TOKENS <= 256


def pool_state(pool: NgramPoolDrafter) -> list:
    return [(key, list(followers.items())) for key, followers in pool._pool.items()]


@pytest.mark.parametrize("max_order", [1, 3, 4])
def test_pool_bulk_learning_equals_token_by_token_learning(monkeypatch, max_order):
    """Without a full context or an eviction, a long read leaves the pool exactly as learning a
    token at a time does: contexts in order of last use, followers in order of first sighting,
    counts; learned on top of what the pool held, across chat turns that repeat the history."""
    import specrun.drafters.ngram as ngram_module

    rng = np.random.default_rng(max_order)
    settings = {"max_order": max_order, "max_followers": 64, "max_contexts": 10**6}
    bulk, stepwise = NgramPoolDrafter(**settings), NgramPoolDrafter(**settings)
    context: list[int] = []
    for _ in range(12):
        context = context + [int(t) for t in rng.integers(0, 12, int(rng.integers(60, 400)))]
        bulk.propose(context, 4, GREEDY, RNG)
        monkeypatch.setattr(ngram_module, "BULK_TOKENS", 10**9)
        stepwise.propose(context, 4, GREEDY, RNG)
        monkeypatch.undo()
        assert pool_state(bulk) == pool_state(stepwise)
        assert bulk.ops == stepwise.ops and bulk.mirror.tokens == stepwise.mirror.tokens
    other = [int(t) for t in rng.integers(0, 12, 300)]  # a new conversation: the pool keeps learning
    bulk.finish(other)
    monkeypatch.setattr(ngram_module, "BULK_TOKENS", 10**9)
    stepwise.finish(other)
    assert pool_state(bulk) == pool_state(stepwise)


def test_pool_bulk_learning_keeps_the_strongest_followers_and_evicts_the_least_recent():
    """Past the caps a long read keeps each context's most counted followers (ties: the first
    sighted, in their order) and the most recently used contexts."""
    text = [1, 2] * 40 + [1, 3] * 30 + [1, 4] * 30 + [1, 5, 6, 7]
    pool = NgramPoolDrafter(max_order=1, max_followers=2)
    pool.finish(text)
    assert pool.followers([1]) == {2: 40, 3: 30}  # 4 (30 as well) was sighted after 3
    capped = NgramPoolDrafter(max_order=1, max_contexts=3)
    capped.finish(text)
    assert list(capped._pool) == [(1,), (5,), (6,)]  # 1 last followed by 5, then 5 and 6
    assert capped.evictions == 3 and capped.followers([1]) == {2: 40, 3: 30, 4: 30, 5: 1}


def test_a_long_read_interrupted_in_the_pool_s_update_is_never_counted_twice():
    """Ctrl-C once the pool holds a long read's counts (while it orders them by use): the read is
    marked read before, so the next read does not count it all again into a pool that is saved."""
    from collections import OrderedDict

    class Interrupting(OrderedDict):
        armed = True

        def move_to_end(self, *args, **kwargs):
            if Interrupting.armed:
                Interrupting.armed = False
                raise KeyboardInterrupt
            super().move_to_end(*args, **kwargs)

    text = [1, 2, 3] * 100
    pool = NgramPoolDrafter(max_order=2)
    pool._pool = Interrupting()
    with pytest.raises(KeyboardInterrupt):
        pool.finish(text)
    pool.finish(text + [1, 2])
    whole = NgramPoolDrafter(max_order=2)
    whole.finish(text + [1, 2])
    for context in ([1], [2], [1, 2], [3, 1]):
        assert sum(pool.followers(context).values()) <= sum(whole.followers(context).values())
