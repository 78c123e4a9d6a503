"""MTP chains and trees at T > 0 keep the target's distribution: the lossless harness's chi-square
against the oracle's exact joint (tests/lossless_harness.py) on 25,000 windows of 8 sampled tokens
each for the chain and for the tree, 50,000 windows in all, beside acceptance against its
expectation. The sweep over every method (test_acceptance.py) runs 1,500 windows of each other
scenario; these two it leaves to this test, whose windows begin with the same seeds
(lossless_harness.SWEPT_LONGER). The two run side by side in two processes (CI's two cores)."""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor

from lossless_harness import DRAFT_LEN, SWEPT_LONGER, run_scenario

RUNS = 25_000


def test_mtp_chains_and_trees_sample_the_target_s_distribution_over_50000_windows():
    names = SWEPT_LONGER
    with ProcessPoolExecutor(max_workers=2) as pool:
        results = dict(zip(names, pool.map(run_scenario, names, [RUNS] * 2)))
    for name, (sampled, problems) in results.items():
        assert problems == [], (name, problems)
        assert 0 < sampled.accepted < sampled.drafted
        assert sampled.verified.deepest >= DRAFT_LEN and sampled.verified.after_full_accept > 0
    assert results["mtp tree"][0].verified.siblings_tested > 0  # siblings tried after a rejection
