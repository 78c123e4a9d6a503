"""Can this drafter speculate for this target? Same ids, same token texts, same BOS/EOS."""

from __future__ import annotations

from specrun.backends.base import Backend
from specrun.errors import IncompatibleModelsError


# llama.cpp also tolerates this many extra ids (its SPEC_VOCAB_MAX_SIZE_DIFFERENCE).
MAX_PADDING_IDS = 128


def is_padding_text(text: str) -> bool:
    """Ids that exist only to pad an embedding matrix (Qwen2.5 GGUFs: '[PAD151936]')."""
    return text == "" or text.startswith(("[PAD", "<|PAD", "<pad"))


def vocabulary_differences(target: Backend, draft: Backend) -> list[str]:
    """Human-readable differences between two vocabularies (empty when compatible).

    Sizes may differ by up to MAX_PADDING_IDS ids when every extra id is padding:
    Qwen2.5's GGUFs pad 151936 ids to 152064 from 7B up, and those ids never occur.
    """
    problems = []
    tv, dv = target.vocab, draft.vocab
    if tv.size != dv.size and not _only_padding_differs(target, draft):
        problems.append(f"vocabulary size {tv.size} vs {dv.size}")
    for token in range(min(tv.size, dv.size)):
        target_text, draft_text = target.token_text(token), draft.token_text(token)
        if target_text != draft_text:
            problems.append(f"token {token} is {target_text!r} in the target but {draft_text!r} in the draft")
            break
    if tv.bos_id != dv.bos_id:
        problems.append(f"BOS id {tv.bos_id} vs {dv.bos_id}")
    if tv.eos_ids != dv.eos_ids:
        problems.append(f"EOS ids {sorted(tv.eos_ids)} vs {sorted(dv.eos_ids)}")
    return problems


def check_compatible(target: Backend, draft: Backend, target_name: str, draft_name: str) -> None:
    """Raise IncompatibleModelsError saying where the vocabularies differ."""
    problems = vocabulary_differences(target, draft)
    if problems:
        raise IncompatibleModelsError(
            f"draft {draft_name} cannot speculate for target {target_name}: " + "; ".join(problems),
            "pick a draft of the same model family (same tokenizer), or use --method lookup",
        )


def _only_padding_differs(target: Backend, draft: Backend) -> bool:
    larger = target if target.vocab.size > draft.vocab.size else draft
    shared = min(target.vocab.size, draft.vocab.size)
    if larger.vocab.size - shared > MAX_PADDING_IDS:
        return False
    return all(is_padding_text(larger.token_text(token)) for token in range(shared, larger.vocab.size))
