"""Layer skipping on MLX (issue 30): a model drafting with some of its own layers
(``--draft self:layers=…``) against plain decoding and against a separate draft model, side by
side: every prompt runs plain decoding and each draft in turn, the order rotated per prompt.

    .venv/bin/python benchmarks/layer_skip.py --target demo-target-xl self:layers=5 self:layers=4 demo-draft
    .venv/bin/python benchmarks/layer_skip.py self:layers=0-13,18-29 smollm2-135m self:q4 --prompts 3

DRAFTS are ``self:layers=…`` specs, ``self:q4``/``self:q8`` or a model a target can draft with.
Greedy at a fixed draft length (-k: every step drafts, so tokens a pass are the draft's own);
per line: drafts accepted, tokens a pass, texts equal to plain decoding's, and the geometric
mean over prompts of its speed over plain decoding's (90% bootstrap interval). The real model's
prompts go as chat messages, a demo model's as typed. MLX on a 2-core CPU takes ~20 s for 48
tokens of SmolLM2-135M F16: a few prompts. Raw figures: --json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from _report import geometric_mean_interval, write_report

from specrun.drafters.methods import build_drafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.registry.loading import LoadOptions, open_backend, open_draft
from specrun.sessions.prompts import CODE_PROMPTS
from specrun.sessions.templates import render_user_prompt

CHAT_PROMPTS = (
    "Write a Python function that returns the factorial of n.",
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that checks whether a string is a palindrome.",
    "List five tips for writing clear emails.",
    "Write a Python class for a stack with push, pop and peek.",
    "Summarize the plot of Romeo and Juliet in four sentences.",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafts", nargs="+", help="self:layers=… specs, self:q4, or draft models")
    parser.add_argument("--target", default="smollm2-135m-f16", help="a builtin model (default smollm2-135m-f16)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts (default 4)")
    parser.add_argument("-n", type=int, default=48, help="new tokens (default 48)")
    parser.add_argument("-k", type=int, default=4, help="draft length (default 4)")
    parser.add_argument("--json", type=Path, help="raw figures (default: none)")
    args = parser.parse_args()
    load = LoadOptions(backend="mlx", n_ctx=1024)
    target = open_backend(args.target, load)
    chat = not args.target.startswith("demo-")
    texts = (CHAT_PROMPTS if chat else CODE_PROMPTS)[: args.prompts]
    prompts = [render_user_prompt(target, text)[1] if chat else target.tokenize(text) for text in texts]
    drafts = {spec: open_draft(target, args.target, spec, load) for spec in args.drafts}
    engines = {"none": SpeculativeEngine(target)}
    engines.update({spec: SpeculativeEngine(target, build_drafter("draft", draft)) for spec, draft in drafts.items()})
    lines = list(engines)
    runs: dict[str, list[dict]] = {line: [] for line in lines}
    for index, prompt in enumerate(prompts):
        order = lines[index % len(lines):] + lines[: index % len(lines)]
        for line in order:
            draft_len = 0 if line == "none" else args.k
            started = time.perf_counter()
            result = engines[line].run(prompt, GenerationParams(args.n, draft_len), complete_cache=False)
            stats = result.stats
            runs[line].append({"prompt": index, "seconds": time.perf_counter() - started,
                               "tokens_per_second": stats.tokens_per_second, "steps": stats.steps,
                               "tokens": stats.new_tokens, "drafted": stats.drafted, "accepted": stats.accepted,
                               "text": list(result.token_ids)})
        print(f"prompt {index + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    plain = runs["none"]
    print(f"{args.target} on MLX, {len(prompts)} prompts, {args.n} tokens, greedy, -k {args.k}, interleaved")
    print("| line | layers | accepted | tokens / pass | vs plain (90% interval) | same text |")
    print("|---|---|---|---|---|---|")
    for line in lines:
        rows = runs[line]
        if line not in drafts:
            layers = f"{target.n_layers}"
        else:
            own = not line.startswith("self:layers")
            layers = f"{drafts[line].n_layers}" + (" (its own)" if own else f" of {target.n_layers}")
        drafted, accepted = sum(r["drafted"] for r in rows), sum(r["accepted"] for r in rows)
        per_pass = sum(r["tokens"] for r in rows) / max(sum(r["steps"] for r in rows), 1)
        ratios = [r["tokens_per_second"] / p["tokens_per_second"] for r, p in zip(rows, plain)]
        mean, low, high = geometric_mean_interval(ratios)
        same = sum(r["text"] == p["text"] for r, p in zip(rows, plain))
        shown = f"{accepted}/{drafted}" if drafted else "-"
        print(f"| {line} | {layers} | {shown} | {per_pass:.2f} | {mean:.3f} ({low:.3f}-{high:.3f}) | "
              f"{same}/{len(rows)} |")
    write_report(args.json, {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs})
    for draft in drafts.values():
        draft.close()
    target.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
