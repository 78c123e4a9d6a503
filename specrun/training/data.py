"""What `specrun heads train` learns from: text files, a prompts file, or built-in prompts.

Heads are trained on the target's own tokens. Text files are cut into windows of tokens; prompts
are continued greedily by the target (self-distillation), so the labels are exactly what the
target would say. Without a prompts file a completion model (the demo target, which writes
Python) gets snippets of the Python standard library, idlelib/ left out since the demo and the
benchmarks hold it out (sessions/prompts.py); an instruct model gets questions in its chat
template, made from the topics and kinds of request below.
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

from specrun.errors import FileAccessError
from specrun.fileio import MiB, read_limited

TEXT_FILE_LIMIT = 16 * MiB
PROMPTS_FILE_LIMIT = 16 * MiB
MAX_TEXT_FILES = 10_000
SNIPPET_LINES = (2, 8)  # a built-in Python prompt is this many lines, from a random line of a file
HELD_OUT_STDLIB = ("idlelib", "test", "site-packages")

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


def read_prompts_file(path: Path) -> list[str]:
    """One prompt per non-empty line of ``path``; "\\n" in a line stands for a newline."""
    path = Path(path).expanduser()
    fix = "pass a UTF-8 text file with one prompt per line"
    data = read_limited(path, PROMPTS_FILE_LIMIT, "prompts file", fix)
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise FileAccessError(f"cannot use the prompts file {path}: it is not UTF-8 text", fix) from None
    prompts = [line.replace("\\n", "\n") for line in lines if line.strip()]
    if not prompts:
        raise FileAccessError(f"cannot use the prompts file {path}: it holds no prompts", fix)
    return prompts


def builtin_python_prompts(count: int, seed: int) -> list[str]:
    """``count`` snippets of the Python standard library (2-8 lines from a random line of a
    random file), idlelib/ and the tests left out."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        path for path in stdlib.rglob("*.py")
        if not any(part in HELD_OUT_STDLIB for part in path.relative_to(stdlib).parts)
    )
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
    """``count`` questions for an instruct model: every kind of request about every topic, shuffled."""
    questions = [form.format(topic=topic) for topic in TOPICS for form in QUESTION_FORMS]
    random.Random(seed).shuffle(questions)
    return [questions[i % len(questions)] for i in range(count)]


def cut_windows(tokens: list[int], length: int, shortest: int) -> list[list[int]]:
    """``tokens`` cut into windows of ``length``; a last window shorter than ``shortest`` is dropped."""
    windows = [tokens[start : start + length] for start in range(0, len(tokens), length)]
    return [window for window in windows if len(window) >= shortest]


def text_pieces(text: str, chars: int) -> list[str]:
    """``text`` as consecutive pieces of at most ``chars`` characters: runs of whole lines, a
    longer line cut after a space (or anywhere, if it has none in its second half)."""
    pieces, current = [], ""
    for line in text.splitlines(keepends=True):
        while len(line) > chars:
            cut = line.rfind(" ", chars // 2, chars) + 1 or chars
            pieces.extend([current, line[:cut]] if current else [line[:cut]])
            current, line = "", line[cut:]
        if current and len(current) + len(line) > chars:
            pieces.append(current)
            current = ""
        current += line
    return [*pieces, current] if current else pieces
