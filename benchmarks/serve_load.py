"""`specrun serve` under load (issue 51): C clients at once, each sending prompts one after the
other, against every server line at the same C.

Lines, each a server started afresh for each C (127.0.0.1 only) and warmed by one request:
- ``specrun fifo``: `specrun serve` answering one request at a time (``--parallel 1``), as before;
- ``specrun``: `specrun serve --parallel C`, the slots sharing every pass, speculation yielding to
  the batch (TargetCosts.sharing);
- ``specrun auto``: `specrun serve --parallel auto` (slots as memory allows);
- ``specrun plain``: `specrun serve --parallel C --method none`, the slots without speculation (what
  specrun's batching alone gives, beside llama-server's);
- ``specrun draft k4``: every slot drafting 4 tokens a step with the draft model (what speculation
  gives where it never yields to the batch);
- ``specrun lookup``: the slots drafting by prompt lookup alone (no draft model: what costs nothing
  to draft gives);
- ``specrun trees``: ``specrun`` with ``--branches 2``, each slot's verify pass carrying its tree in
  the shared batch;
- ``specrun eagle``, ``specrun eagle fifo``: the target's EAGLE heads drafting on every slot, and
  answering one request at a time (``--parallel 1``);
- with ``--before REV``: ``specrun REV``, ``specrun`` served from that commit's checkout (a git
  worktree, as ab_commits.py makes), to compare a change under load in one interleaved run;
- with ``--llama-bin``: ``llama-server -np C`` without speculation, with ``-md`` (the same draft,
  ``--spec-type draft-simple``) and with ``--spec-type ngram-mod``.

Each phase sends ``--requests`` chat requests (streamed, with usage) from C client threads taking
prompts in turn, bounded by ``--budget`` seconds; figures per line and C: aggregate tokens/s
(completion tokens over the phase's wall time; and steady: until the first client finds no request
left, before the phase drains), p50/p95 request latency and time to first token.
The lines run in turn at each C, their order rotating between rounds (docs/measuring.md). Two
prompt sets, reported apart: specrun's built-in suite and Spec-Bench questions.

    .venv/bin/python benchmarks/serve_load.py --target smollm2-135m-x2 --draft smollm2-135m \\
        --llama-bin LLAMA_CPP/build/bin --clients 1 2 4 8
    .venv/bin/python benchmarks/serve_load.py --target demo-target --draft demo-draft --clients 1 2 \\
        --requests 4 --sets builtin   # does it run
    .venv/bin/python benchmarks/serve_load.py --backend mlx --target smollm2-135m-x2 --draft smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _llama_tools import (  # noqa: E402
    _free_port, check_bin_dir, machine_note, save_report, spec_bench, stop_process,
)
from real_model import model_path  # noqa: E402

from specrun.bench.suite import BUILTIN_SUITE, BenchPrompt  # noqa: E402

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
START_S = 180
REQUEST_TIMEOUT_S = 600


@dataclass
class Answer:
    tokens: int
    latency: float  # seconds from sending to the last byte
    first_token: float  # seconds from sending to the first text
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of each chunk of text


@dataclass
class Phase:
    line: str
    clients: int
    prompt_set: str
    seconds: float = 0.0
    # from the start to the first client finding no request left: every client busy all along
    steady_seconds: float = 0.0
    started: float = 0.0
    answers: list[Answer] = field(default_factory=list)
    failures: int = 0
    server: dict = field(default_factory=dict)  # specrun's /metrics over the phase: why the figure is what it is

    def summary(self) -> dict:
        tokens = sum(answer.tokens for answer in self.answers)
        latencies = sorted(answer.latency for answer in self.answers)
        firsts = sorted(answer.first_token for answer in self.answers)

        def pct(values, q):
            return values[min(len(values) - 1, int(q * len(values)))] if values else None

        return {"line": self.line, "clients": self.clients, "set": self.prompt_set, "requests": len(self.answers),
                "failures": self.failures, "tokens": tokens, "seconds": self.seconds,
                "tokens_per_s": tokens / self.seconds if self.seconds else None,
                "steady_tokens_per_s": self.steady_rate(),
                "latency_p50": pct(latencies, 0.5), "latency_p95": pct(latencies, 0.95),
                "ttft_p50": pct(firsts, 0.5), "ttft_p95": pct(firsts, 0.95), **self.server}

    def steady_rate(self) -> float | None:
        """Tokens/s while every client had a request in flight (before the phase drains: its last
        answers, some clients idle, lower the phase's figure more where answers end unevenly, as
        speculation makes them). Each answer's tokens are counted by the share of its chunks
        streamed by then."""
        if self.steady_seconds <= 0.0:
            return None
        end = self.started + self.steady_seconds
        tokens = sum(answer.tokens * sum(t <= end for t in answer.chunk_times) / len(answer.chunk_times)
                     for answer in self.answers if answer.chunk_times)
        return tokens / self.steady_seconds


@dataclass
class ServerLine:
    """A server to start for ``clients``: its command, and the model name requests give; ``env``
    and ``cwd``: variables it runs with besides ours and the folder it starts in (``--before``:
    another checkout, whose specrun ``python -m`` then imports)."""

    name: str
    command: object  # (port, clients) -> argv
    model: str
    env: dict | None = None
    cwd: str | None = None  # where it starts (``python -m`` puts it first on the import path)


def stream_answer(port: int, model: str, text: str, max_tokens: int) -> Answer:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    sent = time.perf_counter()
    tokens = None
    times: list[float] = []  # each chunk of text's arrival
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
        for raw in reply:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    times.append(time.perf_counter())
    latency = time.perf_counter() - sent
    return Answer(tokens if tokens is not None else len(times), latency, times[0] - sent if times else latency, times)


def specrun_metrics(port: int) -> dict[str, float]:
    """specrun's /metrics as {sample: value}; {} from a server without it (llama-server's is off)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    except OSError:
        return {}
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def explained(before: dict[str, float], after: dict[str, float], seconds: float) -> dict:
    """Over a phase: the mean draft length chosen and its acceptance, the target batches' mean
    occupancy (sequences a pass), the share of the phase's time the models' batches ran
    (target, draft: the rest is Python between passes, waiting, HTTP), and the tokens the draft
    model read for each token it drafted."""
    if not after:
        return {}

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps, drafted = delta("specrun_verify_passes_total"), delta("specrun_drafted_tokens_total")
    batches = delta('specrun_batches_total{model="target"}')
    return {"mean_draft_len": drafted / steps if steps else None,
            "acceptance": delta("specrun_accepted_tokens_total") / drafted if drafted else None,
            "batch_occupancy": delta('specrun_batch_sequences_total{model="target"}') / batches if batches else None,
            "target_busy": delta('specrun_batch_seconds_total{model="target"}') / seconds if batches else None,
            "draft_busy": delta('specrun_batch_seconds_total{model="draft"}') / seconds if batches else None,
            # tokens the draft model read a token it drafted: 1 where it reads only its own drafts and
            # the tokens verified after them, more where it also reads prompts and text it did not draft
            "draft_reads": delta('specrun_batch_tokens_total{model="draft"}') / drafted if drafted else None,
            # the batch's measured tokens/s by arm and where it held plain (control/batch.Realised), at
            # the phase's end; the lengths it gave the slots over the phase, by sequences and length
            "realised": {name: value for name, value in after.items()
                         if name.startswith(("specrun_batch_realised", "specrun_batch_held_plain"))},
            "lengths": {name: delta(name) for name in after if name.startswith("specrun_batch_draft_lengths_total")
                        and delta(name)}}


