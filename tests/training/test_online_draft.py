"""Draft models that learn online (training/online_draft.py): the windows cut from verified text,
the acceptance reported, what a learner learns, and that learning never changes an answer (greedy
on the fake and on MLX here; the sampled scenarios "draft learning …" of lossless_harness swap the
fake's adapter between runs; backends/mlx_lora.py's trainer on its own below)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from specrun.backends.fake import FakeBackend
from specrun.training.learner import LearnSettings
from specrun.training.online import Learning
from specrun.training.online_draft import DraftLearner, TokenWindow, draft_cannot_learn

VOCAB = 8


def following(token: int) -> int:
    return (3 * token + 1) % VOCAB


def stream(length: int, start: int) -> list[int]:
    tokens = [start]
    while len(tokens) < length:
        tokens.append(following(tokens[-1]))
    return tokens


def wrong_draft() -> FakeBackend:
    """A fake draft whose guess after v is v + 1: the stream's (3v + 1 mod 8) only after 0 and 4, in
    the cycle 0 1 4 5; never in the cycle 2 7 6 3 that ``feed`` hands over."""
    def table(context):
        logits = np.zeros(VOCAB, np.float32)
        logits[(context[-1] + 1) % VOCAB] = 3.0
        return logits

    return FakeBackend(table, VOCAB)


def feed(learner: DraftLearner, texts: int, length: int = 60, prompt: int = 4, stride: int = 3) -> None:
    """``texts`` texts of the stream handed over as a drafter does: the prompt's length first, then
    the context after each verify pass of ``stride`` tokens, and the whole text at its end."""
    for k in range(texts):
        tokens = stream(length, (2, 7, 6, 3)[k % 4])
        learner.start_text()
        handed = prompt
        for stop in range(prompt + stride, length + 1, stride):
            learner.observe(handed, tokens[:stop])
            handed = stop
        learner.observe(handed, tokens)
    learner.start_text()


class Recorder(DraftLearner):
    """The windows handed to the worker, kept instead of trained on."""

    def _hand(self, window) -> None:
        self.handed.append(window)


def test_windows_hold_the_target_s_tokens_after_up_to_a_window_of_context():
    learner = Recorder(wrong_draft(), window=4, inline=True)
    learner.handed = []
    tokens = list(range(100, 120))
    learner.start_text()
    learner.observe(3, tokens[:6])  # a prompt of 3, then 3 generated
    learner.observe(6, tokens[:13])
    learner.observe(13, tokens[:14])
    learner.observe(20, tokens[:14] + [0] * 6 + [1, 2])  # not where the run ended: a new run
    learner.start_text()
    windows = [(list(window.tokens), window.first) for window in learner.handed]
    assert windows == [
        (tokens[:7], 3),  # positions 3..6, after the prompt
        (tokens[3:11], 4),  # positions 7..10, after four tokens before them
        (tokens[7:14], 4),  # the run's rest, 11..13, handed when a new run begins
        ([0, 0, 0, 0, 1, 2], 4),  # the new run's two positions at the text's end
    ]
    assert [window.size for window in learner.handed] == [4, 4, 3, 2]


def test_the_reported_acceptance_by_depth_is_the_greedy_chain_s():
    """Teacher-forced guesses scored as `heads train` scores chains equal what drafting greedy
    chains from every position accepts."""
    rng = np.random.default_rng(3)
    noise = rng.normal(0, 1, (VOCAB, VOCAB)).astype(np.float32)

    def table(context):
        return noise[context[-1]] + 2.0 * (np.arange(VOCAB) == following(context[-1]))

    draft = FakeBackend(table, VOCAB)
    learner = DraftLearner(draft, window=40, inline=True)
    tokens = np.asarray(stream(30, 1)[:10] + list(rng.integers(0, VOCAB, 30)), np.int64)
    window = TokenWindow(tokens, 5)
    guesses, labels = learner._guesses(window), learner._labels(window)
    depth = learner.depth
    for t in range(window.size - depth + 1):  # positions every depth labels
        context = list(tokens[: 5 + t])
        chain = []
        for _ in range(depth):
            chain.append(int(table(tuple(context)).argmax()))
            context.append(chain[-1])
        accepted = next((d for d in range(depth) if chain[d] != tokens[5 + t + d]), depth)
        right = guesses[:, t] == labels[:, t]
        assert int(np.cumprod(right).sum()) == accepted


def test_a_draft_model_learns_a_stream_it_did_not_know():
    """The same stream with learning and without (a rate too small to move the adapter): the
    acceptance over the latest positions, each scored before it was trained on."""
    reports = []
    for rate in (1e-12, 1.0):
        learner = DraftLearner(wrong_draft(), learning_rate=rate, window=8, inline=True, inline_steps=4)
        feed(learner, 12)
        learner.close()
        reports.append(learner.report())
    without, learned = reports
    assert learned.kind == "draft" and learned.steps > 0 and not learned.stopped
    assert without.latest[0] == 0.0 and learned.latest[0] >= 0.95, (without.summary(), learned.summary())
    assert learned.latest[-1] >= without.latest[-1] + 0.5 and learned.first_positions > 0


def test_the_drafter_swaps_adapters_in_and_a_text_s_tail_is_learned_from():
    """A drafter's learner gets every verified token (the tail too, at ``finish``) and the fake
    drafts with each adapter published."""
    from specrun.drafters.methods import DrafterOptions, build_drafter
    from specrun.engine.loop import GenerationParams, SpeculativeEngine

    target = FakeBackend(lambda context: 3.0 * (np.arange(VOCAB) == following(context[-1])), VOCAB)
    draft = wrong_draft()
    learner = DraftLearner(draft, learning_rate=1.0, window=4, inline=True)
    drafter = build_drafter("draft", draft, DrafterOptions(draft_learner=learner))
    engine = SpeculativeEngine(target, drafter, method="draft")
    results = []
    for start in (2, 7, 6):  # the cycle the draft never guesses
        results.append(engine.run([start, following(start)], GenerationParams(40, draft_len=3, stop_at_eos=False)))
        drafter.finish(engine.last_context)
    report = learner.report()
    assert report.seen == 3 * 40 and report.swaps > 3 and draft.adapter is not None
    accepted = [result.stats.accepted for result in results]
    assert accepted[-1] >= 25 and accepted[-1] > accepted[0] + 10, accepted  # at most 30: 3 of 4 a pass


def test_the_budget_expects_a_step_to_cost_what_the_last_one_did():
    """The worker's time is its wall clock (MLX computes on its stream's own thread), and a draft
    model's step is dear: each costs 0.2 s here. 9.9 s of generation at a share of 5% allow 0.495 s:
    the first step (its cost unknown) and a second, not a third, which would cross it."""
    spent, now = [0.0], [0.0]
    learner = DraftLearner(wrong_draft(), LearnSettings(share=0.05), window=4, clock=lambda: now[0],
                           cpu_clock=lambda: spent[0])
    stepped = learner.trainer.step

    def costly(windows):
        spent[0] += 0.2
        return stepped(windows)

    learner.trainer.step = costly
    tokens = stream(404, 0)
    learner.start_text()
    for stop in range(4, 404, 4):
        now[0] += 0.1
        learner.observe(stop - 4, tokens[:stop])
        time.sleep(0.002)
    time.sleep(0.3)
    busy = learner.report()
    assert busy.busy_seconds == pytest.approx(9.9)
    assert busy.steps == 2 and busy.busy_cpu <= 0.05 * busy.busy_seconds, busy.summary()
    learner.close()


@pytest.mark.parametrize("keep, share, score_cost, steps", [
    (False, 0.05, 0.0, 0),  # nothing keeps the adapters: the last window is only counted
    (True, 0.05, 0.0, 1),  # 0.245 s allowed: one 0.2 s step, not two
    (True, 0.05, 0.05, 0),  # no step timed: 3 x 2 windows x the 0.05 s score would cross it
    (True, 1.0, 0.05, 4),  # 4.9 s allowed: the window's positions trained on EPOCHS (4) times
])
def test_a_kept_draft_learns_its_last_window_at_close_within_the_budget(keep, share, score_cost, steps):
    """A text shorter than a window hands the worker nothing while it is generated; at close its
    window is scored and trained on within the budget where the adapters are kept (--keep-learned:
    what the run learned is written), a step never timed expected to cost what scoring says, and
    only counted where nothing would keep them. No weights are published then: no drafter takes them."""
    spent, now = [0.0], [0.0]
    learner = DraftLearner(wrong_draft(), LearnSettings(share=share, keep=keep, idle=False), window=400,
                           clock=lambda: now[0], cpu_clock=lambda: spent[0])
    stepped, guessed = learner.trainer.step, learner._guesses

    def costly(windows):
        spent[0] += 0.2
        return stepped(windows)

    def scored(window):
        spent[0] += score_cost
        return guessed(window)

    learner.trainer.step, learner._guesses = costly, scored
    tokens = stream(204, 0)
    learner.start_text()
    for stop in range(4, 204, 4):
        now[0] += 0.1
        learner.observe(stop - 4, tokens[:stop])
    assert learner.report().steps == 0
    learner.close()
    report = learner.report()
    assert report.seen == 199 and report.busy_seconds == pytest.approx(4.9)
    assert report.steps == steps, report.summary()
    assert report.busy_cpu + report.closing_cpu <= share * report.busy_seconds and learner.latest(0) is None


def test_learning_keeps_one_learner_per_draft_model_and_says_why_one_cannot_learn():
    notes = []
    learning = Learning(LearnSettings(), on_note=notes.append, explicit=True, inline=True)
    draft = wrong_draft()
    first = learning.draft(draft)
    assert first is not None and learning.draft(draft) is first and notes == []
    reports = learning.finish()
    assert [report.kind for report in reports] == ["draft"] and reports[0].kept is None

    class Windowed:
        name = "mlx"

    assert draft_cannot_learn(Windowed()) == "this draft model (mlx) cannot learn online"
    assert draft_cannot_learn(draft) == ""


def test_greedy_with_a_learning_draft_is_plain_decoding_on_the_fake():
    import lossless_harness

    made = []
    learning_draft = lossless_harness.learning_draft
    lossless_harness.learning_draft = lambda draft, soft=True: made.append(learning_draft(draft, soft)) or made[-1]
    try:
        problems, drafted, accepted = lossless_harness.greedy_scenario("draft", learn=True)
    finally:
        lossless_harness.learning_draft = learning_draft
    assert problems == [] and drafted > 0
    report = made[0].report()
    assert report.steps > 10 and report.swaps > 10, report.summary()


# ---- soft labels: the target's distributions (--learn-labels distributions) ----------------------
def test_soft_labels_hold_the_target_s_likeliest_tokens_at_the_positions_its_rows_chose():
    from specrun.training.online_draft import SOFT_TOP, top_distributions

    learner = Recorder(wrong_draft(), window=4, inline=True, soft_labels=True)
    learner.handed = []
    rng = np.random.default_rng(0)
    tokens = [(5 * i + 1) % VOCAB for i in range(12)]
    rows = {position: rng.normal(0, 2, VOCAB).astype(np.float32) for position in range(3, 12)}
    learner.start_text()
    learner.observe_rows(3, np.stack([rows[3], rows[4]]))  # a pass kept positions 3 and 4
    learner.observe(3, tokens[:5])
    # position 5 came from a pass whose rows stayed on the device (greedy): no row
    learner.observe_rows(6, np.stack([rows[p] for p in range(6, 12)]))
    learner.observe(5, tokens[:12])
    learner.start_text()
    assert [(window.first, window.size) for window in learner.handed] == [(3, 4), (4, 4), (4, 1)]
    expected_ids, expected_p = top_distributions(np.stack([rows[p] for p in range(3, 12)]), SOFT_TOP)
    assert expected_ids.shape == (9, VOCAB)  # fewer tokens than SOFT_TOP: every one

    def dense(ids, probabilities):
        label = np.zeros(VOCAB)
        np.add.at(label, ids, probabilities)
        return label

    labels = [dense(ids, p) for window in learner.handed for ids, p in zip(*window.soft)]
    positions = range(3, 12)
    for position, label in zip(positions, labels):
        if position == 5:  # its token, at probability 1
            assert label[tokens[5]] == 1.0 and label.sum() == 1.0
        else:
            row = rows[position].astype(np.float64)
            softmax = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
            assert np.allclose(label, softmax, atol=1e-6)
    assert learner._rows_at == {}


def test_top_distributions_keep_the_likeliest_renormalised_and_masked_ids_at_zero():
    from specrun.training.online_draft import top_distributions

    logits = np.array([[0.0, 2.0, -np.inf, 1.0, -1.0]], np.float32)
    ids, probabilities = top_distributions(logits, 2)
    order = np.argsort(ids[0])
    assert ids[0][order].tolist() == [1, 3]
    assert np.allclose(probabilities[0][order], np.exp([2.0, 1.0]) / np.exp([2.0, 1.0]).sum())
    ids, probabilities = top_distributions(logits, 5)
    assert probabilities[0][ids[0] == 2] == 0.0 and np.isclose(probabilities.sum(), 1.0)


def stream_with_rows(learner: DraftLearner, texts: int, second: float, length: int = 60, stride: int = 3) -> None:
    """``feed``'s stream, each pass's rows handed first: the target puts 1 - ``second`` on the
    stream's next token and ``second`` on the token after that one."""
    for k in range(texts):
        tokens = stream(length, (2, 7, 6, 3)[k % 4])
        learner.start_text()
        for stop in range(4 + stride, length + 1, stride):
            rows = np.full((stride, VOCAB), -np.inf, np.float32)
            for offset, position in enumerate(range(stop - stride, stop)):
                before = tokens[position - 1]
                rows[offset, following(before)] = np.log(1.0 - second)
                rows[offset, following(following(before))] = np.log(second)
            learner.observe_rows(stop - stride, rows)
            learner.observe(stop - stride, tokens[:stop])
    learner.start_text()


