#!/usr/bin/env bash
# The GPU benchmark on one GPU (correctness, training bf16 vs float8, the GEMM, FSDP2 and
# cast benchmarks, within 6 minutes): f8train/gpu_bench.sh, whose steps and outputs
# docs/gpu.md describes.
#
#   scripts/gpu_bench.sh OUTDIR       # run; writes OUTDIR/gpu_bench.log, *.json, env.txt
#   scripts/gpu_bench.sh --dry-run    # print each step and its time limit
#
# PYTHON picks the interpreter (default python3). Its arguments go to f8train/gpu_bench.sh.
set -euo pipefail
exec "$(cd "$(dirname "$0")/.." && pwd)/f8train/gpu_bench.sh" "$@"
