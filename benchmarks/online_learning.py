"""Heads and draft models that learn online (issue 55, OSD): heads trained on one kind of text (or
a draft model as it is), then a session of another; acceptance by depth and speed over the
session's tokens, with learning and without.

Two chat sessions of the same target and heads in one process, asked the same prompts in turn
(which answers first alternates), each prompt a new conversation, greedy, the draft length fixed
(``-k``, so every step drafts and acceptance by depth is measured on every position): ``static``
drafts with the heads as trained, ``learning`` with heads that learn from what the target verified
(training/online.py, ``--learn-budget`` of generation time). Learning between answers is off unless
``--idle`` (in this benchmark the other session's turn would be its idle time, stealing the CPU
from the line it is compared with), so its only time is the budget's.

The report: per segment of the session's tokens (``--segments``, cumulative new tokens), each
line's acceptance by depth (the share of steps reaching depth i whose i-th draft was accepted, as
Stats.reached_hist counts it), tokens per verify pass and tokens/s, the ratios learning / static,
and the learner's own report (steps, CPU while generating as a share of generation time).

    .venv/bin/specrun heads train --target smollm2-135m-f16 --kind medusa --minutes 4 \\
        --text CODE_DIR --heads-out runs/code.medusa.safetensors
    .venv/bin/python benchmarks/online_learning.py --target smollm2-135m-f16 \\
        --heads runs/code.medusa.safetensors --prompts ../shared/data/spec_bench/question.jsonl \\
        --tokens 2000 --json runs/osd-code-to-chat.json
    .venv/bin/python benchmarks/online_learning.py --target smollm2-135m-f16 \\
        --heads runs/chat.medusa.safetensors --suite --prompts ../shared/data/spec_bench/question.jsonl \
        --categories code-completion code-editing coding --tokens 2000

Heads learn the target's tokens; ``--labels distributions`` has those that read its final state
learn its distributions there (soft labels, --learn-labels distributions), ``--labels both`` runs
the two side by side: ``learning`` (distributions) and a third line, ``learning-tokens``, in one
interleaved run.

A draft model that learns (MLX: LoRA adapters, training/online_draft.py), ``--method draft``
(``--labels distributions``: soft labels from the rows of sampled passes, so with ``--temperature``):

    .venv/bin/python benchmarks/online_learning.py --target demo-target --draft demo-draft \
        --method draft --backend mlx --suite --categories code --tokens 2000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import SPEC_BENCH, write_report  # noqa: E402


def session_prompts(args: argparse.Namespace) -> list[str]:
    """The built-in suite's prompts (--suite), then the file's (--prompts), of --categories where
    a source has them, in their order."""
    from specrun.bench.suite import BUILTIN_SUITE, categories, load_jsonl, select

    sources = ([list(BUILTIN_SUITE)] if args.suite else []) + ([load_jsonl(Path(args.prompts))] if args.prompts else [])
    chosen = []
    for prompts in sources:
        wanted = None if args.categories is None else [c for c in args.categories if c in categories(prompts)]
        if wanted != []:
            chosen += [prompt.text for prompt in select(prompts, wanted)]
    return chosen


def answer(session, prompt: str, params):
    """The stats of one answer in a new conversation."""
    from specrun.sessions.chat import AnswerDone

    session.reset()
    done = None
    for event in session.ask(prompt, params):
        if isinstance(event, AnswerDone):
            done = event
    return done.stats, done.text


def by_depth(total) -> list[float]:
    """Acceptance at each draft position (1-based): accepted there over reached there."""
    return [round(sum(total.accepted_hist[i:]) / total.reached_hist[i], 4) if total.reached_hist[i] else 0.0
            for i in range(1, len(total.reached_hist))]


def summary(total) -> dict:
    return {
        "tokens": total.new_tokens, "steps": total.steps, "drafted": total.drafted, "accepted": total.accepted,
        "acceptance_by_depth": by_depth(total),
        "tokens_per_pass": round(total.new_tokens / total.steps, 4) if total.steps else 0.0,
        "tokens_per_second": round(total.new_tokens / total.generation_seconds, 2) if total.generation_seconds else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--heads", default=None, help="the heads as trained (read, never written)")
    parser.add_argument("--draft", default=None, help="the draft model (each line opens its own: one learns)")
    parser.add_argument("--prompts", default=None, help=f"a Spec-Bench-style JSONL file (Spec-Bench: {SPEC_BENCH})")
    parser.add_argument("--suite", action="store_true", help="the built-in suite's prompts first")
    parser.add_argument("--categories", nargs="*", default=None)
    parser.add_argument("--tokens", type=int, default=2000, help="the session's new tokens, at least")
    parser.add_argument("--segments", type=int, nargs="*", default=[500, 1000, 2000])
    parser.add_argument("--max-new", type=int, default=192)
    parser.add_argument("-k", "--draft-len", type=int, default=4)
    parser.add_argument("--method", default="medusa")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--learn-budget", type=float, default=0.02)
    parser.add_argument("--idle", action="store_true", help="let learning train between its answers too")
    parser.add_argument("--think", type=float, default=0.0,
                        help="after each prompt's two answers, wait up to this many seconds (a user reading) while "
                        "learning trains on what it read (implies --idle)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample at this temperature (each line's answers then differ by chance)")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed of every answer")
    parser.add_argument("--labels", choices=["distributions", "tokens", "both"], default="tokens",
                        help="what heads learn of the target's (both: a line of each)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    from specrun.engine.loop import GenerationParams
    from specrun.engine.stats import Stats
    from specrun.registry.loading import LoadOptions
    from specrun.sampling import SamplingSettings
    from specrun.sessions.chat import open_chat
    from specrun.training.learner import LearnSettings
    from specrun.training.online import Learning

    prompts = session_prompts(args)
    target, draft = args.target, args.draft
    if draft is None and args.heads is None:
        parser.error("pass --heads (heads that learn) or --draft (a draft model that learns)")
    load = LoadOptions(backend=args.backend, threads=args.threads)
    settings = LearnSettings(share=args.learn_budget, idle=args.idle or args.think > 0)
    learnings = {  # the learning lines: each its own learners
        name: Learning(settings, explicit=True, soft_labels=soft,
                       on_note=lambda note: print(f"note: {note}", file=sys.stderr))
        for name, soft in (("learning", args.labels != "tokens"), ("learning-tokens", False))
        if name == "learning" or args.labels == "both"
    }
    sampling = SamplingSettings(args.temperature, seed=args.seed if args.temperature > 0 else None)
    params = GenerationParams(args.max_new, args.draft_len, sampling)
    lines = {"static": open_chat(target, draft, args.method, load, heads=args.heads, draft_len=args.draft_len)}
    for name, learning in learnings.items():
        lines[name] = open_chat(target, draft, args.method, load, heads=args.heads, draft_len=args.draft_len,
                                learn=learning)

    def learners() -> list:
        return [learner for learning in learnings.values() for learner in learning.learners]

    bounds = sorted(set([*args.segments, args.tokens]))
    totals = {name: {bound: Stats() for bound in bounds} for name in lines}
    done_tokens, answers, differ, thought = 0, 0, 0, 0.0
    started = time.monotonic()
    try:
        for index, prompt in enumerate(prompts):
            if done_tokens >= args.tokens:
                break
            # with --think, learning answers last: its idle training then runs in the pause, never beside static
            order = list(lines) if index % 2 == 0 or args.think > 0 else list(lines)[::-1]
            results = {name: answer(lines[name], prompt, params) for name in order}
            if sampling.greedy:  # sampled, drafts that differ draw differently: the texts may differ
                differ += any(results[name][1] != results["static"][1] for name in learnings)
            segment = next(bound for bound in bounds if done_tokens < bound)
            for name, (stats, _) in results.items():
                totals[name][segment].add(stats)
            done_tokens += results["static"][0].new_tokens
            answers += 1
            if args.think > 0:  # the user reads: learning trains until it has caught up, both lines idle
                waited = time.monotonic()
                while time.monotonic() - waited < args.think and not all(l.caught_up for l in learners()):
                    time.sleep(0.05)
                thought += time.monotonic() - waited
            counts = "  ".join(f"{name} {results[name][0].accepted:4d}/{results[name][0].drafted:<4d}"
                               for name in lines)
            print(f"{answers:3d} {done_tokens:5d} tokens  {counts}", file=sys.stderr, flush=True)
    finally:
        for session in lines.values():  # first: a drafter hands the learner the rest of its last text
            session.close()
        reports = {name: learning.finish() for name, learning in learnings.items()}
    report = {
        "target": args.target, "heads": args.heads, "draft": args.draft, "method": args.method, "draft_len": args.draft_len,
        "prompts": [*(["built-in suite"] if args.suite else []), *([args.prompts] if args.prompts else [])],
        "categories": args.categories,
        "answers": answers, "tokens": done_tokens, "texts_differing": differ, "seconds": round(time.monotonic() - started, 1),
        "temperature": args.temperature, "learn_budget": args.learn_budget, "idle": args.idle or args.think > 0,
        "think_seconds": round(thought, 1),
        "labels": args.labels, "segments": {},
        "learner": {name: [r.to_dict() for r in made] for name, made in reports.items()},
    }
    previous = 0
    for bound in bounds:
        static = summary(totals["static"][bound])
        if not static["tokens"]:
            continue
        segment = report["segments"][f"{previous}-{bound}"] = {"static": static}
        print(f"tokens {previous}-{bound}: static {static['acceptance_by_depth']} {static['tokens_per_pass']} "
              f"tok/pass {static['tokens_per_second']} tok/s")
        for name in learnings:
            learned = summary(totals[name][bound])
            ratio = {key: round(learned[key] / static[key], 3) if static[key] else None
                     for key in ("tokens_per_pass", "tokens_per_second")}
            pairs = zip(static["acceptance_by_depth"], learned["acceptance_by_depth"])
            ratio["acceptance_by_depth"] = [round(b / a, 3) if a else None for a, b in pairs]
            segment[name] = learned
            segment["ratio" if name == "learning" else f"ratio-{name}"] = ratio
            print(f"    {name} {learned['acceptance_by_depth']} {learned['tokens_per_pass']} tok/pass "
                  f"{learned['tokens_per_second']} tok/s | ratio {ratio}")
        previous = bound
    for made in reports.values():
        for learned_report in made:
            print(learned_report.summary())
    if differ:
        print(f"texts differing: {differ} of {answers} (learning must never change a greedy text)")
    write_report(args.json, report)
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
