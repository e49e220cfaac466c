#!/usr/bin/env bash
# The GPU checks, as one prepared script (the development VM has no GPU; run this where one is).
#
#   pip install -e .            # with the CUDA build of torch already installed
#   bash bench/gpu.sh           # from the repository root; OUT=/some/dir to keep the JSON files
#
# 1. profile the built-in gpt on CUDA (CUDA events) and print the profile's consistency figure
#    (sum of per-layer times / a whole-model step, per micro-batch size) and per-layer times;
# 2. the `gpu`-marked tests (pytest -m gpu);
# 3. plan 1 stage from that profile and train it on one GPU (gpipe-plan run --device cuda):
#    measured against predicted step and peak memory;
# 4. with 2 or more GPUs: plan 2 stages and run them over NCCL (one GPU per rank).
#
# Sized for under 8 minutes on a machine with one GPU: each step has its own timeout (2 + 3 +
# 1.5 + 1.5 minutes at most); a step that fails or times out is reported and the next one still
# runs; the exit status is the number of failed steps (0: all passed). Figures go to stdout; the
# profiles, plans and reports are copied into $OUT when it is set.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
GPIPE_PLAN=${GPIPE_PLAN:-gpipe-plan}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpipe-plan-gpu.XXXXXX")
FAILED=0
STARTED=$(date +%s)
export PYTHONWARNINGS=ignore

log() { echo "[gpu.sh +$(( $(date +%s) - STARTED ))s] $*"; }

finish() {
    if [[ -n "${OUT:-}" ]]; then
        mkdir -p "$OUT"
        cp -f "$WORK"/*.json "$OUT"/ 2>/dev/null || true
        log "copied $(ls "$WORK"/*.json 2>/dev/null | wc -l) JSON file(s) to $OUT"
    fi
    log "done: $FAILED step(s) failed; work files in $WORK"
}
trap finish EXIT

# step NAME SECONDS CMD...: run with a timeout, count a failure instead of stopping.
step() {
    local name=$1 seconds=$2
    shift 2
    log "== $name (timeout ${seconds}s): $*"
    local rc=0
    timeout --kill-after=10 "$seconds" "$@" || rc=$?
    if [[ $rc -ne 0 ]]; then
        if [[ $rc -eq 124 || $rc -eq 137 ]]; then log "!! $name timed out"; else log "!! $name failed (exit $rc)"; fi
        FAILED=$((FAILED + 1))
        return 1
    fi
    return 0
}

# 0. The machine.
GPUS=$(timeout 60 "$PYTHON" - <<'EOF'
import sys, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available {torch.cuda.is_available()}", file=sys.stderr)
if not torch.cuda.is_available():
    print(0)
    sys.exit(0)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB", file=sys.stderr)
print(torch.cuda.device_count())
EOF
) || GPUS=0
GPUS=${GPUS:-0}
if [[ "$GPUS" -lt 1 ]]; then
    log "no CUDA device visible to torch: nothing to check here (install the CUDA build of torch)"
    FAILED=1
    exit 1
fi
log "$GPUS GPU(s); $(command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1 || echo 'no nvidia-smi')"

# Figures of a profile, printed.
show_profile() {
    "$PYTHON" - "$1" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
dev = d["device"]
print(f"profile: {dev.get('name')} ({dev.get('type')}), timer {d.get('measurement', {}).get('timer')}, "
      f"speed probe {dev.get('speed_probe_s', 0) * 1e3:.2f} ms")
c = d.get("consistency") or {}
for b, s, m, r in zip(d["micro_batch_sizes"], c.get("layer_sum_s", []), c.get("model_step_s", []), c.get("ratio", [])):
    print(f"  consistency b={b}: sum of layers {s * 1e3:.3f} ms, whole model {m * 1e3:.3f} ms, ratio {r:.3f}")
for l in d["layers"]:
    print(f"  {l['name']:10s} fwd {' '.join(f'{t * 1e3:7.3f}' for t in l['forward_s'])} ms   "
          f"bwd {' '.join(f'{t * 1e3:7.3f}' for t in l['backward_s'])} ms   "
          f"peak transient {max(l.get('peak_transient_bytes') or [0]) / 2**20:.1f} MiB")
EOF
}

show_report() {
    "$PYTHON" - "$1" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
sp = r.get("speed") or {}
print(f"run: K={r['num_stages']} M={r['micro_batches']} {r['schedule']} {r['run']['backend']} {r['run']['executor']}: "
      f"step measured {r['measured_step_s'] * 1e3:.2f} ms / predicted {(r['predicted_step_s'] or 0) * 1e3:.2f} ms "
      f"= {r['step_time_ratio'] or float('nan'):.3f} (at the run's speed: "
      f"{sp.get('step_time_ratio_at_run_speed') or float('nan'):.3f}); {r['samples_per_s']:.1f} samples/s; "
      f"loss {r['loss']['first']:.3f} -> {r['loss']['last']:.3f}")
for s in r["stages"]:
    print(f"  stage {s['index']}: fwd {s['measured_forward_s'] * 1e3:.3f}/{(s['predicted_forward_s'] or 0) * 1e3:.3f} ms, "
          f"bwd {s['measured_backward_s'] * 1e3:.3f}/{(s['predicted_backward_s'] or 0) * 1e3:.3f} ms, "
          f"peak memory {s['measured_peak_memory_bytes'] / 2**20:.1f}/{(s['predicted_memory_bytes'] or 0) / 2**20:.1f} MiB "
          f"(measured/predicted)")
EOF
}

# 1. Profile gpt on CUDA.
PROFILE="$WORK/profile-gpt-cuda.json"
if step "profile gpt on cuda" 120 "$GPIPE_PLAN" profile gpt --device cuda --batch-size 8 --out "$PROFILE" -q; then
    show_profile "$PROFILE" || true
fi

# 2. The gpu-marked tests.
step "pytest -m gpu" 180 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider || true

# 3. One stage on one GPU.
if [[ -f "$PROFILE" ]]; then
    if step "solve 1 stage" 60 "$GPIPE_PLAN" solve "$PROFILE" -k 1 --out "$WORK/plan-k1.json" -q &&
       step "run 1 stage on cuda" 90 "$GPIPE_PLAN" run "$WORK/plan-k1.json" --steps 30 --device cuda \
            --report "$WORK/report-k1.json" -q; then
        show_report "$WORK/report-k1.json" || true
    fi
fi

# 4. Two stages over NCCL.
if [[ "$GPUS" -ge 2 && -f "$PROFILE" ]]; then
    if step "solve 2 stages" 60 "$GPIPE_PLAN" solve "$PROFILE" -k 2 --out "$WORK/plan-k2.json" -q &&
       step "run 2 stages on cuda (NCCL)" 90 "$GPIPE_PLAN" run "$WORK/plan-k2.json" --steps 30 --device cuda \
            --report "$WORK/report-k2.json" -q; then
        show_report "$WORK/report-k2.json" || true
    fi
else
    log "one GPU: the 2-stage NCCL run needs two (skipped)"
fi

exit "$FAILED"
