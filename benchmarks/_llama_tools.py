"""Runs in fresh processes, side by side: specrun generate, llama-cpp-python's Llama.generate, llama.cpp's tools.

Every run is one new process, as a user starts one, and every figure is generation speed
with model load and prompt processing excluded, counted from the first generated token:

- specrun: ``specrun generate --json``; (new tokens - 1) / generation seconds (its first
  token comes from the prefill pass, before the timed loop).
- Llama.generate: this module run as a script; (tokens - 1) / seconds from the first
  yielded token to the last.
- llama-completion: its "total time" less its "prompt eval time" (everything after the prompt
  pass: the one-token passes, sampling and the loop around them, as specrun's generation time
  counts them; its "eval time" alone leaves out sampling and the loop, ~2% on the xl target),
  over its "eval time" runs (the tokens after the first).
- llama-lookup and llama-lookahead: "decoded N tokens in S seconds", (N - 1) / S (the first
  token comes from the prompt pass there too); llama-speculative-simple: N / S (it feeds the prompt's last token
  with the first draft, inside the timed loop).

Greedy everywhere; every line stops at an end-of-generation token or after n tokens.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from _report import geometric_mean_interval, write_report
from specrun.bench.suite import BenchPrompt, load_jsonl, select

TIMEOUT_S = 900
RUNS = Path(__file__).resolve().parents[1] / "runs"  # ignored by git

EVAL_RE = re.compile(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs")
PROMPT_EVAL_RE = re.compile(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens")
PROMPT_EVAL_MS_RE = re.compile(r"prompt eval time =\s*([\d.]+) ms")
TOTAL_RE = re.compile(r"total time =\s*([\d.]+) ms")
DECODED_RE = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
ENCODED_RE = re.compile(r"encoded\s+(\d+) tokens in")
DRAFTED_RE = re.compile(r"n_drafted\s*=\s*(\d+)")
ACCEPTED_RE = re.compile(r"n_accept\s*=\s*(\d+)")


@dataclass
class Run:
    """One generation: decode tokens counted / decode seconds, and what else the line tells."""

    tokens: int  # generated tokens the timing covers (see the module docstring)
    seconds: float
    new_tokens: int
    prompt_tokens: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    text: str | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class Prompt:
    """A prompt as specrun gets it (``raw``: it applies the chat template itself) and as the
    other lines get it (``rendered``: the template applied here, special tokens in the text)."""

    prompt_id: str
    category: str
    raw: str
    rendered: str
    chat: bool  # False: a completion prompt, sent as typed to every line


@dataclass
class Line:
    """A named way to generate: ``run(prompt)`` starts one fresh process."""

    name: str
    run: Callable[[Prompt], Run]
    runs: dict[str, Run | None] = field(default_factory=dict)  # prompt_id -> the run (None: it failed)


class RunFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class Sampling:
    """How every line picks its tokens: greedy at temperature 0; above it, the same filters
    for every line (llama.cpp's tools' defaults) and a fixed seed."""

    temperature: float = 0.0
    seed: int = 1
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def tool_args(self) -> list[str]:
        """The options llama.cpp's tools take."""
        if self.greedy:
            return ["--temp", "0"]
        return ["--temp", str(self.temperature), "--seed", str(self.seed), "--top-k", str(self.top_k),
                "--top-p", str(self.top_p), "--min-p", str(self.min_p)]

    def specrun_args(self) -> list[str]:
        """The options ``specrun generate`` takes (none: greedy, its default)."""
        if self.greedy:
            return []
        return ["--temp", str(self.temperature), "--seed", str(self.seed), "--top-k", str(self.top_k),
                "--top-p", str(self.top_p), "--min-p", str(self.min_p)]

    def server_fields(self) -> dict:
        """The sampling fields of a llama-server /completion request."""
        if self.greedy:
            return {"temperature": 0.0}
        return {"temperature": self.temperature, "seed": self.seed, "top_k": self.top_k,
                "top_p": self.top_p, "min_p": self.min_p}

    def label(self) -> str:
        return "greedy" if self.greedy else f"T={self.temperature:g} (top-k {self.top_k}, top-p {self.top_p:g}, min-p {self.min_p:g})"


GREEDY = Sampling()


# ---- prompts ------------------------------------------------------------------------------
BUILTIN = "builtin"  # in place of a JSONL path: `specrun bench`'s own suite (bench/suite.py)


