"""specrun's llama.cpp backend measured side by side (issue 3's benchmark).

Two comparisons, each interleaved per prompt (A B A B …) in one run:
1. specrun ``--method none`` vs llama-cpp-python's own ``Llama.generate`` at
   temperature 0 on the same target: end-to-end time per prompt (prefill + decode)
   for both, since Llama.generate does not separate them; greedy outputs compared
   (flash attention off on both sides, Llama's default, so rounding is identical).
2. specrun ``--method draft`` (and any other --methods) vs ``none``: generation time only
   (prefill excluded), with acceptance and tokens per verify step.

Prompts: held-out Python from the standard library's idlelib/ (never seen in training).

    .venv/bin/python benchmarks/bench_llama.py --target demo-target-xl --draft demo-draft \
        --prompts 20 -n 128 -k 4 --json docs/figures/bench_llama_xl.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

from _report import write_report
from specrun.backends.llama import LlamaCppBackend
from specrun.sessions.compare import compare_methods
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.registry.loading import resolve_gguf
from specrun.sessions.prompts import heldout_code_prompts
from specrun.registry.catalog import load_registry


def time_llama_generate(llm, prompt_ids: list[int], n_new: int) -> tuple[list[int], float]:
    """Greedy decoding with llama-cpp-python's high-level generator; end-to-end seconds."""
    started = time.perf_counter()
    out = []
    for token in llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        out.append(token)
        if len(out) == n_new:
            break
    return out, time.perf_counter() - started


def bench_against_llama_generate(target_path: Path, prompts: list[list[int]], n_new: int, threads: int) -> dict:
    from specrun.native_order import share_cxx_runtime

    share_cxx_runtime()  # as the backend does before importing llama_cpp (specrun/native_order.py)
    from llama_cpp import Llama

    llm = Llama(str(target_path), n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
    # Llama turns flash attention off; so do we here, so that outputs can be compared exactly.
    ours = LlamaCppBackend(target_path, n_ctx=2048, n_threads=threads, flash_attn=False)
    engine = SpeculativeEngine(ours)
    params = GenerationParams(n_new, 0, stop_at_eos=False)
    time_llama_generate(llm, prompts[0], 8)  # warm-up
    engine.run(prompts[0], GenerationParams(8, 0), complete_cache=False)
    rows = []
    for prompt in prompts:
        ref_ids, ref_seconds = time_llama_generate(llm, prompt, n_new)
        engine.target.reset()  # a fresh prefill, as Llama.generate(reset=True) does
        result = engine.run(prompt, params, complete_cache=False)
        our_seconds = result.stats.prefill_seconds + result.stats.generation_seconds
        rows.append(
            {
                "ref_tps": len(ref_ids) / ref_seconds,
                "ours_tps": result.stats.new_tokens / our_seconds,
                "identical": ref_ids == result.token_ids[: len(ref_ids)],
            }
        )
    ours.close()
    return {
        "median_ratio": statistics.median(r["ours_tps"] / r["ref_tps"] for r in rows),
        "median_ref_tps": statistics.median(r["ref_tps"] for r in rows),
        "median_ours_tps": statistics.median(r["ours_tps"] for r in rows),
        "identical_outputs": sum(r["identical"] for r in rows),
        "prompts": len(rows),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="demo-target")
    parser.add_argument("--draft", default="demo-draft")
    parser.add_argument("--methods", default="none,draft")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-reference", action="store_true", help="skip the Llama.generate comparison")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    entries = load_registry()
    target_path, draft_path = resolve_gguf(args.target, entries), resolve_gguf(args.draft, entries)
    target = LlamaCppBackend(target_path, n_ctx=2048, n_threads=args.threads)
    draft = LlamaCppBackend(draft_path, n_ctx=2048, n_threads=args.threads)
    prompts = [target.tokenize(text) for text in heldout_code_prompts(args.prompts)]
    methods = [m for m in args.methods.split(",") if m]
    params = GenerationParams(args.n, args.k, stop_at_eos=False)
    comparison = compare_methods(target, draft, prompts, methods, params)
    target.close()
    draft.close()

    report = {
        "target": str(args.target),
        "draft": str(args.draft),
        "draft_len": args.k,
        "new_tokens": args.n,
        "prompts": len(prompts),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads},
        "methods": {},
    }
    print(f"{args.target} + {args.draft}, k={args.k}, {len(prompts)} prompts × {args.n} tokens, greedy")
    print(f"{'method':>20} {'tok/s':>8} {'median':>8} {'speed-up':>9} {'accepted':>9} {'tok/step':>9} mismatches")
    for method, figures in comparison.figures.items():
        mismatches = comparison.mismatches[method]
        report["methods"][method] = {
            "tokens_per_second": figures.tokens_per_second,
            "median_tokens_per_second": figures.median_tokens_per_second,
            "speedup": comparison.speedup(method),
            "acceptance_rate": figures.acceptance_rate,
            "mean_tokens_per_step": figures.mean_tokens_per_step,
            "mismatches": [m.__dict__ for m in mismatches],
        }
        real = sum(not m.within_rounding for m in mismatches)
        print(
            f"{method:>20} {figures.tokens_per_second:8.1f} {figures.median_tokens_per_second:8.1f} "
            f"{comparison.speedup(method):8.2f}× {100 * figures.acceptance_rate:8.1f}% "
            f"{figures.mean_tokens_per_step:9.2f} {len(mismatches)} ({real} real)"
        )
    if not args.skip_reference:
        reference = bench_against_llama_generate(target_path, prompts, args.n, args.threads)
        report["vs_llama_generate"] = reference
        print(
            f"specrun none vs Llama.generate (end-to-end, median per prompt): {reference['median_ratio']:.3f}× "
            f"({reference['median_ours_tps']:.1f} vs {reference['median_ref_tps']:.1f} tok/s), "
            f"identical outputs {reference['identical_outputs']}/{reference['prompts']}"
        )
    write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
