"""specrun vs llama.cpp's own tools on one pair, interleaved per prompt.

llama.cpp's tools are built by hand outside the checkout (see docs/measuring.md) and
passed with --tools-dir. Every line reports generation speed with prompt processing
excluded: llama-completion's "eval time", llama-speculative-simple's and llama-lookup's
"decoded … speed", and specrun's generation tokens/s. Greedy, same thread count.

    .venv/bin/python benchmarks/vs_llama_cpp_tools.py --tools-dir /path/to/llama.cpp/build/bin \
        --target demo-target-xl --draft demo-draft --prompts 8 -n 128 -k 4 --threads 1
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

from _report import write_report
from specrun.backends.llama import LlamaCppBackend
from specrun.sessions.compare import forget_learned
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.sessions.setup import ADAPTIVE_MAX_DRAFT_LEN
from specrun.registry.loading import resolve_gguf
from specrun.drafters.methods import build_drafter, is_adaptive
from specrun.sessions.prompts import heldout_code_prompts
from specrun.registry.catalog import load_registry

EVAL_RE = re.compile(r"(?<!prompt )eval time =\s*[\d.]+ ms /\s*\d+ runs.*?([\d.]+) tokens per second")
DECODED_RE = re.compile(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s")
ACCEPT_RE = re.compile(r"accept\s+=\s+([\d.]+)%")


def run_tool(command: list[str], pattern: re.Pattern, retries: int = 3) -> tuple[float, float | None]:
    """tokens/s (and acceptance %, when printed) from a llama.cpp tool's log."""
    for _ in range(retries):  # llama-lookup sometimes exits without statistics
        out = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
        log = out.stdout + out.stderr
        match = pattern.search(log)
        if match:
            accept = ACCEPT_RE.search(log)
            return float(match.group(1)), float(accept.group(1)) if accept else None
    raise RuntimeError(f"no statistics from {command[0]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tools-dir", type=Path, required=True)
    parser.add_argument("--target", default="demo-target-xl")
    parser.add_argument("--draft", default="demo-draft")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--methods", default="none,draft,lookup,lookup+draft,auto")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    entries = load_registry()
    target_path, draft_path = resolve_gguf(args.target, entries), resolve_gguf(args.draft, entries)
    bin_dir, t, n, k = args.tools_dir, str(args.threads), str(args.n), str(args.k)
    tools = {
        "llama-completion": (["-m", str(target_path), "-n", n, "-t", t, "--temp", "0", "-no-cnv"], EVAL_RE),
        "llama-speculative-simple": (
            ["-m", str(target_path), "-md", str(draft_path), "--spec-type", "draft-simple",
             "--spec-draft-n-max", k, "--spec-draft-n-min", "0", "-n", n, "-t", t, "--temp", "0"],
            DECODED_RE,
        ),
        "llama-lookup": (["-m", str(target_path), "--spec-draft-n-max", k, "-n", n, "-t", t], DECODED_RE),
    }
    target = LlamaCppBackend(target_path, n_ctx=2048, n_threads=args.threads)
    draft = LlamaCppBackend(draft_path, n_ctx=2048, n_threads=args.threads)
    methods = [m for m in args.methods.split(",") if m]
    engines = {m: SpeculativeEngine(target, build_drafter(m, draft), method=m) for m in methods}
    rates: dict[str, list[float]] = {name: [] for name in [*tools, *(f"specrun {m}" for m in methods)]}
    accepts: dict[str, list[float]] = {name: [] for name in rates}
    for index, text in enumerate(heldout_code_prompts(args.prompts)):
        for name, (tool_args, pattern) in tools.items():
            speed, accept = run_tool([str(bin_dir / name), *tool_args, "-p", text], pattern)
            rates[name].append(speed)
            if accept is not None:
                accepts[name].append(accept)
        prompt = target.tokenize(text)
        for method in methods:
            adaptive = is_adaptive(method)
            draft_len = ADAPTIVE_MAX_DRAFT_LEN if adaptive else args.k
            params = GenerationParams(args.n, draft_len, stop_at_eos=False, adaptive=adaptive)
            forget_learned(engines[method])  # a fresh n-gram pool per run, as llama-lookup starts with
            result = engines[method].run(prompt, params, complete_cache=False)
            rates[f"specrun {method}"].append(result.stats.tokens_per_second)
            if result.stats.drafted:
                accepts[f"specrun {method}"].append(100 * result.stats.acceptance_rate)
        print(f"prompt {index + 1}/{args.prompts} done", file=sys.stderr)
    base_tool = statistics.median(rates["llama-completion"])
    base_ours = statistics.median(rates["specrun none"]) if "specrun none" in rates else base_tool
    best_tool = max(statistics.median(rates[name]) for name in ("llama-speculative-simple", "llama-lookup"))
    report = {"target": args.target, "draft": args.draft, "threads": args.threads, "n": args.n, "k": args.k, "lines": {}}
    print(f"{args.target} + {args.draft}, {args.prompts} prompts × {args.n} tokens, k={args.k}, {args.threads} thread(s)")
    print(f"{'line':>26} {'median tok/s':>13} {'vs llama-completion':>20} {'vs own plain':>13} {'vs best llama.cpp spec':>23} {'accept %':>9}")
    for name, values in rates.items():
        median = statistics.median(values)
        own_plain = base_ours if name.startswith("specrun") else base_tool
        accept = f"{statistics.mean(accepts[name]):.1f}" if accepts[name] else "–"
        report["lines"][name] = {"median_tps": median, "per_prompt": values, "accept_pct": accepts[name]}
        print(f"{name:>26} {median:13.1f} {median / base_tool:19.2f}× {median / own_plain:12.2f}× "
              f"{median / best_tool:22.2f}× {accept:>9}")
    write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
