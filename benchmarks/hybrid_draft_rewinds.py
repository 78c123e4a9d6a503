"""A hybrid draft model on llama.cpp with and without the state it keeps before drafting
(``LlamaCppBackend.keep_state``): its drafts are a pass each, so a rejected one lies before its last
pass, and without the kept state the draft reads its whole text again. The tests' tiny Qwen3.5-style
hybrid as target, a copy with every matrix nudged as draft (most drafts rejected: the worst case),
``draft -k 4``, greedy, 64 tokens, prompts of several lengths; the two lines alternated, speed
ratio of the means.

    .venv/bin/python benchmarks/hybrid_draft_rewinds.py --dir DIR --lengths 100 1000 3000
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="where the two GGUF files are written")
    parser.add_argument("--lengths", type=int, nargs="+", default=[100, 1000, 3000])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    import numpy as np
    from hybrid_models import HybridShape, hybrid_weights, write_hybrid_gguf

    from specrun.backends.kv import sequence_for
    from specrun.backends.llama import LlamaCppBackend
    from specrun.drafters.draft_model import DraftModelDrafter
    from specrun.engine.loop import GenerationParams, SpeculativeEngine

    args.dir.mkdir(parents=True, exist_ok=True)
    shape = HybridShape(context=max(args.lengths) + 512)
    weights = hybrid_weights(shape)
    rng = np.random.default_rng(5)
    nudged = {name: (value + 0.15 * value.std() * rng.standard_normal(value.shape)).astype(np.float32)
              if value.ndim == 2 else value for name, value in weights.items()}
    target = LlamaCppBackend(write_hybrid_gguf(args.dir / "hybrid.gguf", shape, weights), n_ctx=shape.context,
                             n_threads=1)
    draft = LlamaCppBackend(write_hybrid_gguf(args.dir / "hybrid-nudged.gguf", shape, nudged), n_ctx=shape.context,
                            n_threads=1)
    kept_state = LlamaCppBackend.keep_state
    for length in args.lengths:
        prompt = [(7 * i + 3) % 500 + 3 for i in range(length)]
        rates: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for keeps in (True, False):
                LlamaCppBackend.keep_state = kept_state if keeps else (lambda self: None)
                sequence_for(target).reset()
                sequence_for(draft).reset()
                result = SpeculativeEngine(target, DraftModelDrafter(draft)).run(
                    prompt, GenerationParams(64, 4, stop_at_eos=False))
                rates[keeps].append(len(result.token_ids) / result.stats.generation_seconds)
        LlamaCppBackend.keep_state = kept_state
        print(f"prompt {length}: kept state {statistics.mean(rates[True]) / statistics.mean(rates[False]):.2f}x "
              f"reading the text again ({result.stats.accepted} of {result.stats.drafted} drafts accepted)")


if __name__ == "__main__":
    main()
