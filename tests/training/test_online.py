"""Heads that learn online (training/online.py): what they learn, within what budget, what they
keep, and that learning never changes an answer (greedy here on the fake, llama.cpp and MLX; the
sampled scenarios "… learning" of lossless_harness swap weights between every run)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import numpy as np
import pytest

from specrun.heads.config import HeadsConfig
from specrun.training.learner import EPOCHS, LearnSettings, check_learn_settings
from specrun.fileio import interrupts_held
from specrun.training.online import Learning, OnlineLearner

SIZE, VOCAB, DEPTH = 16, 8, 3
TABLE = np.random.default_rng(0).normal(0, 1, (VOCAB, SIZE)).astype(np.float32)


def following(token: int) -> int:
    return (3 * token + 1) % VOCAB


def text(length: int, start: int) -> list[int]:
    tokens = [start]
    while len(tokens) < length:
        tokens.append(following(tokens[-1]))
    return tokens


def fresh_heads(kind: str):
    """Heads as `heads train` starts them: their projection the target's own head (the state of a
    token gives the token after it: row v is the state of the token v follows), the rest knowing
    nothing of the stream ``text`` makes."""
    from specrun.training.eagle import NumpyEagleTrainer
    from specrun.training.hydra import NumpyHydraTrainer
    from specrun.training.medusa import NumpyHeadsTrainer

    rng = np.random.default_rng(1)
    config = HeadsConfig(kind, DEPTH, 1, SIZE, VOCAB, VOCAB)
    before = {following(token): token for token in range(VOCAB)}
    projection = TABLE[[before[token] for token in range(VOCAB)]]
    if kind == "medusa":
        return NumpyHeadsTrainer.fresh(config, projection, None, 1e-3, 0).heads()
    made = NumpyHydraTrainer if kind == "hydra" else NumpyEagleTrainer
    return made.fresh(config, projection, rng.normal(0, 1, (VOCAB, SIZE)), None, 1e-3, 0).heads()


def feed(learner: OnlineLearner, texts: int, length: int = 80, stride: int = 3) -> None:
    """``texts`` texts of the stream, handed over as a drafter does: the states of each verify
    pass's positions (``stride`` a pass), the state at p standing for the token at p."""
    for k in range(texts):
        tokens = text(length, k % VOCAB)
        learner.start_text()
        for stop in range(1, length - 1, stride):
            first = max(stop - stride, 0)
            learner.observe(first, TABLE[tokens[first:stop]], tokens[: stop + 1])


@pytest.mark.parametrize("kind", ["medusa", "hydra", "eagle"])
def test_heads_learn_a_stream_they_did_not_know(kind):
    """The same stream with learning and without (a learning rate too small to move a weight): the
    acceptance by depth over the latest positions, each scored before it was trained on."""
    reports = []
    for rate in (1e-12, 0.02):
        learner = OnlineLearner(fresh_heads(kind), LearnSettings(learning_rate=rate), window=8, inline=True,
                                inline_steps=4)
        projections = [array.copy() for array in _projections(learner.trainer)]
        feed(learner, 24)
        learner.close()
        reports.append(learner.report())
        assert projections and all(np.array_equal(a, b) for a, b in zip(projections, _projections(learner.trainer)))
    without, learned = reports
    assert learned.steps > 0 and learned.swaps == 0 and not learned.stopped  # no drafter asked for the weights
    assert without.latest[0] < 0.6 and learned.latest[0] >= 0.95, (without.summary(), learned.summary())
    assert learned.latest[-1] >= without.latest[-1] + 0.3, (without.summary(), learned.summary())
    assert learned.first_positions > 0 and learned.latest_positions > 0


def own_head() -> np.ndarray:
    """The stream's target's output rows (VOCAB, SIZE): the state of a token gives the token after
    it (row v is the state of the token v follows), as ``fresh_heads``' projections start."""
    before = {following(token): token for token in range(VOCAB)}
    return TABLE[[before[token] for token in range(VOCAB)]]


