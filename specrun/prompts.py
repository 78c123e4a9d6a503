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
