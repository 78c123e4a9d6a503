"""`specrun trace FILE`: a `--trace` file read back and told in words, run by run.

A trace holds one run (generate), every run of a bench (by prompt, line and repeat), a chat's
answers or a server's requests (sessions/trace.py writes them). For each run: what it made in how
many passes, who drafted and how much of it was kept, where the time went, the moments the policy
changed its mind (a drafter switched off, with the rates it compared, or probed again; the gate on
realised speed turning speculation off or on; the length a batch of slots chose), and how it ended.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from specrun.errors import FileAccessError
from specrun.sessions.trace import TRACE_VERSION
from specrun.wording import count_of

# The fields that tell the runs of one trace apart, in the order they are named.
WHERE = ("request", "answer", "prompt", "line", "repeat")
FIX = "pass a file written by --trace"


@dataclass
class RunTrace:
    """One run's lines: where it was (``WHERE`` fields), its opening (a server's request), steps, end."""

    where: dict
    opening: dict = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)
    summary: dict | None = None
    finish_reason: str | None = None
    stopped: str | None = None


@contextlib.contextmanager
def _stdin_text():
    """stdin as UTF-8 whatever the locale says, left open when done (the command's, not this reader's)."""
    text = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8")
    try:
        yield text
    finally:
        text.detach()


def read_trace(path: Path) -> tuple[dict, list[RunTrace]]:
    """The trace's first line (what ran) and its runs in the order they began; a file that is not a
    trace, a newer one, or a line that is not JSON is refused naming the line. ``-``: stdin."""
    path = Path(path)
    stdin = str(path) == "-"
    where = "on stdin" if stdin else str(path)

    def refuse(reason: str, fix: str = FIX) -> FileAccessError:
        return FileAccessError(f"cannot read the trace {where}: {reason}", fix)

    if stdin and sys.stdin.isatty():  # it would wait for a trace typed in
        raise refuse("stdin is a terminal", "pipe a trace in (specrun trace - < run.jsonl), or pass its file")
    if not stdin and not path.is_file():
        raise refuse("no such file" if not path.exists() else "it is not a regular file")
    runs: dict[tuple, RunTrace] = {}
    header: dict | None = None
    try:
        with (_stdin_text() if stdin else path.open(encoding="utf-8")) as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError) as exc:
                    if header is not None and not line.endswith("\n"):  # a trace's last line, still being written
                        break
                    if header is None:
                        raise refuse("it is not a specrun trace (its first line is not JSON)") from exc
                    raise refuse(f"line {number} is not JSON ({exc})") from exc
                if not isinstance(record, dict):
                    raise refuse(f"line {number} is not a JSON object")
                if header is None:
                    if record.get("trace") != "specrun":
                        raise refuse("it is not a specrun trace (its first line does not say so)")
                    version = record.get("version")
                    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
                        raise refuse(f"its first line's version is {_shown(version)}, not a trace version")
                    if version > TRACE_VERSION:
                        raise refuse(f"it has trace version {version}, newer than this specrun reads "
                                     f"({TRACE_VERSION})", "upgrade specrun")
                    header = record
                    continue
                if "trace" in record:  # a second trace's first line: two traces joined (cat a b)
                    raise refuse(f"line {number} begins another trace (two traces joined into one file)",
                                 "read each trace on its own")
                problem = record_problem(record)
                if problem:
                    raise refuse(f"line {number}: {problem}, which no run writes")
                _add(runs, record)
    except UnicodeDecodeError as exc:
        raise refuse(f"it is not text ({exc.reason})") from exc
    except OSError as exc:
        raise refuse(exc.strerror or str(exc)) from exc
    if header is None:
        raise refuse("it is empty")
    return header, list(runs.values())


# What each field of a line may hold (sessions/trace.py and engine/loop.trace_record write them):
# a count, milliseconds, a name, or an object. A line holding anything else is refused by name
# rather than told as fact or failing inside the telling.
MOST = 2**40  # larger than any count or time a run writes (a count is also at most this many tokens)
COUNTS = ("step", "context", "drafted", "accepted", "emitted", "slot", "prompt_tokens", "cached_tokens",
          "max_tokens", "answer", "prompt", "repeat")
TIMES = ("draft_ms", "verify_ms")
NAMES = ("plan", "source", "finish_reason", "request", "line")
SUMMARY_COUNTS = ("new_tokens", "steps", "drafted", "accepted")
SUMMARY_NUMBERS = ("tokens_per_second", "mean_tokens_per_step", "temperature")


def _shown(value) -> str:
    text = json.dumps(value) if isinstance(value, (str, bool, type(None))) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _count_problem(name: str, value) -> str:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MOST:
        return f"'{name}' is {_shown(value)}, not a count"
    return ""


def _number_problem(name: str, value) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and 0 <= value <= MOST):
        return f"'{name}' is {_shown(value)}, not a non-negative number"
    return ""


def record_problem(record: dict) -> str:
    """Why a line after the header holds what no run writes ("" where it could be a run's)."""
    for name in COUNTS:
        if name in record and (problem := _count_problem(name, record[name])):
            return problem
    for name in TIMES:
        if name in record and (problem := _number_problem(name, record[name])):
            return problem
    if "temperature" in record and (problem := _number_problem("temperature", record["temperature"])):
        return problem
    for name in NAMES:
        if name in record and not isinstance(record[name], (str, type(None))):
            return f"'{name}' is {_shown(record[name])}, not a name"
    if record.get("accepted", 0) > record.get("drafted", record.get("accepted", 0)):
        return f"{count_of(record['accepted'], 'token')} kept of {record['drafted']} drafted"
    if "queued" in record and not isinstance(record["queued"], bool):
        return f"'queued' is {_shown(record['queued'])}, not true or false"
    if "summary" in record:
        summary = record["summary"]
        if not isinstance(summary, dict):
            return f"'summary' is {_shown(summary)}, not an object"
        for name in SUMMARY_COUNTS:
            if name in summary and (problem := _count_problem(f"summary.{name}", summary[name])):
                return problem
        for name in SUMMARY_NUMBERS:
            if name in summary and (problem := _number_problem(f"summary.{name}", summary[name])):
                return problem
    policy = record.get("policy")
    if policy is not None:
        if not isinstance(policy, dict):
            return f"'policy' is {_shown(policy)}, not an object"
        for name in ("gate", "batch"):
            if policy.get(name) is not None and not isinstance(policy[name], dict):
                return f"'policy.{name}' is {_shown(policy[name])}, not an object"
        drafters = policy.get("drafters")
        if drafters is not None and not (isinstance(drafters, dict)
                                         and all(isinstance(state, dict) for state in drafters.values())):
            return f"'policy.drafters' is {_shown(drafters)}, not an object of drafters' states"
        batch = policy.get("batch") or {}
        if "gain" in batch and (problem := _number_problem("policy.batch.gain", batch["gain"])):
            return problem
        if "held_plain" in batch and not isinstance(batch["held_plain"], bool):
            return f"'policy.batch.held_plain' is {_shown(batch['held_plain'])}, not true or false"
        realised = batch.get("realised", {})
        if not isinstance(realised, dict):
            return f"'policy.batch.realised' is {_shown(realised)}, not an object"
        for arm, rate in realised.items():
            if problem := _number_problem(f"policy.batch.realised.{arm}", rate):
                return problem
    return ""


def _add(runs: dict[tuple, RunTrace], record: dict) -> None:
    where = {key: record[key] for key in WHERE if key in record}
    if not where and "stopped" in record:  # a run stopped by Ctrl-C or an error: the last one not ended
        unended = [run for run in runs.values() if run.summary is None and run.stopped is None]
        if unended:
            unended[-1].stopped = str(record["stopped"])
            return
    run = runs.get(key := tuple(where.items()))
    if run is None:
        run = runs[key] = RunTrace(where)
    if "step" in record:
        run.steps.append(record)
    elif "summary" in record:
        run.summary = record["summary"]
        run.finish_reason = record.get("finish_reason")
    elif "stopped" in record:
        run.stopped = str(record["stopped"])
    else:  # a server's request: what was asked
        run.opening = {k: v for k, v in record.items() if k not in WHERE}


def describe_header(header: dict) -> str:
    """The trace's first line in words."""
    draft = f" with {header['draft']}" if header.get("draft") else ""
    what = "serve" if header.get("serve") else "run"
    count = header.get("slots", 1)
    slots = f", {count} slots" if isinstance(count, int) and not isinstance(count, bool) and count > 1 else ""
    prompt = f", a prompt of {header['prompt_tokens']} tokens" if "prompt_tokens" in header else ""
    listed = header.get("methods")
    methods = header.get("method") or (", ".join(map(str, listed)) if isinstance(listed, list) else listed) or "?"
    return f"{what}: {header.get('target', '?')}{draft}, method {methods}{slots}{prompt}{_sampled(header)}"


def _sampled(header: dict) -> str:
    """", sampled at temperature T, top-k K, ..." where the run sampled (none for greedy, or for a
    header whose sampling fields are not numbers a run could have used)."""
    names = ("temperature", "top_k", "top_p", "min_p", "seed")
    if not any(name in header for name in names):
        return ""
    from specrun.sampling import TEMPERATURE_FIRST, SamplingSettings

    values = [header.get(name) for name in names]
    numbers = values[:4]
    if any(value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)))
           for value in numbers):
        return ""
    seed = values[4]
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        return ""
    temperature, top_k, top_p, min_p = numbers
    try:
        if top_k is not None and top_k != int(top_k):
            return ""
        sampling = SamplingSettings(float(0.0 if temperature is None else temperature),
                                    int(0 if top_k is None else top_k),
                                    float(1.0 if top_p is None else top_p),
                                    float(0.0 if min_p is None else min_p), seed, infill=header.get("infill") is True)
    except (OverflowError, ValueError):  # an infinite top-k, a float too large
        return ""
    penalties = _penalties(header.get("penalties"))
    if penalties is not None:
        sampling = dataclasses.replace(sampling, penalties=penalties)
    bias = header.get("logit_bias")  # [[token, amount]], None for -inf (JSON has no infinity)
    if isinstance(bias, list) and all(
            isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], int) and not isinstance(pair[0], bool)
            and (pair[1] is None or (isinstance(pair[1], (int, float)) and not isinstance(pair[1], bool)))
            for pair in bias):
        sampling = dataclasses.replace(sampling, logit_bias=tuple(
            (pair[0], -math.inf if pair[1] is None else float(pair[1])) for pair in bias))
    budget = _reasoning_budget(header.get("reasoning_budget"))
    if budget is not None:
        sampling = dataclasses.replace(sampling, reasoning_budget=budget)
    dry = _dry(header.get("dry"))
    if dry is not None:
        sampling = dataclasses.replace(sampling, dry=dry)
    mirostat = _mirostat(header.get("mirostat"))
    if mirostat is not None:
        sampling = dataclasses.replace(sampling, mirostat=mirostat)
    adaptive = header.get("adaptive_p")  # {target, decay} where on (SamplingSettings.fields)
    if isinstance(adaptive, dict) and all(isinstance(adaptive.get(name), (int, float)) and not isinstance(
            adaptive.get(name), bool) and math.isfinite(adaptive.get(name)) for name in ("target", "decay")):
        from specrun.adaptive_p import AdaptiveP

        sampling = dataclasses.replace(sampling, adaptive_p=AdaptiveP(float(adaptive["target"]), float(adaptive["decay"])))
    for name in ("typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold", "dynatemp_range",
                 "dynatemp_exponent"):  # where on (SamplingSettings.fields)
        value = header.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                sampling = dataclasses.replace(sampling, **{name: float(value)})
            except OverflowError:  # past a float: no run's
                return ""
    order = header.get("samplers")  # the run's order (SamplingSettings.fields); none: temperature first
    if isinstance(order, list) and all(isinstance(name, str) for name in order):
        sampling = dataclasses.replace(sampling, order=tuple(order))
    elif order is None:
        sampling = dataclasses.replace(sampling, order=TEMPERATURE_FIRST)
    if sampling.validate() or (sampling.greedy and not sampling.shapes_rows):
        return ""
    return f", {'decoded' if sampling.greedy else 'sampled at'} {sampling.describe()}"


