"""/metrics: what the server has done, in Prometheus' text format (version 0.0.4)."""

from __future__ import annotations

import math

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def sample_value(value: float) -> str:
    """A sample's value as Prometheus reads it back exactly: a whole number as one (a counter past a
    million written "1.23457e+06" lost its last digits, and rate() over it jumped), else every digit."""
    value = float(value)
    if math.isnan(value) or math.isinf(value):
        return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)


def _family(lines: list[str], name: str, kind: str, help_text: str, samples) -> None:
    """One metric family: its HELP and TYPE lines, then ``samples`` as (labels, value)."""
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        shown = "{" + ",".join(f'{key}="{val}"' for key, val in labels.items()) + "}" if labels else ""
        lines.append(f"{name}{shown} {sample_value(value)}")


def render(worker) -> str:
    """The worker's counters, its queue and slots, and the batches its slots' passes shared."""
    metrics = worker.metrics
    lines: list[str] = []
    _family(lines, "specrun_requests_total", "counter", "Requests answered, by finish reason (error: failed).",
            [({"finish_reason": reason}, count) for reason, count in sorted(metrics.requests.items())]
            or [({"finish_reason": "stop"}, 0)])
    _family(lines, "specrun_requests_refused_total", "counter",
            "Requests refused unanswered: busy (429, the queue full), shutting_down (503, queued or sent then).",
            [({"reason": why}, metrics.refused.get(why, 0)) for why in ("busy", "shutting_down")])
    _family(lines, "specrun_prompt_tokens_total", "counter", "Prompt tokens of the answers.", [({}, metrics.prompt_tokens)])
    _family(lines, "specrun_prompt_tokens_cached_total", "counter",
            "Prompt tokens found in the slot's cache, not prefilled (a conversation's earlier turns).",
            [({}, metrics.cached_prompt_tokens)])
    _family(lines, "specrun_generated_tokens_total", "counter", "Tokens generated.", [({}, metrics.new_tokens)])
    _family(lines, "specrun_verify_passes_total", "counter", "Target verify passes of the answers.",
            [({}, metrics.steps)])
    _family(lines, "specrun_drafted_tokens_total", "counter",
            "Draft tokens verified (over verify passes: the mean draft length chosen).", [({}, metrics.drafted)])
    _family(lines, "specrun_accepted_tokens_total", "counter", "Draft tokens accepted.", [({}, metrics.accepted)])
    _family(lines, "specrun_time_to_first_token_seconds", "summary", "From a request queued to its first text.",
            [])
    lines.append(f"specrun_time_to_first_token_seconds_sum {sample_value(metrics.first_token_seconds)}")
    lines.append(f"specrun_time_to_first_token_seconds_count {metrics.first_tokens}")
    _family(lines, "specrun_request_seconds", "summary", "From a request queued to its answer's end.", [])
    lines.append(f"specrun_request_seconds_sum {sample_value(metrics.answer_seconds)}")
    lines.append(f"specrun_request_seconds_count {metrics.answers}")
    _family(lines, "specrun_queued_requests", "gauge", "Requests waiting for a slot.", [({}, worker.jobs.qsize())])
    _family(lines, "specrun_active_requests", "gauge", "Requests being answered.", [({}, len(worker.active))])
    _family(lines, "specrun_slots", "gauge", "Requests that may be decoded together (--parallel).",
            [({}, worker.parallel)])
    counts = worker.slots.rendezvous.counts if worker.slots is not None else {}
    models = sorted(counts.items())
    _family(lines, "specrun_batches_total", "counter", "Passes the slots shared, by model.",
            [({"model": label}, c.passes) for label, c in models])
    _family(lines, "specrun_batch_sequences_total", "counter",
            "Sequences those passes held (over batches: the mean batch occupancy).",
            [({"model": label}, c.sequences) for label, c in models])
    _family(lines, "specrun_batch_tokens_total", "counter", "Tokens those passes held.",
            [({"model": label}, c.tokens) for label, c in models])
    _family(lines, "specrun_batch_seconds_total", "counter", "Seconds those passes took.",
            [({"model": label}, c.seconds) for label, c in models])
    batch = worker.slots.batch if worker.slots is not None else None
    chosen, gains = batch.choices() if batch is not None else ([], [])
    _family(lines, "specrun_batch_draft_lengths_total", "counter",
            "Draft lengths the slots' batch chose, once a slot a step it was asked, by the slots decoding together "
            "(0: plain batching).",
            [({"sequences": m, "length": k}, count) for (m, k), count in chosen])
    _family(lines, "specrun_batch_draft_gain", "gauge",
            "The latest choice's tokens a second over plain batching's as its measured costs predicted them, "
            "by the slots decoding together, kept until that many decode together again (1: plain).",
            [({"sequences": m}, gain) for m, gain in gains])
    _family(lines, "specrun_batch_realised_tokens_per_second", "gauge",
            "Tokens a second the slots' batch got over its latest measured stretches, by the slots generating, "
            "under the rates' choice (arm \"rates\") and plain (arm \"plain\": held plain, or the rates "
            "choosing 0 all the stretch).",
            [({"slots": m, "arm": arm}, rate) for m, arm, rate in (batch.measured() if batch is not None else [])])
    _family(lines, "specrun_batch_held_plain", "gauge",
            "1 where plain batching is held because the rates' choice measured slower, by the slots generating.",
            [({"slots": m}, int(held)) for m, held in (batch.held_plain() if batch is not None else [])])
    return "\n".join(lines) + "\n"
