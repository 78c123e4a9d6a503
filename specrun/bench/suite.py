"""Bench prompts: the built-in suite, and Spec-Bench-style JSONL files.

The built-in suite was written for specrun. The demo pair knows only Python, so it leans
towards code, but it covers the kinds of work where speculation behaves differently:
completion, editing code given in the prompt (the answer repeats the input, so prompt
lookup shines), chat, summarisation and question answering over a given text, and
rewriting.

A JSONL file holds one object per line in Spec-Bench's format: ``question_id``,
``category`` and ``turns`` (a list of strings, of which the first is the prompt).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specrun.errors import SpecrunError, UsageError
from specrun.fileio import json_problem, read_limited

UNCATEGORISED = "uncategorised"
MAX_PROMPT_FILE_BYTES = 256 << 20  # Spec-Bench's 480 prompts are 0.5 MB


class PromptFileError(SpecrunError):
    """A prompt file that is missing, unreadable or malformed."""


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt of a suite: where it came from, what kind of work it is, and its text."""

    prompt_id: str
    category: str
    text: str


def _code(source: str) -> str:
    return f"```python\n{source.strip()}\n```"


_EDIT_PARSE = '''
def parse_duration(text):
    units = {"s": 1, "m": 60, "h": 3600}
    total = 0
    for part in text.split():
        number, unit = part[:-1], part[-1]
        total += int(number) * units[unit]
    return total
'''

_EDIT_FILES = '''
import os


def find_large_files(folder, min_size):
    result = []
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and os.path.getsize(path) >= min_size:
            result.append(path)
    result.sort()
    return result
'''

_EDIT_STACK = '''
class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

    def peek(self):
        return self.items[-1]

    def __len__(self):
        return len(self.items)
'''

_EDIT_COUNT = '''
def count_words(lines):
    counts = {}
    for line in lines:
        for word in line.lower().split():
            word = word.strip(".,;:!?")
            if word in counts:
                counts[word] = counts[word] + 1
            else:
                counts[word] = 1
    return counts
'''

_SOURCE_CACHE = (
    "Every time the build server compiles a project, it first asks the cache whether the same "
    "inputs were compiled before. The key is a hash of the source files, the compiler version and "
    "the flags. When the key is found, the server copies the stored objects instead of compiling, "
    "which turns a ten-minute build into a few seconds. The cache is shared by all build machines "
    "and evicts the entries that were used least recently once it reaches its size limit. Two "
    "problems came up in the first month: builds that embedded the current time in their output "
    "never hit the cache, and a compiler upgrade on half of the machines made their keys differ "
    "from the other half. Both were fixed by making builds reproducible and pinning the compiler."
)

_SOURCE_RELEASE = (
    "Version 2.4 of the scheduler changes how failed jobs are retried. Until now a failed job was "
    "retried at once, up to three times, which overloaded services that were already struggling. "
    "Retries now wait with exponential backoff: one second, then two, then four, with a random "
    "jitter of up to half the delay so that many jobs failing together do not retry together. The "
    "number of attempts is configurable per job with the new max_attempts setting, and a job that "
    "exhausts its attempts is moved to a dead-letter queue where it can be inspected and replayed. "
    "The old retry_now option still works but is deprecated and will be removed in version 3.0."
)

_SOURCE_MEETING = (
    "The team met to decide whether to move the test suite from the old runner to pytest. Maria "
    "reported that the current suite takes forty minutes and that half of that time is spent "
    "setting up the same database fixtures over and over. Jonas showed a prototype in which "
    "session-scoped fixtures cut the time to twelve minutes. The main worry was the three hundred "
    "tests that rely on a custom assertion helper; Priya offered to write a small plugin that keeps "
    "the helper working. The team agreed to migrate one package per week, starting with the "
    "smallest, and to keep both runners in continuous integration until the migration is complete."
)

_PASSAGES_GIL = (
    "[1] In CPython, the global interpreter lock lets only one thread execute Python bytecode at a "
    "time. Threads still help for programs that wait on the network or on disks, because the lock "
    "is released while a thread waits.\n"
    "[2] The multiprocessing module starts separate interpreter processes, each with its own lock, "
    "so CPU-bound work can use several cores. Data passed between processes must be pickled.\n"
    "[3] Python 3.13 added an experimental build without the global interpreter lock, enabled at "
    "compile time; extension modules must declare that they support it."
)

_PASSAGES_DICT = (
    "[1] Since Python 3.7, dictionaries keep their keys in insertion order as part of the language "
    "definition; in CPython 3.6 this was an implementation detail.\n"
    "[2] A dictionary lookup hashes the key and probes a table of slots; lookups take constant time "
    "on average, but a poor hash function can make many keys collide.\n"
    "[3] Keys must be hashable: numbers, strings and tuples of hashable values can be keys, while "
    "lists and dictionaries cannot, because their contents can change."
)

