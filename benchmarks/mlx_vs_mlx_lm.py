"""specrun's MLX backend against mlx-lm's own speculative decoding, side by side (issue 4).

One run, one loaded pair (the weights are shared by all runners), the same prompts
and draft length. Per prompt, interleaved (the runner order rotates from prompt to
prompt so none always runs first):

1. ``specrun``      — SpeculativeEngine + DraftModelDrafter (``--method draft``) on MlxBackend
2. ``mlx_lm_spec``  — ``mlx_lm.stream_generate(..., draft_model=..., num_draft_tokens=k)``
3. ``mlx_lm_plain`` — ``mlx_lm.stream_generate`` with no draft

Greedy first: tokens/s (median per prompt, and totals), acceptance, and whether the
outputs are token-identical to mlx-lm's plain decoding. ``--repeat N`` runs the greedy
comparison N times (odd repeats take the prompts in reverse) and pools them: on a CPU one
prompt's specrun/mlx-lm ratio swings by up to ±30% from run to run for identical work, more
than the difference looked for, so each prompt's ratio is taken between its medians. Then, at ``--temp`` (0.7 by
default; 0 skips it), the two speculative runners sampled: specrun accepts by
rejection sampling (per-token acceptance Σ min(p_target, p_draft)); mlx-lm samples
the target and compares it with the draft's sample (Σ p_target·p_draft). mlx-lm's
accepted count is the number of responses with ``from_draft``; its drafted count is
rebuilt from its fixed schedule (min(k, tokens left) per verify step).

Timing is generation only: every runner starts with both caches already holding the
prompt minus its last token (prefilled untimed, as mlx-lm's own prefill would), and
the clock runs from the first call to the last token, detokenization included.
Model loading and prefill are excluded.

    .venv/bin/python benchmarks/mlx_vs_mlx_lm.py --target demo-target-xl --draft demo-draft \\
        --prompts 20 -n 128 -k 4 --temp 0.7 --repeat 3 --json docs/figures/mlx_vs_mlx_lm.json

--target/--draft take MLX folders, Hugging Face repo ids or registry aliases.
--prompt-set spec-bench uses first turns of ../shared/data/spec_bench/question.jsonl
(the Spec-Bench question set beside the checkout, docs/measuring.md; rendered with the chat
template) instead of held-out Python.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from _report import SPEC_BENCH
from specrun.backends.mlx import MlxBackend
from specrun.registry.compat import check_compatible
from specrun.drafters.draft_model import DraftModelDrafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.backends.kv import sequence_for
from specrun.registry.loading import resolve_mlx
from specrun.sessions.prompts import heldout_code_prompts
from specrun.registry.catalog import load_registry
from specrun.sampling import SamplingSettings

RUNNERS = ("specrun", "mlx_lm_spec", "mlx_lm_plain")


@dataclass(frozen=True)
class Run:
    """One runner on one prompt: the tokens it produced and the generation seconds."""

    tokens: list[int]
    seconds: float
    drafted: int = 0
    accepted: int = 0

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds


@dataclass
class Pair:
    """The loaded target and draft: mlx-lm modules plus specrun backends over the same weights."""

    target_model: object
    draft_model: object
    tokenizer: object
    target: MlxBackend
    draft: MlxBackend


def load_pair(target_spec: str, draft_spec: str) -> Pair:
    """Load both models once with mlx_lm.load; specrun's backends wrap the same modules."""
    entries = load_registry()
    target_model, tokenizer, target_config = mlx_lm.load(resolve_mlx(target_spec, entries), return_config=True)
    draft_model, draft_tokenizer, draft_config = mlx_lm.load(resolve_mlx(draft_spec, entries), return_config=True)
    target = MlxBackend.from_loaded(target_model, tokenizer, target_config, n_ctx=4096)
    draft = MlxBackend.from_loaded(draft_model, draft_tokenizer, draft_config, n_ctx=4096)
    check_compatible(target, draft, target_spec, draft_spec)
    return Pair(target_model, draft_model, tokenizer, target, draft)


