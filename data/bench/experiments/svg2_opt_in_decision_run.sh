#!/usr/bin/env bash
# The one GPU run that decides SVG2's two opt-in paths (NOTES_svg2_device.md, v25 and v26):
#   v25  SPARSEATTN_KMEANS_BUILD=packed_argmax  (the k-means assignment keeps each row's best as a packed max)
#   v26  SPARSEATTN_SVG2_PLAN=clusters          (the forward and backward planned from the cluster mask)
# In the order of what each step decides, so that a run cut short still decides the first ones:
#   1. svg2_step_bench at svg2_wan14b_720p: the queued call, the in-slots call, and the in-slots call planned by
#      clusters, all on the packed-argmax build, with a profile of one call (what layouts/select spend);
#   2. the GPU tests those defaults touch, on the packed-argmax build (the Wan processor's tests run on both
#      plans by themselves);
#   3. the k-means builds alternated in one process (argmin against packed_argmax);
#   4. the rest of the GPU suite.
# Run from the repository root on the GPU machine, where the project runs from PYTHONPATH=src:
#   bash data/bench/experiments/svg2_opt_in_decision_run.sh "$OUT"
# Wheels the machine lacks (diffusers for the Wan processor's tests) are installed from .whl/ when that folder
# travels with the run. Logs and JSON go to the output folder; a short table is printed last.
set -uo pipefail
out=${1:?usage: svg2_opt_in_decision_run.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
commit=$(git rev-parse --short HEAD 2>/dev/null || cat .scratch/commit 2>/dev/null || echo unknown)
echo "commit $commit, $(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
    | tee "$out/run.txt"
if compgen -G ".whl/*.whl" > /dev/null; then
    python -m pip install --quiet --no-deps --target /tmp/site .whl/*.whl > "$out/wheels.log" 2>&1
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi

declare -A status
step() {  # step NAME LIMIT_S COMMAND...: runs, logs to $out/NAME.log (its command first), records the exit status
    local name=$1 limit=$2
    shift 2
    { echo "\$ $*"; echo; } > "$out/$name.log"
    local t0=$SECONDS
    timeout "$limit" "$@" >> "$out/$name.log" 2>&1
    status[$name]="rc $? in $((SECONDS - t0)) s"
}

python -m sparseattn.kernels.warmup > "$out/warmup.log" 2>&1
SPARSEATTN_KMEANS_BUILD=packed_argmax step svg2_step 150 \
    python -m sparseattn.svg2_step_bench --workload svg2_wan14b_720p \
    --methods wgmma_last_step_queued,wgmma_in_slots_queued,wgmma_in_slots_queued_clusters \
    --reps 6 --warmup 1 --out "$out/svg2_step_packed_argmax.json" --profile "$out/svg2_step_profile_packed_argmax.txt"
SPARSEATTN_KMEANS_BUILD=packed_argmax SPARSEATTN_KERNEL_WARMUP=0 step gpu_tests_svg2 240 \
    python -m pytest -q -n 15 -m gpu --require-gpu tests/gpu/test_svg2_device_gpu.py \
    tests/gpu/test_dynamic_layouts_gpu.py tests/gpu/test_diffusers_wan_gpu.py tests/gpu/test_token_order_gpu.py
step kmeans_builds_ab 120 \
    python data/bench/experiments/kmeans_builds_ab.py --rounds 3 --out "$out/kmeans_builds_ab.json"
SPARSEATTN_KERNEL_WARMUP=0 step gpu_tests_rest 300 \
    python -m pytest -q -n 15 -m gpu --require-gpu tests/gpu \
    --ignore=tests/gpu/test_svg2_device_gpu.py --ignore=tests/gpu/test_dynamic_layouts_gpu.py \
    --ignore=tests/gpu/test_diffusers_wan_gpu.py --ignore=tests/gpu/test_token_order_gpu.py

echo
printf '%-18s %s\n' step outcome
for name in svg2_step gpu_tests_svg2 kmeans_builds_ab gpu_tests_rest; do
    printf '%-18s %s   %s\n' "$name" "${status[$name]:-not run}" "$(tail -n 1 "$out/$name.log" 2>/dev/null | cut -c1-90)"
done
grep -h "overhead\|assign=" "$out/svg2_step.log" 2>/dev/null | tail -n 8
