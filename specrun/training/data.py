"""What `specrun heads train` learns from: text files, a prompts file, or built-in prompts.

Heads are trained on the target's own tokens. Text files are cut into windows of tokens; prompts
are continued greedily by the target (self-distillation), so the labels are exactly what the
target would say. Without a prompts file a completion model (the demo target, which writes
Python) gets snippets of the Python standard library, idlelib/ left out since the demo and the
benchmarks hold it out (sessions/prompts.py); an instruct model gets requests in its chat
template: questions made from the topics and kinds of request below, and the work users bring
about a passage (summarise it, answer from it, extract from it, translate or rewrite it, edit a
function) with passages from the standard library's docstrings and code, and arithmetic. Each
request is unique: the target continues greedily, so a repeated prompt would add no data.
"""

from __future__ import annotations

import functools
import random
import sysconfig
from pathlib import Path

from specrun.errors import FileAccessError
from specrun.fileio import MiB, read_limited

TEXT_FILE_LIMIT = 16 * MiB
PROMPTS_FILE_LIMIT = 16 * MiB
MAX_TEXT_FILES = 10_000
SNIPPET_LINES = (2, 8)  # a built-in Python prompt is this many lines, from a random line of a file
HELD_OUT_STDLIB = ("idlelib", "test", "tests", "idle_test", "site-packages")

QUESTION_FORMS = (
    "Explain {topic} in simple terms.",
    "What are the most common mistakes people make with {topic}?",
    "Write a short story that involves {topic}.",
    "Give me three practical tips about {topic}.",
    "Summarize the history of {topic} in a paragraph.",
    "What are the pros and cons of {topic}?",
    "Write a short poem about {topic}.",
    "How would you teach {topic} to a ten-year-old?",
    "Write a Python function related to {topic}, with a docstring.",
    "Compare {topic} with something similar and explain the differences.",
)
TOPICS = (
    "photosynthesis", "compound interest", "the water cycle", "machine learning", "baking bread",
    "the French Revolution", "black holes", "recursion", "healthy sleep", "climate change",
    "public speaking", "the immune system", "electric cars", "chess openings", "time management",
    "the stock market", "volcanoes", "learning a new language", "gardening", "the internet",
    "prime numbers", "coffee", "the Roman Empire", "meditation", "renewable energy", "sorting algorithms",
    "job interviews", "the solar system", "vaccines", "writing a resume", "honeybees", "databases",
    "running a marathon", "the printing press", "budgeting", "earthquakes", "music theory",
    "cooking pasta", "cybersecurity", "the human brain",
)
# Work about a passage, the passage a docstring of the standard library (prose) or a function of it
# (code), idlelib/ and the tests left out as for the Python prompts.
PASSAGE_FORMS = (
    "Give a two-sentence summary of the text below.\n\n{passage}",
    "Summarize the following text as a bulleted list of its main points.\n\n{passage}",
    "From the text below alone: what is it about, and does it warn about anything?\n\n{passage}",
    "Extract every technical term from this text and explain each in a few words.\n\n{passage}",
    "Translate this text into French.\n\n{passage}",
    "Translate this text into German.\n\n{passage}",
    "Rewrite this text so a beginner can understand it.\n\n{passage}",
    "Write three questions a student could answer from this text, with their answers.\n\n{passage}",
)
CODE_FORMS = (
    "Explain what this function does.\n\n```python\n{code}```",
    "Add type hints to this function, keeping its body as it is.\n\n```python\n{code}```",
    "Write two unit tests for this function with pytest.\n\n```python\n{code}```",
    "Find a possible bug or edge case in this code and fix it.\n\n```python\n{code}```",
    "Rewrite this function to be shorter, keeping its behaviour.\n\n```python\n{code}```",
)
ARITHMETIC_FORMS = (
    "What is {a} times {b}? Show your working.",
    "A shop sells {a} apples a day for {b} days. How many apples does it sell? Explain step by step.",
    "If a train travels {a} kilometres in {b} hours, what is its average speed? Show the steps.",
    "Solve for x: {a}x + {b} = {c}. Explain each step.",  # c = a k + b: a whole answer
    "A class has {a} students and {b} of them are absent. What percentage is present? Show your working.",
)
PASSAGE_CHARS = (200, 700)  # a docstring shorter is not a passage; a longer one is cut at a paragraph
CODE_LINES = (4, 20)  # a function this many lines long, from its def,
CODE_CHARS = 900  # and no longer: a request keeps its last MAX_PROMPT_TOKENS (training/run.py), its instruction first


