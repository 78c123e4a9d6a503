"""What prompt lookup costs when it finds nothing (issue 5: at least 0.97x plain decoding).

The demo model loops on most prompts, so real prompts always give lookup something to
copy. To measure the no-match path itself, this runs, interleaved per prompt:

1. ``none``          plain decoding through the engine;
2. ``lookup``        the real drafter;
3. ``lookup-miss``   the real drafter doing all of its work every step (reading new
   tokens into its index, trying every n-gram order against it) but whose every match is
   discarded, so it proposes nothing, exactly as on a prompt where nothing repeats;
4. ``none-again``    plain decoding through a second engine: the A/A control. Its ratio to
   ``none`` is the measurement's own noise and bias; read lookup-miss against it.

The order of the lines rotates from prompt to prompt, so each runs first, second, ...
equally often when --prompts is a multiple of 4.

Machine noise between two plain runs is about ±3% here, as large as the effect looked
for, so a second reading comes from inside each run: every step's time splits into the
target's pass (Stats.verify_seconds), which for lookup-miss is the same one-token pass as
plain decoding's, and everything else (asking the drafter, the engine's handling of its
answer, the controllers' and the gate's bookkeeping after the pass). The share of
generation time outside the passes, against plain decoding's, is what the no-match path
costs: ``implied ratio`` = (1 - share) / (1 - share of none) (meaningful only for lines
that verify no drafts: lookup-miss and none-again). Until session 15 the bookkeeping after
the pass was counted into the pass, and this reading missed it.

    .venv/bin/python benchmarks/lookup_no_match.py --target demo-target --prompts 20 -n 128 --threads 2

Without -k lookup runs as `specrun generate` runs it: its length chosen each step, gated.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

from _report import geometric_mean_interval, write_report
from specrun.backends.llama import LlamaCppBackend
from specrun.drafters.lookup import PromptLookupDrafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.sessions.setup import ADAPTIVE_MAX_DRAFT_LEN
from specrun.registry.loading import resolve_gguf
from specrun.sessions.prompts import heldout_code_prompts
from specrun.registry.catalog import load_registry


class MissingLookup(PromptLookupDrafter):
    """Prompt lookup that does every step's work and then finds nothing."""

    name = "lookup-miss"

    def _match(self):
        super()._match()  # the same index probes as a real step
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="demo-target")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("-k", type=int, help="a fixed draft length (default: as generate runs lookup, adaptive)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    target = LlamaCppBackend(resolve_gguf(args.target, load_registry()), n_ctx=2048, n_threads=args.threads)
    engines = {
        "none": SpeculativeEngine(target),
        "lookup": SpeculativeEngine(target, PromptLookupDrafter()),
        "lookup-miss": SpeculativeEngine(target, MissingLookup()),
        "none-again": SpeculativeEngine(target),
    }
    draft_len = args.k or ADAPTIVE_MAX_DRAFT_LEN
    params = GenerationParams(args.n, draft_len, stop_at_eos=False, adaptive=args.k is None)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    drafted: dict[str, int] = {name: 0 for name in engines}
    in_passes: dict[str, float] = {name: 0.0 for name in engines}  # seconds inside the target's passes
    generating: dict[str, float] = {name: 0.0 for name in engines}
    prompts = [target.tokenize(text) for text in heldout_code_prompts(args.prompts)]
    for engine in engines.values():  # warm-up
        engine.run(prompts[0][: len(prompts[0]) // 2], dataclasses.replace(params, max_new_tokens=16), complete_cache=False)
    for index, prompt in enumerate(prompts):
        names = list(engines)
        order = names[index % len(names):] + names[: index % len(names)]
        for name in order:
            result = engines[name].run(prompt, params, complete_cache=False)
            rates[name].append(result.stats.tokens_per_second)
            drafted[name] += result.stats.drafted
            in_passes[name] += result.stats.verify_seconds
            generating[name] += result.stats.generation_seconds
    length = f"k={args.k}" if args.k else f"adaptive up to {draft_len}"
    report = {"target": args.target, "threads": args.threads, "prompts": args.prompts, "n": args.n, "k": args.k,
              "lines": {}}
    print(f"{args.target}, {args.prompts} prompts × {args.n} tokens, {length}, {args.threads} thread(s), greedy")
    print(f"{'line':>12} {'median tok/s':>13} {'vs none: median of per-prompt ratios':>37} "
          f"{'quartiles':>14} {'total-time ratio':>17} {'drafted':>8} {'outside-pass share':>19} {'implied ratio':>14}")
    share = {name: 1 - in_passes[name] / generating[name] for name in engines}
    for name, values in rates.items():
        ratios = sorted(value / base for value, base in zip(values, rates["none"]))
        ratio = statistics.median(ratios)
        low, _, high = statistics.quantiles(ratios, n=4)
        # tokens are the same per prompt, so summed 1/rate is total time
        overall = sum(1 / v for v in rates["none"]) / sum(1 / v for v in values)
        report["lines"][name] = {"median_tps": statistics.median(values), "ratio_vs_none": ratio,
                                 "ratio_quartiles": [low, high], "total_time_ratio": overall,
                                 "drafted": drafted[name], "outside_pass_share": share[name],
                                 "implied_ratio": (1 - share[name]) / (1 - share["none"]), "per_prompt": values}
        print(f"{name:>12} {statistics.median(values):13.1f} {ratio:36.3f}× {low:6.3f}-{high:.3f}× "
              f"{overall:16.3f}× {drafted[name]:8d} {100 * share[name]:18.2f}% "
              f"{report['lines'][name]['implied_ratio']:13.3f}×")
    print("geometric mean of per-prompt ratios vs none, 90% bootstrap interval over prompts:")
    for name in ("lookup-miss", "none-again"):
        ratios = [value / base for value, base in zip(rates[name], rates["none"])]
        mean, low, high = geometric_mean_interval(ratios)
        report["lines"][name]["geomean_ratio"] = [mean, low, high]
        print(f"{name:>12} {mean:.3f}× ({low:.3f}-{high:.3f})")
    write_report(args.json, report)
    return 0



if __name__ == "__main__":
    sys.exit(main())
