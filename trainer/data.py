"""Data: load rows with `datasets`, tokenize with the prompt masked from the loss, pack, sample.

Sources: a jsonl/json/parquet/csv file, a directory of them, an s3:// object or prefix (downloaded
first), or a Hugging Face hub data set name.

Bad rows (a jsonl line that is not a JSON object, a missing or non-string field, an empty example,
one longer than seq_len) are skipped and counted by reason, or with bad_rows=error the first one
fails the run at start, named by file and line (jsonl) or row.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from finetune_contract.data import (
    IGNORE_INDEX,
    MALFORMED,
    bad_row_error,
    batches_per_epoch,
    builder_name,
    data_files,
    dataset_source,
    encode_pair,
    encode_row,
    field_problem,
    missing_columns,
    row_columns,
    split_sizes,
)
from trainer.batch import Batch
from trainer.config import TrainConfig

# DPO rows: input_ids/labels hold the chosen example (what the eval loss is taken on), these the
# rejected one.
REJECTED_IDS, REJECTED_LABELS = "rejected_input_ids", "rejected_labels"
# dpo_reference precompute: (chosen, rejected) reference log-probabilities of a pair.
REFERENCE_LOGPS = "reference_logps"
S3_CACHE_DIR = "dataset_cache"  # under output_dir: where s3:// data sets are downloaded


# Columns the loader adds to the rows it reads itself (jsonl): the problem and where the row is.
_PROBLEM, _DETAIL, _FILE, _LINE = "_problem", "_detail", "_file", "_line"


@dataclass
class Splits:
    train: datasets.Dataset
    eval: datasets.Dataset
    skipped: dict[str, int]  # rows skipped, by reason (ROW_PROBLEMS)

    @property
    def skipped_rows(self) -> int:
        return sum(self.skipped.values())


@dataclass
class RawRows:
    """A data set's rows and where each came from, to name a bad one."""

    rows: datasets.Dataset
    files: list[str]  # the data files read, in order; empty for a hub data set
    starts: list[int]  # index of each file's first row (files not read line by line)
    name: str = ""  # the hub data set and split

    def where(self, index: int, row: dict[str, Any]) -> str:
        if row.get(_LINE) is not None:
            return f"{self.files[row[_FILE]]} line {row[_LINE]}"
        if not self.files:
            return f"{self.name} row {index + 1}"
        file = bisect.bisect_right(self.starts, index) - 1
        return f"{self.files[file]} row {index - self.starts[file] + 1}"


def s3_cache_dir(output_dir: str) -> Path:
    """Where s3:// data sets are downloaded: the output dir, or the temp dir if that is on S3."""
    if output_dir.startswith("s3://"):
        return Path(tempfile.gettempdir()) / "trainer" / S3_CACHE_DIR
    return Path(output_dir) / S3_CACHE_DIR


def download_s3(uri: str, cache_dir: Path) -> Path:
    """Copy an s3:// object, or every object under a prefix, to cache_dir/<bucket>/<key>.

    As `aws s3 sync` does, a file already there with the object's size and time is kept.
    """
    import boto3  # only S3 data sets need it
    from botocore.exceptions import ClientError

    bucket, _, key = uri.removeprefix("s3://").partition("/")
    s3 = boto3.client("s3")
    try:
        key, objects = _s3_objects(s3, bucket, key)
    except ClientError as error:
        raise ValueError(f"dataset {uri!r} cannot be read: {error}") from error
    if not objects:
        raise ValueError(f"dataset {uri!r}: no object has that key or is under that prefix")
    bucket_dir = (cache_dir / bucket).absolute()
    for obj in objects:
        local = (bucket_dir / obj["Key"]).resolve()
        if not local.is_relative_to(bucket_dir.resolve()):
            raise ValueError(f"dataset {uri!r}: object key {obj['Key']!r} leaves the cache dir")
        size, mtime = obj["Size"], obj["LastModified"].timestamp()
        if local.is_file() and (local.stat().st_size, local.stat().st_mtime) == (size, mtime):
            continue
        local.parent.mkdir(parents=True, exist_ok=True)
        # A unique hidden name: nodes sharing the cache may fetch the same object at the same time.
        partial = local.with_name(f".{local.name}.{uuid.uuid4().hex}")
        s3.download_file(bucket, obj["Key"], str(partial))
        os.utime(partial, (mtime, mtime))
        os.replace(partial, local)
    return bucket_dir / key


def _s3_objects(s3: Any, bucket: str, key: str) -> tuple[str, list[dict[str, Any]]]:
    """(key or prefix, its objects): the object at `key`, else the objects under `key/`."""
    from botocore.exceptions import ClientError

    if key and not key.endswith("/"):
        try:
            head = s3.head_object(Bucket=bucket, Key=key)
            return key, [
                {"Key": key, "Size": head["ContentLength"], "LastModified": head["LastModified"]}
            ]
        except ClientError as error:
            if error.response["Error"]["Code"] not in ("404", "NoSuchKey", "NotFound"):
                raise
        key += "/"
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key)
    objects = [obj for page in pages for obj in page.get("Contents", [])]
    return key, [obj for obj in objects if not obj["Key"].endswith("/")]


