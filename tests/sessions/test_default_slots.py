"""How many slots `specrun serve --parallel auto` opens (sessions/slots.default_slots): one where
a slot would draft with less than the session, its backend has none, the draft reads a windowed
cache, else up to DEFAULT_SLOTS as half the free memory holds
their caches; and what a slot's cache weighs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specrun.sessions.slots import DEFAULT_SLOTS, default_slots

MIB = 1 << 20


class _Model:
    def __init__(self, name: str = "llama", cache: int = 100 * MIB, slots: bool = True) -> None:
        self.name, self._cache = name, cache
        if slots:
            self.open_slots = lambda n, exact: None

    def slot_cache_bytes(self, keeping: bool = True) -> int:
        self.asked_keeping = keeping
        return self._cache


def _session(target=None, draft=None, drops: str = "", heads=None, layers=()):
    return SimpleNamespace(target=target or _Model(), draft=draft, slot_drops=lambda exact=False: drops,
                           slot_heads=lambda: heads, slot_layers=lambda: layers)


@pytest.mark.parametrize("free_mib, slots", [(4096, DEFAULT_SLOTS), (500, 2), (300, 1), (0, 1)])
def test_slots_are_as_many_as_half_the_free_memory_holds_caches_for(free_mib, slots):
    session = _session(draft=_Model(cache=25 * MIB))
    chosen, note = default_slots(session, lambda: free_mib * MIB)
    assert chosen == slots
    # a draft model's slot keeps a recurrent state before drafting; a target's keeps none
    assert session.target.asked_keeping is False and session.draft.asked_keeping is True
    assert "125 MiB" in note and ("--parallel 1" in note if slots > 1 else "one at a time" in note)


def test_heads_on_slots_count_the_output_buffer_hidden_states_need():
    """Slots opened for heads' hidden states hold llama.cpp's output buffer of a batch of rows (every
    row's logits and state) besides the sequences' caches: fewer slots fit, and the note says why."""
    target = _Model()
    asked = []
    target.slots_shared_bytes = lambda hidden, layers: asked.append((hidden, layers)) or (300 * MIB if hidden else 0)
    chosen, _ = default_slots(_session(target=target), lambda: 1000 * MIB)
    assert chosen == DEFAULT_SLOTS and asked[-1] == (False, ())
    chosen, note = default_slots(_session(target=target, heads=object(), layers=(1, 5)), lambda: 1000 * MIB)
    assert chosen == 2 and asked[-1] == (True, (1, 5)) and "300 MiB for the heads' hidden states" in note


def test_a_llama_target_s_output_buffer_for_hidden_states_is_a_batch_of_logits_and_states():
    pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")
    from specrun.backends.llama import LlamaCppBackend
    from specrun.modelkit.demo import demo_gguf

    backend = LlamaCppBackend(demo_gguf("demo-target"), n_ctx=256, n_threads=1)
    try:
        width = backend.hidden_support.size
        assert backend.slots_shared_bytes(False) == 0
        assert backend.slots_shared_bytes(True) == 512 * (backend.n_vocab + width) * 4
        assert backend.slots_shared_bytes(True, (1, 2, 3)) == 512 * width * 3 * 4
    finally:
        backend.close()


def test_one_slot_where_a_slot_would_draft_with_less_or_cannot_be_opened():
    chosen, note = default_slots(_session(drops="the eagle heads"), lambda: 1 << 40)
    assert chosen == 1 and "without the eagle heads" in note
    chosen, note = default_slots(_session(target=_Model("mlx", slots=False)), lambda: 1 << 40)
    assert chosen == 1 and "the mlx backend decodes one at a time" in note
    chosen, note = default_slots(_session(), lambda: None)
    assert chosen == 1 and "free memory unknown" in note
    windowed = _Model("demo-draft", slots=False)
    windowed.parent, windowed.window = _Model(), 256
    chosen, note = default_slots(_session(draft=windowed), lambda: 1 << 40)
    assert chosen == 1 and "demo-draft drafts from a windowed cache" in note
    recurrent = _Model("qwen35")
    recurrent.recurrent = True  # llama.cpp's slots keep each sequence's state in a cell of its own
    chosen, _ = default_slots(_session(target=recurrent, draft=recurrent), lambda: 1 << 40)
    assert chosen == DEFAULT_SLOTS


def test_a_slot_s_cache_is_every_layer_s_keys_and_values_for_the_context():
    pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")
    import gguf

    from specrun.backends.llama import LlamaCppBackend
    from specrun.modelkit.demo import demo_gguf
    from specrun.modelkit.gguf_io import read_fields

    path = demo_gguf("demo-target")
    fields = read_fields(gguf.GGUFReader(str(path)))
    arch = fields["general.architecture"]
    heads = fields[f"{arch}.attention.head_count"]
    kv_heads = fields.get(f"{arch}.attention.head_count_kv", heads)
    head_dim = fields[f"{arch}.embedding_length"] // heads
    for n_ctx, kv_type in ((256, "f16"), (1024, "f16"), (256, "f32")):
        backend = LlamaCppBackend(path, n_ctx=n_ctx, n_threads=1, kv_type=kv_type)
        try:
            expected = fields[f"{arch}.block_count"] * kv_heads * 2 * head_dim * (4 if kv_type == "f32" else 2) * n_ctx
            assert backend.slot_cache_bytes() == expected
        finally:
            backend.close()


def test_free_memory_on_macos_is_what_vm_stat_says_a_new_allocation_gets():
    from specrun.sessions.slots import vm_stat_free

    text = ("Mach Virtual Memory Statistics: (page size of 16384 bytes)\nPages free:                               "
            "100.\nPages active:                           500000.\nPages inactive:                   200.\n"
            "Pages speculative:                        50.\nPages wired down:                      9.\n")
    assert vm_stat_free(text) == 350 * 16384
    assert vm_stat_free("nothing useful") is None