def run_phase(port: int, line: ServerLine, clients: int, prompts: list[BenchPrompt], prompt_set: str,
              requests: int, budget_s: float, max_tokens: int) -> Phase:
    phase = Phase(line.name, clients, prompt_set)
    lock = threading.Lock()
    taken = [0]
    deadline = time.perf_counter() + budget_s

    def client() -> None:
        while True:
            with lock:
                if taken[0] >= requests or time.perf_counter() > deadline:
                    if not phase.steady_seconds:  # the first client left idle: the phase drains from here
                        phase.steady_seconds = time.perf_counter() - started
                    return
                prompt = prompts[taken[0] % len(prompts)]
                taken[0] += 1
            try:
                answer = stream_answer(port, line.model, prompt.text, max_tokens)
            except Exception as exc:  # noqa: BLE001 - counted; the phase goes on
                print(f"  {line.name}: a request failed: {exc}", file=sys.stderr)
                with lock:
                    phase.failures += 1
                continue
            with lock:
                phase.answers.append(answer)

    before = specrun_metrics(port)
    started = phase.started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    phase.seconds = time.perf_counter() - started
    phase.server = explained(before, specrun_metrics(port), phase.seconds)
    return phase


def wait_ready(process: subprocess.Popen, port: int) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become ready")


def with_server(line: ServerLine, clients: int, work):
    port = _free_port()
    with tempfile.TemporaryFile("w+", errors="replace") as log:
        process = subprocess.Popen(line.command(port, clients), stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT, env={**os.environ, **(line.env or {})}, cwd=line.cwd)
        try:
            wait_ready(process, port)
            return work(port)
        except RuntimeError:
            log.seek(0)
            print(log.read()[-3000:], file=sys.stderr)
            raise
        finally:
            stop_process(process)


