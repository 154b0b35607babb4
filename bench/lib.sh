# Sourced by the bench/*.sh scripts. bench_run LOG ARGS... runs `python -m bench.train ARGS`,
# its JSON lines printed and appended to LOG, its stderr in a file beside LOG. A failed run (its
# exit status, or an error row: bench.train reports a run's exception as a row and goes on)
# sets bench_failed, which the scripts exit with, so a device call's exit says whether all ran.
set -u -o pipefail
bench_failed=0
bench_run() {
    local log=$1
    shift
    local dir
    dir=$(dirname "$log")
    echo "# python -m bench.train $*" | tee -a "$log"
    python -m bench.train "$@" 2>"$dir/stderr-$(date +%s%N).txt" | tee "$dir/last.jsonl" \
        | tee -a "$log" || bench_failed=1
    if grep -q '"error"' "$dir/last.jsonl"; then bench_failed=1; fi
}
