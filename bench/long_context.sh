#!/bin/bash
# Long context on one GPU, ours beside Unsloth (docs/trainer.md "Long context"): an 8B QLoRA
# (and LoRA) with every block's input in CPU memory (ours: --ac full --activation-offload;
# Unsloth: its offloaded gradient checkpointing), then ours alone at the longest sequence.
# Unsloth runs from its own site directory, first on its child's path (bench/unsloth.py).
# Usage: [ATTENTION=fa4] bench/long_context.sh OUT_DIR PART   (PART: peers | longest | longest-lora |
#   short | peft)
# longest, longest-lora: ours alone at SEQ tokens (400,000 unless given), one step (STEPS), the
#   QLoRA and the LoRA (bf16 base) goal; 6 to 7 minutes a step at 400k on an H100.
# short: the least memory at seq 4096 (micro-batch 2), QLoRA and LoRA, ours offloaded beside
# Unsloth's offloaded checkpointing.
# peft: short's LoRA, ours alone, with peft's own LoRA forward (the A/B of the fused adapter add).
source "$(dirname "$0")/lib.sh"
out=$1
part=$2
run() {  # one bench run (bench/lib.sh)
    bench_run "$out/long_context.jsonl" --models 8b --micro-batch 1 --lora-rank 16 --ac full --compile \
        --attention "${ATTENTION:-sdpa}" "$@"
}
case $part in
peers)
    run --seq-len 32768 --quantize-base nf4 --activation-offload --peers unsloth --steps 2 --warmup 1
    run --seq-len 131072 --quantize-base nf4 --activation-offload --peers unsloth --steps 1 --warmup 1
    ;;
longest)
    run --seq-len "${SEQ:-400000}" --quantize-base nf4 --activation-offload --peers "" --steps "${STEPS:-1}" --warmup 0
    ;;
longest-lora)
    run --seq-len "${SEQ:-400000}" --activation-offload --peers "" --steps "${STEPS:-1}" --warmup 0
    ;;
short)
    run --seq-len 4096 --micro-batch 2 --quantize-base nf4 --activation-offload --peers unsloth --steps 5 --warmup 2
    run --seq-len 4096 --micro-batch 2 --activation-offload --peers unsloth --steps 5 --warmup 2
    ;;
peft)
    run --seq-len 4096 --micro-batch 2 --activation-offload --peers "" --lora-forward peft --steps 5 --warmup 2
    ;;
*)
    echo "unknown PART '$part' (see the usage above)" >&2
    exit 2
    ;;
esac
exit $bench_failed
