"""Issue 32, items 5 and 11: the demo models derived on first use.

Several first runs at once each derive the same folder; the one that finishes second must
use the first one's result instead of failing with "Directory not empty". A derived file
that was damaged afterwards is derived again, not blamed on a download.
"""

from __future__ import annotations

import threading

import pytest

from cli_checks import invoke
from specrun.modelkit import demo
from specrun.modelkit.demo import derive_once

RUNS_AT_ONCE = 3


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_simultaneous_first_uses_all_get_the_derived_model(tmp_path, kind):
    target = tmp_path / "derived" / ("model-mlx" if kind == "folder" else "model.gguf")
    everyone_writing = threading.Barrier(RUNS_AT_ONCE)

    def write(path):
        everyone_writing.wait(timeout=10)  # all three have seen no target and are deriving
        if kind == "folder":
            path.mkdir()
            (path / "config.json").write_text("{}")
            (path / "model.safetensors").write_bytes(b"weights")
        else:
            path.write_bytes(b"weights")

    results, failures = [], []

    def first_use():
        try:
            results.append(derive_once(target, write))
        except Exception as exc:  # collected: the assertion below names it
            failures.append(exc)

    threads = [threading.Thread(target=first_use) for _ in range(RUNS_AT_ONCE)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert failures == [] and results == [target] * RUNS_AT_ONCE
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no scratch folders left
    if kind == "folder":
        assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]


def test_a_damaged_derived_demo_file_is_derived_again(tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")
    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path / "cache"))
    derived = demo.demo_gguf("demo-target")
    good = derived.read_bytes()
    derived.write_bytes(good[: len(good) // 3])  # cut, as a full disk or a crash elsewhere might
    result = invoke("generate", "def f():", "-t", "demo-target", "-d", "demo-draft", "--backend", "llama",
                    "-n", "4", "-m", "none")
    assert result.exit_code == 0, result.output
    assert derived.read_bytes() == good
