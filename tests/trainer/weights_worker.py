"""Run under torchrun by test_weights.py: materialize sharded models, save each rank's full view.

torchrun --nproc-per-node 2 tests/trainer/weights_worker.py OUTPUT_DIR PRETRAINED_DIR
"""

import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from trainer.config import load_config
from trainer.model import build_model, materialize_weights
from trainer.parallel import apply_parallelism, init_distributed

SETUPS = {
    "random_full_shard": {"strategy": "FULL_SHARD"},
    "random_hybrid_shard": {"strategy": "HYBRID_SHARD", "shard_group_size": 1},
    "random_checkpointed": {"strategy": "FULL_SHARD", "activation_checkpointing": "full"},
    "pretrained_full_shard": {"strategy": "FULL_SHARD"},
}


def main(output_dir: str, pretrained_dir: str) -> None:
    env = init_distributed()
    for name, setup in SETUPS.items():
        model_name = pretrained_dir if name.startswith("pretrained") else "tiny-llama"
        config = load_config(None, {"model": model_name, "seed": 7, **setup})
        model = build_model(config.model)
        apply_parallelism(model, config, env)
        materialize_weights(model, config.model, config.seed, env.device)
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        rotary = model.model.rotary_emb.inv_freq.clone()
        result = {"state": {k: v.clone() for k, v in state.items()}, "tied": tied, "rotary": rotary}
        torch.save(result, Path(output_dir) / f"{name}_rank{env.rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