_PASSAGES_VENV = (
    "[1] A virtual environment is a folder holding its own Python executable and site-packages "
    "directory, created with python -m venv followed by the folder name.\n"
    "[2] Activating an environment puts its bin directory (Scripts on Windows) first on PATH, so "
    "python and pip refer to the environment's copies; running the executable inside the folder "
    "directly has the same effect without activating.\n"
    "[3] Packages installed in one environment are invisible to the others and to the system "
    "Python, which lets projects pin different versions of the same library."
)

_REWRITE_ERROR = (
    "Error: the operation could not be completed because the configuration file which was "
    "specified by the user on the command line does not exist in the location that was given, "
    "and therefore the program is unable to continue and will now exit without saving."
)

_REWRITE_DOCSTRING = (
    "this function takes a list and it returns a new list where all the items that appeared more "
    "than once are only there one time but the order is the same as the order they first came in, "
    "it does not change the list you give it"
)

_REWRITE_NOTE = (
    "hey so the deploy on friday broke the login page because somebody changed the session "
    "timeout to 5 seconds instead of 5 minutes, we rolled it back in like 20 min, nobody lost "
    "data, going forward we're gonna add a test for the timeout and make config changes need review"
)

BUILTIN_SUITE: tuple[BenchPrompt, ...] = (
    BenchPrompt(
        "completion-intervals",
        "code-completion",
        "def merge_intervals(intervals):\n"
        '    """Merge overlapping (start, end) intervals and return them sorted by start.\n\n'
        "    >>> merge_intervals([(5, 8), (1, 3), (2, 4)])\n"
        "    [(1, 4), (5, 8)]\n"
        '    """\n',
    ),
    BenchPrompt(
        "completion-events",
        "code-completion",
        "class EventEmitter:\n"
        '    """Call every handler registered for an event name, in the order they were added."""\n\n'
        "    def __init__(self):\n"
        "        self._handlers = {}\n\n"
        "    def on(self, name, handler):\n",
    ),
    BenchPrompt(
        "completion-tests",
        "code-completion",
        "import unittest\n\n"
        "from shapes import Rectangle\n\n\n"
        "class RectangleTest(unittest.TestCase):\n"
        "    def test_area(self):\n"
        "        self.assertEqual(Rectangle(3, 4).area(), 12)\n\n"
        "    def test_perimeter(self):\n",
    ),
    BenchPrompt(
        "completion-cli",
        "code-completion",
        "import argparse\nimport sys\n\n\n"
        "def build_parser():\n"
        '    parser = argparse.ArgumentParser(description="Copy files that changed since the last run.")\n'
        '    parser.add_argument("source", help="folder to copy from")\n',
    ),
    BenchPrompt(
        "completion-retry",
        "code-completion",
        "import functools\nimport time\n\n\n"
        "def retry(attempts=3, delay=1.0, exceptions=(Exception,)):\n"
        '    """Decorator: call the function again when it raises, waiting ``delay`` seconds."""\n\n'
        "    def decorate(func):\n"
        "        @functools.wraps(func)\n",
    ),
    BenchPrompt(
        "edit-type-hints",
        "code-editing",
        f"Add type hints to this function. Change nothing else.\n\n{_code(_EDIT_PARSE)}\n\n"
        "The function with type hints:\n\n```python\n",
    ),
    BenchPrompt(
        "edit-pathlib",
        "code-editing",
        f"Rewrite this function to use pathlib instead of os.path, keeping its behaviour.\n\n"
        f"{_code(_EDIT_FILES)}\n\nThe function using pathlib:\n\n```python\n",
    ),
    BenchPrompt(
        "edit-errors",
        "code-editing",
        f"Make pop and peek raise IndexError with a clear message when the stack is empty.\n\n"
        f"{_code(_EDIT_STACK)}\n\nThe updated class:\n\n```python\n",
    ),
    BenchPrompt(
        "edit-counter",
        "code-editing",
        f"Simplify this function with collections.Counter and add a docstring.\n\n"
        f"{_code(_EDIT_COUNT)}\n\nThe simplified function:\n\n```python\n",
    ),
    BenchPrompt(
        "chat-generators",
        "chat",
        "User: What is the difference between a list comprehension and a generator expression in "
        "Python, and when should I use each?\n\nAssistant:",
    ),
    BenchPrompt(
        "chat-debugging",
        "chat",
        "User: My script works when I run it from its own folder but fails with FileNotFoundError "
        "when I run it from anywhere else. What is going on and how do I fix it?\n\nAssistant:",
    ),
    BenchPrompt(
        "chat-naming",
        "chat",
        "User: I keep writing functions called process_data and handle_stuff. Can you give me some "
        "advice on naming functions and variables well?\n\nAssistant:",
    ),
    BenchPrompt(
        "summary-cache",
        "summarisation",
        f"Summarise the following text in two sentences.\n\n{_SOURCE_CACHE}\n\nSummary:",
    ),
    BenchPrompt(
        "summary-release",
        "summarisation",
        f"Summarise these release notes for a user of the scheduler.\n\n{_SOURCE_RELEASE}\n\nSummary:",
    ),
    BenchPrompt(
        "summary-meeting",
        "summarisation",
        f"Write the minutes of this meeting as a short list of decisions.\n\n{_SOURCE_MEETING}\n\nDecisions:",
    ),
    BenchPrompt(
        "qa-threads",
        "qa",
        f"Answer the question using only the passages, and cite them by number.\n\n{_PASSAGES_GIL}\n\n"
        "Question: Why can threads speed up a program that downloads many files but not one that "
        "resizes many images, and what can be used instead?\nAnswer:",
    ),
    BenchPrompt(
        "qa-dict",
        "qa",
        f"Answer the question using only the passages, and cite them by number.\n\n{_PASSAGES_DICT}\n\n"
        "Question: Can I use a list as a dictionary key, and will the keys come back in the order "
        "I added them?\nAnswer:",
    ),
    BenchPrompt(
        "qa-venv",
        "qa",
        f"Answer the question using only the passages, and cite them by number.\n\n{_PASSAGES_VENV}\n\n"
        "Question: Do I have to activate a virtual environment to use the packages installed in "
        "it?\nAnswer:",
    ),
    BenchPrompt(
        "rewrite-error",
        "rewriting",
        f"Rewrite this error message so that it is short and says what to do.\n\n{_REWRITE_ERROR}\n\n"
        "Rewritten:",
    ),
    BenchPrompt(
        "rewrite-docstring",
        "rewriting",
        f"Rewrite this description as a proper Python docstring.\n\n{_REWRITE_DOCSTRING}\n\nDocstring:\n",
    ),
    BenchPrompt(
        "rewrite-incident",
        "rewriting",
        f"Rewrite this message as a formal incident report.\n\n{_REWRITE_NOTE}\n\nIncident report:",
    ),
)


