"""The engine on real llama.cpp models: greedy losslessness, exact rewinds, vocabulary checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from model_factory import TinyModel, random_weights, tiny_config, tiny_tokenizer_json  # noqa: E402
from specrun.backends.llama import LlamaCppBackend  # noqa: E402
from specrun.compat import check_compatible  # noqa: E402
from specrun.drafters.draft_model import DraftModelDrafter  # noqa: E402
from specrun.engine import GenerationParams, SpeculativeEngine  # noqa: E402
from specrun.errors import IncompatibleModelsError, ModelFileError  # noqa: E402
from specrun.modelkit.gguf_io import write_gguf  # noqa: E402
from specrun.modelkit.tokenizer import DEMO_CHAT_TEMPLATE  # noqa: E402

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n    print(i)\n",
    "Hello, world! ",
    "The quick brown fox",
    "    return x + 1\n",
    "# Compute the mean\n",
    "x = [1, 2, 3]\n",
    "if __name__ == '__main__':\n",
    "Grüße aus München",
    "日本語のテキスト",
    "try:\n    pass\nexcept Exception as exc:\n",
    "{'a': 1, 'b': 2}",
    "while True:\n",
    "\n\n\n",
    "SELECT * FROM users WHERE",
    "Emoji 🙂 🚀",
    "def __repr__(self):\n        return",
    "0123456789",
    "lambda x: x * 2",
    "with open(path) as handle:\n",
]
N_NEW = 40
NEAR_TIE = 1e-3


def open_llama(path: Path, n_ctx: int = 2048) -> LlamaCppBackend:
    return LlamaCppBackend(path, n_ctx=n_ctx, n_threads=2)


@pytest.fixture(scope="module")
def perturbed_llama(tiny_llama: TinyModel, tmp_path_factory) -> Path:
    """A draft that agrees with the llama target often but not always: its weights plus noise."""
    rng = np.random.default_rng(7)
    weights = {
        name: (w + 0.08 * w.std() * rng.standard_normal(w.shape)).astype(np.float32)
        for name, w in tiny_llama.weights.items()
    }
    path = tmp_path_factory.mktemp("perturbed") / "llama-perturbed.gguf"
    return write_gguf(path, tiny_llama.config, weights, tiny_llama.tokenizer_json, DEMO_CHAT_TEMPLATE, dtype="F16")


@pytest.fixture(scope="module")
def other_vocab_model(tmp_path_factory) -> Path:
    """A model whose tokenizer has a different vocabulary."""
    config = tiny_config("llama")
    config = type(config)(**{**config.__dict__, "vocab_size": 300})
    path = tmp_path_factory.mktemp("othervocab") / "other.gguf"
    return write_gguf(path, config, random_weights(config, 3), tiny_tokenizer_json(300), None, dtype="F16")


def assert_greedy_equal_or_near_tie(target_path: Path, prompt_ids: list[int], plain: list[int], spec: list[int]):
    """Token-identical, or diverging only where the target's top-2 logits nearly tie."""
    if spec == plain:
        return
    first = next(i for i, (a, b) in enumerate(zip(plain, spec)) if a != b)
    fresh = open_llama(target_path)
    logits = fresh.forward(prompt_ids + plain[:first], [len(prompt_ids) + first - 1])[0]
    fresh.close()
    top2 = np.sort(logits)[-2:]
    gap = float(top2[1] - top2[0])
    assert gap < NEAR_TIE, f"greedy divergence at token {first} with top-2 logit gap {gap:.4g}"


