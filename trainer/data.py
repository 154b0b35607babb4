"""Data: load rows with `datasets`, tokenize with the loss masked on the prompt, sample per rank."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from trainer.config import TrainConfig

PROMPT_TEMPLATE = "### Instruction:\n{prompt}\n\n### Response:\n"
IGNORE_INDEX = -100  # the label value cross_entropy skips: prompt and padding positions
_FORMAT_BY_EXTENSION = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class Batch:
    input_ids: torch.Tensor  # (batch, length), right-padded
    labels: torch.Tensor  # same shape; IGNORE_INDEX where no loss is taken
    num_tokens: int  # tokens that are not padding

    def to(self, device: torch.device) -> Batch:
        return Batch(self.input_ids.to(device), self.labels.to(device), self.num_tokens)


@dataclass
class Splits:
    train: datasets.Dataset
    eval: datasets.Dataset
    skipped_rows: int


def builder_name(path: str, dataset_format: str) -> str:
    """The `datasets` builder for a file: the configured format, or one read off the extension."""
    if dataset_format != "auto":
        return "json" if dataset_format == "jsonl" else dataset_format
    suffix = Path(path).suffix.lower()
    if suffix not in _FORMAT_BY_EXTENSION:
        raise ValueError(
            f"dataset_format is auto but the extension of {path!r} is not one of "
            f"{', '.join(_FORMAT_BY_EXTENSION)}; set dataset_format"
        )
    return _FORMAT_BY_EXTENSION[suffix]


def load_rows(config: TrainConfig) -> datasets.Dataset:
    if not Path(config.dataset).exists():
        raise ValueError(f"dataset {config.dataset!r} does not exist")
    builder = builder_name(config.dataset, config.dataset_format)
    return datasets.load_dataset(builder, data_files=config.dataset, split="train")


def encode_example(
    tokenizer: PreTrainedTokenizerBase, seq_len: int, prompt: str | None, response: str
) -> tuple[list[int], list[int]]:
    """Token ids and labels for one example; with a prompt, only the response carries loss.

    Prompt and response are tokenized separately so the boundary is exact, as at inference time.
    """
    eos = [tokenizer.eos_token_id]
    if prompt is None:
        input_ids = tokenizer(response)["input_ids"] + eos
        labels = list(input_ids)
    else:
        prompt_ids = tokenizer(PROMPT_TEMPLATE.format(prompt=prompt))["input_ids"]
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + eos
        input_ids = prompt_ids + response_ids
        labels = [IGNORE_INDEX] * len(prompt_ids) + response_ids
    return input_ids[:seq_len], labels[:seq_len]


def _present(value: Any) -> bool:
    return isinstance(value, str) and value.strip() != ""


def tokenize(
    rows: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, config: TrainConfig
) -> datasets.Dataset:
    """Tokenized rows; rows with an empty or missing field, or nothing to learn, are dropped."""
    if config.text_field:
        columns = {"text_field": config.text_field}
    else:
        columns = {"prompt_field": config.prompt_field, "response_field": config.response_field}
    for option, column in columns.items():
        if column not in rows.column_names:
            raise ValueError(
                f"{option}={column!r} is not a column of {config.dataset} "
                f"(columns: {', '.join(rows.column_names)})"
            )
    fields = list(columns.values())

    def encode_batch(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        out: dict[str, list[list[int]]] = {"input_ids": [], "labels": []}
        for values in zip(*(batch[field] for field in fields)):
            if not all(_present(v) for v in values):
                continue
            prompt, response = (None, values[0]) if config.text_field else values
            input_ids, labels = encode_example(tokenizer, config.seq_len, prompt, response)
            # The first label is never predicted (nothing precedes it), so it alone teaches nothing.
            if all(label == IGNORE_INDEX for label in labels[1:]):
                continue
            out["input_ids"].append(input_ids)
            out["labels"].append(labels)
        return out

    return rows.map(encode_batch, batched=True, remove_columns=rows.column_names)


@contextmanager
def _rank_zero_first() -> Iterator[None]:
    """Rank 0 fills the `datasets` cache first so the other ranks read it instead of racing."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    if distributed and dist.get_rank() != 0:
        dist.barrier()
    yield
    if distributed and dist.get_rank() == 0:
        dist.barrier()


