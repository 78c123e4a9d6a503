"""LlamaCppBackend details: logits row order, chunked prefill, cache bookkeeping."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from specrun.backends.llama import LlamaCppBackend  # noqa: E402


@pytest.fixture()
def model(tiny_llama):
    backend = LlamaCppBackend(tiny_llama.gguf_path, n_ctx=2048, n_batch=64)
    yield backend
    backend.close()


def test_rows_come_back_in_the_order_asked(model):
    ids = model.tokenize("def add(a, b):\n    return a + b\n")
    ascending = model.forward(ids, [2, 4, 7])
    model.rewind(0)
    shuffled = model.forward(ids, [7, 2, 4])
    np.testing.assert_array_equal(shuffled, ascending[[2, 0, 1]])
    model.rewind(0)
    np.testing.assert_array_equal(model.forward_argmax(ids, [7, 2, 4]), ascending[[2, 0, 1]].argmax(-1))


def test_a_prompt_longer_than_a_batch_is_fed_in_chunks(model):
    ids = (model.tokenize("for i in range(10):\n    total += i\n") * 20)[:150]  # > 2 batches of 64
    long_logits = model.forward(ids, [149])[0]
    assert model.n_past == 150
    model.rewind(0)
    for start in range(0, 149, 50):
        model.forward(ids[start : min(start + 50, 149)], [])
    step_logits = model.forward(ids[149:], [0])[0]
    np.testing.assert_allclose(long_logits, step_logits, atol=2e-2)
    model.rewind(0)
    with pytest.raises(ValueError, match="last n_batch tokens"):
        model.forward(ids, [3])


def test_returned_logits_do_not_change_after_the_next_forward(model):
    first = model.forward(model.tokenize("import os"), [0])
    kept = first.copy()
    model.forward([5, 6, 7], [2])
    np.testing.assert_array_equal(first, kept)


def test_rewind_past_the_end_is_harmless_and_exact(model):
    ids = model.tokenize("class A:\n    pass\n")
    model.forward(ids, [])
    model.rewind(len(ids) + 10)
    assert model.n_past == len(ids)
    model.rewind(3)
    assert model.n_past == 3


def test_special_token_text_becomes_the_special_token_only_when_asked(model):
    assert model.tokenize("<|eos|>", add_bos=False, special=True) == [2]
    plain = model.tokenize("<|eos|>", add_bos=False, special=False)
    assert 2 not in plain and len(plain) > 1


class _Params:
    use_extra_bufts = True  # llama.cpp's default


class _Library:
    """The two calls model_params_for makes, on a build with or without AMX kernels."""

    def __init__(self, features: bytes) -> None:
        self.features = features

    def llama_print_system_info(self) -> bytes:
        return self.features

    def llama_model_default_params(self) -> _Params:
        return _Params()


def test_a_build_with_amx_kernels_keeps_the_weights_out_of_them():
    from specrun.backends.llama import model_params_for

    amx = _Library(b"CPU : AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | REPACK = 1 | ")
    plain = _Library(b"CPU : AVX2 = 1 | AVX512 = 1 | REPACK = 1 | ")
    assert model_params_for(amx).use_extra_bufts is False
    assert model_params_for(plain).use_extra_bufts is True


def test_no_native_loop_is_compared_on_a_build_with_amx_kernels(model, monkeypatch):
    import specrun.backends.llama as llama_backend

    monkeypatch.setattr(llama_backend, "built_with_amx", lambda library: True)
    assert model.native_loop() is None


# ---- flash attention chosen by measurement (sessions/kernels.py) ---------------------------
def test_flash_attention_is_timed_on_and_off_without_touching_the_models_own_cache(model):
    prompt = [1, 5, 9, 14, 3]
    before = model.forward(prompt, [4])
    depth, costs = model.time_flash_attn(40, (1, 6), budget_s=0.5)
    assert depth == 40 and set(costs) == {True, False}
    assert all(set(by_count) == {1, 6} and all(s > 0 for s in by_count.values()) for by_count in costs.values())
    assert model.n_past == len(prompt)  # its own context kept the prompt
    model.rewind(0)
    np.testing.assert_array_equal(model.forward(prompt, [4]), before)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts the process's threads in /proc")
def test_timing_flash_attention_leaves_no_cpu_threads_behind_on_the_caller(tiny_llama):
    """llama.cpp's CPU threads (an OpenMP team) belong to the thread that decodes and stay with it:
    a server's loading thread that timed flash attention kept a team beside the slots' runner's,
    and every shared pass ran slower (backends/slots.Rendezvous; a fresh server's first clients
    got ~0.8x a later one's). The timing runs on a thread of its own that ends with it."""
    backend = LlamaCppBackend(tiny_llama.gguf_path, n_ctx=256, n_threads=2)
    before: set[str] = set()
    left: set[str] = set()
    timed: list = []

    def caller() -> None:  # a thread that never decoded, as a server's loading thread
        nonlocal left
        before.update(os.listdir("/proc/self/task"))
        try:
            timed.append(backend.time_flash_attn(32, (1, 6), budget_s=0.2))
        except Exception as exc:  # noqa: BLE001 - reported below, not lost with the thread
            timed.append(exc)
        # the timing thread and its team end just after it returns: a team the caller kept stays
        for _ in range(50):
            left = set(os.listdir("/proc/self/task")) - before
            if not left:
                break
            time.sleep(0.1)

    try:
        thread = threading.Thread(target=caller)
        thread.start()
        thread.join()
    finally:
        backend.close()
    assert len(timed) == 1 and not isinstance(timed[0], Exception) and timed[0][0] > 0, timed  # passes were timed
    assert before and not left, f"threads {sorted(left)} were left beside the caller"


def test_a_slow_prefill_stops_early_at_the_same_depth_for_both(model):
    depth, costs = model.time_flash_attn(200, (1,), budget_s=0.0)  # every chunk is over budget
    assert depth == 16 and set(costs) == {True, False}  # the first chunk only


def test_nothing_is_timed_on_a_cache_that_cannot_drop_a_pass(model, monkeypatch):
    """A recurrent model's cache refuses to drop the last pass (llama_memory_seq_rm false): the
    next pass would start where llama.cpp does not expect it, so the timing stops with nothing."""
    monkeypatch.setattr(model._lib, "llama_memory_seq_rm", lambda *args: False)
    assert model.time_flash_attn(20, (1, 6), budget_s=0.1) == (0, {})


def test_nothing_is_timed_on_a_recurrent_or_hybrid_model(model, monkeypatch):
    monkeypatch.setattr(model._lib, "llama_model_is_hybrid", lambda handle: True)
    assert model.time_flash_attn(20, (1, 6), budget_s=0.1) == (0, {})


def test_timing_refuses_passes_it_cannot_make(model):
    with pytest.raises(ValueError):
        model.time_flash_attn(0, (1,), budget_s=0.1)
    with pytest.raises(ValueError):
        model.time_flash_attn(10, (model.n_batch + 1,), budget_s=0.1)


def test_flash_attention_set_after_loading_reopens_the_context_as_if_loaded_so(tiny_llama, model):
    from specrun.sessions.tuning import model_id

    assert model.runs_on_cpu and model.flash_attn is None
    automatic_id = model_id(model)
    model.set_flash_attn(False)
    assert model.flash_attn is False and model_id(model) == automatic_id + "|flash=off"
    loaded_off = LlamaCppBackend(tiny_llama.gguf_path, n_ctx=2048, n_batch=64, flash_attn=False)
    try:
        prompt = [1, 5, 9, 14, 3, 22, 7]
        np.testing.assert_array_equal(model.forward(prompt, range(7)), loaded_off.forward(prompt, range(7)))
    finally:
        loaded_off.close()
    with pytest.raises(RuntimeError):  # the cache holds tokens now
        model.set_flash_attn(True)
    assert model.flash_attn is False


def test_a_tree_context_keeps_its_paths_when_flash_attention_is_set(tiny_llama):
    trees = LlamaCppBackend(tiny_llama.gguf_path, n_ctx=512, tree_paths=4)
    try:
        trees.set_flash_attn(False)
        assert trees.tree_support.available and trees.tree_support.max_paths == 4
    finally:
        trees.close()


def test_a_context_that_cannot_be_reopened_leaves_the_one_it_had(model, monkeypatch):
    from specrun.errors import ModelFileError

    real_init = model._lib.llama_init_from_model
    calls = []

    def failing_once(handle, params):
        calls.append(params.flash_attn_type)
        return None if len(calls) == 1 else real_init(handle, params)

    monkeypatch.setattr(model._lib, "llama_init_from_model", failing_once)
    with pytest.raises(ModelFileError):
        model.set_flash_attn(False)
    assert model.flash_attn is None and model._ctx  # reopened as it was
    assert calls[1] == model._ctx_params.flash_attn_type  # with its old setting
    monkeypatch.undo()
    assert model.forward_argmax([1, 5, 9], [2]).shape == (1,)


def test_a_ctrl_c_between_the_frees_never_frees_a_handle_twice(tiny_llama):
    """Ctrl-C can land while a context is freed (model load re-creates it for flash attention);
    close() afterwards once freed the batch again ("double free or corruption")."""
    backend = LlamaCppBackend(tiny_llama.gguf_path, n_ctx=256, n_batch=64)
    real = backend._lib
    freed: list[int] = []

    class Interrupted:  # llama_cpp as the backend calls it, with Ctrl-C after the first free
        def __getattr__(self, name):
            return getattr(real, name)

        def llama_batch_free(self, batch):
            freed.append(ctypes.addressof(batch))
            real.llama_batch_free(batch)
            raise KeyboardInterrupt

        def llama_free(self, ctx):
            freed.append(ctx)
            real.llama_free(ctx)

    backend._lib = Interrupted()
    with pytest.raises(KeyboardInterrupt):
        backend.set_flash_attn(True)
    backend._lib = real
    backend.close()  # what runs after the interrupt: frees the model, and nothing freed already
    assert len(freed) == len(set(freed)) == 1
    assert backend._ctx is None and backend._model is None
