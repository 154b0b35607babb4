"""Data: the prepared splits loaded memory-mapped, collated into batches, sampled per rank, and a
mixture's held-out split taken apart by source (for the eval loss per source).

The data set is read, encoded, packed and split by the prepare_data stage
(finetune_data.prepared_set, the one encoding); the trainer loads its Arrow files on every rank
and never tokenizes at start.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch
import torch.distributed as dist
from finetune_data.mixing import source_ranges
from finetune_data.prepared_set import (
    PREPARED_DIR,
    REJECTED_IDS,
    REJECTED_LABELS,
    download_s3,
    load_eval_dataset,
    load_prepared,
    prepare,
    s3_cache_dir,
)

from finetune_contract.data import IGNORE_INDEX, batches_per_epoch
from trainer.batch import Batch
from trainer.config import TrainConfig
from trainer.storage import is_s3

# dpo_reference precompute: (chosen, rejected) reference log-probabilities of a pair.
REFERENCE_LOGPS = "reference_logps"


@dataclass
class Splits:
    train: datasets.Dataset
    eval: datasets.Dataset
    skipped: dict[str, int]  # rows skipped, by reason (ROW_PROBLEMS)
    stats: dict[str, Any] = field(default_factory=dict)  # the prepared set's (prepare_data)
    eval_dataset: datasets.Dataset | None = None  # the eval_dataset's split, when one is set

    @property
    def skipped_rows(self) -> int:
        return sum(self.skipped.values())

    def eval_by_source(self) -> dict[str, datasets.Dataset]:
        """A mixture's held-out rows by source name (each source's contiguous range, so nothing
        is written beside the memory-mapped split); {} for one data set."""
        names = [source["name"] for source in self.stats.get("sources") or []]
        return {names[index]: self.eval.select(rows)
                for index, rows in source_ranges(self.eval).items()} if names else {}


@contextmanager
def _rank_zero_first(per_node: bool = False) -> Iterator[None]:
    """Rank 0 fills the `datasets` cache first so the other ranks read it instead of racing.

    per_node: each node's local rank 0 goes first, for what lands on a node's own disk.
    """
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    if not distributed:
        yield
        return
    rank = int(os.environ.get("LOCAL_RANK", 0)) if per_node else dist.get_rank()
    if rank != 0:
        dist.barrier()
    yield
    if rank == 0:
        dist.barrier()


def build_splits(config: TrainConfig, unpacked_eval: bool = False) -> Splits:
    """The prepared train and eval splits, memory-mapped: the same on every rank and every run.

    config.prepared_data names the set the prepare_data stage wrote (a directory or an s3://
    prefix, copied to this node first). A trainer started by hand without one prepares the data
    set first with the stage's own function, into output_dir/prepared_data (rank 0 encodes, the
    other ranks find its key there); the trainer's start never encodes rows itself.
    unpacked_eval: the eval split one example a row also when packed (for evaluate).
    """
    datasets.disable_progress_bars()
    path = config.prepared_data
    if not path:
        with _rank_zero_first():
            path = _prepare_here(config)
    elif is_s3(path):
        with _rank_zero_first(per_node=True):
            path = str(download_s3(path.rstrip("/") + "/", s3_cache_dir(config.output_dir)))
    train, held_out, stats = load_prepared(path, unpacked_eval)
    return Splits(train=train, eval=held_out, skipped=stats["skipped_rows_by_reason"],
                  stats=stats, eval_dataset=load_eval_dataset(path) if config.eval_dataset
                  else None)


def _prepare_here(config: TrainConfig) -> str:
    root = (Path(tempfile.gettempdir()) / "trainer" if is_s3(config.output_dir)
            else Path(config.output_dir)) / PREPARED_DIR
    return prepare(config, root)["path"]


def collate(rows: list[dict[str, list[int]]], pad_id: int, pad_to: int | None = None) -> Batch:
    """Right-pad to the longest row (or to `pad_to`).

    No attention mask is needed: with causal attention and right padding, real tokens never see
    the pads, and pad positions carry no loss. Packed rows' padding gets positions from 0, so the
    model takes it for one more example, which no real token attends to.
    """
    reference = None
    if REFERENCE_LOGPS in rows[0]:
        reference = torch.tensor([r[REFERENCE_LOGPS][0] for r in rows]
                                 + [r[REFERENCE_LOGPS][1] for r in rows])
    if REJECTED_IDS in rows[0]:  # DPO pairs: the chosen rows, then the rejected ones
        rows = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows] + \
            [{"input_ids": r[REJECTED_IDS], "labels": r[REJECTED_LABELS]} for r in rows]
    length = pad_to or max(len(row["input_ids"]) for row in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    packed = "position_ids" in rows[0]
    position_ids = torch.zeros((len(rows), length), dtype=torch.long) if packed else None
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        input_ids[i, :n] = torch.tensor(row["input_ids"])
        labels[i, :n] = torch.tensor(row["labels"])
        if position_ids is not None:
            position_ids[i, :n] = torch.tensor(row["position_ids"])
            position_ids[i, n:] = torch.arange(length - n)
    num_tokens = sum(len(row["input_ids"]) for row in rows)
    return Batch(input_ids, labels, num_tokens, position_ids, reference)


def _rows(ds: datasets.Dataset, indices: list[int]) -> list[dict[str, list[int]]]:
    columns = ds[indices]
    return [dict(zip(columns, values)) for values in zip(*columns.values())]


class ResumableSampler:
    """Seeded per-epoch permutation; rank r takes every world_size-th row from offset r.

    The position (epoch, index of the next micro batch in the epoch) is all the state there is,
    so a resumed run draws exactly the batches the uninterrupted run would have drawn.
    """

    def __init__(self, num_rows: int, micro_batch: int, rank: int, world_size: int, seed: int):
        self.num_rows, self.micro_batch = num_rows, micro_batch
        self.rank, self.world_size, self.seed = rank, world_size, seed
        # Every rank must run the same number of steps, so the ragged tail of an epoch is dropped.
        self.batches_per_epoch = batches_per_epoch(num_rows, micro_batch, world_size)
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
        # rows: what every rank together drew of the epoch, which a world of another size (an
        # elastic run that lost a node) resumes from: each step drew the same block of the
        # epoch's order whatever the world, when the global batch is kept.
        return {"epoch": self.epoch, "index": self.index,
                "rows": self.index * self.micro_batch * self.world_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        if "rows" in state:
            self.index = state["rows"] // (self.micro_batch * self.world_size)
        self._order = self._epoch_order()


class TrainBatches:
    """Endless micro batches for this rank, in the sampler's order; pad_to: a fixed length."""

    def __init__(
        self,
        ds: datasets.Dataset,
        sampler: ResumableSampler,
        pad_id: int,
        pad_to: int | None = None,
    ):
        self.ds, self.sampler, self.pad_id, self.pad_to = ds, sampler, pad_id, pad_to

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return collate(_rows(self.ds, self.sampler.next_indices()), self.pad_id, self.pad_to)


class EvalBatches:
    """This rank's share of the whole eval split, in the same number of batches on every rank.

    Every forward is a collective under FSDP, so a rank that runs out of rows runs a batch whose
    labels are all masked: it costs time, not correctness. Batches are built on each pass.
    """

    def __init__(
        self,
        ds: datasets.Dataset,
        micro_batch: int,
        rank: int,
        world_size: int,
        pad_id: int,
        pad_to: int | None = None,
    ):
        self.ds, self.micro_batch, self.pad_id, self.pad_to = ds, micro_batch, pad_id, pad_to
        self.indices = list(range(rank, len(ds), world_size))
        self.num_batches = math.ceil(math.ceil(len(ds) / world_size) / micro_batch)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[Batch]:
        for b in range(self.num_batches):
            chunk = self.indices[b * self.micro_batch : (b + 1) * self.micro_batch]
            if chunk:
                yield collate(_rows(self.ds, chunk), self.pad_id, self.pad_to)
            else:
                filler = collate(_rows(self.ds, [0]), self.pad_id, self.pad_to)
                filler.labels.fill_(IGNORE_INDEX)
                filler.num_tokens = 0
                yield filler
