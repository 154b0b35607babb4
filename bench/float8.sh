#!/bin/bash
# float8 on one GPU (docs/trainer.md "float8"): its loss against bf16 on the demo data, and its
# tokens/s beside torchtitan's own float8 (same recipe).
# Usage: [ATTENTION=fa4] bench/float8.sh OUT_DIR PART [RECIPE]   (PART: loss | titan | 3b)
#        [ATTENTION=fa4] bench/float8.sh OUT_DIR loss [MODEL]
# ATTENTION: ours' attention, one run of ours each (sdpa,fa4: both beside one torchtitan run).
# loss: MODEL (1b unless given), seq 4096, micro-batch 1, 200 steps on the demo instructions
#   (bench.train --tokens demo): bf16, float8 tensorwise and rowwise from the same seed, and bf16
#   from another seed (the run-to-run noise). 3b: about 6 minutes on one H100.
# titan: ours and torchtitan 0.2.2 with float8, tensorwise then rowwise: 3B at micro-batch 2
#   with 2 accumulated (torchtitan's 3B at micro-batch 4 without checkpointing needs more than an
#   80 GB GPU: 103 GiB in bf16 on the H200), then 1B at micro-batch 4 (RECIPE: that one alone,
#   for a device call's 10 minutes with ATTENTION=sdpa,fa4).
# 3b: the 3B goal beside torchtitan, each recipe at micro-batch 2 without accumulation, then
#   2 x 2 (float8 Linears cast their fp32 masters: rules.float8_reads_masters); with
#   ATTENTION=fa4,sdpa about 8 minutes on one H100 (docs/trainer.md "float8 Linears cast their
#   fp32 masters").
source "$(dirname "$0")/lib.sh"
out=$1
part=$2
recipes=("${3:-tensorwise}")
[ $# -ge 3 ] || recipes+=(rowwise)
run() {  # one bench run (bench/lib.sh)
    bench_run "$out/float8.jsonl" --compile --attention "${ATTENTION:-sdpa}" "$@"
}
case $part in
loss)
    common=(--models "${3:-1b}" --micro-batch 1 --seq-len 4096 --tokens demo --steps 200 --warmup 2 --no-hf)
    run "${common[@]}"
    run "${common[@]}" --float8 --float8-recipe tensorwise
    run "${common[@]}" --float8 --float8-recipe rowwise
    run "${common[@]}" --seed 4321
    ;;
titan)
    for recipe in "${recipes[@]}"; do
        run --models 3b --micro-batch 2 --grad-accum 2 --float8 --float8-recipe "$recipe" --peers titan --no-hf --steps 8 --warmup 3
    done
    for recipe in "${recipes[@]}"; do
        run --models 1b --micro-batch 4 --float8 --float8-recipe "$recipe" --peers titan --no-hf --steps 10 --warmup 3
    done
    ;;
3b)
    for recipe in "${recipes[@]}"; do
        run --models 3b --micro-batch 2 --float8 --float8-recipe "$recipe" --peers titan --no-hf --steps 8 --warmup 3
        run --models 3b --micro-batch 2 --grad-accum 2 --float8 --float8-recipe "$recipe" --peers titan --no-hf --steps 8 --warmup 3
    done
    ;;
*)
    echo "unknown PART '$part' (see the usage above)" >&2
    exit 2
    ;;
esac
exit $bench_failed