def load_prompts(pair: Pair, prompt_set: str, count: int) -> list[list[int]]:
    """Token ids of ``count`` prompts: held-out Python, or Spec-Bench first turns through the chat template."""
    if prompt_set == "code":
        return [pair.target.tokenize(text, add_bos=pair.target.vocab.add_bos) for text in heldout_code_prompts(count)]
    questions = [json.loads(line) for line in SPEC_BENCH.read_text(encoding="utf-8").splitlines() if line.strip()]
    chosen = questions[:: max(1, len(questions) // count)][:count]  # spread over the 13 categories
    prompts = []
    for question in chosen:
        message = [{"role": "user", "content": question["turns"][0]}]
        if pair.tokenizer.has_chat_template:
            prompts.append(list(pair.tokenizer.apply_chat_template(message, add_generation_prompt=True)))
        else:
            prompts.append(pair.target.tokenize(question["turns"][0], add_bos=pair.target.vocab.add_bos))
    return prompts


# ---- the runners ------------------------------------------------------------------------
def run_specrun(pair: Pair, prompt: list[int], params: GenerationParams) -> Run:
    """specrun's engine with both caches prefilled to prompt[:-1] before the clock starts."""
    target_cache, draft_cache = sequence_for(pair.target), sequence_for(pair.draft)
    for cache in (target_cache, draft_cache):
        cache.sync(prompt[:-1])
    engine = SpeculativeEngine(pair.target, DraftModelDrafter(pair.draft))
    started = time.perf_counter()
    result = engine.run(prompt, params, complete_cache=False)
    seconds = time.perf_counter() - started
    return Run(result.token_ids, seconds, result.stats.drafted, result.stats.accepted)


def prefilled_cache(model, prompt: list[int]) -> list:
    """A fresh mlx-lm prompt cache holding prompt[:-1]."""
    cache = make_prompt_cache(model)
    model(mx.array(prompt[:-1])[None], cache=cache)
    mx.eval([layer.state for layer in cache])
    return cache


def run_mlx_lm(pair: Pair, prompt: list[int], max_tokens: int, temperature: float, draft_len: int) -> Run:
    """mlx_lm.stream_generate from prefilled caches; speculative when ``draft_len`` > 0."""
    cache = prefilled_cache(pair.target_model, prompt)
    speculative = {}
    if draft_len > 0:
        cache += prefilled_cache(pair.draft_model, prompt)
        speculative = {"draft_model": pair.draft_model, "num_draft_tokens": draft_len}
    sampler = make_sampler(temp=temperature)
    started = time.perf_counter()
    responses = list(
        mlx_lm.stream_generate(
            pair.target_model, pair.tokenizer, mx.array(prompt[-1:]), max_tokens,
            sampler=sampler, prompt_cache=cache, **speculative,
        )
    )
    seconds = time.perf_counter() - started
    from_draft = [response.from_draft for response in responses]
    drafted = mlx_lm_drafted(from_draft, draft_len, max_tokens) if draft_len else 0
    return Run([response.token for response in responses], seconds, drafted, sum(from_draft))


def mlx_lm_drafted(from_draft: list[bool], draft_len: int, max_tokens: int) -> int:
    """How many tokens mlx-lm drafted, rebuilt from its schedule.

    Each verify step drafts min(draft_len, max_tokens - produced) tokens and emits
    its accepted drafts (from_draft) then one target token (absent only when the
    step reached max_tokens).
    """
    drafted = produced = i = 0
    while i < len(from_draft):
        drafted += min(draft_len, max_tokens - produced)
        accepted = 0
        while i < len(from_draft) and from_draft[i]:
            i += 1
            accepted += 1
        i += 1  # the target's own token
        produced += accepted + 1
    return drafted


# ---- the comparison ----------------------------------------------------------------------
def interleaved(
    prompts: list[list[int]], runners: dict[str, Callable[[list[int]], Run]], repeat: int = 1
) -> dict[str, list[list[Run]]]:
    """Every runner on every prompt, ``repeat`` times: runs[name][i] holds prompt i's runs.

    The order rotates per prompt, and odd repeats take the prompts in reverse, so no runner
    or prompt always comes first or last.
    """
    names = list(runners)
    runs: dict[str, list[list[Run]]] = {name: [[] for _ in prompts] for name in names}
    for r in range(repeat):
        indices = range(len(prompts)) if r % 2 == 0 else reversed(range(len(prompts)))
        for i in indices:
            order = names[(i + r) % len(names) :] + names[: (i + r) % len(names)]
            for name in order:
                runs[name][i].append(runners[name](prompts[i]))
    return runs


def summarize(runs: list[list[Run]]) -> dict:
    """Totals over every run; the median over prompts of each prompt's median tokens/s."""
    flat = [run for per_prompt in runs for run in per_prompt]
    tokens = sum(len(run.tokens) for run in flat)
    seconds = sum(run.seconds for run in flat)
    drafted = sum(run.drafted for run in flat)
    accepted = sum(run.accepted for run in flat)
    return {
        "median_tokens_per_second": statistics.median(
            statistics.median(run.tokens_per_second for run in per_prompt) for per_prompt in runs
        ),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
    }


def ratios(ours: list[list[Run]], theirs: list[list[Run]]) -> dict:
    """specrun against mlx-lm: per repeat (median of per-prompt ratios, total-time ratio), and
    pooled (median over prompts of the ratio of per-prompt medians; totals over all runs).
    One prompt's ratio swings by up to ±30% between repeats on a CPU, so pool them."""
    repeats = len(ours[0])

    def rate(runs: list[Run]) -> float:
        return sum(len(run.tokens) for run in runs) / sum(run.seconds for run in runs)

    per_repeat = []
    for r in range(repeats):
        mine, other = [p[r] for p in ours], [p[r] for p in theirs]
        per_repeat.append({
            "median_ratio": statistics.median(a.tokens_per_second / b.tokens_per_second for a, b in zip(mine, other)),
            "total_ratio": rate(mine) / rate(other),
        })
    pooled = [
        statistics.median(run.tokens_per_second for run in a) / statistics.median(run.tokens_per_second for run in b)
        for a, b in zip(ours, theirs)
    ]
    flat_ours = [run for p in ours for run in p]
    flat_theirs = [run for p in theirs for run in p]
    return {"median_ratio": statistics.median(pooled), "total_ratio": rate(flat_ours) / rate(flat_theirs),
            "per_repeat": per_repeat}


def greedy_section(pair: Pair, prompts: list[list[int]], n_new: int, draft_len: int, repeat: int) -> dict:
    warm_up(pair, prompts[0], draft_len, 0.0)
    params = GenerationParams(n_new, draft_len)
    runs = interleaved(
        prompts,
        {
            "specrun": lambda prompt: run_specrun(pair, prompt, params),
            "mlx_lm_spec": lambda prompt: run_mlx_lm(pair, prompt, n_new, 0.0, draft_len),
            "mlx_lm_plain": lambda prompt: run_mlx_lm(pair, prompt, n_new, 0.0, 0),
        },
        repeat,
    )
    report = {name: summarize(runs[name]) for name in RUNNERS}
    reference = [run for per_prompt in runs["mlx_lm_plain"] for run in per_prompt]
    for name in ("specrun", "mlx_lm_spec"):
        mine = [run for per_prompt in runs[name] for run in per_prompt]
        report[name]["identical_to_plain"] = sum(a.tokens == b.tokens for a, b in zip(mine, reference))
    report["specrun_vs_mlx_lm_spec"] = ratios(runs["specrun"], runs["mlx_lm_spec"])
    return report


def sampled_section(pair: Pair, prompts: list[list[int]], n_new: int, draft_len: int, temperature: float) -> dict:
    seeds = itertools.count(1)  # one seed per prompt: reproducible, not the same stream every time

    def ours(prompt: list[int]) -> Run:
        params = GenerationParams(n_new, draft_len, SamplingSettings(temperature=temperature, seed=next(seeds)))
        return run_specrun(pair, prompt, params)

    warm_up(pair, prompts[0], draft_len, temperature)
    mx.random.seed(0)
    runs = interleaved(
        prompts,
        {"specrun": ours, "mlx_lm_spec": lambda prompt: run_mlx_lm(pair, prompt, n_new, temperature, draft_len)},
    )
    return {name: summarize(runs[name]) for name in runs}


def warm_up(pair: Pair, prompt: list[int], draft_len: int, temperature: float) -> None:
    """One short run of each runner, so first-call allocation and mlx-lm's sampler compilation are not timed."""
    run_specrun(pair, prompt, GenerationParams(8, draft_len, SamplingSettings(temperature=temperature, seed=0)))
    run_mlx_lm(pair, prompt, 8, temperature, draft_len)
    run_mlx_lm(pair, prompt, 8, temperature, 0)


# ---- output ------------------------------------------------------------------------------
def print_table(title: str, section: dict, names: tuple[str, ...]) -> None:
    print(title)
    print(f"{'runner':>14} {'median tok/s':>13} {'total tok/s':>12} {'tokens':>7} {'accepted':>9} {'identical':>10}")
    for name in names:
        row = section[name]
        rate = row["acceptance_rate"]
        identical = row.get("identical_to_plain")
        print(
            f"{name:>14} {row['median_tokens_per_second']:>13.1f} {row['tokens_per_second']:>12.1f} "
            f"{row['tokens']:>7} {'-' if rate is None else f'{rate:.1%}':>9} "
            f"{'-' if identical is None else identical:>10}"
        )


def machine() -> dict:
    return {
        "device": str(mx.default_device()),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="demo-target")
    parser.add_argument("--draft", default="demo-draft")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--prompt-set", choices=("code", "spec-bench"), default="code")
    parser.add_argument("-n", type=int, default=128, help="new tokens per prompt")
    parser.add_argument("-k", type=int, default=4, help="draft length")
    parser.add_argument("--temp", type=float, default=0.7, help="temperature of the sampled comparison (0: skip it)")
    parser.add_argument("--repeat", type=int, default=1, help="greedy runs per prompt and runner (pooled)")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)

    pair = load_pair(args.target, args.draft)
    prompts = load_prompts(pair, args.prompt_set, args.prompts)
    report = {
        "target": args.target,
        "draft": args.draft,
        "prompt_set": args.prompt_set,
        "prompts": len(prompts),
        "new_tokens": args.n,
        "draft_len": args.k,
        "timing": "generation only: load and prefill excluded",
        "machine": machine(),
        "repeat": args.repeat,
        "greedy": greedy_section(pair, prompts, args.n, args.k, args.repeat),
    }
    shape = f"k={args.k}, {len(prompts)} prompts × {args.n} tokens"
    print(f"{args.target} + {args.draft}, {shape} on {mx.default_device()}")
    print_table("greedy (identical: runs token-identical to mlx_lm_plain's)", report["greedy"], RUNNERS)
    ratio = report["greedy"]["specrun_vs_mlx_lm_spec"]
    for r, reading in enumerate(ratio["per_repeat"], 1):
        print(f"  repeat {r}: {reading['median_ratio']:.3f}x median per prompt, {reading['total_ratio']:.3f}x total")
    print(f"specrun / mlx_lm_spec: {ratio['median_ratio']:.3f}x median per prompt, {ratio['total_ratio']:.3f}x total")
    if args.temp > 0:
        report["temperature"] = args.temp
        report["sampled"] = sampled_section(pair, prompts, args.n, args.k, args.temp)
        print_table(f"temperature {args.temp}", report["sampled"], ("specrun", "mlx_lm_spec"))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
