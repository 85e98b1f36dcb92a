#!/usr/bin/env bash
# The GPU run that decided five opt-in paths (2026-12-07, H100; outcomes in the notes named below), each built
# and checked on the CPU before it ran:
#   v25    SPARSEATTN_KMEANS_BUILD=packed_argmax  the k-means assignment keeps each row's best as a packed max
#   v26    SPARSEATTN_SVG2_PLAN=clusters          SVG2's forward and backward planned from the cluster mask
#   v27    SPARSEATTN_SVG2_SELECT=bisect_words    SVG2's top-p bisection by the patterns' high words first
#   v28    SPARSEATTN_KMEANS_BUILD=*_tail64       k-means' last chunk of at most 64 centroids at wgmma N = 64
#   tiles  token_order="tiles"                    the Wan model's tokens kept tile-major (compile, CUDA graph)
# (NOTES_svg2_device.md v25–v28; NOTES_kpage_fwd.md, the tile-major token build.) Steps, in the order of
# what each decides, so that a run cut short still decides the first ones:
#   svg2_step         svg2_step_bench at svg2_wan14b_720p: the queued call, the in-slots call, and the in-slots
#                     call planned by clusters, on the packed-argmax build, with a profile of one call;
#   gpu_tests_svg2    the GPU tests those defaults touch, on the packed-argmax build (the Wan processor's
#                     tests run on both plans by themselves, the selection kernel's on every method);
#   select_ab         the selection kernel's bisections alternated in one process (bisect, bisect_words);
#   wan_compile_tiles torch.compile and a CUDA-graph training step of the Wan model with tile-major tokens;
#   kmeans_builds_ab  the k-means builds alternated in one process (argmin, packed_argmax, their _tail64 forms);
#   gpu_tests_rest    the rest of the GPU suite.
# Run from the repository root on the GPU machine, where the project runs from PYTHONPATH=src; name steps
# to run a subset (the whole list takes more than one 10-minute call):
#   bash data/bench/experiments/opt_in_decisions_run.sh "$OUT" [STEP ...]
# Wheels the machine lacks (diffusers for the Wan tests and wan_compile) are installed from .whl/ when that
# folder travels with the run: `pip download --no-deps -d .whl diffusers` here, then carry [".whl"]. Logs
# and JSON go to the output folder; a short table is printed last.
set -uo pipefail
out=${1:?usage: opt_in_decisions_run.sh OUT_DIR [STEP ...]}
shift
steps=("$@")
(( ${#steps[@]} )) || steps=(svg2_step gpu_tests_svg2 select_ab wan_compile_tiles kmeans_builds_ab gpu_tests_rest)
mkdir -p "$out"
step_dir=$out
# shellcheck source=run_step.sh
source "$(dirname "${BASH_SOURCE[0]}")/run_step.sh"
prepare_run

python -m sparseattn.kernels.warmup > "$out/warmup.log" 2>&1
SPARSEATTN_KMEANS_BUILD=packed_argmax step svg2_step 150 \
    python -m sparseattn.svg2_step_bench --workload svg2_wan14b_720p \
    --methods wgmma_last_step_queued,wgmma_in_slots_queued,wgmma_in_slots_queued_clusters \
    --reps 6 --warmup 1 --out "$out/svg2_step_packed_argmax.json" --profile "$out/svg2_step_profile_packed_argmax.txt"
SPARSEATTN_KMEANS_BUILD=packed_argmax SPARSEATTN_KERNEL_WARMUP=0 step gpu_tests_svg2 240 \
    python -m pytest -q -n 15 -m gpu --require-gpu tests/gpu/test_svg2_device_gpu.py \
    tests/gpu/test_dynamic_layouts_gpu.py tests/gpu/test_diffusers_wan_gpu.py tests/gpu/test_token_order_gpu.py
step select_ab 90 \
    python data/bench/experiments/select_bisect_ab.py --out "$out/select_bisect_ab.json"
step wan_compile_tiles 240 \
    python -m sparseattn.wan_compile --layers 4 --graph-layers 2 --warmup 1 --reps 3 --token-order tiles \
    --out "$out/wan_compile_tiles.json"
step kmeans_builds_ab 120 \
    python data/bench/experiments/kmeans_builds_ab.py --rounds 3 --out "$out/kmeans_builds_ab.json"
SPARSEATTN_KERNEL_WARMUP=0 step gpu_tests_rest 300 \
    python -m pytest -q -n 15 -m gpu --require-gpu tests/gpu \
    --ignore=tests/gpu/test_svg2_device_gpu.py --ignore=tests/gpu/test_dynamic_layouts_gpu.py \
    --ignore=tests/gpu/test_diffusers_wan_gpu.py --ignore=tests/gpu/test_token_order_gpu.py

echo
printf '%-18s %s\n' step outcome
for name in "${steps[@]}"; do
    printf '%-18s %s   %s\n' "$name" "${status[$name]:-not run}" "$(tail -n 1 "$out/$name.log" 2>/dev/null | cut -c1-90)"
done
grep -h "overhead\|assign=" "$out/svg2_step.log" 2>/dev/null | tail -n 8
