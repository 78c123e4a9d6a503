"""Fill-in-the-middle: the text between a prefix and a suffix, as code models trained for it
write it (an editor's completion at the cursor: /v1/completions with ``suffix``).

A model trained for it holds three special tokens, found here by their spellings (each must
tokenize to one token of the model's own, special text parsed): Qwen2.5-Coder and CodeGemma
write ``<|fim_prefix|>``, StarCoder and StarCoder2 ``<fim_prefix>``, DeepSeek-Coder
``<｜fim▁begin｜>``. The prompt is prefix-suffix-middle (PSM), as each of them was trained on
and llama-server's /infill builds it: [BOS] PRE prefix SUF suffix MID; the model writes the
middle and ends it with its end-of-text token. The text itself is tokenized without parsing
special text, so a prefix quoting ``<|fim_middle|>`` stays text.
"""

from __future__ import annotations

from dataclasses import dataclass

from specrun.errors import SpecrunError

# (prefix, suffix, middle), the families' spellings
FIM_SPELLINGS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, CodeGemma
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2, Granite Code
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)
NO_FIM_FIX = ("use a code model trained for it (Qwen2.5-Coder, StarCoder2, DeepSeek-Coder, CodeGemma), "
              "or send the prompt without a suffix")


class NoInfillError(SpecrunError):
    """The model holds no fill-in-the-middle tokens."""


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int


def fim_tokens(backend) -> FimTokens | None:
    """The model's fill-in-the-middle tokens, or None where it has none."""
    for spelling in FIM_SPELLINGS:
        ids = [_special_id(backend, text) for text in spelling]
        if None not in ids and len(set(ids)) == 3:
            return FimTokens(*ids)
    return None


def _special_id(backend, text: str) -> int | None:
    ids = backend.tokenize(text, add_bos=False, special=True)
    return ids[0] if len(ids) == 1 else None


def infill_ids(backend, prefix: str | list[int], suffix: str, fim: FimTokens | None = None) -> list[int]:
    """[BOS] PRE prefix SUF suffix MID for ``backend``'s model (``prefix`` as text or token ids;
    ``fim``: its fim_tokens, where the caller has them); NoInfillError where it has no such tokens."""
    fim = fim or fim_tokens(backend)
    if fim is None:
        raise NoInfillError("this model has no fill-in-the-middle tokens (such as <|fim_prefix|>), so it cannot "
                            "complete between a prefix and a suffix", NO_FIM_FIX)
    prefix_ids = list(prefix) if not isinstance(prefix, str) else backend.tokenize(prefix, add_bos=False)
    vocab = backend.vocab
    bos = [vocab.bos_id] if vocab.add_bos and vocab.bos_id is not None else []
    return [*bos, fim.prefix, *prefix_ids, fim.suffix, *backend.tokenize(suffix, add_bos=False), fim.middle]