def test_a_draft_model_learns_the_target_s_distribution_from_soft_labels_and_only_its_token_without():
    """Tokens teach the draft the target's likeliest token; soft labels teach it the odds too, which
    is what acceptance at T > 0 (the sum of min(p, q)) rewards."""
    learned = {}
    for soft in (False, True):
        learner = DraftLearner(wrong_draft(), learning_rate=1.0, window=8, inline=True, inline_steps=4,
                               soft_labels=soft)
        stream_with_rows(learner, 12, second=0.3)
        learner.close()
        assert learner.report().labels == ("distributions" if soft else "tokens")
        logits = learner.trainer._logits(np.array([2]), 0)  # after 2: the stream's 7 (0.7), then 6 (0.3)
        q = np.exp(logits - logits.max())
        learned[soft] = q / q.sum()
    assert learned[False][7] > 0.9 and learned[False][6] < 0.05
    assert abs(learned[True][7] - 0.7) < 0.1 and abs(learned[True][6] - 0.3) < 0.1, learned[True]


ENGINE_VOCAB = 12


def engine_table(context):
    noise = np.random.default_rng(5).normal(0, 1, (ENGINE_VOCAB, ENGINE_VOCAB)).astype(np.float32)
    return noise[context[-1]] + 2.0 * (np.arange(ENGINE_VOCAB) == (3 * context[-1] + 1) % ENGINE_VOCAB)


