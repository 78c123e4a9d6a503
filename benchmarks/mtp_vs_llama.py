"""specrun's MTP drafting side by side with llama.cpp's own (issue 50): one GGUF carrying an MTP
layer, plain decoding and MTP drafting in both, every line in a fresh process per prompt,
interleaved (A B C … A B C …), prompts as typed (the model is no chat model).

No model with MTP layers can be downloaded here, so ``--make`` writes one: the tests' GLM-4.5-style
model (tests/mtp_models.py) at a width and depth you choose, its MTP layer trained on the target's
own continuations (ridge regression, mtp_models.write_fitted_glm). Its weights are random, so its
text is not language and acceptance depends on how well the layer was fitted; what the run shows
is each tool's overhead and how the same drafts pay in each.

Lines: llama-completion (plain), llama-speculative-simple --spec-type draft-mtp at draft size k
(its driver, common_speculative_impl_draft_mtp), specrun none, specrun mtp at -k k and adaptive.
Ratios are to llama-completion, geometric means over prompts with 90% intervals.

    .venv/bin/python benchmarks/mtp_vs_llama.py --make DIR --hidden 1024 --layers 8 \\
        --llama-bin-dir BIN --questions ../shared/data/spec_bench/question.jsonl --per-category 1
    .venv/bin/python benchmarks/mtp_vs_llama.py --make DIR --layout qwen35 --hidden 1024 --layers 8 \
        --llama-bin-dir BIN --in-sample --flash-attn on
    .venv/bin/python benchmarks/mtp_vs_llama.py --make DIR --layout deepseek2 --hidden 1024 --layers 8 \
        --llama-bin-dir BIN --in-sample --flash-attn on
    .venv/bin/python benchmarks/mtp_vs_llama.py --model DIR/glm-mtp-trained.gguf --llama-bin-dir BIN
    .venv/bin/python benchmarks/mtp_vs_llama.py --model DIR/glm-mtp-trained.gguf --llama-bin-dir BIN --in-sample
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(Path(__file__).resolve().parent)]

from _llama_tools import (  # noqa: E402
    _decoding_tool_line, check_bin_dir, completion_line, interleave, line_summary, machine_note, prepare,
    save_report, spec_bench, specrun_line, untuned_env,
)

from specrun.bench.suite import BUILTIN_SUITE, BenchPrompt  # noqa: E402


def make_model(folder: Path, hidden: int, layers: int, layout: str = "glm") -> Path:
    """The tests' GLM-style MTP model (or, ``layout`` qwen35, their Qwen3.5-style hybrid; deepseek2,
    their model of DeepSeek's latent attention, GLM-4.7-Flash's layout) at ``hidden`` wide and
    ``layers`` deep, its MTP layer trained."""
    from mtp_models import GlmShape, glm_weights, write_fitted_glm, write_glm_gguf

    folder.mkdir(parents=True, exist_ok=True)
    if layout == "deepseek2":
        from mtp_models import DeepseekShape, write_fitted_deepseek

        shape = DeepseekShape(hidden=hidden, heads=max(hidden // 64, 1), q_rank=3 * hidden // 8, kv_rank=hidden // 4,
                              nope=64, rope_dims=32, v_dim=64, dense_ffn=4 * hidden, trunk_layers=layers,
                              expert_ffn=hidden // 2, context=4096)
        return write_fitted_deepseek(folder, shape)["trained"]
    if layout == "qwen35":
        from hybrid_models import HybridShape, write_fitted_hybrid

        heads = max(hidden // 64, 1)
        shape = HybridShape(hidden=hidden, layers=layers, heads=heads, kv_heads=max(heads // 4, 1), head_dim=64,
                            rope_dims=32, ffn=3 * hidden, state=64, k_heads=max(heads // 2, 1), v_heads=heads,
                            context=4096)
        return write_fitted_hybrid(folder, shape)["trained"]
    heads = max(hidden // 64, 1)
    shape = GlmShape(hidden=hidden, heads=heads, kv_heads=max(heads // 2, 1), head_dim=64, rope_dims=32,
                     dense_ffn=4 * hidden, trunk_layers=layers, expert_ffn=hidden // 2, context=4096)
    weights = glm_weights(shape)
    glm = {"trunk": write_glm_gguf(folder / "glm-trunk.gguf", shape, weights, mtp_layers=0), "shape": shape,
           "weights": weights}
    return write_fitted_glm(folder / "glm-mtp-trained.gguf", glm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a GGUF carrying MTP layers")
    parser.add_argument("--make", type=Path, help="write the tests' GLM-style MTP model into this folder and use it")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--layout", choices=("glm", "qwen35", "deepseek2"), default="glm",
                        help="--make's model: GLM-4.5's (dense trunk, MoE MTP block) or Qwen3.5's (hybrid trunk: "
                        "Gated DeltaNet beside attention, rolled back after rejected drafts)")
    parser.add_argument("--llama-bin-dir", type=Path, required=True)
    parser.add_argument("--questions", type=Path, help="Spec-Bench question.jsonl (default: the built-in suite)")
    parser.add_argument("--in-sample", action="store_true",
                        help="the prompts the --make model's MTP layer was trained after (mtp_models.TRAINING_PROMPTS): "
                        "what its drafts look like where it predicts well")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("-k", type=int, default=3, help="draft size of the fixed-length lines")
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--flash-attn", choices=("on", "off"),
                        help="every line's flash attention (default: each tool's own choice; specrun measures it)")
    parser.add_argument("--json", type=Path, help="the raw figures (default: runs/)")
    args = parser.parse_args()
    if (args.model is None) == (args.make is None):
        parser.error("give --model or --make")
    model = args.model or make_model(args.make, args.hidden, args.layers, args.layout)
    check_bin_dir(args.llama_bin_dir, ["llama-completion", "llama-speculative-simple"])
    if args.in_sample:
        from mtp_models import TRAINING_PROMPTS

        chosen = [BenchPrompt(f"training-{i}", "training", text) for i, text in enumerate(TRAINING_PROMPTS)]
    else:
        chosen = spec_bench(args.questions, args.per_category) if args.questions else list(BUILTIN_SUITE)
    prompts, n_ctx = prepare(model, chosen, chat=False)
    flash = ("--flash-attn", args.flash_attn) if args.flash_attn else ()
    tool_flash = ["-fa", args.flash_attn] if args.flash_attn else []
    config = Path(tempfile.mkdtemp(prefix="specrun-mtp-bench-"))
    env = untuned_env(config)
    spec = [str(args.llama_bin_dir / "llama-speculative-simple"), "-m", str(model), "--spec-type", "draft-mtp",
            "--spec-draft-n-max", str(args.k), "--spec-draft-n-min", "0", "-n", str(args.n), "-t", str(args.threads),
            "-c", str(n_ctx), "--temp", "0", "--top-k", "1", *tool_flash]
    lines = [
        completion_line(args.llama_bin_dir, model, args.n, args.threads, n_ctx, extra=tuple(tool_flash)),
        _decoding_tool_line(f"llama-speculative-simple draft-mtp k={args.k}", spec, first_token_timed=True),
        specrun_line("none", model, None, args.n, args.threads, env, extra=flash),
        specrun_line("mtp", model, None, args.n, args.threads, env, extra=("-k", str(args.k), *flash),
                     name=f"mtp -k {args.k}"),
        specrun_line("mtp", model, None, args.n, args.threads, env, extra=flash),
    ]
    interleave(lines, prompts)
    baseline, reference = lines[0], lines[2]
    report = {"model": str(model), "machine": machine_note(), "prompts": len(prompts),
              "lines": {line.name: line_summary(line, baseline, reference) for line in lines}}
    for name, summary in report["lines"].items():
        ratio = summary.get("ratio")
        shown = f"{ratio:.2f}x [{summary['ratio_low']:.2f}, {summary['ratio_high']:.2f}]" if ratio else "-"
        acceptance = f", accepted {summary['acceptance']:.0%}" if "acceptance" in summary else ""
        print(f"{name:44s} {shown}  median {summary.get('median_tps', 0):.1f} tok/s{acceptance}")
    save_report(report, args.json, "mtp_vs_llama")
    print(json.dumps({name: s.get("ratio") for name, s in report["lines"].items()}))


if __name__ == "__main__":
    main()
