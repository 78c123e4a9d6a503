"""llama.cpp slots (backends/llama_slots.py): one context, a sequence per slot, one llama_decode a
batch. Greedy answers decoded together are the ones decoded alone; a rewound slot reads as fresh."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="the llama backend is not installed")

from specrun.backends.llama import LlamaCppBackend  # noqa: E402
from specrun.backends.slots import Rendezvous, Slot  # noqa: E402
from specrun.engine.loop import GenerationParams  # noqa: E402
from specrun.tree import TokenTree  # noqa: E402
from tests.slots.slot_runs import together  # noqa: E402
from tests.slots.slot_runs import check_answers_together, tree_alone  # noqa: E402

EXACT = dict(kv_type="f32", flash_attn=False)


@pytest.mark.parametrize("exact", [True, False])
def test_greedy_answers_decoded_together_are_the_ones_decoded_alone(smollm2, exact):
    """SmolLM2 F16 target, its Q4_1 file drafting, four slots: lookup on two, the draft model's slot
    on two (its passes batched too), against each answer decoded alone on fresh contexts."""
    options = EXACT if exact else {}
    target = LlamaCppBackend(smollm2["smollm2-135m-f16"], n_ctx=512, n_threads=1, **options)
    draft = LlamaCppBackend(smollm2["smollm2-135m"], n_ctx=512, n_threads=1, **options)
    texts = ["The history of the Roman empire", "def fibonacci(n):", "Colours of the rainbow: red, orange,",
             "Once upon a time in a small village"]
    prompts = [target.tokenize(text) for text in texts]
    params = GenerationParams(24, draft_len=4, stop_at_eos=False)

    try:
        check_answers_together(target, draft, prompts, params, exact)
    finally:
        target.close()
        draft.close()


@pytest.mark.parametrize("layers", [(), (0,)])  # the tiny model: 2 layers, the first one's output given
def test_slots_opened_with_hidden_states_give_each_sequence_its_own(tiny_models, layers):
    """Each slot gets its own rows' states from a shared batch (the output head's input: every row
    an output, embeddings on; or layer outputs, as EAGLE-3 reads them, logits only where asked) and
    the logits it asked for, as its sequence fed alone gives them, before and after a rewind."""
    from tests.slots.slot_runs import check_hidden_slots, two_slots

    model = LlamaCppBackend(tiny_models["llama"].gguf_f32_path, n_ctx=128, n_threads=1, **EXACT)
    assert model.slots_hidden
    slots, (first, second) = two_slots(model, hidden=True, layers=layers)
    try:
        check_hidden_slots(model, first, second, layers, np.testing.assert_array_equal)
        np.testing.assert_array_equal(first.token_embeddings([3, 1]), model.token_embeddings([3, 1]))
        first.track_hidden(False)
        with pytest.raises(ValueError, match="these slots give the outputs of layers 0, not the output head's|"
                                             "slots opened for the output head's input give no layer outputs"):
            first.hidden_layers(() if layers else (0,))
    finally:
        slots.close()
        model.close()


def test_trees_in_a_shared_batch_read_as_the_model_alone_reads_them(tiny_models):
    """Two slots, each a tree after its tokens in one batch (paths are sequences of their own beside
    the slots'): every node's logits are the ones the model alone gives its path (exact settings,
    a unified cache: within rounding); a kept path, and a tree let go, read on as if fed."""
    from specrun.tree import TokenTree
    from tests.slots.slot_runs import together

    model = LlamaCppBackend(tiny_models["llama"].gguf_f32_path, n_ctx=128, n_threads=1, tree_paths=3, **EXACT)
    slots = model.open_slots(2, exact=False, tree_paths=3)
    exact = model.open_slots(1, exact=True, tree_paths=3)
    try:
        assert not exact.tree_support.available and "stream of its own" in exact.tree_support.reason
        rendezvous = Rendezvous()
        first, second = (Slot(slots, seq, rendezvous, model, "target") for seq in range(2))
        assert first.tree_support.available
        tree = TokenTree((7, 8, 9, 4), (-1, 0, 0, 2))  # 7 -> 8; 7 -> 9 -> 4
        other = TokenTree((3, 5), (-1, -1))
        first.forward([1, 2, 3], [])
        second.forward([6, 5, 4, 3], [])
        got = together([(rendezvous, lambda: first.forward_tree([5], tree, [0, 1, 2, 3, 4])),
                        (rendezvous, lambda: second.forward_tree([2, 1], other, [1, 2, 3]))])

        np.testing.assert_allclose(got[0], tree_alone(model, [1, 2, 3, 5], tree, [3, 4, 5, 6, 7]), rtol=0, atol=1e-4)
        np.testing.assert_allclose(got[1], tree_alone(model, [6, 5, 4, 3, 2, 1], other, [5, 6, 7]), rtol=0, atol=1e-4)
        assert (first.n_past, second.n_past) == (4, 6)
        first.keep_path([0, 2, 3])  # 7, 9, 4
        second.keep_path([])
        assert (first.n_past, second.n_past) == (7, 6)
        got = together([(rendezvous, lambda: first.forward([6], [0])), (rendezvous, lambda: second.forward([9], [0]))])
        np.testing.assert_allclose(got[0], model.forward([1, 2, 3, 5, 7, 9, 4, 6], [7]), rtol=0, atol=1e-4)
        model.rewind(0)
        np.testing.assert_allclose(got[1], model.forward([6, 5, 4, 3, 2, 1, 9], [6]), rtol=0, atol=1e-4)
        model.rewind(0)
    finally:
        slots.close()
        exact.close()
        model.close()





def test_a_second_tree_reads_as_alone_and_every_path_is_freed(tiny_models):
    """Trees after kept paths read as the model alone reads them, and once the slots go on, no path
    sequence holds a cell (a mutant that never freed them passed the first test)."""
    model = LlamaCppBackend(tiny_models["llama"].gguf_f32_path, n_ctx=128, n_threads=1, tree_paths=3, **EXACT)
    slots = model.open_slots(2, exact=False, tree_paths=3)
    lib = slots._lib
    try:
        rendezvous = Rendezvous()
        first, second = (Slot(slots, seq, rendezvous, model, "target") for seq in range(2))
        tree = TokenTree((7, 8, 9, 4), (-1, 0, 0, 2))
        other = TokenTree((3, 5), (-1, -1))
        first.forward([1, 2, 3], [])
        second.forward([6, 5, 4, 3], [])
        together([(rendezvous, lambda: first.forward_tree([5], tree, [0])),
                  (rendezvous, lambda: second.forward_tree([2, 1], other, [0]))])
        first.keep_path([0, 2, 3])
        second.keep_path([1])
        # a second tree pass each, after the kept paths
        tree2 = TokenTree((11, 12, 13), (-1, -1, 0))
        got = together([(rendezvous, lambda: first.forward_tree([6], tree2, [0, 1, 2, 3])),
                        (rendezvous, lambda: second.forward_tree([9], tree2, [0, 1, 2, 3]))])
        np.testing.assert_allclose(got[0], tree_alone(model, [1, 2, 3, 5, 7, 9, 4, 6], tree2, [7, 8, 9, 10]), rtol=0, atol=1e-4)
        np.testing.assert_allclose(got[1], tree_alone(model, [6, 5, 4, 3, 2, 1, 5, 9], tree2, [7, 8, 9, 10]), rtol=0, atol=1e-4)
        first.keep_path([1])
        second.keep_path([0, 2])
        together([(rendezvous, lambda: first.forward([1], [0])), (rendezvous, lambda: second.forward([1], [0]))])
        # every path sequence is empty after the next batch
        for seq in range(slots.n_slots, slots.n_slots * (1 + slots.tree_paths)):
            assert lib.llama_memory_seq_pos_max(slots._memory, seq) == -1, seq
        # and the cache holds no cells but the slots'
        assert lib.llama_memory_seq_pos_max(slots._memory, 0) == first.n_past - 1
    finally:
        slots.close()
        model.close()


def test_a_kept_path_then_a_rewind_into_it_run_in_that_order(tiny_models):
    """keep_path recorded, then a rewind inside the kept path before the next batch: the path is
    kept first, then cut (the other order left the path's cells in place)."""
    model = LlamaCppBackend(tiny_models["llama"].gguf_f32_path, n_ctx=128, n_threads=1, tree_paths=3, **EXACT)
    slots = model.open_slots(1, exact=False, tree_paths=3)
    try:
        rendezvous = Rendezvous()
        slot = Slot(slots, 0, rendezvous, model, "target")
        slot.forward([1, 2, 3], [])
        slot.forward_tree([5], TokenTree((7, 8), (-1, 0)), [0])
        slot.keep_path([0, 1])
        slot.rewind(5)  # inside the kept path: 7 stays, 8 goes
        got = slot.forward([9, 9], [1])
        model.rewind(0)
        np.testing.assert_allclose(got, model.forward([1, 2, 3, 5, 7, 9, 9], [6]), rtol=0, atol=1e-4)
    finally:
        slots.close()
        model.close()


def test_more_slots_trees_than_llama_cpp_has_sequences_keep_chains_saying_why(tiny_models):
    """llama.cpp takes at most llama_max_parallel_sequences() (256) sequences: 42 slots with trees of
    5 paths fit (252), 43 draft chains, their tree_support saying why (not a context that fails)."""
    model = LlamaCppBackend(tiny_models["llama"].gguf_f32_path, n_ctx=64, n_threads=1, tree_paths=5, **EXACT)
    try:
        fits = model.open_slots(42, exact=False, tree_paths=5)
        assert fits.tree_support.available
        fits.close()
        chains = model.open_slots(43, exact=False, tree_paths=5)
        assert not chains.tree_support.available and "sequences than llama.cpp's" in chains.tree_support.reason
        chains.close()
    finally:
        model.close()


@pytest.mark.parametrize("layers", [(), (0,)])
def test_a_tree_s_nodes_give_their_hidden_states_on_slots(tiny_models, layers):
    """Heads drafting trees read the nodes' states: each slot's (head input or layer outputs) equal
    the model's alone for its tokens and nodes."""
    model = LlamaCppBackend(tiny_models["llama"].gguf_f32_path, n_ctx=128, n_threads=1, tree_paths=3, **EXACT)
    slots = model.open_slots(2, exact=False, hidden=True, layers=layers, tree_paths=3)
    try:
        rendezvous = Rendezvous()
        first, second = (Slot(slots, seq, rendezvous, model, "target") for seq in range(2))
        for slot in (first, second):
            slot.hidden_layers(layers)
            slot.track_hidden(True)
        tree = TokenTree((7, 8, 9, 4), (-1, 0, 0, 2))
        other = TokenTree((3, 5), (-1, -1))
        first.forward([1, 2, 3], [])
        second.forward([6, 5, 4, 3], [])
        got = together([(rendezvous, lambda: first.forward_tree([5], tree, [0, 1, 2, 3, 4])),
                        (rendezvous, lambda: second.forward_tree([2, 1], other, [0, 1, 2, 3]))])
        states = [first.hidden_rows(range(5)), second.hidden_rows(range(4))]

        def alone(prefix, tokens, held, rows):
            model.rewind(0)
            model.hidden_layers(layers)
            model.track_hidden(False)
            model.forward(prefix, [])
            model.track_hidden(True)
            try:
                out = model.forward_tree(tokens, held, rows)
                return out, model.hidden_rows(range(len(tokens) + len(held)))
            finally:
                model.keep_path([])
                model.track_hidden(False)
                model.rewind(0)

        for index, (prefix, tokens, held, rows) in enumerate([([1, 2, 3], [5], tree, [0, 1, 2, 3, 4]),
                                                              ([6, 5, 4, 3], [2, 1], other, [0, 1, 2, 3])]):
            logits, hidden = alone(prefix, tokens, held, rows)
            np.testing.assert_allclose(got[index], logits, rtol=0, atol=1e-4)
            np.testing.assert_allclose(states[index], hidden, rtol=0, atol=1e-4)
    finally:
        slots.close()
        model.close()


def test_a_rewound_slot_reads_as_one_fed_afresh(tiny_models):
    model = LlamaCppBackend(tiny_models["llama"].gguf_f32_path, n_ctx=128, n_threads=1, **EXACT)
    slots = model.open_slots(2, exact=True)
    try:
        rendezvous = Rendezvous()
        first, second = (Slot(slots, seq, rendezvous, model, "target") for seq in range(2))
        second.forward([5, 6, 7, 8, 9], [])
        first.forward([1, 2, 3, 4, 5, 6], [])
        first.rewind(3)
        rewound = first.forward([9, 9], [0, 1])
        fresh = model.forward([1, 2, 3, 9, 9], [3, 4])
        np.testing.assert_array_equal(rewound, fresh)
        assert (first.n_past, second.n_past) == (5, 5)
    finally:
        slots.close()
        model.close()
