"""Read `specrun bench --json` output and print the per-category checks of issues 5 and 9.

Issue 9: ``auto`` within 3% of the best fixed draft length (every fixed-length variant
of the sweep) on every category, and at least 0.97x ``none`` on every category.
Issue 5: ``lookup`` >= 1.5x ``none`` where prompts restate their context, >= 0.97x
where it finds nothing, and ``lookup+draft`` at least the better of ``lookup`` and
``draft`` on a mixed set.

    specrun bench --methods none,draft,lookup+ngram+draft,auto --sweep-draft-len 1..8 \\
        --repeat 2 --json docs/figures/bench_auto_sweep.json
    .venv/bin/python benchmarks/bench_checks.py docs/figures/bench_auto_sweep.json

Speed-ups are the bench's own: per prompt the ratio of medians over repeats, per
category their geometric mean, every variant interleaved with ``none`` per prompt.

"Best fixed" picked after the fact is the luckiest of 16 noisy lines, biased upwards
by its noise. With --repeat 2 or more a cross-validated line is printed too: the best
fixed variant is chosen on one half of the repeats (even-numbered, or odd) and measured on
the other (both ways round), and auto is measured on that same half. With --repeat 3 or
more, auto against the best fixed line gets a 90% interval from the timing noise alone
(each prompt's repeats resampled): how far a category's figure can be trusted.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np

from _report import geometric_mean_interval


def rows_by_variant(rows: list[dict]) -> dict[str, dict]:
    return {row["variant"]: row for row in rows}


def others_label(doc: dict) -> str:
    """What auto is compared with: fixed lengths (a sweep, or -k), or other lines that may
    choose their own lengths (lookup and chains without -k; JSON from session 12 on)."""
    adaptive = [v for v in doc["config"]["variants"] if v.get("adaptive") and v["name"] not in ("none", "auto")]
    return "best other line" if adaptive else "best fixed"


def auto_table(doc: dict) -> list[str]:
    best_of = others_label(doc)
    lines = [f"| category | auto vs none | {best_of} | its speed-up | auto vs {best_of} | 90% interval over repeats |",
             "|---|---|---|---|---|---|"]
    groups = {**doc["per_category"], "all prompts": doc["overall"]}
    for category, rows in groups.items():
        variants = rows_by_variant(rows)
        if "auto" not in variants:
            return []
        fixed = [r for r in rows if r["method"] not in ("none", "auto")]
        best = max(fixed, key=lambda r: r["speedup"])
        auto = variants["auto"]["speedup"]
        interval = "-"
        if doc["config"]["repeat"] >= 3:
            low, high = interval_over_repeats(doc, category, "auto", best["variant"])
            interval = f"{low:.3f} - {high:.3f}"
        lines.append(
            f"| {category} | {auto:.2f}x | {best['variant']} | {best['speedup']:.2f}x | {auto / best['speedup']:.3f} "
            f"| {interval} |"
        )
    return lines


def run_rates(doc: dict) -> tuple[dict[int, str], dict[tuple[int, str, int], float]]:
    """Each prompt's category, and tokens/s by (prompt, variant, repeat)."""
    category = {p["index"]: p["category"] for p in doc["prompts"]}
    rate = {(r["prompt_index"], r["variant"], r["repeat"]): r["stats"]["tokens_per_second"] for r in doc["runs"]}
    return category, rate


def repeat_speedups(doc: dict) -> dict[tuple[str, str, int], float]:
    """(category, variant, repeat) -> geometric mean over the category's prompts of
    tokens/s relative to none's run of the same prompt and repeat."""
    category, rate = run_rates(doc)
    logs: dict[tuple[str, str, int], list[float]] = {}
    for (index, variant, repeat), value in rate.items():
        base = rate[(index, "none", repeat)]
        for group in (category[index], "all prompts"):
            logs.setdefault((group, variant, repeat), []).append(math.log(value / base))
    return {key: math.exp(statistics.fmean(values)) for key, values in logs.items()}


def repeat_rates(doc: dict, variant: str, group: str) -> np.ndarray:
    """(prompts, repeats): tokens/s of ``variant`` on the prompts of ``group`` (a category, or
    "all prompts"), one column per repeat."""
    category, rate = run_rates(doc)
    indexes = sorted(i for i in category if group in (category[i], "all prompts"))
    return np.array([[rate[(i, variant, r)] for r in range(doc["config"]["repeat"])] for i in indexes])


def interval_over_repeats(doc: dict, group: str, a: str, b: str, samples: int = 2000) -> tuple[float, float]:
    """A 90% interval for the bench's speed-up of ``a`` over ``b`` on ``group``, from its timing
    noise: each prompt's repeats are resampled with replacement (the same repeats for both
    variants, which ran interleaved) and the statistic computed as the bench does: per prompt
    the ratio of medians over repeats (none's median cancels), per group the geometric mean."""
    rates_a, rates_b = repeat_rates(doc, a, group), repeat_rates(doc, b, group)
    prompts, repeats = rates_a.shape
    picks = np.random.default_rng(0).integers(0, repeats, size=(samples, prompts, repeats))
    rows = np.arange(prompts)[None, :, None]
    log_ratio = np.log(np.median(rates_a[rows, picks], axis=2) / np.median(rates_b[rows, picks], axis=2))
    statistic = np.exp(log_ratio.mean(axis=1))  # (samples,)
    low, high = np.quantile(statistic, [0.05, 0.95])
    return float(low), float(high)


