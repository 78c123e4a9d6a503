"""Built-in prompts: Python for the demo pair (trained on Python source), instructions for chat models."""

from __future__ import annotations

CODE_PROMPTS = (
    'def read_config(path):\n    """Read a configuration file and return a dict."""\n',
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "import os\nimport sys\n\n\ndef main(argv=None):\n",
    "    def __repr__(self):\n        return",
    "def parse_args(args):\n    parser = argparse.ArgumentParser(",
    "class Error(Exception):\n    \"\"\"Base class for exceptions in this module.\"\"\"\n\n",
    "    for key, value in sorted(items):\n",
    "def _check_arg(name, value):\n    if not isinstance(value, str):\n        raise TypeError(",
    "        try:\n            result = self._call(func, *args)\n        except",
    "def test_basic(self):\n        self.assertEqual(",
)


# `specrun demo` on a chat model: the kinds of work users bring (editing, summarising, answering
# from passages, rewriting, explaining), each sent as one user message in the model's template.
# Written for the demo and kept apart from the bench suites, so no figure is tuned on them.
INSTRUCT_PROMPTS = (
    "Add a docstring to this function and change nothing else.\n\n```python\ndef mean(values):\n"
    "    total = 0\n    for value in values:\n        total += value\n    return total / len(values)\n```",
    "Summarise this note in two sentences.\n\nThe nightly backup failed three times this week because "
    "the disk on the backup server filled up. Old backups are never deleted. We will keep the last "
    "fourteen nightly backups and delete the rest, and an alert will fire when the disk is 80% full.",
    "Answer using only the passage.\n\nPassage: The library opens at nine in the morning on weekdays "
    "and at ten on Saturdays. It is closed on Sundays. Books may be borrowed for three weeks.\n\n"
    "Question: When does the library open on Saturdays, and for how long can books be borrowed?",
    "Rewrite this message so it is polite and short.\n\nyour script broke the build again, the tests "
    "in test_io.py fail because you changed the file format, fix it today",
    "Explain in a short paragraph what a Python list comprehension is, with one example.",
    "Rename the variable x to count in this code and change nothing else.\n\n```python\nx = 0\n"
    "for line in open(\"log.txt\"):\n    if \"error\" in line:\n        x += 1\nprint(x)\n```",
)

HELDOUT_CODE_LINES = 16  # lines kept of each held-out file (specrun/demo/heldout_code.json)


def heldout_code_prompts(count: int, lines: int = 12) -> list[str]:
    """``count`` Python prompts from the standard library's idlelib/, which the demo pair never saw.

    Each prompt is ``lines`` lines from a file's first top-level def or class: real code the models
    must continue. The files' openings are frozen in specrun/demo/heldout_code.json (CPython 3.11.7's,
    55 files, each 16 lines or more) so every Python gives the same prompts (Debian ships idlelib/
    apart, and the files move with the version). Deterministic: files sorted by name.
    """
    import json
    from importlib import resources

    if not 1 <= lines <= HELDOUT_CODE_LINES:
        raise ValueError(f"held-out prompts are 1 to {HELDOUT_CODE_LINES} lines, not {lines}")
    files = json.loads(resources.files("specrun.demo").joinpath("heldout_code.json").read_text(encoding="utf-8"))
    bodies = [entry["lines"] for entry in files["files"] if len(entry["lines"]) >= lines]
    return ["\n".join(body[:lines]) + "\n" for body in bodies[:count]]