def read_text_folder(folder: Path) -> list[str]:
    """Every UTF-8 text file under ``folder`` (sorted by path); files that are not text are skipped.
    FileAccessError when there is no such folder, or nothing in it to learn from."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        problem = "is a file, not a folder" if folder.exists() else "no such folder"
        raise FileAccessError(f"--text {folder}: {problem}", "pass a folder of text files")
    texts = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))[:MAX_TEXT_FILES]:
        try:
            text = read_limited(path, TEXT_FILE_LIMIT, "text file").decode("utf-8")
        except (FileAccessError, UnicodeDecodeError):
            continue  # a binary or unreadable file among the texts
        if text.strip():
            texts.append(text)
    if not texts:
        raise FileAccessError(f"--text {folder} holds no UTF-8 text files", "put text files in it, or pass another folder")
    return texts


def read_prompts_file(path: Path, option: str = "--prompts") -> list[str]:
    """One prompt per non-empty line of ``path`` (given as ``option``, which errors name); "\\n" in
    a line stands for a newline."""
    path = Path(path).expanduser()
    fix = "pass a UTF-8 text file with one prompt per line"
    what = f"{option} file"
    data = read_limited(path, PROMPTS_FILE_LIMIT, what, fix)
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise FileAccessError(f"cannot use the {what} {path}: it is not UTF-8 text", fix) from None
    prompts = [line.replace("\\n", "\n") for line in lines if line.strip()]
    if not prompts:
        raise FileAccessError(f"cannot use the {what} {path}: it holds no prompts", fix)
    return prompts


def builtin_python_prompts(count: int, seed: int) -> list[str]:
    """``count`` snippets of the Python standard library (2-8 lines from a random line of a
    random file), idlelib/ and the tests left out."""
    files = _stdlib_files()
    rng = random.Random(seed)
    prompts: list[str] = []
    while files and len(prompts) < count:
        lines = files[rng.randrange(len(files))].read_text(encoding="utf-8", errors="replace").splitlines()
        size = rng.randint(*SNIPPET_LINES)
        if len(lines) <= size:
            continue
        start = rng.randrange(len(lines) - size)
        snippet = "\n".join(lines[start : start + size]) + "\n"
        if snippet.strip():
            prompts.append(snippet)
    return prompts


def builtin_questions(count: int, seed: int) -> list[str]:
    """``count`` requests for an instruct model, shuffled by ``seed``: every kind of question about
    every topic, a passage or function of the standard library with one kind of work asked about it,
    arithmetic. Unique until they run out (4,000-4,600, by the Python version), then repeated."""
    rng = random.Random(seed)
    questions = [form.format(topic=topic) for topic in TOPICS for form in QUESTION_FORMS]
    passages, functions = _stdlib_passages_and_functions()
    for k, passage in enumerate(dict.fromkeys(passages)):  # a docstring repeated across modules asks once
        questions.append(PASSAGE_FORMS[k % len(PASSAGE_FORMS)].format(passage=passage))
    for k, code in enumerate(dict.fromkeys(functions)):
        questions.append(CODE_FORMS[k % len(CODE_FORMS)].format(code=code))
    numbers = random.Random(0)  # the same sums whatever the order's seed
    for k in range(len(ARITHMETIC_FORMS) * 40):
        a = numbers.randint(3, 999)
        b = numbers.randint(2, min(99, a - 1))  # fewer absent than the class holds
        questions.append(ARITHMETIC_FORMS[k % len(ARITHMETIC_FORMS)].format(a=a, b=b, c=a * numbers.randint(2, 9) + b))
    questions = list(dict.fromkeys(questions))  # two sums alike ask once
    rng.shuffle(questions)
    return [questions[i % len(questions)] for i in range(count)]


def _stdlib_files() -> list[Path]:
    """The standard library's Python files, sorted, the parts held out (``HELD_OUT_STDLIB``) left out."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(path for path in stdlib.rglob("*.py")
                  if not any(part in HELD_OUT_STDLIB for part in path.relative_to(stdlib).parts))


@functools.cache
def _stdlib_passages_and_functions() -> tuple[list[str], list[str]]:
    """Docstrings of the standard library long enough to be passages (cut to whole paragraphs:
    its modules', classes' and their methods', top-level functions'), and its top-level functions
    of a readable length, as written. Read once a process (3-5 s on 2 cores). Which and how many
    follow the Python version (4,300-4,600 requests on 3.11-3.13): a training run records it."""
    import ast

    passages, functions = [], []
    for path in _stdlib_files():
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
            tree = ast.parse(text)
        except (OSError, SyntaxError, ValueError):  # unreadable, or not Python this version parses
            continue
        lines = text.splitlines(keepends=True)
        for node in tree.body:
            length = node.end_lineno - node.lineno + 1 if isinstance(node, ast.FunctionDef) else 0
            if CODE_LINES[0] <= length <= CODE_LINES[1]:
                code = "".join(lines[node.lineno - 1 : node.end_lineno])
                if len(code) <= CODE_CHARS:
                    functions.append(code)
        documented = [tree, *tree.body]
        documented += [node for klass in tree.body if isinstance(klass, ast.ClassDef) for node in klass.body]
        for node in documented:
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < PASSAGE_CHARS[0]:
                continue
            kept = ""
            for paragraph in doc.split("\n\n"):
                if kept and len(kept) + len(paragraph) > PASSAGE_CHARS[1]:
                    break
                kept = f"{kept}\n\n{paragraph}" if kept else paragraph
            if PASSAGE_CHARS[0] <= len(kept) <= PASSAGE_CHARS[1]:
                passages.append(kept)
    return passages, functions


def cut_windows(tokens: list[int], length: int, shortest: int) -> list[list[int]]:
    """``tokens`` cut into windows of ``length``; a last window shorter than ``shortest`` is dropped."""
    windows = [tokens[start : start + length] for start in range(0, len(tokens), length)]
    return [window for window in windows if len(window) >= shortest]


def text_pieces(text: str, chars: int) -> list[str]:
    """``text`` as consecutive pieces of at most ``chars`` characters: runs of whole lines, a
    longer line cut after a space (or anywhere, if it has none in its second half). Linear in the
    text: a long line is cut at a moving start, never copied whole for each piece (a 16 MB line
    took 39 s before training began)."""
    pieces, current = [], ""
    for line in text.splitlines(keepends=True):
        start = 0
        while len(line) - start > chars:
            cut = line.rfind(" ", start + chars // 2, start + chars) + 1 or start + chars
            pieces.extend([current, line[start:cut]] if current else [line[start:cut]])
            current, start = "", cut
        line = line[start:]
        if current and len(current) + len(line) > chars:
            pieces.append(current)
            current = ""
        current += line
    return [*pieces, current] if current else pieces
