"""MLX slots (backends/mlx_slots.py): one cache for every slot's cells, one packed model call a
batch. Greedy answers decoded together are the ones decoded alone; a rewound or emptied slot
reads as one fed afresh, its holes closed before the next batch; a failed batch leaves the cells
as before it; a model whose cache a packed pass cannot hold is one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_lm", reason="the mlx backend is not installed")

from specrun.backends.mlx import MlxBackend  # noqa: E402
from specrun.backends.slots import Rendezvous, Slot  # noqa: E402
from specrun.engine.loop import GenerationParams  # noqa: E402
from specrun.errors import ModelFileError  # noqa: E402
from tests.slots.slot_runs import check_answers_together, tree_alone, write_tiny_gemma3_mlx  # noqa: E402

ROUNDING = dict(rtol=0, atol=2e-4)  # float32: a packed pass sums in another order than a lone one


@pytest.fixture(scope="module")
def pair(tiny_models):
    target = MlxBackend(tiny_models["llama"].hf_dir, n_ctx=256)
    draft = MlxBackend(tiny_models["qwen2"].hf_dir, n_ctx=256)
    yield target, draft
    target.close()
    draft.close()


def test_greedy_answers_decoded_together_are_the_ones_decoded_alone(pair):
    """Four slots: lookup on two, the draft model on two (its passes batched too), against each
    answer decoded alone on a fresh cache."""
    target, draft = pair
    texts = ["def fibonacci(n):", "import os\nimport sys\n", "Grüße aus München!", "class Shape:\n    def"]
    prompts = [target.tokenize(text) for text in texts]
    params = GenerationParams(24, draft_len=4, stop_at_eos=False)


    def cells_are_the_slots_tokens(slots, target_slots):
        """Every rejected draft's cells gone once the next batch ran: the cache holds what the slots do."""
        for slot in slots:
            slot.forward([1], [])
        assert target_slots.cells == sum(slot.n_past for slot in slots)

    check_answers_together(target, draft, prompts, params, False, then=cells_are_the_slots_tokens)


def _fresh(model, tokens, rows):
    """The logits of ``rows`` with ``tokens`` fed to the model alone on an empty cache (left empty)."""
    model.rewind(0)
    try:
        return model.forward(tokens, rows)
    finally:
        model.rewind(0)


@pytest.mark.parametrize("layers", [(), (0,)])
def test_slots_opened_with_hidden_states_give_each_sequence_its_own(pair, layers):
    """The body run on the packed row, the head on the rows asked for: each slot gets its own
    rows' states (the output head's input, or layer outputs as EAGLE-3 reads them) and logits, as
    its sequence fed alone gives them, before and after a rewind."""
    from tests.slots.slot_runs import check_hidden_slots, two_slots

    model, _ = pair
    assert model.slots_hidden
    slots, (first, second) = two_slots(model, hidden=True, layers=layers)
    try:
        check_hidden_slots(model, first, second, layers,
                           lambda got, expected: np.testing.assert_allclose(got, expected, **ROUNDING))
    finally:
        slots.close()




