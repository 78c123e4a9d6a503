"""What llama.cpp's flash attention costs a pass here: T(1) and T(n)/T(1) with flash attention
automatic (llama.cpp's default, and specrun's) against off, at a short and a long context.

Both contexts hold the same tokens and are timed in turn, round by round (medians); forward
passes go through specrun's llama.cpp backend with an F16 KV cache in both, as the defaults.

    .venv/bin/python benchmarks/flash_costs.py demo-target smollm2-135m-f16 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from specrun.backends.llama import LlamaCppBackend
from specrun.registry.catalog import load_registry
from specrun.registry.loading import resolve_gguf

SIZES = (1, 5, 9)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="aliases or .gguf paths")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", default="200,1800", help="context lengths (default 200,1800)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    entries = load_registry()
    lengths = [int(n) for n in args.contexts.split(",")]
    print(f"threads {args.threads}, medians of {args.rounds} rounds x {args.repeats}")
    for name in args.models:
        path = resolve_gguf(name, entries)
        for length in lengths:
            models = {flash: LlamaCppBackend(path, n_ctx=max(lengths) + 64, n_threads=args.threads, flash_attn=flash)
                      for flash in (None, False)}
            context = [(7 * i) % 200 + 3 for i in range(length)]
            times: dict[bool | None, dict[int, list[float]]] = {flash: {n: [] for n in SIZES} for flash in models}
            for model in models.values():
                model.forward(context, [])
            for _ in range(args.rounds):
                for flash, model in models.items():
                    for n in SIZES:
                        for _ in range(args.repeats):
                            started = time.perf_counter()
                            model.forward_argmax(context[:n], range(n))
                            times[flash][n].append(time.perf_counter() - started)
                            model.rewind(length)
            for flash in models:
                one = statistics.median(times[flash][1])
                ratios = " ".join(f"T({n})/T(1) {statistics.median(times[flash][n]) / one:5.2f}" for n in SIZES[1:])
                label = "auto" if flash is None else "off"
                print(f"{name:>18} context {length:5d} flash {label:4}: T(1) {one * 1e3:7.2f} ms  {ratios}")
            for model in models.values():
                model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