@pytest.mark.parametrize("buffer", [4096, 100], ids=["growing", "wrapping"])
@pytest.mark.parametrize("kind", ["medusa", "hydra", "eagle"])
def test_with_the_targets_output_rows_heads_learn_its_distributions(kind, buffer, monkeypatch):
    """A learner given the target's output rows (``teacher``) trains each labelled position on the
    target's distribution at the position that chose its label: for Medusa's and Hydra's head i at
    p, the state at p + 1 + i (checked row by row against the stream, in a ring still growing and
    in one wrapping many times, windows straddling its end); EAGLE's batch loss gets the rows (its
    loss test checks the positions). It learns the stream as well as from labels."""
    from specrun.heads.layers import softmax

    teacher = own_head()
    learner = OnlineLearner(fresh_heads(kind), LearnSettings(learning_rate=0.02, buffer_tokens=buffer),
                            teacher=teacher, window=8, inline=True, inline_steps=4)
    assert learner.labels == "distributions"
    checked = []
    if kind == "eagle":
        step = learner.trainer.step_windows
        monkeypatch.setattr(learner.trainer, "step_windows",
                            lambda windows, rows=None: checked.append(rows is teacher or np.array_equal(rows, teacher))
                            or step(windows, rows))
    else:
        step = learner.trainer.step
        token_of = {TABLE[token].tobytes(): token for token in range(VOCAB)}

        def spy(states, labels, *rest):
            soft = rest[-1]
            assert soft.shape == (DEPTH, len(states), VOCAB)
            for row, state in enumerate(states):
                token = token_of[np.asarray(state, np.float32).tobytes()]
                for i in range(DEPTH):
                    token = following(token)  # the token at p + 1 + i, whose state chose head i's label
                    if labels[i, row] >= 0:
                        assert labels[i, row] == following(token)
                        assert np.allclose(soft[i, row], softmax(TABLE[token] @ teacher.T), atol=1e-6)
                        checked.append(True)
            return step(states, labels, *rest)

        monkeypatch.setattr(learner.trainer, "step", spy)
    feed(learner, 24)
    learner.close()
    report = learner.report()
    assert checked and all(checked) and report.steps > 0
    assert report.latest[0] >= 0.95 and report.to_dict()["labels"] == "distributions", report.summary()
    assert "(labels: the target's distributions)" in report.summary()


def test_a_command_learns_the_targets_distributions_where_the_heads_read_its_output_heads_input():
    """With --learn-labels distributions, Learning reads the target's output rows over the heads'
    draft vocabulary for Medusa, Hydra and EAGLE; EAGLE-3 heads (other layers), a target that
    cannot give them, one that does more to its logits than their product (a soft-cap), rows the
    heads' vocabulary outgrows, and rows past TEACHER_MAX_BYTES leave the heads learning its
    tokens, as does learning without --learn-labels distributions."""
    from types import SimpleNamespace

    from heads_factory import eagle3_heads
    from specrun.training import online

    class Target:
        def __init__(self, fails: type[Exception] | None = None, beyond: str = "", vocab: int = VOCAB) -> None:
            self.fails, self.asked, self.beyond = fails, [], beyond
            self.vocab = SimpleNamespace(size=vocab)

        def logits_beyond_rows(self) -> str:
            return self.beyond

        def output_rows(self, ids):
            self.asked.append(list(ids))
            if self.fails is not None:
                raise self.fails("this backend reads no output rows")
            return own_head()[np.asarray(ids)]

        def token_embeddings(self, ids):
            return np.ones((len(ids), 8), np.float32)

    notes = []

    def soft(heads, target):
        return Learning(LearnSettings(), soft_labels=True, on_note=notes.append, inline=True)(heads, target)

    for kind in ("medusa", "hydra", "eagle"):
        target = Target()
        learner = soft(fresh_heads(kind), target)
        assert learner.labels == "distributions" and target.asked == [list(range(VOCAB))], kind
        learner.close()
    for fails in (ValueError, NotImplementedError):  # NotImplementedError: a quantization gguf cannot undo
        assert soft(fresh_heads("medusa"), Target(fails)).labels == "tokens"
    for target in (Target(beyond="its logits are soft-capped at 30 after its output head"), Target(vocab=VOCAB - 1)):
        assert soft(fresh_heads("hydra"), target).labels == "tokens"
        assert target.asked == []
    said = "--learn-labels distributions: the {} heads learn the target's tokens: "
    unread = said.format("medusa") + "its output rows cannot be read (this backend reads no output rows)"
    assert notes == [unread, unread, said.format("hydra") + "its logits are soft-capped at 30 after its output head",
                     said.format("hydra") + "the heads' vocabulary is larger than the target's"]
    notes.clear()
    for asked in ({"soft_labels": False}, {}):  # tokens unless --learn-labels distributions
        target = Target()
        assert Learning(LearnSettings(), inline=True, **asked)(fresh_heads("eagle"), target).labels == "tokens"
        assert target.asked == []
    heads = eagle3_heads(8, 10, aux=(1, 3), heads=4, kv_heads=2, head_dim=4, intermediate=16)
    target = Target()
    assert soft(heads, target).labels == "tokens" and target.asked == []
    layers = "eagle3 heads read the target's layers, not the state its output head reads"
    assert notes == [said.format("eagle3") + layers]
    with pytest.raises(ValueError, match="read the target's layers"):
        OnlineLearner(heads, teacher=np.ones((10, 8), np.float32), inline=True)
    target = Target()
    small = VOCAB * SIZE * 4 - 1
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(online, "TEACHER_MAX_BYTES", small)
        assert soft(fresh_heads("medusa"), target).labels == "tokens"
    assert target.asked == []


