"""Built-in prompts. The demo pair was trained on Python source, so these are Python."""

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


def heldout_code_prompts(count: int, lines: int = 12) -> list[str]:
    """``count`` Python prompts from the standard library's idlelib/, which the demo pair never saw.

    Each prompt is ``lines`` lines from a file's first top-level def or class:
    real code the models must continue. Deterministic: files sorted by name.
    """
    import sysconfig
    from pathlib import Path

    folder = Path(sysconfig.get_paths()["stdlib"]) / "idlelib"
    prompts = []
    for path in sorted(folder.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        body = text.splitlines()
        start = next((i for i, line in enumerate(body) if line.startswith(("def ", "class "))), None)
        if start is None or len(body) < start + lines:
            continue
        prompts.append("\n".join(body[start : start + lines]) + "\n")
        if len(prompts) == count:
            break
    return prompts
