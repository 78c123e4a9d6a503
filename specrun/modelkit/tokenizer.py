"""A byte-level BPE tokenizer that llama.cpp and Hugging Face tokenize identically.

The tokenizer is GPT-2 style: the GPT-2 pre-tokenizer regex, every byte in the
initial alphabet (so no text is ever unknown), and three special tokens at fixed
ids. In GGUF it is written as ``tokenizer.ggml.model = "gpt2"`` with
``tokenizer.ggml.pre = "gpt-2"``, which selects the same regex in llama.cpp.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)  # ids 0, 1, 2
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

GPT2_PRE_TOKENIZER = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
"""GPT-2's regex split and byte-to-unicode mapping in one step (``tokenizer.json`` form)."""

DEMO_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
"""A plain-text chat template: one ``role: content`` line per message, then an
``assistant: `` cue when ``add_generation_prompt`` is true."""


def train_byte_bpe(texts: Iterable[str], vocab_size: int) -> str:
    """Train a byte-level BPE tokenizer on ``texts`` and return its ``tokenizer.json`` text.

    ``vocab_size`` counts the three special tokens and the 256 byte symbols, so it
    must be at least 259; ``ValueError`` if the texts are too small to learn that
    many merges (each merge needs a pair seen at least twice). Ids 0, 1 and 2 are
    ``<|pad|>``, ``<|bos|>`` and ``<|eos|>``; encoding with special tokens prepends
    ``<|bos|>`` (llama.cpp's ``add_bos_token``). The same texts and size always give
    the same tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    minimum = len(SPECIAL_TOKENS) + 256
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} (3 special tokens + 256 bytes)")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    _check_special_ids(tokenizer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the texts only support {tokenizer.get_vocab_size()} tokens, not {vocab_size}: "
            "give more text or a smaller vocab_size"
        )
    return tokenizer.to_str()


def _check_special_ids(tokenizer) -> None:
    """The trainer puts special tokens first, in order; fail loudly if that ever changes."""
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        actual = tokenizer.token_to_id(token)
        if actual != expected_id:
            raise AssertionError(f"special token {token} got id {actual}, expected {expected_id}")


@dataclass(frozen=True)
class ByteBpeVocab:
    """The parts of a byte-level BPE tokenizer that a GGUF file stores.

    ``tokens[i]`` is the byte-level text of token id ``i``; ``merges`` are
    ``"left right"`` strings in rank order; ``special_ids`` are the control tokens;
    ``user_defined_ids`` are added tokens that are not control tokens (llama.cpp
    matches them in any text, as Hugging Face does non-special added tokens).
    """

    tokens: tuple[str, ...]
    merges: tuple[str, ...]
    special_ids: frozenset[int]
    add_bos: bool
    bos_token_id: int | None
    user_defined_ids: frozenset[int] = frozenset()


def parse_tokenizer_json(tokenizer_json: str) -> ByteBpeVocab:
    """Read the vocabulary, merges and specials out of a byte-level BPE ``tokenizer.json``.

    Raises ``ValueError`` for any other kind of tokenizer (the GGUF writer can only
    describe byte-level BPE with the GPT-2 pre-tokenizer).
    """
    spec = json.loads(tokenizer_json)
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or not _is_byte_level(spec.get("pre_tokenizer")):
        raise ValueError("only byte-level BPE tokenizers (GPT-2 pre-tokenizer) are supported")
    by_id: dict[int, str] = {token_id: token for token, token_id in model["vocab"].items()}
    special_ids, user_defined_ids = set(), set()
    for added in spec.get("added_tokens") or []:
        by_id[added["id"]] = added["content"]
        (special_ids if added.get("special") else user_defined_ids).add(added["id"])
    missing = sorted(set(range(max(by_id) + 1)) - set(by_id))
    if missing:
        raise ValueError(f"tokenizer vocabulary has holes at ids {missing[:5]}")
    tokens = tuple(by_id[i] for i in range(len(by_id)))
    merges = tuple(m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or [])
    bos_token_id = _leading_special_id(spec.get("post_processor"), tokens)
    return ByteBpeVocab(
        tokens=tokens,
        merges=merges,
        special_ids=frozenset(special_ids),
        add_bos=bos_token_id is not None,
        bos_token_id=bos_token_id,
        user_defined_ids=frozenset(user_defined_ids),
    )


def build_tokenizer_json(
    vocab: ByteBpeVocab, pre_tokenizer: dict | None = None, ignore_merges: bool = False
) -> str:
    """Write a ``tokenizer.json`` equivalent to ``vocab`` (the inverse of :func:`parse_tokenizer_json`).

    ``pre_tokenizer`` is a ``tokenizer.json`` pre-tokenizer (default: GPT-2's byte-level
    regex); ``ignore_merges`` makes a word that is itself a token one token, as Llama 3's
    tokenizer does. Needs no ``tokenizers`` install: the JSON is written directly in the
    format ``tokenizers.Tokenizer.from_str`` reads.
    """
    added_tokens = [
        {
            "id": token_id,
            "content": vocab.tokens[token_id],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": token_id in vocab.special_ids,
        }
        for token_id in sorted(vocab.special_ids | vocab.user_defined_ids)
    ]
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens,
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer or GPT2_PRE_TOKENIZER,
        "post_processor": _bos_template(vocab) if vocab.add_bos else None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": ignore_merges,
            "vocab": {token: token_id for token_id, token in enumerate(vocab.tokens)},
            "merges": [merge.split(" ") for merge in vocab.merges],
        },
    }
    return json.dumps(spec, ensure_ascii=False, indent=2)


def _is_byte_level(pre_tokenizer: dict | None) -> bool:
    if not pre_tokenizer:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        parts = pre_tokenizer.get("pretokenizers") or []
        return len(parts) == 1 and _is_byte_level(parts[0])
    return pre_tokenizer.get("type") == "ByteLevel" and pre_tokenizer.get("use_regex", True)


def _leading_special_id(post_processor: dict | None, tokens: Sequence[str]) -> int | None:
    """The id a TemplateProcessing post-processor puts before a single sequence, if any."""
    if not post_processor or post_processor.get("type") != "TemplateProcessing":
        return None
    first = post_processor["single"][0]
    if "SpecialToken" not in first:
        return None
    name = first["SpecialToken"]["id"]
    return post_processor["special_tokens"][name]["ids"][0] if name in tokens else None


def _bos_template(vocab: ByteBpeVocab) -> dict:
    bos = vocab.tokens[vocab.bos_token_id]
    bos_piece = {"SpecialToken": {"id": bos, "type_id": 0}}
    first, second = ({"Sequence": {"id": name, "type_id": 0}} for name in ("A", "B"))
    return {
        "type": "TemplateProcessing",
        "single": [bos_piece, first],
        "pair": [bos_piece, first, bos_piece, second],
        "special_tokens": {bos: {"id": bos, "ids": [vocab.bos_token_id], "tokens": [bos]}},
    }