def _projections(trainer) -> list[np.ndarray]:
    """The arrays over the draft vocabulary, which online learning leaves as they are."""
    if hasattr(trainer, "frozen"):
        return [trainer.params[name] for name in sorted(trainer.frozen)]
    return [head[-1] for head in trainer.params]


def test_slots_readers_hand_one_learner_windows_of_their_own_texts(monkeypatch):
    """A server's slots, each reading a text of its own from its own thread through a reader of the
    one learner: every window handed is consecutive positions of one text (the runs never mix),
    every reader's last run reaches the worker at close, and every slot's cache counts as
    generation for the budget."""
    learner = OnlineLearner(fresh_heads("eagle"), window=8, inline=False)
    handed = []
    hand = learner._hand
    monkeypatch.setattr(learner, "_hand", lambda window: handed.append(window) or hand(window))
    readers = [learner.reader() for _ in range(3)]
    assert all(reader.source is learner.source for reader in readers)
    texts = [text(61, start) for start in (1, 2, 5)]
    grown = [0, 0, 0]
    for index, reader in enumerate(readers):
        reader.watch(lambda index=index: grown[index])
    start = threading.Barrier(3)

    def read(index: int) -> None:
        tokens, reader = texts[index], readers[index]
        reader.start_text()
        start.wait()
        for stop in range(1, len(tokens) - 1, 3):
            first = max(stop - 3, 0)
            reader.observe(first, TABLE[tokens[first:stop]], tokens[: stop + 1])
            grown[index] = stop
            time.sleep(0.0005)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    learner._tick()
    assert learner._last_progress == sum(grown)  # every slot's cache watched
    learner.close()
    assert sum(len(window.tokens) for window in handed) == 3 * 58  # every text, each reader's last run included
    # the weights published reach every slot's drafter, each swap counted (a step and a publish
    # forced: the budget of so short a generation allows none)
    assert learner._step()
    learner._publish()
    version, weights = learner._published
    assert all(reader.latest(0) == (version, weights) for reader in readers)
    assert all(reader.latest(version) is None for reader in readers)
    assert learner.report().swaps == 3
    for reader in readers:  # their slots closed: the learner holds neither their runs nor their caches
        reader.release()
    assert learner._readers == [] and learner._also == []
    for window in handed:
        tokens = [int(t) for t in window.tokens]
        assert any(tokens == whole[i : i + len(tokens)] for whole in texts for i in range(len(whole))), tokens
        assert [int(t) for t in window.following[:-1]] == tokens[1:]


def test_only_the_latest_positions_are_kept():
    learner = OnlineLearner(fresh_heads("medusa"), LearnSettings(buffer_tokens=64), window=8, inline=True)
    feed(learner, 10)
    learner.close()
    report = learner.report()
    assert report.seen > 400
    assert 64 <= learner.buffered_positions < 64 + 8
    assert report.trained <= EPOCHS * report.seen + 64  # the step that crosses it is the last


def test_the_positions_ring_holds_the_latest_rows_growing_to_its_capacity():
    from specrun.training.online import _Positions

    ring = _Positions(capacity=1500)
    for start in range(0, 4000, 7):  # windows of 7 rows whose state, label and next token number them
        rows = np.arange(start, start + 7)
        ring.add(rows[:, None].astype(np.float32) * np.ones((1, 3), np.float32), rows[None, :], rows[:, None])
        assert len(ring.states) in (1024, 1500)
    assert ring.size == 1500 and len(ring.states) == 1500
    assert sorted(ring.states[:, 0].astype(int)) == list(range(4004 - 1500, 4004))
    assert np.array_equal(ring.labels[0], ring.states[:, 0].astype(int))
    assert np.array_equal(ring.following[:, 0], ring.labels[0]) and len(ring.labelled()) == 1500