def _penalties(fields):
    """A header's ``penalties`` (SamplingSettings.fields) as Penalties, or None where it names none a run could use."""
    from specrun.penalties import Penalties

    if not isinstance(fields, dict):
        return None
    values = [fields.get(name) for name in ("repeat", "frequency", "presence", "last_n")]
    if any(isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
           for value in values) or values[3] != int(values[3]):
        return None
    penalties = Penalties(float(values[0]), float(values[1]), float(values[2]), int(values[3]))
    return None if penalties.problems() else penalties


def _dry(fields):
    """A header's ``dry`` (SamplingSettings.fields) as dry.Dry, or None where it names none a run could use."""
    from specrun.dry import Dry

    if not isinstance(fields, dict):
        return None
    values = [fields.get(name) for name in ("multiplier", "base", "allowed_length", "last_n")]
    breakers = fields.get("breakers")
    if any(isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
           for value in values) or values[2] != int(values[2]) or values[3] != int(values[3]) or not (
            isinstance(breakers, list) and all(isinstance(breaker, str) for breaker in breakers)):
        return None
    dry = Dry(float(values[0]), float(values[1]), int(values[2]), int(values[3]), tuple(breakers))
    return None if dry.problems() else dry


def _mirostat(fields):
    """A header's ``mirostat`` (SamplingSettings.fields) as mirostat.Mirostat, or None where it names
    none a run could use."""
    from specrun.mirostat import Mirostat

    if not isinstance(fields, dict):
        return None
    values = [fields.get(name) for name in ("version", "tau", "eta")]
    if any(isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
           for value in values) or values[0] != int(values[0]):
        return None
    mirostat = Mirostat(int(values[0]), float(values[1]), float(values[2]))
    return None if mirostat.problems() or not mirostat.on else mirostat


