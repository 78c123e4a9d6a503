"""The bench as one JSON document: configuration, machine, every raw run and every figure.

Schema ``specrun.bench/1`` (keys in order):

- schema, started_at (ISO 8601 UTC), wall_seconds
- config: target, draft, methods, variants [{name, method, draft_len, adaptive}] (adaptive:
  the length chosen as it went, draft_len its longest), draft_lens (as asked: empty when
  each method ran as generate runs it), draft_min_prob (as run), sweep, max_new_tokens,
  temperature, top_k, top_p, min_p, typical_p, top_n_sigma, xtc_probability, xtc_threshold,
  dynatemp_range, dynatemp_exponent, mirostat (its version, tau and eta, or null), adaptive_p (its
  target and decay, or null),
  dry (its multiplier, base, allowed_length, last_n and breakers, or null), samplers (their order), seed, repeat, chat, suite, n_ctx, baseline, timing, tuned (the key of the stored settings the controllers started from, or null),
  tuned_by ("specrun tune", "earlier runs" (learned.json), or null),
  verify (how exact sampled chains were verified: block or token), acceptance ("exact", or a lossy
  rule's label such as "typical (lossy)": the drafting lines' texts are then not the target's own)
  and acceptance_settings (the lossy rule's rule, epsilon, delta and factor, or null)
- machine: cpu, cores, gpu, os, backend, threads, versions {specrun, llama-cpp-python,
  mlx, mlx-lm, numpy, python}
- prompts: [{index, id, category, prompt_tokens}]; skipped: [{id, category, reason}]
- runs: [{prompt_index, variant, repeat, finish_reason, same_as_baseline, stats}]: every run, with
  specrun's Stats.to_dict() (counts, accepted_hist, by_source {drafter: {steps, drafted,
  accepted}}, timings); same_as_baseline is null
  when sampling
- per_prompt, per_category ({category: [figures]}), overall (every prompt): figures
  rows {variant, method, draft_len, prompts, tokens, seconds, tokens_per_second,
  median_tokens_per_second, speedup, acceptance_rate, mean_tokens_per_step,
  draft_share, verify_share, mismatches, near_ties, agreement, log_likelihood}; per_prompt rows add
  prompt_index. Under a lossy rule (else null): agreement, the share of plain decoding's tokens the
  texts repeat before their first difference (null when sampling), and log_likelihood, the target's
  mean log-probability per token of the texts (temperature 1); a lossy line's mismatches are not
  located (its texts differ by design)
- accepted_hist: {variant: [steps that accepted n drafted tokens, n = 0, 1, …]}
- sweep: {method: [{draft_len, speedup}]} for every fixed-length method (not adaptive lines)
- mismatches: [{variant, prompt_index, prompt_id, position, plain_token, other_token, plain_text,
  other_text, token_gap, top2_gap, batch_rounding, near_tie, within_rounding, verdict, defect}]: one per
  prompt where a variant's output differs from the baseline's, at the first differing token
  (position, counted in output tokens); plain_/other_token: the two tokens there (null, and text
  "(end of output)", where an output ended); token_gap: the target's logit for plain's token
  minus the other's (null where one ended), top2_gap: its top-1 minus its runner-up;
  batch_rounding: how far a batched pass moved the logits there; within_rounding: the gap below
  twice that, or a near-tie; verdict "near-tie" or "DEFECT", defect true for a difference
  rounding does not explain (every difference under --exact): what the tables count as mismatches
"""

from __future__ import annotations

import dataclasses

from specrun.bench.figures import ALL_PROMPTS, by_category, mismatch_rows, per_prompt, sweep_curve
from specrun.bench.runner import BenchResult

SCHEMA = "specrun.bench/1"


def bench_to_dict(result: BenchResult) -> dict:
    """Everything the bench measured, JSON-ready."""
    categories = {name: [f.to_dict() for f in rows] for name, rows in by_category(result).items()}
    overall = categories.pop(ALL_PROMPTS)
    return {
        "schema": SCHEMA,
        "started_at": result.started_at,
        "wall_seconds": round(result.wall_seconds, 3),
        "config": _config(result),
        "machine": result.machine,
        "prompts": [
            {"index": i, "id": p.prompt_id, "category": p.category, "prompt_tokens": n}
            for i, (p, n) in enumerate(zip(result.prompts, result.prompt_tokens))
        ],
        "skipped": [
            {"id": s.prompt.prompt_id, "category": s.prompt.category, "reason": s.reason} for s in result.skipped
        ],
        "runs": _runs(result),
        "per_prompt": _per_prompt(result),
        "per_category": categories,
        "overall": overall,
        "accepted_hist": {name: f.accepted_hist for name, f in result.comparison.figures.items()},
        "sweep": {
            method: [{"draft_len": k, "speedup": speedup} for k, speedup in points]
            for method, points in sweep_curve(result).items()
        },
        "mismatches": [
            {
                "variant": variant,
                "prompt_index": m.prompt_index,
                "prompt_id": result.prompts[m.prompt_index].prompt_id,
                "position": m.position,
                "plain_token": m.plain_token,
                "other_token": m.other_token,
                "plain_text": m.plain_text,
                "other_text": m.other_text,
                "token_gap": m.token_gap,
                "top2_gap": m.top2_gap,
                "batch_rounding": m.batch_rounding,
                "near_tie": m.near_tie,
                "within_rounding": m.within_rounding,
                "verdict": m.verdict(result.exact),
                "defect": m.is_defect(result.exact),
            }
            for variant, m in mismatch_rows(result)
        ],
    }


