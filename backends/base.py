"""The narrow interface the engine drives every model through."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class VocabInfo:
    """Vocabulary facts that decide whether two models can speculate together."""

    size: int
    bos_id: int | None
    eos_ids: frozenset[int]  # every end-of-generation token
    add_bos: bool


@runtime_checkable
class Backend(Protocol):
    """One loaded model with a KV cache holding ``n_past`` tokens.

    ``forward`` appends ``tokens`` to the cache at positions n_past … n_past+len-1 and
    returns logits only for the rows asked for (indices into ``tokens``), never for
    the whole context. ``rewind(n_keep)`` drops every cached token from n_keep on.
    """

    name: str
    vocab: VocabInfo
    n_ctx: int

    @property
    def n_past(self) -> int: ...

    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of ``text``; ``special`` turns special-token text (``<|im_start|>``) into
        those tokens, as a rendered chat template needs."""
        ...

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token contributes to output text (b"" for control tokens)."""
        ...

    def control_texts(self) -> frozenset[str]:
        """The texts that ``tokenize(..., special=True)`` turns into control tokens
        (``<|im_start|>``, ``</s>``): never to be read that way from a user's text."""
        ...

    def token_text(self, token: int) -> str:
        """The token's vocabulary entry, for comparing vocabularies."""
        ...

    def chat_template(self) -> str | None: ...

    def native_loop(self):
        """The backend library's own plain decoding loop on the same model (an object with
        ``name``, ``tokens_per_second(prompt_ids, max_new_tokens)`` and ``close()``), to
        report specrun against; None where none is compared."""
        ...

    def forward(self, tokens: Sequence[int], logit_rows: Sequence[int]) -> np.ndarray:
        """Append ``tokens`` to the cache; return float32 logits (len(logit_rows), vocab)."""
        ...

    def forward_argmax(self, tokens: Sequence[int], logit_rows: Sequence[int]) -> np.ndarray:
        """Like ``forward`` but return only the argmax ids (len(logit_rows),)."""
        ...

    def rewind(self, n_keep: int) -> None: ...

    def close(self) -> None: ...