def spec_bench(path: Path, per_category: int, wanted: Sequence[str] | None = None) -> list[BenchPrompt]:
    """``per_category`` Spec-Bench questions of each category (of the built-in suite where ``path``
    is ``builtin``), taken in turn (a b c … a b c …), so that the machine's drift spreads over the
    categories instead of landing on one."""
    from specrun.bench.suite import BUILTIN_SUITE

    chosen = select(list(BUILTIN_SUITE) if str(path) == BUILTIN else load_jsonl(path), wanted, per_category)
    by_category: dict[str, list[BenchPrompt]] = {}
    for prompt in chosen:
        by_category.setdefault(prompt.category, []).append(prompt)
    columns = list(by_category.values())
    return [column[i] for i in range(max(map(len, columns), default=0)) for column in columns if i < len(column)]


def prepare(model: Path, prompts: Sequence[BenchPrompt], chat: bool) -> tuple[list[Prompt], int]:
    """The prompts as the lines get them: with ``chat``, rendered with ``model``'s chat template
    (specrun, told nothing, applies it itself); without, as typed (specrun gets --raw). Also the
    context size specrun gives ``model`` by default (the other lines get the same)."""
    from specrun.backends.llama import LlamaCppBackend
    from specrun.sessions.templates import ChatTemplate

    backend = LlamaCppBackend(model, n_threads=1)
    try:
        template = ChatTemplate.for_backend(backend) if chat else None
        prepared = [
            Prompt(p.prompt_id, p.category, p.text,
                   template.render([{"role": "user", "content": p.text}]) if template else p.text, chat)
            for p in prompts
        ]
        return prepared, backend.n_ctx
    finally:
        backend.close()


