"""Unsloth as a peer of bench.train: its FastLanguageModel for LoRA and QLoRA, in a process
of its own.

`python -m bench.train --lora-rank 16 [--quantize-base nf4] --peers unsloth` runs the bench in
a child process that imports Unsloth before anything else (`bench.train.PEER_PRELUDES`): Unsloth
patches transformers, peft and trl when it is imported, and its patches reach no other run. What
runs is Unsloth's recipe for LoRA and QLoRA fine-tuning: `FastLanguageModel.from_pretrained` of
a checkpoint (random weights at the bench's shape, saved in bf16 with the demo tokenizer beside
them; loaded in bf16, or in bitsandbytes' 4-bit NF4 with `--quantize-base nf4`), then
`FastLanguageModel.get_peft_model` on the same block Linears, rank and alpha as ours, with
Unsloth's own gradient checkpointing (`"unsloth"`) when the bench checkpoints; then the same
Hugging Face Trainer, batches and hyper-parameters as the other peers (bf16, fused AdamW).

Unsloth pins datasets<5 and trl<=1.15 (this project: datasets 5, trl 1.16): it runs from its
own site directory on the device, first on the child's path; nothing of the project imports
it, and only `unsloth_model` needs it.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from finetune_contract.fields import LORA_TARGET_MODULES
from finetune_contract.rules import lora_module_names
from trainer.demo import DEMO_TOKENIZER


def unsloth_problem(args: argparse.Namespace) -> str | None:
    """Why the Unsloth peer would not run these settings the same way as ours, or None."""
    if not args.lora_rank:
        return "the Unsloth peer is the LoRA and QLoRA comparison: give --lora-rank"
    if args.float8 or args.tp_degree > 1:
        return "the Unsloth peer runs one GPU in bf16: no --float8, no --tp-degree"
    return None


def unsloth_model(
    model_config: PretrainedConfig, args: argparse.Namespace, device: torch.device,
    release_memory: Callable[[torch.device], None],
) -> tuple[torch.nn.Module, int, tempfile.TemporaryDirectory, dict[str, Any]]:
    """(model, adapter parameters, the checkpoint's directory, the recipe's options);
    `release_memory` frees the model the checkpoint was saved from (the bench's)."""
    problem = unsloth_problem(args)
    if problem:
        raise ValueError(problem)
    from unsloth import FastLanguageModel

    base_dir = tempfile.TemporaryDirectory()  # Unsloth loads (and quantizes) a checkpoint
    with torch.device(device):
        AutoModelForCausalLM.from_config(model_config).to(torch.bfloat16).save_pretrained(
            base_dir.name)
    AutoTokenizer.from_pretrained(DEMO_TOKENIZER).save_pretrained(base_dir.name)
    release_memory(device)
    checkpointing: str | bool = "unsloth" if args.ac != "none" else False
    model, _tokenizer = FastLanguageModel.from_pretrained(
        base_dir.name, max_seq_length=args.seq_len, dtype=torch.bfloat16,
        load_in_4bit=args.quantize_base == "nf4", use_gradient_checkpointing=checkpointing,
        device_map={"": device.index or 0}, random_state=args.seed,
    )  # fmt: skip
    model = FastLanguageModel.get_peft_model(
        model, r=args.lora_rank, lora_alpha=16, lora_dropout=0.0, bias="none",
        target_modules=lora_module_names(LORA_TARGET_MODULES),
        use_gradient_checkpointing=checkpointing, random_state=args.seed,
    )  # fmt: skip
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    recipe = {
        "unsloth": f"unsloth {version('unsloth')}, unsloth_zoo {version('unsloth_zoo')}",
        "mixed_precision": "bf16 base weights, Trainer bf16 (Unsloth's)",
        "gradient_checkpointing": checkpointing,
    }
    return model, adapters, base_dir, recipe

