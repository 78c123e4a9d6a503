"""Grammars the output must follow: JSON schemas, JSON objects, GBNF, Lark and regular expressions,
compiled and enforced by llguidance (docs/design.md, "Constrained decoding").

llguidance is the library llama.cpp, vLLM, SGLang and mlx-lm's ecosystem use for this: it
computes the set of tokens the grammar allows next over the model's own vocabulary (a bit per
token, tens of microseconds a step), rolls back consumed tokens (a rejected draft), and names
the tokens the grammar forces (``forced``: "fast-forward" tokens, free drafts). XGrammar and
outlines-core do the first two as well, but neither rolls back on CPU wheels for every platform
specrun runs on, nor reads GBNF and Lark both; llguidance does all of it from one wheel.

This module knows the library and a vocabulary; which rows a pass masks, and how drafts are
pruned, is the engine's (engine/constrained.py). A backend is read only through the methods of
``backends.base.Backend`` it passes in (``vocab``, ``tokenize``, ``token_bytes``, ``token_text``).
"""

from __future__ import annotations

import functools
import json
import re
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specrun.errors import UsageError

# The kinds of grammar a run may be given, with what each one's text is.
KINDS = {
    "json_schema": "a JSON schema",
    "json_object": "any JSON object",
    "gbnf": "a GBNF grammar (llama.cpp's)",
    "lark": "a Lark grammar (llguidance's)",
    "regex": "a regular expression",
}
# Whitespace a JSON answer may hold between its items: one space, or a line break and some
# indentation (as llama.cpp's schema grammars allow). llguidance's default, any run of whitespace,
# lets a small model fill max_tokens with blank lines and never close the object.
JSON_OPTIONS = {"whitespace_pattern": r"(?:\x20|\n[\x20\x09]{0,20})?"}
# Tokens whose text is none (control tokens, their bytes b"") are named to llguidance with this
# prefix, its mark for special tokens: a grammar matches them only by name, never as text.
SPECIAL_MARK = b"\xff"


# A grammar's text, and a JSON schema, past these sizes is not one a person wrote: llguidance's
# GBNF conversion grows faster than the text (8,000 rules, 236 kB, took 40 s), so a request is
# refused by its size before anything compiles.
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_SCHEMA_CHARS = 512 * 1024
# llguidance compiles a grammar recursively in native code: a chain of 1,000 $refs (75 kB)
# overflowed a thread's 8 MB stack and killed the process (SIGSEGV). Compiling runs on a thread
# of its own with this much stack (5,000 links fit in 512 MB; the text limits keep chains shorter).
COMPILE_STACK_BYTES = 256 * 1024 * 1024


class GrammarError(UsageError):
    """A grammar, schema or pattern that does not compile: the problem and how to fix it."""


def _on_large_stack(function, *args):
    """``function(*args)`` on a thread with COMPILE_STACK_BYTES of stack, its result or its exception."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = function(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread as is
            outcome["error"] = exc

    previous = threading.stack_size(COMPILE_STACK_BYTES)
    try:
        thread = threading.Thread(target=run, name="specrun-grammar-compile", daemon=True)
        thread.start()
    finally:
        threading.stack_size(previous)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


FIXES = {"json_schema": "fix the schema", "json_object": "fix the schema", "regex": "fix the regular expression"}


def _check_unicode(kind: str, text: str) -> None:
    """A GrammarError where ``text`` holds half of a surrogate pair alone (JSON's \\ud800 reads as
    one): llguidance took it, and the text it let through (a property name of a schema, rendered
    into a tool prompt too) was no UTF-8, an internal error or an answer of invalid bytes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise GrammarError(f"{KINDS[kind]} holding a lone surrogate (half of a UTF-16 pair, "
                           f"{text[exc.start]!r}) at character {exc.start}", "write the character whole") from None


