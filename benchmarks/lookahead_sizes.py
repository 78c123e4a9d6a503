"""Tokens a verify pass yields for each lookahead size on the ladder (issue 30): the acceptance
side of ``specrun.drafters.lookahead.LADDER``, which the pass costs measured on a machine then
weigh (``specrun.control.forecasts``: ``TOKENS_PER_PASS``, ``choose_sizes``).

    .venv/bin/python benchmarks/lookahead_sizes.py --per-category 1 -n 96

SmolLM2-135M-Instruct (F16) on llama.cpp, Spec-Bench's first turns in its chat template, greedy,
every size at a fixed depth of 16 with a fresh window and pool per prompt (a fresh process's),
one thread. Tokens per pass is a property of the text and the window, not of the machine: the
figure printed is the mean over prompts of new tokens / verify passes, for each size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from _llama_tools import spec_bench
from _report import SPEC_BENCH
from specrun.backends.llama import LlamaCppBackend
from specrun.drafters.lookahead import LADDER, LookaheadDrafter, LookaheadSizes
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.modelkit.smollm2 import smollm2_gguf
from specrun.sessions.templates import render_user_prompt


def tokens_per_pass(target, prompt_ids: list[int], sizes: LookaheadSizes, n: int, depth: int) -> tuple[float, list[int]]:
    engine = SpeculativeEngine(target, LookaheadDrafter(sizes), method="lookahead")
    params = GenerationParams(n, depth, adaptive=False, tree_nodes=sizes.max_nodes)
    result = engine.run(prompt_ids, params, complete_cache=False)
    return result.stats.mean_tokens_per_step, result.token_ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=Path, default=SPEC_BENCH)
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("-n", type=int, default=96, help="new tokens a prompt (default 96)")
    parser.add_argument("--depth", type=int, default=16, help="the deepest node verified (-k, default 16)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the per-prompt figures here (runs/…)")
    args = parser.parse_args(argv)
    prompts = spec_bench(args.questions, args.per_category)
    widest = max(sizes.window + sizes.candidates for sizes in LADDER)
    target = LlamaCppBackend(smollm2_gguf("smollm2-135m-f16"), n_threads=args.threads, tree_paths=widest)
    per_size: dict[str, list[float]] = {str(sizes): [] for sizes in LADDER}
    try:
        for prompt in prompts:
            prompt_ids = render_user_prompt(target, prompt.text)[1]
            plain = SpeculativeEngine(target).run(prompt_ids, GenerationParams(args.n, 0), complete_cache=False)
            for sizes in LADDER:
                rate, tokens = tokens_per_pass(target, prompt_ids, sizes, args.n, args.depth)
                per_size[str(sizes)].append(rate)
                same = "same" if tokens == plain.token_ids else "near-tie"
                print(f"{prompt.prompt_id} {prompt.category:<16} {sizes!s:<8} {rate:.2f} tokens/pass ({same})",
                      flush=True)
    finally:
        target.close()
    print("\nsize      nodes  tokens/pass (mean over prompts)")
    for sizes in LADDER:
        print(f"{sizes!s:<9} {sizes.max_nodes:>5}  {statistics.mean(per_size[str(sizes)]):.2f}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(per_size, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
