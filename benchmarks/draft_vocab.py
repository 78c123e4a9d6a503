"""What a reduced draft vocabulary costs and saves (issue 29): heads project onto the target's V
most frequent tokens (EAGLE-3's draft-to-target map) instead of its whole vocabulary.

    .venv/bin/python benchmarks/draft_vocab.py                       # SmolLM2-135M F16, Spec-Bench
    .venv/bin/python benchmarks/draft_vocab.py --target demo-target --raw

The target decodes each prompt plainly (greedy); the draft vocabulary is chosen as `specrun heads
train` chooses it, the most frequent tokens of the target's own text, here of half the prompts,
and its coverage is measured on the other half's text: a token outside it can never be drafted,
so coverage bounds every depth's acceptance. Beside it, the projection a depth of the heads runs
(a (V, H) float32 matrix times the hidden state, NumPy, as the drafters run it), in milliseconds
and in plain decoding steps of the target (measured in the same run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from _report import SPEC_BENCH, write_report

from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.registry.loading import LoadOptions, open_backend
from specrun.sessions.setup import prompt_token_ids
from specrun.sessions.prompts import CODE_PROMPTS


def spec_bench_questions(per_category: int) -> list[str]:
    by_category: dict[str, list[str]] = {}
    for line in SPEC_BENCH.read_text().splitlines():
        row = json.loads(line)
        texts = by_category.setdefault(row["category"], [])
        if len(texts) < per_category:
            texts.append(row["turns"][0])
    rounds = zip(*by_category.values())  # round robin: both halves hold every category
    return [text for row in rounds for text in row]


def projection_ms(rows: int, size: int, repeats: int = 200) -> float:
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((rows, size), dtype=np.float32)
    hidden = rng.standard_normal(size, dtype=np.float32)
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        (weights @ hidden).argmax()
        samples.append(time.perf_counter() - started)
    return 1e3 * statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-f16")
    parser.add_argument("--per-category", type=int, default=2, help="Spec-Bench questions a category (default 2)")
    parser.add_argument("--raw", action="store_true", help="the built-in code prompts, as typed (a demo model)")
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sizes", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    target = open_backend(args.target, LoadOptions(threads=args.threads))
    texts = list(CODE_PROMPTS) if args.raw else spec_bench_questions(args.per_category)
    engine = SpeculativeEngine(target)
    outputs, seconds = [], []
    for index, text in enumerate(texts):
        ids = prompt_token_ids(target, text, chat=not args.raw)
        result = engine.run(ids, GenerationParams(args.n, 0), complete_cache=False)
        outputs.append(result.token_ids)
        seconds.append(result.stats.generation_seconds / max(result.stats.new_tokens, 1))
        print(f"prompt {index + 1}/{len(texts)}", file=sys.stderr, flush=True)
    vocab, hidden = target.vocab.size, target.hidden_support.size
    plain_ms = 1e3 * statistics.median(seconds)
    train, held = outputs[0::2], outputs[1::2]
    counts = np.zeros(vocab, np.int64)
    for tokens in train:
        np.add.at(counts, np.asarray(tokens, np.int64), 1)
    order = np.argsort(-counts, kind="stable")
    held_tokens = np.concatenate([np.asarray(tokens, np.int64) for tokens in held])
    sizes = sorted({min(int(size), vocab) for size in args.sizes.split(",")} | {vocab})
    full_ms = projection_ms(vocab, hidden)
    print(f"{args.target}: vocabulary {vocab}, hidden {hidden}, plain step {plain_ms:.2f} ms; draft vocabulary "
          f"from {sum(map(len, train))} tokens of {len(train)} prompts, coverage of {len(held_tokens)} held-out tokens")
    print("| draft vocabulary | held-out coverage | projection a depth | in plain steps | against the full |")
    print("|---|---|---|---|---|")
    rows = []
    for size in sizes:
        chosen = np.zeros(vocab, bool)
        chosen[order[:size]] = True
        coverage = float(chosen[held_tokens].mean())
        ms = full_ms if size == vocab else projection_ms(size, hidden)
        rows.append({"size": size, "coverage": coverage, "projection_ms": ms})
        print(f"| {size}{' (all)' if size == vocab else ''} | {100 * coverage:.1f}% | {ms:.3f} ms | "
              f"{ms / plain_ms:.3f} | {ms / full_ms:.2f}x |")
    write_report(args.json, {"args": {k: str(v) for k, v in vars(args).items()}, "plain_ms": plain_ms, "rows": rows})
    target.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
