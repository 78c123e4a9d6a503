"""Two commits side by side: every method on every prompt, A and B interleaved per prompt.

Each side is a worker process importing specrun from its own checkout (a git worktree made
here for the commit given), loading the pair once and keeping one engine per method across
prompts, as `specrun bench` does (what a text learned is forgotten between prompts, the
machine's costs are kept). The order A/B is rotated per prompt. Reports, per method and
suite, the geometric mean over prompts of B's tokens/s over A's, with a 90% bootstrap
interval, and checks that both sides emit the same tokens.

    .venv/bin/python benchmarks/ab_commits.py --before 99931c8 [--after HEAD] \
        [--target demo-target --draft demo-draft] [--spec-bench-per-category 5] [-n 128] \
        [--repeats 1] [--methods none,lookup,...] [--sampling 0.7,40,0.95,0.05] [--raw]

Prompts go in the target's chat template where it has one, as `specrun bench` sends them
(--raw: as raw text, as they went before; the demo pair is a completion model either way).

Head methods (medusa, hydra, eagle) draft with the heads found for the target, as `specrun
generate` finds them (the demo target's ship in the package).

--repeats R runs every prompt R times a side (A and B still interleaved, the order rotated per
run) and takes each prompt's ratio as the geometric mean of its R: the built-in suite's 40-60 ms
runs need it to resolve a few percent. The interval is still over prompts.

Raw per-prompt figures go to runs/ab_<before>_<after>.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np

from _report import SPEC_BENCH, geometric_mean_interval

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "runs"
METHODS = ("none", "lookup", "ngram", "draft", "lookup+draft", "lookup+ngram", "auto")

WORKER = r'''
import json, sys, zlib
try:
    from specrun.engine.loop import GenerationParams, SpeculativeEngine
    from specrun.drafters.methods import build_drafter, is_adaptive
    from specrun.registry.loading import LoadOptions, open_pair
except ImportError:  # the layout before issue 27
    from specrun.engine import GenerationParams, SpeculativeEngine
    from specrun.methods import build_drafter, is_adaptive
    from specrun.loading import LoadOptions, open_pair
target_name, draft_name, methods, n_new, threads, patch, sampling, chat = json.loads(sys.argv[1])
if patch:  # an experiment: this side runs the file first (e.g. a rule switched off)
    exec(open(patch).read())
target, draft = open_pair(target_name, draft_name, LoadOptions(threads=threads))
from specrun.drafters.methods import DrafterOptions, needs_heads
try:
    from specrun.sessions.heads import load_heads_for_methods
except ImportError:  # the layout before issue 48
    from specrun.sessions.generation import load_heads_for_methods


def options_for(method):
    """A head method's heads, found for the target as `specrun generate` finds them."""
    if not needs_heads(method):
        return None
    return DrafterOptions(heads=load_heads_for_methods(target_name, None, target, [method]))


engines = {m: SpeculativeEngine(target, build_drafter(m, draft, options_for(m)), m) for m in methods}
render = None
if chat is not False:  # as `specrun bench` sends a prompt: a user message in the target's template
    try:
        from specrun.registry.loading import prompts_as_chat
        from specrun.sessions.templates import render_user_prompt
        if prompts_as_chat(target_name, None, target, chat):
            render = render_user_prompt
    except ImportError:  # a tree from before chat templates: raw text (the other side must say so too)
        pass
print(json.dumps({"ready": True, "chat": render is not None}), flush=True)
for line in sys.stdin:
    text, method = json.loads(line)
    engine = engines[method]
    if needs_heads(method):  # the engines share the target, which tracks the last bound heads' layers
        engine.drafter.bind(engine.target, engine.clock)
    forget = getattr(engine, "policy", engine).forget_acceptance
    forget()
    ids = render(target, text)[1] if render else target.tokenize(text, add_bos=target.vocab.add_bos)
    settings = {}
    if sampling:  # seeded alike on both sides: equal rows draw equal texts
        from specrun.sampling import SamplingSettings
        temperature, top_k, top_p, min_p = sampling
        settings["sampling"] = SamplingSettings(temperature=temperature, top_k=int(top_k), top_p=top_p,
                                                min_p=min_p, seed=zlib.crc32(text.encode()))
    result = engine.run(ids, GenerationParams(n_new, 16 if is_adaptive(method) else 4, adaptive=method != "none",
                                              **settings))
    s = result.stats
    print(json.dumps([s.new_tokens / s.generation_seconds, zlib.crc32(repr(result.token_ids).encode())]), flush=True)
