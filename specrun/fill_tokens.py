"""The spellings of code models' fill-in-the-middle tokens, as llama.cpp's vocabulary finds them
(src/llama-vocab.cpp), for backends that do not find their own (MLX): the prompt's tokens
(sessions/infill.py) and the ones that end generation, so both backends fill alike."""

from __future__ import annotations

# (prefix, suffix, middle), each family's
FIM_SPELLINGS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, CodeGemma
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2, Granite Code
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
    ("▁<PRE>", "▁<SUF>", "▁<MID>"),  # CodeLlama
    ("<PRE>", "<SUF>", "<MID>"),
    ("<|code_prefix|>", "<|code_suffix|>", "<|code_middle|>"),  # GLM-4.5
    ("<|prefix|>", "<|suffix|>", "<|middle|>"),  # Falcon-H1-Tiny-Coder
)
# The repository-level tokens, each optional: a repository's name, a file separator; and the
# padding. llama.cpp ends generation at each of the three a model has (a fill that wrote one
# began an invented next file).
REPO_SPELLINGS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
SEPARATOR_SPELLINGS = ("<|file_sep|>",)
PAD_SPELLINGS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
ENDING_SPELLINGS = (REPO_SPELLINGS, SEPARATOR_SPELLINGS, PAD_SPELLINGS)


def fill_endings(token_id) -> set[int]:
    """The ids of a vocabulary's repository, file-separator and padding tokens (the first of each
    role's spellings it holds), which end generation as llama.cpp ends it; ``token_id(text)``:
    the id of a token spelled ``text``, or None."""
    found = set()
    for spellings in ENDING_SPELLINGS:
        ids = (token_id(text) for text in spellings)
        first = next((each for each in ids if each is not None), None)
        if first is not None:
            found.add(first)
    return found
