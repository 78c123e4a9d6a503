"""The shipped demo pair and the variants derived from it."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from test_modelkit import PARITY_STRINGS  # noqa: E402
from specrun.backends.llama import LlamaCppBackend  # noqa: E402
from specrun.sessions.compare import find_mismatch  # noqa: E402
from specrun.engine.loop import GenerationParams, SpeculativeEngine  # noqa: E402
from specrun.errors import SpecrunError  # noqa: E402
from specrun.modelkit import demo  # noqa: E402
from specrun.sessions.prompts import heldout_code_prompts  # noqa: E402


@pytest.fixture(scope="module")
def derived(tmp_path_factory):
    """Derive the demo variants into a fresh cache, as a first run on a new machine does."""
    cache = tmp_path_factory.mktemp("specrun-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECRUN_CACHE", str(cache))
        yield {name: demo.demo_gguf(name) for name in demo.DEMO_MODELS}, cache


def test_shipped_files_fit_the_budget():
    total = sum(demo.shipped_gguf(name).stat().st_size for name in ("demo-target", "demo-draft"))
    assert total <= 40_000_000


def test_derived_files_are_cached_by_source_hash(derived):
    paths, cache = derived
    assert paths["demo-target-xl"].is_relative_to(cache)
    assert demo.demo_gguf("demo-target-xl") == paths["demo-target-xl"]  # second call: no work
    assert not list(cache.rglob(".deriving-*"))  # nothing half-written left behind


def test_xl_target_generates_what_the_demo_target_generates(derived):
    paths, _ = derived
    small = LlamaCppBackend(paths["demo-target"], n_ctx=1024)
    wide = LlamaCppBackend(paths["demo-target-xl"], n_ctx=1024)
    for text in heldout_code_prompts(4, lines=6):
        prompt = small.tokenize(text)
        expected = SpeculativeEngine(small).run(prompt, GenerationParams(24, 0)).token_ids
        got = SpeculativeEngine(wide).run(prompt, GenerationParams(24, 0)).token_ids
        if got != expected:  # allowed only at a measured near-tie of the small target
            assert find_mismatch(small, 0, prompt, expected, got).near_tie
    small.close()
    wide.close()


def test_demo_tokenizer_matches_llama_cpp():
    tokenizers = pytest.importorskip("tokenizers")
    from specrun.modelkit.gguf_io import read_gguf

    _, _, tokenizer_json, _ = read_gguf(demo.shipped_gguf("demo-draft"))
    hf = tokenizers.Tokenizer.from_str(tokenizer_json)
    model = LlamaCppBackend(demo.shipped_gguf("demo-draft"), n_ctx=256)
    for text in PARITY_STRINGS:
        assert model.tokenize(text, add_bos=True) == hf.encode(text).ids, text
    model.close()


def test_demo_pair_continues_python_plausibly(derived):
    paths, _ = derived
    target = LlamaCppBackend(paths["demo-target"], n_ctx=1024)
    prompt = target.tokenize("import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n")
    text = SpeculativeEngine(target).run(prompt, GenerationParams(48, 0)).text
    target.close()
    assert np.mean([c.isprintable() or c in "\n\t" for c in text]) > 0.95
    assert "self" in text and "def " in text


def test_exact_settings_make_greedy_speculation_bit_identical(derived):
    """The bench's one divergence beyond a near-tie (built-in prompt edit-counter, Q8_0 target)
    comes from F16 KV rounding of batched keys; flash attention on a CPU rounds batches
    differently too. Under --exact (an F32 cache, flash attention off) every method matches plain."""
    from specrun.bench.suite import BUILTIN_SUITE
    from specrun.registry.loading import LoadOptions, open_backend
    from specrun.drafters.methods import build_drafter

    paths, _ = derived
    text = next(p for p in BUILTIN_SUITE if p.prompt_id == "edit-counter").text
    exact = LoadOptions(backend="llama", n_ctx=1024, exact=True)
    target = open_backend(str(paths["demo-target"]), exact)
    draft = open_backend(str(paths["demo-draft"]), exact)
    assert (target.kv_type, target.flash_attn) == ("f32", False)
    ids = target.tokenize(text)
    plain = SpeculativeEngine(target).run(ids, GenerationParams(96, 0)).token_ids
    for method, draft_len in (("draft", 1), ("draft", 4), ("lookup+draft", 4)):
        engine = SpeculativeEngine(target, build_drafter(method, draft), method=method)
        assert engine.run(ids, GenerationParams(96, draft_len)).token_ids == plain, (method, draft_len)
    target.close()
    draft.close()
    with pytest.raises(ValueError, match="kv_type"):
        LlamaCppBackend(paths["demo-draft"], kv_type="q4")


@pytest.mark.slow
def test_the_widened_real_target_s_heads_derive_from_the_f16_copy_s(smollm2, tmp_path, monkeypatch):
    """Where heads of smollm2-135m-f16 ship, smollm2-135m-x2's are derived from them, every kind:
    EAGLE-3's fc reads each layer's first 576 columns as before (zeros after them), with the F16
    copy's embedding rows of their own; Medusa's are padded with zeros. Both made for the widened
    target, found where heads are looked for; other copies get none."""
    import specrun.demo
    from heads_factory import eagle3_heads, random_heads
    from specrun.heads.eagle3 import Eagle3Heads
    from specrun.heads.files import load_heads, save_eagle3, save_heads
    from specrun.modelkit import smollm2 as real
    from specrun.modelkit.gguf_io import read_gguf_tensor
    from specrun.registry.heads import find_heads, shipped_heads_path

    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path / "cache"))
    package = tmp_path / "package"
    package.mkdir()
    monkeypatch.setattr(specrun.demo, "__file__", str(package / "__init__.py"))
    shipped = package / "smollm2-135m-f16.eagle3"
    trained = eagle3_heads(576, 49152, draft_vocab=range(64), aux=(1, 14, 26), embed_tokens=None)
    save_eagle3(trained, shipped)
    medusa = random_heads(576, 49152, num_heads=2, draft_vocab=range(64))
    save_heads(medusa, package / "smollm2-135m-f16.medusa.safetensors")
    assert shipped_heads_path("smollm2-135m-f16", "eagle3") == shipped
    derived = shipped_heads_path("smollm2-135m-x2", "eagle3")
    assert derived != shipped and derived.is_relative_to(tmp_path / "cache")
    wide = load_heads(derived)
    assert isinstance(wide, Eagle3Heads)
    assert wide.config.hidden_size == 1152 and wide.config.target_name == "smollm2-135m-x2"
    assert wide.fc.shape == (576, 3 * 1152)
    for slot in range(3):
        np.testing.assert_allclose(wide.fc[:, slot * 1152:slot * 1152 + 576],
                                   trained.fc[:, slot * 576:(slot + 1) * 576], atol=1e-3, rtol=1e-3)
        assert not wide.fc[:, slot * 1152 + 576:(slot + 1) * 1152].any()
    embedding = read_gguf_tensor(real.smollm2_gguf("smollm2-135m-f16"), "token_embd.weight")
    np.testing.assert_allclose(wide.embed_tokens, embedding, atol=1e-3)
    wide_medusa = find_heads("smollm2-135m-x2", None, "medusa")
    assert wide_medusa.is_relative_to(tmp_path / "cache") and wide_medusa.is_dir()
    loaded = load_heads(wide_medusa)
    assert loaded.config.hidden_size == 1152 and loaded.config.target_name == "smollm2-135m-x2"
    np.testing.assert_allclose(loaded.lm_heads[0][:, :576], medusa.lm_heads[0], atol=1e-2, rtol=1e-3)
    assert not loaded.lm_heads[0][:, 576:].any()
    made = (wide_medusa / "medusa.safetensors").stat().st_mtime_ns
    assert find_heads("smollm2-135m-x2", None, "medusa") == wide_medusa
    assert (wide_medusa / "medusa.safetensors").stat().st_mtime_ns == made  # derived once, then used
    assert not shipped_heads_path("smollm2-135m", "eagle3").exists()  # only the F16 copy's and its widening
    with pytest.raises(SpecrunError, match="no hydra heads"):
        find_heads("smollm2-135m-x2", None, "hydra")  # none shipped, none derived