def _reasoning_budget(fields):
    """A header's ``reasoning_budget`` (SamplingSettings.fields) as a ReasoningBudget, or None where
    it names none a run could use."""
    from specrun.reasoning_budget import ReasoningBudget

    def ids(value) -> bool:
        return isinstance(value, list) and all(isinstance(token, int) and not isinstance(token, bool) for token in value)

    if not isinstance(fields, dict):
        return None
    starts, ends, forced = fields.get("starts"), fields.get("ends"), fields.get("forced")
    budget, start_at = fields.get("budget"), fields.get("start_at")
    if not (isinstance(starts, list) and all(ids(tag) for tag in starts) and isinstance(ends, list)
            and all(ids(tag) for tag in ends) and ids(forced) and ids([budget, start_at])):
        return None
    rule = ReasoningBudget(tuple(tuple(tag) for tag in starts), tuple(tuple(tag) for tag in ends), tuple(forced),
                           budget, start_at)
    return None if rule.problems() else rule


def explain(run: RunTrace, most_events: int = 12, live: bool = False) -> list[str]:
    """The run in a few lines: its name, its passes, its drafters, its time, the policy's turns
    (at most ``most_events``, then how many more), its end. ``live``: a server's trace, written
    as it goes (a run without an end may still be going); other traces are put in place whole."""
    lines = [_title(run)]
    steps = run.steps
    if steps:
        emitted = sum(step.get("emitted", 0) for step in steps)
        plans: dict[str, int] = {}
        for step in steps:  # a pass that asked for a draft and got none verified one token: said so
            plan = step.get("plan", "?")
            plan = "asked for a draft and got none" if plan == "draft" and step.get("drafted", 1) == 0 else plan
            plans[plan] = plans.get(plan, 0) + 1
        kinds = ", ".join(f"{count} {plan}" for plan, count in sorted(plans.items(), key=lambda item: -item[1]))
        passes = f"{len(steps)} pass{'' if len(steps) == 1 else 'es'}"
        lines.append(f"  {count_of(emitted, 'token')} in {passes} ({emitted / len(steps):.2f} a pass): {kinds}")
        lines.extend(f"  {line}" for line in _by_source(steps))
        draft_ms = sum(step.get("draft_ms", 0.0) for step in steps)
        verify_ms = sum(step.get("verify_ms", 0.0) for step in steps)
        if draft_ms + verify_ms > 0:
            share = draft_ms / (draft_ms + verify_ms)
            lines.append(f"  time: drafting {draft_ms:.0f} ms ({share:.0%}), verifying {verify_ms:.0f} ms")
        events = _events(steps)
        lines.extend(f"  {event}" for event in events[:most_events])
        if len(events) > most_events:
            lines.append(f"  … and {len(events) - most_events} more turns of the policy (--events to see them)")
    lines.append(f"  {_ending(run, live)}")
    return lines


