"""What a rejected draft's rewind costs an MLX model whose cache cannot be cut (issue 50): a
verify pass of ``k + 1`` tokens, a rewind keeping ``kept`` of them, then the next one-token pass
(MLX is lazy: a rollback's work runs with the pass after it), timed against that one-token pass
alone, with the rollback within the pass (backends/mlx_snapshots.py) and with replay from the
checkpoint (``MlxBackend.snapshots`` off). Interleaved rounds, medians.

    .venv/bin/python benchmarks/mlx_rewind_cost.py --target FOLDER [-k 4] [--kept 1,2,3] [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, required=True, help="an MLX folder (a hybrid: Qwen3.5, Qwen3-Next)")
    parser.add_argument("-k", type=int, default=4, help="draft tokens a verify pass checks (it feeds k + 1)")
    parser.add_argument("--kept", default="1,2,3", help="tokens of the verify pass a rewind keeps")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    from specrun.backends.mlx import MlxBackend

    backend = MlxBackend(args.target)
    if not backend.needs_checkpoints:
        parser.error(f"{args.target}'s cache can be cut: nothing to roll back")
    kept_counts = [int(n) for n in args.kept.split(",")]
    prompt = backend.tokenize("The quick brown fox jumps over the lazy dog. " * 4)
    backend.forward(prompt, [len(prompt) - 1])
    start = backend.n_past
    fed = [(11 * i + 5) % 200 + 3 for i in range(args.k + 2)]
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for snapshots in (True, False):  # a pass that keeps what a rollback reads, and one that does not
            backend.snapshots = snapshots
            for name, count in ((f"step {snapshots}", 1), (f"pass {snapshots}", args.k + 1)):
                began = time.perf_counter()
                backend.forward(fed[:count], range(count))
                times.setdefault(name, []).append(time.perf_counter() - began)
                backend.rewind(start)
        for kept in kept_counts:
            for snapshots in (True, False):
                backend.snapshots = snapshots
                backend.forward(fed[: args.k + 1], range(args.k + 1))
                began = time.perf_counter()
                backend.rewind(start + kept)
                backend.forward(fed[kept : kept + 1], [0])
                times.setdefault(f"{'rollback' if snapshots else 'replay'} {kept}", []).append(
                    time.perf_counter() - began)
                backend.rewind(start)
    step = statistics.median(times["step False"])
    print(f"{args.target.name}: one-token pass {step * 1e3:.2f} ms ({statistics.median(times['step True']) * 1e3:.2f} "
          f"keeping); a pass of {args.k + 1} {statistics.median(times['pass False']) / step:.2f} steps "
          f"({statistics.median(times['pass True']) / step:.2f} keeping)")
    for kept in kept_counts:
        line = [f"keep {kept} of {args.k + 1}:"]
        for way in ("rollback", "replay"):
            extra = statistics.median(times[f"{way} {kept}"]) - step
            line.append(f"{way} + next pass {extra * 1e3:+.2f} ms ({extra / step:+.2f} steps)")
        print(" ".join(line))


if __name__ == "__main__":
    main()
