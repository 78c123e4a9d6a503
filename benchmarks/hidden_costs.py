"""What reading a target's hidden states costs a llama.cpp pass, and what an EAGLE-3 depth costs beside it.

Head methods need the target's states with every verify pass: EAGLE-1, Medusa and Hydra the
output head's input (``llama_set_embeddings``: llama.cpp then outputs, and computes logits for,
every row), EAGLE-3 the outputs of three layers (llama.cpp's ``llama_set_embeddings_layer_inp``:
a copy of every row's layer input, logits only where asked). This times passes of 1 and of
``--verify`` tokens after a ``--context``-token prompt, untracked, tracking the head's input and
tracking the layers SGLang reads (1, N/2 - 1, N - 4), in interleaved rounds (median of each), and
one EAGLE-3 drafting depth in NumPy (specrun's drafter: its layer and the projection over
``--draft-vocab`` tokens) for a head as wide as the target, as published EAGLE-3 heads are.

    .venv/bin/python benchmarks/hidden_costs.py --target smollm2-135m-f16 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _report import write_report  # noqa: E402
from heads_factory import eagle3_heads  # noqa: E402
from specrun.backends.kv import sequence_for  # noqa: E402
from specrun.backends.llama import LlamaCppBackend  # noqa: E402
from specrun.drafters.heads.eagle import EagleDrafter  # noqa: E402
from specrun.modelkit.builtin import builtin_gguf  # noqa: E402
from specrun.heads.config import default_aux_layer_ids
from specrun.sampling import SamplingSettings  # noqa: E402

MODES = ("untracked", "head input", "layers")


def time_passes(backend: LlamaCppBackend, context: list[int], verify: int, mode: str, rounds: int) -> dict[int, float]:
    """Median seconds of a 1-token and a ``verify``-token pass after ``context``, tracking as ``mode`` says."""
    layers = default_aux_layer_ids(backend.hidden_support.layers) if mode == "layers" else ()
    backend.hidden_layers(layers)
    backend.track_hidden(mode != "untracked")
    times: dict[int, list[float]] = {1: [], verify: []}
    try:
        for _ in range(rounds):
            for count in times:
                backend.rewind(len(context))
                started = time.perf_counter()
                backend.forward(context[:count], [count - 1])  # any tokens: the cost is the count's
                times[count].append(time.perf_counter() - started)
    finally:
        backend.track_hidden(False)
    return {count: statistics.median(values) for count, values in times.items()}


def eagle3_depth_seconds(backend: LlamaCppBackend, context: list[int], draft_vocab: int, depth: int = 4) -> float:
    """Seconds a depth of specrun's EAGLE-3 drafter takes (a chain of ``depth``, its root's entry
    made again each time, as between verify passes), for a head as wide as the target with an MLP
    as wide as its own (its GGUF's feed-forward length) and ``draft_vocab`` draft tokens."""
    support = backend.hidden_support
    size = support.size
    inner = int(backend.metadata(f"{backend.metadata('general.architecture')}.feed_forward_length") or 4 * size)
    heads = eagle3_heads(size, backend.vocab.size, depth=depth, heads=max(size // 64, 1), kv_heads=max(size // 192, 1),
                         head_dim=64, intermediate=inner, draft_vocab=range(draft_vocab), aux=())
    drafter = EagleDrafter(heads)
    sequence = sequence_for(backend)
    sequence.reset()
    drafter.bind(sequence, time.perf_counter)
    sequence.feed(context[:-1])
    drafter.propose(context, depth, SamplingSettings(), np.random.default_rng(0))  # entries for the context
    seconds = []
    for _ in range(20):
        started = time.perf_counter()
        drafter.propose(context, depth, SamplingSettings(), np.random.default_rng(0))
        seconds.append(time.perf_counter() - started)
    drafter.close()
    sequence.reset()
    return statistics.median(seconds) / depth


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-f16", help="a builtin model name or a GGUF path")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--verify", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--draft-vocab", type=int, default=4096)
    parser.add_argument("--json", type=Path, default=None, help="also write the report here (JSON)")
    args = parser.parse_args(argv)
    path = Path(args.target) if args.target.endswith(".gguf") else builtin_gguf(args.target)
    backend = LlamaCppBackend(path, n_ctx=2048, n_threads=args.threads)
    context = [int(token) for token in np.random.default_rng(0).integers(10, backend.vocab.size, args.context)]
    backend.forward(context, [])
    results: dict[str, list[dict[int, float]]] = {mode: [] for mode in MODES}
    for _ in range(3):  # interleaved blocks, each mode in turn
        for mode in MODES:
            results[mode].append(time_passes(backend, context, args.verify, mode, args.rounds))
    lines = [f"{path.name}, {args.threads} threads, {args.context}-token context, median of {3 * args.rounds}",
             f"layers read: {default_aux_layer_ids(backend.hidden_support.layers)}"]
    base = {count: statistics.median(block[count] for block in results["untracked"]) for count in (1, args.verify)}
    for mode in MODES:
        cells = []
        for count in (1, args.verify):
            seconds = statistics.median(block[count] for block in results[mode])
            cells.append(f"{count} tokens {seconds * 1e3:.2f} ms ({seconds / base[count]:.3f}x)")
        lines.append(f"{mode:>11}: " + ", ".join(cells))
    depth = eagle3_depth_seconds(backend, context, args.draft_vocab)
    lines.append(f"EAGLE-3 depth as wide as the target, {args.draft_vocab} draft tokens: {depth * 1e3:.2f} ms "
                 f"({depth / base[1]:.2f} of a plain step)")
    backend.close()
    print("\n".join(lines))
    write_report(args.json, {"target": path.name, "threads": args.threads, "lines": lines})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
