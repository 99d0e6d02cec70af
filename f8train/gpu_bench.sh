#!/usr/bin/env bash
# The GPU run: correctness, then the benchmarks, on one GPU within 6 minutes worst case.
#
#   f8train/gpu_bench.sh OUTDIR        # run (from anywhere; it cd's to the repository root)
#   f8train/gpu_bench.sh --dry-run     # print each step with its time limit, and the total
#
# Runs the machine's torch (PYTHON, default python3) on the checkout, nothing installed. Each
# step runs under `timeout LIMIT` (SIGKILL KILL_S later); the steps and what they write are
# in docs/gpu.md; tests/f8train/test_gpu_bench.py checks the 360 s total.
set -uo pipefail

KILL_S=5
DRY=0
if [ "${1:-}" = "--dry-run" ]; then
  DRY=1
  OUT=/tmp/gpu_bench_dry_run
else
  OUT=${1:?usage: f8train/gpu_bench.sh OUTDIR | --dry-run}
  mkdir -p "$OUT"
  OUT=$(cd "$OUT" && pwd)
fi
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
LOG="$OUT/gpu_bench.log"
TOTAL=0

step() { # step NAME LIMIT CMD...: run under a timeout, log output and exit status
  local name=$1 limit=$2
  shift 2
  TOTAL=$((TOTAL + limit + KILL_S))
  if [ "$DRY" = 1 ]; then
    printf 'step %-15s limit %4d s (+%d kill): %s\n' "$name" "$limit" "$KILL_S" "$*"
    return 0
  fi
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout -k "$KILL_S" "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s$([ "$rc" = 124 ] && echo ' (timed out)')" |
    tee -a "$LOG"
}

[ "$DRY" = 1 ] || : >"$LOG"
# env.txt: time, commit, GPU, driver, Python and torch ($0 is the interpreter, $1 OUT)
ENV='date -u +%FT%TZ; git rev-parse --short HEAD; nvidia-smi --format=csv --query-gpu=name,memory.total,driver_version; "$0" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))"'
step env 10 bash -c "{ $ENV; } >\"\$1/env.txt\" 2>&1; cat \"\$1/env.txt\"" "$PYTHON" "$OUT"

step gpu_tests 45 "$PYTHON" -m pytest -q -m gpu tests/gpu -p no:cacheprovider \
  --junit-xml "$OUT/gpu_tests.xml"

# ~200M parameters, 16384 tokens a step: GEMMs of 16384 x 2048 x 6144, where float8 pays off
TRAIN=(-m torch.distributed.run --standalone --nproc_per_node 1 -m f8train.train
  --device cuda --preset small --dim 2048 --n-layers 4 --n-heads 16 --n-kv-heads 8
  --multiple-of 1024 --seq-len 2048 --global-batch 8 --steps 30 --log-every 5
  --val-every 0 --ckpt-every 0 --compile)
step train_bf16 55 "$PYTHON" "${TRAIN[@]}" --recipe off --out "$OUT/train_bf16"
step train_float8 55 "$PYTHON" "${TRAIN[@]}" --recipe tensorwise --out "$OUT/train_float8"
step train_compare 5 "$PYTHON" -m f8train.compare --runs "$OUT/train_bf16" \
  "$OUT/train_float8" --json "$OUT/train_compare.json"

step linear_eager 45 "$PYTHON" -m f8train.bench_linear --device cuda --shapes llama \
  --recipes tensorwise,rowwise,rowwise_with_gw_hp,blockwise --kernels \
  --json "$OUT/linear.json"
step fsdp 40 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 1 \
  -m f8train.bench_fsdp --device cuda --json "$OUT/fsdp.json"
step cast 15 "$PYTHON" -m f8train.bench_cast --device cuda --json "$OUT/cast.json"
FFN=16384x4096x14336,16384x8192x28672
# then each measured time beside the roofline predicted for it on a CPU (f8train/gpu_predicted.py)
LINEAR_COMPILE=(-m f8train.bench_linear --device cuda --shapes "$FFN" --recipes tensorwise,rowwise
  --compile-only --warmup 3 --iters 10 --json "$OUT/linear_compile.json")
step linear_compile 45 bash -c '"$0" "${@:2}"; "$0" -m f8train.gpu_predicted "$1"' \
  "$PYTHON" "$OUT/linear_compile.json" "${LINEAR_COMPILE[@]}"

if [ "$DRY" = 1 ]; then
  echo "total ${TOTAL} s worst case (limits plus ${KILL_S} s kill margin each)"
else
  echo "=== done in ${SECONDS} s (worst case ${TOTAL} s): $(ls "$OUT" | tr '\n' ' ')" |
    tee -a "$LOG"
fi
