"""Run under torchrun by test_tensor_parallel.py: train a few steps once per set-up, in order.

torchrun --nproc-per-node N tests/trainer/tensor_parallel_worker.py DATASET OUTPUT_ROOT SETUP...

A set-up named `<name>_resumed` starts from the first checkpoint of set-up `<name>`.
"""

import os
import shutil
import sys
import time
from pathlib import Path

import torch.distributed as dist

import trainer.loss
from trainer.config import load_config
from trainer.parallel import init_distributed
from trainer.train import train

STEPS, CHECKPOINT_AT = 4, 2
# The ranks of a TP group share a batch, so micro batches x data-parallel ranks is 8 rows a step
# in each set-up; the sampler then deals the same rows to every step of every set-up.
SETUPS = {
    "fsdp_dp2": {"strategy": "FULL_SHARD"},
    "tp2_dp1": {"tp_degree": 2, "grad_accum": 2, "checkpoint_interval": CHECKPOINT_AT},
    "tp2_dp1_resumed": {"tp_degree": 2, "grad_accum": 2},
    "tp2_dp2": {"tp_degree": 2},
    # A model whose vocabulary TP can split (tiny-llama's 725 tokens stay whole on every rank).
    "fsdp_dp2_even_vocab": {"strategy": "FULL_SHARD"},
    "tp2_dp1_even_vocab": {"tp_degree": 2, "grad_accum": 2},
}
EVEN_VOCAB_MODEL_ENV = "TP_TEST_EVEN_VOCAB_MODEL"  # a saved model dir with an even vocab


# Which loss path a set-up took: the calls of the sequence-parallel loss are counted into
# OUTPUT_ROOT/<set-up>/sequence_parallel_loss_calls.
_sequence_parallel_loss_sum = trainer.loss._sequence_parallel_loss_sum
CALLS = {"n": 0}


def _counted(*args, **kwargs):
    CALLS["n"] += 1
    return _sequence_parallel_loss_sum(*args, **kwargs)


def main(dataset: str, output_root: str, *names: str) -> None:
    trainer.loss._sequence_parallel_loss_sum = _counted
    env = init_distributed()
    for name in names:
        output_dir = Path(output_root) / name
        if name.endswith("_resumed") and env.rank == 0:
            checkpoint = Path(output_root) / name.removesuffix("_resumed") / "checkpoints"
            shutil.copytree(
                checkpoint / f"step_{CHECKPOINT_AT:08d}",
                output_dir / "checkpoints" / f"step_{CHECKPOINT_AT:08d}",
            )
        dist.barrier()
        overrides = {
            "dataset": dataset,
            "output_dir": str(output_dir),
            "micro_batch": 4,
            "max_steps": STEPS,
            "warmup_steps": 1,
            "eval_interval": 0,
            **SETUPS[name],
        }
        if name.endswith("_even_vocab"):
            overrides["model"] = os.environ[EVEN_VOCAB_MODEL_ENV]
        CALLS["n"] = 0
        train(load_config(None, overrides), env, time.time())
        if env.rank == 0:
            (output_dir / "sequence_parallel_loss_calls").write_text(str(CALLS["n"]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
