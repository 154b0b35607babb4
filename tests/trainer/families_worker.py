"""Run under torchrun by test_families.py: every path of the matrix for each family, in order.

torchrun --nproc-per-node 2 tests/trainer/families_worker.py MODELS_ROOT DATASET PREFERENCES
    OUTPUT_ROOT FAMILY...

MODELS_ROOT/<family> is a small random model directory (config, safetensors, tokenizer) that the
test saved. One process group runs every set-up of every family (a torchrun start costs more
than a tiny run). Set-up `resumed` starts from `full`'s checkpoint of step CHECKPOINT_AT.
"""

import shutil
import sys
import time
from pathlib import Path

import torch.distributed as dist

import trainer  # noqa: F401 (first: it puts the contract package, plugins/, on the path)
from finetune_contract.families import FAMILIES
from trainer.config import load_config
from trainer.parallel import init_distributed
from trainer.train import train

STEPS, CHECKPOINT_AT = 3, 2
COMMON = {"micro_batch": 2, "seq_len": 64, "max_steps": STEPS, "warmup_steps": 1,
          "eval_interval": 0, "log_interval": 1, "bad_rows": "skip"}
# What each set-up proves; full and resumed: a checkpoint written, resumed to the same losses.
SETUPS = {
    "full": {"checkpoint_interval": CHECKPOINT_AT},
    "resumed": {},
    "lora_packing": {"lora_rank": 4, "packing": True, "lr": 1e-2, "max_steps": 2},
    "dpo_lora": {"method": "dpo", "lora_rank": 4, "max_steps": 1},
    # A TP group shares its batch: 2 micro batches of 2 rows make full's 2 ranks x 2 rows a
    # step, the same rows, so its losses are full's.
    "tp2": {"tp_degree": 2, "grad_accum": 2},
}


def setups_of(family: str) -> list[str]:
    """The set-ups a family runs: tp2 only where the table has a plan (else validate refuses)."""
    return [name for name in SETUPS if not (name == "tp2" and FAMILIES[family].tp_refused)]


def main(models_root: str, dataset: str, preferences: str, output_root: str,
         *families: str) -> None:
    env = init_distributed()
    for family in families:
        for name in setups_of(family):
            output_dir = Path(output_root) / family / name
            if name == "resumed" and env.rank == 0:
                step = f"step_{CHECKPOINT_AT:08d}"
                shutil.copytree(Path(output_root) / family / "full" / "checkpoints" / step,
                                output_dir / "checkpoints" / step)
            dist.barrier()
            data = preferences if SETUPS[name].get("method") == "dpo" else dataset
            overrides = {"dataset": data, **COMMON, **SETUPS[name],
                         "model": str(Path(models_root) / family), "output_dir": str(output_dir)}
            started = time.time()
            train(load_config(None, overrides), env, time.time())
            if env.rank == 0:
                (output_dir / "seconds").write_text(f"{time.time() - started:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