def local_dataset(config: TrainConfig) -> Path | None:
    """The data set's local file or directory, downloaded first if on S3; None for a hub name."""
    source = dataset_source(config.dataset)
    if source == "hub":
        return None
    if source == "s3":
        return download_s3(config.dataset, s3_cache_dir(config.output_dir))
    return Path(config.dataset)


def is_jsonl(path: str, dataset_format: str) -> bool:
    return dataset_format == "jsonl" or (
        dataset_format == "auto" and Path(path).suffix.lower() == ".jsonl")


def _jsonl_rows(files: list[str], columns: dict[str, str],
                stamps: list[tuple[int, int]]) -> Iterator[dict[str, Any]]:
    """Every non-blank line of the files as a row of the needed columns, its problem, its place.

    Read here rather than by `datasets`, whose json loader fails on a whole file for one bad
    line. stamps (size, mtime) make a changed file a new cache entry.
    """
    del stamps
    for file_index, path in enumerate(files):
        with open(path, "rb") as f:
            for line_number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row: dict[str, Any] = {}
                try:
                    parsed = json.loads(line)
                except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
                    problem: tuple[str, str] | None = (MALFORMED, f"not JSON ({error})")
                else:
                    if isinstance(parsed, dict):
                        row, problem = parsed, field_problem(columns, parsed)
                    else:
                        problem = (MALFORMED, f"a JSON {type(parsed).__name__}, not an object")
                yield {
                    **{c: v if isinstance(v := row.get(c), str) else None
                       for c in columns.values()},
                    _PROBLEM: problem[0] if problem else None,
                    _DETAIL: problem[1] if problem else None,
                    _FILE: file_index,
                    _LINE: line_number,
                }


def _has_a_line(path: str) -> bool:
    with open(path, "rb") as f:
        return any(line.strip() for line in f)  # stops at the first


