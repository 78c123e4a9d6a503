"""Constrained decoding, speculative against plain (issue 52): JSON-schema extraction, forced tool
calls and Spec-Bench questions answered as JSON, each line under the same grammar.

Lines, interleaved per prompt in fresh processes (docs/measuring.md):
- ``specrun none``: constrained plain decoding (`specrun generate --json-schema/--grammar`), the
  baseline every ratio is taken against;
- ``specrun auto`` and ``specrun draft``: the same grammar, speculating (the tokens the grammar
  forces are drafted for free);
- ``llama-server`` and ``llama-server -md`` (with ``--llama-bin``): the same schema as llama-server's
  ``json_schema`` field, plainly and with its draft-model speculation (extraction and Spec-Bench
  prompts: llama-server takes no Lark grammar, so the tool prompts are specrun's alone).

Three prompt sets, reported apart (a figure tuned on one set does not hold on another):
- extraction: eight texts, each with a schema of the facts to pull out of it;
- tools: six requests with the same four tools, a call required (`generate --tools FILE
  --tool-choice required`: the tools rendered as `specrun serve` renders them, one call forced);
- spec-bench: Spec-Bench questions, the answer a JSON object {"answer": ...}.

    .venv/bin/python benchmarks/constrained.py --target smollm2-135m-x2 --draft smollm2-135m \\
        --llama-bin LLAMA_CPP/build/bin --spec-bench 13
    .venv/bin/python benchmarks/constrained.py --target smollm2-135m-f16 --draft smollm2-135m --spec-bench 13
    .venv/bin/python benchmarks/constrained.py -n 24 --sets extraction --limit 1   # does it run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _llama_tools import (  # noqa: E402
    SERVER_SPECULATION, Line, Prompt, Run, RunFailed, _free_port, _post_json, _run_process, _wait_until_ready,
    check_bin_dir, interleave, line_summary, machine_note, prepare, save_report, spec_bench, untuned_env,
)
from real_model import model_path  # noqa: E402

from specrun.bench.suite import BenchPrompt  # noqa: E402

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties),
            "additionalProperties": False}


TEXT = {"type": "string", "maxLength": 80}
EXTRACTION = [
    ("Alice Martin, 34, moved from Lyon to Toronto in 2019 to work as a nurse at St. Michael's Hospital.",
     _obj({"name": TEXT, "age": {"type": "integer"}, "from_city": TEXT, "to_city": TEXT, "year": {"type": "integer"},
           "job": TEXT})),
    ("The Fjord 2 headphones cost $249, weigh 260 g, last 30 hours on a charge and come in black or silver.",
     _obj({"product": TEXT, "price_usd": {"type": "number"}, "weight_g": {"type": "integer"},
           "battery_hours": {"type": "integer"}, "colours": {"type": "array", "items": TEXT, "maxItems": 5}})),
    ("Meeting with the design team on Tuesday 14 May at 10:30 in room 4B to review the onboarding flow; "
     "bring the survey results.",
     _obj({"title": TEXT, "day": TEXT, "date": TEXT, "time": TEXT, "room": TEXT, "to_bring": TEXT})),
    ("Order #58213: 2 x USB-C cable (9.99 each), 1 x laptop stand (34.50), shipping 5.00, total 59.48.",
     _obj({"order_id": TEXT, "items": {"type": "array", "maxItems": 5, "items": _obj(
         {"name": TEXT, "quantity": {"type": "integer"}, "unit_price": {"type": "number"}})},
           "shipping": {"type": "number"}, "total": {"type": "number"}})),
    ("Paris, 3 June: 24°C and sunny in the afternoon, light wind from the west, 10% chance of rain.",
     _obj({"city": TEXT, "date": TEXT, "temperature_c": {"type": "integer"}, "sky": TEXT, "wind": TEXT,
           "rain_chance_percent": {"type": "integer"}})),
    ("Dr. Kenji Watanabe (kenji.w@example.org, +81 3 1234 5678) leads the robotics lab at Kyoto Institute.",
     _obj({"name": TEXT, "title": TEXT, "email": TEXT, "phone": TEXT, "role": TEXT, "organisation": TEXT})),
    ("The flight BA 117 leaves London Heathrow at 08:25 and lands in New York JFK at 11:05 local time; "
     "seat 32A, economy.",
     _obj({"flight": TEXT, "from_airport": TEXT, "to_airport": TEXT, "departs": TEXT, "arrives": TEXT,
           "seat": TEXT, "cabin": {"enum": ["economy", "premium", "business", "first"]}})),
    ("Bug report: the app crashes on Android 14 when uploading a photo larger than 20 MB; reported by 12 users; "
     "priority high.",
     _obj({"summary": TEXT, "platform": TEXT, "trigger": TEXT, "reports": {"type": "integer"},
           "priority": {"enum": ["low", "medium", "high"]}})),
]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": _obj({"city": TEXT, "unit": {"enum": ["C", "F"]}})}},
    {"type": "function", "function": {"name": "search_web", "description": "Search the web",
                                      "parameters": _obj({"query": TEXT, "results": {"type": "integer"}})}},
    {"type": "function", "function": {"name": "create_event", "description": "Add an event to the calendar",
                                      "parameters": _obj({"title": TEXT, "date": TEXT, "time": TEXT})}},
    {"type": "function", "function": {"name": "send_email", "description": "Send an email",
                                      "parameters": _obj({"to": TEXT, "subject": TEXT, "body": TEXT})}},
]
TOOL_REQUESTS = [
    "What's the weather like in Oslo right now, in Celsius?",
    "Find me the three best reviews of the new Fjord 2 headphones.",
    "Put lunch with Sam on the calendar for Friday the 9th at 12:30.",
    "Email Priya that the report is late and will arrive on Monday.",
    "Is it raining in Buenos Aires? Use Fahrenheit.",
    "Search for how to repot an orchid, five results.",
]
ANSWER = _obj({"answer": {"type": "string", "maxLength": 1200}})


def bench_prompts(sets: list[str], spec_bench_per_category: int, limit: int | None) -> list[tuple[BenchPrompt, str, dict]]:
    """(prompt, grammar kind, schema or tools) for every prompt of the sets asked, the sets
    interleaved so the machine's drift lands on each."""
    columns = []
    if "extraction" in sets:
        columns.append([(BenchPrompt(f"extract-{i}", "extraction", f"Extract the facts as JSON:\n{text}"),
                         "json_schema", schema) for i, (text, schema) in enumerate(EXTRACTION)])
    if "tools" in sets:
        columns.append([(BenchPrompt(f"tools-{i}", "tools", text), "tools", {"tools": TOOLS})
                        for i, text in enumerate(TOOL_REQUESTS)])
    if "spec-bench" in sets and spec_bench_per_category:
        columns.append([(BenchPrompt(p.prompt_id, f"spec-bench/{p.category}",
                                     f"{p.text}\n\nAnswer as a JSON object with one field, \"answer\"."),
                         "json_schema", ANSWER) for p in spec_bench(SPEC_BENCH, spec_bench_per_category)])
    rows = [column[i] for i in range(max(map(len, columns), default=0)) for column in columns if i < len(column)]
    return rows[:limit] if limit else rows


