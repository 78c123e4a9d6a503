"""`specrun bench` and `specrun demo` print a line for every output that differs from plain
decoding, and none when every output matches."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from specrun.cli.app import app
from specrun.engine.loop import SpeculativeEngine

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

DOCTORED_AT = 1
DIFFERS = "differs from plain decoding at token"


class DoctoredEngine(SpeculativeEngine):
    """Prompt lookup's output with one token changed: a difference the bench must find."""

    def run(self, prompt, params, **kwargs):
        result = super().run(prompt, params, **kwargs)
        if self.method != "lookup" or len(result.token_ids) <= DOCTORED_AT:
            return result
        ids = list(result.token_ids)
        ids[DOCTORED_AT] = (ids[DOCTORED_AT] + 1) % self.target.backend.vocab.size
        return dataclasses.replace(result, token_ids=ids)


def bench(tiny_llama, tmp_path, *extra: str):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, [
        "bench", "-t", str(tiny_llama.gguf_path), "--methods", "none,lookup", "--categories", "code-completion",
        "--per-category", "1", "-n", "8", "-k", "2", "--json", str(out), *extra,
    ])
    assert result.exit_code == 0, result.output
    return result.stdout, json.loads(out.read_text())


def test_bench_prints_nothing_when_every_output_matches(tiny_llama, tmp_path):
    stdout, doc = bench(tiny_llama, tmp_path)
    assert DIFFERS not in stdout
    assert doc["mismatches"] == []


def test_bench_locates_a_difference_and_judges_it(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setattr("specrun.sessions.compare.SpeculativeEngine", DoctoredEngine)
    stdout, doc = bench(tiny_llama, tmp_path)
    [found] = doc["mismatches"]
    assert found["variant"] == "lookup" and found["position"] == DOCTORED_AT
    assert found["other_token"] == (found["plain_token"] + 1) % tiny_llama.config.vocab_size
    assert found["defect"] == (not found["within_rounding"])
    assert found["verdict"] == ("DEFECT" if found["defect"] else "near-tie")
    [line] = [line for line in stdout.splitlines() if DIFFERS in line]
    assert line.startswith(f"lookup on {found['prompt_id']}: differs from plain decoding at token {DOCTORED_AT}:")
    plain, other = (f"{found[side + '_text']!r} (#{found[side + '_token']})" for side in ("plain", "other"))
    assert f"plain {plain} vs {other}" in line
    assert f"logit gap {found['token_gap']:.3g}" in line and f": {found['verdict']}" in line
    lookup_row = next(row for row in doc["overall"] if row["variant"] == "lookup")
    assert (lookup_row["mismatches"], lookup_row["near_ties"]) == (int(found["defect"]), int(not found["defect"]))


def test_under_exact_any_difference_is_a_defect(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setattr("specrun.sessions.compare.SpeculativeEngine", DoctoredEngine)
    stdout, doc = bench(tiny_llama, tmp_path, "--exact")
    [found] = doc["mismatches"]
    assert found["defect"] and found["verdict"] == "DEFECT"
    [line] = [line for line in stdout.splitlines() if DIFFERS in line]
    assert ": DEFECT" in line
    assert next(row for row in doc["overall"] if row["variant"] == "lookup")["mismatches"] == 1
    table_row = next(line for line in stdout.splitlines() if line.split()[:1] == ["lookup"])
    assert "NO: 1 prompt" in table_row


def test_demo_prints_a_line_only_for_a_differing_output(tiny_llama, monkeypatch):
    path = str(tiny_llama.gguf_path)
    args = ["demo", "-t", path, "-d", path, "--methods", "none,lookup", "--prompts", "2", "-n", "8", "-k", "2"]
    equal = CliRunner().invoke(app, args)
    assert equal.exit_code == 0, equal.output
    assert DIFFERS not in equal.stdout

    monkeypatch.setattr("specrun.sessions.compare.SpeculativeEngine", DoctoredEngine)
    doctored = CliRunner().invoke(app, args)
    assert doctored.exit_code == 0, doctored.output
    lines = [line for line in doctored.stdout.splitlines() if DIFFERS in line]
    assert [line.split(":")[0] for line in lines] == ["lookup on prompt 1", "lookup on prompt 2"]
    assert all(line.endswith(("near-tie", "DEFECT (the target had a clear choice)")) for line in lines)


def test_demo_exact_loads_the_pair_as_exact_and_still_locates_a_difference(tiny_llama, monkeypatch):
    import specrun.registry.loading

    opened = []
    load = specrun.registry.loading._load
    monkeypatch.setattr(specrun.registry.loading, "_load",
                        lambda kind, path, options: opened.append(options) or load(kind, path, options))
    path = str(tiny_llama.gguf_path)
    args = ["demo", "-t", path, "-d", path, "--methods", "none,lookup", "--prompts", "1", "-n", "8", "-k", "2"]
    monkeypatch.setattr("specrun.sessions.compare.SpeculativeEngine", DoctoredEngine)
    doctored = CliRunner().invoke(app, [*args, "--exact"])
    assert doctored.exit_code == 0, doctored.output
    assert opened and all(options.exact for options in opened)
    lines = [line for line in doctored.stdout.splitlines() if DIFFERS in line]
    assert len(lines) == 1 and lines[0].endswith("DEFECT (the target had a clear choice)")
