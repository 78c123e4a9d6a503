"""How much of generation time is spent outside the models' forward passes, per method.

In the tiny regime a target pass takes ~3 ms, so bookkeeping per step (the drafters'
indexes, the controller's estimates, the engine's accounting) is a visible share of a
step. This times every llama.cpp decode call (target and draft model alike) while the
engine generates, and reports the share of generation time that is not in one: what the
Python around the models costs. Prefill is excluded on both sides. Methods interleave per
prompt (Spec-Bench prompts through the chat template, as `specrun bench` feeds them).

The share is read within each run, so it is free of the machine's noise between runs;
``none`` (plain decoding) is the floor every method shares (reading logits, picking the
token). Session 5 found ``auto`` at 8.8% against lookup's 4.6% with this, and the
controller's rebuilt cost tables behind most of the difference.

    .venv/bin/python benchmarks/step_overhead.py --categories coding,qa --per-category 10 \\
        --methods none,lookup,lookup+draft,auto --threads 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from _report import SPEC_BENCH, write_report
from specrun.backends.llama import LlamaCppBackend
from specrun.bench.runner import tokenize_prompt
from specrun.bench.suite import load_jsonl, select
from specrun.sessions.compare import forget_learned
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.sessions.setup import ADAPTIVE_MAX_DRAFT_LEN
from specrun.registry.loading import LoadOptions, open_pair
from specrun.drafters.methods import build_drafter, is_adaptive
from specrun.engine.stats import Stats



class DecodeClock:
    """Seconds spent in llama.cpp decode calls, all models together, since the last reset."""

    def __init__(self) -> None:
        self.seconds = 0.0
        original = LlamaCppBackend._decode_chunk
        clock = self

        def timed(backend, *args, **kwargs):
            started = time.perf_counter()
            try:
                return original(backend, *args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - started

        LlamaCppBackend._decode_chunk = timed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="demo-target")
    parser.add_argument("--draft", default="demo-draft")
    parser.add_argument("--prompts", type=Path, default=SPEC_BENCH)
    parser.add_argument("--categories", default="coding,qa")
    parser.add_argument("--per-category", type=int, default=10)
    parser.add_argument("--methods", default="none,lookup,lookup+draft,auto")
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("-k", type=int, default=4, help="draft length of the fixed methods")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    prompts = select(load_jsonl(args.prompts), args.categories.split(","), args.per_category)
    target, draft = open_pair(args.target, args.draft, LoadOptions(threads=args.threads, n_ctx=2048))
    clock = DecodeClock()
    engines = {m: SpeculativeEngine(target, build_drafter(m, draft), method=m) for m in methods}
    params = {
        m: GenerationParams(args.n, ADAPTIVE_MAX_DRAFT_LEN if is_adaptive(m) else args.k, adaptive=is_adaptive(m))
        for m in methods
    }
    in_prefill = [0.0]
    for engine in engines.values():  # decode calls in the prefill are not generation
        original_prefill = engine.passes.prefill

        def prefill(*a, _original=original_prefill, **kw):
            before = clock.seconds
            try:
                return _original(*a, **kw)
            finally:
                in_prefill[0] += clock.seconds - before

        engine.passes.prefill = prefill
    token_prompts = [ids for p in prompts if len(ids := tokenize_prompt(target, p, True)) + args.n <= target.n_ctx]
    for m, engine in engines.items():  # warm-up
        list(engine.steps(token_prompts[0][:32], GenerationParams(8, params[m].draft_len, adaptive=params[m].adaptive), Stats()))
    totals = {m: {"generation_seconds": 0.0, "decode_seconds": 0.0, "tokens": 0, "steps": 0} for m in methods}
    for prompt in token_prompts:
        for m, engine in engines.items():
            forget_learned(engine)
            stats = Stats()
            clock.seconds = in_prefill[0] = 0.0
            for step in engine.steps(prompt, params[m], stats):
                totals[m]["tokens"] += len(step.tokens)
                totals[m]["steps"] += 1
            totals[m]["generation_seconds"] += stats.generation_seconds
            totals[m]["decode_seconds"] += clock.seconds - in_prefill[0]
    print(f"{args.target} + {args.draft}, {len(token_prompts)} prompts × {args.n} tokens, {args.threads} thread(s)")
    print(f"{'method':>14} {'tok/s':>7} {'steps':>6} {'outside passes':>15} {'per step':>9}")
    report = {"target": args.target, "draft": args.draft, "prompts": len(token_prompts), "n": args.n,
              "threads": args.threads, "categories": args.categories, "methods": {}}
    for m, t in totals.items():
        outside = t["generation_seconds"] - t["decode_seconds"]
        share = outside / t["generation_seconds"]
        per_step_us = outside / t["steps"] * 1e6
        report["methods"][m] = {**t, "outside_share": share, "outside_us_per_step": per_step_us}
        print(f"{m:>14} {t['tokens'] / t['generation_seconds']:7.0f} {t['steps']:6d} {100 * share:14.1f}% "
              f"{per_step_us:7.0f}us")
    write_report(args.json, report)
    target.close()
    draft.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