def grammar_files(folder: Path, model: Path, entries: list[tuple[BenchPrompt, str, dict]]):
    """The prompts as every line gets them, and per prompt the options specrun takes its grammar
    (or its tools) by and the JSON schema llama-server gets (None for a tool call)."""
    prompts, n_ctx = prepare(model, [entry[0] for entry in entries], chat=True)
    options, schemas = {}, {}
    for prompt, kind, spec in entries:
        path = folder / f"{prompt.prompt_id}.json"
        path.write_text(json.dumps(spec))
        if kind == "tools":  # a call required: generate renders the tools and forces one
            options[prompt.prompt_id], schemas[prompt.prompt_id] = ["--tools", str(path), "--tool-choice",
                                                                    "required"], None
        else:
            options[prompt.prompt_id], schemas[prompt.prompt_id] = ["--json-schema", str(path)], spec
    return prompts, options, schemas, n_ctx


def specrun_constrained(method: str, target: Path, draft: Path | None, n: int, threads: int, env: dict,
                        options: dict[str, list[str]]) -> Line:
    """``specrun generate --json`` with the prompt's grammar, in a fresh process per prompt."""

    def run(prompt: Prompt) -> Run:
        command = [sys.executable, "-m", "specrun", "generate", "-", "--json", "--method", method,
                   "--target", str(target), "-n", str(n), "--threads", str(threads), *options[prompt.prompt_id]]
        if draft is not None and method != "none":
            command += ["--draft", str(draft)]
        out = _run_process(command if prompt.chat else [*command, "--raw"], stdin=prompt.raw, env=env)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        stats = result["stats"]
        return Run(tokens=max(stats["new_tokens"] - 1, 0), seconds=stats["generation_seconds"],
                   new_tokens=stats["new_tokens"], prompt_tokens=stats["prompt_tokens"], drafted=stats["drafted"],
                   accepted=stats["accepted"], text=result["text"])

    return Line(f"specrun {method}", run)


