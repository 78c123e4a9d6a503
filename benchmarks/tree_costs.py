"""What a token tree costs a verify pass (issue 28): plain decoding in a chains-only llama.cpp
context against one opened for trees (``tree_paths``: a unified KV cache, one sequence per
path), and passes over chains against trees of the same node count, interleaved by round.

    .venv/bin/python benchmarks/tree_costs.py                      # SmolLM2-135M F16, 1 thread
    .venv/bin/python benchmarks/tree_costs.py --model smollm2-135m --threads 2

Prints milliseconds per pass for each round (medians of ``--passes`` passes; plain decoding as
the mean over 64 one-token passes after a 300-token prompt).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from specrun.backends.kv import sequence_for
from specrun.backends.llama import LlamaCppBackend
from specrun.modelkit.smollm2 import smollm2_gguf
from specrun.tree import TokenTree

SHAPES = ((4, 0), (8, 0), (4, 4), (8, 4))  # (chain drafts, second guesses beside the chain)
PROMPT = list(range(100, 400))
PLAIN_TOKENS = 64


def shape_tree(n_chain: int, n_second: int) -> TokenTree:
    """A chain of ``n_chain`` with ``n_second`` second guesses beside its first nodes."""
    return TokenTree((*range(600, 600 + n_chain), *range(700, 700 + n_second)),
                     (*range(-1, n_chain - 1), *range(-1, n_second - 1)))


def plain_ms(sequence) -> tuple[float, int]:
    sequence.rewind(0)
    sequence.feed(PROMPT, [len(PROMPT) - 1])
    token, started = 500, time.perf_counter()
    for _ in range(PLAIN_TOKENS):
        token = int(sequence.feed_argmax([token], [0])[0])
    return 1e3 * (time.perf_counter() - started) / PLAIN_TOKENS, token


def pass_ms(sequence, tree: TokenTree, token: int, passes: int) -> float:
    times = []
    for _ in range(passes):
        sequence.rewind(len(PROMPT) + PLAIN_TOKENS)
        started = time.perf_counter()
        if tree.is_chain:
            sequence.feed_argmax([token, *tree.tokens], range(len(tree) + 1))
        else:
            sequence.feed_tree_argmax([token], tree, tree.logit_rows(1))
        times.append(time.perf_counter() - started)
        if not tree.is_chain:
            sequence.keep_path(tree, ())
    return 1e3 * float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-f16", help="a SmolLM2 builtin (default: the F16 copy)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--tree-paths", type=int, default=5)
    args = parser.parse_args()
    path = smollm2_gguf(args.model)
    contexts = {paths: LlamaCppBackend(path, n_ctx=1024, n_threads=args.threads, tree_paths=paths)
                for paths in (0, args.tree_paths)}
    plain: dict[int, list[float]] = {paths: [] for paths in contexts}
    shapes: dict[tuple[int, int], list[float]] = {shape: [] for shape in SHAPES}
    for _ in range(args.rounds):
        for paths, backend in contexts.items():
            sequence = sequence_for(backend)
            ms, token = plain_ms(sequence)
            plain[paths].append(ms)
            if paths:
                for shape in SHAPES:
                    shapes[shape].append(pass_ms(sequence, shape_tree(*shape), token, args.passes))
    print(f"{path.name}, {args.threads} thread(s), {args.rounds} rounds; ms per pass")
    for paths, values in plain.items():
        print(f"plain decoding, tree_paths={paths}: " + ", ".join(f"{v:.2f}" for v in values))
    for (n_chain, n_second), values in shapes.items():
        print(f"chain {n_chain} + {n_second} second guesses ({1 + n_chain + n_second} tokens): "
              + ", ".join(f"{v:.2f}" for v in values))


if __name__ == "__main__":
    main()
