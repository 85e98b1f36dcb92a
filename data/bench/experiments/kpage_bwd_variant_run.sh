#!/usr/bin/env bash
# One device call for backward builds (SPARSEATTN_BWD_VARIANT macros of paged_bwd.cu, comma-joined per build):
# the default build and each BUILD alternated in one process on three workloads (`sparseattn bench variants
# --pass bwd`: each build's gradients checked against the float64 reference first, paired ratios per round),
# then compute-sanitizer (racecheck on the pair routes, memcheck on the backward's small ragged case) and the
# backward and device-planner GPU tests, on the last BUILD. From the repository root on the GPU machine:
#   bash data/bench/experiments/kpage_bwd_variant_run.sh "$OUT" PAGED_BWD_WG_DQ,PAGED_BWD_WG_SUM PAGED_BWD_WG_DQ
# About 9 minutes after the machine starts (warm-up of the builds ~30 s each, the A/B ~200 s at ROUNDS=5 (the
# environment variable, default 5), the sanitizers up to 180 s, the tests the rest of the 560 s the script
# allows itself). ALTERNATE=1 adds the A/B on VSA 480p in the alternated pair order
# (SPARSEATTN_PAIR_BWD_ORDER=alternate, ~90 s, taken from the tests' time). One $OUT/records.tgz comes back;
# a short table last.
set -uo pipefail
out=${1:?usage: kpage_bwd_variant_run.sh OUT_DIR BUILD [BUILD ...]}
shift
builds=("$@")
(( ${#builds[@]} )) || { echo "name the backward builds, e.g. PAGED_BWD_WG_DQ" >&2; exit 2; }
rounds=${ROUNDS:-5}
steps=(ab ab_alternate racecheck memcheck tests)
step_dir=$(mktemp -d)
# shellcheck source=run_step.sh
source "$(dirname "${BASH_SOURCE[0]}")/run_step.sh"
prepare_run

python -m sparseattn.kernels.warmup > "$step_dir/warmup.log" 2>&1
variants=(--variant default)
for build in "${builds[@]}"; do
    SPARSEATTN_BWD_VARIANT=$build python -m sparseattn.kernels.warmup >> "$step_dir/warmup.log" 2>&1
    variants+=(--variant "$build")
done
export SPARSEATTN_KERNEL_WARMUP=0
step ab 260 \
    python -m sparseattn bench variants --pass bwd --workload dense_32768 --workload ssta_hy15_720p \
    --workload vsa_wan14b_480p "${variants[@]}" --rounds "$rounds" --reps 3 --out "$step_dir/ab.json"
# ALTERNATE=1: the same builds on VSA 480p's host plans in the alternated pair order (v21d's plan form)
if [[ ${ALTERNATE:-0} == 1 ]]; then
    export SPARSEATTN_PAIR_BWD_ORDER=alternate
    step ab_alternate 150 \
        python -m sparseattn bench variants --pass bwd --workload vsa_wan14b_480p "${variants[@]}" \
        --rounds "$rounds" --reps 3 --out "$step_dir/ab_alternate.json"
    unset SPARSEATTN_PAIR_BWD_ORDER
fi
export SPARSEATTN_BWD_VARIANT=${builds[-1]}
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
step racecheck 100 \
    "$sanitizer" --tool racecheck --error-exitcode 3 python -m sparseattn.gpucheck --sanitize-case --pair-only
step memcheck 80 \
    "$sanitizer" --tool memcheck --error-exitcode 3 python -m sparseattn.gpucheck --sanitize-case --backward-only
left=$((560 - SECONDS))
(( left > 20 )) && step tests "$left" \
    python -m pytest -q -n 15 -m gpu --require-gpu -p no:cacheprovider tests/gpu/test_kpage_backward.py \
    tests/gpu/test_kpage_backward_random.py tests/gpu/test_device_planner_gpu.py
tar czf "$out/records.tgz" -C "$step_dir" .
for name in "${steps[@]}"; do echo "$name: ${status[$name]:-not run}"; done
grep -h -A8 "^workload" "$step_dir/ab.log" "$step_dir/ab_alternate.log" 2>/dev/null
grep -h "SUMMARY" "$step_dir/racecheck.log" "$step_dir/memcheck.log"
tail -2 "$step_dir/tests.log"