def test_trees_in_a_shared_batch_read_as_the_model_alone_reads_them(pair):
    """Two slots, each a tree after its tokens in one packed call (a node sees its sequence's cells
    and its own ancestors): every node's logits and hidden state are the ones the model alone gives
    its path; a kept path, a tree let go, a second tree and a rewind into a kept path read on as
    if fed, and once the slots go on the cache holds their tokens alone."""
    from specrun.tree import TokenTree
    from tests.slots.slot_runs import together

    model, _ = pair
    assert model.slots_tree_problem(False) == ""
    slots = model.open_slots(2, False, hidden=True, tree_paths=3)
    chains = model.open_slots(1, False)
    try:
        assert slots.tree_support.available and not chains.tree_support.available
        rendezvous = Rendezvous()
        first, second = (Slot(slots, seq, rendezvous, model, "target") for seq in range(2))
        for slot in (first, second):
            slot.track_hidden(True)
        tree = TokenTree((7, 8, 9, 4), (-1, 0, 0, 2))  # 7 -> 8; 7 -> 9 -> 4
        other = TokenTree((3, 5), (-1, -1))
        together([(rendezvous, lambda: first.forward([1, 2, 3], [])), (rendezvous, lambda: second.forward([6, 5, 4, 3], []))])
        got = together([(rendezvous, lambda: first.forward_tree([5], tree, [0, 1, 2, 3, 4])),
                        (rendezvous, lambda: second.forward_tree([2, 1], other, [1, 2, 3]))])
        np.testing.assert_allclose(got[0], tree_alone(model, [1, 2, 3, 5], tree, [3, 4, 5, 6, 7]), **ROUNDING)
        np.testing.assert_allclose(got[1], tree_alone(model, [6, 5, 4, 3, 2, 1], other, [5, 6, 7]), **ROUNDING)
        # the deepest node's state is the one its path fed alone gives
        model.rewind(0)
        model.track_hidden(True)
        model.forward([1, 2, 3, 5, 7, 9, 4], [6])
        path_state = model.hidden_rows([6])
        model.track_hidden(False)
        model.rewind(0)
        np.testing.assert_allclose(first.hidden_rows([4]), path_state, **ROUNDING)
        first.keep_path([0, 2, 3])  # 7, 9, 4
        second.keep_path([])
        assert (first.n_past, second.n_past) == (7, 6)
        tree2 = TokenTree((11, 12, 13), (-1, -1, 0))
        got = together([(rendezvous, lambda: first.forward_tree([6], tree2, [0, 1, 2, 3])),
                        (rendezvous, lambda: second.forward_tree([9], tree2, [0, 1, 2, 3]))])
        np.testing.assert_allclose(got[0], tree_alone(model, [1, 2, 3, 5, 7, 9, 4, 6], tree2, [7, 8, 9, 10]),
                                   **ROUNDING)
        np.testing.assert_allclose(got[1], tree_alone(model, [6, 5, 4, 3, 2, 1, 9], tree2, [6, 7, 8, 9]),
                                   **ROUNDING)
        first.keep_path([1])  # 12
        second.keep_path([0, 2])  # 11, 13
        first.rewind(first.n_past - 1)  # into the kept path: 12 goes again
        got = together([(rendezvous, lambda: first.forward([1], [0])), (rendezvous, lambda: second.forward([1], [0]))])
        np.testing.assert_allclose(got[0], _fresh(model, [1, 2, 3, 5, 7, 9, 4, 6, 1], [8]), **ROUNDING)
        np.testing.assert_allclose(got[1], _fresh(model, [6, 5, 4, 3, 2, 1, 9, 11, 13, 1], [9]), **ROUNDING)
        together([(rendezvous, lambda: first.forward([2], [])), (rendezvous, lambda: second.forward([2], []))])
        assert slots.cells == first.n_past + second.n_past  # no node's cell left behind
    finally:
        slots.close()
        chains.close()


