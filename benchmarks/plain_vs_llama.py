"""Plain decoding against llama.cpp's (issue 33's check): ``specrun generate --method none`` vs
llama-cpp-python's own ``Llama.generate`` loop and, with --llama-bin-dir, ``llama-completion``.

Three models by default: the demo target, the bench-scale demo target and the real model
(SmolLM2-135M-Instruct F16). The demo models (completion models in the registry) know only Python:
they get the code prompts of specrun's built-in suite (completion and editing) as typed
(specrun with --raw); a chat model gets Spec-Bench questions, which specrun puts in the
model's chat template itself and the other lines get rendered.
Per prompt the lines run in turn (A B C … A B C …), each in a fresh process; speeds are
generation only (model load and prompt processing excluded: _llama_tools.py says how each
line is timed). Greedy, 128 new tokens, 2 threads.

    .venv/bin/python benchmarks/plain_vs_llama.py --llama-bin-dir /path/to/llama.cpp/build/bin
    .venv/bin/python benchmarks/plain_vs_llama.py --models demo-target --prompts 2   # a quick look
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from _llama_tools import (
    Line,
    check_bin_dir,
    completion_line,
    interleave,
    line_summary,
    llama_generate_line,
    machine_note,
    median_tps,
    prepare,
    prompt_token_mismatches,
    runs_report,
    save_report,
    spec_bench,
    specrun_line,
    untuned_env,
)
from _report import SPEC_BENCH
from specrun.bench.suite import BUILTIN_SUITE, select
from specrun.registry.loading import resolve_gguf
from specrun.registry.catalog import entry_for, load_registry

MODELS = "demo-target,demo-target-xl,smollm2-135m-f16"
CODE_CATEGORIES = ("code-completion", "code-editing")


def code_prompts(count: int) -> list:
    """``count`` code prompts of the built-in suite, completion and editing in turn."""
    columns = [select(BUILTIN_SUITE, [category]) for category in CODE_CATEGORIES]
    mixed = [column[i] for i in range(max(map(len, columns))) for column in columns if i < len(column)]
    return mixed[:count]


def ratio_cell(summary: dict) -> str:
    if "ratio" not in summary:
        return "–"
    return f"{summary['ratio']:.3f}× ({summary['ratio_low']:.3f}–{summary['ratio_high']:.3f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=MODELS, help=f"comma-separated targets (default {MODELS})")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per model (default 8)")
    parser.add_argument("--questions", type=Path, default=SPEC_BENCH, help="Spec-Bench question.jsonl (chat models)")
    parser.add_argument("--llama-bin-dir", type=Path, help="folder with llama-completion")
    parser.add_argument("-n", type=int, default=128, help="new tokens (default 128)")
    parser.add_argument("--threads", type=int, default=2, help="threads for every line (default 2)")
    parser.add_argument("--json", type=Path, help="raw figures (default runs/plain_vs_llama-TIME.json)")
    args = parser.parse_args(argv)

    if args.llama_bin_dir:
        check_bin_dir(args.llama_bin_dir, ("llama-completion",))
    entries = load_registry()
    per_category = -(-args.prompts // 13)  # Spec-Bench has 13 categories
    chat = spec_bench(args.questions, per_category)[: args.prompts]
    code = code_prompts(args.prompts)
    report: dict = {"n": args.n, "threads": args.threads, "models": {}}
    rows = []
    with tempfile.TemporaryDirectory(prefix="specrun-new-user-") as config_home:
        env = untuned_env(Path(config_home))
        for model in args.models.split(","):
            path = resolve_gguf(model, entries)
            completion_model = entry_for(model, entries).completion  # the demo pair: Python source, not chat
            prompts, n_ctx = prepare(path, code if completion_model else chat, chat=not completion_model)
            ours = specrun_line("none", path, None, args.n, args.threads, env)
            generate = llama_generate_line(path, args.n, args.threads, n_ctx)
            lines: list[Line] = [ours, generate]
            completion = None
            if args.llama_bin_dir:
                completion = completion_line(args.llama_bin_dir, path, args.n, args.threads, n_ctx)
                lines.insert(0, completion)
            load = machine_note()
            complete = interleave(lines, prompts, label=f"{model} ")
            vs_generate = line_summary(ours, generate, reference=generate)
            vs_completion = line_summary(ours, completion) if completion else {}
            rows.append((model, ours, generate, completion, vs_completion, vs_generate))
            report["models"][model] = {
                "path": str(path), "n_ctx": n_ctx, "load_before": load, "load_after": machine_note(),
                "prompts": [p.prompt_id for p in prompts],
                "none_vs_llama_completion": vs_completion, "none_vs_llama_generate": vs_generate,
                "llama_generate_vs_llama_completion": line_summary(generate, completion) if completion else {},
                "prompt_token_mismatches": prompt_token_mismatches(lines), "runs": runs_report(lines),
            }
            if not complete:  # Ctrl-C: report what was measured
                break

    print(f"\nspecrun --method none vs llama.cpp's plain decoding: {args.prompts} prompts per model, "
          f"{args.n} tokens, greedy, {args.threads} threads, fresh process per run, interleaved; "
          f"{machine_note()} at the end")
    print("\n| model | specrun none tok/s | Llama.generate tok/s | llama-completion tok/s | none / llama-completion "
          "| none / Llama.generate | text = Llama.generate |")
    print("|---|---|---|---|---|---|---|")
    for model, ours, generate, completion, vs_completion, vs_generate in rows:
        medians = [median_tps(line) if line else None for line in (ours, generate, completion)]
        cells = [f"{m:.1f}" if m is not None else "–" for m in medians]
        same = (f"{vs_generate['same_text']}/{vs_generate['compared_texts']}"
                if "compared_texts" in vs_generate else "–")
        print(f"| {model} | {' | '.join(cells)} | {ratio_cell(vs_completion)} | {ratio_cell(vs_generate)} | {same} |")
    for model, entry in report["models"].items():
        if entry["prompt_token_mismatches"]:
            print(f"{model}: prompt token counts differ: {entry['prompt_token_mismatches'][0]}")
    print("(tok/s: medians over prompts; ratios: geometric means of per-prompt ratios, 90% bootstrap interval)")
    save_report(report, args.json, "plain_vs_llama")
    return 0


if __name__ == "__main__":
    sys.exit(main())
