"""MTP chains and trees at T > 0 keep the target's distribution: the lossless harness's chi-square
against the oracle's exact joint (tests/lossless_harness.py) on 25,000 windows of 8 sampled tokens
each for the chain and for the tree, 50,000 windows in all (the sweep over every method runs
2,000 each), beside acceptance against its expectation. The two run side by side in two
processes (CI's two cores)."""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor

from lossless_harness import DRAFT_LEN, run_scenario

RUNS = 25_000
FIRST_SEED = 100_000  # other windows than the sweep's


def test_mtp_chains_and_trees_sample_the_target_s_distribution_over_50000_windows():
    names = ("mtp", "mtp tree")
    with ProcessPoolExecutor(max_workers=2) as pool:
        results = dict(zip(names, pool.map(run_scenario, names, [RUNS] * 2, [FIRST_SEED] * 2)))
    for name, (sampled, problems) in results.items():
        assert problems == [], (name, problems)
        assert 0 < sampled.accepted < sampled.drafted
        assert sampled.verified.deepest >= DRAFT_LEN
    assert results["mtp tree"][0].verified.siblings_tested > 0  # siblings tried after a rejection