def test_a_tree_s_cells_outlive_a_batch_retried_pass_by_pass(pair):
    """A shared batch that fails is retried a pass at a time: another slot's pass run before this
    slot keeps its tree's path must not close the tree's cells as holes (they were, and the kept
    path was lost: the slot's next pass found 4 tokens where 6 were); a tree no path was kept of
    goes with its slot's next pass."""
    import time

    from specrun.tree import TokenTree
    from tests.slots.slot_runs import together

    model, _ = pair
    slots = model.open_slots(2, False, tree_paths=3)
    rendezvous = Rendezvous()
    try:
        first, second = (Slot(slots, seq, rendezvous, model, "target") for seq in range(2))
        together([(rendezvous, lambda: first.forward([1, 2, 3], [])), (rendezvous, lambda: second.forward([6, 5, 4], []))])
        run, failed = slots.run, []

        def fails_once_together(passes):
            if len(passes) > 1 and not failed:
                failed.append(True)
                raise RuntimeError("a batch that fails as a whole")
            return run(passes)

        slots.run = fails_once_together
        tree = TokenTree((7, 8, 9), (-1, 0, 0))
        together([(rendezvous, lambda: first.forward_tree([5], tree, [0, 1, 2, 3])),
                  (rendezvous, lambda: (time.sleep(0.3), second.forward([2], [0]))[1])])
        assert failed
        first.keep_path([0, 1])  # 7, 8
        second.forward_tree([1], tree, [0])  # a tree its slot lets go
        got = together([(rendezvous, lambda: first.forward([1], [0])), (rendezvous, lambda: second.forward([3], [0]))])
        np.testing.assert_allclose(got[0], _fresh(model, [1, 2, 3, 5, 7, 8, 1], [6]), **ROUNDING)
        np.testing.assert_allclose(got[1], _fresh(model, [6, 5, 4, 2, 1, 3], [5]), **ROUNDING)
        together([(rendezvous, lambda: first.forward([2], [])), (rendezvous, lambda: second.forward([2], []))])
        assert slots.cells == first.n_past + second.n_past
    finally:
        rendezvous.close()
        slots.close()


def test_a_rewound_or_emptied_slot_reads_as_one_fed_afresh(pair):
    model, _ = pair
    slots = model.open_slots(3, False)
    rendezvous = Rendezvous()
    try:
        first, second, third = (Slot(slots, seq, rendezvous, model, "target") for seq in range(3))
        first.forward([1, 2, 3, 4, 5, 6], [])
        second.forward([5, 6, 7, 8, 9], [])
        first.rewind(3)  # a hole in the middle of the cache, second's cells after it
        rewound = first.forward([9, 9], [0, 1])
        np.testing.assert_allclose(rewound, _fresh(model, [1, 2, 3, 9, 9], [3, 4]), **ROUNDING)
        second.rewind(0)  # emptied, as for its next request
        third.forward([7, 7, 7], [])
        again = first.forward([4], [0])
        np.testing.assert_allclose(again, _fresh(model, [1, 2, 3, 9, 9, 4], [5]), **ROUNDING)
        assert (first.n_past, second.n_past, third.n_past) == (6, 0, 3)
        assert slots.cells == 9
        fed_afresh = second.forward([3, 1, 4, 1, 5], [4])
        np.testing.assert_allclose(fed_afresh, _fresh(model, [3, 1, 4, 1, 5], [4]), **ROUNDING)
    finally:
        rendezvous.close()
        slots.close()


def test_one_packed_batch_of_sequences_at_different_places_reads_as_each_alone(pair):
    """Several passes in one model call, one after a hole the batch closes first: each pass's
    logits are its sequence's alone; a pass that does not continue its sequence is refused."""
    from specrun.backends.slots import SlotPass

    model, _ = pair
    slots = model.open_slots(3, False)
    try:
        slots.run([SlotPass(0, 0, [1, 2, 3, 4, 5, 6], []), SlotPass(1, 0, [5, 6, 7], [])])
        slots.remove(0, 3)  # a hole before sequence 1's cells
        batch = [SlotPass(0, 3, [9, 9], [0, 1]), SlotPass(1, 3, [8], [0]), SlotPass(2, 0, [3, 1, 4], [2, 0])]
        slots.run(batch)
        np.testing.assert_allclose(batch[0].logits, _fresh(model, [1, 2, 3, 9, 9], [3, 4]), **ROUNDING)
        np.testing.assert_allclose(batch[1].logits, _fresh(model, [5, 6, 7, 8], [3]), **ROUNDING)
        np.testing.assert_allclose(batch[2].logits, _fresh(model, [3, 1, 4], [2, 0]), **ROUNDING)
        assert slots.cells == 5 + 4 + 3
        with pytest.raises(ValueError, match="holds 5 tokens, not the 6"):
            slots.run([SlotPass(0, 6, [1], [0])])
        assert slots.cells == 12
    finally:
        slots.close()


