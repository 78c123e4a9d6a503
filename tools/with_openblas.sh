#!/usr/bin/env bash
# Runs a command with Debian's OpenBLAS preloaded where it is installed (Linux): the pthread build on
# one thread (OPENBLAS_NUM_THREADS=1), whose locks keep two threads' multiplications apart (the serial
# build has none: a draft's passes beside its adapters' training thread read corrupted logits in
# about one pass of 60, tests/training/test_online_draft.py), so it is not used.
# MLX's Linux CPU wheel multiplies with netlib's reference BLAS: SmolLM2 in float32 prefilled 100
# tokens in 17 s there, 0.76 s with OpenBLAS, whose cblas_sgemm then serves MLX (NumPy's own
# OpenBLAS has other symbol names; llama.cpp uses no BLAS). On x86-64 with AVX2 its kernels are
# pinned to one kind, so every such machine rounds alike. Its sums follow a matrix's shape (MLX's
# one-token and batched passes ~4e-5 apart on SmolLM2); the reference BLAS's did not.
# Usage: tools/with_openblas.sh COMMAND [ARGS...]
set -euo pipefail
if [ "$(uname -s)" = Linux ]; then
    blas="/usr/lib/$(uname -m)-linux-gnu/openblas-pthread/libblas.so.3"
    if [ -e "$blas" ]; then
        export LD_PRELOAD="$blas${LD_PRELOAD:+ $LD_PRELOAD}" OPENBLAS_NUM_THREADS=1
        if [ -z "${OPENBLAS_CORETYPE:-}" ] && [ "$(uname -m)" = x86_64 ] && grep -qw avx2 /proc/cpuinfo; then
            export OPENBLAS_CORETYPE=Haswell
        fi
    else
        echo "note: $blas is missing (Debian: apt-get install libopenblas0-pthread): MLX multiplies with its reference BLAS, far slower" >&2
    fi
fi
exec "$@"
