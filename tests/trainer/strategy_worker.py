"""Run under torchrun by test_training.py: train a few steps once per set-up of a group.

torchrun --nproc-per-node 2 tests/trainer/strategy_worker.py DATASET OUTPUT_ROOT [GROUP,...]
"""

import sys
import time
from pathlib import Path

from trainer.config import load_config
from trainer.parallel import init_distributed
from trainer.train import train

SETUPS = {
    "full_shard": {"strategy": "FULL_SHARD"},
    "shard_grad_op": {"strategy": "SHARD_GRAD_OP"},
    "hybrid_shard": {"strategy": "HYBRID_SHARD", "shard_group_size": 1},
    "no_shard": {"strategy": "NO_SHARD"},
    "full_shard_checkpointed": {"strategy": "FULL_SHARD", "activation_checkpointing": "full"},
    "full_shard_bf16": {"strategy": "FULL_SHARD", "mixed_precision": "bf16"},
}
# Precision and activation-memory options on FULL_SHARD, each compared with fp32 full_shard.
PRECISION_AND_MEMORY_SETUPS = {
    "fp16": {"mixed_precision": "fp16"},
    "selective_op": {"activation_checkpointing": "selective", "selective_ac": "op"},
    "selective_every_2": {"activation_checkpointing": "selective", "selective_ac": "2"},
    "offloaded": {"activation_offload": True, "cpu_offload": True},
    # each block's input in CPU memory, its MLP tiled (trainer/offload.py), under FSDP
    "offloaded_blocks": {"activation_checkpointing": "full", "activation_offload": True},
    "fp16_all_memory_options": {
        "mixed_precision": "fp16",
        "activation_checkpointing": "selective",
        "selective_ac": "2",
        "activation_offload": True,
        "cpu_offload": True,
    },
}
GROUPS = {"strategies": SETUPS, "precision_and_memory": PRECISION_AND_MEMORY_SETUPS}


def main(dataset: str, output_root: str, groups: str = "strategies") -> None:
    env = init_distributed()
    setups = {name: s for group in groups.split(",") for name, s in GROUPS[group].items()}
    for name, setup in setups.items():
        overrides = {
            "dataset": dataset,
            "output_dir": str(Path(output_root) / name),
            "micro_batch": 4,
            "max_steps": 3,
            "eval_interval": 0,
            **setup,
        }
        train(load_config(None, overrides), env, time.time())


if __name__ == "__main__":
    main(*sys.argv[1:])