def categories(prompts: Sequence[BenchPrompt]) -> list[str]:
    """The categories of ``prompts`` in order of first appearance."""
    return list(dict.fromkeys(p.category for p in prompts))


def select(
    prompts: Sequence[BenchPrompt], wanted: Sequence[str] | None = None, per_category: int | None = None
) -> list[BenchPrompt]:
    """The prompts of the ``wanted`` categories (all when None), at most ``per_category`` of each.

    An unknown category is a usage error that lists the known ones.
    """
    known = categories(prompts)
    unknown = [c for c in wanted or () if c not in known]
    if unknown:
        raise UsageError(f"unknown category {unknown[0]!r}", f"use some of: {', '.join(known)}")
    taken: dict[str, int] = {}
    chosen = []
    for prompt in prompts:
        if wanted and prompt.category not in wanted:
            continue
        if per_category is not None and taken.get(prompt.category, 0) >= per_category:
            continue
        taken[prompt.category] = taken.get(prompt.category, 0) + 1
        chosen.append(prompt)
    return chosen


def load_jsonl(path: Path) -> list[BenchPrompt]:
    """Prompts from a Spec-Bench-style JSONL file; the first turn of each line is its prompt.

    Raises PromptFileError naming the file (and the line) when it cannot be read or a line
    is not an object with a non-empty ``turns`` list of strings.
    """
    fix = "pass an existing JSONL file"
    # a regular file only: a FIFO was read for ever
    data = read_limited(path, MAX_PROMPT_FILE_BYTES, "prompt file", fix, error=PromptFileError)
    try:
        lines = data.decode("utf-8-sig").splitlines()  # a leading BOM (some editors write one) is no text
    except UnicodeDecodeError as exc:
        raise PromptFileError(f"cannot use the prompt file {path}: it is not UTF-8 text (byte {exc.start + 1} "
                              f"is {data[exc.start]:#04x})", "save it as UTF-8 (iconv -t UTF-8)") from None
    prompts = [_parse_line(path, number, line) for number, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise PromptFileError(f"prompt file {path} holds no prompts", "give one JSON object per line")
    return prompts


def _parse_line(path: Path, number: int, line: str) -> BenchPrompt:
    def bad(problem: str) -> PromptFileError:
        return PromptFileError(
            f"{path} line {number}: {problem}",
            'each line must be a JSON object like {"question_id": 1, "category": "qa", "turns": ["…"]}',
        )

    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise bad(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    except (ValueError, RecursionError) as exc:  # a number of thousands of digits; nesting past Python's stack
        raise bad(f"not valid JSON ({json_problem(exc)})") from None
    if not isinstance(record, dict):
        raise bad(f"expected a JSON object, got {type(record).__name__}")
    turns = record.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise bad("'turns' must be a non-empty list of strings")
    if not turns[0].strip():
        raise bad("the first turn is empty")
    category = record.get("category", UNCATEGORISED)
    if not isinstance(category, str) or not category.strip():
        raise bad("'category' must be a non-empty string")
    question_id = record.get("question_id", number)
    if not isinstance(question_id, (str, int)) or isinstance(question_id, bool):
        raise bad("'question_id' must be a string or an integer")
    for key, value in (("turns", turns[0]), ("category", category), ("question_id", str(question_id))):
        try:  # JSON's \ud800 escapes half a surrogate pair alone: no model reads it, no report writes it
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise bad(f"'{key}' holds a lone surrogate (half of a UTF-16 pair) at character {exc.start}") from None
    return BenchPrompt(str(question_id), category.strip(), turns[0])
