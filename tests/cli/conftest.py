"""Fixtures the CLI tests share: the tiny llama with a draft that disagrees with it now and then."""

from __future__ import annotations

import pytest

from model_factory import perturbed_copy

BACKEND_MODULES = {"llama": "llama_cpp", "mlx": "mlx_lm"}


@pytest.fixture(scope="module")
def perturbed(tiny_llama, tmp_path_factory):
    """A draft that disagrees with the tiny llama now and then, so drafts are also rejected."""
    return perturbed_copy(tiny_llama, tmp_path_factory.mktemp("perturbed"))


@pytest.fixture(params=["llama", "mlx"])
def backend_pair(request, tiny_llama, perturbed):
    """The tiny llama and its perturbed draft on each backend: GGUF for llama, HF folders for mlx."""
    kind = request.param
    pytest.importorskip(BACKEND_MODULES[kind], reason=f"the {kind} backend is not installed")
    source = str(tiny_llama.gguf_path if kind == "llama" else tiny_llama.hf_dir)
    return ["-t", source, "-d", str(perturbed[kind]), "--backend", kind]
