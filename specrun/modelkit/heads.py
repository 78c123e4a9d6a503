"""Self-drafting heads (Medusa, Hydra, EAGLE) as specrun holds them in memory, and their files.

Heads draft from the target's own hidden state (the output head's input, after the final norm,
``Backend.hidden_support``) instead of a second model. A hidden state h_p at position p is what
the target's own head turns into its guess for token p + 1.

Medusa (Cai et al. 2024): head i (0-based) reads h_p alone and guesses token p + 2 + i. Each head
is ``num_layers`` residual blocks, h <- h + silu(W h + b), then a projection over the draft
vocabulary. Heads here project over a draft vocabulary (``d2t``: the target id of each draft id;
None where it is the target's whole vocabulary), as EAGLE-3 does, since a projection over a 50k
vocabulary costs as much as a small target's pass on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HEAD_KINDS = ("medusa", "hydra", "eagle")


@dataclass(frozen=True)
class HeadsConfig:
    """What a heads file says it is and which target it was made for.

    kind: one of HEAD_KINDS. num_heads: positions drafted per target pass (Medusa's heads;
    EAGLE: the depth it was trained to). num_layers: residual blocks per Medusa head (EAGLE:
    decoder layers). hidden_size, vocab_size: the target's. draft_vocab_size: rows of the
    projection (vocab_size when there is no draft vocabulary). target: what the target was,
    as far as it is known: ``name``, ``vocabulary`` (specrun.drafters.ngram.vocabulary_fingerprint,
    "" when unknown), ``num_layers`` (0 when unknown).
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


@dataclass(frozen=True)
class MedusaHeads:
    """Medusa heads as NumPy arrays (float32).

    blocks[i][j]: (weight (H, H), bias (H,)) of head i's residual block j.
    lm_heads[i]: (Vd, H) head i's projection over the draft vocabulary (heads may share one).
    d2t: (Vd,) int64, the target id of each draft id; None when Vd is the target's vocabulary.
    """

    config: HeadsConfig
    blocks: tuple[tuple[tuple[np.ndarray, np.ndarray], ...], ...]
    lm_heads: tuple[np.ndarray, ...]
    d2t: np.ndarray | None = None
