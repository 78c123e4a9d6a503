"""specrun's methods on an MLX target against mlx-lm's plain decoding of the same loaded model,
a hybrid target (recurrent state beside attention) especially (issue 50): mlx-lm's own
speculative decoding refuses such a model ("requires a trimmable prompt cache"); specrun restores
its state from a checkpoint after a rejected draft. Plain decoding (``none``) is where specrun
must never trail mlx-lm. One process, one loaded model, prompts interleaved (mlx-lm plain, then
each method), generation time only (from the first new token to the last, prefill excluded), greedy.

    .venv/bin/python benchmarks/mlx_hybrid_vs_mlx_lm.py --make DIR -n 64 [--hidden 512] [--in-sample]
    .venv/bin/python benchmarks/mlx_hybrid_vs_mlx_lm.py --target FOLDER --methods none,lookup -n 64 \
        --prompts ../shared/data/spec_bench/question.jsonl --per-category 2
    .venv/bin/python benchmarks/mlx_hybrid_vs_mlx_lm.py --target FOLDER --methods mtp,mtp:replay --fixed 3
    .venv/bin/python benchmarks/mtp_vs_llama.py --make DIR --layout qwen35 --hidden 1024 --layers 8 ...
    specrun models convert DIR/hybrid.gguf --to mlx --out DIR/f16
    specrun models convert DIR/hybrid.gguf --to mlx --dtype q4 --out DIR/q4
    .venv/bin/python benchmarks/mlx_hybrid_vs_mlx_lm.py --target DIR/f16 --draft DIR/q4 \
        --methods none,draft,draft:replay [--fixed 4]

A method named ``NAME:sync`` runs NAME with plain steps that do not read ahead (each step's pass
queued only once the host has its id), beside NAME in the same interleaved run; ``NAME:replay``
runs it with rollback within a pass off (``MlxBackend.snapshots``, backends/mlx_snapshots.py): every
rewind of a recurrent cache restores a checkpoint and feeds the kept tokens again.

``--target``: an MLX folder (the tests' Qwen3.5 folder with a fitted MTP layer:
tests/hybrid_models.write_fitted_qwen35_mlx_folder, written by ``--make DIR``). ``--prompts``: a Spec-Bench-style JSONL file instead of the built-in suite.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from specrun.bench.suite import BUILTIN_SUITE, BenchPrompt, load_jsonl, select  # noqa: E402


def mlx_lm_plain(model, tokenizer, ids, n: int) -> tuple[list[int], float]:
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    tokens, first, last = [], 0.0, 0.0
    for response in mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=n, sampler=make_sampler(temp=0.0)):
        last = time.perf_counter()
        if not tokens:
            first = last
        tokens.append(response.token)
    return tokens, (len(tokens) - 1) / (last - first) if len(tokens) > 1 and last > first else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path)
    parser.add_argument("--make", type=Path, help="write the tests' Qwen3.5 folder here (its MTP layer fitted on its "
                        "continuations of tests/mtp_models.TRAINING_PROMPTS) and use it")
    parser.add_argument("--hidden", type=int, help="--make's width (default: the tests' 128; 4 layers)")
    parser.add_argument("--layers", type=int, default=8, help="--make's depth where --hidden is given")
    parser.add_argument("--in-sample", action="store_true", help="the prompts --make's MTP layer was fitted on")
    parser.add_argument("--draft", type=Path, help="an MLX folder the methods that take a draft model draft with")
    parser.add_argument("--methods", default="none,lookup,mtp,lookup+ngram+mtp",
                        help="specrun methods, each adaptive (none: plain decoding through specrun's engine)")
    parser.add_argument("-n", type=int, default=64)
    parser.add_argument("--fixed", type=int, metavar="K",
                        help="draft K tokens every step (default: adaptive lengths up to 16)")
    parser.add_argument("--prompts", type=Path, help="a Spec-Bench-style JSONL file (default: the built-in suite)")
    parser.add_argument("--per-category", type=int, help="at most this many prompts of each category")
    args = parser.parse_args()
    if (args.target is None) == (args.make is None):
        parser.error("give --target or --make")
    target = args.target
    if args.make is not None:
        from hybrid_models import HybridShape, write_fitted_qwen35_mlx_folder

        shape = HybridShape()
        if args.hidden:  # mtp_vs_llama.make_model's proportions
            heads = max(args.hidden // 64, 1)
            shape = HybridShape(hidden=args.hidden, layers=args.layers, heads=heads, kv_heads=max(heads // 4, 1),
                                head_dim=64, rope_dims=32, ffn=3 * args.hidden, state=64, k_heads=max(heads // 2, 1),
                                v_heads=heads, context=4096)
        target = write_fitted_qwen35_mlx_folder(args.make, shape)

    from specrun.backends.mlx import MlxBackend
    from specrun.drafters.methods import DrafterOptions, build_drafter, needs_heads
    from specrun.engine.loop import GenerationParams, SpeculativeEngine
    from specrun.sessions.heads import read_heads

    backend = MlxBackend(target)
    draft = MlxBackend(args.draft) if args.draft else None
    methods = args.methods.split(",")
    heads = read_heads(target, None) if any(needs_heads(m) for m in methods) else None
    # an engine a method: what a method's policy learns on one prompt carries to its next, never
    # to another line's (one engine for all let each line learn from the line before it: +3-4%)
    engines = {method: SpeculativeEngine(backend, None) for method in methods}
    ratios: dict[str, list[float]] = {method: [] for method in methods}
    same: dict[str, int] = dict.fromkeys(methods, 0)
    if args.in_sample:
        from mtp_models import TRAINING_PROMPTS

        prompts = [BenchPrompt(f"fitted-{i}", "fitted", text) for i, text in enumerate(TRAINING_PROMPTS)]
    else:
        prompts = select(load_jsonl(args.prompts) if args.prompts else BUILTIN_SUITE, per_category=args.per_category)
    for prompt in prompts:
        ids = backend.tokenize(prompt.text)
        if len(ids) + args.n > backend.n_ctx:  # the tests' folders hold 512 tokens
            print(f"skipped {prompt.prompt_id}: {len(ids)} tokens and {args.n} more pass the context of {backend.n_ctx}")
            continue
        plain_tokens, plain_rate = mlx_lm_plain(backend.model, backend.tokenizer, ids, args.n)
        if not plain_rate:  # ended at once (an end-of-text first): nothing to time
            continue
        for method in methods:
            name, _, variant = method.partition(":")
            drafter = build_drafter(name, draft, DrafterOptions(heads=heads if needs_heads(name) else None))
            engine = engines[method]
            engine.set_drafter(drafter, name)
            reads_ahead = MlxBackend.reads_ahead
            if variant == "sync":
                MlxBackend.reads_ahead = property(lambda self: False)
            for model in (backend, draft):
                if model is not None:
                    model.snapshots = variant != "replay"
            try:
                length = (args.fixed or 16) if drafter else 0
                result = engine.run(ids, GenerationParams(args.n, length, adaptive=drafter is not None and not args.fixed))
            finally:
                MlxBackend.reads_ahead = reads_ahead
                for model in (backend, draft):
                    if model is not None:
                        model.snapshots = True
            if drafter is not None:
                drafter.close()
            rate = max(len(result.token_ids) - 1, 0) / result.stats.generation_seconds
            ratios[method].append(rate / plain_rate)
            same[method] += list(result.token_ids) == plain_tokens[: len(result.token_ids)]
    for method in methods:
        values = ratios[method]
        mean = statistics.geometric_mean(values)
        print(f"{method:8s} {mean:.2f}x mlx-lm plain (prompts {len(values)}, worst {min(values):.2f}x, "
              f"same text {same[method]}/{len(values)})")


if __name__ == "__main__":
    main()
