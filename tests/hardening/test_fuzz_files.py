"""Issue 32: a seeded fuzz over the files specrun reads back (n-gram caches, tuned.json,
registry files). Every mutated file either loads, and then the run's greedy output is plain
decoding's, or fails with one line that names the file and a fix: never another exception,
a hang, or different output.

Mutations: bytes flipped, cut, inserted or repeated; and, inside the JSON or TOML, one value
replaced by another type, a huge or negative number, NaN, deep nesting, a key dropped or
added. N-gram payloads are mostly re-wrapped with a valid checksum, so the mutation reaches
the parser instead of stopping at the checksum.
"""

from __future__ import annotations

import copy
import json
import random

import numpy as np
import pytest

from cli_checks import deadline, ngram_cache_bytes
from fake_models import COPYING_VOCAB, REPEATING_PROMPT, copying_logits, noisy_copy
from specrun.backends.fake import FakeBackend
from specrun.drafters.methods import build_drafter
from specrun.drafters.ngram import NgramPoolDrafter, vocabulary_fingerprint
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.errors import SpecrunError
from specrun.registry.catalog import ENTRY_KEYS, ModelEntry, entry_for, parse_registry
from specrun.sessions import tuning

SEED = 32
CASES = {"ngram": 250, "tuned": 150, "registry": 150}  # 550 in all, a few seconds
NEW_TOKENS = 24
SECONDS_PER_CASE = 5
TUNED_KEY = "fake-target|fake-draft"
TABLE = copying_logits(salt=9)
PROMPTS = [REPEATING_PROMPT, [7, 8, 9, 7, 8, 30, 31, 7, 8]]
STRANGE_VALUES = [
    -1, 0, 1, 2**31, 2**63, 10**400, -(10**30), 0.5, -0.0, 1e-300, 1e308, float("nan"), float("inf"),
    "", "x", "12", None, True, False, [], [1], [[1, 2], [3]], {}, {"a": 1},
]


def assert_one_line_refusal(error: SpecrunError, path, case: str) -> None:
    line = error.one_line()
    assert "\n" not in line and str(path) in line and error.fix, f"{case}: {line!r}"


# ---- mutations ------------------------------------------------------------------------
def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    data = bytearray(data)
    kind = rng.randrange(5)
    if kind == 0 and data:  # flip bits
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == 1:  # cut
        del data[rng.randrange(len(data) + 1) :]
    elif kind == 2:  # insert random bytes
        at = rng.randrange(len(data) + 1)
        data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    elif kind == 3 and data:  # repeat a chunk
        start = rng.randrange(len(data))
        data[start:start] = data[start : start + rng.randint(1, 64)] * rng.randint(1, 3)
    else:  # a Latin-1 or random byte where text was
        data[rng.randrange(len(data) + 1) : 0] = bytes([rng.choice([0xE9, 0xFF, 0x80, 0x00])])
    return bytes(data)


def containers(node, found=None) -> list:
    """Every list and dict inside a JSON document, the document first."""
    found = [] if found is None else found
    if isinstance(node, (list, dict)):
        found.append(node)
        for child in node.values() if isinstance(node, dict) else node:
            containers(child, found)
    return found


def mutate_document(document, rng: random.Random):
    document = copy.deepcopy(document)
    target = rng.choice(containers(document))
    if not target:
        return document
    key = rng.choice(list(target)) if isinstance(target, dict) else rng.randrange(len(target))
    kind = rng.randrange(4)
    if kind == 0:
        target[key] = rng.choice(STRANGE_VALUES)
    elif kind == 1:
        del target[key]
    elif kind == 2:
        depth = rng.choice([3, 50, 5000])
        nested = rng.choice(STRANGE_VALUES)
        for _ in range(depth):
            nested = [nested]
        target[key] = nested
    elif isinstance(target, dict):
        target[rng.choice(["extra", "vocabulary", "version", "0"])] = rng.choice(STRANGE_VALUES)
    else:
        target.append(rng.choice(STRANGE_VALUES))
    return document