def lines_for(args, target: Path | str, draft: Path | str) -> list[ServerLine]:
    specrun = [sys.executable, "-m", "specrun", "serve", "--target", str(target), "--draft", str(draft),
               "--threads", str(args.threads), "--ctx", str(args.ctx), "--max-queue", "256", "--host", "127.0.0.1",
               "--backend", args.backend]
    named = [*specrun[:5], args.target, *specrun[6:]]
    lines = [
        ServerLine("specrun fifo", lambda port, c: [*specrun, "--port", str(port), "--parallel", "1"], str(target)),
        ServerLine("specrun", lambda port, c: [*specrun, "--port", str(port), "--parallel", str(c)], str(target)),
        ServerLine("specrun auto", lambda port, c: [*specrun, "--port", str(port), "--parallel", "auto"], str(target)),
        ServerLine("specrun plain", lambda port, c: [*specrun, "--port", str(port), "--parallel", str(c),
                                                     "--method", "none"], str(target)),
        ServerLine("specrun draft", lambda port, c: [*specrun, "--port", str(port), "--parallel", str(c),
                                                     "--method", "draft"], str(target)),
        ServerLine("specrun draft k4", lambda port, c: [*specrun, "--port", str(port), "--parallel", str(c),
                                                        "--method", "draft", "-k", "4"], str(target)),
        ServerLine("specrun lookup", lambda port, c: [*specrun, "--port", str(port), "--parallel", str(c),
                                                      "--method", "lookup"], str(target)),
        ServerLine("specrun trees", lambda port, c: [*specrun, "--port", str(port), "--parallel", str(c),
                                                     "--branches", "2"], str(target)),
        # the target's heads (--method eagle: EAGLE-3's where found) drafting on every slot, and one at a
        # time: the target by its registry name, under which its heads are found
        ServerLine("specrun eagle", lambda port, c: [*named, "--port", str(port), "--parallel", str(c),
                                                     "--method", "eagle"], args.target),
        ServerLine("specrun eagle fifo", lambda port, c: [*named, "--port", str(port), "--parallel", "1",
                                                          "--method", "eagle"], args.target),
    ]
    if args.before is not None:  # the same slots as ``specrun``, from another commit's checkout (ab_commits.py's)
        from ab_commits import worktree

        tree = str(worktree(args.before))
        lines.append(ServerLine(f"specrun {args.before}", lambda port, c: [*specrun, "--port", str(port),
                                                                           "--parallel", str(c)], str(target),
                                {"PYTHONPATH": tree}, tree))
    if args.llama_bin is not None:
        def server(extra):
            return lambda port, c: [str(args.llama_bin / "llama-server"), "-m", str(target), "-t", str(args.threads),
                                    "-tb", str(args.threads), "-c", str(args.ctx * c), "-np", str(c),
                                    "--host", "127.0.0.1", "--port", str(port), "--no-webui", *extra]

        lines += [
            ServerLine("llama-server", server([]), "model"),
            ServerLine("llama-server -md", server(["-md", str(draft), "--spec-type", "draft-simple"]), "model"),
            ServerLine("llama-server ngram-mod", server(["--spec-type", "ngram-mod"]), "model"),
        ]
    wanted = args.lines and [*args.lines, *([f"specrun {args.before}"] if args.before is not None else [])]
    return [line for line in lines if not wanted or line.name in wanted]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-x2")
    parser.add_argument("--draft", default="smollm2-135m")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--requests", type=int, default=16, help="requests per phase (at least C)")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds a phase may take")
    parser.add_argument("-n", "--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backend", choices=["llama", "mlx"], default="llama",
                        help="specrun's backend (mlx: the registry's MLX copies; no llama-server lines)")
    parser.add_argument("--ctx", type=int, default=2048, help="context per slot")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--sets", nargs="+", default=["builtin", "spec-bench"], choices=["builtin", "spec-bench"])
    parser.add_argument("--spec-bench", type=Path, default=SPEC_BENCH)
    parser.add_argument("--per-category", type=int, default=2,
                        help="Spec-Bench questions a category (a phase cycles its prompts: the n-gram pool "
                             "learns an answer asked again, so a long phase wants as many prompts as requests)")
    parser.add_argument("--llama-bin", type=Path, default=None)
    parser.add_argument("--lines", nargs="*", default=None, help="only these lines (names as reported)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--before", default=None,
                        help="a commit: a line `specrun REV` serves as `specrun` does, from that commit's checkout "
                        "(kept whatever --lines names)")
    parser.add_argument("--trace", type=Path, default=None,
                        help="a folder: each specrun server writes its `serve --trace` there (`specrun trace FILE`)")
    args = parser.parse_args()
    if args.llama_bin is not None and args.backend == "mlx":
        parser.error("--llama-bin compares llama-server with specrun on llama.cpp: leave it out with --backend mlx")
    if args.llama_bin is not None:
        check_bin_dir(args.llama_bin, ["llama-server"])
    # MLX: the registry's names, which specrun resolves to their MLX copies
    target, draft = (model_path(args.target), model_path(args.draft)) if args.backend == "llama" else (args.target,
                                                                                                     args.draft)
    sets = {"builtin": list(BUILTIN_SUITE), "spec-bench": spec_bench(args.spec_bench, args.per_category) if "spec-bench" in args.sets
            else []}
    lines = lines_for(args, target, draft)
    print(f"# serve load: {args.target} + {args.draft}, {args.threads} threads, {machine_note()}", file=sys.stderr)
    phases: list[Phase] = []
    if args.trace is not None:
        args.trace.mkdir(parents=True, exist_ok=True)
    for clients in args.clients:
        for round_index in range(args.rounds):
            shift = round_index % len(lines)
            for line in lines[shift:] + lines[:shift]:
                def work(port, line=line, clients=clients):
                    stream_answer(port, line.model, "Say hello.", 8)  # warm-up: the first pass's set-up
                    return [run_phase(port, line, clients, sets[name], name, max(args.requests, clients),
                                      args.budget, args.max_tokens) for name in args.sets]

                traced = line
                if args.trace is not None and line.name.startswith("specrun"):  # serve --trace, a file a server
                    named = line.name.replace(' ', '-').replace('/', '-')
                    where = args.trace.resolve() / f"{named}-c{clients}-r{round_index + 1}.jsonl"
                    traced = ServerLine(line.name, lambda port, c, line=line, where=where: [
                        *line.command(port, c), "--trace", str(where)], line.model, line.env, line.cwd)
                for phase in with_server(traced, clients, work):
                    phases.append(phase)
                    s = phase.summary()
                    steady = s["steady_tokens_per_s"]
                    print(f"C={clients} {s['set']:<10} {line.name:<24} {s['tokens_per_s']:7.1f} tok/s  "
                          + (f"(steady {steady:.1f})  " if steady is not None else "")
                          + f"p50 {s['latency_p50']:.2f}s p95 {s['latency_p95']:.2f}s  "
                          f"ttft p50 {s['ttft_p50']:.2f}s  ({s['requests']} answers, {s['failures']} failed)"
                          + "".join(f"  {key} {value:.2f}" for key, value in phase.server.items()
                                    if isinstance(value, float))
                          + "".join(f"\n    {key}: " + " ".join(f"{name.removeprefix('specrun_batch_')}={number:g}"
                                                                 for name, number in value.items())
                                    for key, value in phase.server.items() if isinstance(value, dict) and value),
                          file=sys.stderr)
    report = {"target": args.target, "draft": args.draft, "threads": args.threads, "machine": machine_note(),
              "phases": [phase.summary() for phase in phases]}
    print_table(report)
    save_report(report, args.out, "serve-load")


def print_table(report: dict) -> None:
    """Median aggregate tokens/s per line, C and set (over the phase, and steady: every client
    busy), with each line's ratio to specrun fifo."""
    by_key: dict[tuple, list[float]] = {}
    steady_by_key: dict[tuple, list[float]] = {}
    for phase in report["phases"]:
        key = (phase["set"], phase["clients"], phase["line"])
        by_key.setdefault(key, []).append(phase["tokens_per_s"] or 0.0)
        if phase.get("steady_tokens_per_s") is not None:
            steady_by_key.setdefault(key, []).append(phase["steady_tokens_per_s"])
    print("| set | C | line | tokens/s | steady | vs specrun fifo |")
    print("|---|---|---|---|---|---|")
    for (prompt_set, clients, line), values in sorted(by_key.items()):
        value = statistics.median(values)
        steady = steady_by_key.get((prompt_set, clients, line))
        fifo = by_key.get((prompt_set, clients, "specrun fifo"))
        ratio = f"{value / statistics.median(fifo):.2f}x" if fifo and statistics.median(fifo) else "-"
        steady_text = f"{statistics.median(steady):.1f}" if steady else "-"
        print(f"| {prompt_set} | {clients} | {line} | {value:.1f} | {steady_text} | {ratio} |")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
