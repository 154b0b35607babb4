"""Export the trained model as a Hugging Face directory: safetensors, config, tokenizer.

At the end of a run `export_hf` gathers the sharded model; any checkpoint of a run can be exported
afterwards on one CPU process, without a process group:

python -m trainer.export --checkpoint RUN/checkpoints/step_00000100 --out RUN/model-step-100

A LoRA run exports the base weights with the adapters merged in (the model loads at once with
AutoModelForCausalLM.from_pretrained) and the adapters themselves in `adapter/` (for
PeftModel.from_pretrained on the base model).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from huggingface_hub import save_torch_state_dict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from finetune_contract.fields import RESOLVED_CONFIG_FILE
from trainer.lora import ADAPTER_DIR, lora_config_of, merge_adapters, save_adapter
from trainer.qlora import dequantized

# from_pretrained's arguments a tokenizer keeps in its init_kwargs and would save as settings:
# where and how it was loaded, not what it is.
LOAD_TIME_KEYS = ("local_files_only", "is_local", "cache_dir", "force_download", "proxies",
                  "token", "use_auth_token", "revision", "subfolder", "_commit_hash",
                  "trust_remote_code")

def export_hf(
    model: torch.nn.Module,
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str | Path,
    rank: int,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Gather the full weights to rank 0's CPU and write them for `from_pretrained`.

    Every rank must call this (the gather is a collective); only rank 0 writes.
    """
    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        write_hf(state, model, config, tokenizer, Path(out_dir), dtype)


def write_hf(
    state: dict[str, torch.Tensor],
    model: torch.nn.Module,
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    out: Path,
    dtype: torch.dtype,
) -> None:
    """Write a full (unsharded) state dict of `model` as a Hugging Face model directory."""
    out.mkdir(parents=True, exist_ok=True)
    # QLoRA: the adapters are merged into the base they trained on, the dequantized 4-bit one.
    state = {name: dequantized(tensor) for name, tensor in state.items()}
    lora_config = lora_config_of(model)
    if lora_config is not None:
        state, adapter = merge_adapters(state, lora_config)
        save_adapter(adapter, lora_config, out / ADAPTER_DIR, dtype)
    if config.tie_word_embeddings:
        # One tensor under two names; from_pretrained re-ties the head to the embedding.
        state.pop("lm_head.weight", None)
    # A copy per tensor: gathered shards of uneven size are views into a larger, padded buffer.
    state = {name: tensor.to(dtype, copy=True) for name, tensor in state.items()}
    save_torch_state_dict(state, out, max_shard_size="5GB")
    config = copy.deepcopy(config)
    config.dtype = dtype
    config.use_cache = True
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    save_tokenizer(tokenizer, out)
    readable_as_umask_allows(out)


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    """tokenizer.save_pretrained without the load-time arguments in tokenizer_config.json."""
    tokenizer = copy.copy(tokenizer)
    tokenizer.init_kwargs = {k: v for k, v in tokenizer.init_kwargs.items()
                             if k not in LOAD_TIME_KEYS}
    tokenizer.save_pretrained(out)


def readable_as_umask_allows(root: Path) -> None:
    """Give the exported files the mode the process's umask gives new files (the run's other
    outputs have it): the safetensors writer makes its files owner-only (0600), which another
    user or service on a shared file system cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [root, *root.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def export_checkpoint(
    checkpoint: str | Path, out_dir: str | Path, config_path: str | Path | None = None
) -> Path:
    """Export the model part of a DCP checkpoint (`checkpoints/step_N`) on this one process.

    The model is built as the run built it, from the run's resolved config (the run dir's
    `trainer_config.resolved.json`, or `config_path`), with the same adapters, and written in
    the run's compute dtype. Memory: the whole model once on the CPU.
    """
    import torch.distributed.checkpoint as dcp
    from transformers import AutoTokenizer

    from trainer.config import load_config
    from trainer.lora import apply_lora
    from trainer.model import build_model, init_buffers, materialize_weights
    from trainer.parallel import COMPUTE_DTYPES, quantize_dtype

    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir() or not (checkpoint / ".metadata").is_file():
        raise ValueError(f"checkpoint {checkpoint} is not a DCP checkpoint dir (no .metadata)")
    config_path = Path(config_path or checkpoint.parent.parent / RESOLVED_CONFIG_FILE)
    if not config_path.is_file():
        raise ValueError(
            f"no run config at {config_path}: give the run's {RESOLVED_CONFIG_FILE} with --config"
        )
    train_config = load_config(config_path)
    tokenizer = AutoTokenizer.from_pretrained(train_config.tokenizer)
    model = build_model(train_config.model, tokenizer, seq_len=train_config.seq_len)
    if train_config.lora_rank:
        apply_lora(model, train_config)
    lora = bool(train_config.lora_rank)
    if not lora:
        model.to_empty(device="cpu")
        model.tie_weights()
    else:  # a LoRA checkpoint holds no frozen weights: the base is made again from its source
        materialize_weights(model, train_config.model, train_config.seed, torch.device("cpu"),
                            quantize_dtype(train_config))
    # The checkpoint's keys (get_state_dict drops wrapper prefixes), frozen ones only if saved.
    state = {name: param for name, param in model.state_dict(keep_vars=True).items()
             if not lora or param.requires_grad}
    state = {name: tensor.detach() for name, tensor in state.items()}
    dcp.load({"model": state}, checkpoint_id=checkpoint)
    model.load_state_dict(state, strict=not lora)
    init_buffers(model)
    write_hf(
        model.state_dict(),
        model,
        model.config,
        tokenizer,
        Path(out_dir),
        COMPUTE_DTYPES[train_config.mixed_precision],
    )
    return Path(out_dir)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trainer.export", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a run's checkpoints/step_N dir")
    parser.add_argument("--out", required=True, help="directory to write the model to")
    parser.add_argument("--config", help=f"the run's {RESOLVED_CONFIG_FILE} (default: run dir's)")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out, args.config)
    except ValueError as error:
        parser.error(str(error))
    print(json.dumps({"checkpoint": str(args.checkpoint), "model": str(out)}), flush=True)


if __name__ == "__main__":
    main()
