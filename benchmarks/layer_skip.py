"""Layer skipping on MLX (issue 30): a model drafting with some of its own layers
(``--draft self:layers=…``), against plain decoding, on one prompt (the real model's as a
chat message; a demo model's as typed).

    .venv/bin/python benchmarks/layer_skip.py self:layers=0-13,18-29 self:layers=24
    .venv/bin/python benchmarks/layer_skip.py --target demo-target-xl self:layers=3 self:layers=2

Plain decoding runs first, then each draft in turn, greedy, at a fixed draft length; prints
drafts accepted, whether the text equals plain decoding's, and the speed ratio. MLX on a
2-core CPU takes ~20 s for 48 tokens of SmolLM2-135M F16: one prompt, one run each.
"""

from __future__ import annotations

import argparse
import time

from specrun.backends.mlx import MlxBackend
from specrun.drafters.methods import build_drafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.modelkit.builtin import builtin_mlx_dir
from specrun.registry.loading import open_layer_draft
from specrun.sessions.templates import render_user_prompt

PROMPT = "Write a Python function that returns the factorial of n."
CODE_PROMPT = "def factorial(n):\n    \"\"\"Return n!.\"\"\"\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafts", nargs="+", help="self:layers=… specs")
    parser.add_argument("-n", type=int, default=48, help="new tokens (default 48)")
    parser.add_argument("-k", type=int, default=4, help="draft length (default 4)")
    parser.add_argument("--target", default="smollm2-135m-f16", help="a builtin model (default smollm2-135m-f16)")
    args = parser.parse_args()
    target = MlxBackend(builtin_mlx_dir(args.target), n_ctx=512)
    chat = not args.target.startswith("demo-")
    prompt_ids = render_user_prompt(target, PROMPT)[1] if chat else target.tokenize(CODE_PROMPT)
    started = time.perf_counter()
    plain = SpeculativeEngine(target).run(prompt_ids, GenerationParams(args.n, 0), complete_cache=False)
    plain_seconds = time.perf_counter() - started
    print(f"plain: {plain_seconds:.2f} s")
    for spec in args.drafts:
        draft = open_layer_draft(target, spec)
        engine = SpeculativeEngine(target, build_drafter("draft", draft))
        started = time.perf_counter()
        result = engine.run(prompt_ids, GenerationParams(args.n, args.k), complete_cache=False)
        seconds = time.perf_counter() - started
        same = result.token_ids == plain.token_ids
        stats = result.stats
        print(f"{spec}: {draft.n_layers} of {target.n_layers} layers, accepted {stats.accepted} / "
              f"{stats.drafted}, {stats.new_tokens / max(stats.steps, 1):.2f} tokens a pass, same text {same}, "
              f"{plain_seconds / seconds:.2f}x plain")
        draft.close()


if __name__ == "__main__":
    main()
