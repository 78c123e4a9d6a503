"""The one table of head kinds (specrun/heads/kinds.py) and what hangs off it: every kind has a
drafter for its method, every trainable kind a trainer, every kind a reader and a writer, and the
method lists the CLI accepts come from the table."""

from __future__ import annotations

import re

import numpy as np
import pytest

from heads_factory import eagle3_heads, random_eagle, random_heads, random_hydra, random_mtp
from specrun.drafters.heads import DRAFTERS
from specrun.drafters.heads.base import HeadsDrafter
from specrun.drafters.methods import METHODS, PARTS, heads_kind, heads_of_kind
from specrun.heads import files
from specrun.heads.kinds import (
    AUTO_HEADS_ORDER, BY_NAME, FILE_KINDS, HEAD_METHODS, KINDS, TRAINABLE_KINDS, WINDOW_KINDS, kind_of,
    kinds_of_method,
)
from specrun.training.run import MLX_TRAINERS, TRAINERS, trainer_class

# heads of every kind, small (the factories tests draft with)
EXAMPLES = {
    "medusa": lambda: random_heads(8, 32, num_heads=2),
    "hydra": lambda: random_hydra(8, 32, num_heads=2),
    "eagle": lambda: random_eagle(8, 32, depth=2),
    "eagle3": lambda: eagle3_heads(8, 32, depth=2),
    "mtp": lambda: random_mtp(8, 32, depth=2, experts=4),
}


def test_the_table_names_each_kind_once_with_known_values():
    assert len(BY_NAME) == len(KINDS)
    for kind in KINDS:
        assert kind.stored in ("file", "folder", "model")
        assert kind.trains_on in ("positions", "windows", "")
        assert kind.reads in ("hidden", "layers")
        assert kind.embeds in ("", "own", "target")


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name)
def test_every_kind_has_a_drafter_for_its_method(kind):
    drafter = DRAFTERS[kind.method]
    assert issubclass(drafter, HeadsDrafter)
    heads = EXAMPLES[kind.name]()
    assert kind_of(heads) is kind
    assert heads_of_kind(heads, kind.method) is heads  # the method's drafter takes heads of this kind


@pytest.mark.parametrize("kind", [BY_NAME[name] for name in TRAINABLE_KINDS], ids=lambda kind: kind.name)
def test_every_trainable_kind_has_a_trainer(kind):
    for backend in ("llama", "mlx"):
        trainer = trainer_class(kind.name, backend)
        assert callable(getattr(trainer, "fresh", None)), f"{trainer} cannot start {kind.name} heads"
    assert set(MLX_TRAINERS) <= set(TRAINERS) == set(TRAINABLE_KINDS)


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name)
def test_every_kind_has_a_reader_and_a_writer_and_reads_back_what_it_wrote(kind, tmp_path, glm_mtp):
    if kind.stored == "model":  # read from the model that carries it (tests/heads/test_mtp.py reads it whole)
        from specrun.modelkit.mtp import read_mtp_gguf

        heads = read_mtp_gguf(glm_mtp["gguf"])
        assert kind_of(heads) is kind and heads.config.kind == kind.method
        return
    if kind.stored == "file":
        assert kind.name in files.TENSOR_WRITERS and kind.name in files.TENSOR_READERS
        path = tmp_path / f"{kind.name}.safetensors"
    else:
        assert kind.name in files.FOLDER_WRITERS and kind.name in files.FOLDER_READERS
        assert kind.name in files.FOLDER_ARCHITECTURES.values()  # how load_heads recognises its folder
        path = tmp_path / kind.name
    heads = EXAMPLES[kind.name]()
    files.save_heads(heads, path)
    loaded = files.load_heads(path)
    assert kind_of(loaded) is kind and loaded.config.kind == heads.config.kind
    if kind.stored == "file":  # float16 on disk: written again, the same tensors
        written, layout = files.TENSOR_WRITERS[kind.name](heads, path)
        again, layout_again = files.TENSOR_WRITERS[kind.name](loaded, path)
        assert written.keys() == again.keys() and layout == layout_again
        for name in written:
            np.testing.assert_array_equal(written[name], again[name])
    else:
        np.testing.assert_allclose(loaded.lm_head, heads.lm_head, rtol=1e-3, atol=1e-3)


def test_both_backends_heads_targets_give_what_training_asks_for():
    """backends/heads_target.py declares it; the llama.cpp and MLX targets each have every member."""
    import inspect

    from specrun.backends.heads_llama import LlamaHeadsTarget
    from specrun.backends.heads_mlx import MlxHeadsTarget
    from specrun.backends.heads_target import HeadsTarget

    methods = {name for name, value in vars(HeadsTarget).items() if not name.startswith("_") and callable(value)}
    attributes = set(HeadsTarget.__annotations__)
    assert methods and attributes
    for target in (LlamaHeadsTarget, MlxHeadsTarget):
        assert methods <= set(dir(target)), (target, methods - set(dir(target)))
        source = inspect.getsource(target.__init__)
        missing = {name for name in attributes if not re.search(rf"self\.{name}\b\s*[:=]", source)}
        assert not missing, (target, missing)


def test_the_method_lists_derive_from_the_table():
    assert HEAD_METHODS == tuple(dict.fromkeys(kind.method for kind in KINDS))
    assert set(HEAD_METHODS) <= set(METHODS) and set(HEAD_METHODS) <= set(PARTS)
    assert PARTS.index("lookahead") < min(map(PARTS.index, HEAD_METHODS)) < PARTS.index("draft")
    assert sorted(AUTO_HEADS_ORDER) == sorted(HEAD_METHODS)
    assert FILE_KINDS == tuple(kind.name for kind in KINDS if kind.stored == "file")
    assert set(WINDOW_KINDS) <= set(TRAINABLE_KINDS)
    for method in HEAD_METHODS:
        assert heads_kind(method) == method
        assert kinds_of_method(method)
    # EAGLE-3's folder is looked for before EAGLE-1's file
    assert [kind.name for kind in kinds_of_method("eagle")] == ["eagle3", "eagle"]
