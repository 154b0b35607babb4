"""The trainer's one config object: a frozen dataclass from JSON plus `--key value` overrides."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from trainer.demo import DEMO_DATASET, DEMO_TOKENIZER
from trainer.lora import target_module_names
from trainer.model import BUILTIN_CONFIGS
from trainer.storage import is_s3, split_s3

DatasetFormat = Literal["auto", "jsonl", "json", "parquet", "csv"]
Strategy = Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"]
MixedPrecision = Literal["bf16", "fp16", "fp32"]
ActivationCheckpointing = Literal["none", "full", "selective"]
PromptTemplate = Literal["instruction", "chat"]
BadRows = Literal["skip", "error"]
DatasetSource = Literal["s3", "local", "hub"]
FORMAT_BY_EXTENSION = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# Every Linear of a Llama block: attention and MLP projections.
LORA_TARGET_MODULES = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # org/name or name, as the hub allows


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs. The defaults are the local demo (tiny-llama on the demo data)."""

    model: str = "tiny-llama"
    tokenizer: str | None = None
    dataset: str = str(DEMO_DATASET)
    dataset_format: DatasetFormat = "auto"
    dataset_split: str = "train"  # for hub data sets
    text_field: str | None = None
    prompt_field: str = "prompt"
    response_field: str = "response"
    prompt_template: PromptTemplate = "instruction"  # chat: the tokenizer's chat template
    packing: bool = False  # pack examples to seq_len; no attention across documents
    # Rows that are malformed, miss a field, are empty or exceed seq_len: skipped and counted,
    # or the first one fails the run at start (file and line in the error).
    bad_rows: BadRows = "skip"
    seq_len: int = 128
    micro_batch: int = 8
    grad_accum: int = 1
    lr: float = 3e-3
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    max_steps: int = 150
    epochs: float = 1.0
    seed: int = 1234
    strategy: Strategy = "FULL_SHARD"
    shard_group_size: int = 0
    mixed_precision: MixedPrecision = "fp32"
    activation_checkpointing: ActivationCheckpointing = "none"
    selective_ac: str = "op"  # selective: "op" (save matmul outputs) or k (every k-th block)
    activation_offload: bool = False  # saved activations to CPU memory
    cpu_offload: bool = False  # parameters, gradients and optimizer step on CPU (FSDP2 policy)
    compile: bool = False  # torch.compile each decoder block
    tp_degree: int = 1  # tensor (and sequence) parallel degree: a 2-D mesh with FSDP
    float8: bool = False  # torchao float8 matmuls in the decoder blocks (CUDA capability >= 8.9)
    lora_rank: int = 0  # LoRA adapters of this rank (peft); 0: full fine-tune
    lora_alpha: float = 16.0  # adapter output scaled by lora_alpha / lora_rank
    lora_dropout: float = 0.0
    lora_target_modules: str = LORA_TARGET_MODULES  # comma-separated Linear names in the blocks
    eval_interval: int = 50
    eval_fraction: float = 0.05
    checkpoint_interval: int = 0
    keep_checkpoints: int = 2
    checkpoint_async: bool = False  # write (and upload) checkpoints in the background
    output_dir: str = "output"
    log_interval: int = 10
    metrics_port: int = 0  # rank 0 serves the per-step metrics to Prometheus here; 0: off
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for field in dataclasses.fields(self):
            value = _coerce(field.name, hints[field.name], getattr(self, field.name))
            object.__setattr__(self, field.name, value)
        _check_ranges(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# The allowed values of each numeric field: (description for the error, test).
_RANGES: dict[str, tuple[str, Callable[[float], bool]]] = {
    "seq_len": (">= 2", lambda v: v >= 2),
    "micro_batch": (">= 1", lambda v: v >= 1),
    "grad_accum": (">= 1", lambda v: v >= 1),
    "lr": ("> 0", lambda v: v > 0),
    "warmup_steps": (">= 0", lambda v: v >= 0),
    "min_lr_ratio": ("between 0 and 1", lambda v: 0 <= v <= 1),
    "weight_decay": (">= 0", lambda v: v >= 0),
    "max_steps": (">= 0", lambda v: v >= 0),
    "epochs": ("> 0", lambda v: v > 0),
    "seed": (">= 0", lambda v: v >= 0),
    "shard_group_size": (">= 0", lambda v: v >= 0),
    "tp_degree": (">= 1", lambda v: v >= 1),
    "lora_rank": (">= 0", lambda v: v >= 0),
    "lora_alpha": ("> 0", lambda v: v > 0),
    "lora_dropout": (">= 0 and < 1", lambda v: 0 <= v < 1),
    "eval_interval": (">= 0", lambda v: v >= 0),
    "eval_fraction": ("> 0 and < 1", lambda v: 0 < v < 1),
    "checkpoint_interval": (">= 0", lambda v: v >= 0),
    "keep_checkpoints": (">= 1", lambda v: v >= 1),
    "log_interval": (">= 1", lambda v: v >= 1),
    "metrics_port": ("between 0 and 65535", lambda v: 0 <= v <= 65535),
    "max_grad_norm": ("> 0", lambda v: v > 0),
}
_REQUIRED_STRINGS = ("model", "dataset", "output_dir", "prompt_field", "response_field")


def _check_ranges(config: TrainConfig) -> None:
    for name, (allowed, test) in _RANGES.items():
        value = getattr(config, name)
        if not test(value):
            raise ValueError(f"{name} must be {allowed}, got {value!r}")
    for name in _REQUIRED_STRINGS:
        if not getattr(config, name).strip():
            raise ValueError(f"{name} must not be empty")
    if config.lora_rank and not target_module_names(config.lora_target_modules):
        raise ValueError("lora_target_modules must name at least one module when lora_rank > 0")


def _coerce(name: str, hint: Any, value: Any) -> Any:
    """Return `value` as the field's type; strings (from the command line) are parsed."""
    if isinstance(hint, types.UnionType):  # only `str | None` is used
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            return None
        hint = str
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
        return value
    if hint is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {value!r}")
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"{name} must be a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if hint is int:
        if value != int(value):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        return int(value)
    return float(value)


def field_names() -> tuple[str, ...]:
    return tuple(field.name for field in dataclasses.fields(TrainConfig))


def load_config(
    path: str | os.PathLike[str] | None, overrides: Mapping[str, Any] | None = None
) -> TrainConfig:
    """Read a JSON config (or start from the defaults), apply overrides, resolve paths."""
    values: dict[str, Any] = {}
    if path is not None:
        with open(path) as f:
            values = json.load(f)
        if not isinstance(values, dict):
            raise ValueError(f"{path}: the config must be a JSON object")
    values.update(overrides or {})
    unknown = sorted(set(values) - set(field_names()))
    if unknown:
        raise ValueError(f"unknown config key(s): {', '.join(unknown)}")
    return resolve(TrainConfig(**values))


def resolve(config: TrainConfig) -> TrainConfig:
    """Make paths absolute (relative to the working dir) and fill in the tokenizer.

    The resolved config is saved and read from other working dirs, so it holds no relative path.
    A model, tokenizer or data set that is not a local path stays as given: a Hugging Face hub id
    (or, for the data set, an s3:// URI); so does an s3:// output_dir.
    """
    if is_s3(config.output_dir):
        split_s3(config.output_dir)  # names the field when the bucket is missing
    model = config.model if config.model in BUILTIN_CONFIGS else _absolute_if_local(config.model)
    tokenizer = config.tokenizer
    if tokenizer is None:
        tokenizer = str(DEMO_TOKENIZER) if config.model in BUILTIN_CONFIGS else model
    return dataclasses.replace(
        config,
        model=model,
        tokenizer=_absolute_if_local(tokenizer),
        dataset=_absolute(config.dataset)
        if dataset_source(config.dataset) == "local"
        else config.dataset,
        output_dir=config.output_dir if is_s3(config.output_dir) else _absolute(config.output_dir),
    )


def dataset_source(dataset: str) -> DatasetSource:
    """Where a data set lives: an s3:// URI, a local file or directory, or the Hugging Face hub.

    A name that is not on disk is a hub name only if shaped like one and not like a data file, so
    a mistyped path is reported missing rather than looked up on the hub.
    """
    if dataset.startswith("s3://"):
        return "s3"
    path = Path(dataset).expanduser()
    if path.exists() or path.suffix.lower() in FORMAT_BY_EXTENSION or not _HUB_NAME.match(dataset):
        return "local"
    return "hub"


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().absolute())


def _absolute_if_local(path: str) -> str:
    return _absolute(path) if Path(path).expanduser().exists() else path


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """`--config cfg.json` plus one `--<field> value` option per TrainConfig field."""
    parser = argparse.ArgumentParser(prog="trainer.train", allow_abbrev=False)
    parser.add_argument("--config", help="JSON file with TrainConfig fields")
    for name in field_names():
        parser.add_argument(f"--{name}", default=argparse.SUPPRESS, metavar="VALUE")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        raise ValueError(f"unknown option(s): {' '.join(unknown)}")
    overrides = vars(args)
    return load_config(overrides.pop("config"), overrides)
