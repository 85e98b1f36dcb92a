#!/usr/bin/env bash
# The GPU run that decides two SVG2 candidates built and checked on the CPU (NOTES_svg2_device.md), in one
# device call (~5 min on an H100):
#   v35  SPARSEATTN_KMEANS_BUILD=packed_argmax_tail64_ring_halves  each chunk's S as two halves of 64
#   v36  SPARSEATTN_SVG2_SIDE_STREAM=1                             Q's layout on a side stream beside K's k-means
# Steps, in the order of what each decides:
#   gpu_tests_svg2             the SVG2 device GPU tests (every k-means build; the side stream's test);
#   gpu_tests_wan_side_stream  the Wan processor's SVG2 tests (its CUDA-graph capture among them) with v36;
#   kmeans_builds_ab           the k-means builds alternated in one process (v35 against the ring);
#   svg2_step, svg2_step_v35, svg2_step_v36   the 720p call with the defaults, with v35, with v36.
# (v37, df585f3, is reverted on main: it runs from a working copy with `git revert 78af596`.)
# Run from the repository root on the GPU machine, with .scratch/commit and .whl/ (diffusers) carried:
#   bash data/bench/experiments/svg2_candidates_run.sh "$OUT" [STEP ...]
# Everything is packed into one $OUT/svg2_candidates.tgz (a device call returns at most 8 files); a
# short table is printed last.
set -uo pipefail
out=${1:?usage: svg2_candidates_run.sh OUT_DIR [STEP ...]}
shift
steps=("$@")
(( ${#steps[@]} )) || steps=(gpu_tests_svg2 gpu_tests_wan_side_stream kmeans_builds_ab svg2_step svg2_step_v35 svg2_step_v36)
step_dir=$(mktemp -d)
# shellcheck source=run_step.sh
source "$(dirname "${BASH_SOURCE[0]}")/run_step.sh"
prepare_run

python -m sparseattn.kernels.warmup > "$step_dir/warmup.log" 2>&1
SPARSEATTN_KERNEL_WARMUP=0 step gpu_tests_svg2 200 \
    python -m pytest -q -n 15 -m gpu --require-gpu tests/gpu/test_svg2_device_gpu.py
SPARSEATTN_SVG2_SIDE_STREAM=1 SPARSEATTN_KERNEL_WARMUP=0 step gpu_tests_wan_side_stream 200 \
    python -m pytest -q -n 8 -m gpu --require-gpu tests/gpu/test_diffusers_wan_gpu.py -k svg2
step kmeans_builds_ab 120 \
    python data/bench/experiments/kmeans_builds_ab.py --out "$step_dir/kmeans_builds_ab.json"
call=(python -m sparseattn.svg2_step_bench --workload svg2_wan14b_720p --methods wgmma_in_slots_queued_clusters
      --reps 8 --warmup 1)
step svg2_step 90 "${call[@]}" --out "$step_dir/svg2_step.json"
SPARSEATTN_KMEANS_BUILD=packed_argmax_tail64_ring_halves step svg2_step_v35 90 \
    "${call[@]}" --out "$step_dir/svg2_step_v35.json"
SPARSEATTN_SVG2_SIDE_STREAM=1 step svg2_step_v36 90 "${call[@]}" --out "$step_dir/svg2_step_v36.json"

tar czf "$out/svg2_candidates.tgz" -C "$step_dir" .
echo
printf '%-26s %s\n' step outcome
for name in "${steps[@]}"; do
    printf '%-26s %-16s %s\n' "$name" "${status[$name]:-not run}" \
        "$(grep -h "of the kernel\|passed\|failed\|clusters)" "$step_dir/$name.log" 2>/dev/null | tail -n 2 | cut -c1-160)"
done
