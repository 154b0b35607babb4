"""The trainer's config (trainer/config.py TrainConfig fields) from a run config; every target
hands the trainer the same JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from finetune.config import RunConfig, resolve_path
from finetune_contract.data import dataset_source
from finetune_contract.fields import DPO_FIELDS, EVAL_FRACTION, method_dataset
from finetune_contract.models import BUILTIN_MODELS


def trainer_config(cfg: RunConfig, *, local_paths: bool = True) -> dict[str, Any]:
    """The trainer's JSON config (trainer/config.py TrainConfig) for this run.

    local_paths: resolve paths on this machine (local target). Off for a cluster: paths are read
    in the trainer's container (relative ones from its working dir, which holds trainer/), or
    are s3:// or hub ids.
    """
    source = method_dataset(cfg.method, cfg.dataset)
    if not local_paths:
        model, tokenizer, dataset = cfg.model, cfg.tokenizer or None, source
        eval_dataset = cfg.eval_dataset or None
    else:
        model = cfg.model if cfg.model in BUILTIN_MODELS or not _is_dir(resolve_path(cfg.model)) \
            else str(resolve_path(cfg.model))
        tokenizer = str(resolve_path(cfg.tokenizer)) if cfg.tokenizer else None
        dataset = _dataset_here(source)
        eval_dataset = _dataset_here(cfg.eval_dataset) or None
    return {
        "model": model,
        "tokenizer": tokenizer,
        "dataset": dataset,
        "dataset_format": cfg.dataset_format,
        "dataset_split": cfg.dataset_split,
        "prepared_data": cfg.prepared_data or None,
        "text_field": cfg.text_field or None,
        "prompt_field": cfg.prompt_field,
        "response_field": cfg.response_field,
        **{name: getattr(cfg, name) for name in DPO_FIELDS},
        "seq_len": cfg.seq_len,
        "micro_batch": cfg.micro_batch,
        "grad_accum": cfg.grad_accum,
        "lr": cfg.lr,
        "warmup_steps": cfg.warmup_steps,
        "max_steps": cfg.max_steps,
        "epochs": cfg.epochs,
        "seed": cfg.seed,
        "strategy": cfg.strategy,
        "shard_group_size": cfg.shard_group_size,
        "tp_degree": cfg.tp_degree,
        "mixed_precision": cfg.mixed_precision,
        "activation_checkpointing": cfg.activation_checkpointing,
        "selective_ac": cfg.selective_ac,
        "activation_offload": cfg.activation_offload,
        "cpu_offload": cfg.cpu_offload,
        "compile": cfg.compile,
        "attention": cfg.attention,
        "float8": cfg.float8,
        "float8_recipe": cfg.float8_recipe,
        "lora_rank": cfg.lora_rank,
        "lora_alpha": cfg.lora_alpha,
        "lora_dropout": cfg.lora_dropout,
        "lora_target_modules": cfg.lora_target_modules,
        "quantize_base": cfg.quantize_base,
        "prompt_template": cfg.prompt_template,
        "packing": cfg.packing,
        "bad_rows": cfg.bad_rows,
        "eval_interval": cfg.eval_interval,
        "eval_fraction": EVAL_FRACTION,
        "checkpoint_interval": cfg.checkpoint_interval,
        "checkpoint_async": cfg.checkpoint_async,
        "metrics_port": cfg.metrics_port,
        "hang_timeout_s": cfg.hang_timeout_s,
        "straggler_threshold": cfg.straggler_threshold,
        "eval_dataset": eval_dataset,
        "sample_prompts": cfg.sample_prompts,
        "max_new_tokens": cfg.max_new_tokens,
        "eval_tasks": cfg.eval_tasks,
        "output_dir": cfg.run_dir,
    }


def _dataset_here(dataset: str) -> str:
    """A local data set's absolute path (relative ones are from the repository root); an
    s3:// URI or hub name as given."""
    if not dataset or dataset.startswith("s3://"):
        return dataset
    resolved = resolve_path(dataset)
    try:
        exists = resolved.exists()
    except OSError:
        exists = False
    return str(resolved) if exists or dataset_source(dataset) == "local" else dataset


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # a name no file system holds: validate names it
        return False


def local_dir(path: str, in_pod: bool) -> Path | None:
    """A path to read here (None for one only the pod sees, or one no file system can hold)."""
    if not path or (in_pod and path.startswith("/")) or path.startswith("s3://"):
        return None
    try:
        resolved = resolve_path(path)
        return resolved if resolved.exists() else None
    except OSError:
        return None


def run_tokenizer_dir(cfg: RunConfig, in_pod: bool) -> Path | None:
    """The run's tokenizer directory as this machine reads it (a built-in model's: the demo
    tokenizer; else the tokenizer's, or the model's); None when it is not here."""
    if cfg.tokenizer:
        found = local_dir(cfg.tokenizer, in_pod)
    elif cfg.model in BUILTIN_MODELS:
        from finetune import REPO_ROOT

        found = REPO_ROOT / "trainer" / "demo" / "tokenizer"
    else:
        found = local_dir(cfg.model, in_pod)
    return found if found is not None and found.is_dir() else None
