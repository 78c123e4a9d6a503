"""What one forward pass costs: per-token decode time and the cost of verifying k tokens.

For each model, interleaved round by round: the median time of a forward over n new
tokens (n = 1, 2, 3, 5, 9) at a context of ``--context`` tokens, as ratios to n = 1.
This is the T_target(k+1) / T_target(1) that decides whether speculation can pay
(docs/design.md), and the target/draft cost ratio the demo pair must exceed.

    .venv/bin/python benchmarks/model_costs.py demo-target demo-draft demo-target-xl --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from specrun.backends.llama import LlamaCppBackend
from specrun.registry.loading import resolve_gguf
from specrun.registry.catalog import load_registry

SIZES = (1, 2, 3, 5, 9)


def time_forward(model: LlamaCppBackend, context: list[int], n: int, repeats: int) -> float:
    """Median seconds of one forward over n tokens appended to ``context``."""
    model.rewind(0)
    model.forward(context, [])
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        model.forward_argmax(context[:n], range(n))
        samples.append(time.perf_counter() - started)
        model.rewind(len(context))
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="aliases or .gguf paths")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    entries = load_registry()
    models = {name: LlamaCppBackend(resolve_gguf(name, entries), n_ctx=1024, n_threads=args.threads) for name in args.models}
    context = [(7 * i) % 200 + 3 for i in range(args.context)]
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in SIZES} for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            for n in SIZES:
                times[name][n].append(time_forward(model, context, n, args.repeats))
    print(f"threads {args.threads}, context {args.context}, medians of {args.rounds} rounds × {args.repeats}")
    print(f"{'model':>18} {'ms/token':>9} " + " ".join(f"{'T(' + str(n) + ')/T(1)':>9}" for n in SIZES[1:]))
    one = {name: statistics.median(times[name][1]) for name in models}
    for name in models:
        ratios = " ".join(f"{statistics.median(times[name][n]) / one[name]:9.2f}" for n in SIZES[1:])
        print(f"{name:>18} {one[name] * 1e3:9.3f} {ratios}")
    names = list(models)
    for other in names[1:]:
        print(f"per-token cost {names[0]} / {other}: {one[names[0]] / one[other]:.2f}×")
    return 0


if __name__ == "__main__":
    sys.exit(main())
