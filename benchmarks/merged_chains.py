"""A chain's proposals merged into one token tree against the chain and against trees without
merging (issue 28, item 4), interleaved per prompt: tokens per verify pass and generation speed.

    .venv/bin/python benchmarks/merged_chains.py --per-category 1 --prompts 6 -n 96 --json runs/merged_chains.json

SmolLM2-135M-Instruct F16 target and its Q4_1 copy as the draft model (llama.cpp, the target
opened for trees), ``lookup+ngram+draft`` on Spec-Bench's first turns in the chat template,
greedy. Lines, each adaptive (lengths up to 16, as auto) and at -k 4:

- chain: one member's proposal a pass (--chain);
- branches: --branches second guesses within --tree-nodes, each proposal verified alone
  (AdaptivePolicy.merge_chains off);
- merged: the same, the proposals the chain passed over merged in (the default with trees);
- merged, no branches: merging alone (--tree-nodes without second guesses).

"merged passes" is the share of verify passes that held more than one member's proposal.

``--simulated``: the engines' clocks count simulated seconds instead, a target pass costing
1 + 0.01 a token and a draft pass 0.05 (a memory-bound machine: a GPU, an M-series Mac), so
the policies decide as they would there. Tokens per pass then show what merging does where
the draft model pays; tok/s is in simulated seconds. On this 2-core CPU the draft model costs
about what the target does a pass and its gate keeps it off, so the chain seldom asks it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from _llama_tools import spec_bench
from _report import SPEC_BENCH, geometric_mean_interval, write_report
from specrun.backends.llama import LlamaCppBackend
from specrun.drafters.methods import DrafterOptions, build_drafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.engine.stats import Stats
from specrun.modelkit.smollm2 import smollm2_gguf
from specrun.sessions.templates import render_user_prompt

METHOD = "lookup+ngram+draft"
MEMBERS = set(METHOD.split("+"))


class SimulatedClock:
    """Seconds that pass only as charged backends run: ``per_pass`` + ``per_token`` a token fed."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def charge(self, backend, per_pass: float, per_token: float) -> None:
        for name in ("forward", "forward_argmax", "forward_tree", "forward_tree_argmax"):
            method = getattr(backend, name)
            setattr(backend, name, self._charged(method, per_pass, per_token, tree="tree" in name))

    def _charged(self, method, per_pass: float, per_token: float, tree: bool):
        def charged(tokens, *rest):
            self.now += per_pass + per_token * (len(tokens) + (len(rest[0]) if tree else 0))
            return method(tokens, *rest)

        return charged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=Path, default=SPEC_BENCH)
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=6, help="the first N of them (default 6)")
    parser.add_argument("-n", type=int, default=96, help="new tokens a prompt (default 96)")
    parser.add_argument("-k", type=int, default=4, help="the fixed draft length of the -k lines (default 4)")
    parser.add_argument("--branches", type=int, default=4)
    parser.add_argument("--tree-nodes", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--simulated", action="store_true", help="simulated memory-bound pass costs (see above)")
    parser.add_argument("--json", type=Path, help="write the per-prompt figures here (runs/…)")
    args = parser.parse_args(argv)

    prompts = spec_bench(args.questions, args.per_category)[: args.prompts]
    target = LlamaCppBackend(smollm2_gguf("smollm2-135m-f16"), n_threads=args.threads, tree_paths=8)
    draft = LlamaCppBackend(smollm2_gguf("smollm2-135m"), n_threads=args.threads)
    clock = time.perf_counter
    if args.simulated:
        clock = SimulatedClock()
        clock.charge(target, 1.0, 0.01)
        clock.charge(draft, 0.05, 0.0)
    shapes = {"chain": (0, 0, False), "branches": (args.branches, args.tree_nodes, False),
              "merged": (args.branches, args.tree_nodes, True), "merged, no branches": (0, args.tree_nodes, True)}
    engines, params = {}, {}
    for shape, (branches, nodes, merge) in shapes.items():
        for mode, adaptive in (("adaptive", True), (f"k{args.k}", False)):
            name = f"{shape} {mode}"
            drafter = build_drafter(METHOD, draft, DrafterOptions(branches=branches))
            engine = SpeculativeEngine(target, drafter, METHOD, clock=clock)
            engine.policy.merge_chains = merge
            engines[name] = engine
            params[name] = GenerationParams(args.n, 16 if adaptive else args.k, adaptive=adaptive, tree_nodes=nodes)
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    try:
        for prompt in prompts:
            prompt_ids = render_user_prompt(target, prompt.text)[1]
            for name, engine in engines.items():
                engine.policy.forget_acceptance()
                stats, started, merged, passes = Stats(), time.perf_counter(), 0, 0
                for step in engine.steps(prompt_ids, params[name], stats):
                    passes += 1
                    merged += step.n_drafted > 0 and step.source not in MEMBERS
                tokens = engine.last_context[len(prompt_ids):]
                runs[name].append({"prompt": prompt.prompt_id, "category": prompt.category, "tokens": len(tokens),
                                   "steps": passes, "merged": merged, "seconds": stats.generation_seconds,
                                   "wall": time.perf_counter() - started, "text": tokens})
            print(f"{prompt.prompt_id} {prompt.category}: " + ", ".join(
                f"{name} {runs[name][-1]['tokens'] / runs[name][-1]['steps']:.2f}" for name in engines), flush=True)
    finally:
        for engine in engines.values():
            engine.drafter.close()
        target.close()
        draft.close()
    print(f"\nSmolLM2-135M F16 + Q4_1 draft, {METHOD}, {len(prompts)} Spec-Bench prompts, {args.n} tokens, greedy, "
          f"{args.threads} threads; trees: --branches {args.branches}, --tree-nodes {args.tree_nodes}"
          + ("; simulated memory-bound pass costs" if args.simulated else ""))
    print("| line | tokens / pass | merged passes | tok/s | vs the chain (speed, 90% interval) | same text |")
    print("|---|---|---|---|---|---|")
    for name, line in runs.items():
        chain = runs["chain " + name.rsplit(" ", 1)[1]]
        per_pass = sum(r["tokens"] for r in line) / sum(r["steps"] for r in line)
        merged = sum(r["merged"] for r in line) / sum(r["steps"] for r in line)
        speed = sum(r["tokens"] for r in line) / sum(r["seconds"] for r in line)
        mean, low, high = geometric_mean_interval(
            [(r["tokens"] / r["seconds"]) / (c["tokens"] / c["seconds"]) for r, c in zip(line, chain)])
        same = sum(r["text"] == c["text"] for r, c in zip(line, chain))
        print(f"| {name} | {per_pass:.2f} | {100 * merged:.0f}% | {speed:.1f} | {mean:.3f} ({low:.3f}-{high:.3f}) "
              f"| {same}/{len(line)} |")
    write_report(args.json, {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