@pytest.mark.parametrize("temperature, branches, lossy, eos", [
    (0.8, 0, None, False),  # chains
    (0.8, 0, None, True),  # answers cut by an EOS inside a pass's kept tokens
    (0.8, 3, None, True),  # trees: each accepted node's row
    (0.0, 0, "typical", False),  # a lossy rule brings its rows at T = 0 too
    (0.8, 3, "margin", False),
])
def test_the_engine_hands_a_learning_draft_the_row_that_chose_each_token(temperature, branches, lossy, eos):
    """Every position's soft label is the target's distribution given the text before it (the first
    token's: the prompt's row), whatever the pass's shape."""
    from specrun.drafters.methods import DrafterOptions, build_drafter
    from specrun.engine.loop import GenerationParams, SpeculativeEngine
    from specrun.sampling import SamplingSettings
    from specrun.verify import LossyAcceptance

    target = FakeBackend(engine_table, ENGINE_VOCAB, eos_ids=[11])
    labelled = hard = 0
    for seed in range(4):
        draft = FakeBackend(lambda context: 1.2 * engine_table(context), ENGINE_VOCAB, eos_ids=[11])
        learner = Recorder(draft, window=4, inline=True, soft_labels=True)
        learner.handed = []
        drafter = build_drafter("draft", draft, DrafterOptions(draft_learner=learner, branches=branches))
        engine = SpeculativeEngine(target, drafter, method="draft")
        if lossy is not None:
            engine.passes.acceptance = LossyAcceptance(lossy, factor=2.0) if lossy == "margin" else LossyAcceptance(lossy)
        sampling = SamplingSettings(temperature=temperature, seed=seed)
        engine.run([1, 2, 3], GenerationParams(37, draft_len=4, stop_at_eos=eos, sampling=sampling))
        drafter.finish(engine.last_context)
        text = engine.last_context
        position = 3
        for window in learner.handed:
            for offset in range(window.size):
                assert window.tokens[window.first + offset] == text[position]
                if window.soft is None or window.soft[1][offset].max() == 1.0:  # its token: a pass without rows
                    hard += 1
                else:
                    label = np.zeros(ENGINE_VOCAB)
                    np.add.at(label, window.soft[0][offset], window.soft[1][offset])
                    row = engine_table(tuple(text[:position])).astype(np.float64)
                    softmax = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
                    assert np.allclose(label, softmax, atol=1e-6), position
                    labelled += 1
                position += 1
        assert position == len(text) and learner._rows_at == {}
    # sampled, every pass brings its rows; greedy, the plain steps do not (a text's last token's, here)
    assert hard == 0 if temperature > 0 else hard <= 4 and labelled >= 4 * 30
    assert labelled >= 4 * 10


