"""The bench under a lossy acceptance rule: how far each line's texts stray from the target's own
(agreement with plain decoding, the target's mean log-likelihood per token), checked against the
fake target's own table."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from fake_models import hashed_logits
from specrun.backends.fake import FakeBackend
from specrun.backends.kv import common_prefix_len
from specrun.bench.figures import figures_for, same_output_label
from specrun.cli.app import app
from specrun.engine.loop import GenerationParams
from specrun.engine.passes import Verification
from specrun.sampling import SamplingSettings
from specrun.sessions import compare
from specrun.sessions.compare import Variant, compare_variants, quality_line, text_log_likelihood
from specrun.verify import LossyAcceptance

VOCAB = 40
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8]]
VARIANTS = [Variant("none", "none", 0), Variant("draft", "draft", 4)]
TYPICAL = Verification(acceptance=LossyAcceptance("typical"))


def pair():
    target_table = hashed_logits(VOCAB, 11, spread=2.0)
    noise = hashed_logits(VOCAB, 12, spread=1.5)
    target = FakeBackend(target_table, VOCAB)
    draft = FakeBackend(lambda context: target_table(context) + noise(context), VOCAB)
    return target_table, target, draft


def oracle_log_likelihood(table, prompt, output) -> float:
    """The table's log-softmax summed over the output, one context at a time, in float64."""
    total, context = 0.0, list(prompt)
    for token in output:
        logits = table(tuple(context)).astype(np.float64)
        total += logits[token] - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        context.append(token)
    return total


def compared(verification: Verification, temperature: float = 0.0):
    table, target, draft = pair()
    params = GenerationParams(60, 4, SamplingSettings(temperature, seed=5))
    return table, compare_variants(target, draft, PROMPTS, VARIANTS, params, repeat=2, verification=verification)


def test_lossy_lines_are_scored_against_the_targets_own_text():
    table, comparison = compared(TYPICAL)
    assert comparison.acceptance == "typical (lossy)"
    assert comparison.mismatches == {"none": [], "draft": []}  # a lossy line's differences are by design
    agreed = plain_tokens = 0
    likelihood, tokens = 0.0, 0
    for index, prompt in enumerate(PROMPTS):
        plain = comparison.figures["none"].by_prompt[index][0].token_ids
        for run, quality in zip(comparison.figures["draft"].by_prompt[index], comparison.quality["draft"][index]):
            assert run.stats.acceptance == "typical (lossy)"
            assert quality.agreed == common_prefix_len(plain, run.token_ids)
            assert quality.plain_tokens == len(plain) == 60 and quality.tokens == len(run.token_ids)
            assert quality.log_likelihood == pytest.approx(oracle_log_likelihood(table, prompt, run.token_ids),
                                                           rel=1e-9)
            agreed, plain_tokens = agreed + quality.agreed, plain_tokens + quality.plain_tokens
            likelihood, tokens = likelihood + quality.log_likelihood, tokens + quality.tokens
        baseline = comparison.quality["none"][index][0]
        assert baseline.agreed == baseline.plain_tokens  # plain decoding agrees with itself
    assert comparison.figures["none"].results[0].stats.acceptance == "exact"  # the baseline drafts nothing
    everything = range(len(PROMPTS))
    assert 0.0 < comparison.agreement("draft", everything) == agreed / plain_tokens < 1.0
    assert comparison.mean_log_likelihood("draft", everything) == pytest.approx(likelihood / tokens)
    assert comparison.agreement("none", everything) == 1.0

    figures = figures_for(comparison, "draft", [0])
    assert figures.agreement == comparison.agreement("draft", [0])
    assert figures.log_likelihood == comparison.mean_log_likelihood("draft", [0])
    assert same_output_label(figures, True, False) == f"no: lossy ({100 * figures.agreement:.0f}% agree)"
    line = quality_line(comparison)
    assert line.startswith("acceptance typical (lossy): the texts are not the target's own")
    assert f"draft {comparison.mean_log_likelihood('draft', everything):.3f}" in line


def test_sampled_lossy_lines_have_no_agreement_but_a_likelihood():
    table, comparison = compared(TYPICAL, temperature=1.0)
    everything = range(len(PROMPTS))
    assert comparison.agreement("draft", everything) is None  # no one text is the target's when sampling
    run = comparison.figures["draft"].by_prompt[1][1]
    assert comparison.quality["draft"][1][1].log_likelihood == pytest.approx(
        oracle_log_likelihood(table, PROMPTS[1], run.token_ids), rel=1e-9)
    assert same_output_label(figures_for(comparison, "draft", [1]), False, False) == "no: lossy"


def test_an_exact_comparison_measures_nothing_more():
    _, comparison = compared(Verification())
    assert comparison.acceptance == "exact" and comparison.quality == {}
    assert comparison.agreement("draft", [0]) is None and comparison.mean_log_likelihood("draft", [0]) is None
    assert figures_for(comparison, "draft", [0]).log_likelihood is None
    assert same_output_label(figures_for(comparison, "draft", [0]), True, False) == "yes"


def test_scoring_in_short_passes_over_a_cached_prefix_gives_the_same_sum(monkeypatch):
    table, target, _ = pair()
    output = [5, 9, 1, 1, 30, 2, 7, 7, 8, 3, 0, 39, 4]
    expected = oracle_log_likelihood(table, PROMPTS[1], output)
    monkeypatch.setattr(compare, "SCORE_CHUNK", 4)
    assert text_log_likelihood(target, PROMPTS[1], output) == pytest.approx(expected, rel=1e-9)
    # again, with the prompt and some of the output already cached
    assert text_log_likelihood(target, PROMPTS[1], output) == pytest.approx(expected, rel=1e-9)
    assert text_log_likelihood(target, PROMPTS[1], []) == 0.0


needs_llama = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                 reason="llama-cpp-python is not installed")


@needs_llama
def test_bench_with_a_lossy_rule_labels_its_lines_and_reports_their_quality(tiny_llama, tmp_path):
    path = str(tiny_llama.gguf_path)
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, [
        "bench", "-t", path, "-d", path, "--methods", "none,draft", "--categories", "code-completion",
        "--per-category", "1", "-n", "8", "-k", "2", "--accept", "margin", "--margin", "3", "--verify", "token",
        "--json", str(out),
    ])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    config = doc["config"]
    assert (config["verify"], config["acceptance"]) == ("token", "margin (lossy)")
    assert config["acceptance_settings"]["rule"] == "margin" and config["acceptance_settings"]["factor"] == 3.0
    labels = {run["variant"]: run["stats"]["acceptance"] for run in doc["runs"]}
    assert labels == {"none": "exact", "draft": "margin (lossy)"}
    draft = next(row for row in doc["overall"] if row["variant"] == "draft")
    # the draft is the target: at T = 0 every draft is its argmax, so the text is plain decoding's
    assert draft["agreement"] == 1.0 and draft["mismatches"] == 0
    assert draft["log_likelihood"] < 0.0
    table_row = next(line for line in result.stdout.splitlines() if line.split()[:1] == ["draft"])
    assert "no: lossy (100% agree)" in table_row
    assert "acceptance margin (lossy): the texts are not the target's own" in result.stdout
