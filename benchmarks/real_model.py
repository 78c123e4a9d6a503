"""The real model, side by side with llama.cpp (issue 26): SmolLM2-135M-Instruct F16 as target,
its shipped Q4_1 file as draft, on chat-formatted Spec-Bench questions.

Each prompt runs every line in turn (A B C … A B C …), each in a fresh process as a new
user starts one: specrun's methods (``specrun generate --json``, untuned: an empty config
folder unless --tuned), llama-cpp-python's own ``Llama.generate`` loop (plain), and, with
--llama-bin-dir, llama.cpp's ``llama-completion`` (plain), ``llama-lookup`` and
``llama-speculative-simple`` with the same draft (at one or several draft sizes), and on
request llama-server's own speculation for one client (``--tools server-draft,server-ngram-mod,
server-ngram-map-k``: ``-md`` with the same draft, and the draft-free n-gram kinds with their
defaults). ``--second-draft`` runs every line that drafts with a model once more with another
draft (``smollm2-135m-cut``, less faithful than the Q4_1 file). ``--temperature`` samples on
every line with the same filters and seed. specrun gets the raw question and applies
the chat template itself; the others get the question rendered with the model's template.
Speeds are generation only (model load and prompt processing excluded; _llama_tools.py says
how each line is timed); 128 new tokens, greedy, 2 threads.

Reported per line: the geometric mean over prompts of the per-prompt speed ratio to
llama-completion (to specrun none without the binaries), per category too, the worst
prompt, acceptance (accepted / drafted tokens) and how many texts equal specrun none's.
Raw figures go to runs/ as JSON.

    .venv/bin/python benchmarks/real_model.py --llama-bin-dir /path/to/llama.cpp/build/bin
    .venv/bin/python benchmarks/real_model.py --per-category 1 --methods none,lookup,auto   # a quick look
    .venv/bin/python benchmarks/real_model.py --methods none,auto --line "auto trees=auto --tree-nodes 16"
    .venv/bin/python benchmarks/real_model.py --llama-bin-dir BIN --llama-lookahead --methods none,lookahead \
        --line "lookahead 15:5:15=lookahead --lookahead 15:5:15"
    .venv/bin/python benchmarks/real_model.py --target demo-target-xl --draft demo-draft --raw ...  # another pair
    .venv/bin/python benchmarks/real_model.py --llama-bin-dir BIN --target smollm2-135m-x2 \
        --second-draft smollm2-135m-cut --spec-draft-max 3,4,8 --per-category 4 \
        --tools completion,lookup,speculative-simple,server-draft,server-ngram-mod,server-ngram-map-k \
        --methods none,lookup,ngram,draft,lookup+draft,lookahead,auto --line "draft trees=draft --tree-nodes 16"

``--target``/``--draft`` take the demo models' and SmolLM2's aliases (or GGUF paths); ``--raw``
gives every line the question as typed (the demo models are not chat models). A ``--line``
with a ``--draft`` of its own drafts with that.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
import tempfile
from pathlib import Path

from _llama_tools import (
    BUILTIN,
    SERVER_SPECULATION,
    Line,
    Sampling,
    check_bin_dir,
    completion_line,
    geometric_mean,
    interleave,
    line_summary,
    llama_generate_line,
    lookahead_line,
    lookup_line,
    machine_note,
    prepare,
    prompt_token_mismatches,
    ratios,
    runs_report,
    save_report,
    server_line,
    spec_bench,
    specrun_line,
    speculative_line,
    untuned_env,
)
from _report import SPEC_BENCH
from specrun.drafters.methods import needs_draft_model
from specrun.modelkit.demo import DEMO_MODELS, demo_gguf
from specrun.modelkit.selfdraft import SELF_KINDS, self_draft_gguf
from specrun.modelkit.smollm2 import smollm2_gguf

METHODS = "none,lookup,ngram,draft,lookup+draft,auto"
# llama.cpp's lines (generate: llama-cpp-python's Llama.generate; server*: llama-server, one client)
TOOLS = ("completion", "lookup", "speculative-simple", "generate", *SERVER_SPECULATION)
DEFAULT_TOOLS = ("completion", "lookup", "speculative-simple", "generate")
BINARIES = {"completion": "llama-completion", "lookup": "llama-lookup", "speculative-simple": "llama-speculative-simple",
            **{kind: "llama-server" for kind in SERVER_SPECULATION}}


def build_lines(args: argparse.Namespace, target: Path, draft: Path, second: Path | None, n_ctx: int,
                env: dict, sampling: Sampling) -> list[Line]:
    lines = []
    wanted = set(args.tools.split(","))
    unknown = wanted - set(TOOLS)
    if unknown:
        raise SystemExit(f"error: unknown --tools {sorted(unknown)[0]!r}; choose from {','.join(TOOLS)}")
    drafts = [(draft, "")] + ([(second, f" ({second.name})")] if second else [])
    bins, n, threads = args.llama_bin_dir, args.n, args.threads
    if bins:
        check_bin_dir(bins, tuple(dict.fromkeys(BINARIES[tool] for tool in TOOLS if tool in wanted and tool in BINARIES)))
        if "completion" in wanted:
            lines.append(completion_line(bins, target, n, threads, n_ctx, sampling))
        if "lookup" in wanted:
            lines.append(lookup_line(bins, target, n, threads, n_ctx, args.lookup_draft_max, sampling))
        if "speculative-simple" in wanted:
            sizes = spec_draft_sizes(args.spec_draft_max)
            for index, (each, label) in enumerate(drafts):
                for k in sizes if index == 0 else sizes[:1]:  # the second draft at the first size only
                    lines.append(speculative_line(bins, target, each, n, threads, n_ctx, k, sampling, label))
        for kind in (kind for kind in SERVER_SPECULATION if kind in wanted):
            for each, label in drafts if kind == "server-draft" else [(None, "")]:
                lines.append(server_line(bins, target, kind, n, threads, n_ctx, each, sampling, label))
    if args.llama_lookahead:
        check_bin_dir(bins, ("llama-lookahead",))
        lines.append(lookahead_line(bins, target, n, threads, n_ctx))
    if "generate" in wanted:
        lines.append(llama_generate_line(target, n, threads, n_ctx, sampling))
    for method in args.methods.split(","):
        for each, label in drafts if needs_draft_model(method) else [(None, "")]:
            lines.append(specrun_line(method, target, each, n, threads, env, sampling=sampling,
                                      name=method + label))
    for spec in args.line:  # "NAME=METHOD OPTION ...": a method with more options, e.g. token trees
        name, _, command = spec.partition("=")
        method, *extra = command.split()
        method_draft = draft if needs_draft_model(method) and "--draft" not in extra else None
        lines.append(specrun_line(method, target, method_draft, n, threads, env, tuple(extra), name, sampling))
    return lines


def spec_draft_sizes(text: str) -> list[int]:
    try:
        sizes = [int(k) for k in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"error: --spec-draft-max {text!r}: give draft sizes of 1 or more, e.g. 3,4,8")
    return sizes


def model_path(name: str) -> Path:
    """A GGUF file for ``name``: a demo model (built once), a SmolLM2 alias (derived once), or a path."""
    if name in DEMO_MODELS:
        return demo_gguf(name)
    if name.startswith("smollm2"):
        return smollm2_gguf(name)
    path = Path(name)
    if not path.is_file():
        raise SystemExit(f"error: no model {name!r}: give a demo or smollm2 alias, or a GGUF file")
    return path


def print_tables(lines: list[Line], baseline: Line, reference: Line | None, categories: dict[str, str]) -> dict:
    summaries = {line.name: line_summary(line, baseline, reference) for line in lines}
    print(f"\n| line | vs {baseline.name} | 90% interval | worst prompt | median tok/s | total tok/s "
          f"| accepted | text = specrun none |")
    print("|---|---|---|---|---|---|---|---|")
    for line in lines:
        s = summaries[line.name]
        ratio = f"{s['ratio']:.3f}×" if "ratio" in s else "–"
        interval = f"{s['ratio_low']:.3f}–{s['ratio_high']:.3f}" if "ratio" in s else "–"
        worst = f"{s['worst_ratio']:.2f}× ({s['worst_prompt']})" if "ratio" in s else "–"
        accepted = f"{100 * s['acceptance']:.1f}%" if "acceptance" in s else "–"
        same = f"{s['same_text']}/{s['compared_texts']}" if "compared_texts" in s else "–"
        print(f"| {line.name} | {ratio} | {interval} | {worst} | {s.get('median_tps', 0):.1f} | "
              f"{s.get('total_tps', 0):.1f} | {accepted} | {same} |")

    names = list(dict.fromkeys(categories.values()))
    print(f"\nPer category, geometric mean of per-prompt ratios to {baseline.name}:\n")
    print("| line | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    per_category: dict[str, dict[str, float]] = {}
    for line in lines:
        cells = []
        for category in names:
            ids = [pid for pid, c in categories.items() if c == category]
            mean = geometric_mean(list(ratios(line, baseline, ids).values()))
            per_category.setdefault(line.name, {})[category] = mean
            cells.append(f"{mean:.2f}")
        print(f"| {line.name} | " + " | ".join(cells) + " |")
    for name, summary in summaries.items():
        summary["per_category"] = per_category[name]
    return summaries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=Path, default=SPEC_BENCH,
                        help="Spec-Bench question.jsonl, or builtin: specrun bench's own suite")
    parser.add_argument("--per-category", type=int, default=8, help="questions per category (default 8)")
    parser.add_argument("--categories", help="comma-separated categories (default: all)")
    parser.add_argument("--methods", default=METHODS, help=f"specrun methods (default {METHODS})")
    parser.add_argument("--llama-bin-dir", type=Path,
                        help="folder with llama-completion, llama-lookup and llama-speculative-simple")
    parser.add_argument("--tools", default=",".join(DEFAULT_TOOLS),
                        help=f"llama.cpp's lines to run, of {','.join(TOOLS)} (default {','.join(DEFAULT_TOOLS)}; "
                        "all but generate need --llama-bin-dir; generate is llama-cpp-python's Llama.generate, "
                        "server* llama-server with one client: plain, -md with the draft, ngram-mod, ngram-map-k)")
    parser.add_argument("--llama-lookahead", action="store_true",
                        help="also llama-lookahead from --llama-bin-dir (build its target there first)")
    parser.add_argument("-n", type=int, default=128, help="new tokens (default 128)")
    parser.add_argument("--threads", type=int, default=2, help="threads for every line (default 2)")
    parser.add_argument("--lookup-draft-max", type=int, default=8, help="llama-lookup's --spec-draft-n-max (default 8)")
    parser.add_argument("--spec-draft-max", default="4",
                        help="llama-speculative-simple's --spec-draft-n-max, or several: 3,4,8 (default 4)")
    parser.add_argument("--line", action="append", default=[], metavar="NAME=METHOD OPTION ...",
                        help='one more specrun line, e.g. "auto trees=auto --tree-nodes 16" (repeatable)')
    parser.add_argument("--tuned", action="store_true", help="let specrun read the user's tune file (default: untuned)")
    parser.add_argument("--self-q4", action="store_true",
                        help="draft with the Q4_0 copy --draft self:q4 derives from the F16 target (every draft "
                        "line, llama-speculative-simple's too), not the shipped Q4_1 file")
    parser.add_argument("--target", default="smollm2-135m-f16", help="target alias or GGUF (default smollm2-135m-f16)")
    parser.add_argument("--draft", default="smollm2-135m", help="draft alias or GGUF (default smollm2-135m)")
    parser.add_argument("--second-draft", help="a second draft alias or GGUF (smollm2-135m-cut): every line that "
                        "drafts with a model runs with it too (llama-speculative-simple at the first --spec-draft-max)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample at this temperature, every line with top-k 40, top-p 0.95, min-p 0.05 "
                        "(llama.cpp's defaults) and --seed (default 0: greedy)")
    parser.add_argument("--seed", type=int, default=1, help="every line's sampling seed (default 1)")
    parser.add_argument("--raw", action="store_true", help="prompts as typed, no chat template")
    parser.add_argument("--json", type=Path, help="raw figures (default runs/real_model-TIME.json)")
    args = parser.parse_args(argv)
    if args.llama_lookahead and not args.llama_bin_dir:
        parser.error("--llama-lookahead needs --llama-bin-dir")

    if args.temperature < 0:
        parser.error("--temperature must be 0 (greedy) or more")
    sampling = Sampling(args.temperature, args.seed)
    spec_draft_sizes(args.spec_draft_max)
    target, draft = model_path(args.target), model_path(args.draft)  # derives SmolLM2's F16 copy once
    second = model_path(args.second_draft) if args.second_draft else None
    if args.self_q4:
        draft = self_draft_gguf(target, SELF_KINDS["q4"], args.target)  # derived once, as self:q4 is
    wanted = args.categories.split(",") if args.categories else None
    prompts, n_ctx = prepare(target, spec_bench(args.questions, args.per_category, wanted), chat=not args.raw)
    with tempfile.TemporaryDirectory(prefix="specrun-new-user-") as config_home:
        env = untuned_env(Path(config_home)) if not args.tuned else None
        lines = build_lines(args, target, draft, second, n_ctx, env, sampling)
        load_before = machine_note()
        print(f"{len(prompts)} prompts × {len(lines)} lines, {load_before}", file=sys.stderr)
        interleave(lines, prompts)
    load_after = machine_note()

    by_name = {line.name: line for line in lines}
    baseline = by_name.get("llama-completion") or by_name.get("specrun none") or lines[0]
    reference = by_name.get("specrun none") if sampling.greedy else None  # sampled texts differ by design
    seconds = f" (and {second.name})" if second else ""
    suite = "built-in" if str(args.questions) == BUILTIN else "Spec-Bench"
    print(f"\n{args.target} ({target.name}) + {draft.name}{seconds} as draft; {len(baseline.runs)} of {len(prompts)} "
          f"{suite} prompts run ({args.per_category} per category), {args.n} tokens, {sampling.label()}, "
          f"{args.threads} threads, "
          f"fresh process per run; {load_before} before, {load_after} after")
    summaries = print_tables(lines, baseline, reference, {p.prompt_id: p.category for p in prompts})
    mismatches = prompt_token_mismatches(lines)
    if mismatches:
        print(f"\nPrompt token counts differ on {len(mismatches)} prompts (first: {mismatches[0]})")
    for name, summary in summaries.items():
        if summary.get("differing_prompts"):
            print(f"{name}: text differs from specrun none on {', '.join(summary['differing_prompts'])}")

    report = {
        "target": str(target), "draft": str(draft), "second_draft": str(second) if second else None,
        "sampling": asdict(sampling), "n": args.n, "threads": args.threads, "n_ctx": n_ctx,
        "baseline": baseline.name, "untuned": not args.tuned, "load_before": load_before, "load_after": load_after,
        "prompts": [{"id": p.prompt_id, "category": p.category} for p in prompts],
        "summary": summaries, "prompt_token_mismatches": mismatches, "runs": runs_report(lines),
    }
    save_report(report, args.json, "real_model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