def test_greedy_passes_bring_no_rows_and_the_learning_says_so():
    from specrun.drafters.methods import DrafterOptions, build_drafter
    from specrun.engine.loop import GenerationParams, SpeculativeEngine

    notes = []
    learning = Learning(LearnSettings(), on_note=notes.append, explicit=True, soft_labels=True, inline=True)
    draft = FakeBackend(lambda context: 1.2 * engine_table(context), ENGINE_VOCAB)
    learner = learning.draft(draft)
    drafter = build_drafter("draft", draft, DrafterOptions(draft_learner=learner))
    engine = SpeculativeEngine(FakeBackend(engine_table, ENGINE_VOCAB), drafter, method="draft")
    engine.run([1, 2, 3], GenerationParams(30, draft_len=3, stop_at_eos=False))
    drafter.finish(engine.last_context)
    assert learner._rows_at == {}
    (report,) = learning.finish()
    assert report.labels == "tokens" and report.seen == 30
    assert notes == ["--learn-labels distributions: the draft model had the target's tokens only: no pass brought "
                     "its distributions to the host (greedy passes keep them on the device; sampling with --temp "
                     "above 0 brings them)"]


def test_rows_refused_by_the_budget_are_not_said_to_be_missing():
    """Sampled passes hand their rows even where the budget leaves them unread: the run's end says
    nothing of passes that brought none."""
    from specrun.drafters.methods import DrafterOptions, build_drafter
    from specrun.engine.loop import GenerationParams, SpeculativeEngine
    from specrun.sampling import SamplingSettings

    notes = []
    learning = Learning(LearnSettings(share=1e-9), on_note=notes.append, explicit=True, soft_labels=True)
    draft = FakeBackend(lambda context: 1.2 * engine_table(context), ENGINE_VOCAB)
    learner = learning.draft(draft)
    learner._busy_seconds, learner._busy_cpu = 1.0, 1.0  # the budget spent already: every row refused
    drafter = build_drafter("draft", draft, DrafterOptions(draft_learner=learner))
    engine = SpeculativeEngine(FakeBackend(engine_table, ENGINE_VOCAB), drafter, method="draft")
    engine.run([1, 2, 3], GenerationParams(30, draft_len=3, stop_at_eos=False,
                                           sampling=SamplingSettings(temperature=0.8, seed=2)))
    drafter.finish(engine.last_context)
    assert learner.rows_offered > 5 and learner._rows_at == {}
    (report,) = learning.finish()
    assert report.labels == "tokens" and report.seen == 30
    assert not any("tokens only" in note for note in notes), notes


