"""A Gated DeltaNet's state rolled back within a short pass on MLX (backends/mlx_snapshots.py): a
rewind into the last pass feeds nothing and leaves every logit a fresh cache's; a rewind past it,
or into a prompt's long pass, replays from a checkpoint as before; a model whose probe disagrees
replays (Mamba, sliding windows: tests/backends/test_backend_engine.py); speculation on a hybrid,
MTP, lookup or a hybrid draft model, gives plain decoding's tokens."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")

LAYOUTS = ("qwen35", "qwen35moe", "qwen3next")
# Logits compared with a fresh cache's fed in other batch shapes: OpenBLAS rounds them up to ~3e-4
# apart here (tools/with_openblas.sh; the MoE layouts' most), a state one token off by ~1.
ATOL = 1e-3


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from hybrid_models import HybridShape, hybrid_weights, write_qwen35_mlx_folder

    from hybrid_models import write_fitted_qwen35_mlx_folder

    root = tmp_path_factory.mktemp("snapshots")
    shapes = {"qwen35": HybridShape(), "qwen35moe": HybridShape(experts=4),
              "qwen3next": HybridShape(experts=4, next=True)}
    folders = {name: write_qwen35_mlx_folder(root / name, shape, hybrid_weights(shape, mtp_layers=1))
               for name, shape in shapes.items()}
    # its MTP layer fitted on its own continuations: drafts accepted in part, rewinds at every depth
    folders["qwen35-fitted"] = write_fitted_qwen35_mlx_folder(root / "qwen35-fitted", HybridShape())
    return folders


def open_mlx(folder, **options):
    from specrun.backends.mlx import MlxBackend

    backend = MlxBackend(folder, n_ctx=512)
    for name, value in options.items():
        setattr(backend, name, value)
    return backend


class CountedPasses:
    """How many model calls a backend makes (a replay is one or more)."""

    def __init__(self, backend, monkeypatch) -> None:
        self.calls = 0
        run = backend._run_model

        def counted(inputs):
            self.calls += 1
            return run(inputs)

        monkeypatch.setattr(backend, "_run_model", counted)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_rewind_into_the_last_pass_feeds_nothing_and_leaves_a_fresh_cache_s_logits(folders, layout, monkeypatch):
    from specrun.backends.mlx_snapshots import SNAPSHOT_TOKENS

    target, fresh = open_mlx(folders[layout]), open_mlx(folders[layout])
    ids = [(7 * i + 3) % 200 + 5 for i in range(SNAPSHOT_TOKENS + 20)]
    prompt = SNAPSHOT_TOKENS + 8  # past what a pass keeps
    full = fresh.forward(ids, range(len(ids)))  # (n, V): one pass, longer than any kept
    target.forward(ids[:prompt], [0])
    assert target._snapshotter is not None and target._snapshotter.recurrent == [0, 1, 2]
    passes = CountedPasses(target, monkeypatch)
    for kept in (5, 3, 1):  # each rejects more of what the verify pass fed
        target.forward(ids[prompt : prompt + 6], range(6))  # a verify pass of six
        n_keep = prompt + kept
        target.rewind(n_keep)
        assert target.n_past == n_keep and passes.calls == 1
        np.testing.assert_allclose(target.forward(ids[n_keep : n_keep + 2], [0, 1]), full[n_keep : n_keep + 2],
                                   atol=ATOL, rtol=0)
        target.rewind(n_keep + 1)  # into the pass of two just fed
        target.rewind(prompt)  # the verify pass's checkpoint: nothing fed either
        assert target.n_past == prompt and passes.calls == 2
        passes.calls = 0
    target.forward(ids[prompt : prompt + 6], range(6))
    target.rewind(prompt - 1)  # into the prompt's pass: from its checkpoint, its tokens fed again
    assert target.n_past == prompt - 1 and passes.calls > 1
    np.testing.assert_allclose(target.forward(ids[prompt - 1 : prompt + 1], [0, 1]), full[prompt - 1 : prompt + 1],
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plain_decoding_and_rewinds_keep_the_cache_a_fresh_one_fed_the_kept_tokens(folders, layout):
    """One token a pass (a draft's drafting, plain decoding), then rewinds of 1-3 tokens back
    through passes of 1: each lands at a pass's checkpoint (nothing kept is read, nothing fed)."""
    target, fresh = open_mlx(folders[layout]), open_mlx(folders[layout])
    ids = [(11 * i + 1) % 180 + 7 for i in range(30)]
    full = fresh.forward(ids, range(len(ids)))
    target.forward(ids[:8], [7])
    for at in range(8, 20):
        target.forward(ids[at : at + 1], [0])
    for n_keep in (19, 17, 14):
        target.rewind(n_keep)
        np.testing.assert_allclose(target.forward(ids[n_keep:22], range(22 - n_keep)), full[n_keep:22],
                                   atol=ATOL, rtol=0)


@pytest.mark.parametrize("layout", ["qwen35", "qwen3next"])
def test_a_rewind_into_any_call_of_a_pass_reads_that_call_s_rows(folders, layout, monkeypatch):
    """A pass whose rows start after its first tokens is three model calls (the tokens before the
    first row fed unread, the rows, the tokens after): a rewind into each call rolls back by its
    own rows and state before it, nothing fed again."""
    target, fresh = open_mlx(folders[layout]), open_mlx(folders[layout])
    ids = [(5 * i + 2) % 190 + 9 for i in range(24)]
    full = fresh.forward(ids, range(len(ids)))
    target.forward(ids[:10], [0])
    passes = CountedPasses(target, monkeypatch)
    for n_keep in (11, 12, 13, 14, 15):  # in the first call (10-11), the second (12), the third (13-15)
        target.forward(ids[10:16], [2])  # calls of 2, 1 and 3 tokens
        target.rewind(n_keep)
        assert target._pass_states is not None and passes.calls == 3
        np.testing.assert_allclose(target.forward(ids[n_keep : n_keep + 2], [0, 1]), full[n_keep : n_keep + 2],
                                   atol=ATOL, rtol=0)
        target.rewind(10)
        passes.calls = 0


def test_a_model_with_recorders_still_copies(folders):
    """copy.deepcopy of the model (a draft's online LoRA trainer copies it) with the conv recorders
    installed: no recursion through their attribute lookup."""
    import copy

    target = open_mlx(folders["qwen35"])
    target.forward([5, 6, 7, 8], [3])
    assert target._snapshotter is not None
    copied = copy.deepcopy(target.model)
    assert type(copied.layers[0].linear_attn.conv1d).__name__ == "_ConvRecorder"


def test_the_recorders_leave_the_model_s_parameters_and_its_unrecorded_calls_as_they_were(folders):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load

    model, _ = load(str(folders["qwen35"]))
    tokens = mx.array([[5, 9, 13, 17, 21]])
    from mlx_lm.models.cache import make_prompt_cache

    before = model(tokens, cache=make_prompt_cache(model))
    names = sorted(name for name, _ in tree_flatten(model.parameters()))
    from specrun.backends.mlx_snapshots import Snapshotter
    from mlx_lm.models import cache as lm_cache

    assert Snapshotter.for_model(mx, lm_cache, model) is not None
    assert sorted(name for name, _ in tree_flatten(model.parameters())) == names  # conv1d still a child
    assert type(model.layers[0].linear_attn.conv1d).__name__ == "_ConvRecorder"
    assert mx.array_equal(model(tokens, cache=make_prompt_cache(model)), before).item()


def test_a_probe_that_disagrees_leaves_the_model_to_replay(folders, monkeypatch):
    """A layout read wrongly (here: the recurrence run a token too far) fails the probe: no
    snapshotter, and rewinds stay exact by replay."""
    from specrun.backends import mlx_snapshots

    real = mlx_snapshots.Snapshotter.cache_state

    def a_row_late(self, states, index, n_tokens):
        conv, _ = real(self, states, index, n_tokens)
        first, _, update = states.calls[index][-1]
        return [conv, update.state_after(min(n_tokens - first + 1, update.timed[0].shape[1]))]

    monkeypatch.setattr(mlx_snapshots.Snapshotter, "cache_state", a_row_late)
    target, fresh = open_mlx(folders["qwen35"]), open_mlx(folders["qwen35"])
    assert target.needs_checkpoints and target._snapshotter is None
    assert type(target.model.layers[0].linear_attn.conv1d).__name__ == "Conv1d"  # the recorders taken off
    ids = list(range(20, 40))
    full = fresh.forward(ids, range(len(ids)))
    target.forward(ids[:10], [0])
    target.forward(ids[10:15], range(5))
    target.rewind(12)
    np.testing.assert_allclose(target.forward(ids[12:14], [0, 1]), full[12:14], atol=ATOL, rtol=0)


def test_snapshots_off_replays(folders, monkeypatch):
    target = open_mlx(folders["qwen35"], snapshots=False)
    target.forward(list(range(5, 15)), [0])
    passes = CountedPasses(target, monkeypatch)
    target.forward([20, 21, 22, 23], range(4))
    target.rewind(12)
    assert target._pass_states is None and passes.calls == 2  # the pass, then two tokens fed again


@pytest.mark.parametrize("layout", ["qwen35-fitted", "qwen3next"])
def test_speculation_on_a_hybrid_rewinds_by_its_kept_states_and_gives_plain_decoding_s_tokens(folders, layout):
    """Lookup and the model's own MTP layer drafting on the hybrid, greedy, fixed and adaptive
    lengths: the tokens plain decoding gives, rejected drafts rolled back without a replay (with
    the fitted layer, to every depth a draft of 3 can keep)."""
    from mtp_models import TRAINING_PROMPTS
    from specrun.drafters.methods import DrafterOptions, build_drafter
    from specrun.engine.loop import GenerationParams, SpeculativeEngine
    from specrun.sessions.heads import read_heads

    target = open_mlx(folders[layout])
    kept_depths = []
    restore = target._restore_kept_states

    def counted(n_keep):
        start = target._pass_states.start if target._pass_states is not None else None
        used = restore(n_keep)
        if used:
            kept_depths.append(n_keep - start)
        return used

    target._restore_kept_states = counted
    heads = read_heads(folders[layout], None)
    engine = SpeculativeEngine(target, None)
    accepted = drafted = 0
    for prompt in (*TRAINING_PROMPTS[:2], "import os\nimport sys\nimport os\nimport sys\n"):
        ids = target.tokenize(prompt)
        engine.set_drafter(None, "none")
        plain = engine.run(ids, GenerationParams(40, 0)).token_ids
        for method, params in (("mtp", GenerationParams(40, 3)), ("mtp", GenerationParams(40, 8, adaptive=True)),
                               ("lookup", GenerationParams(40, 3))):
            drafter = build_drafter(method, None, DrafterOptions(heads=heads))
            engine.set_drafter(drafter, method)
            result = engine.run(ids, params)
            drafter.close()
            assert result.token_ids == plain, (prompt, method, params)
            accepted, drafted = accepted + result.stats.accepted, drafted + result.stats.drafted
    assert drafted > 0 and kept_depths
    if layout == "qwen35-fitted":
        assert accepted > 0.2 * drafted and set(kept_depths) >= {1, 2, 3}
    target.close()


@pytest.fixture(scope="module")
def nudged_draft(folders, tmp_path_factory):
    """The Qwen3.5 folder with every matrix nudged by 1% of its spread: a hybrid draft that agrees
    with it about half the time."""
    import mlx.core as mx

    folder = tmp_path_factory.mktemp("nudged") / "qwen35"
    shutil.copytree(folders["qwen35"], folder)
    for path in folder.glob("model*.safetensors"):
        weights = mx.load(str(path))
        mx.random.seed(3)
        nudged = {name: value + 0.01 * mx.std(value) * mx.random.normal(value.shape) if value.ndim == 2 else value
                  for name, value in weights.items()}
        mx.save_safetensors(str(path), nudged)
    return folder


@pytest.mark.parametrize("snapshots", [True, False])
def test_a_hybrid_draft_model_for_a_hybrid_target_gives_plain_decoding_s_tokens(folders, nudged_draft, monkeypatch,
                                                                                snapshots):
    """Both sides recurrent (a small Qwen3.5 drafting for a large one), greedy, fixed and adaptive
    lengths: plain decoding's tokens. Rolling back within passes, the draft drafts on the device
    with one sync and a fixed length's verify pass is queued on its ids (as for a cache that can be
    cut); replaying, a token at a time with the ids on the host first."""
    from specrun.backends.mlx import MlxBackend
    from specrun.drafters.methods import DrafterOptions, build_drafter
    from specrun.engine.loop import GenerationParams, SpeculativeEngine

    target, draft = open_mlx(folders["qwen35"], snapshots=snapshots), open_mlx(nudged_draft, snapshots=snapshots)
    assert target.can_defer == draft.can_defer == snapshots
    calls = {"deferred": 0, "after": 0, "one by one": 0}
    for name, method in (("deferred", "forward_greedy_deferred"), ("after", "forward_argmax_after"),
                         ("one by one", "_greedy_one_by_one")):
        real = getattr(MlxBackend, method)

        def counted(self, *args, real=real, name=name, **kwargs):
            calls[name] += 1
            return real(self, *args, **kwargs)

        monkeypatch.setattr(MlxBackend, method, counted)
    engine = SpeculativeEngine(target, None)
    accepted = rejected = 0
    for prompt in ("def hello(world):", "The list of numbers"):
        ids = target.tokenize(prompt)
        engine.set_drafter(None, "none")
        plain = engine.run(ids, GenerationParams(40, 0)).token_ids
        for params in (GenerationParams(40, 4), GenerationParams(40, 8, adaptive=True)):
            drafter = build_drafter("draft", draft, DrafterOptions())
            engine.set_drafter(drafter, "draft")
            result = engine.run(ids, params)
            drafter.close()
            assert result.token_ids == plain, (prompt, params)
            accepted += result.stats.accepted
            rejected += result.stats.drafted - result.stats.accepted
    assert accepted > 0 and rejected > 0
    if snapshots:
        assert calls["deferred"] > 0 and calls["after"] > 0 and calls["one by one"] == 0
    else:
        assert calls["deferred"] == calls["after"] == 0 and calls["one by one"] > 0


def test_greedy_ids_on_the_device_leave_a_hybrid_s_cache_as_one_at_a_time_does(folders, monkeypatch):
    """``forward_greedy`` on a hybrid, the ids chained on the device: the ids and, after a rewind
    into its passes (nothing fed again), the logits that passes one token at a time give."""
    target, reference = open_mlx(folders["qwen35"]), open_mlx(folders["qwen35"], snapshots=False)
    prompt = target.tokenize("def hello(world): return the sum of")
    ids = target.forward_greedy(prompt, 6)
    assert list(ids) == list(reference.forward_greedy(prompt, 6))
    passes = CountedPasses(target, monkeypatch)
    target.rewind(len(prompt) + 2)
    assert passes.calls == 0
    fed = [*prompt, *ids[:2].tolist()]
    reference.rewind(0)
    np.testing.assert_allclose(target.forward([int(ids[2])], [0]), reference.forward([*fed, int(ids[2])], [len(fed)]),
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("layout", ["qwen35", "qwen3next"])
def test_a_layer_draft_of_a_hybrid_is_one_line_not_a_crash(folders, layout):
    """self:layers=N on a hybrid: Qwen3.5's wrapper keeps its body behind a property, Qwen3-Next's
    body indexes its attention layer by position; each is a ModelFileError naming the fix."""
    from specrun.errors import ModelFileError

    target = open_mlx(folders[layout])
    with pytest.raises(ModelFileError, match="cannot run a part of its layers") as error:
        target.layer_draft([0, 1])
    assert "self:q4 or a draft model" in error.value.fix