def _refused(spec: GrammarSpec, problem: str) -> GrammarError:
    return GrammarError(f"{KINDS[spec.kind]} that cannot be used: {_first_line(_in_gbnf_terms(spec, problem))}",
                        FIXES.get(spec.kind, "fix the grammar"))


_AT_LINE = re.compile(r"at (\d+)\(\d+\): ")
_LARK_RULE = re.compile(r"^([A-Za-z_]\w*)\s*:")
_GBNF_RULE = re.compile(r"^\s*([A-Za-z0-9_-]+)\s*::=", re.MULTILINE)
_SNIPPET_LINE = re.compile(r"^\s*(\d+ \|.*|\^+)\s*$")


def _in_gbnf_terms(spec: GrammarSpec, problem: str) -> str:
    """llguidance's problem with a GBNF grammar it converted to Lark says where in the Lark text
    (``at 9(6):``, then that text's lines), which the user never wrote: said instead as the GBNF
    rule it came from and the line that rule begins on (``in rule num (line 4):``). Lark, a
    problem that names no position, and one no GBNF rule can be found for pass as they are."""
    import llguidance

    at = _AT_LINE.match(problem)
    if spec.kind != "gbnf" or at is None or llguidance.gbnf_to_lark.is_lark_syntax(spec.text):
        return problem
    try:  # as the grammar was converted, on the large stack (a deep grammar recurses)
        lark = _on_large_stack(llguidance.gbnf_to_lark.gbnf_to_lark, _unicode_escapes(spec.text))
    except Exception:  # noqa: BLE001 - it converted once: a second failure is no reason to lose the problem
        return problem
    rule = next((found.group(1) for line in reversed(lark.splitlines()[: int(at.group(1))])
                 if (found := _LARK_RULE.match(line))), None)
    for found in _GBNF_RULE.finditer(spec.text):
        name = found.group(1)
        if rule is not None and _lark_name(name) == rule.lower():
            said = "\n".join(line.strip() for line in problem[at.end():].splitlines()
                             if line.strip() and not _SNIPPET_LINE.match(line))
            line = spec.text.count("\n", 0, found.start(1)) + 1
            return f"in rule {name} (line {line}): {said}"
    return problem


def _lark_name(gbnf_name: str) -> str:
    """A GBNF rule's name as llguidance's converter writes it, lower-cased: root is Lark's start,
    dashes become underscores and camelCase snake_case (``itemList``: ``item_list``)."""
    if gbnf_name == "root":
        return "start"
    return re.sub(r"([a-z])([A-Z])", r"\1_\2", gbnf_name.replace("-", "_")).lower()


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must follow, as the user gave it: ``kind`` (a key of KINDS) and its text
    (empty for json_object)."""

    kind: str
    text: str = ""
    # A reasoning model's thinking before what the grammar holds: (opening tag, closing tag,
    # opened) as llguidance items (a tag's text quoted, a control token as <[id]>); ``opened``:
    # the prompt opened the block (else the answer may open one first); then, where the answer's
    # message has a header before it (gpt-oss's final channel), the header's items ("": none).
    # None: no thinking.
    thought: tuple[str, str, bool] | tuple[str, str, bool, str] | None = None
    # The grammar writes its message's header itself (gpt-oss's tool calls): none is put before it.
    headed: bool = False

    def llguidance_grammar(self) -> str:
        """The spec as llguidance's grammar, or GrammarError naming the problem."""
        grammar = self._own_grammar()
        return grammar if self.thought is None else _after_thought(grammar, *self.thought)

    def _own_grammar(self) -> str:
        import llguidance

        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}", f"use one of {', '.join(KINDS)}")
        limit = MAX_SCHEMA_CHARS if self.kind == "json_schema" else MAX_GRAMMAR_CHARS
        if len(self.text) > limit:
            raise GrammarError(f"{KINDS[self.kind]} of {len(self.text):,} characters, more than the {limit:,} taken",
                               "shorten it")
        _check_unicode(self.kind, self.text)
        try:
            if self.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            if self.kind == "json_schema":
                schema = json.loads(self.text)
                if not isinstance(schema, dict):
                    raise GrammarError("the JSON schema is not an object", "give a schema such as {\"type\": \"object\"}")
                _check_unicode(self.kind, json.dumps(schema, ensure_ascii=False))  # its \\ud800 escapes read
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            text = self.text
            if self.kind == "gbnf" and not llguidance.gbnf_to_lark.is_lark_syntax(text):  # Lark passes as it is
                text = _unicode_escapes(text)
            return _on_large_stack(llguidance.grammar_from, self.kind, text)
        except GrammarError:
            raise
        except (ValueError, TypeError, RecursionError) as error:  # json's and llguidance's parse errors
            fix = "fix the schema's JSON" if self.kind == "json_schema" else "fix the grammar's syntax"
            raise GrammarError(f"{KINDS[self.kind]} that does not parse: {_first_line(str(error))}", fix) from None

    def check(self) -> None:
        """Raise GrammarError if the spec does not compile, before any vocabulary is at hand (a
        server checks a request's grammar before it queues)."""
        import llguidance

        problem = _on_large_stack(llguidance.LLMatcher.validate_grammar, self.llguidance_grammar())
        if problem:
            raise _refused(self, problem)