def _config(result: BenchResult) -> dict:
    config = result.config
    sampling = config.sampling
    return {
        "target": config.target,
        "draft": config.draft,
        "methods": list(config.methods),
        "variants": [
            {"name": v.name, "method": v.method, "draft_len": v.draft_len, "adaptive": v.adapts}
            for v in result.comparison.variants.values()
        ],
        "draft_lens": list(config.draft_lens),
        "draft_min_prob": result.draft_min_prob,
        "sweep": config.sweep,
        "max_new_tokens": config.max_new_tokens,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "min_p": sampling.min_p,
        "typical_p": sampling.typical_p,
        "top_n_sigma": sampling.top_n_sigma,
        "xtc_probability": sampling.xtc_probability,
        "xtc_threshold": sampling.xtc_threshold,
        "dynatemp_range": sampling.dynatemp_range,
        "dynatemp_exponent": sampling.dynatemp_exponent,
        "mirostat": sampling.mirostat.fields() if sampling.mirostat_on else None,
        "adaptive_p": sampling.adaptive_p.fields() if sampling.adaptive_on else None,
        "dry": sampling.dry.fields() if sampling.dry.on else None,
        "samplers": list(sampling.order),
        "seed": sampling.seed,
        "repeat": config.repeat,
        "chat": config.chat,
        "exact": config.load.exact,
        "tree_nodes": config.trees.nodes,  # 0: chains only
        "branches": config.trees.branches,
        # the lookahead method's WINDOW:NGRAM:CANDIDATES (None: no lookahead line)
        "lookahead": None if config.lookahead is None else dataclasses.astuple(config.lookahead),
        "kv_type": config.load.llama_kv_type,
        "flash_attn": result.flash_attn,  # what the target ran with (--flash-attn, or measured: sessions/kernels.py)
        "rpc": list(config.load.rpc),  # the RPC servers the target ran on (empty: this machine)
        "gpu_layers": config.load.gpu_layers,
        "suite": config.suite,
        "n_ctx": result.n_ctx,
        "baseline": result.comparison.baseline,
        "timing": "generation only (prefill excluded); methods interleaved per prompt",
        "tuned": result.tuned,
        "tuned_by": None if result.tuned is None else "earlier runs" if result.tuned_by_runs else "specrun tune",
        "native": _native(result.comparison),
        "verify": config.verification.chain_rule,
        "acceptance": result.comparison.acceptance,
        "acceptance_settings": None if config.verification.acceptance is None
        else dataclasses.asdict(config.verification.acceptance),
    }


def _native(comparison) -> dict | None:
    """The backend's own plain loop beside the methods (bench --native), or None."""
    if not comparison.native:
        return None
    return {
        "name": comparison.native_name,
        "tokens_per_second_by_prompt": {str(i): rates for i, rates in comparison.native.items()},
        "speedup_geomean": {name: comparison.native_speedup(name) for name in comparison.figures},
    }


def _runs(result: BenchResult) -> list[dict]:
    comparison = result.comparison
    baseline = comparison.figures[comparison.baseline]
    rows = []
    for name, figures in comparison.figures.items():
        for index, runs in figures.by_prompt.items():
            reference = baseline.by_prompt[index][0].token_ids
            for repeat, run in enumerate(runs):
                same = run.token_ids == reference if comparison.outputs_compared else None
                rows.append(
                    {
                        "prompt_index": index,
                        "variant": name,
                        "repeat": repeat,
                        "finish_reason": run.finish_reason,
                        "same_as_baseline": same,
                        "stats": run.stats.to_dict(),
                    }
                )
    return sorted(rows, key=lambda row: (row["prompt_index"], row["repeat"]))


def _per_prompt(result: BenchResult) -> list[dict]:
    return [{"prompt_index": index, **figures.to_dict()} for index, figures in per_prompt(result)]
