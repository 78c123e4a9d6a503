"""Issue 32, item 7: a tuned.json (or learned.json) of the wrong shape names the file and the fix."""

from __future__ import annotations

import json

import pytest

from cli_checks import assert_one_line_error, invoke
from specrun.errors import SpecrunError
from specrun.sessions import tuning

KEY = "pair-a"
GOOD = {
    "key": KEY, "target": "t.gguf", "draft": "d.gguf", "machine": "m", "best_draft_len": 3, "speedup": 1.4,
    "tokens_per_second": {"none": 10.0, "draft k=3": 14.0}, "target_costs": {"1": 0.01, "4": 0.012},
    "acceptance": 0.7, "best_min_prob": 0.3, "draft_costs": {"3": 0.004}, "first_acceptance": 0.8,
    "learned": False, "draft_off_gap": 0,
}


def write(path, document) -> None:
    path.write_text(document if isinstance(document, str) else json.dumps(document))


def entry_with(**changes) -> dict:
    return {"version": 2, "pairs": {KEY: {**GOOD, **changes}}}


def test_a_good_file_loads(tmp_path):
    path = tmp_path / "tuned.json"
    write(path, entry_with())
    loaded = tuning.load(KEY, path)
    assert loaded.best_draft_len == 3 and loaded.target_costs == {1: 0.01, 4: 0.012}
    assert loaded.acceptance_by_position == {}  # files from before it was kept
    write(path, entry_with(acceptance_by_position={"1": 0.97, "2": 0.0}))
    assert tuning.load(KEY, path).acceptance_by_position == {1: 0.97, 2: 0.0}


WRONG_SHAPES = {
    "pairs is a list": {"version": 2, "pairs": []},
    "an entry is a list": {"version": 2, "pairs": {KEY: [1, 2]}},
    "costs are a list": entry_with(target_costs=[1, 2]),
    "cost key is not a number": entry_with(draft_costs={"k": 0.1}),
    "cost is a string": entry_with(target_costs={"1": "fast"}),
    "cost is negative": entry_with(target_costs={"1": -1.0}),
    "cost is zero": entry_with(draft_costs={"3": 0}),
    "cost is astronomical": entry_with(target_costs={"1": 10**400}),
    "draft length is a string": entry_with(best_draft_len="4"),
    "draft length is huge": entry_with(best_draft_len=10**9),
    "probability above one": entry_with(best_min_prob=7),
    "unknown field": entry_with(colour="blue"),
    "missing field": {"version": 2, "pairs": {KEY: {k: v for k, v in GOOD.items() if k != "speedup"}}},
    "rates are a string": entry_with(tokens_per_second="fast"),
    "learned is a number": entry_with(learned=3),
    "not finite": '{"version": 2, "pairs": {"pair-a": {"speedup": NaN}}}',
    "version is a list": {"version": [2], "pairs": {}},
    "acceptance by position above one": entry_with(acceptance_by_position={"1": 0.9, "2": 1.5}),
    "acceptance by position at position 0": entry_with(acceptance_by_position={"0": 0.9}),
    "acceptance by position is a list": entry_with(acceptance_by_position=[0.9, 0.8]),
}


@pytest.mark.parametrize("shape", list(WRONG_SHAPES))
@pytest.mark.parametrize("name", ["tuned.json", "learned.json"])
def test_a_file_of_the_wrong_shape_names_itself_and_the_fix(tmp_path, shape, name):
    path = tmp_path / name
    write(path, WRONG_SHAPES[shape])
    with pytest.raises(SpecrunError) as caught:
        tuning.load(KEY, path)
    assert str(path) in caught.value.one_line()
    assert "delete it" in caught.value.fix


def test_generate_with_a_broken_tuned_file_fails_in_one_line(tiny_llama, tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    path = tmp_path / "specrun" / "tuned.json"
    path.parent.mkdir()
    write(path, {"version": 2, "pairs": []})
    model = str(tiny_llama.gguf_path)
    draft = tmp_path / "draft.gguf"  # another file (the target's own as draft is noted: a second line)
    draft.write_bytes(tiny_llama.gguf_path.read_bytes())
    result = invoke("generate", "def f():", "-t", model, "-d", str(draft), "--backend", "llama", "-n", "4")
    assert_one_line_error(result.exit_code, result.stderr, 1, str(path), "specrun tune")


SAVES_A_PROCESS = 60
SAVER = """
import sys
from specrun.sessions import tuning
path, prefix, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
for i in range(count):
    tuning.save(tuning.TuneResult(f"{prefix}{i}", "t.gguf", "d.gguf", "m", 3, 1.4, {"none": 10.0}), tuning.Path(path))
"""


def test_processes_saving_at_once_keep_each_other_s_entries(tmp_path):
    """learned.json is read, changed and written back by every run: two runs saving at once lost
    entries (250 of 400 kept) until each save held the file's lock."""
    import subprocess
    import sys

    from cli_checks import ROOT

    path = tmp_path / "learned.json"
    savers = [subprocess.Popen([sys.executable, "-c", SAVER, str(path), prefix, str(SAVES_A_PROCESS)],
                               env={"PYTHONPATH": str(ROOT), "PATH": ""}) for prefix in ("a", "b", "c")]
    assert [saver.wait(timeout=120) for saver in savers] == [0, 0, 0]
    assert len(tuning.load_all(path)) == 3 * SAVES_A_PROCESS