@pytest.mark.parametrize("draft_kind", ["same", "perturbed", "other_arch"])
def test_greedy_speculation_is_token_identical(draft_kind, tiny_llama, tiny_qwen2, perturbed_llama):
    target_path = tiny_llama.gguf_path
    draft_path = {"same": tiny_llama.gguf_path, "perturbed": perturbed_llama, "other_arch": tiny_qwen2.gguf_path}[
        draft_kind
    ]
    target, draft = open_llama(target_path), open_llama(draft_path)
    engine = SpeculativeEngine(target, DraftModelDrafter(draft))  # draft_len 0 is plain decoding
    accepted = drafted = 0
    for i, text in enumerate(PROMPTS):
        prompt_ids = target.tokenize(text)
        plain = engine.run(prompt_ids, GenerationParams(N_NEW, 0), complete_cache=False).token_ids
        result = engine.run(prompt_ids, GenerationParams(N_NEW, draft_len=1 + i % 6), complete_cache=False)
        assert_greedy_equal_or_near_tie(target_path, prompt_ids, plain, result.token_ids)
        accepted += result.stats.accepted
        drafted += result.stats.drafted
    rate = accepted / drafted
    if draft_kind == "same":
        assert rate == 1.0
    elif draft_kind == "perturbed":
        assert 0.05 < rate < 0.98  # both accepts and rejections happened
    target.close()
    draft.close()


def test_caches_hold_prompt_plus_output_after_1000_speculative_tokens(tiny_llama, perturbed_llama):
    target, draft = open_llama(tiny_llama.gguf_path), open_llama(perturbed_llama)
    engine = SpeculativeEngine(target, DraftModelDrafter(draft))
    prompt_ids = target.tokenize(PROMPTS[0])
    result = engine.run(prompt_ids, GenerationParams(1100, draft_len=5))
    full = prompt_ids + result.token_ids
    assert len(result.token_ids) == 1100 and result.stats.accepted > 100
    assert target.n_past == len(full) and engine.target.tokens == full
    assert draft.n_past == len(full) and engine.drafter.sequence.tokens == full
    continued = engine.run(full, GenerationParams(32, draft_len=0)).token_ids
    fresh_target = open_llama(tiny_llama.gguf_path)
    fresh = SpeculativeEngine(fresh_target).run(full, GenerationParams(32, draft_len=0)).token_ids
    assert continued == fresh
    for backend in (target, draft, fresh_target):
        backend.close()


def test_batched_logits_match_one_token_at_a_time(tiny_qwen2):
    model = open_llama(tiny_qwen2.gguf_path)
    ids = model.tokenize("def add(a, b):\n    return a + b\n")
    batched = model.forward(ids, range(len(ids)))  # (n, V)
    model.rewind(0)
    single = np.stack([model.forward([t], [0])[0] for t in ids])
    np.testing.assert_allclose(batched, single, atol=2e-2, rtol=0)
    model.rewind(3)
    again = model.forward(ids[3:], [len(ids) - 4])[0]
    np.testing.assert_allclose(again, batched[-1], atol=2e-2, rtol=0)
    model.close()


def test_logits_are_returned_only_for_requested_rows(tiny_llama):
    model = open_llama(tiny_llama.gguf_path)
    out = model.forward(model.tokenize("abc def ghi"), [2, 4])
    assert out.shape == (2, tiny_llama.config.vocab_size)
    assert model.forward([5, 6, 7], []).shape == (0, tiny_llama.config.vocab_size)
    model.close()


def test_vocabularies_are_compared(tiny_llama, tiny_qwen2, other_vocab_model):
    llama, qwen2, other = (open_llama(p) for p in (tiny_llama.gguf_path, tiny_qwen2.gguf_path, other_vocab_model))
    check_compatible(llama, qwen2, "llama", "qwen2")  # same tokenizer, different architecture
    with pytest.raises(IncompatibleModelsError, match=r"vocabulary size 512 vs 300"):
        check_compatible(llama, other, "llama", "other")
    for backend in (llama, qwen2, other):
        backend.close()


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "not found"), (b"", "not a GGUF file"), (b"GGUF" + b"\x00" * 64, "could not load")],
)
def test_bad_model_files_are_refused(tmp_path, content, message):
    path = tmp_path / "bad.gguf"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ModelFileError, match=message):
        LlamaCppBackend(path)
