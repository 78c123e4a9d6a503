"""The slots' KV cache: one unified pool of cells, or a stream a sequence (llama.cpp's kv_unified).

A server's slots keep their sequences in one llama.cpp context (backends/llama_slots.py). With
a unified cache every token's attention reads the cells of every sequence (masked), so its cost
grows with the batch's whole context; with a stream a sequence it reads its own, but llama.cpp
splits a batch whose sequences bring unequal numbers of tokens into a graph per share, each
reading the weights again. This times both on the same model, C sequences of D tokens each:

- ``plain``: every sequence one token (plain batching at its best for streams);
- ``mixed``: the first sequence a pass of CHUNK tokens (a verify pass, a prompt's chunk) beside
  the others' single tokens (what speculation and arriving prompts make of a batch).

Each kind is made twice, interleaved, and the faster of the two is reported (ms a step).

    .venv/bin/python benchmarks/kv_streams.py --model smollm2-135m-x2 --slots 8 --depth 512 --chunk 5
"""

from __future__ import annotations

import argparse
import time

from specrun.registry.loading import LoadOptions, open_backend


def time_steps(target, unified: bool, slots: int, depth: int, chunk: int, steps: int) -> float:
    """ms a step over ``steps`` batches after every sequence was fed ``depth`` tokens."""
    import llama_cpp as lib

    params = type(target._ctx_params).from_buffer_copy(target._ctx_params)
    params.n_seq_max, params.kv_unified = slots, unified
    params.n_ctx = (depth + steps * chunk + 64) * slots
    params.n_batch = params.n_ubatch = 512
    ctx = lib.llama_init_from_model(target._model, params)
    batch = lib.llama_batch_init(512, 0, 1)

    def decode(items) -> None:
        batch.n_tokens = len(items)
        for i, (token, position, sequence, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.logits[i] = token, position, logits
            batch.n_seq_id[i], batch.seq_id[i][0] = 1, sequence
        if lib.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    try:
        for sequence in range(slots):
            for start in range(0, depth, 256):
                decode([(100 + (i * 7 + sequence) % 1000, i, sequence, 0) for i in range(start, min(depth, start + 256))])
        started = time.perf_counter()
        for step in range(steps):
            first = [(300 + j, depth + step * chunk + j, 0, int(j == chunk - 1)) for j in range(chunk)]
            decode(first + [(200 + sequence, depth + step, sequence, 1) for sequence in range(1, slots)])
        return (time.perf_counter() - started) / steps * 1000
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-x2")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--depth", type=int, default=512, help="tokens in each sequence before the timed steps")
    parser.add_argument("--chunk", type=int, default=5, help="the first sequence's tokens a step in the mixed batch")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    target = open_backend(args.model, LoadOptions(threads=args.threads, n_ctx=2048), entries=None)
    for kind, chunk in (("plain", 1), ("mixed", args.chunk)):
        best = {True: float("inf"), False: float("inf")}
        for unified in (True, False, True, False):
            best[unified] = min(best[unified], time_steps(target, unified, args.slots, args.depth, chunk, args.steps))
        print(f"{kind}: {args.slots} sequences of {args.depth} tokens: unified {best[True]:.1f} ms a step, "
              f"streams {best[False]:.1f} ms ({best[False] / best[True]:.2f}x)")
    target.close()


if __name__ == "__main__":
    main()