def clocked_learner(share: float, charged: str, cost: float) -> tuple[OnlineLearner, list[float], list[float]]:
    """A Medusa learner on clocks the test moves (``now[0]``, and ``spent[0]`` its worker's CPU), each
    call of its trainer's ``charged`` method costing ``cost`` seconds of that CPU."""
    spent, now = [0.0], [0.0]
    learner = OnlineLearner(fresh_heads("medusa"), LearnSettings(share=share), window=8,
                            clock=lambda: now[0], cpu_clock=lambda: spent[0])
    work = getattr(learner.trainer, charged)

    def costly(*args):
        spent[0] += cost
        return work(*args)

    setattr(learner.trainer, charged, costly)
    return learner, spent, now


def test_the_worker_keeps_within_its_share_while_generating_then_trains_when_idle():
    """Clocks the test moves: each step costs 0.05 s of the worker's CPU; 100 passes 0.1 s apart
    are 10 s of generation, so a share of 5% allows ten steps (the one that crosses it included)."""
    learner, spent, now = clocked_learner(0.05, "step", 0.05)
    tokens = text(400, 0)
    learner.start_text()
    for stop in range(4, 404, 4):
        now[0] += 0.1
        learner.observe(stop - 4, TABLE[tokens[stop - 4 : stop]], tokens[: stop + 1])
        time.sleep(0.002)
    time.sleep(0.3)  # the worker's turn: within the budget, the rest waits in its inbox
    busy = learner.report()
    assert busy.busy_seconds == pytest.approx(9.9)
    assert busy.steps > 0, busy.summary()
    assert busy.steps <= 11, busy.summary()  # a step of 0.05 s: 10 fit in 5% of 9.9 s, the 11th crosses it
    assert busy.busy_cpu <= 0.05 * busy.busy_seconds + 0.05 + 1e-9, busy.summary()
    now[0] += 5.0  # the user reads the answer: nothing generates
    deadline = time.monotonic() + 20
    while not learner.caught_up and time.monotonic() < deadline:
        time.sleep(0.01)
    learner.close()
    idle = learner.report()
    assert idle.idle_cpu > 0 and idle.steps > busy.steps
    assert idle.trained <= EPOCHS * idle.seen + 64  # it stops once each position was trained on EPOCHS times