def server_constrained(bin_dir: Path, model: Path, draft: Path | None, n: int, threads: int, n_ctx: int,
                       schemas: dict[str, dict | None]) -> Line:
    """llama-server (with ``draft``: its draft-model speculation) started afresh per prompt, sent the
    prompt's schema as its json_schema field; a tool prompt (no schema llama-server takes) is skipped."""
    options = [*SERVER_SPECULATION["server-draft" if draft else "server"], *(["-md", str(draft)] if draft else [])]

    def run(prompt: Prompt) -> Run:
        schema = schemas[prompt.prompt_id]
        if schema is None:
            raise RunFailed("llama-server takes no Lark grammar: tool prompts are specrun's alone")
        port = _free_port()
        command = [str(bin_dir / "llama-server"), "-m", str(model), "-t", str(threads), "-tb", str(threads),
                   "-c", str(n_ctx), "-np", "1", "--host", "127.0.0.1", "--port", str(port), "--no-webui", *options]
        with tempfile.TemporaryFile("w+", errors="replace") as log:
            server = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            try:
                _wait_until_ready(server, port, log)
                reply = _post_json(f"http://127.0.0.1:{port}/completion", {
                    "prompt": prompt.rendered, "n_predict": n, "cache_prompt": False, "temperature": 0.0,
                    "json_schema": schema})
            finally:
                server.terminate()
                server.wait(timeout=30)
        timings = reply["timings"]
        generated = int(timings["predicted_n"])
        return Run(tokens=max(generated - 1, 0), seconds=float(timings["predicted_ms"]) / 1e3, new_tokens=generated,
                   prompt_tokens=int(timings["prompt_n"]), drafted=timings.get("draft_n"),
                   accepted=timings.get("draft_n_accepted"), text=reply.get("content"))

    return Line("llama-server -md" if draft else "llama-server", run)


def valid_answers(line: Line, schemas: dict[str, dict | None]) -> tuple[int, int]:
    """How many of a line's finished answers parse and follow their schema (tool calls: parse as a call)."""
    import jsonschema

    from specrun.sessions.tools import STYLES

    good = total = 0
    for pid, run in line.runs.items():
        if run is None or run.text is None:
            continue
        total += 1
        schema = schemas.get(pid)
        try:
            if schema is None:
                good += bool(STYLES["hermes"].parse(run.text)[1])
            else:
                jsonschema.validate(json.loads(run.text), schema)
                good += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return good, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-x2")
    parser.add_argument("--draft", default="smollm2-135m")
    parser.add_argument("--methods", default="none,auto,draft")
    parser.add_argument("--sets", default="extraction,tools,spec-bench")
    parser.add_argument("--spec-bench", type=int, default=1, help="Spec-Bench questions per category")
    parser.add_argument("--limit", type=int, default=None, help="at most this many prompts in all")
    parser.add_argument("-n", type=int, default=160, help="tokens at most per answer")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-bin", type=Path, default=None, help="llama.cpp's build/bin, for llama-server lines")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.llama_bin is not None:
        check_bin_dir(args.llama_bin, ["llama-server"])
    target, draft = model_path(args.target), model_path(args.draft)
    entries = bench_prompts(args.sets.split(","), args.spec_bench, args.limit)
    with tempfile.TemporaryDirectory(prefix="specrun-constrained-") as scratch:
        env = untuned_env(Path(scratch) / "config")
        prompts, options, schemas, n_ctx = grammar_files(Path(scratch), target, entries)
        lines = [specrun_constrained(method, target, draft, args.n, args.threads, env, options)
                 for method in args.methods.split(",")]
        if args.llama_bin is not None:
            lines += [server_constrained(args.llama_bin, target, None, args.n, args.threads, n_ctx, schemas),
                      server_constrained(args.llama_bin, target, draft, args.n, args.threads, n_ctx, schemas)]
        interleave(lines, prompts)
    baseline = lines[0]
    report = {"machine": machine_note(), "target": str(target), "draft": str(draft), "n": args.n,
              "threads": args.threads, "sets": {}}
    categories = sorted({p.category.split("/")[0] for p in prompts})
    print(f"\n{args.target} with {args.draft}, {args.threads} threads, greedy, at most {args.n} tokens; "
          f"ratios against {baseline.name} (geometric mean, 90% interval)")
    for category in categories:
        ids = [p.prompt_id for p in prompts if p.category.split("/")[0] == category]
        print(f"\n{category} ({len(ids)} prompts)")
        report["sets"][category] = {}
        for line in lines:
            subset = Line(line.name, line.run, {pid: line.runs.get(pid) for pid in ids if pid in line.runs})
            base = Line(baseline.name, baseline.run, {pid: baseline.runs.get(pid) for pid in ids})
            summary = line_summary(subset, base, reference=base)
            summary["valid"], summary["answers"] = valid_answers(subset, schemas)
            report["sets"][category][line.name] = summary
            if "ratio" in summary:
                acceptance = f", {100 * summary['acceptance']:.0f}% accepted" if "acceptance" in summary else ""
                same = (f", {summary['same_text']}/{summary['compared_texts']} texts as plain"
                        if "same_text" in summary else "")
                print(f"  {line.name:18} {summary['ratio']:.2f}x [{summary['ratio_low']:.2f}-"
                      f"{summary['ratio_high']:.2f}], median {summary['median_tps']:.1f} tok/s, "
                      f"{summary['valid']}/{summary['answers']} valid{acceptance}{same}")
    save_report(report, args.out, "constrained")
    return 0


if __name__ == "__main__":
    sys.exit(main())