def test_rows_of_a_text_cut_short_never_label_the_next_one():
    learner = Recorder(wrong_draft(), window=4, inline=True, soft_labels=True)
    learner.handed = []
    learner.start_text()
    learner.observe(3, stream(5, 2))
    learner.observe_rows(5, np.zeros((3, VOCAB), np.float32))  # a pass whose tokens the text never got (cut)
    learner.start_text()
    learner.observe(3, stream(9, 7))  # the next text: positions 5-7 again, no rows for them
    learner.start_text()
    assert all(window.soft is None for window in learner.handed) and learner._rows_at == {}
    learner.observe(3, stream(5, 2))
    learner.observe_rows(5, np.zeros((3, VOCAB), np.float32))
    learner.observe(8, stream(12, 6))  # a new run of the same text further on: its rows before it go
    assert learner._rows_at == {}


def test_past_the_budget_the_generating_thread_reads_no_rows():
    """The worker's spending leaves none of the budget: the drafter's thread reads no rows (their
    positions learn tokens) rather than add to it."""
    now = [0.0]
    learner = DraftLearner(wrong_draft(), LearnSettings(share=0.05), window=4, soft_labels=True,
                           clock=lambda: now[0], cpu_clock=lambda: now[0])
    learner.start_text()
    learner.observe(3, stream(5, 2))
    for stop in (7, 9):  # a second of generation: 0.05 s of budget
        now[0] += 0.5
        learner.observe(stop - 2, stream(stop, 2))
    assert learner.report().busy_seconds == pytest.approx(1.0)
    learner.observe_rows(9, np.zeros((1, VOCAB), np.float32))
    assert 9 in learner._rows_at
    learner._busy_cpu = 0.06  # as the worker's steps would have spent it
    learner.observe_rows(10, np.zeros((1, VOCAB), np.float32))
    assert 10 not in learner._rows_at
    learner.close()


def test_soft_labels_cost_the_generating_thread_within_the_budget():
    """What reading a pass's rows costs the drafter's thread counts as the learner's while generating."""
    spent = [0.0]

    def clock():
        spent[0] += 0.001
        return spent[0]

    learner = DraftLearner(wrong_draft(), window=4, inline=True, soft_labels=True, cpu_clock=clock)
    learner.start_text()
    before = learner.report().busy_cpu
    learner.observe_rows(3, np.zeros((2, VOCAB), np.float32))
    assert learner.report().busy_cpu - before == pytest.approx(0.001)  # one reading of the clock to the next


# ---- MLX: LoRA adapters ------------------------------------------------------------------------
@pytest.fixture
def mlx_pair(tiny_llama, looping_llama):
    pytest.importorskip("mlx_lm", reason="the mlx backend is not installed")
    return str(tiny_llama.hf_dir), str(looping_llama["mlx"])


def test_adapters_learn_on_a_copy_and_the_drafting_model_takes_them(mlx_pair):
    """The trainer's copy learns a text (its loss falls); the drafting model computes what it did
    until adapters are loaded, and then what the trainer's copy computes."""
    from specrun.backends.mlx import MlxBackend

    draft = MlxBackend(mlx_pair[1])
    tokens = np.asarray(draft.tokenize("the cat sat on the mat. " * 6), np.int64)
    rows = list(range(len(tokens) - 1))
    before = draft.forward(list(tokens), rows)
    trainer = draft.online_trainer(1e-2, seed=0)
    losses = [trainer.step([(tokens, 1)]) for _ in range(12)]
    assert losses[-1] < 0.7 * losses[0], losses
    draft.rewind(0)
    assert np.array_equal(draft.forward(list(tokens), rows), before)  # the copy learned, not it
    draft.adapt(trainer.weights())
    draft.rewind(0)
    adapted = draft.forward(list(tokens), rows).argmax(axis=-1)
    assert np.array_equal(adapted, trainer.predict(tokens))
    assert (adapted == tokens[1:]).mean() > (before.argmax(axis=-1) == tokens[1:]).mean()


