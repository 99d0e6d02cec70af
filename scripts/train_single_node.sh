#!/usr/bin/env bash
# Float8 pretraining on one node: NGPU ranks (one per GPU) under torchrun --standalone.
#
#   scripts/train_single_node.sh [TRAINER FLAGS...]
#   NGPU=8 scripts/train_single_node.sh --preset llama3_8b --recipe tensorwise --out runs/a
#
# Every flag goes to `python -m f8train.train` (docs/trainer.md; `--help` lists them).
# Environment: NGPU (default 8), and PYTHON, DEVICE, DRY_RUN (scripts/_launch.sh).
source "$(dirname "$0")/_launch.sh"

NGPU=${NGPU:-8}
need_int NGPU "$NGPU"
launch "${TORCHRUN[@]}" --standalone --nproc_per_node "$NGPU" \
  -m f8train.train --device "$DEVICE" "$@"