def test_sliding_window_layers_decode_together_as_alone(pair, tmp_path):
    """Gemma 3's sliding layers (a RotatingKVCache alone) share the slots' plain cache, their window
    kept by the mask: answers far longer than the window, a slot rewound past it, and a tree's nodes
    (which a lone sequence's rotating cache cannot hold) read as alone."""
    from specrun.backends.slots import SlotPass

    target, _ = pair
    gemma = MlxBackend(write_tiny_gemma3_mlx(tmp_path / "gemma", Path(target.path)), n_ctx=256)
    gemma_draft = MlxBackend(write_tiny_gemma3_mlx(tmp_path / "gemma-draft", Path(target.path), seed=1), n_ctx=256)
    try:
        assert gemma.slots_problem() is None and not gemma.tree_support.available
        prompts = [gemma.tokenize(text) for text in ("def fibonacci(n):", "import os\nimport sys\n",
                                                     "class Shape:\n    def", "Grüße aus München!")]
        params = GenerationParams(24, draft_len=4, stop_at_eos=False)
        check_answers_together(gemma, gemma_draft, prompts, params, False)
        slots = gemma.open_slots(2, False)
        try:
            long = list(range(3, 23))  # 20 tokens, past the window of 8
            slots.run([SlotPass(0, 0, long, []), SlotPass(1, 0, long[:5], [])])
            slots.remove(0, 15)
            batch = [SlotPass(0, 15, [7, 7], [0, 1]), SlotPass(1, 5, long[5:], [14])]
            slots.run(batch)
            np.testing.assert_allclose(batch[0].logits, _fresh(gemma, long[:15] + [7, 7], [15, 16]), **ROUNDING)
            np.testing.assert_allclose(batch[1].logits, _fresh(gemma, long, [19]), **ROUNDING)
        finally:
            slots.close()
        # trees on its slots, past the window too: each node reads what its path fed alone reads
        from specrun.tree import TokenTree

        assert gemma.slots_tree_problem(False) == ""
        slots = gemma.open_slots(2, False, tree_paths=4)
        try:
            assert slots.tree_support.available
            tree = TokenTree((7, 8, 9, 4), (-1, 0, 0, 2))  # 7 -> 8; 7 -> 9 -> 4
            batch = [SlotPass(0, 0, long, [19, 20, 21, 22, 23], tree=tree), SlotPass(1, 0, long[:5], [4])]
            slots.run(batch)
            for row, path in zip(range(1, 5), ([7], [7, 8], [7, 9], [7, 9, 4])):
                np.testing.assert_allclose(batch[0].logits[row], _fresh(gemma, long + path, [19 + len(path)])[0],
                                           **ROUNDING)
            slots.keep_path(0, 20, tree, [0, 2, 3])  # 7, 9, 4
            follow = [SlotPass(0, 23, [5], [0]), SlotPass(1, 5, [6], [0])]
            slots.run(follow)
            np.testing.assert_allclose(follow[0].logits, _fresh(gemma, long + [7, 9, 4, 5], [23]), **ROUNDING)
            np.testing.assert_allclose(follow[1].logits, _fresh(gemma, long[:5] + [6], [5]), **ROUNDING)
        finally:
            slots.close()
    finally:
        gemma.close()
        gemma_draft.close()