def _after_thought(grammar: str, opening: str, closing: str, opened: bool, header: str = "") -> str:
    """``grammar`` (llguidance's text: Lark, or its JSON of grammars) after a thinking block of
    any text: one the prompt opened, ended by the first closing tag, or (``opened`` false) one
    the answer may open first; whitespace may follow it, then ``header`` (llguidance items: the
    answer's message header, gpt-oss's final channel). The closing tag ends the block's text
    lazily (a suffix: unlike a stop string, llguidance rolls it back when a draft is rejected),
    or, a control token without text, is the item after it."""
    top = json.loads(grammar) if grammar.lstrip().startswith("{") else {"grammars": [{"lark_grammar": grammar}]}
    grammars = [dict(entry) for entry in top["grammars"]]
    answer = grammars[0].get("name") or "answer"
    grammars[0]["name"] = answer
    if closing.startswith("<["):
        thought = f"thought: THOUGHT {closing}\nTHOUGHT: /(?s:.*)/\n"
    else:
        thought = f"thought[suffix={closing}]: /(?s:.*)/\n"
    block = "thought" if opened else f"({opening} thought)?"
    # at most a blank line between (a small model left free wrote whitespace to max_tokens)
    start = f"start: {block} GAP? {header} @{answer}\nGAP: /[ \\t]{{0,4}}(\\r?\\n){{1,2}}/\n{thought}"
    return json.dumps({**top, "grammars": [{"lark_grammar": start}, *grammars]})


def matcher_problem(error: str) -> str:
    """llguidance's error in a line, its name for a dead end said in words."""
    line = _first_line(error)
    if line == "NoExtensionBias":  # nothing but an end of text it does not accept may follow
        return "no token of the model's vocabulary continues it"
    return line


def _first_line(text: str) -> str:
    """llguidance's error in one line: its first, and where that only heads what follows (``regex
    parse error:``, then the text and a caret under it, then the reason), the lines after it too."""
    lines = [line.strip() for line in text.strip().splitlines()]
    if not lines or not lines[0]:
        return "no reason given"
    if lines[0].endswith(":") and len(lines) > 1:
        rest = [line for line in lines[1:] if line and set(line) - set("^~ ")]
        return " ".join([lines[0], "; ".join(rest)])[:300]
    return lines[0][:300]


