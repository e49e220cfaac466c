#!/usr/bin/env bash
# The GPU figures, in under 8 minutes (run bench/gpu_smoke.sh first: it checks that the paths work).
#
#   bash bench/gpu.sh             # on the GPU machine; OUT=dir keeps the results
#   bash bench/gpu.sh --dry-run   # on a CPU: the same steps with a small model, no CUDA
#
# 1. profiles of a model worth planning on an H200 (gpt: 8 blocks of width 1024, 512 tokens)
#    in fp32 and in bf16: the consistency ratio on CUDA, and bf16 against fp32 (whole-model
#    step, saved activation bytes);
# 2. each planned on 1 stage and run for 20 steps: measured against predicted step time and
#    memory (allocated, reserved, CUDA context, what lies outside the allocator), and bf16
#    against fp32 step time as run;
# 3. the runtime's CPU tests under the machine's own torch (the torch executor on gloo with
#    2 ranks, precision, the torch-version checks): does the project work on that torch?
# Writes $OUT/gpu.log, $OUT/gpu.json (the figures) and $OUT/gpu-artifacts.tar.gz. Exit status:
# the number of failed steps.
NAME=gpu
source "$(dirname "$0")/gpu_lib.sh"

log "gpipe-plan GPU figures ($([[ $DRY -eq 1 ]] && echo 'dry run on the CPU' || echo 'CUDA')), results in $OUT"
step "install (offline)" 120 install_offline || { log "cannot go on without the project installed"; exit 1; }

if [[ $DRY -eq 1 ]]; then
    MODEL=(gpt --layers 2 --width 64 --heads 2 --seq-len 32 --contention-processes 0)
    STEPS=5
else
    MODEL=(gpt --layers 8 --width 1024 --heads 16 --seq-len 512 --vocab-size 8192)
    STEPS=20
fi
for precision in fp32 bf16; do
    profile="$WORK/profile-$precision.json"
    if step "$precision profile on $DEVICE" 150 gpipe_plan profile "${MODEL[@]}" --device "$DEVICE" \
            --precision "$precision" --batch-size 8 --out "$profile" -q; then
        figures profile "$profile"
        if step "solve 1 stage ($precision)" 30 gpipe_plan solve "$profile" -k 1 --out "$WORK/plan-$precision.json" -q &&
           step "1-stage run of $STEPS steps ($precision)" 120 gpipe_plan run "$WORK/plan-$precision.json" \
                --steps "$STEPS" --device "$DEVICE" --report "$WORK/report-$precision.json" -q; then
            figures report "$WORK/report-$precision.json"
        fi
    fi
done
# bf16 at small micro-batches can leave the GPU waiting for Python (launch-bound): the same
# model at larger ones shows whether the per-layer sum then agrees with the whole model.
if step "bf16 profile at micro-batches 8-32" 150 gpipe_plan profile "${MODEL[@]}" --device "$DEVICE" \
        --precision bf16 --micro-batch-sizes 8,16,32 --no-recompute-timing --out "$WORK/profile-bf16-large.json" -q; then
    figures profile "$WORK/profile-bf16-large.json"
    if step "solve 1 stage (bf16, batch 32)" 30 gpipe_plan solve "$WORK/profile-bf16-large.json" -k 1 -m 1 \
            --out "$WORK/plan-bf16-large.json" -q &&
       step "1-stage run of $STEPS steps (bf16, batch 32)" 120 gpipe_plan run "$WORK/plan-bf16-large.json" \
            --steps "$STEPS" --device "$DEVICE" --report "$WORK/report-bf16-large.json" -q; then
        figures report "$WORK/report-bf16-large.json"
    fi
fi
if [[ -f "$WORK/profile-fp32.json" && -f "$WORK/profile-bf16.json" ]]; then
    figures compare "$WORK/profile-fp32.json" "$WORK/profile-bf16.json"
fi
if [[ -f "$WORK/report-fp32.json" && -f "$WORK/report-bf16.json" ]]; then
    figures compare "$WORK/report-fp32.json" "$WORK/report-bf16.json"
fi

if [[ -n "${GPU_CPU_TESTS:-}" ]]; then
    read -r -a TESTS <<< "$GPU_CPU_TESTS"     # e.g. a rerun of the ones that failed
elif [[ $DRY -eq 1 ]]; then
    TESTS=(tests/runtime/test_torch_compat.py)
else
    TESTS=(tests/runtime/test_torch_compat.py tests/models/test_precision.py tests/runtime/test_runtime.py tests/runtime/test_train.py)
fi
step "the runtime's CPU tests under torch $("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null)" 150 \
    "$PYTHON" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
exit "$FAILED"
