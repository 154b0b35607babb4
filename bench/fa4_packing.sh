#!/bin/bash
# Packed rows with fa4 against sdpa's masked path (docs/trainer.md "Packed rows with FA4"), 1B at
# micro-batch 4 x 4096 on the packed demo instructions. Needs flash-attn-4 on the path.
# Usage: bench/fa4_packing.sh OUT_DIR PART [SEED]   (PART: check | losses; SEED: 1234)
# check: each kernel against every document attended alone in fp32, each backward run again 20
#   times (fa4 adds dq, dk, dv with atomics in no fixed order: how far a rerun moves), demo and
#   random documents.
# losses: 40 steps each of sdpa, fa4 twice (its own spread) and sdpa in fp32 (the reference both
#   bf16 curves are measured against), every step's loss to six digits.
source "$(dirname "$0")/lib.sh"
out=$1
part=$2
seed=${3:-1234}
rows=(--models 1b --micro-batch 4 --seq-len 4096 --no-hf --peers= --compile --tokens demo
      --packing --seed "$seed")
run() {  # one bench run (bench/lib.sh)
    bench_run "$out/fa4_packing.jsonl" "${rows[@]}" "$@"
}
case $part in
check)
    run --attention-check --attention=
    run --attention-check --attention= --tokens random
    ;;
losses)
    run --steps 40 --warmup 2 --attention sdpa,fa4,fa4
    run --steps 40 --warmup 2 --attention sdpa --mixed-precision fp32 --ac full
    ;;
*)
    echo "unknown PART '$part' (see the usage above)" >&2
    exit 2
    ;;
esac
exit $bench_failed