class Vocabulary:
    """A backend's vocabulary as llguidance reads it: every token's bytes, the end-of-text tokens,
    and the backend's tokenizer for the text a grammar forces. Built once per backend (~0.1 s
    for 50k tokens) and shared by every grammar on it."""

    _built: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, backend) -> None:
        import llguidance

        size = backend.vocab.size
        eos_ids = sorted(backend.vocab.eos_ids)
        tokens = []
        for token in range(size):
            piece = backend.token_bytes(token)
            if not piece:  # a control token (or an id no text maps to): matched by name only
                piece = SPECIAL_MARK + (backend.token_text(token) or f"<{token}>").encode("utf-8", "replace")
            tokens.append(piece)

        class _Tokenizer:  # what llguidance.TokenizerWrapper reads
            eos_token_id = eos_ids[0] if eos_ids else None
            bos_token_id = backend.vocab.bos_id
            special_token_ids = [t for t, piece in enumerate(tokens) if piece.startswith(SPECIAL_MARK)]

            def __init__(self) -> None:
                self.tokens = tokens

            def __call__(self, text: bytes) -> list[int]:
                return backend.tokenize(text.decode("utf-8", "replace"), add_bos=False)

        self.size = size
        self.tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_Tokenizer()), eos_token=eos_ids or None
        )

    @classmethod
    def of(cls, backend) -> "Vocabulary":
        """The backend's vocabulary, built on first use."""
        built = cls._built.get(backend)
        if built is None:
            built = cls._built[backend] = cls(backend)
        return built


class Grammar:
    """A compiled grammar over one vocabulary: compiled once (on a large stack), then a copy of its
    start state for each answer."""

    def __init__(self, spec: GrammarSpec, vocabulary: Vocabulary) -> None:
        import llguidance

        self.spec = spec
        self.vocabulary = vocabulary
        self._start = _on_large_stack(
            functools.partial(llguidance.LLMatcher, log_level=0), vocabulary.tokenizer, spec.llguidance_grammar())
        if self._start.is_error():
            raise _refused(spec, self._start.get_error())
        first = self._start.deep_copy()  # some grammars fail only once a mask is asked ({"$ref": "#"})
        first.compute_bitmask()
        if first.is_error():
            raise _refused(spec, f"{matcher_problem(first.get_error())} (at its first token)")

    @classmethod
    def compile(cls, spec: GrammarSpec, backend) -> "Grammar":
        return cls(spec, Vocabulary.of(backend))

    def start(self) -> "GrammarState":
        return GrammarState(self._start.deep_copy(), self.vocabulary.size)


