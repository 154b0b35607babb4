"""Helpers the task YAML files here name with `!function`: their data (shipped beside them, read
offline) and the prompt, in the trainer's own template (the model saw it in training)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets

from finetune_contract.data import PROMPT_TEMPLATE

TASK_DIR = Path(__file__).resolve().parent


def load_items(**_: Any) -> datasets.DatasetDict:
    """demo_instructions' items as its `test` split (the harness passes its metadata: unused)."""
    path = TASK_DIR / "demo_instructions.jsonl"
    return datasets.DatasetDict({"test": datasets.load_dataset(
        "json", data_files=str(path), split="train")})


def doc_to_text(doc: dict[str, Any]) -> str:
    return PROMPT_TEMPLATE.format(prompt=doc["prompt"])
