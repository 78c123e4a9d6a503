"""What --exact costs: plain decoding under llama.cpp's defaults against --exact (flash
attention off, F32 KV cache), both loaded in one process and alternated per prompt.

    .venv/bin/python benchmarks/exact_cost.py smollm2-135m-f16 --threads 1
    .venv/bin/python benchmarks/exact_cost.py demo-target-xl

Prints the median, lowest and highest per-prompt ratio of --exact's speed to the default's
(generation only, prefill excluded; 128 tokens; the prompts in the model's chat template
when it is not a completion model).
"""

from __future__ import annotations

import argparse
import statistics

from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.registry.loading import LoadOptions, open_backend, prompts_as_chat
from specrun.sessions.templates import render_user_prompt

PROMPTS = (
    "Write a short poem about the sea.",
    "Explain what a CPU cache is.",
    "Give me three tips for learning Python.",
    "Summarize the plot of Romeo and Juliet.",
    "What is the difference between a list and a tuple?",
    "def read_config(path):\n",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a target alias or .gguf path")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("-n", type=int, default=128)
    args = parser.parse_args()
    lines = {
        "default": open_backend(args.model, LoadOptions(backend="llama", n_ctx=1024, threads=args.threads)),
        "exact": open_backend(args.model, LoadOptions(backend="llama", n_ctx=1024, threads=args.threads, exact=True)),
    }
    chat = prompts_as_chat(args.model, None, lines["default"], None)
    ratios = []
    for _ in range(args.repeat):
        for prompt in PROMPTS:
            speed = {}
            for name, backend in lines.items():
                ids = render_user_prompt(backend, prompt)[1] if chat else backend.tokenize(prompt)
                result = SpeculativeEngine(backend, None).run(
                    ids, GenerationParams(args.n, 0, stop_at_eos=False), complete_cache=False
                )
                speed[name] = result.stats.tokens_per_second
            ratios.append(speed["exact"] / speed["default"])
    print(f"{args.model}: --exact / default plain decoding speed: median {statistics.median(ratios):.3f} "
          f"(lowest {min(ratios):.3f}, highest {max(ratios):.3f}) over {len(ratios)} runs")


if __name__ == "__main__":
    main()
