"""The engine on real backends (llama.cpp and MLX): greedy losslessness, exact rewinds, vocabularies.

Every test that takes ``backend_kind`` runs once per backend and is skipped, with
the reason, where that backend is not installed. The tiny models are opened by
kind: for llama.cpp the F32 GGUF with an F32 KV cache and flash attention off, for MLX the
float32 Hugging Face folder. In F16 (weights, cache or flash attention's accumulators) a pass
of several tokens and one-token passes round apart by up to ~1e-2 in the logits (measured on
an AVX2-only x86 CPU), far above NEAR_TIE; in float32 they agree to ~1e-5, so a divergence
the harness lets through is a true near-tie, not kernel rounding.
"""

from __future__ import annotations

import itertools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from lossless_harness import (
    REAL_RUNS,
    REAL_TOKENS,
    TREE_BRANCHES,
    assert_few_prompts_diverge,
    branches_taken,
    greedy_divergences,
    real_heads,
    real_scenario,
)
from model_factory import TinyModel, perturbed_copy, random_weights, tiny_config, tiny_tokenizer_json
from specrun.backends.base import Backend
from specrun.backends.kv import sequence_for
from specrun.control.gate import SpeculationGate
from specrun.registry.compat import check_compatible
from specrun.drafters.draft_model import DraftModelDrafter
from specrun.drafters.lookahead import LookaheadSizes
from specrun.drafters.methods import (
    METHODS, DrafterOptions, build_drafter, is_adaptive, needs_draft_model, needs_heads, uses_lookahead
)
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.errors import BackendUnavailableError, IncompatibleModelsError, ModelFileError, UsageError
from specrun.modelkit.gguf_io import write_gguf
from specrun.modelkit.hf_io import write_hf_folder
from specrun.modelkit.tokenizer import DEMO_CHAT_TEMPLATE
from specrun.mirostat import Mirostat
from specrun.sampling import SamplingSettings
from specrun.sessions.setup import method_trees, resolve_trees

BACKEND_MODULES = {"llama": "llama_cpp", "mlx": "mlx_lm"}
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


def require_backend(kind: str) -> None:
    pytest.importorskip(BACKEND_MODULES[kind], reason=f"the {kind} backend is not installed")


@pytest.fixture(params=["llama", "mlx"])
def backend_kind(request: pytest.FixtureRequest) -> str:
    """Each backend in turn, skipped with a reason when it is not installed."""
    require_backend(request.param)
    return request.param


def source_of(model: TinyModel, kind: str) -> Path:
    """The file a backend opens for a tiny model: the F32 GGUF for llama.cpp, the HF folder for MLX."""
    return model.gguf_f32_path if kind == "llama" else model.hf_dir


def open_model(kind: str, source: Path, n_ctx: int = 2048) -> Backend:
    if kind == "llama":
        from specrun.backends.llama import LlamaCppBackend

        # float32 throughout (module docstring); threads: SPECRUN_THREADS (1 in tests)
        return LlamaCppBackend(source, n_ctx=n_ctx, kv_type="f32", flash_attn=False)
    from specrun.backends.mlx import MlxBackend

    return MlxBackend(source, n_ctx=n_ctx)


def write_model(folder: Path, config, weights, tokenizer_json: str, chat_template: str | None) -> dict[str, Path]:
    """One model in both formats: {"llama": F16 GGUF, "mlx": float32 HF folder}."""
    folder.mkdir(parents=True, exist_ok=True)
    return {
        "llama": write_gguf(folder / "model.gguf", config, weights, tokenizer_json, chat_template, dtype="F16"),
        "mlx": write_hf_folder(folder / "hf", config, weights, tokenizer_json, chat_template, dtype="float32"),
    }


@pytest.fixture(scope="module")
def perturbed_llama(tiny_llama: TinyModel, tmp_path_factory) -> dict[str, Path]:
    """A draft that agrees with the llama target often but not always: its weights plus noise."""
    return perturbed_copy(tiny_llama, tmp_path_factory.mktemp("perturbed"))


@pytest.fixture(scope="module")
def other_vocab_model(tmp_path_factory) -> dict[str, Path]:
    """A model whose tokenizer has a different vocabulary."""
    config = tiny_config("llama")
    config = type(config)(**{**config.__dict__, "vocab_size": 300})
    folder = tmp_path_factory.mktemp("othervocab")
    return write_model(folder, config, random_weights(config, 3), tiny_tokenizer_json(300), None)


def diverges_at_near_ties_only(
    kind: str, target_source: Path, prompt_ids: list[int], plain: list[int], spec: list[int]
) -> bool:
    """Token-identical (False), or diverging (True) only where plain decoding in the output's
    own context has a near-tie and the output took the runner-up: every divergence along it
    is examined (lossless_harness.greedy_divergences)."""
    if spec == plain:
        return False
    fresh = open_model(kind, target_source)
    divergences = greedy_divergences(fresh, prompt_ids, spec)
    fresh.close()
    assert divergences, f"{kind}: the output differs from plain decoding's yet is the argmax everywhere"
    return True


def greedy_acceptance_over_prompts(kind: str, target: Backend, draft: Backend, target_source: Path) -> float:
    """Plain vs speculative greedy decoding on every prompt; the acceptance rate of the speculative runs."""
    engine = SpeculativeEngine(target, DraftModelDrafter(draft))  # draft_len 0 is plain decoding
    accepted = drafted = diverging = 0
    for i, text in enumerate(PROMPTS):
        prompt_ids = target.tokenize(text)
        plain = engine.run(prompt_ids, GenerationParams(N_NEW, 0), complete_cache=False).token_ids
        result = engine.run(prompt_ids, GenerationParams(N_NEW, draft_len=1 + i % 6), complete_cache=False)
        diverging += diverges_at_near_ties_only(kind, target_source, prompt_ids, plain, result.token_ids)
        accepted += result.stats.accepted
        drafted += result.stats.drafted
    assert_few_prompts_diverge(diverging, len(PROMPTS))
    return accepted / drafted


# ---- losslessness and rewinds, on both backends ------------------------------------
@pytest.mark.parametrize("draft_kind", ["same", "perturbed", "other_arch"])
def test_greedy_speculation_is_token_identical(backend_kind, draft_kind, tiny_llama, tiny_qwen2, perturbed_llama):
    target_source = source_of(tiny_llama, backend_kind)
    draft_source = {
        "same": target_source,
        "perturbed": perturbed_llama[backend_kind],
        "other_arch": source_of(tiny_qwen2, backend_kind),
    }[draft_kind]
    target, draft = open_model(backend_kind, target_source), open_model(backend_kind, draft_source)
    rate = greedy_acceptance_over_prompts(backend_kind, target, draft, target_source)
    if draft_kind == "same":
        assert rate == 1.0
    elif draft_kind == "perturbed":
        assert 0.05 < rate < 0.98  # both accepts and rejections happened
    target.close()
    draft.close()


