# Shared by bench/gpu_smoke.sh and bench/gpu.sh (sourced, not run): options, logging, steps,
# and the offline install on the GPU machine.
#
# The GPU machine has no network and its own Python and torch (docs/benchmarks.md, "GPU: the
# CUDA paths"):
# the project installs there with --no-index --no-deps --no-build-isolation, against the
# image's torch, click, rich and networkx; packages the image lacks (pulp) travel as wheels in
# .whl/ (bench/gpu_wheels.sh fetches them here) and go to a folder of their own on PYTHONPATH.
#
# --dry-run runs every step on the CPU with a small model instead: everything but CUDA is
# checked before any GPU time is spent.

set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

DRY=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '2,/^[^#]/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown option $arg (use --dry-run or --help)" >&2; exit 2 ;;
    esac
done
if [[ $DRY -eq 1 ]]; then DEVICE=cpu; else DEVICE=cuda; fi

PYTHON=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpipe-plan-gpu.XXXXXX")}
mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpipe-plan-work.XXXXXX")
export GPU_FIGURES="$OUT/$NAME.json" PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/$NAME.log") 2>&1
FAILED=0
STARTED=$(date +%s)

log() { echo "[$NAME +$(( $(date +%s) - STARTED ))s] $*"; }

# step NAME SECONDS CMD...: run with a timeout; a failure is counted and the next step runs.
step() {
    local name=$1 seconds=$2
    shift 2
    log "== $name (at most ${seconds}s)"
    local rc=0 began
    began=$(date +%s)
    # Through bash -c, so that a step may be one of the shell functions below (exported).
    timeout --kill-after=10 "$seconds" bash -c '"$@"' step "$@" || rc=$?
    if [[ $rc -ne 0 ]]; then
        if [[ $rc -eq 124 || $rc -eq 137 ]]; then log "!! $name timed out"; else log "!! $name failed (exit $rc)"; fi
        FAILED=$((FAILED + 1))
        return 1
    fi
    log "ok: $name ($(( $(date +%s) - began ))s)"
    return 0
}

# The project, installed offline into the Python that has torch; wheels from .whl/ beside it
# go to a folder of their own, on PYTHONPATH for every later step.
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpipe-plan-site .whl/*.whl && export PYTHONPATH="/tmp/gpipe-plan-site${PYTHONPATH:+:$PYTHONPATH}"
fi
install_offline() {
    "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
    "$PYTHON" -c "import gpipe_plan, click, rich, networkx, torch; print('gpipe_plan', gpipe_plan.__version__, 'on torch', torch.__version__)"
}

finish() {
    # Few files travel back from the GPU machine: the run's artifacts go back as one archive.
    tar czf "$OUT/$NAME-artifacts.tar.gz" -C "$WORK" . 2>/dev/null
    log "done in $(( $(date +%s) - STARTED ))s: $FAILED step(s) failed; log $OUT/$NAME.log, figures $GPU_FIGURES"
}
trap finish EXIT

gpipe_plan() { "$PYTHON" -m gpipe_plan.cli "$@"; }
figures() { "$PYTHON" bench/gpu_figures.py "$@"; }
export -f install_offline gpipe_plan figures
export PYTHON
