"""What a heads file says it is (HeadsConfig: its kind, shape and the target it was made for),
the held-out report training wrote, and which of the target's layers heads read."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np



@dataclass(frozen=True)
class HeadsConfig:
    """What a heads file says it is and which target it was made for.

    kind: the method that drafts with the heads, one of heads.kinds.HEAD_METHODS (EAGLE-3 heads
    say "eagle"; heads.kinds.kind_of gives loaded heads' row of the table). num_heads: positions
    drafted per target pass (Medusa's and Hydra's heads; EAGLE: the depth it was trained to).
    num_layers: residual blocks per Medusa head (Hydra: layers per head, its first reading the
    drafted tokens too; EAGLE: decoder layers). hidden_size, vocab_size: the target's.
    draft_vocab_size: rows of the projection (vocab_size when there is no draft vocabulary).
    target: what the target was, as far as it is known: ``name``, ``vocabulary``
    (specrun.drafters.ngram.vocabulary_fingerprint, "" when unknown), ``num_layers`` (0 when
    unknown). training: what the trainer recorded (steps, loss, held-out acceptance), free-form;
    empty for published heads.
    """

    kind: str
    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    target_name: str = ""
    target_vocabulary: str = ""
    target_layers: int = 0
    training: dict = field(default_factory=dict, hash=False)


def held_out_acceptance(config: HeadsConfig) -> tuple[float, ...] | None:
    """Each depth's acceptance given the depths before it accepted, as `specrun heads train`
    measured it (its report's ``chain_accuracy``): on the --eval-prompts where it was given them
    (prompts unlike the data, a closer guess at other prompts), else on held-out data; None where
    the file carries no such report (published heads) or a malformed one."""
    training = config.training if isinstance(config.training, dict) else {}
    report = training.get("other_prompts") if isinstance(training.get("other_prompts"), dict) else training.get("held_out")
    values = report.get("chain_accuracy") if isinstance(report, dict) else None
    if not isinstance(values, list) or not values or len(values) > config.num_heads:
        return None
    if not all(isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0
               for value in values):
        return None
    return tuple(float(value) for value in values)


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """The target layers (0-based outputs) an EAGLE-3 head reads when its file names none.

    SGLang captures the residual stream entering layers 2, N // 2 and N - 3
    (models/llama.py, ``set_eagle3_layers_to_capture``); SpecForge's trainer picks the same
    outputs (``resolve_eagle_capture_layers``: 1, N // 2 - 1, N - 4).
    """
    return (1, num_layers // 2 - 1, num_layers - 4)


def training_layer_ids(num_layers: int) -> tuple[int, ...]:
    """The target layers `specrun heads train --kind eagle3` reads: SGLang's three where they are
    distinct and llama.cpp gives them all (it cannot give the last layer's output), else three (or
    as many as there are) spread evenly over the layers it gives, from the second on."""
    readable = max(num_layers - 1, 1)
    ids = default_aux_layer_ids(num_layers)
    if len(set(ids)) == len(ids) and 0 <= min(ids) and max(ids) < readable:
        return ids
    spread = np.linspace(min(1, readable - 1), readable - 1, 3)
    return tuple(sorted({int(round(value)) for value in spread}))