def test_caches_hold_prompt_plus_output_after_1000_speculative_tokens(backend_kind, tiny_llama, perturbed_llama):
    target_source = source_of(tiny_llama, backend_kind)
    target, draft = open_model(backend_kind, target_source), open_model(backend_kind, perturbed_llama[backend_kind])
    engine = SpeculativeEngine(target, DraftModelDrafter(draft))
    prompt_ids = target.tokenize(PROMPTS[0])
    result = engine.run(prompt_ids, GenerationParams(1100, draft_len=5, stop_at_eos=False))
    full = prompt_ids + result.token_ids
    assert len(result.token_ids) == 1100 and result.stats.accepted > 100
    assert target.n_past == len(full) and engine.target.tokens == full
    assert draft.n_past == len(full) and engine.drafter.sequence.tokens == full
    continued = engine.run(full, GenerationParams(32, draft_len=0)).token_ids
    fresh_target = open_model(backend_kind, target_source)
    fresh = SpeculativeEngine(fresh_target).run(full, GenerationParams(32, draft_len=0)).token_ids
    assert continued == fresh
    for backend in (target, draft, fresh_target):
        backend.close()


def test_sampled_speculation_with_draft_equal_to_target_accepts_almost_everything(backend_kind, tiny_llama):
    """Draft = target under sampling: p_target = p_draft, so min(1, p/q) = 1 up to batched rounding."""
    source = source_of(tiny_llama, backend_kind)
    target, draft = open_model(backend_kind, source), open_model(backend_kind, source)
    engine = SpeculativeEngine(target, DraftModelDrafter(draft))
    sampling = SamplingSettings(temperature=0.8, seed=3)
    result = engine.run(target.tokenize(PROMPTS[2]), GenerationParams(120, draft_len=4, sampling=sampling))
    assert len(result.token_ids) == 120 or result.finish_reason == "eos"
    assert result.stats.drafted > 50 and result.stats.accepted / result.stats.drafted > 0.95
    target.close()
    draft.close()


# Every method, and the n-gram pool's trees, sampled on llama.cpp (on MLX: MLX_SAMPLED's) with the
# perturbed draft, checked by PIT and acceptance against a second copy of the target (lossless_harness). Methods
# with a draft model at temperature 1 (and once with every option, each cutting tokens the draft
# may still propose); the drafters that read the context alone at 0.3, where the random model
# repeats itself, so their one-hot drafts are accepted as well as rejected, over twice the runs.
REAL_SAMPLINGS = {
    "temp 1": SamplingSettings(temperature=1.0),
    "temp 0.3": SamplingSettings(temperature=0.3),
    "temp 0.1": SamplingSettings(temperature=0.1),
    "every option": SamplingSettings(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05),
    "mirostat": SamplingSettings(temperature=1.0, mirostat=Mirostat(2, tau=3.0, eta=0.3)),  # each row at its path's μ
}


@dataclass(frozen=True)
class RealCase:
    method: str
    sampling: str
    adaptive: bool = False  # lengths chosen as the CLI chooses them, up to 16 (auto always)
    branches: int = 0  # the n-gram pool's runner-up guesses as siblings (a tree verified in one pass)
    # MLX's passes cost ~5x llama.cpp's on these tiny models: the adaptive variants of fixed-length
    # draft-model cases run on llama.cpp only (auto is MLX's adaptive case; sampling is NumPy).
    llama_only: bool = False

    @property
    def runs(self) -> int:
        return REAL_RUNS if needs_draft_model(self.method) or self.method == "none" else 2 * REAL_RUNS

    @property
    def id(self) -> str:
        return "-".join([self.method, self.sampling, *(["adaptive"] * self.adaptive), *(["tree"] * bool(self.branches))])


def _real_cases() -> list[RealCase]:
    def sampling(method: str) -> str:
        if needs_heads(method):  # near greedy, the looping target's own future is foretold
            return "temp 0.1"
        return "temp 1" if needs_draft_model(method) or method == "none" else "temp 0.3"

    cases = [RealCase(method, sampling(method), adaptive=is_adaptive(method)) for method in METHODS]
    # Prompt lookup alone branches where the output repeats an n-gram that had different
    # continuations before; the random model's output did in none of 2339 steps (a match in
    # 49), so its tree case would be its chain case again. Its trees are verified on the fake
    # backend (lossless_harness) and on the real model (tests/trees/test_tree_real_model.py).
    cases += [RealCase(method, sampling(method), branches=TREE_BRANCHES)
              for method in METHODS if branches_taken(method) and not needs_draft_model(method) and method != "lookup"]
    return cases + [RealCase("draft", "every option"), RealCase("draft", "mirostat"),
                    RealCase("draft", "temp 1", adaptive=True, llama_only=True),
                    RealCase("lookup+draft", "temp 1", adaptive=True, llama_only=True)]


REAL_CASES = _real_cases()


def on_backends(cases: list[RealCase], name, on_mlx=lambda case: not case.llama_only) -> dict:
    """pytest.mark.parametrize's arguments: each case on each backend it runs on."""
    pairs = [(kind, case) for case in cases for kind in (("llama", "mlx") if on_mlx(case) else ("llama",))]
    return dict(argnames=("backend_kind", "case"), argvalues=pairs, ids=[f"{kind}-{name(case)}" for kind, case in pairs])


def open_target(kind: str, source: Path, case: RealCase) -> Backend:
    """The target, on llama.cpp opened for the trees the case verifies as `generate` opens it
    (--branches: branches + 1 paths; lookahead: its window's and candidates')."""
    paths = max(resolve_trees(False, None, case.branches or None).paths, method_trees(case.method).paths)
    if kind == "llama" and paths:
        from specrun.backends.llama import LlamaCppBackend

        return LlamaCppBackend(source, n_ctx=2048, tree_paths=paths)
    return open_model(kind, source)


def case_target(case: RealCase, kind: str, tiny_llama: TinyModel, looping_llama: dict[str, Path]) -> Path:
    """The target a case runs on: the random tiny model, or for a head method the looping one
    (conftest.looping_llama), whose next tokens its hidden states foretell, as a trained
    model's do (the random model's sampled output is noise no head can learn: 1% accepted)."""
    return looping_llama[kind] if needs_heads(case.method) else source_of(tiny_llama, kind)