def test_what_close_does_after_the_text_is_reported_apart_within_generation_s_budget():
    """The windows waiting when the learner closes are scored after the text: their CPU is
    reported as the close's (the summary's "after it"), not as generation's, and still counts
    against generation's budget (a step at close only where it stays within it)."""
    learner, spent, now = clocked_learner(0.001, "predict", 0.01)  # scoring a window reads the heads' guesses
    tokens = text(200, 0)
    learner.start_text()
    for stop in range(4, 196, 4):
        now[0] += 0.1
        learner.observe(stop - 4, TABLE[tokens[stop - 4 : stop]], tokens[: stop + 1])
    deadline = time.monotonic() + 10
    while learner.report().busy_cpu == 0 and time.monotonic() < deadline:  # the first window scored
        time.sleep(0.005)
    before = learner.report()  # 0.01 s spent: past 0.1% of 4.7 s, so nothing more while generating
    learner.close()
    after = learner.report()
    assert before.busy_cpu == after.busy_cpu == pytest.approx(0.01)
    assert after.closing_cpu == pytest.approx(0.01 * (after.seen // 8 - 1))  # every other window, at close
    assert after.steps == 0  # past the budget: no step at close either
    assert "0.01 s CPU while generating" in after.summary() and f"{after.closing_cpu:.2f} s after it" in after.summary()
    assert after.to_dict()["closing_cpu_seconds"] == pytest.approx(after.closing_cpu, abs=1e-3)


def test_generation_is_told_by_the_target_growing_whether_or_not_the_heads_draft():
    """No state handed over (auto drafted with another member): the worker still counts the time as
    generation's, the target's cache growing, so the budget applies and it does not train as if idle."""
    now, cached = [0.0], [0]
    learner = OnlineLearner(fresh_heads("medusa"), window=8, clock=lambda: now[0])
    learner.watch(lambda: cached[0])
    for _ in range(20):
        now[0] += 0.3
        cached[0] += 3
        time.sleep(0.06)  # the worker looks at least every WAIT_SECONDS
    learner.close()
    assert learner.report().busy_seconds == pytest.approx(19 * 0.3)


def test_slow_passes_count_as_generation_not_as_idle_time():
    """A large model on a CPU: two seconds a pass. The worker keeps to its budget through them."""
    now, cached = [0.0], [0]
    learner = OnlineLearner(fresh_heads("medusa"), window=8, clock=lambda: now[0])
    learner.watch(lambda: cached[0])
    for step in range(10):
        now[0] += 2.0
        cached[0] += 3
        time.sleep(0.06)
        assert step < 2 or not learner._idle()  # the first gap is the one it learns the pace from
    learner.close()
    assert learner.report().busy_seconds == pytest.approx(8 * 2.0)


def test_a_loss_that_is_not_finite_stops_learning_with_the_last_weights_kept():
    learner = OnlineLearner(fresh_heads("medusa"), window=8, inline=True)
    feed(learner, 1)
    version, kept = learner.latest(0)
    learner.trainer.step = lambda *args: float("nan")
    feed(learner, 2)
    report = learner.report()
    assert "nan" in report.stopped and learner.latest(version) is None
    assert learner.latest(0)[1] is kept


@pytest.mark.parametrize(("share", "buffer", "message"), [
    (0.0, 4096, "--learn-budget must be more than 0 and at most 1"),
    (1.5, 4096, "--learn-budget must be more than 0 and at most 1"),
    (float("nan"), 4096, "--learn-budget must be more than 0 and at most 1"),
    (0.02, 10, "--learn-buffer must be between 64 and 131072 tokens, got 10"),
])
def test_settings_out_of_range_are_usage_errors(share, buffer, message):
    from specrun.errors import UsageError

    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        check_learn_settings(share, buffer)


# ---- the drafter's side: weights swapped between verify passes, answers unchanged -------------
@pytest.mark.parametrize("method", ["medusa", "hydra", "eagle"])
def test_greedy_with_learning_is_plain_decoding_on_the_fake(method, monkeypatch):
    import lossless_harness

    made = []
    learning_heads = lossless_harness.learning_heads
    monkeypatch.setattr(lossless_harness, "learning_heads", lambda *args: made.append(learning_heads(*args)) or made[-1])
    problems, drafted, accepted = lossless_harness.greedy_scenario(method, learn=True)
    assert problems == [] and drafted > 0
    report = made[0].report()
    assert report.steps > 10 and report.swaps > 10 and report.labels == "distributions", report.summary()


@pytest.fixture(params=["llama", "mlx"])
def real_target(request, tiny_llama):
    pytest.importorskip({"llama": "llama_cpp", "mlx": "mlx_lm"}[request.param],
                        reason=f"the {request.param} backend is not installed")
    return request.param, str(tiny_llama.gguf_path if request.param == "llama" else tiny_llama.hf_dir)


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_greedy_with_learning_is_plain_decoding_on_both_backends(real_target, method, tiny_llama, tmp_path):
    """Heads made for the tiny llama learn from its output as it is generated (the target's
    distributions, from the backend's output rows), their weights swapped in every 32 positions
    (HARVEST_POSITIONS): the text is plain decoding's."""
    from heads_factory import random_eagle, random_heads
    from specrun.heads.files import save_heads
    from specrun.registry.loading import LoadOptions
    from specrun.sessions.generation import GenerateRequest, generate_text
    from specrun.training.online import teacher_rows

    backend, target = real_target
    config = tiny_llama.config
    path = tmp_path / "heads.safetensors"
    save_heads({"medusa": random_heads, "eagle": random_eagle}[method](config.hidden_size, config.vocab_size), path)
    made = []

    def learn(heads, backend_):
        teacher = teacher_rows(heads, backend_)[0]
        made.append(OnlineLearner(heads, LearnSettings(learning_rate=0.05), teacher=teacher, window=4, inline=True))
        return made[-1]

    def run(method_: str, learn_=None) -> str:
        request = GenerateRequest("def f(x):\n    return x\n" * 3, target, None, method=method_, max_new_tokens=112,
                                  draft_len=4, heads=str(path), load=LoadOptions(backend=backend), chat=False,
                                  learn=learn_)
        return generate_text(request).text

    assert run(method, learn) == run("none")
    report = made[0].report()
    made[0].close()
    assert report.steps > 3 and report.swaps >= 2 and not report.stopped, report.summary()
    assert report.labels == "distributions"


# ---- what a command keeps ----------------------------------------------------------------------
def test_learned_heads_are_written_back_and_read_as_heads(tmp_path):
    from specrun.heads.files import load_heads, save_heads

    path = tmp_path / "heads.safetensors"
    save_heads(fresh_heads("medusa"), path)
    heads = load_heads(path)
    learning = Learning(LearnSettings(keep=True, learning_rate=0.02), lambda found: path, window=8, inline=True,
                        inline_steps=2)
    learner = learning(heads, None)
    assert learning(heads, None) is learner  # the next text's drafter learns with the same one
    feed(learner, 6)
    reports = learning.finish()
    assert reports[0].kept == path and reports[0].steps > 0
    learned = load_heads(path)
    assert not np.allclose(learned.blocks[0][0][0], heads.blocks[0][0][0])  # the first head's block (projections stay)
    assert np.allclose(learned.lm_heads[0], heads.lm_heads[0])
    assert learned.config.training["online"][0]["steps"] == reports[0].steps
    assert learning.finish() == []  # finished once


def test_heads_are_kept_only_where_a_file_of_heads_or_nothing_is(tmp_path):
    from specrun.errors import FileAccessError
    from specrun.training.online import check_keep_path

    other = tmp_path / "weights.safetensors"
    other.write_bytes(b"a model's weights")
    with pytest.raises(FileAccessError, match="exists and is not specrun heads: training would write over it"):
        check_keep_path(other, "file")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(FileAccessError, match="holds files of its own"):
        check_keep_path(folder, "folder")
    check_keep_path(tmp_path / "new.safetensors", "file")  # nothing there yet: fine


def test_a_damaged_heads_file_in_specrun_s_cache_is_said_to_be_deleted(tmp_path, monkeypatch):
    """Garbage where specrun's cache keeps a target's heads: heads train and --keep-learned refused
    it, each fix naming a path option (--heads-out, --heads) the user had not given; none said to
    delete the damaged copy. A file of the user's outside the cache is never offered for deletion."""
    from specrun.errors import FileAccessError
    from specrun.training.online import check_keep_path
    from specrun.training.run import check_heads_file

    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path / "cache"))
    damaged = tmp_path / "cache" / "heads" / "demo-target" / "medusa.safetensors"
    damaged.parent.mkdir(parents=True)
    damaged.write_text("garbage")
    for check in (check_heads_file, lambda path: check_keep_path(path, "file")):
        with pytest.raises(FileAccessError) as refused:
            check(damaged)
        assert refused.value.fix.startswith(f"delete {damaged} (a damaged file in specrun's cache), or ")
    damaged.unlink()  # the .json beside intact heads damaged: that file is named, not the heads (review)
    damaged.with_suffix(".json").write_text("garbage")
    with pytest.raises(FileAccessError) as refused:
        check_keep_path(damaged, "file")
    assert refused.value.fix.startswith(f"delete {damaged.with_suffix('.json')} (a damaged file")
    mine = tmp_path / "mine.safetensors"
    mine.write_text("garbage")
    with pytest.raises(FileAccessError) as refused:
        check_heads_file(mine)
    assert "delete" not in refused.value.fix


