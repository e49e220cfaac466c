#!/usr/bin/env bash
# The CPU-issue bound on a GPU, in under 5 minutes. UNVALIDATED: written without a GPU.
#
#   bash bench/gpu_issue.sh             # on the GPU machine; OUT=dir keeps the results
#   bash bench/gpu_issue.sh --dry-run   # on a CPU: the same steps with a small model, no CUDA
#
# 1. which rule a CUDA stage's actions obey: each block's GPU time behind a backlog and the
#    CPU's issue time, against actions of 1-8 blocks run as the runtime runs them
#    (bench/gpu_issue.py: the verdict is the rule closest to the measured actions);
# 2. a bf16 profile at small micro-batches (where the CPU issues slower than the GPU runs),
#    planned on 1 stage and run: measured against predicted, now that the plan charges each
#    pass the larger of the two sums (one-stage plans measured 0.75-0.80x their prediction
#    before, docs/benchmarks.md "GPU").
# Writes $OUT/gpu_issue.log, $OUT/gpu_issue.json and $OUT/gpu_issue-artifacts.tar.gz.
NAME=gpu_issue
source "$(dirname "$0")/gpu_lib.sh"

log "gpipe-plan CPU-issue bound ($([[ $DRY -eq 1 ]] && echo 'dry run on the CPU' || echo 'CUDA')), results in $OUT"
step "install (offline)" 120 install_offline || { log "cannot go on without the project installed"; exit 1; }
step "the rule a stage's actions obey" 120 "$PYTHON" bench/gpu_issue.py $([[ $DRY -eq 1 ]] && echo --dry-run)

if [[ $DRY -eq 1 ]]; then
    MODEL=(gpt --layers 2 --width 64 --heads 2 --seq-len 32 --contention-processes 0)
    PRECISION=fp32
else
    MODEL=(gpt --layers 8 --width 1024 --heads 16 --seq-len 256 --vocab-size 8192)
    PRECISION=bf16
fi
profile="$WORK/profile-issue.json"
if step "$PRECISION profile at micro-batches 1,2,4 on $DEVICE" 150 gpipe_plan profile "${MODEL[@]}" --device "$DEVICE" \
        --precision "$PRECISION" --micro-batch-sizes 1,2,4 --no-recompute-timing --out "$profile" -q; then
    figures profile "$profile"
    for m in 1 2 4; do
        if step "solve 1 stage, M=$m" 30 gpipe_plan solve "$profile" -k 1 -m "$m" -b 4 --out "$WORK/plan-m$m.json" -q &&
           step "1-stage run, M=$m" 120 gpipe_plan run "$WORK/plan-m$m.json" --steps 20 --device "$DEVICE" \
                --report "$WORK/report-m$m.json" -q; then
            figures report "$WORK/report-m$m.json"
        fi
    done
fi
exit "$FAILED"
