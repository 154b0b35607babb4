"""What a target hands the trainer: its config (TrainConfig's fields) from a run config, the same
JSON on every target; and where this machine finds the run's model and tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from finetune.config import RunConfig, resolve_path
from finetune_contract.data import dataset_source
from finetune_contract.fields import DEMO_TOKENIZER
from finetune_contract.mixture import with_source_datasets
from finetune_contract.models import BUILTIN_MODELS
from finetune_contract.parameters import TRAINER_PARAMETERS
from finetune_contract.train_config import method_dataset


def trainer_config(cfg: RunConfig, *, local_paths: bool = True) -> dict[str, Any]:
    """The trainer's JSON config (finetune_contract.train_config.TrainConfig) for this run:
    every trainer parameter with the run's value (an optional text left empty as null), the
    output directory the run's own.

    local_paths: resolve paths on this machine (local target), a mixture's sources' too. Off
    for a cluster: paths are read in the trainer's container (relative ones from its working
    dir, which holds trainer/), or are s3:// or hub ids.
    """
    values = {p.name: (getattr(cfg, p.name) or None) if p.optional else getattr(cfg, p.name)
              for p in TRAINER_PARAMETERS}
    values["dataset"] = method_dataset(cfg.method, cfg.dataset)
    values["output_dir"] = cfg.run_dir
    if local_paths:
        if cfg.model not in BUILTIN_MODELS and _is_dir(resolve_path(cfg.model)):
            values["model"] = str(resolve_path(cfg.model))
        if cfg.tokenizer:
            values["tokenizer"] = str(resolve_path(cfg.tokenizer))
        values["dataset"] = _dataset_here(values["dataset"])
        values["eval_dataset"] = _dataset_here(cfg.eval_dataset) or None
        if cfg.mixture:
            values["mixture"] = with_source_datasets(cfg.mixture, _dataset_here)
    return values


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

        found = REPO_ROOT / DEMO_TOKENIZER
    else:
        found = local_dir(cfg.model, in_pod)
    return found if found is not None and found.is_dir() else None
