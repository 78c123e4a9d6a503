"""What the slots' backend tests share: runs on several threads at once, the answers each
prompt gets alone, and a tiny Gemma 3 folder (sliding-window layers) for MLX."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np

from specrun.backends.kv import sequence_for
from specrun.backends.slots import Rendezvous, Slot
from specrun.drafters.draft_model import DraftModelDrafter
from specrun.drafters.lookup import PromptLookupDrafter
from specrun.engine.loop import SpeculativeEngine


def together(runs) -> list:
    """Each (rendezvous, run) on a thread of its own joined to the rendezvous, started at once; their results."""
    results: list = [None] * len(runs)
    start = threading.Barrier(len(runs))

    def work(index, rendezvous, run):
        rendezvous.join()
        start.wait()
        try:
            results[index] = run()
        finally:
            rendezvous.leave()

    threads = [threading.Thread(target=work, args=(i, *run)) for i, run in enumerate(runs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads)
    return results


def two_slots(model, hidden: bool = False, layers=()):
    """Two slots of ``model`` (exact), sequences 0 and 1 of one rendezvous, fed by the caller's thread;
    ``hidden``: opened with hidden states (``layers``' outputs where given), both slots tracking them."""
    slots = model.open_slots(2, exact=True, hidden=True, layers=layers) if hidden else model.open_slots(2, exact=True)
    rendezvous = Rendezvous()
    made = [Slot(slots, seq, rendezvous, model, "target") for seq in range(2)]
    for slot in made if hidden else ():
        slot.hidden_layers(layers)
        slot.track_hidden(True)
    return slots, made


def check_hidden_slots(model, first, second, layers, same) -> None:
    """Two slots of ``model`` opened with hidden states (``two_slots``): each gets its own rows' states
    and its logits from a shared batch, as its sequence fed alone gives them (``same(got, expected)``
    asserts it), before and after a rewind; the two slots' states differ."""
    rendezvous = first.rendezvous
    logits = together([(rendezvous, lambda: first.forward([1, 2, 3, 4, 5, 6], [5, 2])),
                       (rendezvous, lambda: second.forward([5, 6, 7, 8, 9], [4]))])
    alone_logits, alone_states = fed_alone(model, [1, 2, 3, 4, 5, 6], [5, 2], layers)
    assert alone_states.shape == (6, model.hidden_support.size * max(len(layers), 1))
    same(logits[0], alone_logits)
    same(first.hidden_rows(range(6)), alone_states)
    same(second.hidden_rows([4, 0]), fed_alone(model, [5, 6, 7, 8, 9], [4], layers)[1][[4, 0]])
    first.rewind(3)
    rewound = first.forward([9, 9], [0, 1])
    alone_logits, alone_states = fed_alone(model, [1, 2, 3, 9, 9], [3, 4], layers)
    same(rewound, alone_logits)
    same(first.hidden_rows(range(2)), alone_states[3:])
    assert np.abs(first.hidden_rows(range(2)) - second.hidden_rows(range(2))).max() > 1e-2


def fed_alone(model, tokens, rows, layers=()):
    """``model``'s logits at ``rows`` and hidden states (``layers``' outputs where given) at every
    row for ``tokens`` fed on an empty cache."""
    model.rewind(0)
    model.hidden_layers(layers)
    model.track_hidden(True)
    try:
        return model.forward(tokens, rows), model.hidden_rows(range(len(tokens)))
    finally:
        model.track_hidden(False)
        model.hidden_layers(())
        model.rewind(0)


def tree_alone(model, tokens, tree, rows):
    """``model``'s logits at ``rows`` for ``tokens`` and ``tree`` fed alone on an empty cache (left empty)."""
    model.rewind(0)
    try:
        return model.forward_tree(tokens, tree, rows)
    finally:
        model.keep_path([])
        model.rewind(0)


def drafter(index, draft_backend):
    """Lookup on odd slots, the draft model on even ones."""
    return PromptLookupDrafter() if index % 2 else DraftModelDrafter(draft_backend)


def answers_alone(target, draft, prompts, params) -> list:
    """Each prompt's answer (token ids) from the target alone, its slot's drafter, fresh caches."""
    alone = []
    for index, prompt in enumerate(prompts):
        sequence_for(target).reset()  # each answer on a fresh cache, as each slot's is
        sequence_for(draft).reset()
        alone.append(SpeculativeEngine(target, drafter(index, draft)).run(prompt, params).token_ids)
    return alone


NEAR_TIE = 0.1  # a logit gap the shape of a batch may flip where its settings round differently


def parting_gap(target, prompt, alone, together) -> float:
    """Where a greedy answer decoded together first differs from ``alone``: the gap between
    the lone answer's token and the other's, which must be the lone context's top two (the
    target replays the lone answer's context on a fresh cache). After it the contexts differ."""
    at = next((i for i, (a, b) in enumerate(zip(alone, together)) if a != b), None)
    assert at is not None, f"one answer ends inside the other: {together} against {alone}"
    sequence = sequence_for(target)
    sequence.reset()
    row = sequence.feed(list(prompt) + list(alone[:at]), [len(prompt) + at - 1])[0]
    sequence.reset()
    top_two = [int(token) for token in np.argsort(row)[::-1][:2]]
    assert sorted(top_two) == sorted((alone[at], together[at])), f"parted at {at} off the top two {top_two}"
    return float(abs(row[alone[at]] - row[together[at]]))


def check_answers_together(target, draft, prompts, params, exact: bool, then=None) -> None:
    """A slot of each model per prompt, decoding ``prompts`` together, give each prompt its answer alone
    (without ``exact`` settings, which round alike in any batch, one prompt of them may part from
    it at a near tie: the shape of the batch moves logits a little), and their passes were shared (the draft model's too); ``then(slots, target_slots)`` looks at
    the target's slots afterwards, before they close."""
    alone = answers_alone(target, draft, prompts, params)
    target_slots, draft_slots = target.open_slots(len(prompts), exact), draft.open_slots(len(prompts), exact)
    rendezvous = Rendezvous()
    try:
        slots = [Slot(target_slots, i, rendezvous, target, "target") for i in range(len(prompts))]
        engines = [SpeculativeEngine(slot, drafter(i, Slot(draft_slots, i, rendezvous, draft, "draft")))
                   for i, slot in enumerate(slots)]
        results = together([(rendezvous, lambda e=e, p=p: e.run(p, params)) for e, p in zip(engines, prompts)])
        together_ids = [result.token_ids for result in results]  # (a helper: pytest rewrites no assert here)
        if exact:
            assert together_ids == alone, f"together {together_ids} against alone {alone}"
        else:
            parted = [i for i, (ids, lone) in enumerate(zip(together_ids, alone)) if ids != lone]
            assert len(parted) <= 1, f"together {together_ids} against alone {alone}"
            for i in parted:
                gap = parting_gap(target, prompts[i], alone[i], together_ids[i])
                assert gap < NEAR_TIE, f"prompt {i} parted at a top-2 gap of {gap:.3f}: {together_ids[i]} against {alone[i]}"
        counts = {name: (rendezvous.counts[name].sequences, rendezvous.counts[name].passes)
                  for name in ("target", "draft")}
        assert counts["target"][0] > 2 * counts["target"][1], f"(sequences, passes): {counts}"
        assert counts["draft"][0] > counts["draft"][1], f"(sequences, passes): {counts}"
        if then is not None:
            then(slots, target_slots)
    finally:
        rendezvous.close()
        target_slots.close()
        draft_slots.close()


def random_schedule(slots, alone, seed: int, rounds: int, tolerance: dict, empty_one: bool = False) -> dict[int, list[int]]:
    """Three sequences of ``slots`` (a SlotModel of a recurrent model) started one at a time in a
    random order, then ``rounds`` batches of unequal passes in any order, each followed by rejected
    drafts rewound, kept states (``keep``) and far rewinds, some to a kept state; then a draft's
    round (a keep, one-token passes beside the others', a rewind past them) and, with ``empty_one``,
    sequence 1 emptied. Every pass's logits, every row, against ``alone(text before, tokens)``
    within ``tolerance``; the texts the sequences hold at the end."""
    from specrun.backends.slots import SlotPass

    rng = np.random.default_rng(seed)
    texts: dict[int, list[int]] = {seq: [] for seq in range(3)}
    kept = dict.fromkeys(range(3), 0)  # where each sequence last kept its state

    def step(passes):
        handed = [SlotPass(seq, len(texts[seq]), tokens, list(range(len(tokens)))) for seq, tokens in passes]
        slots.run(handed)
        for slot_pass in handed:
            np.testing.assert_allclose(slot_pass.logits, alone(texts[slot_pass.seq], list(slot_pass.tokens)),
                                       **tolerance)
            texts[slot_pass.seq] += list(slot_pass.tokens)

    def some(n):
        return [int(token) for token in rng.integers(5, 200, n)]

    for seq in rng.permutation(3):
        step([(int(seq), some(int(rng.integers(2, 7))))])
    for _ in range(rounds):
        lengths = [int(rng.integers(1, 6)) for _ in range(3)]
        present = [seq for seq in range(3) if rng.random() < 0.8] or [0]
        step([(int(seq), some(lengths[seq])) for seq in rng.permutation(present)])
        for seq in present:
            draw = rng.random()
            n_keep = (len(texts[seq]) - int(rng.integers(1, lengths[seq])) if lengths[seq] > 1 and draw < 0.6
                      else int(rng.integers(kept[seq] if draw > 0.95 else 0, len(texts[seq]))) if draw > 0.85
                      else None)
            if n_keep is not None:
                slots.remove(seq, n_keep)
                del texts[seq][n_keep:]
                kept[seq] = min(kept[seq], n_keep)
            elif draw < 0.75:
                slots.keep(seq)
                kept[seq] = len(texts[seq])
    slots.keep(0)  # as a draft's slot before drafting: its passes a token each beside the others'
    at = len(texts[0])
    for _ in range(3):
        step([(int(seq), some(1 if seq == 0 else 3)) for seq in rng.permutation(3)])
    slots.remove(0, at + 1)  # past its last pass: its kept state, its first draft fed again
    del texts[0][at + 1 :]
    if empty_one:
        slots.remove(1, 0)  # emptied, as for its next request
        texts[1] = []
    step([(int(seq), some(2)) for seq in rng.permutation(3)])
    return texts


def write_tiny_gemma3_mlx(folder: Path, tokenizer_from: Path, window: int = 8, seed: int = 0) -> Path:
    """A random Gemma 3 text model mlx-lm loads, every other layer sliding over ``window`` positions
    (a RotatingKVCache alone), with the tokenizer of the folder ``tokenizer_from``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import gemma3_text

    folder.mkdir(parents=True, exist_ok=True)
    config = dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=512, sliding_window=window,
                  sliding_window_pattern=2, rope_theta=10000.0, rope_local_base_freq=10000.0,
                  query_pre_attn_scalar=32, rms_norm_eps=1e-6, max_position_embeddings=1024)
    mx.random.seed(seed)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(config))
    for layer in model.model.layers:  # attention that matters beside Gemma's scaled-up embeddings
        layer.self_attn.q_proj.weight = layer.self_attn.q_proj.weight * 4
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * 64
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, folder / name)
    return folder
