"""The trainer's config: the contract's `TrainConfig` from JSON plus `--key value` overrides.

The dataclass, its choices, bounds and rules live in the torch-free contract package
(plugins/finetune_contract), which the Airflow side validates with before a run starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from finetune_contract.data import dataset_source
from finetune_contract.fields import DEMO_DATASET as DEFAULT_DATASET
from finetune_contract.fields import DEMO_PREFERENCES as DEFAULT_PREFERENCES
from finetune_contract.mixture import with_source_datasets
from finetune_contract.models import BUILTIN_MODELS
from finetune_contract.rules import split_s3
from finetune_contract.train_config import TrainConfig, field_names
from trainer.demo import DEMO_DATASET, DEMO_PREFERENCES, DEMO_TOKENIZER
from trainer.storage import is_s3

__all__ = ["TrainConfig", "field_names", "load_config", "parse_args", "resolve"]


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
    A model, tokenizer or data set (a mixture's sources' too) that is not a local path stays as
    given: a Hugging Face hub id (or, for the data set, an s3:// URI); so does an s3:// output_dir.
    """
    if is_s3(config.output_dir):
        try:
            split_s3(config.output_dir)
        except ValueError as exc:
            raise ValueError(f"output_dir {exc}") from None
    model = config.model if config.model in BUILTIN_MODELS else _absolute_if_local(config.model)
    tokenizer = config.tokenizer
    if tokenizer is None:
        tokenizer = str(DEMO_TOKENIZER) if config.model in BUILTIN_MODELS else model
    # The contract's default names the demo data from the repository root; the trainer may run
    # from elsewhere.
    demo_data = {DEFAULT_DATASET: DEMO_DATASET, DEFAULT_PREFERENCES: DEMO_PREFERENCES}
    dataset = str(demo_data.get(config.dataset, config.dataset))

    def local(path: str) -> str:
        path = str(demo_data.get(path, path))
        return _absolute(path) if dataset_source(path) == "local" else path

    return dataclasses.replace(
        config,
        mixture=with_source_datasets(config.mixture, local) if config.mixture else None,
        model=model,
        tokenizer=_absolute_if_local(tokenizer),
        dataset=_absolute(dataset) if dataset_source(dataset) == "local" else dataset,
        eval_dataset=_absolute(config.eval_dataset) if config.eval_dataset
        and dataset_source(config.eval_dataset) == "local" else config.eval_dataset,
        output_dir=config.output_dir if is_s3(config.output_dir) else _absolute(config.output_dir),
    )


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