def test_a_soft_label_step_is_the_token_step_where_a_label_is_one_token_and_learns_a_distribution(mlx_pair):
    """The trainer's loss is mlx's cross-entropy of the tokens; against soft labels, a label of one
    token at probability 1 takes the step its token does (the same loss, the same adapters after);
    labels that put 0.4 on a token the text never holds teach the adapted draft those odds, where the
    text's tokens teach it none (DistillSpec's forward KL)."""
    import mlx.nn as nn

    from specrun.backends.mlx import MlxBackend

    draft = MlxBackend(mlx_pair[1])
    tokens = np.asarray(draft.tokenize("the cat sat on the mat. " * 4), np.int64)
    first = 3
    hard, soft_one = draft.online_trainer(1e-2, seed=0), draft.online_trainer(1e-2, seed=0)
    mx = hard._mx
    logits = hard.model(mx.array(tokens[None, :-1])).astype(mx.float32)
    expected = float(nn.losses.cross_entropy(logits, mx.array(tokens[None, 1:]))[0, first - 1 :].mean().item())
    one = (tokens[first:, None], np.ones((len(tokens) - first, 1), np.float32))
    losses = [(hard.step([(tokens, first)]), soft_one.step([(tokens, first, one)])) for _ in range(3)]
    assert losses[0][0] == pytest.approx(expected, rel=1e-5)  # the loss before the first step
    assert all(token == pytest.approx(soft, rel=1e-5) for token, soft in losses)
    for name, array in hard.adapter_arrays().items():
        assert np.allclose(array, soft_one.adapter_arrays()[name], atol=1e-6), name

    labelled = len(tokens) - first
    ids = np.stack([tokens[first:], np.full(labelled, 5)], axis=1)  # the text's token 0.6, token 5 0.4
    odds = np.tile(np.array([0.6, 0.4], np.float32), (labelled, 1))
    spread = {}
    for soft in (False, True):  # the token a label puts 0.4 on: soft labels teach it, tokens do not
        trainer = draft.online_trainer(1e-2, seed=0)
        for _ in range(40):
            trainer.step([(tokens, first, (ids, odds) if soft else None)])
        q = mx.softmax(trainer.model(mx.array(tokens[None, :-1])).astype(mx.float32), axis=-1)
        spread[soft] = float(np.asarray(q)[0, first - 1 :, 5].mean())
    assert spread[False] < 0.01 and abs(spread[True] - 0.4) < 0.1, spread


def test_adapters_train_in_a_thread_while_the_draft_model_drafts(mlx_pair):
    """MLX streams belong to one thread each: the worker's steps on its own beside the drafting
    thread's passes, which compute what they compute alone. Thirty passes: with Debian's serial
    OpenBLAS preloaded (no locks), about one pass in 60 read corrupted logits."""
    import threading

    from specrun.backends.mlx import MlxBackend

    draft = MlxBackend(mlx_pair[1])
    tokens = draft.tokenize("one two three four five six seven eight nine ten " * 3)
    alone = draft.forward(tokens, [len(tokens) - 1])[0]
    trainer = draft.online_trainer(1e-3)
    stop, losses = threading.Event(), []

    def work():
        while not stop.is_set():
            losses.append(trainer.step([(np.asarray(tokens, np.int64), 1)]))

    worker = threading.Thread(target=work)
    worker.start()
    try:
        for _ in range(30):
            draft.rewind(0)
            assert np.array_equal(draft.forward(tokens, [len(tokens) - 1])[0], alone)
    finally:
        stop.set()
        worker.join()
    assert losses and all(np.isfinite(losses))


LEARNING_PROMPT = "def f(x):\n    return x\n" * 3


def greedy_with_and_without(mlx_pair, make_learner, tokens: int) -> tuple[list[int], list[int], DraftLearner]:
    """The tiny llama's greedy tokens with its looping copy drafting and learning (``make_learner``
    of the draft backend), and plain decoding's; the learner."""
    from specrun.registry.loading import LoadOptions
    from specrun.sessions.generation import GenerateRequest, generate_text

    target, draft = mlx_pair
    made = []

    def learn(heads, backend):
        raise AssertionError("no heads here")

    def learn_draft(draft_backend, alone=True):
        made.append(make_learner(draft_backend))
        return made[-1]

    learn.draft = learn_draft

    def run(method: str, learn_=None) -> list[int]:
        request = GenerateRequest(LEARNING_PROMPT, target, draft, method=method,
                                  max_new_tokens=tokens, draft_len=4, load=LoadOptions(backend="mlx"), chat=False,
                                  learn=learn_)
        return generate_text(request).token_ids

    return run("draft", learn), run("none"), made[0]


def assert_plain_but_at_near_ties(mlx_pair, learned: list[int], plain: list[int]) -> None:
    """The learning run's tokens are plain decoding's, or part from them only where plain decoding
    in the output's own context has a near-tie (MLX's kernels round a pass of several tokens
    apart from one of one: where the drafts fall, which the worker's timing moves, decides)."""
    if learned == plain:
        return
    from specrun.backends.mlx import MlxBackend
    from specrun.sessions.setup import prompt_token_ids

    from lossless_harness import greedy_divergences

    fresh = MlxBackend(mlx_pair[0])
    try:
        prompt = prompt_token_ids(fresh, LEARNING_PROMPT, chat=False)  # as the runs read it
        # plain decoding's tokens are the argmax in their own context, but at near-ties (asserted there)
        greedy_divergences(fresh, prompt, plain)
        assert greedy_divergences(fresh, prompt, learned), "the output differs yet is the argmax everywhere"
    finally:
        fresh.close()


