# Shared by the launchers in scripts/ (sourced, not run): the repository root, the Python
# and torchrun to use, and `launch`, which prints the command and runs it (DRY_RUN=1: only
# prints it).
#
#   PYTHON   the interpreter whose torch runs (default: python3)
#   DEVICE   --device of the trainer (default: cuda; cpu with gloo for a dry run). Flags
#            after the script's name come later on the command line, so they win.
#   DRY_RUN  1: print the command, run nothing
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
DRY_RUN=${DRY_RUN:-0}
TORCHRUN=("$PYTHON" -m torch.distributed.run)
export PYTHONUNBUFFERED=1

need_int() { # need_int NAME VALUE: a positive integer, or exit naming the variable
  if ! [[ "$2" =~ ^[1-9][0-9]*$ ]]; then
    echo "$(basename "$0"): $1=$2 is not a positive integer; set $1 to e.g. 8" >&2
    exit 2
  fi
}

launch() { # launch CMD...: print it (one line, shell-quoted), then run it from the repository root
  printf '+'
  printf ' %q' "$@"
  printf '\n'
  if [ "$DRY_RUN" = 1 ]; then
    return 0
  fi
  cd "$REPO"
  exec "$@"
}
