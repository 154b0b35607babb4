#!/bin/bash
# An 8B full fine-tune on one GPU beside torchtitan 0.2.2 (docs/trainer.md "8B full fine-tune on
# one GPU"): fp32 masters and AdamW state (128 GB) need the H200. Ours with FULL_SHARD: no FSDP on
# one process, each block's bf16 copies only while it runs (trainer/master_weights.py).
# Usage: [ATTENTION=fa4] bench/full_8b.sh OUT_DIR PART [RECIPE]
#   (PART: bf16 | pick | float8 | titan-none)
# ATTENTION: ours' attention (sdpa unless given; torchtitan has sdpa alone).
# bf16: ours and torchtitan with per-op selective checkpointing (torchtitan's fastest that fits,
#   2026-12-03), then ours without checkpointing (the planner's pick).
# pick (one device call's worth): ours without checkpointing, then torchtitan alone (--attention=)
#   with per-op selective checkpointing.
# float8: ours without checkpointing (the planner's pick: float8 keeps its Linears' inputs in
#   float8), then torchtitan alone with its own float8 and per-op selective checkpointing;
#   tensorwise then rowwise (RECIPE: that one alone, for a device call's 10 minutes).
# titan-none: torchtitan alone without checkpointing, in bf16 and then in float8 tensorwise and
#   rowwise (never run before 2026-12-07: whether it fits one H200, and beats its selective
#   checkpointing, which the rows above compare ours with).
source "$(dirname "$0")/lib.sh"
out=$1
part=$2
recipes=("${3:-tensorwise}")
[ $# -ge 3 ] || recipes+=(rowwise)
run() {  # one bench run (bench/lib.sh)
    bench_run "$out/full_8b.jsonl" --models 8b --micro-batch 2 --strategy FULL_SHARD --compile --no-hf \
        --attention "${ATTENTION:-sdpa}" "$@"
}
case $part in
bf16)
    run --ac selective --peers titan --steps 5 --warmup 2
    run --ac none --peers "" --steps 5 --warmup 2
    ;;
pick)
    run --ac none --peers "" --steps 5 --warmup 2
    run --ac selective --attention= --peers titan --steps 5 --warmup 2
    ;;
float8)
    for recipe in "${recipes[@]}"; do
        run --ac none --float8 --float8-recipe "$recipe" --peers "" --steps 5 --warmup 2
        run --ac selective --float8 --float8-recipe "$recipe" --attention= --peers titan \
            --steps 5 --warmup 2
    done
    ;;
titan-none)
    run --ac none --attention= --peers titan --steps 5 --warmup 2
    for recipe in tensorwise rowwise; do
        run --ac none --float8 --float8-recipe "$recipe" --attention= --peers titan \
            --steps 5 --warmup 2
    done
    ;;
*)
    echo "unknown PART '$part' (see the usage above)" >&2
    exit 2
    ;;
esac
exit $bench_failed
