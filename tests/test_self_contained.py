"""The project carries its own design: no file points at documents or paths outside the checkout.

What specrun is, how its code should read and how it is measured live in docs/ (design.md,
style.md, measuring.md). A clone must be readable on its own, so no file cites documents kept
elsewhere, and no file outside tests/ names a path of the machine it was written on.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()

# The one thing that stays beside the checkout: the Spec-Bench question set (Apache-2.0), the
# benchmarks' default --prompts, named in docs/perf.md's commands; it is never copied in.
SPEC_BENCH = "../shared/data/spec_bench/question.jsonl"

# Documents that used to live outside the repository, by their old names (docs/ has them now).
OUTSIDE_DOCUMENT = re.compile(r"\b(?:DESIGN|STYLE|MEASURE)\.md\b")
# A path into the folder beside the checkout, other than the Spec-Bench prompts.
OUTSIDE_FOLDER = re.compile(r"\.\./shared/(?!data/spec_bench/question\.jsonl)")
# An absolute path of one machine: /work/…, /root/…, /home/NAME, /Users/NAME, /tmp/NAME. The
# slash must start the path (not "runs/work/", not a URL's "host/root/"); ~/.cache is fine.
MACHINE_PATH = re.compile(r"(?<![\w.~/:-])/(?:(?:work|root)/|(?:home|Users|tmp)/[\w.-])")

# Files that are data, not text: model weights and images. (The records of past runs under
# docs/figures are text and checked too: a training report once kept the interpreter's path.)
DATA_SUFFIXES = (".gguf", ".safetensors", ".npz", ".npy", ".png", ".jpg", ".svg", ".pdf")


def project_files() -> list[str]:
    """Tracked files, and new ones git would track (not ignored), that exist in the tree."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout.decode().split("\0")
    return sorted({name for name in listed if name and (ROOT / name).is_file()})


def text_of(name: str) -> str | None:
    """The file's text, or None for data and binary files."""
    if name == THIS or name.endswith(DATA_SUFFIXES):
        return None
    raw = (ROOT / name).read_bytes()
    if b"\0" in raw[:8192]:
        return None
    return raw.decode("utf-8", errors="replace")


def offending_lines(*patterns: re.Pattern, outside_tests: bool = False) -> list[str]:
    """Every line of a project text file that one of ``patterns`` matches, once, as FILE:LINE: text."""
    found = []
    for name in project_files():
        if outside_tests and name.startswith("tests/"):
            continue
        text = text_of(name)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if any(pattern.search(line) for pattern in patterns):
                found.append(f"{name}:{number}: {line.strip()[:160]}")
    return found


def test_no_file_cites_a_document_outside_the_repository():
    found = offending_lines(OUTSIDE_DOCUMENT, OUTSIDE_FOLDER)
    assert not found, (
        "cite docs/design.md, docs/style.md or docs/measuring.md instead "
        f"(only {SPEC_BENCH} may stay outside):\n" + "\n".join(found)
    )


def test_no_file_outside_tests_names_a_path_of_one_machine():
    found = offending_lines(MACHINE_PATH, outside_tests=True)
    assert not found, "paths of one machine (write them relative to the checkout):\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("line", "document", "folder", "machine"),
    [
        ("Method: `/work/shared/MEASURE.md`. In short:", True, False, True),
        ("build them as ../shared/MEASURE.md says", True, True, False),
        ("see ../shared/DESIGN.md and STYLE.md, habit 5", True, True, False),
        ("# the layers of ../shared beside the checkout", False, False, False),
        (f"specrun bench --prompts {SPEC_BENCH} --per-category 10", False, False, False),
        ("docs/design.md, docs/style.md, docs/measuring.md", False, False, False),
        ('"stdlib": "/root/.pyenv/versions/3.11.7/lib/python3.11"', False, False, True),
        ("written to /home/alice/models or /tmp/specrun-run", False, False, True),
        ("$SPECRUN_CACHE, else ~/.cache/specrun; raw output in runs/work/", False, False, False),
        ("https://huggingface.co/root/model and owner/name/FILE.gguf", False, False, False),
    ],
)
def test_the_rules_catch_what_they_are_for(line, document, folder, machine):
    assert bool(OUTSIDE_DOCUMENT.search(line)) is document
    assert bool(OUTSIDE_FOLDER.search(line)) is folder
    assert bool(MACHINE_PATH.search(line)) is machine
