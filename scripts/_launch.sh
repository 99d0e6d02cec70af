# Shared by the launchers in scripts/ (sourced, not run): the repository root, the Python
# and torchrun to use, and `launch`, which prints the command and runs it (DRY_RUN=1: only
# prints it).
#
#   PYTHON   the interpreter whose torch runs (default: python3)
#   DEVICE   --device of the trainer (default: cuda; cpu with gloo for a dry run). Flags
#            after the script's name come later on the command line, so they win.
#   DRY_RUN  1, yes, true, on, y: print the command, run nothing; 0, no, false, off, n or
#            empty (the default): run it; any other value is refused
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
TORCHRUN=("$PYTHON" -m torch.distributed.run)
export PYTHONUNBUFFERED=1

case "$(printf '%s' "${DRY_RUN:-}" | tr '[:upper:]' '[:lower:]')" in
  1 | yes | y | true | on) DRY_RUN=1 ;;
  0 | no | n | false | off | "") DRY_RUN=0 ;;
  *)
    echo "$(basename "$0"): DRY_RUN=$DRY_RUN is neither yes nor no; set DRY_RUN=1 (or yes, true, on) to print the command only, DRY_RUN=0 (or no, false, off, or unset) to run it" >&2
    exit 2
    ;;
esac

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