# The methods sampled on MLX too: each reads something MLX computes in a way of its own there. The
# draft model's rows (draft; auto, the default, drafts with it), hidden rows and a head's layer
# over them (eagle; medusa and hydra read the same rows), MLX's MTP layer (mtp), lookahead's
# window, and tree passes (eagle's and mtp's trees); plain sampling (none).
MLX_SAMPLED = frozenset({"none", "draft", "auto", "eagle", "mtp", "lookahead"})


def sampled_on_mlx(case: RealCase) -> bool:
    """What the other cases add on MLX is NumPy, checked on llama.cpp here, on the fake pair
    (lossless_harness) and greedy on MLX below: drafters that read the text alone (lookup, ngram:
    one-hot drafts), medusa and hydra (eagle's rows), a chain of drafters (merging proposals, then
    sampling), the sampling options. MLX's passes cost ~5x llama.cpp's on these tiny models."""
    return not case.llama_only and case.method in MLX_SAMPLED and case.sampling not in ("every option", "mirostat")


@pytest.mark.parametrize(**on_backends(REAL_CASES, lambda case: case.id, sampled_on_mlx))
def test_sampled_speculation_with_a_disagreeing_draft_is_lossless(backend_kind, case, tiny_llama, perturbed_llama,
                                                                  looping_llama):
    """Every output token's PIT against a second copy of the target replaying the output one
    token at a time, and the acceptance count against its expectation (thresholds in
    lossless_harness); drafts verified 4 deep, and right after a full accept."""
    require_backend(backend_kind)
    target_source = case_target(case, backend_kind, tiny_llama, looping_llama)
    target, reference = open_target(backend_kind, target_source, case), open_model(backend_kind, target_source)
    draft = open_model(backend_kind, perturbed_llama[backend_kind])
    sampled, problems = real_scenario(target, draft, reference, case.method, REAL_SAMPLINGS[case.sampling],
                                      case.adaptive, runs=case.runs, branches=case.branches)
    for backend in (target, draft, reference):
        backend.close()
    assert problems == []
    seen = sampled.verified
    if case.method == "none":
        assert seen.tested == 0 and len(seen.pit) == case.runs * REAL_TOKENS
        return
    # drafts verified 4 deep, or for lookahead as deep as its candidates go (its window's deeper
    # cells are Jacobi guesses, seldom right on a random model)
    deepest = LookaheadSizes().levels if uses_lookahead(case.method) else 4
    assert seen.deepest >= deepest, seen.deepest
    assert 0 < seen.accepted < seen.tested, (seen.accepted, seen.tested)
    if case.method != "lookup":  # from the prompt alone, a full accept is rare at these runs
        assert seen.after_full_accept > 0
    if needs_draft_model(case.method):
        assert 0.1 < seen.accepted / seen.tested < 0.95, (seen.accepted, seen.tested)
    if case.branches or uses_lookahead(case.method):
        assert seen.siblings_tested > 0  # trees were verified, a sibling after a rejected one


# Chains with a head drafter (--method takes drafters joined by "+"): greedy here; sampled on the fake pair.
GREEDY_CASES = [case for case in REAL_CASES if case.method != "none" and case.sampling != "every option"] + [
    RealCase("lookup+medusa", "temp 0.1", adaptive=True), RealCase("eagle+draft", "temp 0.1")]


class NeverJudged(SpeculationGate):
    """A gate that keeps speculating whatever the steps cost."""

    def record(self, tokens, seconds, engaged, plain_pass):
        pass


@pytest.mark.parametrize(**on_backends(GREEDY_CASES, lambda case: case.id.replace(case.sampling, "greedy")))
def test_greedy_speculation_with_a_disagreeing_draft_equals_plain_decoding(backend_kind, case, tiny_llama,
                                                                           perturbed_llama, looping_llama):
    """Every method (and tree) greedy: plain decoding's tokens, or a divergence only at
    near-ties (every one examined), on four prompts; drafts were accepted and rejected.
    Greedy, the random model seldom repeats itself: on these prompts it does (lookup drafts
    on all four and has some accepted on two, on both backends)."""
    require_backend(backend_kind)
    target_source = case_target(case, backend_kind, tiny_llama, looping_llama)
    target = open_target(backend_kind, target_source, case)
    draft = open_model(backend_kind, perturbed_llama[backend_kind])
    heads = real_heads(target, case.method, SamplingSettings())
    drafter = build_drafter(case.method, draft, DrafterOptions(branches=case.branches, heads=heads))
    # Runs are timed on a clock of their own, which advances a millisecond each time it is read:
    # every pass seems to cost the same, so drafting pays and adaptive lengths and a chain's
    # gated draft model draft whatever the machine's load (on a busy machine the real clock
    # once left auto drafting nothing at all).
    # The gate still judged that clock's steps: auto ran off after its first stretch and drafted
    # 6 tokens in 160, so whether one was accepted hung on where its few drafts fell. Never judged
    # here (the gate has tests of its own), the drafters draft throughout.
    ticks = itertools.count()
    engine = SpeculativeEngine(target, drafter, method=case.method, clock=lambda: next(ticks) * 1e-3)
    engine.policy.gate = NeverJudged()
    accepted = drafted = diverging = 0
    prompts = (PROMPTS[10], PROMPTS[15], PROMPTS[5], PROMPTS[7])
    for text in prompts:
        prompt_ids = target.tokenize(text)
        plain = engine.run(prompt_ids, GenerationParams(N_NEW, 0), complete_cache=False).token_ids
        result = engine.run(prompt_ids, GenerationParams(N_NEW, 16 if case.adaptive else 4, adaptive=case.adaptive),
                            complete_cache=False)
        diverging += diverges_at_near_ties_only(backend_kind, target_source, prompt_ids, plain, result.token_ids)
        accepted += result.stats.accepted
        drafted += result.stats.drafted
    drafter.close()
    target.close()
    draft.close()
    assert_few_prompts_diverge(diverging, len(prompts))
    assert 0 < accepted < drafted


def test_batched_logits_match_one_token_at_a_time(backend_kind, tiny_qwen2):
    model = open_model(backend_kind, source_of(tiny_qwen2, backend_kind))
    ids = model.tokenize("def add(a, b):\n    return a + b\n")
    batched = model.forward(ids, range(len(ids)))  # (n, V)
    model.rewind(0)
    single = np.stack([model.forward([t], [0])[0] for t in ids])
    np.testing.assert_allclose(batched, single, atol=2e-2, rtol=0)
    model.rewind(3)
    again = model.forward(ids[3:], [len(ids) - 4])[0]
    np.testing.assert_allclose(again, batched[-1], atol=2e-2, rtol=0)
    model.close()


