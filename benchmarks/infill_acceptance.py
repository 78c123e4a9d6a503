"""How much of a draft model's drafts the target accepts under llama.cpp's infill rule (what
editors' plugins ask for with "samplers": ["top_k", "top_p", "infill"]), the draft's rows
drawn under the rule as specrun draws them, and drawn without it: acceptance, the figure the
rule on the draft moves (a count: one run is the figure; no timing here).

    .venv/bin/python benchmarks/infill_acceptance.py --target smollm2-135m-x2 --draft smollm2-135m \
        --spec-bench ../shared/data/spec_bench/question.jsonl

Two prompt sets, side by side: the start of each of specrun's own source files (code, as an
editor sends it) and Spec-Bench's first questions (prose). Sampling as llama.vscode sends it:
T = 1 (no temperature sampler listed), top-k 40, top-p 0.99.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specrun.drafters.draft_model import DraftModelDrafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.registry.loading import LoadOptions, open_backend
from specrun.sampling import SamplingSettings, probabilities

SETTINGS = SamplingSettings(1.0, 40, 0.99, 0.0, seed=1, infill=True)
SOURCE_CHARACTERS = 1500


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-x2")
    parser.add_argument("--draft", default="smollm2-135m")
    parser.add_argument("--spec-bench", type=Path, help="Spec-Bench's question.jsonl")
    parser.add_argument("--prompts", type=int, default=20, help="prompts of each set")
    parser.add_argument("-n", type=int, default=64, help="tokens at most an answer")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    sources = sorted((Path(__file__).parent.parent / "specrun").rglob("*.py"))[: args.prompts]
    sets = {"code (specrun's sources)": [path.read_text()[:SOURCE_CHARACTERS] for path in sources]}
    if args.spec_bench:
        lines = args.spec_bench.read_text().splitlines()[: args.prompts]
        sets["Spec-Bench"] = [json.loads(line)["turns"][0] for line in lines]
    target = open_backend(args.target, LoadOptions(threads=args.threads))
    draft = open_backend(args.draft, LoadOptions(threads=args.threads))
    ruled = DraftModelDrafter._p_draft
    print(f"{args.target} + {args.draft}, {SETTINGS.describe()}, {args.n} tokens at most")
    print("| prompts | draft rows | accepted / drafted | tokens |")
    print("|---|---|---|---|")
    try:
        for name, prompts in sets.items():
            for rows, p_draft in (("under the rule", ruled), ("without it", _plain)):
                DraftModelDrafter._p_draft = p_draft
                accepted = drafted = tokens = 0
                for prompt in prompts:
                    engine = SpeculativeEngine(target, DraftModelDrafter(draft), method="draft")
                    result = engine.run(target.tokenize(prompt), GenerationParams(args.n, 4, sampling=SETTINGS))
                    accepted += result.stats.accepted
                    drafted += result.stats.drafted
                    tokens += result.stats.new_tokens
                print(f"| {name} | {rows} | {accepted / max(drafted, 1):.2f} ({accepted}/{drafted}) | {tokens} |")
    finally:
        DraftModelDrafter._p_draft = ruled
        target.close()
        draft.close()


def _plain(self, logits, sampling):
    return probabilities(logits, sampling)


if __name__ == "__main__":
    main()
