# Sourced by the lab run scripts (opt_in_decisions_run.sh, issue_records_run.sh, kpage_bwd_variant_run.sh) on the GPU machine, from
# the repository root. The script sets `steps` (the names to run) and `step_dir` (where the logs go) first.

# The run's environment: the project from src/, the records' commit (from .scratch/commit where it travels:
# the machine's copy of .git may be older than the tree), wheels from .whl/ where that folder travels;
# run.txt in $step_dir says commit, date and GPU.
prepare_run() {
    export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
    commit=$(cat .scratch/commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
    export SPARSEATTN_COMMIT=${SPARSEATTN_COMMIT:-$commit}
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
    echo "commit $commit, $(date -u +%FT%TZ), $gpu" | tee "$step_dir/run.txt"
    if compgen -G ".whl/*.whl" > /dev/null; then
        python -m pip install --quiet --no-deps --target /tmp/site .whl/*.whl > "$step_dir/wheels.log" 2>&1
        export PYTHONPATH=$PYTHONPATH:/tmp/site
    fi
}

declare -A status
step() {  # step NAME LIMIT_S COMMAND...: runs if named, logs to $step_dir/NAME.log (its command first), records the exit status
    local name=$1 limit=$2
    shift 2
    [[ " ${steps[*]} " == *" $name "* ]] || return 0
    { echo "\$ $*"; echo; } > "$step_dir/$name.log"
    local t0=$SECONDS
    timeout "$limit" "$@" >> "$step_dir/$name.log" 2>&1
    status[$name]="rc $? in $((SECONDS - t0)) s"
}