def _title(run: RunTrace) -> str:
    where = run.where
    if "request" in where:
        opening = run.opening
        said = [f"slot {opening['slot']}"] if "slot" in opening else []
        if "prompt_tokens" in opening:
            said.append(f"{opening['prompt_tokens']} prompt tokens, {opening.get('cached_tokens', 0)} cached")
        if "temperature" in opening:
            said.append(f"temperature {opening['temperature']:g}")
        return f"request {where['request']}" + (f" ({', '.join(said)})" if said else "")
    if "answer" in where:
        return f"answer {where['answer']}"
    if "prompt" in where:
        return f"prompt {where['prompt']}, {where.get('line', '?')}, repeat {where.get('repeat', '?')}"
    return "the run"


def _by_source(steps: list[dict]) -> list[str]:
    """Each drafter's passes, drafted and kept tokens, and what a drafted token cost it (where that
    is a tenth of a millisecond or more: a draft model, heads); then a plain pass's median cost."""
    sources: dict[str, list[float]] = {}
    for step in steps:
        if step.get("drafted", 0) > 0:
            counts = sources.setdefault(step.get("source", "?"), [0, 0, 0, 0.0])
            counts[0] += 1
            counts[1] += step["drafted"]
            counts[2] += step.get("accepted", 0)
            counts[3] += step.get("draft_ms", 0.0)
    told = []
    for source, (n, drafted, kept, draft_ms) in sorted(sources.items(), key=lambda item: -item[1][1]):
        cost = f", {draft_ms / drafted:.1f} ms a drafted token" if draft_ms / drafted >= 0.1 else ""
        told.append(f"{source}: {n} pass{'es' if n != 1 else ''}, {drafted} drafted, {kept} kept "
                    f"({kept / drafted:.0%}){cost}")
    plain, waited = [], []  # a pass queued by the step before (read ahead): its wait, not its cost
    for step in steps:
        if step.get("plan") == "plain" and "verify_ms" in step:
            (waited if step.get("queued") else plain).append(step["verify_ms"])
    if plain:
        told.append(f"a plain pass: {sorted(plain)[len(plain) // 2]:.1f} ms (the median of {len(plain)})")
    elif waited:
        told.append(f"a plain step waited {sorted(waited)[len(waited) // 2]:.1f} ms for its pass, queued by the "
                    f"step before (the median of {len(waited)})")
    return told