def test_greedy_with_a_learning_mlx_draft_is_plain_decoding(mlx_pair):
    """The looping copy drafts for the tiny llama and learns from it as it is generated, its
    adapters swapped in between passes: the tokens are plain decoding's, but at near-ties."""
    learned, plain, learner = greedy_with_and_without(
        mlx_pair, lambda draft: DraftLearner(draft, learning_rate=1e-2, window=8, inline=True), 96)
    assert_plain_but_at_near_ties(mlx_pair, learned, plain)
    report = learner.report()
    assert report.steps > 3 and report.swaps >= 2 and not report.stopped, report.summary()


def test_drafts_that_run_the_target_s_own_weights_never_learn(mlx_pair):
    """A layer draft runs the target's layers, and self:window the target itself: adapters loaded
    into them would change the target. A draft model reading a windowed cache learns through it."""
    from specrun.backends.fake import FakeWindowCache
    from specrun.backends.mlx import MlxBackend
    from specrun.backends.window import WindowedBackend

    target = MlxBackend(mlx_pair[0])
    layers = target.layer_draft([0])
    assert "self:layers" in draft_cannot_learn(layers)
    with pytest.raises(ValueError, match="must not change"):
        layers.online_trainer(1e-5)
    notes = []
    assert Learning(LearnSettings(), on_note=notes.append, explicit=True).draft(layers) is None
    assert notes == ["--learn: nothing learns: a layer draft (self:layers) runs the target's own layers, "
                     "which must not change"]

    fake = wrong_draft()
    itself = WindowedBackend(fake, lambda cells: FakeWindowCache(fake, cells), 4, 16, owns=False)
    assert "self:window" in draft_cannot_learn(itself)
    owned = WindowedBackend(fake, lambda cells: FakeWindowCache(fake, cells), 4, 16, owns=True)
    learner = DraftLearner(owned, learning_rate=1.0, window=8, inline=True)
    feed(learner, 2)
    assert learner.report().steps > 0 and learner.latest(0) is not None
    owned.adapt(learner.latest(0)[1])
    assert fake.adapter is not None
    assert int(owned.forward([2], [0])[0].argmax()) == following(2)  # the window's passes read the adapter


def test_a_quantized_draft_takes_adapters_over_its_quantized_maps(mlx_pair, tmp_path):
    """A 4-bit draft: quantizing a map again would move it where the adapter is zero, so its
    adapters come as LoRA layers; the drafting model then computes what the trainer's copy does,
    and before any step exactly what it did."""
    from specrun.backends.mlx import MlxBackend, quantize_mlx_folder

    quantize_mlx_folder(Path(mlx_pair[1]), tmp_path / "q4", 4, group_size=32)
    draft = MlxBackend(tmp_path / "q4")
    tokens = np.asarray(draft.tokenize("the cat sat on the mat. " * 4), np.int64)
    rows = list(range(len(tokens) - 1))
    before = draft.forward(list(tokens), rows)
    trainer = draft.online_trainer(1e-2, seed=0)
    published = trainer.weights()
    assert published and all(name.endswith((".lora_a", ".lora_b")) for name in published)
    draft.adapt(published)
    draft.rewind(0)
    assert np.array_equal(draft.forward(list(tokens), rows), before)  # B is zero: nothing moved
    for _ in range(6):
        trainer.step([(tokens, 1)])
    draft.adapt(trainer.weights())
    draft.rewind(0)
    assert np.array_equal(draft.forward(list(tokens), rows).argmax(axis=-1), trainer.predict(tokens))


def test_weights_made_on_the_worker_thread_are_swapped_in_mid_generation(mlx_pair, monkeypatch):
    """The threaded worker (publishing as soon as it steps) and the drafting thread on MLX: the
    tokens are plain decoding's, but at near-ties, and the draft took weights the worker made."""
    import specrun.training.learner as learner_module

    monkeypatch.setattr(learner_module, "PUBLISH_SECONDS", 0.0)
    learned, plain, learner = greedy_with_and_without(
        mlx_pair, lambda draft: DraftLearner(draft, LearnSettings(share=1.0), learning_rate=1e-2, window=8), 160)
    learner.close()  # its thread stopped before a second model is opened to check the tokens
    assert_plain_but_at_near_ties(mlx_pair, learned, plain)
    report = learner.report()
    assert report.steps > 0 and report.swaps > 0 and not report.stopped, report.summary()