def build_splits(config: TrainConfig, tokenizer: PreTrainedTokenizerBase) -> Splits:
    """Tokenized train and held-out eval rows: the same split on every rank and every run."""
    datasets.disable_progress_bars()
    with _rank_zero_first():
        rows = load_rows(config)
        tokenized = tokenize(rows, tokenizer, config)
    n = len(tokenized)
    n_eval = max(math.ceil(config.eval_fraction * n), config.micro_batch)
    if n_eval >= n:
        raise ValueError(
            f"dataset {config.dataset} has {n} usable rows: too few for an eval split of {n_eval} "
            "(eval_fraction, at least micro_batch rows) plus training rows"
        )
    split = tokenized.train_test_split(test_size=n_eval, shuffle=True, seed=config.seed)
    return Splits(train=split["train"], eval=split["test"], skipped_rows=len(rows) - n)


def collate(rows: list[dict[str, list[int]]], pad_id: int, pad_to: int | None = None) -> Batch:
    """Right-pad to the longest row (or to `pad_to`).

    No attention mask is needed: with causal attention and right padding, real tokens never see
    the pads, and pad positions carry no loss.
    """
    length = pad_to or max(len(row["input_ids"]) for row in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        input_ids[i, :n] = torch.tensor(row["input_ids"])
        labels[i, :n] = torch.tensor(row["labels"])
    return Batch(input_ids, labels, sum(len(row["input_ids"]) for row in rows))


def _rows(ds: datasets.Dataset, indices: list[int]) -> list[dict[str, list[int]]]:
    columns = ds[indices]
    return [
        {"input_ids": ids, "labels": labels}
        for ids, labels in zip(columns["input_ids"], columns["labels"])
    ]


class DistributedSampler:
    """Seeded per-epoch permutation; rank r takes every world_size-th row from offset r.

    The position (epoch, index of the next micro batch in the epoch) is all the state there is,
    so a resumed run draws exactly the batches the uninterrupted run would have drawn.
    """

    def __init__(self, num_rows: int, micro_batch: int, rank: int, world_size: int, seed: int):
        self.num_rows, self.micro_batch = num_rows, micro_batch
        self.rank, self.world_size, self.seed = rank, world_size, seed
        # Every rank must run the same number of steps, so the ragged tail of an epoch is dropped.
        self.batches_per_epoch = num_rows // world_size // micro_batch
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"{num_rows} training rows are fewer than micro_batch ({micro_batch}) x world size "
                f"({world_size})"
            )
        self.epoch, self.index = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        permutation = torch.randperm(self.num_rows, generator=generator)
        return permutation[self.rank :: self.world_size].tolist()

    def next_indices(self) -> list[int]:
        if self.index == self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._epoch_order()
        start = self.index * self.micro_batch
        self.index += 1
        return self._order[start : start + self.micro_batch]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._epoch_order()


class TrainBatches:
    """Endless micro batches for this rank, in the sampler's order."""

    def __init__(self, ds: datasets.Dataset, sampler: DistributedSampler, pad_id: int):
        self.ds, self.sampler, self.pad_id = ds, sampler, pad_id

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return collate(_rows(self.ds, self.sampler.next_indices()), self.pad_id)


class EvalBatches:
    """This rank's share of the whole eval split, in the same number of batches on every rank.

    Every forward is a collective under FSDP, so a rank that runs out of rows runs a batch whose
    labels are all masked: it costs time, not correctness. Batches are built on each pass.
    """

    def __init__(
        self, ds: datasets.Dataset, micro_batch: int, rank: int, world_size: int, pad_id: int
    ):
        self.ds, self.micro_batch, self.pad_id = ds, micro_batch, pad_id
        self.indices = list(range(rank, len(ds), world_size))
        self.num_batches = math.ceil(math.ceil(len(ds) / world_size) / micro_batch)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[Batch]:
        for b in range(self.num_batches):
            chunk = self.indices[b * self.micro_batch : (b + 1) * self.micro_batch]
            if chunk:
                yield collate(_rows(self.ds, chunk), self.pad_id)
            else:
                filler = collate(_rows(self.ds, [0]), self.pad_id)
                filler.labels.fill_(IGNORE_INDEX)
                filler.num_tokens = 0
                yield filler
