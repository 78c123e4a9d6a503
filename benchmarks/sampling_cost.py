"""What turning a verify pass's rows into distributions costs, per sampling setting.

Every sampled step builds k + 1 rows over the whole vocabulary (``sampling.probabilities``; under
mirostat and adaptive-p each at the state its drafts reach, ``TargetPasses.path_p_target``), and
settings that shape rows by their text (penalties, DRY, a bias) shape each row first
(``sampling.text_shaped_rows``). This times both on a real model's own rows: one pass of
``--rows`` rows after each prompt (SmolLM2-135M F16 by default: 49,152 tokens a row), for the
built-in suite's prompts and Spec-Bench's side by side, so top-p's and typical-p's candidates
widen as they do on real text. Settings interleave on each prompt's rows, repeated; the report
gives each setting's median milliseconds a pass per prompt set and its ratio to the temperature
alone. The engine keeps freed arrays' memory mapped (specrun/allocator.py), and so does this;
SPECRUN_KEEP_FREED=0 measures without.

    .venv/bin/python benchmarks/sampling_cost.py --per-category 1 --repeats 15 --out runs/sampling_cost.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from _report import SPEC_BENCH, write_report
from specrun.allocator import keep_freed_arrays
from specrun.backends.kv import sequence_for
from specrun.backends.llama import LlamaCppBackend
from specrun.bench.runner import tokenize_prompt
from specrun.bench.suite import BUILTIN_SUITE, load_jsonl, select
from specrun.drafters.base import Proposal
from specrun.dry import Dry
from specrun.engine.passes import TargetPasses
from specrun.adaptive_p import AdaptiveP
from specrun.mirostat import Mirostat
from specrun.penalties import Penalties
from specrun.registry.loading import load_registry, resolve_gguf
from specrun.sampling import TEMPERATURE_FIRST, SamplingSettings, for_vocabulary, probabilities, text_shaped_rows

T = 0.7
SETTINGS = {
    "temperature": SamplingSettings(T),
    "top-k 40": SamplingSettings(T, top_k=40),
    "top-p 0.9": SamplingSettings(T, top_p=0.9),
    "top-p 0.9, temperature first": SamplingSettings(T, top_p=0.9, order=TEMPERATURE_FIRST),
    "min-p 0.05": SamplingSettings(T, min_p=0.05),
    "llama-server's (top-k 40, top-p 0.95, min-p 0.05)": SamplingSettings(T, top_k=40, top_p=0.95, min_p=0.05),
    "typical-p 0.9": SamplingSettings(T, typical_p=0.9),
    "top-n-sigma 1": SamplingSettings(T, top_n_sigma=1.0),
    "XTC 0.5 at 0.1": SamplingSettings(T, xtc_probability=0.5),
    "dynamic temperature ±0.5": SamplingSettings(T, dynatemp_range=0.5),
    "llama-server's, dynamic temperature ±0.5": SamplingSettings(T, top_k=40, top_p=0.95, min_p=0.05,
                                                                 dynatemp_range=0.5),
    "repeat penalty 1.1": SamplingSettings(T, penalties=Penalties(repeat=1.1)),
    "DRY 0.8, last 64": SamplingSettings(T, dry=Dry(0.8)),
    "DRY 0.8, the whole text": SamplingSettings(T, dry=Dry(0.8, last_n=-1)),
    "mirostat 2 (τ 5)": SamplingSettings(T, mirostat=Mirostat(2)),
    "mirostat 1 (τ 5)": SamplingSettings(T, mirostat=Mirostat(1)),
    "min-p 0.05, adaptive-p 0.3": SamplingSettings(T, min_p=0.05, adaptive_p=AdaptiveP(0.3)),
}


def time_pass(rows: np.ndarray, settings: SamplingSettings, text: list[int]) -> float:
    """Seconds to shape (where the settings do) and sample-prepare one pass's rows, as the engine does."""
    paths = [text[len(text) - i:] if i else [] for i in range(len(rows))]  # row i after i drafts (the text's own)
    context = text[: len(text) - len(rows) + 1]
    drafts = Proposal(tuple(text[len(text) - len(rows) + 1:]))  # the text's own, as drafts of the pass
    passes = TargetPasses(None)
    passes.start_text(settings)  # μ at its start, 2τ
    start = time.perf_counter()
    shaped = text_shaped_rows(rows, settings, context, paths) if settings.shapes_rows else rows
    if settings.carries_state:  # each row at the state its drafts reach (mirostat's μ, adaptive-p's average)
        passes.path_p_target(shaped, settings, drafts)
    else:
        probabilities(shaped, settings)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-f16", help="alias or .gguf path")
    parser.add_argument("--prompts", type=Path, default=SPEC_BENCH, help="Spec-Bench-style JSONL")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--rows", type=int, default=9, help="rows a pass (k + 1)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    keep_freed_arrays()  # as the engine does (SPECRUN_KEEP_FREED=0: not)
    model = LlamaCppBackend(resolve_gguf(args.model, load_registry()), n_ctx=2048, n_threads=args.threads)
    sets = {"built-in suite": select(BUILTIN_SUITE, per_category=args.per_category),
            "Spec-Bench": select(load_jsonl(args.prompts), per_category=args.per_category)}
    settings = {name: for_vocabulary(each, model) for name, each in SETTINGS.items()}  # DRY's breakers, looked up once
    passes: dict[str, list[tuple[np.ndarray, list[int]]]] = {}
    for set_name, prompts in sets.items():
        passes[set_name] = []
        for prompt in prompts:
            ids = tokenize_prompt(model, prompt, chat=True)[-1500:]
            sequence = sequence_for(model)
            sequence.rewind(0)
            rows = sequence.feed(ids, list(range(len(ids) - args.rows, len(ids))))  # (rows, V)
            passes[set_name].append((np.asarray(rows, dtype=np.float32), ids))
    times = {set_name: {name: [] for name in settings} for set_name in sets}
    for _ in range(args.repeats):
        for set_name, taken in passes.items():
            for rows, ids in taken:
                for name, each in settings.items():  # interleaved
                    times[set_name][name].append(time_pass(rows, each, ids))
    report = {"model": args.model, "rows": args.rows, "repeats": args.repeats, "temperature": T,
              "prompts": {set_name: len(taken) for set_name, taken in passes.items()}, "ms": {}, "ratio": {}}
    print(f"{args.model}: {args.rows} rows a pass, medians of {args.repeats} repeats per prompt, ms (ratio to the "
          "temperature alone)")
    print(f"{'setting':>52} " + " ".join(f"{set_name:>22}" for set_name in sets))
    for name in settings:
        cells = []
        for set_name in sets:
            ms = statistics.median(times[set_name][name]) * 1e3
            base = statistics.median(times[set_name]["temperature"]) * 1e3
            report["ms"].setdefault(name, {})[set_name] = ms
            report["ratio"].setdefault(name, {})[set_name] = ms / base
            cells.append(f"{ms:13.2f} ({ms / base:5.2f}x)")
        print(f"{name:>52} " + " ".join(f"{cell:>22}" for cell in cells))
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
