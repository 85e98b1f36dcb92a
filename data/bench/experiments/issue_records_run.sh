#!/usr/bin/env bash
# The runs whose records the open issues' "Must show" lists ask for (committed JSON + log, on the H200),
# as one script with named steps. Each step's command is the one that made the newest H100 record of its
# question (the `command` of the files that data/bench/README.md names). Steps are listed in the order of
# what they cost, so that one 10-minute device call can take several of the cheaper ones:
#   svg2_step    (SVG2 per step)      the 720p call by parts, in order and in the processor's order  ~25 s
#   plan         (dynamic sparsity)   device planning beside the forward, four workloads           ~90 s
#   dense        (skeleton's rate)    KPage against cuDNN at the four dense shapes                  ~90 s
#   forward      (skeleton's rate)    KPage's forward on the four partial workloads, checked        ~90 s
#   host_cost    (torch op)           host time per call, eager and replayed                        ~60 s
#   svg2_peers   (SVG2 per step)      KPage against FlashInfer's variable-block wrappers            ~90 s
#   wan_compile  (torch op)           compiled Wan with tile-major tokens, CUDA-graph training step  ~4 min
#   gpucheck     (skeleton's rate)    the whole GPU suite, compute-sanitizer, the bench subset      ~6 min
#   wan_vsa      (dynamic sparsity)   Wan steps with VSA on KPage and on the VSA kernel              ~5 min
#   model_wan    (torch op, SVG2)     Wan 1.3B steps, dense / KPage STA / Flex STA / KPage SVG2      ~8 min
# Run from the repository root on the GPU machine:
#   bash data/bench/experiments/issue_records_run.sh "$OUT" STEP [STEP ...]
# Wheels the machine lacks come from .whl/ when that folder travels with the run (carry [".whl"]):
# diffusers (wan_compile, model_wan), flashinfer-python (svg2_peers), fastvideo-kernel (wan_vsa); a step
# whose peer is missing records what it can and says so in its log. The records' commit comes from
# .scratch/commit when it travels (the machine's copy of .git may be older than the tree). A device call
# returns at most 8 files, so everything a step writes is packed into one $OUT/records.tgz at the end;
# a short table is printed last.
set -uo pipefail
out=${1:?usage: issue_records_run.sh OUT_DIR STEP [STEP ...]}
shift
steps=("$@")
(( ${#steps[@]} )) || { echo "name the steps to run (see the header)" >&2; exit 2; }
work=$(mktemp -d)
step_dir=$work
# shellcheck source=run_step.sh
source "$(dirname "${BASH_SOURCE[0]}")/run_step.sh"
prepare_run

python -m sparseattn.kernels.warmup > "$work/warmup.log" 2>&1
step svg2_step 120 \
    python -m sparseattn.svg2_step_bench --workload svg2_wan14b_720p \
    --methods wgmma_in_slots_queued_clusters,wgmma_in_slots_queued_clusters_beside \
    --reps 8 --warmup 1 --out "$work/svg2_step.json"
step plan 240 \
    python -m sparseattn bench --workload vsa_wan14b_720p --workload vsa_wan14b_480p --workload ssta_hy15_720p \
    --workload sta_wan14b_69f --impl kpage --pass fwd --pass plan --reps 10 --out "$work/device_planner_speed.json"
step dense 240 \
    python -m sparseattn bench --workload dense_16384 --workload dense_32768 --workload dense_75600 --workload dense_131072 \
    --impl kpage --impl cudnn_dense --pass fwd --reps 10 --out "$work/dense_speed.json"
step forward 240 \
    python -m sparseattn bench --workload ssta_hy15_720p --workload svg2_wan14b_720p --workload vsa_wan14b_720p \
    --workload vsa_wan14b_480p --impl kpage --pass fwd --reps 10 --out "$work/forward_speed.json"
step host_cost 180 \
    python -m sparseattn.host_cost --out "$work/host_cost.json"
step svg2_peers 240 \
    python -m sparseattn bench --workload svg2_wan14b_720p --impl kpage --impl flashinfer_varblock \
    --impl flashinfer_varblock_fa3 --reps 10 --out "$work/svg2_peers.json"
step wan_compile 360 \
    python -m sparseattn.wan_compile --layers 4 --graph-layers 2 --warmup 1 --reps 3 --token-order tiles \
    --out "$work/wan_compile_tiles.json"
step gpucheck 560 \
    python -m sparseattn.gpucheck --out "$work/gpucheck"
step wan_vsa 560 \
    python -m sparseattn.wan_bench --reps 3 --out "$work/wan_steps_vsa.json"
step model_wan 580 \
    python -m sparseattn bench model wan --models 1.3b --res 480p,720p --impl dense,kpage_sta_tiles,flex_sta,kpage_svg2 \
    --budget-s 450 --out "$work/model_wan.json"

tar czf "$out/records.tgz" -C "$work" .
echo
printf '%-12s %s\n' step outcome
for name in "${steps[@]}"; do
    printf '%-12s %-16s %s\n' "$name" "${status[$name]:-not run}" "$(tail -n 1 "$work/$name.log" 2>/dev/null | cut -c1-90)"
done
echo "files: records.tgz (run.txt, warmup.log, and each step's .log and .json); $gpu, $commit"