# ---- adapters kept between runs (--keep-learned) ---------------------------------------------------
def test_kept_adapters_come_back_as_they_were_learned(mlx_pair, tmp_path):
    """A trainer's adapters written and read into a second trainer of the same draft: the second's
    copy computes what the first's does, and the drafting model takes the same weights."""
    from specrun.backends.mlx import MlxBackend
    from specrun.training.online_draft import load_adapters, save_adapters

    draft = MlxBackend(mlx_pair[1])
    tokens = np.asarray(draft.tokenize("the cat sat on the mat. " * 6), np.int64)
    first = draft.online_trainer(1e-2, seed=0)
    for _ in range(4):
        first.step([(tokens, 1)])
    path = tmp_path / "draft.adapters.safetensors"
    save_adapters(path, first.adapter_arrays(), "looping")
    second = draft.online_trainer(1e-2, seed=1)  # other A matrices, B zero: another model until loaded
    assert not np.array_equal(second.predict(tokens), first.predict(tokens))
    second.load_adapter_arrays(load_adapters(path, "looping"))
    assert np.array_equal(second.predict(tokens), first.predict(tokens))
    weights, again = first.weights(), second.weights()
    assert weights.keys() == again.keys()
    assert all(np.array_equal(np.array(weights[name]), np.array(again[name])) for name in weights)


def test_kept_adapters_that_cannot_be_used_are_refused_saying_why(mlx_pair, tmp_path):
    from specrun.backends.mlx import MlxBackend
    from specrun.training.online_draft import load_adapters, save_adapters

    draft = MlxBackend(mlx_pair[1])
    trainer = draft.online_trainer(1e-2)
    arrays = trainer.adapter_arrays()
    path = tmp_path / "draft.adapters.safetensors"
    save_adapters(path, arrays, "looping")
    with pytest.raises(ValueError, match="learned by 'looping', not 'other'"):
        load_adapters(path, "other")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # a tensor's byte changed
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum disagrees"):
        load_adapters(path, "looping")
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_adapters(path, "looping")
    before = trainer.adapter_arrays()
    name = next(iter(arrays))
    with pytest.raises(ValueError, match="adapters missing"):
        trainer.load_adapter_arrays({key: value for key, value in arrays.items() if key != name})
    with pytest.raises(ValueError, match=f"{name} is"):
        trainer.load_adapter_arrays({**arrays, name: np.zeros((1, 1), np.float32)})
    with pytest.raises(ValueError, match="finite"):
        trainer.load_adapter_arrays({**arrays, name: np.full(arrays[name].shape, np.nan, np.float32)})
    after = trainer.adapter_arrays()
    assert all(np.array_equal(before[key], after[key]) for key in before)  # nothing changed


def test_keep_learned_starts_a_draft_from_kept_adapters_and_a_damaged_file_afresh(mlx_pair, tmp_path):
    """Learning with keep: a draft's adapters written at the end of a run that learned; the next
    run's draft starts from them (its drafting model takes them at once, a note says so); a run
    that took no step, or whose loss went not finite, leaves the file as it was; a damaged file is
    a note, learning starts afresh and writes a good file over it; a place that cannot take the
    file is one line before anything runs."""
    import mlx.nn as nn

    from specrun.backends.mlx import MlxBackend
    from specrun.errors import FileAccessError
    from specrun.training.online import draft_name
    from specrun.training.online_draft import load_adapters

    path = tmp_path / "kept" / "draft.adapters.safetensors"
    text = MlxBackend(mlx_pair[1]).tokenize("one two three four five " * 8)

    def run(learn: bool, poisoned: bool = False) -> tuple[list[str], np.ndarray, object]:
        notes: list[str] = []
        draft = MlxBackend(mlx_pair[1])
        learning = Learning(LearnSettings(keep=True), on_note=notes.append, explicit=True,
                            draft_keep_path=lambda _: path, inline=True, window=8, inline_steps=3)
        learner = learning.draft(draft)
        drafted = draft.forward(list(text), [len(text) - 2])[0]
        if poisoned:  # a step whose loss is not finite (as a float16 overflow gives)
            loss = learner.trainer._loss
            learner.trainer._loss_and_grad = nn.value_and_grad(learner.trainer.model,
                                                               lambda *args: loss(*args) * float("nan"))
        if learn:
            learner.observe(1, list(text))
        (report,) = learning.finish()
        return notes, drafted, report

    fresh_notes, untrained, report = run(learn=True)
    assert report.steps > 0 and report.kept == path
    assert not any("earlier runs" in note for note in fresh_notes)
    name = draft_name(MlxBackend(mlx_pair[1]))
    learned = load_adapters(path, name)
    written = path.read_bytes()
    notes, drafted, report = run(learn=False)
    assert any(f"drafts with the adapters it learned in earlier runs ({path})" in note for note in notes), notes
    assert not np.array_equal(drafted, untrained)  # the drafting model took the kept adapters at once
    assert report.kept is None and path.read_bytes() == written  # no step: the file as it was
    _, _, report = run(learn=True, poisoned=True)
    assert report.stopped and report.kept is None and path.read_bytes() == written  # never written back bad
    path.write_bytes(b"damaged")
    notes, drafted, report = run(learn=True)
    assert any("cannot be used (not a safetensors file" in note for note in notes), notes
    np.testing.assert_array_equal(drafted, untrained)
    assert report.kept == path and load_adapters(path, name).keys() == learned.keys()  # written anew, good
    path.unlink()
    path.mkdir()
    with pytest.raises(FileAccessError, match="--keep-learned"):
        Learning(LearnSettings(keep=True), draft_keep_path=lambda _: path).draft(MlxBackend(mlx_pair[1]))
