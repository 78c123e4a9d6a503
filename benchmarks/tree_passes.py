"""Token trees against chains, interleaved per prompt (issue 28's speed check): tokens per verify
pass and generation speed, on one target opened for trees (so both lines pay its context alike).

Lines: every METHOD as a chain and with branches (--branches second guesses, --tree-nodes cap),
at a fixed draft length (-k: every node verified, what trees give per pass) and adaptive (the
policy keeps the second guesses that pay on this machine). Built-in suite, greedy.

    .venv/bin/python benchmarks/tree_passes.py                        # demo-target-xl + demo-draft, draft
    .venv/bin/python benchmarks/tree_passes.py --target smollm2-135m-f16 --draft smollm2-135m --methods draft,auto
    .venv/bin/python benchmarks/tree_passes.py --always-grow --branches 12 --tree-nodes 24   # trees every step
    .venv/bin/python benchmarks/tree_passes.py --target demo-target --methods medusa,eagle -k 4 --branches 8
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from _report import geometric_mean_interval, write_report
from specrun.bench.suite import BUILTIN_SUITE
from specrun.drafters.methods import DrafterOptions, build_drafter, needs_draft_model
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.registry.loading import LoadOptions, open_pair
from specrun.sessions.compare import track_as_drafted
from specrun.sessions.heads import load_heads_for_methods


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="demo-target-xl")
    parser.add_argument("--draft", default="demo-draft")
    parser.add_argument("--methods", default="draft")
    parser.add_argument("--branches", type=int, default=4)
    parser.add_argument("--tree-nodes", type=int, default=16)
    parser.add_argument("-k", type=int, default=4, help="the fixed draft length (default 4)")
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=21)
    parser.add_argument("--exact", action="store_true", help="load as --exact (flash attention off, F32 KV)")
    parser.add_argument("--json", help="raw figures (default: none)")
    parser.add_argument("--heads", help="the head methods' heads file (default: found by the target's alias)")
    parser.add_argument("--always-grow", action="store_true",
                        help="the draft grows its dynamic tree every step, whatever its tree passes cost here "
                        "(tokens a pass as on hardware where they cost a one-token pass)")
    args = parser.parse_args()
    if args.always_grow:
        import specrun.drafters.draft_model as draft_model

        draft_model.TREE_PASS_LIMIT = float("inf")

    options = LoadOptions(threads=args.threads, tree_paths=args.branches + 1, exact=args.exact)
    target, draft = open_pair(args.target, args.draft, options)
    methods = args.methods.split(",")
    heads = load_heads_for_methods(args.target, args.heads, target, methods)
    engines, params = {}, {}
    for method in methods:
        for shape, branches in (("chain", 0), ("tree", args.branches)):
            drafter = build_drafter(method, draft if needs_draft_model(method) else None,
                                    DrafterOptions(branches=branches, heads=heads))
            for mode, adaptive in ((f"k{args.k}", False), ("adaptive", True)):
                name = f"{method} {shape} {mode}"
                engines[name] = SpeculativeEngine(target, drafter, method=method)
                params[name] = GenerationParams(args.n, 16 if adaptive else args.k, adaptive=adaptive,
                                                tree_nodes=args.tree_nodes if branches else 0)
    runs = {name: [] for name in engines}
    prompts = BUILTIN_SUITE[: args.prompts]
    for prompt in prompts:
        ids = target.tokenize(prompt.text, add_bos=target.vocab.add_bos)
        for name, engine in engines.items():
            engine.policy.forget_acceptance()
            track_as_drafted(engine)  # hidden states for the head lines only
            started = time.perf_counter()
            result = engine.run(ids, params[name])
            runs[name].append({"prompt": prompt.prompt_id, "tokens": len(result.token_ids), "steps": result.stats.steps,
                               "seconds": result.stats.generation_seconds, "wall": time.perf_counter() - started,
                               "text": result.token_ids})
    print(f"{args.target} + {args.draft}, {len(prompts)} built-in prompts, {args.n} tokens, greedy, "
          f"{args.threads} threads, target opened with {args.branches + 1} tree paths{', --exact' * args.exact}")
    print("| line | tokens / pass | tok/s | vs the chain (speed, 90% interval) | same text as the chain |")
    print("|---|---|---|---|---|")
    for name, line in runs.items():
        chain = runs[name.replace(" tree ", " chain ")]
        per_pass = sum(r["tokens"] for r in line) / sum(r["steps"] for r in line)
        speed = sum(r["tokens"] for r in line) / sum(r["seconds"] for r in line)
        ratios = [(r["tokens"] / r["seconds"]) / (c["tokens"] / c["seconds"]) for r, c in zip(line, chain)]
        mean, low, high = geometric_mean_interval(ratios)
        same = sum(r["text"] == c["text"] for r, c in zip(line, chain))
        print(f"| {name} | {per_pass:.2f} | {speed:.1f} | {mean:.3f} ({low:.3f}-{high:.3f}) | {same}/{len(line)} |")
    if args.json:
        write_report(Path(args.json), {"args": vars(args), "runs": runs})


if __name__ == "__main__":
    main()
