"""Plain MLX decoding under a repetition penalty or sampling: specrun against mlx-lm, side by side.

A penalty shapes each row by the text before it, and a sampled token is drawn from its row:
either way the next pass cannot be queued on an argmax the device already holds. specrun's MLX
plain steps shape the row there (backends/mlx.py, ``shaped_on_device``) and draw the token there
(``drawn_on_device``: Gumbel noise keyed by the step's uniform of the run's generator), and so
still read one token ahead, as mlx-lm's loop does with its logits processors and sampler; before,
each row came to the host and nothing was read ahead. One loaded model, per prompt interleaved
(the order rotating):

1. ``ahead``   — specrun plain on the device, reading ahead (the default)
2. ``host``    — specrun plain, rows shaped and drawn on the host, no reading ahead (the old way)
3. ``mlx_lm``  — mlx-lm's loop (``generate_step``) with its repetition-penalty processor and sampler
4. ``greedy``  — specrun plain greedy without a penalty (what the settings cost at all)

``--repeat-penalty`` over the last ``--last-n`` tokens (mlx-lm's repetition penalty is
llama.cpp's repeat penalty: a logit divided by it, multiplied where negative; 1: none),
``--temp`` (0: greedy; with ``--top-k``, ``--top-p``, ``--min-p``). Timing is generation only, the cache
holding the prompt but its last token first. Reports tokens/s, each runner against mlx-lm and
``ahead`` against ``host``, and whether the texts agree: greedy, ``ahead`` and ``host`` must
(mlx-lm's may part at a near-tie: it shapes in the logits' dtype); sampled, each path's seeded
draws are its own.

    .venv/bin/python benchmarks/mlx_plain_settings.py --target demo-target --prompts 12 -n 128 --repeat 2
    .venv/bin/python benchmarks/mlx_plain_settings.py --target demo-target --prompt-set spec-bench --prompts 13 -n 128
    .venv/bin/python benchmarks/mlx_plain_settings.py ... --repeat-penalty 1 --temp 0.7
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from mlx_lm.sample_utils import make_logits_processors, make_sampler

from mlx_vs_mlx_lm import Run, interleaved, load_pair, load_prompts, machine, prefilled_cache
from specrun.backends.kv import sequence_for
from specrun.backends.mlx import MlxBackend
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.penalties import Penalties
from specrun.sampling import SamplingSettings

# mlx-lm's make_sampler applies top-p, min-p, then top-k, the temperature last: the same
# distribution on both sides (llama.cpp's order, specrun's default, differs where top-k and top-p are on)
MLX_LM_ORDER = ("top_p", "min_p", "top_k", "temperature")

RUNNERS = ("ahead", "host", "mlx_lm", "greedy")


class _OnTheHost:
    """The backend's device shaping and drawing turned off for a run: rows to the host, no reading ahead."""

    def __enter__(self):
        self._was = MlxBackend.__dict__["shapes_ahead"], MlxBackend.__dict__["samples_ahead"]
        MlxBackend.shapes_ahead = MlxBackend.samples_ahead = property(lambda self: False)

    def __exit__(self, *exc):
        MlxBackend.shapes_ahead, MlxBackend.samples_ahead = self._was


def run_specrun(target: MlxBackend, prompt: list[int], params: GenerationParams, host: bool = False) -> Run:
    """specrun's plain decoding from a cache holding prompt[:-1]; ``host``: rows shaped and drawn there."""
    sequence_for(target).sync(prompt[:-1])
    engine = SpeculativeEngine(target)
    started = time.perf_counter()
    if host:
        with _OnTheHost():
            result = engine.run(prompt, params, complete_cache=False)
    else:
        result = engine.run(prompt, params, complete_cache=False)
    return Run(list(result.token_ids), time.perf_counter() - started)