def test_a_failed_batch_leaves_the_cells_as_before_it(pair, monkeypatch):
    model, _ = pair
    slots = model.open_slots(2, False)
    rendezvous = Rendezvous()
    try:
        slot = Slot(slots, 0, rendezvous, model, "target")
        slot.forward([1, 2, 3], [])

        def broken(_logits):
            raise RuntimeError("the device went away")

        with monkeypatch.context() as patched:
            patched.setattr(model, "_fit_vocab", broken)
            with pytest.raises(RuntimeError, match="went away"):
                slot.forward([4, 5], [1])
        assert slots.cells == 3 and slot.n_past == 3
        np.testing.assert_allclose(slot.forward([4, 5], [1]), _fresh(model, [1, 2, 3, 4, 5], [4]), **ROUNDING)
    finally:
        rendezvous.close()
        slots.close()


def test_a_slot_s_cache_is_every_layer_s_keys_and_values_for_the_context(pair, tiny_models):
    model, _ = pair
    config = tiny_models["llama"].config
    expected = config.num_layers * config.num_kv_heads * 2 * config.head_dim * 4 * model.n_ctx  # float32
    assert model.slot_cache_bytes() == expected
    assert model.slots_problem() is None


def test_a_model_whose_cache_a_packed_pass_cannot_hold_is_one_line(pair, monkeypatch):
    from mlx_lm.models.cache import ArraysCache

    model, _ = pair
    monkeypatch.setattr(model, "_cache", [ArraysCache(2) for _ in model._cache])  # a recurrent state
    assert "ArraysCache cache" in model.slots_problem()
    with pytest.raises(ModelFileError) as raised:
        model.open_slots(2, False)
    assert "cannot hold several sequences" in str(raised.value) and "--parallel 1" in raised.value.fix


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    """The tests' Qwen3.5 hybrid (Gated DeltaNet beside attention) as an MLX folder, and a copy with
    every matrix nudged: a hybrid draft that agrees with it part of the time."""
    import shutil

    import mlx.core as mx
    from hybrid_models import HybridShape, hybrid_weights, write_qwen35_mlx_folder

    root = tmp_path_factory.mktemp("hybrid-slots")
    shape = HybridShape()
    target_folder = write_qwen35_mlx_folder(root / "qwen35", shape, hybrid_weights(shape))
    draft_folder = root / "nudged"
    shutil.copytree(target_folder, draft_folder)
    for path in draft_folder.glob("model*.safetensors"):
        weights = mx.load(str(path))
        mx.random.seed(3)
        mx.save_safetensors(str(path), {name: value + 0.05 * mx.std(value) * mx.random.normal(value.shape)
                                        if value.ndim == 2 else value for name, value in weights.items()})
    target, draft = MlxBackend(target_folder, n_ctx=256), MlxBackend(draft_folder, n_ctx=256)
    yield target, draft
    target.close()
    draft.close()


HYBRID_ROUNDING = dict(rtol=0, atol=2e-3)  # OpenBLAS rounds a packed pass's rows apart by ~1e-4 here


def test_greedy_answers_of_a_hybrid_decoded_together_are_the_ones_decoded_alone(hybrid_pair):
    """Four slots of a hybrid target and a hybrid draft (their recurrent states one per sequence):
    lookup on two, the draft model on two, passes shared, each answer the one it gets alone (one
    may part from it at a near tie: a packed pass rounds apart)."""
    target, draft = hybrid_pair
    assert target.slots_problem() is None and target.open_slots(1, False).recurrent
    # a recurrent state holds one path: its slots keep chains, saying why
    assert "recurrent or hybrid" in target.slots_tree_problem(False)
    assert not target.open_slots(1, False, tree_paths=2).tree_support.available
    prompts = [target.tokenize(text) for text in ("def hello(world):", "the cat sat on the mat. the cat sat on the",
                                                  "import os\nimport sys\n", "Once upon a time")]
    check_answers_together(target, draft, prompts, GenerationParams(32, draft_len=4, stop_at_eos=False), False)