def _run_process(command: list[str], stdin: str | None = None, env: dict | None = None,
                 timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    out = subprocess.run(
        # errors="replace": a tool may print a token's bytes split mid-character
        command, input=stdin, capture_output=True, text=True, errors="replace", env=env, timeout=timeout,
        stdin=None if stdin is not None else subprocess.DEVNULL,
    )
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        raise RunFailed(f"{Path(command[0]).name} exited {out.returncode}: {' | '.join(tail)}")
    return out


# ---- specrun -----------------------------------------------------------------------------
def specrun_line(method: str, target: Path, draft: Path | None, n: int, threads: int, env: dict,
                 extra: tuple[str, ...] = (), name: str | None = None, sampling: Sampling = GREEDY) -> Line:
    """``specrun generate --method METHOD --json`` in a fresh process per prompt (the prompt as typed
    on stdin: specrun applies the chat template to a chat prompt itself); ``extra``: more options
    (``--tree-nodes 16``), under the line's ``name``."""
    command = [sys.executable, "-m", "specrun", "generate", "-", "--json", "--method", method,
               "--target", str(target), "-n", str(n), "--threads", str(threads), *sampling.specrun_args(), *extra]
    if draft is not None:
        command += ["--draft", str(draft)]

    def run(prompt: Prompt) -> Run:
        out = _run_process(command if prompt.chat else [*command, "--raw"], stdin=prompt.raw, env=env)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        stats = result["stats"]
        return Run(
            tokens=max(stats["new_tokens"] - 1, 0),
            seconds=stats["generation_seconds"],
            new_tokens=stats["new_tokens"],
            prompt_tokens=stats["prompt_tokens"],
            drafted=stats["drafted"],
            accepted=stats["accepted"],
            text=result["text"],
        )

    return Line(f"specrun {name or method}", run)


def untuned_env(config_home: Path) -> dict:
    """The environment of a new user: no tune file, no user registry (an empty config folder)."""
    return {**os.environ, "XDG_CONFIG_HOME": str(config_home)}


# ---- llama-cpp-python's own loop ------------------------------------------------------------
def llama_generate_line(model: Path, n: int, threads: int, n_ctx: int, sampling: Sampling = GREEDY) -> Line:
    """llama-cpp-python's ``Llama.generate`` (its defaults, greedy) in a fresh process per prompt."""

    def run(prompt: Prompt) -> Run:
        request = {"model": str(model), "prompt": prompt.rendered, "n": n, "threads": threads, "n_ctx": n_ctx,
                   "sampling": asdict(sampling)}
        out = _run_process([sys.executable, __file__], stdin=json.dumps(request))
        return Run(**json.loads(out.stdout.strip().splitlines()[-1]))

    return Line("Llama.generate", run)


def _llama_generate(request: dict) -> dict:
    """The child process: load the model, generate greedily, time from the first token to the last."""
    from specrun.native_order import share_cxx_runtime

    share_cxx_runtime()  # as the backend does before importing llama_cpp (specrun/native_order.py)
    import llama_cpp

    sampling = Sampling(**request["sampling"])
    llm = llama_cpp.Llama(request["model"], n_ctx=request["n_ctx"], n_threads=request["threads"],
                          n_threads_batch=request["threads"], seed=sampling.seed, verbose=False)
    chosen = ({"temp": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0} if sampling.greedy else
              {"temp": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p, "min_p": sampling.min_p})
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    prompt_ids = llm.tokenize(request["prompt"].encode("utf-8"), add_bos=True, special=True)
    tokens: list[int] = []
    first = last = time.perf_counter()
    for token in llm.generate(prompt_ids, **chosen, repeat_penalty=1.0, reset=True):
        last = time.perf_counter()
        if not tokens:
            first = last
        tokens.append(token)
        if llama_cpp.llama_vocab_is_eog(vocab, token) or len(tokens) == request["n"]:
            break
    shown = [t for t in tokens if not llama_cpp.llama_vocab_is_eog(vocab, t)]
    text = llm.detokenize(shown, prev_tokens=prompt_ids).decode("utf-8", errors="replace")
    return asdict(Run(tokens=max(len(tokens) - 1, 0), seconds=last - first, new_tokens=len(tokens),
                      prompt_tokens=len(prompt_ids), text=text))


# ---- llama.cpp's own tools ----------------------------------------------------------------
def _tool_log(command: list[str], needed: re.Pattern, retries: int = 3) -> str:
    for _ in range(retries):  # llama-lookup sometimes exits 0 without printing statistics
        out = _run_process(command)
        log = out.stdout + out.stderr
        if needed.search(log):
            return log
    raise RunFailed(f"no statistics from {Path(command[0]).name} after {retries} tries")


def _int(pattern: re.Pattern, log: str) -> int | None:
    match = pattern.search(log)
    return int(match.group(1)) if match else None


def completion_line(bin_dir: Path, model: Path, n: int, threads: int, n_ctx: int, sampling: Sampling = GREEDY,
                    extra: tuple[str, ...] = ()) -> Line:
    """``llama-completion`` (plain decoding): everything after its prompt pass; ``extra``: more options."""
    base = [str(bin_dir / "llama-completion"), "-m", str(model), "-n", str(n), "-t", str(threads),
            "-c", str(n_ctx), *sampling.tool_args(), "-no-cnv", *extra]

    def run(prompt: Prompt) -> Run:
        log = _tool_log([*base, "-p", prompt.rendered], EVAL_RE)
        runs = EVAL_RE.search(log).group(2)
        after_prompt_ms = float(TOTAL_RE.search(log).group(1)) - float(PROMPT_EVAL_MS_RE.search(log).group(1))
        return Run(tokens=int(runs), seconds=after_prompt_ms / 1e3, new_tokens=int(runs) + 1,
                   prompt_tokens=_int(PROMPT_EVAL_RE, log))

    return Line("llama-completion", run)


def _decoding_tool_line(name: str, command: list[str], first_token_timed: bool) -> Line:
    def run(prompt: Prompt) -> Run:
        log = _tool_log([*command, "-p", prompt.rendered], DECODED_RE)
        decoded, seconds = DECODED_RE.search(log).groups()
        decoded = int(decoded)
        return Run(tokens=decoded if first_token_timed else max(decoded - 1, 0), seconds=float(seconds),
                   new_tokens=decoded, prompt_tokens=_int(ENCODED_RE, log),
                   drafted=_int(DRAFTED_RE, log), accepted=_int(ACCEPTED_RE, log))

    return Line(name, run)


def lookup_line(bin_dir: Path, model: Path, n: int, threads: int, n_ctx: int, draft_max: int,
                sampling: Sampling = GREEDY) -> Line:
    """``llama-lookup`` (prompt lookup, up to ``draft_max`` tokens a step)."""
    command = [str(bin_dir / "llama-lookup"), "-m", str(model), "--spec-draft-n-max", str(draft_max),
               "-n", str(n), "-t", str(threads), "-c", str(n_ctx), *sampling.tool_args()]
    return _decoding_tool_line(f"llama-lookup k={draft_max}", command, first_token_timed=False)


def lookahead_line(bin_dir: Path, model: Path, n: int, threads: int, n_ctx: int) -> Line:
    """``llama-lookahead`` (Jacobi lookahead decoding; its sizes are fixed in its source:
    window 15, n-gram 5, 15 candidates)."""
    command = [str(bin_dir / "llama-lookahead"), "-m", str(model), "-n", str(n), "-t", str(threads),
               "-c", str(n_ctx), "--temp", "0"]
    return _decoding_tool_line("llama-lookahead 15:5:15", command, first_token_timed=False)


def speculative_line(bin_dir: Path, model: Path, draft: Path, n: int, threads: int, n_ctx: int, draft_max: int,
                     sampling: Sampling = GREEDY, label: str = "") -> Line:
    """``llama-speculative-simple`` with a draft model (up to ``draft_max`` tokens a step). It
    reads the prompt as one batch: its logical batch is the whole context (``-b``), or a prompt
    longer than llama.cpp's default 2048 fails."""
    command = [str(bin_dir / "llama-speculative-simple"), "-m", str(model), "-md", str(draft),
               "--spec-type", "draft-simple", "--spec-draft-n-max", str(draft_max), "--spec-draft-n-min", "0",
               "-n", str(n), "-t", str(threads), "-c", str(n_ctx), "-b", str(n_ctx), *sampling.tool_args()]
    return _decoding_tool_line(f"llama-speculative-simple k={draft_max}{label}", command, first_token_timed=True)


# llama-server's speculation, by the options that turn it on (its defaults otherwise)
SERVER_SPECULATION = {
    "server": (),
    "server-draft": ("--spec-type", "draft-simple"),  # with -md DRAFT
    "server-ngram-mod": ("--spec-type", "ngram-mod"),
    "server-ngram-map-k": ("--spec-type", "ngram-map-k"),
}
SERVER_START_S = 120


def server_line(bin_dir: Path, model: Path, kind: str, n: int, threads: int, n_ctx: int,
                draft: Path | None = None, sampling: Sampling = GREEDY, label: str = "") -> Line:
    """``llama-server`` with one kind of its speculation (SERVER_SPECULATION), started afresh for
    each run and sent one /completion request; the figures come from the response's timings."""
    if (kind == "server-draft") != (draft is not None):
        raise ValueError("llama-server drafts with a model exactly when its kind is server-draft")
    options = [*SERVER_SPECULATION[kind], *(["-md", str(draft)] if draft else [])]

    def run(prompt: Prompt) -> Run:
        port = _free_port()
        command = [str(bin_dir / "llama-server"), "-m", str(model), "-t", str(threads), "-tb", str(threads),
                   "-c", str(n_ctx), "-np", "1", "--host", "127.0.0.1", "--port", str(port), "--no-webui", *options]
        with tempfile.TemporaryFile("w+", errors="replace") as log:  # a pipe left unread would fill and stall it
            server = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            try:
                _wait_until_ready(server, port, log)
                body = {"prompt": prompt.rendered, "n_predict": n, "cache_prompt": False, **sampling.server_fields()}
                reply = _post_json(f"http://127.0.0.1:{port}/completion", body)
            finally:
                stop_process(server)
        timings = reply["timings"]
        generated = int(timings["predicted_n"])
        return Run(tokens=max(generated - 1, 0), seconds=float(timings["predicted_ms"]) / 1e3, new_tokens=generated,
                   prompt_tokens=int(timings["prompt_n"]), drafted=timings.get("draft_n"),
                   accepted=timings.get("draft_n_accepted"), text=reply.get("content"))

    name = {"server": "llama-server", "server-draft": "llama-server -md"}.get(kind, f"llama-server {kind[7:]}")
    return Line(name + label, run)


def stop_process(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not ended within 30 s."""
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_until_ready(server: subprocess.Popen, port: int, log) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            tail = log.read().strip().splitlines()[-3:]
            raise RunFailed(f"llama-server exited {server.returncode}: {' | '.join(tail)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)
    raise RunFailed(f"llama-server was not ready after {SERVER_START_S} s")


def _post_json(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        raise RunFailed(f"llama-server answered {exc.code}: {exc.read()[:200]!r}") from None


def check_bin_dir(bin_dir: Path, tools: Sequence[str]) -> None:
    missing = [tool for tool in tools if not (bin_dir / tool).is_file()]
    if missing:
        sys.exit(f"{bin_dir} lacks {', '.join(missing)}: build them as docs/measuring.md says")


# ---- the interleaved run and its summary -------------------------------------------------------
def interleave(lines: Sequence[Line], prompts: Sequence[Prompt], label: str = "") -> bool:
    """Run every line on each prompt in turn (A B C … A B C …), filling ``line.runs``.

    Ctrl-C (SIGINT) stops early and keeps the prompts that every line completed: then the
    answer is False."""
    for index, prompt in enumerate(prompts):
        for line in lines:
            try:
                line.runs[prompt.prompt_id] = line.run(prompt)
            except (RunFailed, subprocess.TimeoutExpired, json.JSONDecodeError, KeyError) as exc:
                print(f"  {line.name} on {prompt.prompt_id} failed: {exc}", file=sys.stderr)
                line.runs[prompt.prompt_id] = None
            except KeyboardInterrupt:
                for each in lines:  # a prompt that some lines missed is left out
                    each.runs.pop(prompt.prompt_id, None)
                print(f"{label}interrupted: {index} of {len(prompts)} prompts complete", file=sys.stderr)
                return False
        rates = ", ".join(f"{line.name} {run.tokens_per_second:.1f}" for line in lines
                          if (run := line.runs[prompt.prompt_id]) is not None)
        print(f"{label}{index + 1}/{len(prompts)} {prompt.prompt_id}: {rates} tok/s", file=sys.stderr)
    return True


def ratios(line: Line, baseline: Line, prompt_ids: Sequence[str] | None = None) -> dict[str, float]:
    """Per-prompt speed ratio line / baseline, over the prompts both completed."""
    ids = prompt_ids if prompt_ids is not None else line.runs
    return {
        pid: run.tokens_per_second / base.tokens_per_second
        for pid in ids
        if (run := line.runs.get(pid)) and (base := baseline.runs.get(pid)) and base.tokens_per_second > 0
        and run.tokens_per_second > 0
    }


def median_tps(line: Line) -> float | None:
    """The median over prompts of the line's tokens/s (None before any run completed)."""
    rates = [run.tokens_per_second for run in line.runs.values() if run is not None]
    return statistics.median(rates) if rates else None


def geometric_mean(values: Sequence[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else float("nan")


def line_summary(line: Line, baseline: Line, reference: Line | None = None) -> dict:
    """Figures of one line against ``baseline``: geometric mean ratio with its interval, worst prompt,
    median and total tokens/s, acceptance, and how many texts equal ``reference``'s."""
    runs = [run for run in line.runs.values() if run is not None]
    per_prompt = ratios(line, baseline)
    summary: dict = {"prompts": len(runs), "failed": sum(run is None for run in line.runs.values())}
    if runs:
        summary["median_tps"] = median_tps(line)
        summary["total_tps"] = sum(run.tokens for run in runs) / sum(run.seconds for run in runs)
    if per_prompt:
        mean, low, high = geometric_mean_interval(list(per_prompt.values()))
        worst = min(per_prompt, key=per_prompt.get)
        summary.update(ratio=mean, ratio_low=low, ratio_high=high, worst_prompt=worst, worst_ratio=per_prompt[worst])
    drafted = sum(run.drafted or 0 for run in runs)
    if drafted:
        summary["acceptance"] = sum(run.accepted or 0 for run in runs) / drafted
    if reference is not None and reference is not line:
        pairs = [(run.text, ref.text) for pid, run in line.runs.items()
                 if run is not None and run.text is not None
                 and (ref := reference.runs.get(pid)) and ref.text is not None]
        if pairs:
            summary["same_text"] = sum(a == b for a, b in pairs)
            summary["compared_texts"] = len(pairs)
            summary["differing_prompts"] = [pid for pid, run in line.runs.items() if run is not None
                                            and (ref := reference.runs.get(pid)) and run.text != ref.text]
    return summary


def prompt_token_mismatches(lines: Sequence[Line]) -> list[str]:
    """Prompts whose token counts differ between lines (a template applied by one side only, a BOS)."""
    found = []
    for pid in lines[0].runs:
        counts = {line.name: run.prompt_tokens for line in lines
                  if (run := line.runs.get(pid)) is not None and run.prompt_tokens is not None}
        if len(set(counts.values())) > 1:
            found.append(f"{pid}: " + ", ".join(f"{name} {count}" for name, count in counts.items()))
    return found


def runs_report(lines: Sequence[Line]) -> dict:
    """Every run of every line, for the JSON report."""
    return {line.name: {pid: (asdict(run) if run else None) for pid, run in line.runs.items()} for line in lines}


def save_report(report: dict, path: Path | None, name: str) -> None:
    """Write the raw figures to ``path``, by default runs/NAME-TIME.json, and say where."""
    path = path or RUNS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_report(path, report)
    print(f"\nraw figures: {path}", file=sys.stderr)


def machine_note() -> str:
    """The load averages now: the machines here are shared, and busy cores slow every line."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"


if __name__ == "__main__":
    print(json.dumps(_llama_generate(json.loads(sys.stdin.read()))))