def _rate(value) -> str:
    return f"{value:.1f}" if isinstance(value, (int, float)) else "?"


def _events(steps: list[dict]) -> list[str]:
    """Where the policy changed its mind, step by step."""
    events: list[str] = []
    before: dict | None = None
    for step in steps:
        policy = step.get("policy")
        if not isinstance(policy, dict):
            continue
        at = f"step {step.get('step', '?')} (context {step.get('context', '?')})"
        gate, was_gate = policy.get("gate") or {}, (before or {}).get("gate") or {}
        if before is not None and gate.get("on") != was_gate.get("on"):
            events.append(f"{at}: speculation back on" if gate.get("on") else
                          f"{at}: the gate on realised speed turned speculation off for "
                          f"{gate.get('plain_steps_left', '?')} plain steps")
        drafters, was_drafters = policy.get("drafters") or {}, (before or {}).get("drafters") or {}
        for name, state in drafters.items():
            was = was_drafters.get(name)
            if was is None or state.get("on") == was.get("on"):
                continue
            if state.get("on"):
                events.append(f"{at}: {name} on again (best length {state.get('best_length')}, expected "
                              f"{_rate(state.get('expected_tokens_per_second'))} tok/s against plain "
                              f"{_rate(state.get('plain_tokens_per_second'))})")
            else:
                plain = _rate(state.get("plain_tokens_per_second"))
                why = (f"no draft length beats plain decoding's {plain} tok/s" if not state.get("best_length") else
                       f"expected {_rate(state.get('expected_tokens_per_second'))} tok/s at its best length "
                       f"{state['best_length']} against plain {plain}")
                events.append(f"{at}: {name} off: {why}; probed again in {state.get('probe_in', '?')} steps")
        batch, was_batch = policy.get("batch"), (before or {}).get("batch")
        if isinstance(batch, dict) and (not isinstance(was_batch, dict) or any(
                batch.get(key) != was_batch.get(key) for key in ("length", "sequences", "held_plain"))):
            held = ""
            if batch.get("held_plain"):
                realised = batch.get("realised", {})
                held = (f"; plain held at {batch.get('slots', '?')} slots: {_rate(realised.get('rates'))} tok/s "
                        f"measured under the rates' choice against {_rate(realised.get('plain'))} plain")
            events.append(f"{at}: {batch.get('sequences')} slots together draft {batch.get('length')} each "
                          f"({batch.get('gain', 1.0):.2f}x plain batching's tokens/s, predicted{held})")
        before = policy
    return events


def _ending(run: RunTrace, live: bool) -> str:
    if run.summary is not None:
        summary = run.summary
        reason = f" ({run.finish_reason})" if run.finish_reason else ""
        speed = summary.get("tokens_per_second")
        rate = f", {speed:.1f} tok/s" if isinstance(speed, (int, float)) else ""
        return f"finished{reason}: {summary.get('new_tokens', '?')} tokens{rate}, " \
               f"{summary.get('mean_tokens_per_step', 0):.2f} a verify pass"
    if run.stopped is not None:
        return f"stopped: {run.stopped}"
    if live:
        return "not ended (the trace was cut off, or is still being written)"
    return "not ended: interrupted before its statistics (a chat's Ctrl-C ends the answer, not the chat)"
