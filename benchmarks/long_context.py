"""Long contexts (issue 53): does speculation's gain fade as the prompt grows, and do drafts that
read a windowed cache (sinks + a recent window: StreamingLLM, MagicDec) keep it?

Documents are Python's own library sources, which ship with every Python (named in the report:
``Lib/argparse.py`` and ``Lib/inspect.py`` of the interpreter running this), cut to fill a prompt
of ``--lengths`` tokens with one of two tasks after them: summarise the code, or say what one of its
functions (the last one the cut document defines) does.

Lines, each a fresh process per prompt, greedy, ``--threads`` threads, interleaved (A B C … A B C …):
- ``specrun none`` (plain decoding, the baseline), ``specrun draft`` (the draft model, its full
  cache), ``specrun draft window`` (the draft model reading sinks + ``--window``), ``specrun
  self:window`` (the target drafting for itself through a window: no second model), ``specrun auto``
  (as a user runs it: a window of 512 held beside the draft's full cache, drafting from whichever it
  measures faster), ``specrun auto full`` (``--window 0``: the full cache alone) and ``specrun auto
  window`` (the windowed cache alone);
- with ``--tuned``: ``specrun tune --window-search`` runs first in a config folder of its own (on
  ``Lib/argparse.py``, its own long prompt: report on ``--documents inspect`` so nothing is tuned on
  the prompts reported), and ``specrun none tuned``, ``specrun draft tuned`` and ``specrun auto
  tuned`` run there: what a user who ran tune gets (its window, sinks, kernels and costs);
- with ``--llama-bin``: ``llama-completion`` and ``llama-speculative-simple`` (the same draft).

Every figure is generation speed (prompt processing excluded, as _llama_tools counts it); besides,
the report keeps each line's prefill seconds (a windowed draft reads sinks + window of the prompt, a
full-cache one all of it) and the cost against context length: plain decoding's ms a token (a
target pass) and each draft line's ms a drafted token, plotted in ``--svg``.

    .venv/bin/python benchmarks/long_context.py --target smollm2-135m-x2 --draft smollm2-135m \\
        --llama-bin LLAMA_CPP/build/bin --lengths 1000 4000 7900 --json runs/long.json --svg runs/long.svg
    .venv/bin/python benchmarks/long_context.py --target smollm2-135m-f16 --draft smollm2-135m \\
        --lengths 300 600 -n 16 --tasks summary     # does it run
    .venv/bin/python benchmarks/long_context.py --target smollm2-135m-x2 --draft smollm2-135m \\
        --lengths 1000 7900 --documents inspect --tasks function --tuned \\
        --lines "specrun draft" "specrun auto" "specrun none tuned" "specrun draft tuned" "specrun auto tuned"
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _llama_tools import (  # noqa: E402
    Line, Prompt, Run, _run_process, completion_line, geometric_mean, interleave, machine_note, ratios, save_report,
    speculative_line, untuned_env,
)
from real_model import model_path  # noqa: E402

# the documents: sources that ship with every Python
DOCUMENTS = {"argparse": Path(argparse.__file__), "inspect": Path(inspect.__file__)}
TASKS = {
    "summary": "Summarise the Python code above: what the module is for and its main parts.",
    "function": "In the Python code above, what does the function {name} do, and what are its arguments?",
}
DEF_RE = re.compile(r"^\s*def (\w+)\(", re.MULTILINE)
TUNE_TIMEOUT_S = 3600  # tune calibrates, then times windows after a long prompt: longer than one run
QUESTION_ROOM = 96  # tokens of the prompt left to the task and the chat template


def build_prompts(target: Path, lengths: list[int], tasks: list[str], documents: list[str]) -> list[Prompt]:
    """For each length, document and task, a chat prompt of about ``length`` tokens (the target's)."""
    from specrun.backends.llama import LlamaCppBackend
    from specrun.sessions.templates import ChatTemplate

    backend = LlamaCppBackend(target, n_threads=1, n_ctx=512)
    try:
        template = ChatTemplate.for_backend(backend)
        prompts = []
        for length in lengths:
            for doc_name in documents:
                path = DOCUMENTS[doc_name]
                ids = backend.tokenize(path.read_text(), add_bos=False)
                if len(ids) < length:
                    raise SystemExit(f"{path} holds {len(ids)} tokens, fewer than --lengths {length}")
                text = b"".join(backend.token_bytes(t) for t in ids[: length - QUESTION_ROOM]).decode(errors="ignore")
                names = DEF_RE.findall(text)
                for task in tasks:
                    question = TASKS[task].format(name=names[-1] if names else "main")
                    raw = f"{text}\n\n{question}"
                    rendered = template.render([{"role": "user", "content": raw}])
                    prompts.append(Prompt(f"{length}/{doc_name}/{task}", str(length), raw, rendered, True))
        return prompts
    finally:
        backend.close()


def specrun_costed(method: str, target: Path, draft: Path | None, args, env: dict, extra=(), name=None) -> Line:
    """``specrun generate --json`` (as _llama_tools.specrun_line) whose runs also record prefill seconds and drafting ms a drafted token."""
    line = Line(f"specrun {name or method}", None)
    line.costs = {}
    command = [sys.executable, "-m", "specrun", "generate", "-", "--json", "--method", method,
               "--target", str(target), "-n", str(args.n), "--threads", str(args.threads), "--ctx", str(args.ctx),
               *extra] + (["--draft", str(draft)] if draft is not None else [])

    def run(prompt: Prompt) -> Run:
        out = _run_process(command, stdin=prompt.raw, env=env)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        stats = result["stats"]
        line.costs[prompt.prompt_id] = {
            "prefill_s": stats["prefill_seconds"],
            "draft_ms_per_token": 1e3 * stats["draft_seconds"] / stats["drafted"] if stats["drafted"] else None,
            "step_ms": 1e3 * stats["generation_seconds"] / max(stats["steps"], 1),
            "acceptance": stats["acceptance_rate"],
            "tokens_per_step": stats["mean_tokens_per_step"],
            "by_source": stats["by_source"],
        }
        return Run(tokens=max(stats["new_tokens"] - 1, 0), seconds=stats["generation_seconds"],
                   new_tokens=stats["new_tokens"], prompt_tokens=stats["prompt_tokens"], drafted=stats["drafted"],
                   accepted=stats["accepted"], text=result["text"])

    line.run = run
    return line


def tune(target: Path, draft: Path, args, env: dict) -> str:
    """``specrun tune --window-search`` for the pair in ``env``'s config folder; its window line."""
    command = [sys.executable, "-m", "specrun", "tune", "-t", str(target), "-d", str(draft), "--prompts", "2",
               "--max-tokens", "64", "--window-search", "--threads", str(args.threads), "--ctx", str(args.ctx)]
    out = _run_process(command, env={**env, "COLUMNS": "400"}, timeout=TUNE_TIMEOUT_S)  # one line, unwrapped
    found = [line for line in (out.stdout + out.stderr).splitlines() if "window search (tok/s" in line]
    return found[-1].strip() if found else "(tune printed no window search)"


def build_lines(args, target: Path, draft: Path, env: dict, tuned_env: dict | None = None) -> list[Line]:
    window = ("--window", str(args.window))
    lines = [
        specrun_costed("none", target, None, args, env),
        specrun_costed("draft", target, draft, args, env),
        specrun_costed("draft", target, draft, args, env, window, "draft window"),
        specrun_costed("draft", target, None, args, env, ("--draft", "self:window", *window), "self:window"),
        specrun_costed("auto", target, draft, args, env),
        specrun_costed("auto", target, draft, args, env, ("--window", "0"), "auto full"),
        specrun_costed("auto", target, draft, args, env, window, "auto window"),
    ]
    if tuned_env is not None:
        lines += [specrun_costed("none", target, None, args, tuned_env, name="none tuned"),
                  specrun_costed("draft", target, draft, args, tuned_env, name="draft tuned"),
                  specrun_costed("auto", target, draft, args, tuned_env, name="auto tuned")]
    if args.llama_bin is not None:
        lines.append(completion_line(args.llama_bin, target, args.n, args.threads, args.ctx))
        lines.append(speculative_line(args.llama_bin, target, draft, args.n, args.threads, args.ctx, 4))
    if args.lines:  # some of them (the baseline always)
        lines = [lines[0]] + [line for line in lines[1:] if line.name in args.lines]
    return lines


def summarise(lines: list[Line], prompts: list[Prompt], lengths: list[int]) -> dict:
    baseline = lines[0]
    table: dict = {}
    for length in lengths:
        ids = [p.prompt_id for p in prompts if p.category == str(length)]
        row = {}
        for line in lines:
            ratio = list(ratios(line, baseline, ids).values())
            costs = getattr(line, "costs", {})
            prefill = [costs[i]["prefill_s"] for i in ids if i in costs]
            drafting = [costs[i]["draft_ms_per_token"] for i in ids if i in costs and costs[i]["draft_ms_per_token"]]
            steps = [costs[i]["step_ms"] for i in ids if i in costs]
            rates = [run.tokens_per_second for i in ids if (run := line.runs.get(i)) is not None]
            row[line.name] = {
                "vs_plain": geometric_mean(ratio) if ratio else None,
                "worst": min(ratio) if ratio else None,
                "tokens_per_second": geometric_mean(rates) if rates else None,
                "prefill_s": sum(prefill) / len(prefill) if prefill else None,
                "draft_ms_per_token": sum(drafting) / len(drafting) if drafting else None,
                "step_ms": sum(steps) / len(steps) if steps else None,
            }
        table[str(length)] = row
    return table


def print_table(table: dict, lines: list[Line]) -> None:
    lengths = list(table)
    print("| line | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for line in lines:
        cells = []
        for length in lengths:
            entry = table[length][line.name]
            cell = f"{entry['vs_plain']:.2f}x" if entry["vs_plain"] else "-"
            if entry["tokens_per_second"]:
                cell += f" ({entry['tokens_per_second']:.1f} tok/s)"
            cells.append(cell)
        print(f"| {line.name} | " + " | ".join(cells) + " |")
    print("\ncost against context length (ms):")
    for length in lengths:
        parts = [f"plain step {table[length]['specrun none']['step_ms']:.1f}"]
        for name, entry in table[length].items():
            if entry.get("draft_ms_per_token"):
                parts.append(f"{name} draft token {entry['draft_ms_per_token']:.1f}")
        prefill = ", ".join(f"{name} {entry['prefill_s']:.1f}s" for name, entry in table[length].items()
                            if entry.get("prefill_s") is not None)
        print(f"  {length}: " + "; ".join(parts) + f"\n     prefill: {prefill}")


def write_svg(table: dict, path: Path) -> None:
    from specrun.bench.svg import Series, colors, line_chart

    lengths = [int(n) for n in table]
    names = ["specrun none"] + [name for name in table[str(lengths[0])] if name != "specrun none"
                                and table[str(lengths[0])][name].get("draft_ms_per_token")]
    palette = colors(len(names))
    series = []
    for color, name in zip(palette, names):
        key = "step_ms" if name == "specrun none" else "draft_ms_per_token"
        label = "target pass (plain step)" if name == "specrun none" else f"{name.removeprefix('specrun ')}: a drafted token"
        series.append(Series(label, [table[str(n)][name][key] or float("nan") for n in lengths], color))
    path.write_text(line_chart("long-context-costs", "Cost against context length", lengths, series,
                               "prompt tokens", "milliseconds"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-x2")
    parser.add_argument("--draft", default="smollm2-135m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 4000, 7900])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--documents", nargs="+", default=list(DOCUMENTS), choices=list(DOCUMENTS))
    parser.add_argument("--window", type=int, default=512, help="the windowed lines' --window (not tuned here)")
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--llama-bin", type=Path, default=None)
    parser.add_argument("--lines", nargs="+", default=None,
                        help="run only these lines besides plain decoding (as the table names them)")
    parser.add_argument("--tuned", action="store_true",
                        help="run `specrun tune --window-search` first and add the lines of a tuned config")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--svg", type=Path, default=None)
    args = parser.parse_args(argv)
    target, draft = model_path(args.target), model_path(args.draft)
    prompts = build_prompts(target, args.lengths, args.tasks, args.documents)
    tuned_note = None
    with tempfile.TemporaryDirectory() as config, tempfile.TemporaryDirectory() as tuned_config:
        tuned_env = untuned_env(Path(tuned_config)) if args.tuned else None
        if tuned_env is not None:
            print("tuning (specrun tune --window-search) ...", flush=True)
            tuned_note = tune(target, draft, args, tuned_env)
            print(tuned_note, flush=True)
        lines = build_lines(args, target, draft, untuned_env(Path(config)), tuned_env)
        order = sorted(prompts, key=lambda p: (int(p.category), p.prompt_id))
        interleave(lines, order)
    table = summarise(lines, prompts, args.lengths)
    print(f"\n{args.target} + {args.draft}, {args.threads} threads, greedy, {args.n} tokens, window {args.window}; "
          f"documents: Python {sys.version.split()[0]}'s " + ", ".join(f"Lib/{DOCUMENTS[d].name}" for d in args.documents))
    print_table(table, lines)
    if tuned_note:
        print(f"tune: {tuned_note}")
    baseline_texts = lines[0].runs
    same = {line.name: sum(1 for pid, run in line.runs.items() if run and baseline_texts.get(pid)
                           and run.text == baseline_texts[pid].text) for line in lines if line.name.startswith("specrun")}
    print("texts equal plain decoding's:", same)
    report = {"machine": machine_note(), "target": args.target, "draft": args.draft, "window": args.window,
              "threads": args.threads, "tokens": args.n, "documents": {k: str(v) for k, v in DOCUMENTS.items()},
              "table": table, "same_text": same, "tuned": tuned_note,
              "runs": {line.name: {pid: vars(run) if run else None for pid, run in line.runs.items()} for line in lines},
              "costs": {line.name: getattr(line, "costs", {}) for line in lines}}
    save_report(report, args.json, "long_context")
    if args.svg is not None:
        write_svg(table, args.svg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
