"""Slots sharing passes (backends/slots.py) on the fake model: every slot's output is the one it
gets alone, the passes really are shared, and a failing slot leaves the others' text intact."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from specrun.backends.fake import FakeBackend, FakeSlots
from specrun.backends.slots import PREFILL_CHUNK, Rendezvous, Slot
from specrun.drafters.draft_model import DraftModelDrafter
from specrun.drafters.lookup import PromptLookupDrafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.sampling import SamplingSettings
from tests.fake_models import REPEATING_PROMPT, VOCAB, copying_logits, hashed_logits

PROMPTS = [REPEATING_PROMPT, [5, 6, 7, 5, 6, 7, 5, 6], [40, 41, 42, 43] * 3, [9] * 20]


def slot_pair(n_slots: int, table, draft_table=None):
    """``n_slots`` slots of a fake target (and of a fake draft model), one rendezvous for both."""
    rendezvous = Rendezvous()
    target = FakeBackend(table, VOCAB)
    target_slots = FakeSlots(target, n_slots)
    targets = [Slot(target_slots, seq, rendezvous, target, "target") for seq in range(n_slots)]
    drafts = [None] * n_slots
    if draft_table is not None:
        draft = FakeBackend(draft_table, VOCAB)
        draft_slots = FakeSlots(draft, n_slots)
        drafts = [Slot(draft_slots, seq, rendezvous, draft, "draft") for seq in range(n_slots)]
    return rendezvous, target_slots, targets, drafts


def run_together(rendezvous: Rendezvous, runs) -> list:
    """Each run (a function) on a thread of its own, joined to the rendezvous while it runs; none
    starts before all have joined."""
    results: list = [None] * len(runs)
    errors: list = []
    all_joined = threading.Barrier(len(runs))

    def work(index, run):
        rendezvous.join()
        all_joined.wait()
        try:
            results[index] = run()
        except BaseException as exc:  # noqa: BLE001 - collected for the test to raise
            errors.append(exc)
            results[index] = exc
        finally:
            rendezvous.leave()

    threads = [threading.Thread(target=work, args=(i, run)) for i, run in enumerate(runs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a slot never got its pass: the rendezvous hung"
    return results


@pytest.mark.parametrize("method", ["none", "lookup", "draft"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_slots_decoded_together_give_what_each_gives_alone(method, temperature):
    table, draft_table = copying_logits(salt=7, vocab_size=VOCAB), hashed_logits(VOCAB, salt=9, spread=1.0)
    rendezvous, target_slots, targets, drafts = slot_pair(len(PROMPTS), table, draft_table)
    sampling = SamplingSettings(temperature=temperature, seed=11)
    params = GenerationParams(48, draft_len=0 if method == "none" else 4, sampling=sampling, stop_at_eos=False)

    def drafter(draft):
        return {"none": None, "lookup": PromptLookupDrafter(), "draft": DraftModelDrafter(draft) if draft else None}[method]

    alone = []
    for prompt in PROMPTS:
        draft = FakeBackend(draft_table, VOCAB)
        alone.append(SpeculativeEngine(FakeBackend(table, VOCAB), drafter(draft)).run(prompt, params).token_ids)
    engines = [SpeculativeEngine(target, drafter(draft)) for target, draft in zip(targets, drafts)]
    together = run_together(rendezvous, [lambda e=e, p=p: e.run(p, params) for e, p in zip(engines, PROMPTS)])
    assert [result.token_ids for result in together] == alone
    shared = [batch for batch in target_slots.batches if len(batch) > 1]
    assert len(shared) >= 0.5 * len(target_slots.batches)  # most passes carried several sequences
    assert max(len(batch) for batch in target_slots.batches) == len(PROMPTS)


@pytest.mark.parametrize(("method", "eagle3"), [("medusa", False), ("hydra", False), ("eagle", False),
                                                ("eagle", True)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_heads_draft_for_slots_from_the_hidden_states_their_shared_passes_give(method, eagle3, temperature):
    """Slots of a model opened with hidden states (EAGLE-3's: the layers it reads): each slot's
    heads drafter reads its own sequence's states from the batches it shares, and drafts, accepts
    and answers exactly as the same heads on the model alone (a state from another slot's rows
    would draft otherwise)."""
    from heads_factory import FAKE_LAYERS, oracle_heads_for, oracle_hidden
    from specrun.drafters.heads.eagle import eagle3_layers
    from specrun.drafters.methods import DrafterOptions, build_drafter

    table = copying_logits(salt=7, vocab_size=VOCAB)
    hidden = oracle_hidden(table, VOCAB)
    heads = oracle_heads_for(method, VOCAB, eagle3=eagle3)
    size = heads.config.hidden_size

    def model() -> FakeBackend:
        return FakeBackend(table, VOCAB, hidden_table=hidden, hidden_size=size, n_layers=FAKE_LAYERS)

    params = GenerationParams(32, draft_len=3, sampling=SamplingSettings(temperature=temperature, seed=5),
                              stop_at_eos=False)
    alone = [SpeculativeEngine(model(), build_drafter(method, None, DrafterOptions(heads=heads))).run(prompt, params)
             for prompt in PROMPTS]
    target = model()
    layers = eagle3_layers(heads, target) if eagle3 else ()
    target_slots, rendezvous = FakeSlots(target, len(PROMPTS), hidden=True, layers=layers), Rendezvous()
    slots = [Slot(target_slots, seq, rendezvous, target, "target") for seq in range(len(PROMPTS))]
    assert slots[0].hidden_support.available and bool(slots[0].hidden_support.layer_outputs) == eagle3
    engines = [SpeculativeEngine(slot, build_drafter(method, None, DrafterOptions(heads=heads))) for slot in slots]
    together = run_together(rendezvous, [lambda e=e, p=p: e.run(p, params) for e, p in zip(engines, PROMPTS)])
    assert [result.token_ids for result in together] == [result.token_ids for result in alone]
    assert [(r.stats.drafted, r.stats.accepted) for r in together] == [(r.stats.drafted, r.stats.accepted)
                                                                      for r in alone]
    assert sum(result.stats.accepted for result in together) > 0
    assert max(len(batch) for batch in target_slots.batches) > 1  # the passes were shared


@pytest.mark.parametrize(("method", "temperature"), [("draft", 0.0), ("draft", 0.8), ("eagle", 0.0), ("eagle", 0.8)])
def test_trees_drafted_for_slots_are_verified_in_their_shared_passes_as_alone(method, temperature):
    """Slots whose model holds trees: each slot's draft model (or EAGLE heads) drafts a tree, the
    shared batch carries every slot's tokens and nodes, the accepted path is kept before the next
    batch, and each answer, and what it drafted and accepted, is the one it gets alone."""
    from heads_factory import oracle_heads_for, oracle_hidden
    from specrun.drafters.methods import DrafterOptions, build_drafter

    table, draft_table = copying_logits(salt=7, vocab_size=VOCAB), hashed_logits(VOCAB, salt=9, spread=1.0)
    hidden = oracle_hidden(table, VOCAB)
    heads = oracle_heads_for("eagle", VOCAB)

    def model() -> FakeBackend:
        return FakeBackend(table, VOCAB, hidden_table=hidden, hidden_size=heads.config.hidden_size)

    def drafter(draft):
        if method == "draft":
            return DraftModelDrafter(draft, branches=2)
        return build_drafter("eagle", None, DrafterOptions(heads=heads, branches=2))

    params = GenerationParams(32, draft_len=3, sampling=SamplingSettings(temperature=temperature, seed=3),
                              stop_at_eos=False, tree_nodes=12)
    alone = [SpeculativeEngine(model(), drafter(FakeBackend(draft_table, VOCAB))).run(prompt, params)
             for prompt in PROMPTS]
    target, draft = model(), FakeBackend(draft_table, VOCAB)
    target_slots = FakeSlots(target, len(PROMPTS), hidden=method == "eagle", trees=True)
    draft_slots, rendezvous = FakeSlots(draft, len(PROMPTS)), Rendezvous()
    targets = [Slot(target_slots, seq, rendezvous, target, "target") for seq in range(len(PROMPTS))]
    drafts = [Slot(draft_slots, seq, rendezvous, draft, "draft") for seq in range(len(PROMPTS))]
    assert targets[0].tree_support.available
    engines = [SpeculativeEngine(t, drafter(d)) for t, d in zip(targets, drafts)]
    together = run_together(rendezvous, [lambda e=e, p=p: e.run(p, params) for e, p in zip(engines, PROMPTS)])
    assert [result.token_ids for result in together] == [result.token_ids for result in alone]
    assert [(r.stats.drafted, r.stats.accepted) for r in together] == [(r.stats.drafted, r.stats.accepted)
                                                                      for r in alone]
    trees = target_slots.kept_paths
    assert any(size > len(path) for _, size, path in trees) and any(path for _, _, path in trees)  # branches, kept
    assert max(len(batch) for batch in target_slots.batches) > 1  # the passes were shared
    for target_slot, result, prompt in zip(targets, together, PROMPTS):  # the caches hold the texts
        assert target_slots.caches[target_slot.seq][: target_slot.n_past] == [*prompt, *result.token_ids][: target_slot.n_past]


def test_a_tree_s_nodes_count_in_what_the_other_slots_fed():
    """A pass of 1 token and 4 nodes beside one of 2 tokens: each slot reads the other's rows as
    the batch's (what prices a shared pass: TargetCosts.others_tokens)."""
    from specrun.tree import TokenTree
    from tests.slots.slot_runs import together

    target = FakeBackend(copying_logits(salt=7, vocab_size=VOCAB), VOCAB)
    fake = FakeSlots(target, 2, trees=True)
    rendezvous = Rendezvous()
    a, b = (Slot(fake, seq, rendezvous, target, "target") for seq in range(2))
    a.forward([1, 2], [])
    b.forward([1, 2], [])
    tree = TokenTree((3, 4, 5, 6), (-1, 0, 1, 2))
    together([(rendezvous, lambda: a.forward_tree([3], tree, [0])), (rendezvous, lambda: b.forward([3, 4], [0]))])
    assert a.others_tokens_in_pass == 2
    assert b.others_tokens_in_pass == 5


def test_slots_opened_without_hidden_states_refuse_heads_saying_why():
    table = copying_logits(salt=7, vocab_size=VOCAB)
    target = FakeBackend(table, VOCAB, hidden_table=lambda context: np.zeros(4, np.float32), hidden_size=4)
    slot = Slot(FakeSlots(target, 2), 0, Rendezvous(), target, "target")
    with pytest.raises(ValueError, match="these slots give no hidden states"):
        slot.track_hidden(True)
    with pytest.raises(ValueError, match="no hidden states"):
        slot.token_embeddings([1])
    opened = Slot(FakeSlots(target, 2, hidden=True), 0, Rendezvous(), target, "target")
    with pytest.raises(ValueError, match="opened for the output head's input give no layer outputs"):
        opened.hidden_layers([0])
    opened.track_hidden(True)
    opened.forward([1, 2, 3], [2])
    assert opened.hidden_rows(range(3)).shape == (3, 4)


def test_a_long_prompt_is_fed_in_chunks_beside_the_slots_already_decoding():
    table = hashed_logits(VOCAB, salt=3)
    rendezvous, target_slots, targets, _ = slot_pair(2, table)
    long_prompt = [int(t) for t in np.random.default_rng(0).integers(0, VOCAB, 3 * PREFILL_CHUNK + 10)]
    params = GenerationParams(40, draft_len=0, stop_at_eos=False)
    started = threading.Event()

    def short():
        engine = SpeculativeEngine(targets[0])
        started.set()
        return engine.run([1, 2, 3], params)

    def long():
        started.wait()
        return SpeculativeEngine(targets[1]).run(long_prompt, params)

    short_result, long_result = run_together(rendezvous, [short, long])
    assert long_result.token_ids == SpeculativeEngine(FakeBackend(table, VOCAB)).run(long_prompt, params).token_ids
    assert short_result.token_ids == SpeculativeEngine(FakeBackend(table, VOCAB)).run([1, 2, 3], params).token_ids
    long_chunks = [dict(batch)[1] for batch in target_slots.batches if 1 in dict(batch)]
    assert max(long_chunks) == PREFILL_CHUNK  # never the whole prompt in one pass
    beside = [batch for batch in target_slots.batches if dict(batch).get(1, 0) == PREFILL_CHUNK and 0 in dict(batch)]
    assert beside, "the short answer was not decoded beside the long prompt's chunks"


def test_a_slot_whose_pass_fails_fails_alone_and_the_others_go_on():
    table = hashed_logits(VOCAB, salt=5)
    rendezvous, target_slots, targets, _ = slot_pair(3, table)
    target_slots.slot_ctx = 30  # a 28-token prompt leaves room for 2 tokens only
    params = GenerationParams(20, draft_len=0, stop_at_eos=False)
    prompts = [[1, 2, 3], list(range(1, 29)), [7, 8]]
    targets[1].n_ctx = 64  # the slot believes it has room: the model's own check must catch it
    results = run_together(rendezvous, [lambda e=SpeculativeEngine(t), p=p: e.run(p, params)
                                        for t, p in zip(targets, prompts)])
    assert isinstance(results[1], ValueError) and "overflow" in str(results[1])
    for index in (0, 2):
        alone = SpeculativeEngine(FakeBackend(table, VOCAB)).run(prompts[index], params)
        assert results[index].token_ids == alone.token_ids


def test_a_removal_that_fails_fails_its_slot_alone_and_the_runner_goes_on():
    """A model's removal raising (its cache in an unknown state): that slot's pass fails with the
    error; the other slot's pass runs in the same batch, and the runner thread takes later passes."""
    table = hashed_logits(VOCAB, salt=5)
    rendezvous, target_slots, targets, _ = slot_pair(2, table)
    removal = target_slots.remove

    def failing(seq, n_keep):
        if seq == 1:
            raise OSError("the cache could not drop its cells")
        removal(seq, n_keep)

    target_slots.remove = failing
    for target in targets:
        target.forward([1, 2, 3], [])
        target.rewind(2)
    results = run_together(rendezvous, [lambda t=t: t.forward([7], [0]) for t in targets])
    np.testing.assert_array_equal(results[0][0], table((1, 2, 7)))
    assert isinstance(results[1], OSError) and "could not drop" in str(results[1])
    target_slots.remove = removal
    targets[1].rewind(0)
    np.testing.assert_array_equal(targets[1].forward([4, 5], [1])[0], table((4, 5)))
    assert target_slots.batches[-2] == ((0, 1),)  # the failed slot's pass was not in the batch


def test_a_removal_that_fails_beside_another_slot_s_pass_is_tried_again_before_its_own():
    """A slot rewinds; its removal runs, and fails, before another slot's batch: it is recorded
    again, so the slot's own next pass starts where the slot says (before, the cells stayed and its
    pass failed: the sequence held a token its slot had let go)."""
    table = hashed_logits(VOCAB, salt=5)
    _, target_slots, targets, _ = slot_pair(2, table)
    removal, failures = target_slots.remove, []

    def failing_once(seq, n_keep):
        if seq == 1 and not failures:
            failures.append(n_keep)
            raise OSError("the cache could not drop its cells")
        removal(seq, n_keep)

    target_slots.remove = failing_once
    for target in targets:
        target.forward([1, 2, 3], [])
    targets[1].rewind(2)
    np.testing.assert_array_equal(targets[0].forward([7], [0])[0], table((1, 2, 3, 7)))
    assert failures == [2] and target_slots.caches[1] == [1, 2, 3]
    np.testing.assert_array_equal(targets[1].forward([9], [0])[0], table((1, 2, 9)))


def failing_partial_removals(target_slots, seq: int) -> list[int]:
    """``seq``'s removals of part of its cells fail (a state that cannot be restored); emptying it
    whole works. Returns the n_keep of each removal that failed."""
    removal, failures = target_slots.remove, []

    def failing(at, n_keep):
        if at == seq and n_keep > 0:
            failures.append(n_keep)
            raise OSError("the cache could not drop its cells")
        removal(at, n_keep)

    target_slots.remove = failing
    return failures


def test_a_removal_that_fails_twice_empties_the_sequence_and_its_slot_starts_afresh():
    """Not tried for ever: failing again before the slot's next pass, the sequence is emptied
    whole, that pass fails, and the slot counts nothing cached; its next request reads it all."""
    table = hashed_logits(VOCAB, salt=5)
    rendezvous, target_slots, targets, _ = slot_pair(2, table)
    for target in targets:
        target.forward([1, 2, 3], [])
    failures = failing_partial_removals(target_slots, 1)
    targets[1].rewind(2)
    results = run_together(rendezvous, [lambda t=t: t.forward([7], [0]) for t in targets])
    assert isinstance(results[1], OSError) and failures == [2] and targets[1].n_past == 2  # tried again next
    with pytest.raises(OSError, match="could not drop"):
        targets[1].forward([7], [0])
    assert failures == [2, 2] and target_slots.caches[1] == [] and targets[1].n_past == 0
    np.testing.assert_array_equal(targets[1].forward([4, 5], [1])[0], table((4, 5)))
    np.testing.assert_array_equal(results[0][0], table((1, 2, 3, 7)))


def test_a_slot_whose_sequence_was_emptied_between_its_passes_is_told_at_its_next():
    """The removal fails twice in other slots' batches: the slot's next pass fails (it would read
    cells it counts as cached, gone) and counts nothing cached; a request after reads afresh."""
    table = hashed_logits(VOCAB, salt=5)
    _, target_slots, targets, _ = slot_pair(2, table)
    for target in targets:
        target.forward([1, 2, 3], [])
    failures = failing_partial_removals(target_slots, 1)
    targets[1].rewind(2)
    targets[0].forward([7], [0])
    targets[0].forward([8], [0])
    assert failures == [2, 2] and target_slots.caches[1] == [] and targets[1].emptied
    with pytest.raises(RuntimeError, match="emptied after a rewind of it failed"):
        targets[1].forward([9], [0])
    assert not targets[1].emptied
    assert targets[1].n_past == 0 and target_slots.caches[1] == []
    np.testing.assert_array_equal(targets[1].forward([4, 5], [1])[0], table((4, 5)))
    targets[1].rewind(0)  # a slot that rewinds to nothing is not told later: empty either way
    failures.clear()
    target_slots.caches[1] = [4, 5]
    targets[1].rewind(1)
    targets[0].forward([1], [0])
    targets[0].forward([1], [0])
    targets[1].rewind(0)
    np.testing.assert_array_equal(targets[1].forward([6], [0])[0], table((6,)))


def test_a_request_after_its_slot_was_emptied_while_idle_reads_its_prompt_afresh():
    """The slot's sequence emptied while it waited between requests: its session's next text
    (ChatSession.new_text) empties the slot's account too, so the request reads its whole prompt
    and answers as alone, where its first pass would otherwise have failed."""
    from specrun.backends.kv import sequence_for
    from specrun.sessions.chat import ChatSession

    table = hashed_logits(VOCAB, salt=5)
    _, target_slots, targets, _ = slot_pair(2, table)
    session = ChatSession(targets[1], None, "lookup")
    sequence = sequence_for(targets[1])
    sequence.feed([1, 2, 3])
    failures = failing_partial_removals(target_slots, 1)
    sequence.rewind(2)
    targets[0].forward([7], [0])
    targets[0].forward([8], [0])
    assert failures == [2, 2] and targets[1].emptied
    session.new_text()
    assert not targets[1].emptied and sequence.tokens == [] and targets[1].n_past == 0
    np.testing.assert_array_equal(sequence.feed([1, 2, 9], [2])[0], table((1, 2, 9)))


def test_a_sequence_whose_cells_a_failed_batch_wrote_is_emptied_when_they_cannot_be_dropped():
    """A batch fails whole after writing cells; retried alone, each pass first drops what it wrote.
    Where that fails the sequence is emptied (never a pass over stray cells) and its pass fails."""
    table = hashed_logits(VOCAB, salt=5)
    rendezvous, target_slots, targets, _ = slot_pair(2, table)
    for target in targets:
        target.forward([1, 2, 3], [])
    run = target_slots.run

    def writing_then_failing(passes):
        if len(passes) > 1:
            target_slots.caches[1].append(99)  # the stray cell of a batch whose compute failed
            raise RuntimeError("the batch's compute failed")
        run(passes)

    target_slots.run = writing_then_failing
    failures = failing_partial_removals(target_slots, 1)
    results = run_together(rendezvous, [lambda t=t: t.forward([7], [0]) for t in targets])
    np.testing.assert_array_equal(results[0][0], table((1, 2, 3, 7)))
    assert isinstance(results[1], OSError) and failures == [3]
    assert target_slots.caches[1] == [] and targets[1].n_past == 0
    np.testing.assert_array_equal(targets[1].forward([4], [0])[0], table((4,)))


def test_a_thread_outside_any_generation_runs_its_pass_at_once():
    """A probe or a warm-up on a slot (no join) does not wait for slots that are generating."""
    table = hashed_logits(VOCAB, salt=5)
    rendezvous, _, targets, _ = slot_pair(2, table)
    logits = targets[0].forward([1, 2, 3], [2])
    np.testing.assert_array_equal(logits[0], table((1, 2, 3)))
    targets[0].rewind(1)
    assert targets[0].n_past == 1
    assert rendezvous.joined == 0


def test_a_rewind_is_run_before_the_model_s_next_batch():
    table = hashed_logits(VOCAB, salt=5)
    rendezvous, target_slots, targets, _ = slot_pair(1, table)
    targets[0].forward([1, 2, 3, 4], [])
    targets[0].rewind(2)
    assert target_slots.caches[0] == [1, 2, 3, 4]  # recorded, not run yet
    out = targets[0].forward([9], [0])
    assert target_slots.caches[0] == [1, 2, 9]
    np.testing.assert_array_equal(out[0], table((1, 2, 9)))


def test_a_slot_knows_what_the_other_sequences_fed_its_last_pass():
    """Slot.others_tokens_in_pass: the batch's tokens less the slot's own (what a shared pass's cost
    is read by: TargetCosts.others_tokens)."""
    table = hashed_logits(VOCAB, salt=6)
    rendezvous, target_slots, targets, _ = slot_pair(2, table)
    fed = [[1, 2, 3, 4, 5], [7, 8]]
    run_together(rendezvous, [lambda slot=slot, tokens=tokens: slot.forward(tokens, [len(tokens) - 1])
                              for slot, tokens in zip(targets, fed)])
    assert target_slots.batches == [((0, 5), (1, 2))] or target_slots.batches == [((1, 2), (0, 5))]
    assert (targets[0].others_tokens_in_pass, targets[1].others_tokens_in_pass) == (2, 5)
    assert (targets[0].others_in_pass, targets[1].others_in_pass) == (1, 1)
    alone = FakeBackend(table, VOCAB)
    assert getattr(alone, "others_tokens_in_pass", 0) == 0


def test_the_rendezvous_tells_its_observer_of_every_batch_that_ran_whole():
    """What slots sharing a draft length price the batch by (control/batch.py, BatchDrafts.timed):
    each batch by its model's label and each sequence's tokens; a batch that failed (run again a
    pass at a time) is no batch's cost, and is not told."""
    table = hashed_logits(VOCAB, salt=6)
    rendezvous, target_slots, targets, drafts = slot_pair(2, table, hashed_logits(VOCAB, salt=8))
    seen = []
    rendezvous.observer = lambda label, lengths, seconds: seen.append((label, sorted(lengths), seconds >= 0.0))
    run_together(rendezvous, [lambda: targets[0].forward([1, 2, 3], [2]), lambda: targets[1].forward([7, 8], [1])])
    run_together(rendezvous, [lambda: drafts[0].forward([1], [0]), lambda: drafts[1].forward([7], [0])])
    assert seen == [("target", [2, 3], True), ("draft", [1, 1], True)]
    target_slots.slot_ctx = 5  # the next batch overflows slot 1's sequence: it fails as a whole
    results = run_together(rendezvous, [lambda: targets[0].forward([4], [0]),
                                        lambda: targets[1].forward([9, 9, 9, 9], [3])])
    assert isinstance(results[1], ValueError) and not isinstance(results[0], BaseException)
    assert seen == [("target", [2, 3], True), ("draft", [1, 1], True)]


def test_an_observer_that_fails_is_let_go_and_the_slots_go_on():
    table = hashed_logits(VOCAB, salt=6)
    rendezvous, _, targets, _ = slot_pair(2, table)

    def failing(label, lengths, seconds):
        raise RuntimeError("a broken observer")

    rendezvous.observer = failing
    first = run_together(rendezvous, [lambda: targets[0].forward([1, 2], [1]), lambda: targets[1].forward([3], [0])])
    second = run_together(rendezvous, [lambda: targets[0].forward([4], [0]), lambda: targets[1].forward([5], [0])])
    assert not any(isinstance(result, BaseException) for result in first + second)
    np.testing.assert_array_equal(second[0][0], table((1, 2, 4)))
    assert rendezvous.observer is None and "broken observer" in str(rendezvous.observer_error)
