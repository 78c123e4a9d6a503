"""Plain MLX decoding under a repetition penalty: specrun against mlx-lm, side by side.

A penalty shapes each row by the text before it, so a row cannot be read as an argmax on the
device without knowing its text. specrun's MLX plain steps shape it there (backends/mlx.py,
``shaped_on_device``) and so still read one token ahead, as mlx-lm's loop does with its
logits processors; before, they brought each row to the host and read nothing ahead. One
loaded model, per prompt interleaved (the order rotating):

1. ``ahead``     — specrun plain, the penalty on the device, reading ahead (the default)
2. ``host``      — specrun plain, the penalty on the host, no reading ahead (the old way)
3. ``mlx_lm``    — mlx-lm's loop (``generate_step``) with its repetition-penalty logits processor
4. ``unshaped``  — specrun plain without the penalty (what the penalty costs at all)

Greedy; ``--repeat-penalty`` over the last ``--last-n`` tokens (mlx-lm's repetition penalty is
llama.cpp's repeat penalty: a logit divided by it, multiplied where negative). Timing is
generation only, both caches holding the prompt but its last token first. Reports tokens/s,
each runner against mlx-lm and ``ahead`` against ``host``, and whether the texts agree
(``ahead`` and ``host`` must; mlx-lm shapes in the logits' own dtype, so may part at a near-tie).

    .venv/bin/python benchmarks/mlx_penalties_plain.py --target demo-target --prompts 12 -n 128
    .venv/bin/python benchmarks/mlx_penalties_plain.py --target demo-target --prompt-set spec-bench --prompts 13 -n 128
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

RUNNERS = ("ahead", "host", "mlx_lm", "unshaped")


class _HostShaping:
    """The backend's device shaping turned off for a run: rows to the host, no reading ahead."""

    def __enter__(self):
        self._was = MlxBackend.__dict__["shapes_ahead"]
        MlxBackend.shapes_ahead = property(lambda self: False)

    def __exit__(self, *exc):
        MlxBackend.shapes_ahead = self._was


def run_specrun(target: MlxBackend, prompt: list[int], params: GenerationParams, host: bool = False) -> Run:
    """specrun's plain decoding from a cache holding prompt[:-1]; ``host``: the rows shaped there."""
    sequence_for(target).sync(prompt[:-1])
    engine = SpeculativeEngine(target)
    started = time.perf_counter()
    if host:
        with _HostShaping():
            result = engine.run(prompt, params, complete_cache=False)
    else:
        result = engine.run(prompt, params, complete_cache=False)
    return Run(list(result.token_ids), time.perf_counter() - started)


def run_mlx_lm(pair, prompt: list[int], max_tokens: int, penalty: float, last_n: int) -> Run:
    """mlx-lm's generate_step from a prefilled cache with its repetition-penalty processor, which
    reads the prompt's tokens too (as specrun's and llama.cpp's penalties do): they are put before
    the tokens mlx-lm's loop hands it, which start at the last one fed."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    cache = prefilled_cache(pair.target_model, prompt)
    (inner,) = make_logits_processors(repetition_penalty=penalty, repetition_context_size=last_n)
    before = mx.array(prompt[:-1])

    def processor(tokens, logits):
        return inner(mx.concatenate([before, tokens]), logits)

    started = time.perf_counter()
    tokens = [int(token) for token, _ in generate_step(mx.array(prompt[-1:]), pair.target_model, max_tokens=max_tokens,
                                                       sampler=make_sampler(temp=0.0), logits_processors=[processor],
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
    parser.add_argument("--repeat-penalty", type=float, default=1.1)
    parser.add_argument("--last-n", type=int, default=64, help="the penalty's window, in tokens")
    parser.add_argument("--repeat", type=int, default=1, help="runs per prompt and runner (pooled)")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    if args.last_n <= 0:
        parser.error("--last-n must be a count of tokens: mlx-lm's processor reads the last N (no -1 or 0)")

    pair = load_pair(args.target, args.target)
    target = pair.target
    prompts = load_prompts(pair, args.prompt_set, args.prompts)
    shaped = GenerationParams(args.n, 0, stop_at_eos=False, sampling=SamplingSettings(
        penalties=Penalties(repeat=args.repeat_penalty, last_n=args.last_n)))
    unshaped = GenerationParams(args.n, 0, stop_at_eos=False)
    runners = {
        "ahead": lambda prompt: run_specrun(target, prompt, shaped),
        "host": lambda prompt: run_specrun(target, prompt, shaped, host=True),
        "mlx_lm": lambda prompt: run_mlx_lm(pair, prompt, args.n, args.repeat_penalty, args.last_n),
        "unshaped": lambda prompt: run_specrun(target, prompt, unshaped),
    }
    for runner in runners.values():  # warm every path once, untimed
        runner(prompts[0][:8])
    runs = interleaved(prompts, runners, args.repeat)
    same_as_host = all(run.tokens == other.tokens for a, b in zip(runs["ahead"], runs["host"]) for run, other in zip(a, b))
    same_as_mlx_lm = sum(a[0].tokens == b[0].tokens for a, b in zip(runs["ahead"], runs["mlx_lm"]))
    report = {
        "machine": machine(), "args": {key: str(value) for key, value in vars(args).items()},
        "tokens_per_second": {name: round(total_rate(runs[name]), 2) for name in RUNNERS},
        "ahead_vs_mlx_lm": round(ratio(runs["ahead"], runs["mlx_lm"]), 3),
        "host_vs_mlx_lm": round(ratio(runs["host"], runs["mlx_lm"]), 3),
        "ahead_vs_host": round(ratio(runs["ahead"], runs["host"]), 3),
        "ahead_vs_unshaped": round(ratio(runs["ahead"], runs["unshaped"]), 3),
        "ahead_text_is_host_s": same_as_host,
        "prompts_with_mlx_lm_s_text": f"{same_as_mlx_lm} of {len(prompts)}",
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0 if same_as_host else 1


if __name__ == "__main__":
    sys.exit(main())