def test_logits_are_returned_only_for_requested_rows(backend_kind, tiny_llama):
    model = open_model(backend_kind, source_of(tiny_llama, backend_kind))
    ids = model.tokenize("abc def ghi")
    out = model.forward(ids, [2, 4])
    assert out.shape == (2, tiny_llama.config.vocab_size) and out.dtype == np.float32
    assert model.forward([5, 6, 7], []).shape == (0, tiny_llama.config.vocab_size)
    model.rewind(0)
    argmax = model.forward_argmax(ids, [4, 2])
    np.testing.assert_array_equal(argmax, out[[1, 0]].argmax(axis=-1))
    assert model.n_past == len(ids)
    assert model.forward([], []).shape == (0, tiny_llama.config.vocab_size)  # feeding nothing is a no-op
    assert model.n_past == len(ids)
    model.close()


def test_token_bytes_rebuild_the_text_exactly(backend_kind, tiny_llama):
    model = open_model(backend_kind, source_of(tiny_llama, backend_kind))
    for text in PROMPTS:
        ids = model.tokenize(text, add_bos=False)
        assert b"".join(model.token_bytes(t) for t in ids) == text.encode("utf-8")
    specials = (model.vocab.bos_id, *model.vocab.eos_ids)
    assert all(model.token_bytes(t) == b"" for t in specials)
    assert model.chat_template() == DEMO_CHAT_TEMPLATE
    model.close()


def test_vocabularies_are_compared(backend_kind, tiny_llama, tiny_qwen2, other_vocab_model):
    llama, qwen2, other = (
        open_model(backend_kind, path)
        for path in (
            source_of(tiny_llama, backend_kind),
            source_of(tiny_qwen2, backend_kind),
            other_vocab_model[backend_kind],
        )
    )
    check_compatible(llama, qwen2, "llama", "qwen2")  # same tokenizer, different architecture
    with pytest.raises(IncompatibleModelsError, match=r"vocabulary size 512 vs 300"):
        check_compatible(llama, other, "llama", "other")
    for backend in (llama, qwen2, other):
        backend.close()


# ---- bad model files ----------------------------------------------------------------
def _bad_llama_input(tmp_path: Path, content: bytes | None, tiny_llama: TinyModel) -> Path:
    path = tmp_path / "bad.gguf"
    if content is not None:
        path.write_bytes(content)
    return path


def _bad_mlx_input(tmp_path: Path, case: str, tiny_llama: TinyModel) -> Path:
    """A broken copy of the tiny llama's MLX folder."""
    if case == "missing":
        return tmp_path / "nope"
    if case == "gguf_file":
        return tiny_llama.gguf_path
    folder = tmp_path / "broken"
    shutil.copytree(tiny_llama.hf_dir, folder)
    weights = folder / "model.safetensors"
    if case == "no_config":
        (folder / "config.json").unlink()
    elif case == "no_weights":
        weights.unlink()
    elif case == "truncated_weights":
        weights.write_bytes(weights.read_bytes()[:5000])
    elif case == "unknown_arch":
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "model_type": "no_such_arch"}))
    return folder


BAD_INPUTS = [
    ("llama", None, "not found"),
    ("llama", b"", "not a GGUF file"),
    ("llama", b"GGUF" + b"\x00" * 64, "could not load"),
    ("mlx", "missing", "model folder not found"),
    ("mlx", "gguf_file", "is a file, not an MLX model folder"),
    ("mlx", "no_config", "has no config.json"),
    ("mlx", "no_weights", "has no model\\*.safetensors weights"),
    ("mlx", "truncated_weights", "corrupt or truncated safetensors"),
    ("mlx", "unknown_arch", "no_such_arch"),
]


@pytest.mark.parametrize(("kind", "case", "message"), BAD_INPUTS)
def test_bad_model_files_are_refused(tmp_path, tiny_llama, kind, case, message):
    require_backend(kind)
    make_input = _bad_llama_input if kind == "llama" else _bad_mlx_input
    path = make_input(tmp_path, case, tiny_llama)
    with pytest.raises(ModelFileError, match=message) as caught:
        open_model(kind, path)
    assert "\n" not in caught.value.one_line()