def read_jsonl(files: list[str], columns: dict[str, str]) -> datasets.Dataset:
    """The jsonl files' rows (see _jsonl_rows), written to the `datasets` cache."""
    features = datasets.Features({
        **{c: datasets.Value("string") for c in columns.values()},
        _PROBLEM: datasets.Value("string"),
        _DETAIL: datasets.Value("string"),
        _FILE: datasets.Value("int32"),
        _LINE: datasets.Value("int64"),
    })
    stamps = [(os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
    return datasets.Dataset.from_generator(
        _jsonl_rows, features=features,
        gen_kwargs={"files": files, "columns": columns, "stamps": stamps})


def load_rows(config: TrainConfig, local_path: Path | None) -> RawRows:
    """The raw rows of the local file or directory, or (for None) of the hub data set."""
    if local_path is None:
        try:
            rows = datasets.load_dataset(config.dataset, split=config.dataset_split)
        except OSError as error:  # not found (DatasetNotFoundError) or hub unreachable
            raise ValueError(
                f"dataset {config.dataset!r} is no local file or directory, so it was looked up "
                f"as a Hugging Face hub data set: {error}"
            ) from error
        return RawRows(rows, [], [], name=f"{config.dataset} split {config.dataset_split}")
    files = data_files(local_path, config.dataset_format)
    if is_jsonl(files[0], config.dataset_format):
        if not any(_has_a_line(file) for file in files):
            raise ValueError(f"dataset {config.dataset} has no rows: its jsonl files are empty "
                             "or blank")
        return RawRows(read_jsonl(files, row_columns(config)), files, [])
    builder = builder_name(files[0], config.dataset_format)
    parts, starts = [], []
    for file in files:  # one at a time, to tell which file a bad row is in
        starts.append(sum(len(part) for part in parts))
        try:
            parts.append(datasets.load_dataset(builder, data_files=[file], split="train"))
        except Exception as error:  # the builders raise their own types (arrow, pandas)
            raise ValueError(f"dataset file {file} cannot be read as {builder}: {error}") \
                from error
    try:
        rows = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    except ValueError as error:
        raise ValueError(
            f"the files of dataset {config.dataset} do not share one set of columns and types: "
            f"{error}") from error
    return RawRows(rows, files, starts)


def tokenize(raw: RawRows, tokenizer: PreTrainedTokenizerBase,
             config: TrainConfig) -> tuple[datasets.Dataset, dict[str, int]]:
    """(tokenized usable rows, skipped rows by reason); bad_rows=error raises at the first bad row.

    A row longer than seq_len is bad rather than truncated: truncation would cut the response
    (and its EOS, so the model would not learn to stop) without anyone noticing.
    """
    rows = raw.rows
    dpo = config.method == "dpo"  # a row is a pair: the chosen example and the rejected one
    missing = missing_columns(config, rows.column_names, config.dataset)
    if missing:
        raise ValueError("; ".join(message for _, message in missing))

    def encode_batch(batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"input_ids": [], "labels": [], _PROBLEM: []}
        if dpo:
            out.update({REJECTED_IDS: [], REJECTED_LABELS: []})
        for i, index in enumerate(indices):
            row = {key: values[i] for key, values in batch.items()}
            rejected: tuple[list[int], list[int]] = ([], [])
            if row.get(_PROBLEM):
                problem, input_ids, labels = (row[_PROBLEM], row[_DETAIL]), [], []
            elif dpo:
                problem, (input_ids, labels), rejected = encode_pair(tokenizer, config, row)
            else:
                problem, input_ids, labels = encode_row(tokenizer, config, row)
            if problem is not None and config.bad_rows == "error":
                raise ValueError(bad_row_error(config, raw.where(index, row), problem[1]))
            out["input_ids"].append(input_ids)
            out["labels"].append(labels)
            if dpo:
                out[REJECTED_IDS].append(rejected[0])
                out[REJECTED_LABELS].append(rejected[1])
            out[_PROBLEM].append(problem[0] if problem else None)
        return out

    encoded = rows.map(encode_batch, batched=True, with_indices=True,
                       remove_columns=rows.column_names)
    problems = encoded.data.column(_PROBLEM)
    skipped = {str(v["values"]): int(v["counts"])
               for v in problems.value_counts().to_pylist() if v["values"] is not None}
    if skipped:
        encoded = encoded.filter(lambda problem: problem is None, input_columns=_PROBLEM)
    return encoded.remove_columns(_PROBLEM), skipped


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


def check_prompt_template(config: TrainConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """Fail at start, before any download, when the tokenizer has no chat template to apply
    (chat with text_field is the contract's rule, checked before this)."""
    if config.prompt_template != "chat":
        return
    if not tokenizer.chat_template:
        raise ValueError(
            f"prompt_template=chat but tokenizer {config.tokenizer} has no chat template: use "
            "prompt_template=instruction or a tokenizer with a chat template"
        )


def build_splits(config: TrainConfig, tokenizer: PreTrainedTokenizerBase) -> Splits:
    """Tokenized train and held-out eval rows: the same split on every rank and every run."""
    datasets.disable_progress_bars()
    check_prompt_template(config, tokenizer)
    with _rank_zero_first(per_node=True):
        local_path = local_dataset(config)
    with _rank_zero_first():
        raw = load_rows(config, local_path)
        tokenized, skipped = tokenize(raw, tokenizer, config)
    try:
        _, n_eval = split_sizes(len(tokenized), config)
    except ValueError as error:
        reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(skipped.items()))
        raise ValueError(
            str(error) + (f"; skipped rows: {reasons} ({_first_problem(raw, config)})"
                          if skipped else "")) from None
    split = tokenized.train_test_split(test_size=n_eval, shuffle=True, seed=config.seed)
    train, held_out = split["train"], split["test"]
    if config.packing:
        # Split before packing: the eval split holds the same examples with packing on or off.
        with _rank_zero_first():
            train, held_out = pack(train, config.seq_len), pack(held_out, config.seq_len)
    if REJECTED_IDS in held_out.column_names:
        # DPO: the eval loss is the chosen responses' (a held-out SFT loss on what is preferred).
        held_out = held_out.remove_columns([REJECTED_IDS, REJECTED_LABELS])
    return Splits(train=train, eval=held_out, skipped=skipped)


def _first_problem(raw: RawRows, config: TrainConfig) -> str:
    """The first bad row and what is wrong with it (checks fields only: no tokenizing)."""
    columns = row_columns(config)
    for index, row in enumerate(raw.rows):
        problem = (row[_PROBLEM], row[_DETAIL]) if row.get(_PROBLEM) else \
            field_problem(columns, row)
        if problem is not None:
            return f"first: {raw.where(index, row)}: {problem[1]}"
    return f"every row is longer than seq_len {config.seq_len} or has no token to learn"


def pack(ds: datasets.Dataset, seq_len: int) -> datasets.Dataset:
    """Examples concatenated in order into rows of up to seq_len tokens; none is split.

    position_ids restart at 0 for each example, so the model sees each one as it would alone
    (see Batch.model_inputs). An example's first token takes no loss, as it would be predicted
    from the example before: the labelled tokens are those of the unpacked examples.
    """

    def pack_batch(batch: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        packed: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "position_ids": []}
        for input_ids, labels in zip(batch["input_ids"], batch["labels"]):
            if not packed["input_ids"] or len(packed["input_ids"][-1]) + len(input_ids) > seq_len:
                for column in packed.values():
                    column.append([])
            packed["input_ids"][-1] += input_ids
            packed["labels"][-1] += [IGNORE_INDEX, *labels[1:]]
            packed["position_ids"][-1] += range(len(input_ids))
        return packed

    # Packed per map batch (1000 examples): memory stays bounded, one short row per batch.
    return ds.map(pack_batch, batched=True, remove_columns=ds.column_names)


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


class DistributedSampler:
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
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._epoch_order()


class TrainBatches:
    """Endless micro batches for this rank, in the sampler's order; pad_to: a fixed length."""

    def __init__(
        self,
        ds: datasets.Dataset,
        sampler: DistributedSampler,
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