'''


def worktree(rev: str) -> Path:
    sha = subprocess.check_output(["git", "rev-parse", "--short", rev], cwd=ROOT, text=True).strip()
    path = Path("/tmp") / f"specrun-ab-{sha}"
    if not path.exists():
        subprocess.check_call(["git", "worktree", "add", "-f", "--detach", str(path), sha], cwd=ROOT,
                              stdout=subprocess.DEVNULL)
    link = path / "specrun" / "backends"  # the package maps specrun.backends to backends/
    if not link.exists():
        link.symlink_to(path / "backends")
    return path


class Worker:
    def __init__(self, tree: Path, args, patch: str | None = None) -> None:
        spec = json.dumps([args.target, args.draft, list(args.methods), args.max_tokens, args.threads, patch,
                           args.sampling, False if args.raw else None])
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, spec], cwd=tree, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**os.environ, "PYTHONPATH": str(tree)})
        ready = json.loads(self.proc.stdout.readline())
        assert ready["ready"]
        self.chat = ready["chat"]  # prompts sent in the target's chat template

    def run(self, text: str, method: str) -> tuple[float, int]:
        self.proc.stdin.write(json.dumps([text, method]) + "\n")
        self.proc.stdin.flush()
        return tuple(json.loads(self.proc.stdout.readline()))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def prompts(args) -> dict[str, list[str]]:
    sys.path.insert(0, str(ROOT))
    from specrun.bench.suite import BUILTIN_SUITE

    suites = {} if args.no_builtin else {"builtin": [p.text for p in BUILTIN_SUITE]}
    if args.spec_bench_per_category:
        by_category: dict[str, list[str]] = {}
        for line in SPEC_BENCH.read_text().splitlines():
            row = json.loads(line)
            if args.categories and row["category"] not in args.categories:
                continue
            texts = by_category.setdefault(row["category"], [])
            if len(texts) < args.spec_bench_per_category:
                texts.append(row["turns"][0])
        if args.mix:  # round robin over the categories: each prompt follows one of another kind
            rounds = itertools.zip_longest(*by_category.values())
            suites["spec-bench"] = [t for row in rounds for t in row if t is not None]
        else:
            suites["spec-bench"] = [t for texts in by_category.values() for t in texts]
    return suites


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--target", default="demo-target")
    parser.add_argument("--draft", default="demo-draft")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("-n", "--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--spec-bench-per-category", type=int, default=5)
    parser.add_argument("--categories", type=lambda v: v.split(","), help="Spec-Bench categories, comma-separated")
    parser.add_argument("--mix", action="store_true", help="Spec-Bench prompts round robin over the categories")
    parser.add_argument("--no-builtin", action="store_true", help="Spec-Bench only")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every prompt a side")
    parser.add_argument("--raw", action="store_true", help="prompts as raw text (default: as `specrun bench` "
                        "sends them, in the target's chat template where it has one)")
    parser.add_argument("--patch-after", help="a Python file side B runs before loading (an experiment)")
    parser.add_argument("--sampling", type=lambda v: [float(x) for x in v.split(",")],
                        help="TEMPERATURE,TOP_K,TOP_P,MIN_P, each prompt seeded alike on both sides (default greedy)")
    args = parser.parse_args()
    args.methods = tuple(args.methods.split(","))
    if args.patch_after:  # the workers run in their own checkouts
        args.patch_after = str(Path(args.patch_after).resolve())
    sides = {"A": worktree(args.before), "B": worktree(args.after)}
    workers = {name: Worker(tree, args, args.patch_after if name == "B" else None) for name, tree in sides.items()}
    if workers["A"].chat != workers["B"].chat:
        print("A and B send prompts differently (one tree predates chat templates): pass --raw", file=sys.stderr)
        return 2
    print(f"prompts {'in the chat template' if workers['A'].chat else 'as raw text'}")
    raw, mismatches = [], 0
    try:
        for suite, texts in prompts(args).items():
            for index, text in enumerate(texts):
                for repeat in range(args.repeats):
                    for method in args.methods:
                        turn = index + repeat + zlib.crc32(method.encode())
                        order = ("A", "B") if turn % 2 == 0 else ("B", "A")
                        got = {side: workers[side].run(text, method) for side in order}
                        mismatches += got["A"][1] != got["B"][1]
                        raw.append({"suite": suite, "prompt": index, "repeat": repeat, "method": method,
                                    "A": got["A"][0], "B": got["B"][0],
                                    "same_tokens": got["A"][1] == got["B"][1]})
                print(f"{suite} {index + 1}/{len(texts)}", file=sys.stderr, flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    RUNS.mkdir(exist_ok=True)
    out = RUNS / f"ab_{args.before}_{args.after}{'_' + Path(args.patch_after).stem if args.patch_after else ''}.json"
    out.write_text(json.dumps({"args": vars(args) | {"methods": list(args.methods)}, "runs": raw}, indent=1))
    print(f"B ({args.after}) against A ({args.before}): tokens/s ratio, geometric mean over prompts [90% interval]")
    print(f"{'suite':<11} {'method':<14} {'ratio':>6}  interval")
    for suite in dict.fromkeys(r["suite"] for r in raw):
        for method in args.methods:
            by_prompt: dict[int, list[float]] = {}
            for r in raw:
                if r["suite"] == suite and r["method"] == method:
                    by_prompt.setdefault(r["prompt"], []).append(r["B"] / r["A"])
            ratios = [float(np.exp(np.log(runs).mean())) for runs in by_prompt.values()]
            mean, low, high = geometric_mean_interval(ratios)
            print(f"{suite:<11} {method:<14} {mean:6.3f}  [{low:.3f}, {high:.3f}]")
    print(f"outputs differing between A and B: {mismatches} of {len(raw)}; raw: {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