class GrammarState:
    """Where one answer stands in its grammar: the tokens it allows next, what it forces, and
    tokens consumed or rolled back as the answer grows (llguidance's LLMatcher).

    llguidance refuses, rather than raises, past its limits (a row of more alternatives than it
    keeps, say): the matcher then allows nothing and ``error`` says why."""

    def __init__(self, matcher, size: int) -> None:
        self.size = size
        self._matcher = matcher

    @property
    def error(self) -> str:
        """Why the grammar allows nothing more ("" while it works)."""
        return self._matcher.get_error() if self._matcher.is_error() else ""

    @property
    def stopped(self) -> bool:
        """Is the grammar complete (nothing but an end-of-text token may follow)?"""
        return self._matcher.is_stopped()

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows next (size,) bool: none in an error state."""
        if self._matcher.is_error():
            return np.zeros(self.size, dtype=bool)
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        if self._matcher.is_error():  # failed computing it (past a limit): its bits mean nothing
            return np.zeros(self.size, dtype=bool)
        return np.unpackbits(bits, bitorder="little")[: self.size].astype(bool)

    def forced(self) -> list[int]:
        """The tokens the grammar forces from here (its fast-forward tokens): [] where it leaves a choice."""
        if self._matcher.is_error() or self._matcher.is_stopped():
            return []
        return list(self._matcher.compute_ff_tokens())

    def allowed_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, in order from here, the grammar allows."""
        if not tokens or self._matcher.is_error():
            return 0
        return int(self._matcher.validate_tokens([int(t) for t in tokens]))

    def advance(self, tokens: Sequence[int]) -> bool:
        """Consume tokens the answer kept (each allowed: the verifier picked it from a masked row);
        False where the grammar failed on one (``error`` says why). An end-of-text token after a
        complete grammar is the answer's end, not a token to consume."""
        for token in tokens:
            if self._matcher.is_stopped():
                return True
            if not self._matcher.consume_token(int(token)):
                return False
        return True

    def allowed_after(self, tokens: Sequence[int]) -> np.ndarray:
        """The tokens allowed after ``tokens`` (each allowed in turn) from here, (size,) bool; the
        state is left as it was."""
        consumed = 0
        try:
            for token in tokens:
                if self._matcher.is_stopped():  # an end-of-text token after the end: the end again
                    break
                # checked first: a token the matcher refuses leaves it in its error state for good,
                # which no rollback undoes (a drafter's look-ahead would end the answer)
                if self._matcher.validate_tokens([int(token)]) < 1 or not self._matcher.consume_token(int(token)):
                    raise ValueError(f"token {token} is not allowed here")
                consumed += 1
            return self.allowed()
        finally:
            self.rollback(consumed)

    def rollback(self, count: int) -> None:
        if count:
            self._matcher.rollback(count)

    def allowed_along(self, tokens: Sequence[int]) -> np.ndarray:
        """The allowed tokens at each position along the longest prefix of ``tokens`` whose every
        token its row allows: (k + 1, size) bool, the first row this state's own. The rows decide,
        not ``validate_tokens`` (``allowed_prefix``), which can take a token the mask leaves out:
        a draft cut there (it was a 500). The state is left as it was."""
        rows = [self.allowed()]
        consumed = 0
        try:
            for token in tokens:
                if not rows[-1][token]:
                    break
                if self._matcher.is_stopped():  # an end-of-text token after the end: the end again
                    rows.append(rows[-1])
                    continue
                if not self._matcher.validate_tokens([int(token)]) or not self._matcher.consume_token(int(token)):
                    break
                consumed += 1
                rows.append(self.allowed())
        finally:
            self.rollback(consumed)
        return np.stack(rows)


def mask_logits(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """``logits`` (n, V) with every token a row's grammar forbids at -inf. ``allowed`` is (n, size);
    ids past the vocabulary (padded output rows) are forbidden."""
    logits = np.asarray(logits, dtype=np.float32)
    width = logits.shape[-1]
    if allowed.shape[-1] < width:
        allowed = np.pad(allowed, ((0, 0), (0, width - allowed.shape[-1])))
    return np.where(allowed[:, :width], logits, -np.inf).astype(np.float32)


def mask_row(p_draft: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """A drafter's distribution (V,) restricted to what the grammar allows and renormalised: the
    distribution a draft token was drawn from once it is known to be allowed (engine/constrained.py
    says why verification then needs this row, not the drafter's own)."""
    width = p_draft.shape[-1]
    kept = np.where(np.pad(allowed, (0, max(0, width - allowed.shape[-1])))[:width], p_draft, 0.0)
    return kept / kept.sum()


_GBNF_ESCAPE = re.compile(r"\\(\\|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8})")


def _unicode_escapes(gbnf: str) -> str:
    """llama.cpp's ``\\uXXXX`` and ``\\UXXXXXXXX`` escapes as llguidance's GBNF reader takes them:
    it drops their leading zeros (``"\\u0041"`` became ``"\\u41"``, a lexer error), so an ASCII one
    is written ``\\xNN`` and any other as its character (never special in GBNF); an escaped
    backslash stays as it is."""

    def written(match: re.Match) -> str:
        escape = match.group(1)
        if escape == "\\":
            return match.group(0)
        code = int(escape[1:], 16)
        if code < 0x80:
            return f"\\x{code:02x}"
        if 0xD800 <= code <= 0xDFFF or code > 0x10FFFF:
            return match.group(0)  # no character: llguidance says what is wrong with it
        return chr(code)

    return _GBNF_ESCAPE.sub(written, gbnf)