def cross_validated_table(doc: dict) -> list[str]:
    """auto against the fixed variant chosen on the other half of the repeats: 2-fold, the
    even-numbered repeats against the odd-numbered ones (with --repeat 2: repeat 0 against
    repeat 1), both folds averaged. A half's speed-up is the geometric mean over its repeats."""
    repeats = doc["config"]["repeat"]
    variants = [v["name"] for v in doc["config"]["variants"]]
    if repeats < 2 or "auto" not in variants:
        return []
    fixed = [v for v in variants if v not in ("none", "auto")]
    speedups = repeat_speedups(doc)
    halves = (range(0, repeats, 2), range(1, repeats, 2))

    def half(category: str, variant: str, repeats_in: range) -> float:
        return math.exp(statistics.fmean(math.log(speedups[(category, variant, r)]) for r in repeats_in))

    names = ["even", "odd"] if repeats > 2 else ["0", "1"]
    lines = [f"| category | chosen on repeats {names[0]} / {names[1]} | auto vs chosen, measured on repeats "
             f"{names[1]} / {names[0]} | mean |", "|---|---|---|---|"]
    for category in [*doc["per_category"], "all prompts"]:
        folds, chosen = [], []
        for pick, measure in ((0, 1), (1, 0)):
            best = max(fixed, key=lambda v: half(category, v, halves[pick]))
            chosen.append(best)
            folds.append(half(category, "auto", halves[measure]) / half(category, best, halves[measure]))
        lines.append(f"| {category} | {chosen[0]} / {chosen[1]} | {folds[0]:.3f} / {folds[1]:.3f} | "
                     f"{statistics.fmean(folds):.3f} |")
    return lines


def chain_table(doc: dict, chain: str = "lookup+draft", parts: tuple[str, ...] = ("lookup", "draft")) -> list[str]:
    """Issue 5: a chain against the better of its parts, per prompt (each prompt's better part
    is picked after the fact, which favours the parts). Per prompt the ratio of medians over
    repeats; per category the geometric mean, and a 90% interval from resampling the prompts."""
    variants = [v["name"] for v in doc["config"]["variants"]]
    if chain not in variants or any(part not in variants for part in parts):
        return []
    category, rate = run_rates(doc)
    repeats = range(doc["config"]["repeat"])
    ratios: dict[str, list[float]] = {}
    for index in sorted(category):
        medians = {v: statistics.median(rate[(index, v, r)] for r in repeats) for v in (chain, *parts)}
        ratio = medians[chain] / max(medians[part] for part in parts)
        for group in (category[index], "all prompts"):
            ratios.setdefault(group, []).append(ratio)
    lines = [f"| category | {chain} / better of {' and '.join(parts)}, geometric mean | 90% interval over prompts |",
             "|---|---|---|"]
    ratios["all prompts"] = ratios.pop("all prompts")  # last, as in the other tables
    for group, values in ratios.items():
        mean, low, high = geometric_mean_interval(values)
        lines.append(f"| {group} | {mean:.3f} | {low:.3f} - {high:.3f} |")
    return lines


def method_table(doc: dict, methods: list[str]) -> list[str]:
    lines = ["| category | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    groups = {**doc["per_category"], "all prompts": doc["overall"]}
    for category, rows in groups.items():
        variants = rows_by_variant(rows)
        cells = [f"{variants[m]['speedup']:.2f}x ({100 * variants[m]['acceptance_rate']:.0f}%)"
                 if m in variants else "-" for m in methods]
        lines.append(f"| {category} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench_json", type=Path)
    args = parser.parse_args(argv)
    doc = json.loads(args.bench_json.read_text())
    variants = [v["name"] for v in doc["config"]["variants"] if v["name"] != "none"]
    config = doc["config"]
    print(f"{config['target']} + {config['draft']}, {len(doc['prompts'])} prompts x {config['max_new_tokens']} "
          f"tokens, repeat {config['repeat']}, {doc['machine']['threads']} thread(s), "
          f"wall {doc['wall_seconds']:.0f} s")
    print("\nspeed-up over none (acceptance):")
    print("\n".join(method_table(doc, variants)))
    table = auto_table(doc)
    if table:
        print(f"\nauto against the {others_label(doc)} (adaptive lines: "
              f"{', '.join(v['name'] for v in config['variants'] if v.get('adaptive')) or 'auto alone'}):")
        print("\n".join(table))
    chain = chain_table(doc)
    if chain:
        print("\nlookup+draft against the better of lookup and draft, per prompt:")
        print("\n".join(chain))
    cross = cross_validated_table(doc)
    if cross:
        print(f"\nauto against the {others_label(doc)} chosen on the other half of the repeats:")
        print("\n".join(cross))
    # within_rounding: what the bench's tables count as near-ties (older files: near_tie only)
    mismatches = [m for m in doc["mismatches"] if not m.get("within_rounding", m["near_tie"])]
    print(f"\noutputs differing from none beyond a near-tie: {len(mismatches)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