# ---- MLX only: the two backends agree, and caches that cannot be trimmed ----------------
def test_mlx_and_llama_agree_on_vocabulary_and_logits(tiny_models):
    require_backend("llama")
    require_backend("mlx")
    for model in tiny_models.values():
        llama, mlx = open_model("llama", model.gguf_f32_path), open_model("mlx", model.hf_dir)
        assert mlx.vocab == llama.vocab
        assert all(mlx.token_text(t) == llama.token_text(t) for t in range(mlx.vocab.size))
        assert all(mlx.token_bytes(t) == llama.token_bytes(t) for t in range(mlx.vocab.size))
        if model.config.arch == "llama":
            # transformers 5 swaps in Qwen2's own pre-tokenizer regex for any qwen2 model, so the
            # tiny qwen2 folder splits "\n    " differently from its GGUF (GPT-2 regex).
            for text in PROMPTS:
                assert mlx.tokenize(text) == llama.tokenize(text), text
        ids = llama.tokenize("".join(PROMPTS[:6]))
        logits_llama = llama.forward(ids, range(len(ids)))  # (n, V)
        logits_mlx = mlx.forward(ids, range(len(ids)))  # (n, V)
        # llama.cpp keeps its KV cache in F16, so the two agree to about 1e-2, not to float32 rounding.
        np.testing.assert_allclose(logits_mlx, logits_llama, atol=5e-2, rtol=0)
        top2 = np.sort(logits_llama, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 0.1
        np.testing.assert_array_equal(logits_mlx.argmax(-1)[clear], logits_llama.argmax(-1)[clear])
        llama.close()
        mlx.close()


def test_mlx_drops_padded_embedding_rows(tiny_llama, tmp_path):
    """Embeddings padded past the tokenizer (Qwen2.5: 151936 rows, 151665 tokens): logits cover the tokenizer only."""
    require_backend("mlx")
    config = type(tiny_llama.config)(**{**tiny_llama.config.__dict__, "vocab_size": 520})
    padding = np.zeros((8, config.hidden_size), np.float32)
    weights = dict(tiny_llama.weights)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[name] = np.concatenate([weights[name], padding])  # (520, hidden)
    folder = write_hf_folder(tmp_path / "padded", config, weights, tiny_llama.tokenizer_json, dtype="float32")
    padded = open_model("mlx", folder)
    plain = open_model("mlx", tiny_llama.hf_dir)
    ids = plain.tokenize(PROMPTS[0])
    assert padded.vocab.size == 512
    # a BLAS may sum by the matrix's shape (OpenBLAS: 2e-6 apart here); a dropped or shifted row is off by units
    np.testing.assert_allclose(padded.forward(ids, [0, len(ids) - 1]), plain.forward(ids, [0, len(ids) - 1]),
                               rtol=0, atol=1e-5)
    padded.close()
    plain.close()


def test_mlx_token_bytes_of_a_sentencepiece_vocabulary():
    """▁ is a space, <0xNN> is one raw byte, control tokens give nothing."""
    require_backend("mlx")
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from specrun.backends.mlx import TokenBytes

    pieces = ["<unk>", "<s>", "</s>", "<0x0A>", "<0xC3>", "<0xA9>", "\u2581Hello", "\u2581w", "orld"]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    token_bytes = TokenBytes(hf)
    assert [token_bytes(i) for i in range(9)] == [b"", b"", b"", b"\n", b"\xc3", b"\xa9", b" Hello", b" w", b"orld"]


@pytest.fixture(scope="module")
def uncuttable_models(tiny_llama: TinyModel, tmp_path_factory) -> dict[str, Path]:
    """MLX folders whose caches cannot simply be trimmed.

    sliding: the tiny llama with a 24-token sliding window on its first layer
    (mlx-lm gives that layer a RotatingKVCache); mamba: a tiny random Mamba whose
    cache is recurrent state (ArraysCache).
    """
    require_backend("mlx")
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import mamba

    root = tmp_path_factory.mktemp("uncuttable")
    sliding = root / "sliding"
    shutil.copytree(tiny_llama.hf_dir, sliding)
    config = json.loads((sliding / "config.json").read_text())
    config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=24)
    (sliding / "config.json").write_text(json.dumps(config))

    recurrent = root / "mamba"
    recurrent.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama.hf_dir / name, recurrent / name)
    args = dict(
        model_type="mamba", vocab_size=512, hidden_size=64, intermediate_size=128, state_size=8,
        num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=4,
    )
    mx.random.seed(0)
    weights = dict(tree_flatten(mamba.Model(mamba.ModelArgs(**args)).parameters()))
    for name, value in weights.items():
        # mlx's default init makes the mixers negligible, so the model just repeats its input:
        # projections at std 2/sqrt(fan_in) give varied greedy output.
        if name.endswith(("in_proj.weight", "x_proj.weight", "out_proj.weight")):
            weights[name] = 2.0 / value.shape[-1] ** 0.5 * mx.random.normal(value.shape)
    mx.save_safetensors(str(recurrent / "model.safetensors"), weights)
    (recurrent / "config.json").write_text(json.dumps({**args, "bos_token_id": 1, "eos_token_id": 2}))
    return {"sliding": sliding, "mamba": recurrent}


@pytest.mark.parametrize("arch", ["sliding", "mamba"])
def test_mlx_caches_that_cannot_be_trimmed_rewind_through_checkpoints(uncuttable_models, arch):
    source = uncuttable_models[arch]
    model = open_model("mlx", source)
    assert model.needs_checkpoints
    ids = model.tokenize(PROMPTS[3] * 3)  # longer than the 24-token window
    full = model.forward(ids, range(len(ids)))  # (n, V)
    for n_keep in (len(ids) - 2, 30, 5, 0):
        model.rewind(n_keep)
        assert model.n_past == n_keep
        if n_keep:
            np.testing.assert_allclose(model.forward(ids[n_keep:], [0])[0], full[n_keep], atol=1e-4, rtol=0)
            model.rewind(n_keep)
    model.close()


@pytest.mark.parametrize("arch", ["sliding", "mamba"])
def test_mlx_caches_no_gated_deltanet_holds_are_not_rolled_back_within_a_pass(uncuttable_models, arch):
    """A sliding window's cache beside attention, Mamba's recurrent state: no snapshotter
    (backends/mlx_snapshots.py reads Gated DeltaNet mixers only), so their rewinds replay."""
    model = open_model("mlx", uncuttable_models[arch])
    assert model.needs_checkpoints and model._snapshotter is None
    model.close()


