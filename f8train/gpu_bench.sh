#!/usr/bin/env bash
# Every benchmark on one GPU, in under 8 minutes; every result file under OUTDIR.
#
#   f8train/gpu_bench.sh OUTDIR
#
# Run from anywhere (it cd's to the repository root); PYTHON picks the interpreter
# (default: python3, the one holding a CUDA torch on the lent GPU machines). Each step runs
# under `timeout`, so one hang or slow compile cannot eat the whole budget; each bench
# writes its JSON after every row, so a step cut short still leaves what it measured.
# Files (7, all in OUTDIR): env.txt, gpu_tests.xml, linear.json, cast.json, fsdp.json,
# linear_compile.json and gpu_bench.log with everything printed. Budget (the timeouts add
# up to 470 s):
#   the `gpu`-marked tests (real _scaled_mm, CUDA amax, NCCL FSDP2)  40 s
#   the single-process gpu tests again under TORCH_CUDA_SANITIZER=1     30 s
#     (CSAN: a tensor used on one stream while another writes it fails)
#   linear eager, 8 Llama-3 8B/70B shapes x (bf16 + 3 recipes)        90 s
#   cast, eager + compiled, 3 Llama-sized tensors                       60 s
#   fsdp, torchrun --nproc_per_node 1 with NCCL, every config           100 s
#   linear compiled, the 4 FFN shapes (the big ones; 16 compiles,       150 s
#     8B then 70B w1/w3 first, so a cut run still has the largest)
# torchao is compared only where it imports there (carry its wheel; see
# /work/.library/device/README.md); otherwise bench_fsdp reports it as skipped.
set -uo pipefail

OUT=${1:?usage: f8train/gpu_bench.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
LOG="$OUT/gpu_bench.log"
: >"$LOG"

step() {  # step NAME SECONDS CMD...: run with a timeout, log its output and exit status
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s$([ "$rc" = 124 ] && echo ' (timed out)')" |
    tee -a "$LOG"
}

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  git rev-parse --short HEAD 2>/dev/null && git status --porcelain --untracked-files=no | head
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
  "$PYTHON" -c 'import sys, torch; print(sys.version); print("torch", torch.__version__,
      "cuda", torch.version.cuda, torch.cuda.get_device_name(0))' 2>&1
  "$PYTHON" -c 'import torchao; print("torchao", torchao.__version__)' 2>&1 | tail -1
} >"$OUT/env.txt"
cat "$OUT/env.txt" | tee -a "$LOG"

step gpu_tests 40 "$PYTHON" -m pytest -q -m gpu tests/gpu -p no:cacheprovider \
  --junit-xml "$OUT/gpu_tests.xml"
# CSAN checks stream-ordering of every kernel launch (slow): the GEMM-contract tests only,
# which exercise the float8 casts and scaled GEMMs of forward and backward
step gpu_sanitizer 30 env TORCH_CUDA_SANITIZER=1 "$PYTHON" -m pytest -q -m gpu \
  tests/gpu/test_cuda_contract.py -k "not nccl" -p no:cacheprovider
step linear_eager 90 "$PYTHON" -m f8train.bench_linear --device cuda --shapes llama \
  --kernels --json "$OUT/linear.json"
step cast 60 "$PYTHON" -m f8train.bench_cast --device cuda --compile --json "$OUT/cast.json"
step fsdp 100 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 1 \
  -m f8train.bench_fsdp --device cuda --json "$OUT/fsdp.json"
FFN=16384x4096x14336,16384x8192x28672,16384x14336x4096,16384x28672x8192
step linear_compile 150 "$PYTHON" -m f8train.bench_linear --device cuda --shapes "$FFN" \
  --compile-only --kernels --warmup 3 --iters 10 --json "$OUT/linear_compile.json"

echo "=== done: $(ls "$OUT" | tr '\n' ' ')" | tee -a "$LOG"
