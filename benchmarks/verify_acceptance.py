"""Acceptance of the exact verification rules (issue 54): block against token-by-token
verification of sampled chains, and, for siblings drawn independently from one row, SpecTr's
k-sequential selection against multi-round rejection (and against siblings drawn without
replacement, how specrun's drafters draw them). Tokens per pass only: no timing.

Each pair runs the built-in prompts at each temperature with both chain rules interleaved
(same seed per prompt): "live" is tokens per verify pass as generated. Every sampled pass is
recorded and each rule's exact expected accepted drafts computed on the very same passes
("same passes"), which removes the noise of two different texts. The rows of the first drafted
position of those passes give the independent-siblings figures: the exact chance one of k
siblings is accepted (k-sequential, and multi-round rejection with replacement), and a Monte
Carlo estimate for siblings drawn without replacement.

    .venv/bin/python benchmarks/verify_acceptance.py                                   # fake pair
    .venv/bin/python benchmarks/verify_acceptance.py --target demo-target-xl --draft demo-draft
    .venv/bin/python benchmarks/verify_acceptance.py --target smollm2-135m-f16 --draft smollm2-135m

With ``--spec-bench PATH --per-category N`` the prompts are N Spec-Bench questions a category,
and a second table gives the same-passes figures by category (issue 54: block never lower in any).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import specrun.engine.passes  # noqa: E402
from specrun.bench.suite import BUILTIN_SUITE  # noqa: E402
from specrun.drafters.methods import DrafterOptions, build_drafter, needs_draft_model  # noqa: E402
from specrun.engine.loop import GenerationParams, SpeculativeEngine  # noqa: E402
from specrun.sampling import SamplingSettings  # noqa: E402
from specrun.verify import block_keep_chances, k_sequential_rho, sibling_row  # noqa: E402

RULES = ("block", "token")
SIBLINGS = (2, 3, 4)
WITHOUT_REPLACEMENT_DRAWS = 64  # Monte Carlo draws per row for siblings drawn without replacement
SIBLING_ROWS = 300  # rows (first drafted positions) the siblings' figures average over


def token_expected(tokens, p_target, p_draft) -> float:
    """Token by token: sum over i of prod_{j <= i} min(1, p_target(x_j) / p_draft(x_j))."""
    reach, total = 1.0, 0.0
    for i, token in enumerate(tokens):
        q = 1.0 if p_draft[i] is None else float(p_draft[i][token])
        reach *= min(1.0, float(p_target[i][token]) / q)
        total += reach
    return total


def block_expected(tokens, p_target, p_draft) -> float:
    """Block verification: sum over t of t h_t prod_{i > t} (1 - h_i)."""
    keep, _ = block_keep_chances(tokens, p_target, p_draft)
    k = len(tokens)
    return sum((t + 1) * keep[t] * float(np.prod(1.0 - keep[t + 1:])) for t in range(k))


def siblings_accepted(p_target_row, p_draft_row, n_drafts: int, rng) -> tuple[float, float, float]:
    """The chance one of ``n_drafts`` siblings is accepted: drawn independently and selected by
    k-sequential selection (exact), or tried by multi-round rejection (exact: a rejection leaves
    the same residual whatever the token); drawn without replacement and tried by multi-round
    rejection, each sibling against its sibling_row (Monte Carlo over the draws)."""
    _, beta = k_sequential_rho(p_target_row, p_draft_row, n_drafts)
    rejected, p_row = 1.0, p_target_row
    for _ in range(n_drafts):
        rejected *= 1.0 - np.minimum(p_row, p_draft_row).sum()
        left = np.maximum(p_row - p_draft_row, 0.0)
        p_row = left / left.sum() if left.sum() > 0.0 else p_row
    without = []
    support = int((p_draft_row > 0).sum())
    for _ in range(WITHOUT_REPLACEMENT_DRAWS):
        p_row, q_row, drawn, stay = p_target_row, p_draft_row, [], 1.0
        for _ in range(min(n_drafts, support)):
            token = int(rng.choice(len(q_row), p=q_row))
            stay *= 1.0 - min(1.0, p_row[token] / q_row[token])
            left = np.maximum(p_row - q_row, 0.0)
            p_row = left / left.sum() if left.sum() > 0.0 else p_row
            drawn.append(token)
            if len(drawn) < support:
                q_row = sibling_row(p_draft_row, drawn)
        without.append(1.0 - stay)
    return 1.0 - (1.0 - beta) ** n_drafts, 1.0 - rejected, float(np.mean(without))


class Recorder:
    """Records every sampled chain pass (tokens, p_target, p_draft) whichever rule runs it."""

    def __init__(self) -> None:
        self.passes: list[tuple] = []

    def __enter__(self) -> "Recorder":
        self._rules = {name: getattr(specrun.engine.passes, name) for name in ("verify_block", "verify_sampled")}
        for name, rule in self._rules.items():
            setattr(specrun.engine.passes, name, self._wrap(rule))
        return self

    def __exit__(self, *exc) -> None:
        for name, rule in self._rules.items():
            setattr(specrun.engine.passes, name, rule)

    def _wrap(self, rule):
        def verify(tokens, p_target, p_draft, rng):
            if len(tokens):
                self.passes.append((tuple(tokens), np.array(p_target), tuple(p_draft)))
            return rule(tokens, p_target, p_draft, rng)

        return verify


def fake_pair(vocab: int = 64):
    """A fake target and a draft that half agrees with it (tests/fake_models.hashed_logits)."""
    from fake_models import hashed_logits
    from specrun.backends.fake import FakeBackend

    target_table = hashed_logits(vocab, salt=1, spread=2.0)
    noise = hashed_logits(vocab, salt=2, spread=1.5)
    return FakeBackend(target_table, vocab), FakeBackend(lambda context: 0.8 * target_table(context) + noise(context), vocab)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="a model alias or path (default: the fake pair)")
    parser.add_argument("--draft")
    parser.add_argument("--methods", default="draft,lookup")
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("-k", type=int, default=4, help="the fixed draft length (default 4)")
    parser.add_argument("-n", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=21)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--spec-bench", type=Path, default=None, help="Spec-Bench's question.jsonl: its prompts")
    parser.add_argument("--per-category", type=int, default=1, help="with --spec-bench: questions a category")
    parser.add_argument("--no-siblings", action="store_true", help="leave out the siblings' table (slow)")
    args = parser.parse_args()

    if args.target:
        from specrun.registry.loading import LoadOptions, open_pair

        target, draft = open_pair(args.target, args.draft, LoadOptions(threads=args.threads))
        label = f"{args.target} + {args.draft}"
    else:
        target, draft = fake_pair()
        label = "fake pair (64 tokens)"
    if args.spec_bench is not None:
        from _llama_tools import spec_bench

        prompts = spec_bench(args.spec_bench, args.per_category)
        named = f"{len(prompts)} Spec-Bench prompts"
    else:
        prompts = BUILTIN_SUITE[: args.prompts]
        named = f"{len(prompts)} built-in prompts"
    rng = np.random.default_rng(0)
    print(f"{label}, {named}, {args.n} tokens, -k {args.k}")
    print("| method | T | live tokens/pass block | token | same passes: drafts kept block | token | gain | passes |")
    print("|---|---|---|---|---|---|---|---|")
    sibling_rows = []
    by_category: list[tuple[str, float, str, list[float], list[float]]] = []  # method, T, category, block, token
    for method in args.methods.split(","):
        drafter = build_drafter(method, draft if needs_draft_model(method) else None, DrafterOptions())
        engine = SpeculativeEngine(target, drafter, method=method)
        for temperature in (float(t) for t in args.temperatures.split(",")):
            live = {rule: [0, 0] for rule in RULES}
            categories: list[str] = []  # of each recorded pass
            with Recorder() as recorder:
                for index, prompt in enumerate(prompts):
                    ids = target.tokenize(prompt.text, add_bos=target.vocab.add_bos) if args.target \
                        else [int(c) % 64 for c in prompt.text.encode()[:32]]
                    for rule in RULES:
                        engine.passes.chain_rule = rule
                        sampling = SamplingSettings(temperature=temperature, seed=index)
                        result = engine.run(ids, GenerationParams(args.n, args.k, sampling, stop_at_eos=False))
                        drafting = [counts for source, counts in result.stats.by_source.items() if counts.drafted]
                        live[rule][0] += sum(counts.steps + counts.accepted for counts in drafting)
                        live[rule][1] += sum(counts.steps for counts in drafting)
                    categories += [prompt.category] * (len(recorder.passes) - len(categories))
            block = [block_expected(*each) for each in recorder.passes]
            token = [token_expected(*each) for each in recorder.passes]
            gain = (sum(block) - sum(token)) / sum(token) if sum(token) else 0.0
            per_pass = {rule: live[rule][0] / max(live[rule][1], 1) for rule in RULES}
            print(f"| {method} | {temperature} | {per_pass['block']:.3f} | {per_pass['token']:.3f} | "
                  f"{np.mean(block):.3f} | {np.mean(token):.3f} | {gain:+.1%} | {len(block)} |")
            for category in dict.fromkeys(categories):
                mine = [i for i, each in enumerate(categories) if each == category]
                by_category.append((method, temperature, category, [block[i] for i in mine], [token[i] for i in mine]))
            if needs_draft_model(method):
                sibling_rows += [(each[1][0], each[2][0], temperature) for each in recorder.passes]
        drafter.close()
    if len({row[2] for row in by_category}) > 1:
        print()
        print("By category, same passes: drafts kept a pass")
        print("| method | T | category | block | token | gain | passes |")
        print("|---|---|---|---|---|---|---|")
        for method, temperature, category, block, token in by_category:
            gain = (sum(block) - sum(token)) / sum(token) if sum(token) else 0.0
            print(f"| {method} | {temperature} | {category} | {np.mean(block):.3f} | {np.mean(token):.3f} | "
                  f"{gain:+.1%} | {len(block)} |")
    if sibling_rows and not args.no_siblings:
        print()
        print("Independent siblings at the first drafted position: the chance one of k is accepted")
        print("| T | k | k-sequential | multi-round rejection | without replacement, multi-round | rows |")
        print("|---|---|---|---|---|---|")
        picked = [sibling_rows[i] for i in rng.permutation(len(sibling_rows))]
        for temperature in sorted({row[2] for row in picked}):
            rows = [row for row in picked if row[2] == temperature][:SIBLING_ROWS]
            for n_drafts in SIBLINGS:
                figures = np.mean([siblings_accepted(p, q, n_drafts, rng) for p, q, _ in rows], axis=0)
                print(f"| {temperature} | {n_drafts} | {figures[0]:.4f} | {figures[1]:.4f} | {figures[2]:.4f} | {len(rows)} |")


if __name__ == "__main__":
    main()