@pytest.mark.parametrize("arch", ["sliding", "mamba"])
def test_mlx_checkpoints_are_bounded_in_bytes_and_rewinds_past_the_thinned_ones_stay_exact(
        uncuttable_models, arch, monkeypatch):
    """A real model's checkpoint weighs 100s of MB: the kept ones are bounded by CHECKPOINT_BYTES
    (never fewer than MIN_CHECKPOINTS), older ones thinned, and a rewind to any point, one
    between thinned checkpoints or before them all, leaves the cache as a fresh one fed the kept tokens."""
    from specrun.backends import mlx as mlx_backend

    source = uncuttable_models[arch]
    model, fresh = open_model("mlx", source), open_model("mlx", source)
    ids = model.tokenize(PROMPTS[3] * 3)[:60]  # past the 24-token window
    model.forward(ids[:30], [0])
    model.forward(ids[30:31], [0])  # its checkpoint holds a full window or the recurrent state
    one = mlx_backend._state_bytes(model._checkpoints[-1].layer_states)
    assert one > 0
    monkeypatch.setattr(mlx_backend, "CHECKPOINT_BYTES", 6 * one + one // 2)
    for at in range(31, len(ids)):  # one pass a token, as plain decoding and a draft model's drafting feed
        model.forward(ids[at : at + 1], [0])
        assert sum(checkpoint.nbytes for checkpoint in model._checkpoints) <= mlx_backend.CHECKPOINT_BYTES
    assert len(model._checkpoints) < 12  # of 31 passes (a sliding window's weigh less once it wraps)
    positions = [checkpoint.n_past for checkpoint in model._checkpoints]
    assert positions[-2:] == [len(ids) - 2, len(ids) - 1] and positions[0] > 0
    full = fresh.forward(ids, range(len(ids)))
    for n_keep in (len(ids) - 1, len(ids) - 4, positions[1] - 1, positions[0] + 1, 3):
        model.rewind(n_keep)
        np.testing.assert_allclose(model.forward(ids[n_keep:], [0])[0], full[n_keep], atol=1e-4, rtol=0)
    monkeypatch.setattr(mlx_backend, "CHECKPOINT_BYTES", 1)  # each weighs more than the budget: the floor
    for at in range(len(ids), len(ids) + 10):
        model.forward(ids[at % len(ids) : at % len(ids) + 1], [0])
    assert len(model._checkpoints) == mlx_backend.MIN_CHECKPOINTS
    model.close()
    fresh.close()


def test_checkpoints_thin_out_geometrically_so_a_rewind_replays_about_as_far_as_it_goes():
    """checkpoint_to_drop over 3,000 one-token passes: the newest two always kept, and a rewind of
    any d tokens finds a checkpoint within a few d of where it lands (8 kept), never the start."""
    from specrun.backends.mlx import checkpoint_to_drop

    positions: list[int] = []
    worst = 0.0
    for now in range(1, 3001):
        positions.append(now - 1)
        while len(positions) > 8:
            del positions[checkpoint_to_drop(positions, now)]
        assert positions[-2:] == [now - 2, now - 1][-len(positions):]
        if now >= 100:
            for d in range(1, now):
                newest = max((p for p in positions if p <= now - d), default=0)
                worst = max(worst, (now - d - newest) / d)
    assert positions == sorted(positions) and worst <= 7.0
    with pytest.raises(ValueError):
        checkpoint_to_drop([0, 1], 2)


@pytest.mark.parametrize("arch", ["sliding", "mamba"])
def test_mlx_greedy_speculation_is_lossless_on_untrimmable_caches(uncuttable_models, arch):
    source = uncuttable_models[arch]
    target, draft = open_model("mlx", source), open_model("mlx", source)
    engine = SpeculativeEngine(target, DraftModelDrafter(draft))
    diverging = 0
    for text in PROMPTS[:4]:
        prompt_ids = target.tokenize(text)
        plain = engine.run(prompt_ids, GenerationParams(80, 0, stop_at_eos=False), complete_cache=False)
        assert len(set(plain.token_ids)) > 20  # varied output, so a wrong restore would show
        spec = engine.run(prompt_ids, GenerationParams(80, draft_len=5, stop_at_eos=False))
        diverging += diverges_at_near_ties_only("mlx", source, prompt_ids, plain.token_ids, spec.token_ids)
        assert spec.stats.accepted / spec.stats.drafted > 0.9
        assert target.n_past == draft.n_past == len(prompt_ids) + 80
    assert_few_prompts_diverge(diverging, 4)
    target.close()
    draft.close()


@pytest.mark.parametrize("arch", ["llama", "sliding"])
def test_mlx_forward_greedy_equals_successive_argmax(tiny_llama, uncuttable_models, arch):
    """Greedy ids chained on the device: the same ids and the same cache as one forward_argmax per id."""
    source = tiny_llama.hf_dir if arch == "llama" else uncuttable_models[arch]
    chained, stepwise = open_model("mlx", source), open_model("mlx", source)
    ids = chained.tokenize(PROMPTS[0])
    got = chained.forward_greedy(ids, 6)  # (6,)
    expected = [int(stepwise.forward_argmax(ids, [len(ids) - 1])[0])]
    while len(expected) < 6:
        expected.append(int(stepwise.forward_argmax(expected[-1:], [0])[0]))
    assert got.tolist() == expected
    assert chained.n_past == stepwise.n_past == len(ids) + 5
    np.testing.assert_array_equal(chained.forward(expected[-1:], [0]), stepwise.forward(expected[-1:], [0]))
    chained.close()
    stepwise.close()


@pytest.mark.parametrize("arch", ["llama", "sliding", "mamba"])
def test_mlx_plain_decoding_reads_ahead_with_the_ids_and_cache_of_one_pass_a_step(tiny_llama, uncuttable_models, arch):
    """Plain greedy steps queue the next step's pass on their own id (mlx-lm's loop): the same ids
    as one forward_argmax a step, the same cache after, and a rewind past an id read ahead (a
    checkpoint restored, where the cache cannot be trimmed) leaves the cache as it was."""
    source = tiny_llama.hf_dir if arch == "llama" else uncuttable_models[arch]
    ahead, stepwise = open_model("mlx", source), open_model("mlx", source)
    assert ahead.reads_ahead
    calls = []
    real = ahead.forward_argmax_ahead
    ahead.forward_argmax_ahead = lambda token, queue=True: calls.append(token) or real(token, queue)
    ids = ahead.tokenize(PROMPTS[1] * 2)  # past the sliding window of 24
    result = SpeculativeEngine(ahead).run(ids, GenerationParams(40, 0, stop_at_eos=False))
    expected = [int(stepwise.forward_argmax(ids, [len(ids) - 1])[0])]
    while len(expected) < 40:
        expected.append(int(stepwise.forward_argmax(expected[-1:], [0])[0]))
    assert list(result.token_ids) == expected and len(set(expected)) > 5
    assert calls.count(None) == 38  # every step after the second continued a queued pass
    stepwise.forward(expected[-1:], [])  # the engine's finished cache holds the last id too
    assert ahead.n_past == stepwise.n_past == len(ids) + 40
    sequence = sequence_for(ahead)  # the engine's view of the cache
    np.testing.assert_array_equal(sequence.feed([5, 6, 7], [2]), stepwise.forward([5, 6, 7], [2]))
    first, _ = sequence.feed_argmax_ahead(9)
    second, queued = sequence.feed_argmax_ahead(first)
    assert queued and ahead.n_past == stepwise.n_past + 3  # 9, first, and second read ahead
    sequence.rewind(stepwise.n_past)  # back past everything read ahead
    np.testing.assert_array_equal(sequence.feed([9], [0]), stepwise.forward([9], [0]))
    ahead.close()
    stepwise.close()


@pytest.mark.parametrize("arch", ["llama", "sliding"])  # mlx-lm's mamba gives no hidden states
@pytest.mark.parametrize("layers", [(), (0, 1)])
def test_mlx_reading_ahead_while_tracking_keeps_the_states_a_step_at_a_time_keeps(tiny_llama, uncuttable_models,
                                                                                   arch, layers):
    """A head drafter's plain steps read ahead too: each queued pass keeps the state of the token
    it fed (the output head's input, or EAGLE-3's layer outputs), as one tracked pass a step does."""
    source = tiny_llama.hf_dir if arch == "llama" else uncuttable_models[arch]
    ahead, stepwise = open_model("mlx", source), open_model("mlx", source)
    tracked, plain = sequence_for(ahead), sequence_for(stepwise)
    ids = ahead.tokenize(PROMPTS[1] * 2)  # past the sliding window of 24
    for sequence in (tracked, plain):
        sequence.track_hidden(True, layers=layers)
        sequence.feed(ids[:-1])
    assert tracked.can_read_ahead
    token, _ = tracked.feed_argmax_ahead(ids[-1])
    expected = [int(plain.feed_argmax(ids[-1:], [0])[0])]
    for _ in range(12):
        token, queued = tracked.feed_argmax_ahead(token)
        assert queued
        expected.append(int(plain.feed_argmax(expected[-1:], [0])[0]))
    assert tracked.tokens == plain.tokens and token == expected[-1]  # the last id read ahead, not yet in
    np.testing.assert_allclose(tracked.hidden(0, len(tracked)), plain.hidden(0, len(plain)), rtol=1e-5, atol=1e-5)
    plain.feed_argmax([token], [0])  # a text going on with the id read ahead keeps it, its state read
    assert tracked.rewind_to_prefix_of(plain.tokens) == len(plain) and not tracked.reading_ahead
    np.testing.assert_allclose(tracked.hidden(0, len(tracked)), plain.hidden(0, len(plain)), rtol=1e-5, atol=1e-5)
    tracked.rewind(len(ids))  # back past what was read ahead: the cache as one pass a step leaves it
    plain.rewind(len(ids))
    np.testing.assert_allclose(tracked.feed([9], [0]), plain.feed([9], [0]), rtol=1e-5, atol=1e-5)
    ahead.close()
    stepwise.close()


@pytest.mark.parametrize("arch", ["llama", "sliding", "mamba"])
@pytest.mark.parametrize("at", ["fed", "queued"])
def test_mlx_an_interrupt_while_reading_ahead_leaves_the_cache_as_its_tokens_say(tiny_llama, uncuttable_models,
                                                                                   arch, at, monkeypatch):
    """Ctrl-C lands while the host waits for a step's id, after the next pass was built (every
    layer's cache moved on): the rewind that follows must take back what every layer holds."""
    source = tiny_llama.hf_dir if arch == "llama" else uncuttable_models[arch]
    ahead, stepwise = open_model("mlx", source), open_model("mlx", source)
    ids = ahead.tokenize(PROMPTS[2] * 2)
    sequence = sequence_for(ahead)
    sequence.feed(ids[:-1])
    stepwise.forward(ids[:-1], [])
    first, _ = sequence.feed_argmax_ahead(ids[-1])
    passes = []
    real = type(ahead)._ahead_pass

    def interrupted(self, token, host_id, *shaping):
        result = real(self, token, host_id, *shaping)
        passes.append(host_id)
        if (at == "fed") == (host_id != -1):
            raise KeyboardInterrupt  # after the pass was built, before the host has its id
        return result

    monkeypatch.setattr(type(ahead), "_ahead_pass", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sequence.feed_argmax_ahead(first if at == "queued" else (first + 1) % ahead.vocab.size)
    monkeypatch.undo()
    assert ahead.n_past == len(sequence.tokens) and not sequence.reading_ahead
    offsets = {layer.offset for layer in ahead._cache if hasattr(layer, "offset")}
    assert offsets <= {ahead.n_past} or arch == "sliding"  # a rotating layer's offset counts on past its window
    stepwise.forward([ids[-1]], [])
    assert ahead.n_past == stepwise.n_past
    np.testing.assert_array_equal(sequence.feed([4, 5], [1]), stepwise.forward([4, 5], [1]))
    ahead.close()
    stepwise.close()


def test_mlx_forward_greedy_reads_a_drafters_two_pending_tokens_with_its_first_pass(tiny_llama):
    """After a full accept a draft model reads its last draft and the bonus token: both go in
    with the first greedy pass (one pass fewer than feeding them apart), ids and cache unchanged."""
    joined, apart = open_model("mlx", tiny_llama.hf_dir), open_model("mlx", tiny_llama.hf_dir)
    ids = joined.tokenize(PROMPTS[2])
    joined.forward(ids, [])
    apart.forward(ids, [])
    got = joined.forward_greedy([7, 9], 4)  # (4,)
    apart.forward([7], [])
    expected = [int(apart.forward_argmax([9], [0])[0])]
    while len(expected) < 4:
        expected.append(int(apart.forward_argmax(expected[-1:], [0])[0]))
    assert got.tolist() == expected
    assert joined.n_past == apart.n_past == len(ids) + 2 + 3
    np.testing.assert_array_equal(joined.forward(expected[-1:], [0]), apart.forward(expected[-1:], [0]))
    joined.close()
    apart.close()


def test_mlx_draft_and_verify_run_as_one_graph_and_stay_lossless(tiny_llama, perturbed_llama):
    """Greedy, fixed draft length, MLX on both sides: the verify pass is built on the draft's
    ids still on the device (one host sync a step, as in mlx-lm), with the same output."""
    target, draft = open_model("mlx", tiny_llama.hf_dir), open_model("mlx", perturbed_llama["mlx"])
    fused_calls = []
    real = target.forward_argmax_after
    target.forward_argmax_after = lambda tokens, deferred: fused_calls.append(len(deferred)) or real(tokens, deferred)
    engine = SpeculativeEngine(target, DraftModelDrafter(draft))
    diverging = 0
    for text in PROMPTS[:6]:
        prompt_ids = target.tokenize(text)
        plain = engine.run(prompt_ids, GenerationParams(60, 0, stop_at_eos=False)).token_ids
        spec = engine.run(prompt_ids, GenerationParams(60, draft_len=4, stop_at_eos=False))
        diverging += diverges_at_near_ties_only("mlx", tiny_llama.hf_dir, prompt_ids, plain, spec.token_ids)
        full = prompt_ids + spec.token_ids
        assert target.n_past == draft.n_past == len(full)
        assert engine.target.tokens == engine.drafter.sequence.tokens == full
    assert_few_prompts_diverge(diverging, 6)
    assert fused_calls and set(fused_calls) <= {1, 2, 3, 4}
    assert 0.05 < spec.stats.acceptance_rate < 1.0
    target.close()
    draft.close()


def test_mlx_deferred_ids_settle_when_the_draft_model_is_next_used(tiny_llama):
    """Ids left on the device (say an interrupt came before the target read them) are
    recorded by the backend's next use, so its cache and token list stay in step."""
    from specrun.backends.kv import KVSequence

    model = open_model("mlx", tiny_llama.hf_dir)
    sequence = KVSequence(model)
    ids = model.tokenize(PROMPTS[1])
    deferred = sequence.feed_greedy_deferred(ids, 3)
    assert model.n_past == len(ids) + 2  # reading n_past resolved them
    assert sequence.tokens == ids + deferred.resolve()[:-1].tolist()
    sequence.rewind(len(ids))
    assert model.n_past == len(sequence) == len(ids)
    model.close()


# ---- choosing a backend ---------------------------------------------------------------
@pytest.fixture
def on_platform(monkeypatch):
    """Pretend to run on (system, machine) with the given backends installed."""

    def pretend(system: str, machine: str, installed: tuple[str, ...] = ("llama_cpp", "mlx_lm")) -> None:
        import importlib.util
        import platform

        real_find_spec = importlib.util.find_spec

        def find_spec(name, *args):
            hidden = name in BACKEND_MODULES.values() and name not in installed
            return None if hidden else real_find_spec(name, *args)

        monkeypatch.setattr(platform, "system", lambda: system)
        monkeypatch.setattr(platform, "machine", lambda: machine)
        monkeypatch.setattr(importlib.util, "find_spec", find_spec)

    return pretend


def test_auto_prefers_mlx_on_apple_silicon_when_the_model_has_an_mlx_source(on_platform, tiny_llama):
    from specrun.registry.loading import choose_backend
    from specrun.registry.catalog import load_registry

    entries = load_registry()
    on_platform("Darwin", "arm64")
    assert choose_backend("auto", str(tiny_llama.hf_dir), entries) == "mlx"
    assert choose_backend("auto", "demo-target", entries) == "mlx"
    assert choose_backend("auto", "mlx-community/Qwen2.5-0.5B-Instruct-4bit", entries) == "mlx"
    assert choose_backend("auto", str(tiny_llama.gguf_path), entries) == "llama"
    on_platform("Linux", "x86_64")
    assert choose_backend("auto", "demo-target", entries) == "llama"
    assert choose_backend("auto", str(tiny_llama.gguf_path), entries) == "llama"
    assert choose_backend("auto", str(tiny_llama.hf_dir), entries) == "mlx"  # its only source
    on_platform("Darwin", "arm64", installed=("llama_cpp",))
    assert choose_backend("auto", "demo-target", entries) == "llama"


def test_a_missing_backend_is_named_with_its_pip_extra(on_platform, tiny_llama):
    from specrun.registry.loading import choose_backend

    on_platform("Linux", "x86_64", installed=("llama_cpp",))
    with pytest.raises(BackendUnavailableError) as missing_mlx:
        choose_backend("mlx")
    expected = "the mlx backend is not installed; install it with: pip install 'specrun[mlx]'"
    assert missing_mlx.value.one_line() == expected
    with pytest.raises(BackendUnavailableError, match=r"the mlx backend this model needs") as needed:
        choose_backend("auto", str(tiny_llama.hf_dir), {})
    assert "pip install 'specrun[mlx]'" in needed.value.one_line()
    on_platform("Darwin", "arm64", installed=("mlx_lm",))
    with pytest.raises(BackendUnavailableError) as missing_llama:
        choose_backend("llama")
    assert "pip install 'specrun[llama]'" in missing_llama.value.one_line()
    with pytest.raises(UsageError, match="unknown backend 'tpu'"):
        choose_backend("tpu")


def test_resolve_mlx_finds_folders_aliases_and_repo_ids(tiny_llama, tmp_path, monkeypatch):
    import specrun.registry.hub
    from specrun.errors import RegistryError
    from specrun.registry.loading import resolve_mlx
    from specrun.registry.catalog import parse_registry

    monkeypatch.setattr(specrun.registry.hub, "cached_mlx", lambda entry: Path("/hub-cache") / entry.mlx_repo)

    registry = tmp_path / "models.toml"
    registry.write_text(
        f'[models.local]\nmlx_path = "{tiny_llama.hf_dir}"\n'
        '[models.hub]\nmlx_repo = "mlx-community/Some-Model-4bit"\n'
        '[models.gguf-only]\ngguf_path = "/x/model.gguf"\n'
    )
    entries = parse_registry(registry)
    assert resolve_mlx(str(tiny_llama.hf_dir), entries) == str(tiny_llama.hf_dir)
    assert resolve_mlx("local", entries) == str(tiny_llama.hf_dir)
    assert resolve_mlx("hub", entries) == "/hub-cache/mlx-community/Some-Model-4bit"
    assert resolve_mlx("owner/repo", entries) == "/hub-cache/owner/repo"
    assert resolve_mlx(str(tmp_path / "gone"), entries) == str(tmp_path / "gone")  # MlxBackend names it
    with pytest.raises(RegistryError, match="'gguf-only' has no MLX source"):
        resolve_mlx("gguf-only", entries)
    with pytest.raises(RegistryError, match="unknown model 'nothing'"):
        resolve_mlx("nothing", entries)


# ---- the demo pair on MLX -----------------------------------------------------------------
def test_the_demo_pair_on_mlx_is_lossless_for_every_method_and_rewinds_exactly():
    """The shipped pair through mlx-lm: every speculative method (and draft = target) gives
    plain decoding's tokens, and both caches end holding exactly prompt + output."""
    require_backend("mlx")
    from specrun.backends.mlx import MlxBackend
    from specrun.drafters.methods import build_drafter
    from specrun.modelkit.demo import demo_mlx_dir
    from specrun.sessions.prompts import heldout_code_prompts

    target_dir = demo_mlx_dir("demo-target")
    target, draft = MlxBackend(target_dir, n_ctx=1024), MlxBackend(demo_mlx_dir("demo-draft"), n_ctx=1024)
    same = MlxBackend(target_dir, n_ctx=1024)  # draft = target
    diverging = checked = 0
    for text in heldout_code_prompts(2, lines=6):
        ids = target.tokenize(text)
        plain = SpeculativeEngine(target).run(ids, GenerationParams(32, 0)).token_ids
        runs = [(m, draft, k) for m, k in (("draft", 4), ("lookup", 4), ("lookup+draft", 3), ("auto", 8))]
        for method, draft_model, draft_len in [*runs, ("draft", same, 5)]:
            engine = SpeculativeEngine(target, build_drafter(method, draft_model), method=method)
            result = engine.run(ids, GenerationParams(32, draft_len, adaptive=method == "auto"))
            diverging += diverges_at_near_ties_only("mlx", target_dir, ids, plain, result.token_ids)
            checked += 1
            full = ids + result.token_ids
            assert target.n_past == len(full) and engine.target.tokens == full, method
            if draft_model is same:
                assert result.stats.acceptance_rate == 1.0
            for member in getattr(engine.drafter, "drafters", (engine.drafter,)):
                if hasattr(member, "sequence"):  # a draft model's cache
                    assert member.sequence.tokens == full, method
    assert_few_prompts_diverge(diverging, checked)
    for backend in (target, draft, same):
        backend.close()
