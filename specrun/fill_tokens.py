"""The spellings of code models' fill-in-the-middle tokens, and of the tokens that end a turn, as
llama.cpp's vocabulary finds them (src/llama-vocab.cpp), for backends that do not find their own
(MLX): a fill's prompt tokens (sessions/infill.py) and the tokens that end generation, so both
backends fill, and end, alike."""

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


# Tokens llama.cpp ends generation at by their text, whatever the model's configuration names
# (llama-vocab.cpp's list): a model whose config names only its end of text went on past its
# end of turn on MLX (``<|eot_id|>``, ``<end_of_turn>``) where llama.cpp stopped.
TURN_END_SPELLINGS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
)


def turn_endings(vocab: dict[str, int]) -> set[int]:
    """The ids of the tokens of ``vocab`` ({text: id}) spelled as TURN_END_SPELLINGS. As llama.cpp,
    ``<|end|>`` is left out beside ``<|return|>`` or ``<|flush|>`` with ``<|call|>`` or ``<|calls|>``
    (gpt-oss's harmony format, Solar Open), where it ends a message, not the turn; and ``</s>``
    beside ``<|tool_response>`` or ``<|plamo:eos|>`` (Gemma 4, PLaMo), where it is text."""
    found = {text: vocab[text] for text in TURN_END_SPELLINGS if text in vocab}
    calls = "<|call|>" in found or "<|calls|>" in found
    if "<|end|>" in found and calls and ("<|return|>" in found or "<|flush|>" in found):
        del found["<|end|>"]
    if "</s>" in found and ("<|tool_response>" in found or "<|plamo:eos|>" in vocab):
        del found["</s>"]
    return set(found.values())