def test_a_run_with_nothing_to_learn_says_so_when_learning_was_asked_for():
    notes = []
    Learning(LearnSettings(), on_note=notes.append, explicit=False)(None, None)
    assert notes == []
    learning = Learning(LearnSettings(), on_note=notes.append, explicit=True)

    class Llama:
        name = "llama"

    learning(None, Llama())
    learning(None, Llama())
    assert notes == ["--learn: nothing learns: the method drafts with no heads and no draft model, and only those "
                     "learn online"]
    for alone, said in ((True, "nothing learns"), (False, "the draft model does not learn")):
        notes.clear()
        learning = Learning(LearnSettings(), on_note=notes.append, explicit=True)
        assert learning.draft(Llama(), alone=alone) is None
        assert notes == [f"--learn: {said}: llama.cpp's draft models cannot learn online (its weights are fixed "
                         "in the GGUF)"]


def test_eagle3_heads_the_trainer_does_not_model_are_left_as_they_are_in_a_note():
    import dataclasses

    from heads_factory import eagle3_heads

    notes = []
    learning = Learning(LearnSettings(), on_note=notes.append, explicit=True)
    assert learning(eagle3_heads(8, 10, aux=(1, 3), norm_before_residual=True), None) is None
    assert notes == ["--learn: nothing learns: their layer adds the normed feature back (norm_before_residual), "
                     "which specrun's trainer does not"]
    heads = eagle3_heads(8, 10, aux=(1, 3), heads=4, kv_heads=2, head_dim=4, intermediate=16)
    heads = dataclasses.replace(heads, max_position_embeddings=2048, rms_norm_eps=1e-5)  # published heads' epsilon
    learner = OnlineLearner(heads, inline=True)
    published = learner.trainer.heads()
    learner.close()
    assert (published.rms_norm_eps, published.max_position_embeddings, published.num_key_value_heads) == \
        (heads.rms_norm_eps, 2048, 2)
    assert published.embed_tokens is heads.embed_tokens


