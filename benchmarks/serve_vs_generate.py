"""Tokens per second through `specrun serve` against `specrun generate` (issue 31: at least 0.95x).

One server stays up for the whole run, loaded once as a user runs it; every prompt goes to it
streamed through the openai client and to `specrun generate --json` in a fresh process, in turn
(A B on one prompt, B A on the next), so the machine's drift lands on both. Speeds:

- engine: tokens per second after prefill as the engine counts them (Stats.tokens_per_second:
  generate's --json statistics, the server's ``speculation`` object), the same figure both ways;
- client: the server's speed as its client sees it, from the first text chunk to the last over
  the tokens after the first, which adds HTTP, JSON and server-sent events.

A completion model of the registry (the demo pair) gets the code prompts of specrun's built-in
suite as typed (/v1/completions); a chat model gets Spec-Bench questions as one user message
(/v1/chat/completions; generate puts them in the same chat template).

    .venv/bin/python benchmarks/serve_vs_generate.py --target smollm2-135m-f16 --prompts 8
    .venv/bin/python benchmarks/serve_vs_generate.py --prompts 1 -n 16   # does it run
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from specrun.bench.suite import BUILTIN_SUITE, select
from specrun.registry.catalog import load_registry

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
CODE_CATEGORIES = ("code-completion", "code-editing")
SPECRUN = [sys.executable, "-m", "specrun"]


def prompts_for(target: str, count: int, questions: Path) -> tuple[list[str], bool]:
    """(prompt texts, chat?) for ``target``: code as typed for a completion model, else questions."""
    entry = load_registry().get(target)
    if entry is not None and entry.completion:
        return [p.text for p in select(BUILTIN_SUITE, list(CODE_CATEGORIES))][:count], False
    from specrun.bench.suite import load_jsonl

    return [p.text for p in load_jsonl(questions)][:count], True


class ServerLine:
    """`specrun serve` in a subprocess, and one streamed request at a time through the openai client."""

    def __init__(self, model_args: list[str]) -> None:
        self.process = subprocess.Popen([*SPECRUN, "serve", "--port", "0", *model_args],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for line in self.process.stderr:
            if found := re.search(r"http://\S+/v1", line):
                self.url = found.group(0)
                break
        else:
            raise SystemExit(f"specrun serve did not start (exit {self.process.wait()})")
        import openai

        self.client = openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=600)
        self.model = self.client.models.list().data[0].id

    def run(self, prompt: str, chat: bool, max_tokens: int) -> dict:
        options = dict(model=self.model, max_tokens=max_tokens, temperature=0, stream=True,
                       stream_options={"include_usage": True})
        if chat:
            stream = self.client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **options)
        else:
            stream = self.client.completions.create(prompt=prompt, **options)
        texts, times, speculation, tokens = [], [], None, 0
        for chunk in stream:
            if chunk.choices:
                choice = chunk.choices[0]
                text = choice.delta.content if chat else choice.text
                if text:
                    texts.append(text)
                    times.append(time.perf_counter())
                if choice.finish_reason:
                    speculation = chunk.model_extra["speculation"]
            elif chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        span = times[-1] - times[0] if len(times) > 1 else 0.0
        return {"text": "".join(texts), "tokens": tokens, "engine_tps": speculation["tokens_per_second"],
                "client_tps": (tokens - 1) / span if span > 0 else 0.0}

    def close(self) -> None:
        self.process.send_signal(signal.SIGINT)
        self.process.wait(timeout=60)


def generate_line(model_args: list[str], prompt: str, max_tokens: int) -> dict:
    done = subprocess.run([*SPECRUN, "generate", "--json", "-n", str(max_tokens), *model_args, "-"], input=prompt,
                          capture_output=True, text=True, check=True)
    result = json.loads(done.stdout)
    return {"text": result["text"], "tokens": result["stats"]["new_tokens"],
            "engine_tps": result["stats"]["tokens_per_second"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="demo-target")
    parser.add_argument("--draft", help="draft model (default: the registry's suggestion)")
    parser.add_argument("--method", default="auto")
    parser.add_argument("--prompts", type=int, default=8, help="prompts (default 8)")
    parser.add_argument("-n", type=int, default=128, help="new tokens (default 128)")
    parser.add_argument("--threads", type=int, default=2, help="threads for both lines (default 2)")
    parser.add_argument("--exact", action="store_true", help="pass --exact to both lines")
    parser.add_argument("--questions", type=Path, default=SPEC_BENCH, help="Spec-Bench question.jsonl (chat models)")
    parser.add_argument("--json", type=Path, help="write the raw figures here")
    args = parser.parse_args(argv)

    model_args = ["--target", args.target, "--method", args.method, "--threads", str(args.threads)]
    model_args += ["--draft", args.draft] if args.draft else []
    model_args += ["--exact"] if args.exact else []
    prompts, chat = prompts_for(args.target, args.prompts, args.questions)
    server = ServerLine(model_args)
    rows = []
    try:
        for index, prompt in enumerate(prompts):
            row = {}
            order = ("serve", "generate") if index % 2 == 0 else ("generate", "serve")
            for line in order:
                row[line] = (server.run(prompt, chat, args.n) if line == "serve"
                             else generate_line(model_args, prompt, args.n))
            row["same_text"] = row["serve"]["text"] == row["generate"]["text"]
            rows.append(row)
            print(f"prompt {index + 1}/{len(prompts)}: serve {row['serve']['engine_tps']:.1f} tok/s "
                  f"(client {row['serve']['client_tps']:.1f}), generate {row['generate']['engine_tps']:.1f} tok/s, "
                  f"{'same text' if row['same_text'] else 'TEXTS DIFFER'}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"interrupted: {len(rows)} prompts measured", file=sys.stderr)
    finally:
        server.close()

    measured = [r for r in rows if r["generate"]["engine_tps"] > 0]
    summary = {}
    for figure in ("engine_tps", "client_tps"):
        ratios = [r["serve"][figure] / r["generate"]["engine_tps"] for r in measured]
        if ratios:
            summary[f"{figure}_ratio_median"] = statistics.median(ratios)
    summary["texts_differ"] = sum(not r["same_text"] for r in rows)
    print(f"{args.target}, method {args.method}, {len(rows)} prompts, {args.n} tokens: serve/generate median "
          + ", ".join(f"{name.removesuffix('_ratio_median')} {value:.3f}x" for name, value in summary.items()
                      if name.endswith("median"))
          + f"; texts differ on {summary['texts_differ']}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                         "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
