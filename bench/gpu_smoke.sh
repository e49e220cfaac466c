#!/usr/bin/env bash
# The GPU machine's first check, in under 3 minutes: does every CUDA path of gpipe-plan work?
#
#   bash bench/gpu_smoke.sh             # on the GPU machine, from anywhere; OUT=dir keeps the results
#   bash bench/gpu_smoke.sh --dry-run   # on a CPU: the same steps with a small model, no CUDA
#
# 1. versions (Python, torch, CUDA, NCCL, nvidia-smi -L) and the torch API the runtime relies on
#    (torch.distributed.pipelining's arguments, bf16 support);
# 2. the offline install (no network there; wheels the image lacks come from .whl/);
# 3. a bf16 profile on CUDA, with its consistency ratio (sum of layers / whole model);
# 4. a 1-stage run of 5 steps from that profile, over NCCL;
# 5. pytest -m gpu (CUDA profiling, CUDA runs, span timing with CUDA events);
# 6. CUDA events against wall time on one wide layer;
# 7. a 2-stage run over NCCL when there are two GPUs; with one, it says NCCL point-to-point
#    was not tested.
# Writes $OUT/smoke.log, $OUT/smoke.json (the figures) and $OUT/smoke-artifacts.tar.gz (the
# profiles, plans and reports). Exit status: the number of failed steps.
NAME=smoke
source "$(dirname "$0")/gpu_lib.sh"

log "gpipe-plan GPU smoke check ($([[ $DRY -eq 1 ]] && echo 'dry run on the CPU' || echo 'CUDA')), results in $OUT"
if [[ $DRY -eq 0 ]]; then
    command -v nvidia-smi >/dev/null && nvidia-smi -L && \
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
fi
step "install (offline)" 120 install_offline || { log "cannot go on without the project installed"; exit 1; }
step "versions and the torch API" 60 figures versions

if [[ $DRY -eq 1 ]]; then
    MODEL=(gpt --layers 2 --width 64 --heads 2 --seq-len 32 --contention-processes 0)
else
    MODEL=(gpt --layers 4 --width 512 --heads 8 --seq-len 256 --vocab-size 8192)
fi
PROFILE="$WORK/smoke-profile-bf16.json"
if step "bf16 profile on $DEVICE" 120 gpipe_plan profile "${MODEL[@]}" --device "$DEVICE" --precision bf16 \
        --batch-size 4 --repeats 5 --out "$PROFILE" -q; then
    figures profile "$PROFILE"
    if step "solve 1 stage" 30 gpipe_plan solve "$PROFILE" -k 1 --out "$WORK/smoke-plan-k1.json" -q &&
       step "1-stage run of 5 steps ($([[ $DRY -eq 1 ]] && echo gloo || echo NCCL))" 120 \
            gpipe_plan run "$WORK/smoke-plan-k1.json" --steps 5 --device "$DEVICE" \
            --report "$WORK/smoke-report-k1.json" -q; then
        figures report "$WORK/smoke-report-k1.json"
    fi
fi

if [[ $DRY -eq 1 ]]; then
    step "pytest -m gpu (collect only: no CUDA here)" 120 "$PYTHON" -m pytest -m gpu --collect-only -q -p no:cacheprovider
else
    step "pytest -m gpu" 180 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider
fi
step "CUDA events against wall time" 60 figures events-vs-wall

GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [[ $DRY -eq 0 && "$GPUS" -ge 2 ]]; then
    if step "solve 2 stages" 30 gpipe_plan solve "$PROFILE" -k 2 --out "$WORK/smoke-plan-k2.json" -q &&
       step "2-stage run over NCCL" 120 gpipe_plan run "$WORK/smoke-plan-k2.json" --steps 5 --device cuda \
            --report "$WORK/smoke-report-k2.json" -q; then
        figures report "$WORK/smoke-report-k2.json"
    fi
else
    log "NCCL point-to-point between stages was not tested: $GPUS GPU(s) here, a 2-stage run needs 2"
fi
exit "$FAILED"
