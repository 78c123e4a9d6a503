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
text per chunk, then [FILE_SEP] and the file being edited; a model without a file separator gets
each chunk after a plain snippet line. Each part has a share of the context that depends on the
context alone (``fill_prompt``), so the chunks kept stay the same from one keystroke to the next.
"""

from __future__ import annotations

from dataclasses import dataclass

from specrun.errors import SpecrunError
from specrun.fill_tokens import FIM_SPELLINGS, REPO_SPELLINGS, SEPARATOR_SPELLINGS

# The names llama-server writes where its client gives none: plugins' prompts were tuned on them.
REPO_NAME = "myproject"
EDITED_FILE = "filename"
CHUNK_FILE = "tmp"
SNIPPET_LINE = "\n\n--- snippet ---\n\n"  # a chunk's header where the model has no file separator
NO_FIM_FIX = ("use a code model trained for it (Qwen2.5-Coder, StarCoder2, DeepSeek-Coder, CodeGemma, CodeLlama), "
              "or send the prompt without a suffix")


class NoInfillError(SpecrunError):
    """The model holds no fill-in-the-middle tokens."""


class FillTooLongError(SpecrunError):
    """A fill's cursor line and markers leave its answer no room in the context."""


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    repo: int | None = None  # a repository's name follows it (llama-server's repository layout)
    separator: int | None = None  # a file's name and text follow it


def fim_tokens(backend) -> FimTokens | None:
    """The model's fill-in-the-middle tokens, or None where it has none: llama.cpp's finding
    where the backend gives it (``fill_token_ids``: the GGUF's ids first, Codestral's [PREFIX]
    among them), else the families' spellings as llama.cpp finds them (specrun/fill_tokens.py)."""
    declared = getattr(backend, "fill_token_ids", None)
    found = declared() if declared is not None else None
    if found is not None:
        if not {"prefix", "suffix", "middle"} <= found.keys():
            return None
        return FimTokens(found["prefix"], found["suffix"], found["middle"], found.get("repo"), found.get("separator"))
    for spelling in FIM_SPELLINGS:
        ids = [_special_id(backend, text) for text in spelling]
        if None not in ids and len(set(ids)) == 3:
            repo, separator = (_first_special(backend, each) for each in (REPO_SPELLINGS, SEPARATOR_SPELLINGS))
            return FimTokens(*ids, repo, separator)
    return None


def _required(fim: FimTokens | None) -> FimTokens:
    """``fim``, or NoInfillError where the model has no fill-in-the-middle tokens."""
    if fim is None:
        raise NoInfillError("this model has no fill-in-the-middle tokens (such as <|fim_prefix|>), so it cannot "
                            "complete between a prefix and a suffix", NO_FIM_FIX)
    return fim


def _first_special(backend, spellings) -> int | None:
    return next((found for text in spellings if (found := _special_id(backend, text)) is not None), None)


def _special_id(backend, text: str) -> int | None:
    ids = backend.tokenize(text, add_bos=False, special=True)
    return ids[0] if len(ids) == 1 else None


def infill_ids(backend, prefix: str | list[int], suffix: str, fim: FimTokens | None = None) -> list[int]:
    """[BOS] PRE prefix SUF suffix MID for ``backend``'s model (``prefix`` as text or token ids;
    ``fim``: its fim_tokens, where the caller has them); NoInfillError where it has no such tokens."""
    fim = _required(fim or fim_tokens(backend))
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


# The text around the cursor keeps at most LOCAL_SHARE of the context (at most LOCAL_TOKENS,
# llama-server's default batch), three quarters of it for the prefix; the answer keeps an
# ANSWER_SHARE (at most ANSWER_TOKENS); the other files' chunks get the rest. Each share depends on
# the context alone, so from one keystroke to the next (and after a plugin's warm-up, n_predict 0)
# the chunks kept are the same tokens and the cache holds them.
LOCAL_SHARE, LOCAL_TOKENS = 2, 2048
ANSWER_SHARE, ANSWER_TOKENS = 8, 512
# The text of a part kept for tokenizing: at most this many characters per token of its share (a
# token spells a few characters; an editor may send megabytes no context holds).
CHARACTERS_PER_TOKEN = 32


def fill_prompt(backend, fill: Fill, n_ctx: int) -> tuple[list[int], bool]:
    """``fill``'s prompt for ``backend``'s model in a context of ``n_ctx`` tokens, and whether
    anything was cut to fit: the prefix's start and the suffix's end beyond their shares, the
    oldest chunks beyond theirs (whole; the newest alone too long, its start). NoInfillError where
    the model has no FIM tokens; FillTooLongError where the cursor line leaves the answer no room."""
    fim = _required(fim_tokens(backend))
    vocab = backend.vocab

    cut_early = False  # a text cut by its characters before tokenizing

    def tokens(text: str, share: int, last: bool = False) -> list[int]:
        nonlocal cut_early
        cap = max(share, 1) * CHARACTERS_PER_TOKEN
        cut_early |= len(text) > cap
        return backend.tokenize(text[-cap:] if last else text[:cap], add_bos=False) if text else []

    local = min(n_ctx // LOCAL_SHARE, LOCAL_TOKENS)
    answer = min(n_ctx // ANSWER_SHARE, ANSWER_TOKENS)
    head = [vocab.bos_id] if vocab.add_bos and vocab.bos_id is not None else []
    if fim.repo is not None:
        head += [fim.repo, *tokens(REPO_NAME + "\n", local)]
    current = [fim.separator, *tokens(EDITED_FILE + "\n", local)] if fim.separator is not None else []
    middle = tokens(fill.middle, n_ctx, last=True)  # nearest the cursor
    prefix = tokens(fill.prefix, local, last=True)
    suffix = tokens(fill.suffix, local)
    keep_prefix = min(len(prefix), 3 * local // 4)
    keep_suffix = min(len(suffix), max(0, local // 4 - 2 - len(middle)))  # llama-server's shares
    cut = (keep_prefix, keep_suffix) != (len(prefix), len(suffix))
    prefix, suffix = prefix[len(prefix) - keep_prefix:], suffix[:keep_suffix]
    fixed = len(head) + len(current) + 3 + len(prefix) + len(middle) + len(suffix)
    # the chunks' room: the context less the local share and the answer's, less what a long cursor
    # line takes past its share
    room = n_ctx - answer - len(head) - len(current) - 3 - max(local, len(prefix) + len(middle) + len(suffix))
    if fixed >= n_ctx:
        raise FillTooLongError(f"the cursor line and the fill markers take {fixed} tokens of the {n_ctx} the "
                               "context holds", "shorten the cursor line, or raise --ctx")
    kept: list[list[int]] = []  # the chunks kept, newest first
    taken = 0
    for name, text in reversed(fill.extra):  # the newest first, while they fit whole
        header = [fim.separator, *tokens(name + "\n", room)] if fim.separator is not None \
            else tokens(SNIPPET_LINE, room)
        chunk = header + tokens(text, room, last=True)
        if taken + len(chunk) > room:
            cut = True
            if not kept and room > 0:  # the newest alone is too long: its end, as llama-server keeps it
                kept.append(chunk[len(chunk) - room:])
            break
        kept.append(chunk)
        taken += len(chunk)
    extra = [token for chunk in reversed(kept) for token in chunk]
    ids = [*head, *extra, *current, fim.prefix, *prefix, *middle, fim.suffix, *suffix, fim.middle]
    return ids, cut or cut_early