def test_a_hybrid_slot_with_hidden_states_gives_its_own_rows_after_its_kept_tokens_fed_again(hybrid_pair):
    """A hybrid's slot rewound past what it kept feeds those tokens at the head of its next pass:
    the hidden states it gives are that pass's own rows, as the sequence fed alone gives them."""
    from tests.slots.slot_runs import fed_alone, two_slots

    target, _ = hybrid_pair
    if not target.slots_hidden:
        pytest.skip(f"this hybrid gives no hidden states: {target.hidden_support.reason}")
    slots, (first, second) = two_slots(target, hidden=True)
    try:
        second.forward([5, 6, 7, 8, 9], [])
        first.forward([1, 2, 3, 4, 5, 6], [])
        first.forward([7, 8, 9], [])
        first.rewind(2)  # before its last pass's state: its kept tokens fed again at its next pass's head
        logits = first.forward([9, 9], [0, 1])
        alone_logits, alone_states = fed_alone(target, [1, 2, 9, 9], [2, 3])
        np.testing.assert_allclose(logits, alone_logits, **HYBRID_ROUNDING)
        assert first.hidden_rows(range(2)).shape == (2, alone_states.shape[1])
        np.testing.assert_allclose(first.hidden_rows(range(2)), alone_states[2:], **HYBRID_ROUNDING)
        np.testing.assert_allclose(second.hidden_rows(range(5)), fed_alone(target, [5, 6, 7, 8, 9], [])[1],
                                   **HYBRID_ROUNDING)
    finally:
        slots.close()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hybrid_slots_started_apart_batched_unequally_and_rewound_read_as_fed_alone(hybrid_pair, seed):
    """Three slots of a hybrid started one at a time in a random order, then packed batches of
    unequal passes in any order, with rejected drafts rewound, kept states rewound to, far rewinds
    and a sequence emptied: every logit of every pass is a fresh cache's fed the same text (a state
    another sequence's, or one token off, is off by far more than the rounding)."""
    from tests.slots.slot_runs import random_schedule

    target, _ = hybrid_pair
    slots = target.open_slots(3, False)
    restored = []
    rewind = slots._rewind_recurrent

    def watched(seq, n_keep):
        before = slots._kept[seq]
        at = rewind(seq, n_keep)
        restored.append(before is not None and at == before[0] and at > 0)
        return at

    slots._rewind_recurrent = watched

    def alone(kept, last):
        return _fresh(target, kept + last, [len(kept) + row for row in range(len(last))])

    try:
        texts = random_schedule(slots, alone, seed, 16, HYBRID_ROUNDING, empty_one=True)
        assert any(restored), "no rewind went back to a kept state"
        assert slots.cells == sum(len(text) for text in texts.values())
    finally:
        slots.close()


def test_a_hybrid_draft_slot_s_kept_state_advances_round_after_round(hybrid_pair):
    """A draft model's slot: keep, a pass, one-token drafts, a rewind into them (one accepted), keep
    again: each keep takes the states after what the rewind left to feed again (its next pass feeds
    them), so the kept state is where the round starts and each rewind feeds two tokens again (else
    each round re-fed all since the first keep); every logit a fresh cache's."""
    from specrun.backends.slots import SlotPass

    target, _ = hybrid_pair
    slots = target.open_slots(2, False)
    text = list(range(5, 24))
    try:
        slots.run([SlotPass(0, 0, list(text), [])])
        pending = [30]
        for _ in range(4):
            slots.keep(0)
            start = len(text)
            first = SlotPass(0, start, pending, [0])
            slots.run([first])
            assert slots._kept[0][0] == start and not slots._again[0]
            np.testing.assert_allclose(first.logits, _fresh(target, text + pending, [start]), **HYBRID_ROUNDING)
            for token in (40, 41, 42):
                slots.run([SlotPass(0, start + 1 + token - 40, [token], [0])])
            slots.remove(0, start + 2)  # the pending token and one draft kept: past the last pass
            assert slots._again[0] == [*pending, 40]  # the kept state restored, two tokens to feed again
            text += [*pending, 40]
            pending = [31]
    finally:
        slots.close()