def dumps(document) -> bytes:
    try:
        return json.dumps(document).encode()
    except RecursionError:
        return b"[" * 100_000 + b"]" * 100_000


# ---- the n-gram cache -----------------------------------------------------------------
@pytest.fixture(scope="module")
def plain_outputs() -> list[list[int]]:
    plain = SpeculativeEngine(FakeBackend(TABLE, COPYING_VOCAB))
    params = GenerationParams(NEW_TOKENS, draft_len=0, stop_at_eos=False)
    return [plain.run(prompt, params).token_ids for prompt in PROMPTS]


def run_greedy(engine: SpeculativeEngine, params: GenerationParams) -> list[list[int]]:
    return [engine.run(prompt, params).token_ids for prompt in PROMPTS]


def test_fuzzed_ngram_caches_load_losslessly_or_fail_in_one_line(tmp_path, plain_outputs):
    fingerprint = vocabulary_fingerprint(FakeBackend(TABLE, COPYING_VOCAB))
    pool = NgramPoolDrafter(vocabulary=fingerprint)
    pool.finish([int(t) for t in np.random.default_rng(SEED).integers(0, COPYING_VOCAB, 400)] + REPEATING_PROMPT)
    good_file = pool.save(tmp_path / "good.ngram").read_bytes()
    good_document = json.loads(good_file[60:])
    rng = random.Random(SEED)
    outcomes = {"loaded": 0, "refused": 0}
    for number in range(CASES["ngram"]):
        roll = rng.random()
        if roll < 0.6:
            contents = ngram_cache_bytes(dumps(mutate_document(good_document, rng)))
        elif roll < 0.8:
            contents = ngram_cache_bytes(mutate_bytes(good_file[60:], rng))
        else:
            contents = mutate_bytes(good_file, rng)
        path = tmp_path / f"case{number}.ngram"
        path.write_bytes(contents)
        case = f"n-gram case {number} (seed {SEED})"
        with deadline(SECONDS_PER_CASE, case):
            try:
                drafter = NgramPoolDrafter.open(path, vocabulary=fingerprint)
            except SpecrunError as error:
                assert_one_line_refusal(error, path, case)
                outcomes["refused"] += 1
                continue
            engine = SpeculativeEngine(FakeBackend(TABLE, COPYING_VOCAB), drafter, method="ngram")
            assert run_greedy(engine, GenerationParams(NEW_TOKENS, draft_len=4, stop_at_eos=False)) == plain_outputs, case
            outcomes["loaded"] += 1
    assert min(outcomes.values()) > 10, outcomes  # the mutations reach both ends


# ---- tuned.json -------------------------------------------------------------------------
GOOD_TUNED = {
    "version": 2,
    "pairs": {
        TUNED_KEY: {
            "key": TUNED_KEY, "target": "t", "draft": "d", "machine": "m", "best_draft_len": 4, "speedup": 1.3,
            "tokens_per_second": {"none": 100.0, "draft k=4": 130.0}, "target_costs": {"1": 0.01, "5": 0.012},
            "acceptance": 0.7, "best_min_prob": 0.3, "draft_costs": {"4": 0.002}, "first_acceptance": 0.8,
            "learned": False, "draft_off_gap": 0,
        }
    },
}


