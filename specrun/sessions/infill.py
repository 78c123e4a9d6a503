"""Fill-in-the-middle: the text between a prefix and a suffix, as code models trained for it
write it (an editor's completion at the cursor: /v1/completions with ``suffix``).

A model trained for it holds three special tokens, found here by their spellings (each must
tokenize to one token of the model's own, special text parsed): Qwen2.5-Coder and CodeGemma
write ``<|fim_prefix|>``, StarCoder and StarCoder2 ``<fim_prefix>``, DeepSeek-Coder
``<｜fim▁begin｜>``. The prompt is prefix-suffix-middle (PSM), as each of them was trained on
and llama-server's /infill builds it: [BOS] PRE prefix SUF suffix MID; the model writes the
middle and ends it with its end-of-text token. The text itself is tokenized without parsing
special text, so a prefix quoting ``<|fim_middle|>`` stays text.

An editor's plugin written for llama-server's /infill (llama.vim, llama.vscode) sends more: the
cursor line's start apart from the lines before it, and chunks of other files it has open
(``Fill``). Those go before the prefix in the repository-level layout Qwen2.5-Coder was trained
on (arXiv 2409.12186), as llama-server lays them out: [REPO] name, then [FILE_SEP] file name and
text per chunk, then [FILE_SEP] and the file being edited; a model without those tokens gets each
chunk after a plain snippet line. What does not fit the context is cut (``fill_prompt``): the
oldest chunks first, then the prefix's start and the suffix's end.
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
# (repository name, file separator): Qwen2.5-Coder's and StarCoder2's repository-level tokens
REPO_SPELLINGS = (("<|repo_name|>", "<|file_sep|>"), ("<repo_name>", "<file_sep>"))
# The names llama-server writes where its client gives none: plugins' prompts were tuned on them.
REPO_NAME = "myproject"
EDITED_FILE = "filename"
CHUNK_FILE = "tmp"
SNIPPET_LINE = "\n\n--- snippet ---\n\n"  # a chunk's header where the model has no file separator
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


@dataclass(frozen=True)
class Fill:
    """What an editor's plugin sends to fill at its cursor (llama-server's /infill): the text
    before the cursor line (``prefix``), the cursor line's start (``middle``), the text after the
    cursor (``suffix``) and chunks of other files, oldest first, as (file name, text)."""

    prefix: str
    suffix: str
    middle: str = ""
    extra: tuple[tuple[str, str], ...] = ()


# The text of a part kept for tokenizing: at most this many characters per token of the context
# (a token spells a few characters; an editor may send megabytes of chunks no context holds).
CHARACTERS_PER_TOKEN = 32


def fill_prompt(backend, fill: Fill, budget: int) -> tuple[list[int], bool]:
    """``fill``'s prompt for ``backend``'s model in at most ``budget`` tokens, and whether
    anything was cut to fit: the chunks first (the oldest, from the front), then the prefix's
    start and the suffix's end, the prefix keeping three quarters of what is left where both
    are long (llama-server's ratio). NoInfillError where the model has no FIM tokens;
    ValueError where even the cursor line and the markers do not fit."""
    fim = fim_tokens(backend)
    if fim is None:
        raise NoInfillError("this model has no fill-in-the-middle tokens (such as <|fim_prefix|>), so it cannot "
                            "complete between a prefix and a suffix", NO_FIM_FIX)
    vocab = backend.vocab
    repo = _repo_tokens(backend)
    cap = max(budget, 1) * CHARACTERS_PER_TOKEN
    cut = len(fill.prefix) > cap or len(fill.suffix) > cap

    def tokens(text: str) -> list[int]:
        return backend.tokenize(text, add_bos=False) if text else []

    head = [vocab.bos_id] if vocab.add_bos and vocab.bos_id is not None else []
    if repo is not None:
        head += [repo[0], *tokens(REPO_NAME + "\n")]
    current = [repo[1], *tokens(EDITED_FILE + "\n")] if repo is not None else []
    middle = tokens(fill.middle)
    fixed = len(head) + len(current) + 3 + len(middle)
    if fixed > budget:
        raise ValueError(f"the cursor line and the fill markers take {fixed} tokens, more than the "
                         f"{budget} the context leaves")
    prefix, suffix = tokens(fill.prefix[-cap:]), tokens(fill.suffix[:cap])
    room = budget - fixed
    if len(prefix) + len(suffix) > room:
        cut = True
        keep_suffix = min(len(suffix), max(room - len(prefix), room // 4))
        keep_prefix = room - keep_suffix
        prefix, suffix = prefix[len(prefix) - keep_prefix:] if keep_prefix else [], suffix[:keep_suffix]
    room -= len(prefix) + len(suffix)
    extra: list[int] = []
    for name, text in reversed(fill.extra):  # the newest first, while they fit
        if len(extra) >= room:
            cut = True
            break
        chunk = ([repo[1], *tokens(name + "\n")] if repo is not None else tokens(SNIPPET_LINE)) \
            + tokens(text[-cap:])
        if len(extra) + len(chunk) > room:
            cut = True
            chunk = chunk[len(chunk) - (room - len(extra)):]  # the chunk's end, as llama-server keeps it
        extra[:0] = chunk
    ids = [*head, *extra, *current, fim.prefix, *prefix, *middle, fim.suffix, *suffix, fim.middle]
    return ids, cut


def _repo_tokens(backend) -> tuple[int, int] | None:
    """The model's repository-name and file-separator tokens, or None where it has none."""
    for spelling in REPO_SPELLINGS:
        ids = [_special_id(backend, text) for text in spelling]
        if None not in ids and ids[0] != ids[1]:
            return ids[0], ids[1]
    return None
