"""Run under torchrun by test_training.py: train a few steps once per sharding set-up.

torchrun --nproc-per-node 2 tests/trainer/strategy_worker.py DATASET OUTPUT_ROOT
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


def main(dataset: str, output_root: str) -> None:
    env = init_distributed()
    for name, setup in SETUPS.items():
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