def test_fuzzed_tuned_files_load_losslessly_or_fail_in_one_line(tmp_path, plain_outputs):
    good = json.dumps(GOOD_TUNED).encode()
    rng = random.Random(SEED + 1)
    outcomes = {"loaded": 0, "refused": 0}
    for number in range(CASES["tuned"]):
        contents = dumps(mutate_document(GOOD_TUNED, rng)) if rng.random() < 0.75 else mutate_bytes(good, rng)
        path = tmp_path / f"case{number}" / "tuned.json"
        path.parent.mkdir()
        path.write_bytes(contents)
        case = f"tuned.json case {number} (seed {SEED + 1})"
        with deadline(SECONDS_PER_CASE, case):
            try:
                tuned = tuning.load(TUNED_KEY, path)
            except SpecrunError as error:
                assert_one_line_refusal(error, path, case)
                outcomes["refused"] += 1
                continue
            draft = FakeBackend(noisy_copy(9), COPYING_VOCAB)
            engine = SpeculativeEngine(FakeBackend(TABLE, COPYING_VOCAB), build_drafter("draft", draft), method="draft")
            if tuned is not None:
                tuned.apply(engine)
            params = GenerationParams(NEW_TOKENS, draft_len=8, stop_at_eos=False, adaptive=True)
            assert run_greedy(engine, params) == plain_outputs, case
            outcomes["loaded"] += 1
    assert min(outcomes.values()) > 10, outcomes


# ---- registry files -----------------------------------------------------------------------
GOOD_REGISTRY = """\
[models.mine]
description = "a local model"
family = "llama3"
context = 8192
size_gb = 4.9
gguf_path = "/models/mine.gguf"
drafts = ["small"]

[models.small]
family = "llama3"
gguf_repo = "owner/small-GGUF"
gguf_file = "small-Q4.gguf"
verified = false
"""
TOML_VALUES = ['-5', '1e400', 'inf', 'nan', '"x"', '""', 'true', '[1, "a"]', '{ a = 1 }', '1979-05-27', '[[[[1]]]]']


def mutate_toml(text: str, rng: random.Random) -> bytes:
    lines = text.splitlines()
    kind = rng.randrange(5)
    at = rng.randrange(len(lines))
    if kind == 0 and "=" in lines[at]:
        lines[at] = lines[at].split("=")[0] + "= " + rng.choice(TOML_VALUES)
    elif kind == 1:
        del lines[at]
    elif kind == 2:
        lines.insert(at, rng.choice(lines))
    elif kind == 3:
        lines.insert(at, rng.choice(["[models]", "[other]", "[models.mine.sub]", "colour = 1", "drafts = " + "[" * 600]))
    else:
        return mutate_bytes(text.encode(), rng)
    return "\n".join(lines).encode()


def test_fuzzed_registry_files_load_well_typed_or_fail_in_one_line(tmp_path):
    rng = random.Random(SEED + 2)
    outcomes = {"loaded": 0, "refused": 0}
    for number in range(CASES["registry"]):
        path = tmp_path / f"case{number}.toml"
        path.write_bytes(mutate_toml(GOOD_REGISTRY, rng))
        case = f"registry case {number} (seed {SEED + 2})"
        with deadline(SECONDS_PER_CASE, case):
            try:
                entries = parse_registry(path)
            except SpecrunError as error:
                assert_one_line_refusal(error, path, case)
                outcomes["refused"] += 1
                continue
            for alias, entry in entries.items():
                assert isinstance(entry, ModelEntry) and entry_for(alias, entries) is entry, case
                for key, expected in ENTRY_KEYS.items():
                    value = getattr(entry, key)
                    assert isinstance(value, tuple if key == "drafts" else expected), (case, key, value)
                assert entry.context >= 0 and 0 <= entry.size_gb < float("inf"), (case, entry)
            outcomes["loaded"] += 1
    assert min(outcomes.values()) > 10, outcomes


@pytest.mark.timeout(60)
def test_a_case_s_deadline_leaves_the_suite_s_own_timer_running():
    """deadline() shares SIGALRM with the suite's per-test timeout: the timer is armed again, with
    the time it had left (it was left off, and a hang later in the test hung the run)."""
    import signal

    before, _ = signal.getitimer(signal.ITIMER_REAL)
    assert before > 0  # pytest-timeout's, from the marker above
    with deadline(5, "a case"):
        pass
    after, _ = signal.getitimer(signal.ITIMER_REAL)
    assert 0 < after <= before
    with pytest.raises(AssertionError, match="a slow case: still running after 0.05 s"), deadline(0.05, "a slow case"):
        signal.pause()
    assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= after