def run_mlx_lm(pair, prompt: list[int], max_tokens: int, args) -> Run:
    """mlx-lm's generate_step from a prefilled cache with its sampler and, where a penalty is
    asked, its repetition processor, which reads the prompt's tokens too (as specrun's and
    llama.cpp's penalties do): they are put before the tokens mlx-lm's loop hands it, which
    start at the last one fed."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    cache = prefilled_cache(pair.target_model, prompt)
    processors = []
    if args.repeat_penalty != 1.0:
        (inner,) = make_logits_processors(repetition_penalty=args.repeat_penalty, repetition_context_size=args.last_n)
        before = mx.array(prompt[:-1])
        processors = [lambda tokens, logits: inner(mx.concatenate([before, tokens]), logits)]
    sampler = make_sampler(temp=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)
    started = time.perf_counter()
    tokens = [int(token) for token, _ in generate_step(mx.array(prompt[-1:]), pair.target_model, max_tokens=max_tokens,
                                                       sampler=sampler, logits_processors=processors,
                                                       prompt_cache=cache)]
    return Run(tokens, time.perf_counter() - started)


def total_rate(runs: list[list[Run]]) -> float:
    """All prompts' tokens over all their seconds."""
    flat = [run for prompt_runs in runs for run in prompt_runs]
    return sum(len(run.tokens) for run in flat) / sum(run.seconds for run in flat)


def ratio(ours: list[list[Run]], theirs: list[list[Run]]) -> float:
    """The median over prompts of ours' tokens/s over theirs' (each prompt's median run)."""
    return statistics.median(statistics.median(run.tokens_per_second for run in a)
                             / statistics.median(run.tokens_per_second for run in b) for a, b in zip(ours, theirs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="demo-target")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--prompt-set", choices=("code", "spec-bench"), default="code")
    parser.add_argument("-n", type=int, default=128, help="new tokens per prompt")
    parser.add_argument("--repeat-penalty", type=float, default=1.1, help="1: none")
    parser.add_argument("--last-n", type=int, default=64, help="the penalty's window, in tokens")
    parser.add_argument("--temp", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="specrun's runs' seed (mlx-lm draws its own)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per prompt and runner (pooled)")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    if args.last_n <= 0:
        parser.error("--last-n must be a count of tokens: mlx-lm's processor reads the last N (no -1 or 0)")

    pair = load_pair(args.target, args.target)
    target = pair.target
    prompts = load_prompts(pair, args.prompt_set, args.prompts)
    penalties = Penalties(repeat=args.repeat_penalty, last_n=args.last_n)
    asked = GenerationParams(args.n, 0, stop_at_eos=False, sampling=SamplingSettings(
        temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
        penalties=penalties, order=MLX_LM_ORDER))
    greedy = GenerationParams(args.n, 0, stop_at_eos=False)
    runners = {
        "ahead": lambda prompt: run_specrun(target, prompt, asked),
        "host": lambda prompt: run_specrun(target, prompt, asked, host=True),
        "mlx_lm": lambda prompt: run_mlx_lm(pair, prompt, args.n, args),
        "greedy": lambda prompt: run_specrun(target, prompt, greedy),
    }
    for runner in runners.values():  # warm every path once, untimed
        runner(prompts[0][:8])
    runs = interleaved(prompts, runners, args.repeat)
    pairs = [(run, other) for a, b in zip(runs["ahead"], runs["host"]) for run, other in zip(a, b)]
    same_as_host = sum(run.tokens == other.tokens for run, other in pairs)
    same_as_mlx_lm = sum(a[0].tokens == b[0].tokens for a, b in zip(runs["ahead"], runs["mlx_lm"]))
    report = {
        "machine": machine(), "args": {key: str(value) for key, value in vars(args).items()},
        "tokens_per_second": {name: round(total_rate(runs[name]), 2) for name in RUNNERS},
        "ahead_vs_mlx_lm": round(ratio(runs["ahead"], runs["mlx_lm"]), 3),
        "host_vs_mlx_lm": round(ratio(runs["host"], runs["mlx_lm"]), 3),
        "ahead_vs_host": round(ratio(runs["ahead"], runs["host"]), 3),
        "ahead_vs_greedy": round(ratio(runs["ahead"], runs["greedy"]), 3),
        "runs_with_the_host_s_text": f"{same_as_host} of {len(pairs)}",
        "prompts_with_mlx_lm_s_text": f"{same_as_mlx_lm} of {len(prompts)}",
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