def test_ctrl_c_while_the_heads_are_written_waits_for_both_files(tmp_path):
    from specrun.heads.files import load_heads, save_heads

    path = tmp_path / "heads.safetensors"
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            save_heads(fresh_heads("medusa"), path)
            assert threading.current_thread() is threading.main_thread()
    assert load_heads(path).config.kind == "medusa"  # both files, their checksums agreeing


def test_the_report_reads_as_json():
    learner = OnlineLearner(fresh_heads("medusa"), window=8, inline=True)
    feed(learner, 2)
    document = json.loads(json.dumps(learner.report().to_dict()))
    assert document["kind"] == "medusa" and document["steps"] > 0 and len(document["acceptance_latest"]) == DEPTH


def test_the_report_gives_no_share_of_a_generation_too_short_to_print():
    """A 4-token answer's generation took 0.0001 s: its share read 6,500% of "0.0 s"."""
    import dataclasses

    learner = OnlineLearner(fresh_heads("medusa"), window=8, inline=True)
    feed(learner, 1)
    report = learner.report()
    short = dataclasses.replace(report, busy_cpu=0.01, busy_seconds=0.0001).summary()
    assert "(a generation under 0.1 s)" in short and "%" not in short.split("acceptance")[0]
    long = dataclasses.replace(report, busy_cpu=0.1, busy_seconds=2.0).summary()
    assert "(5.0% of 2.0 s)" in long


def test_positions_verified_while_the_heads_drafted_nothing_are_learned_from():
    """A text whose steps never asked the heads (auto drafting with another member, or not at all):
    the drafter hands the learner every verified position when the text ends."""
    from heads_factory import oracle_heads_for, oracle_hidden
    from fake_models import COPYING_VOCAB, copying_logits
    from specrun.backends.fake import FakeBackend
    from specrun.backends.kv import sequence_for
    from specrun.drafters.heads.medusa import MedusaDrafter

    heads = oracle_heads_for("medusa", COPYING_VOCAB)
    table = copying_logits(salt=4)
    target = sequence_for(FakeBackend(table, COPYING_VOCAB, hidden_table=oracle_hidden(table, COPYING_VOCAB),
                                      hidden_size=heads.config.hidden_size))
    learner = OnlineLearner(heads, window=8, inline=True)
    drafter = MedusaDrafter(heads)
    drafter.learner = learner
    drafter.bind(target, lambda: 0.0)
    tokens = [int(token) % COPYING_VOCAB for token in range(3, 120)]
    drafter.prefill(tokens[:10])
    for stop in range(10, len(tokens), 7):  # verify passes of 7 tokens, none of them drafted by the heads
        target.sync(tokens[: stop - 1])
    target.sync(tokens[:-1])  # the text as verified: every token but the last is cached
    drafter.close()
    assert learner.report().seen == len(tokens) - 2 - 9  # from the prompt's last position to the last cached


def test_a_write_that_fails_while_ctrl_c_is_held_says_why_not_that_it_was_interrupted():
    """A full disk as the finished heads were written, a Ctrl-C meanwhile: the Ctrl-C raised in
    its place, and heads train, which takes a Ctrl-C there as the end of a finished run, reported
    heads it never wrote."""
    from specrun.errors import FileAccessError

    with pytest.raises(FileAccessError):
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            raise FileAccessError("cannot write the heads: no space left on device", "free some disk space")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C is Ctrl-C again
