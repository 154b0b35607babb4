"""The prepare_data stage: a data set read, encoded with the run's tokenizer and template (the
contract's `encode_row`/`encode_pair`, the one encoding: texts, prompts and responses,
conversations), packed when asked, split train/eval with the run's seed and written as Arrow
files with its statistics, once, before any GPU is up. A mixture of data sets (`mixture`) is read
and encoded source by source, each split into its own training and held-out rows, and its
training examples drawn by weight (finetune_data.mixing); its statistics count each source apart.

Content-addressed: the prepared set's directory is named by a key of the sources' versions
(files' sizes and mtimes, S3 ETags, the hub data set's revision), the tokenizer's files and every
field the encoding depends on (a mixture's sources, weights and fields among them). A key that
exists is reused; a set is written to a temporary directory and renamed into place whole, so two
runs preparing one key never leave a half-written set (the first rename wins, the other run
reuses it), and a failure leaves nothing a later run would read.

The trainer loads the result memory-mapped (`load_prepared`) and never tokenizes. Needs `datasets`
and `transformers` (imported on use: the Airflow plugin loader imports this file).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune_contract.data import (
    IGNORE_INDEX,
    MALFORMED,
    TOO_LONG,
    TOOLS_COLUMN,
    bad_row_error,
    builder_name,
    data_files,
    dataset_source,
    encode_pair,
    encode_row,
    field_problem,
    missing_columns,
    other_method_problem,
    read_rows,
    row_columns,
    row_format,
    row_kind,
    split_sizes,
)
from finetune_contract.mixture import Source, mixture_counts, mixture_sources, source_config
from finetune_contract.train_config import TrainConfig
from finetune_data.mixing import held_out_by_source, mixed_train, with_source

if TYPE_CHECKING:
    import datasets

# Bump when the prepared layout or the encoding changes: old sets are then not reused.
# 2: the eval_dataset encoded too, in the key; 3: conversations found by themselves, mixtures.
PREPARE_VERSION = 3
PREPARED_DIR = "prepared_data"  # under output_dir: one directory per key
STATS_FILE = "stats.json"  # written last: a directory with it is complete
TRAIN_SPLIT, EVAL_SPLIT = "train", "eval"
# With packing: the eval split's examples unpacked, for the evaluate stage's samples and loss.
EVAL_EXAMPLES_SPLIT = "eval_examples"
# A separate eval data set (eval_dataset), encoded as the training data is, one example a row:
# what the evaluate stage measures on, so nothing after prepare_data tokenizes.
EVAL_DATASET_SPLIT = "eval_dataset"
# The encoding's processes: no more than one per this many rows. Below it a process pool costs
# more than it saves and is one more thing to fail (5,000 demo rows: 0.85 s with one process,
# 0.61 s with two; 1,000 rows: under 0.3 s either way; 2 cores, 2026-12-04).
ROWS_PER_PROCESS = 1000
S3_CACHE_DIR = "dataset_cache"  # under output_dir: where s3:// data sets are downloaded
# What an example's encoding and the split depend on, besides the rows and the tokenizer.
ENCODING_FIELDS = ("dataset_format", "dataset_split", "text_field", "prompt_field",
                   "response_field", "messages_field", "prompt_template", "seq_len", "method",
                   "chosen_field", "rejected_field", "packing", "bad_rows", "seed",
                   "eval_fraction", "micro_batch")
# Rows read from the start of jsonl files to see their columns (a conversation's, say).
COLUMNS_SEEN_ROWS = 1000
# DPO rows: input_ids/labels hold the chosen example (what the eval loss is taken on), these the
# rejected one.
REJECTED_IDS, REJECTED_LABELS = "rejected_input_ids", "rejected_labels"
LONGEST_SKIPPED = 5  # the longest skipped rows the statistics name

# Columns the loader adds to the rows it reads itself (jsonl): the problem and where the row is.
_PROBLEM, _DETAIL, _FILE, _LINE = "_problem", "_detail", "_file", "_line"
_TOKENS, _INDEX = "_tokens", "_index"  # per encoded row: its length, its index in the source
_TOO_LONG_TOKENS = re.compile(r"(\d+) tokens, more than seq_len")


@dataclass
class RawRows:
    """A data set's rows and where each came from, to name a bad one."""

    rows: datasets.Dataset
    files: list[str]  # the data files read, in order; empty for a hub data set
    starts: list[int]  # index of each file's first row (files not read line by line)
    name: str = ""  # the hub data set and split
    # The data's columns (jsonl: those of its first rows; the rows keep the needed ones only).
    seen_columns: list[str] | None = None

    @property
    def columns(self) -> list[str]:
        return self.seen_columns if self.seen_columns is not None else self.rows.column_names

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


def s3_version(uri: str) -> list[tuple[str, int, str]]:
    """(key, size, ETag) of every object of an s3:// data set: its version for the key."""
    import boto3
    from botocore.exceptions import ClientError

    bucket, _, key = uri.removeprefix("s3://").partition("/")
    try:
        _, objects = _s3_objects(boto3.client("s3"), bucket, key)
    except ClientError as error:
        raise ValueError(f"dataset {uri!r} cannot be read: {error}") from error
    return sorted((obj["Key"], obj["Size"], obj.get("ETag", "")) for obj in objects)


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
                {"Key": key, "Size": head["ContentLength"], "LastModified": head["LastModified"],
                 "ETag": head.get("ETag", "")}
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


def _jsonl_rows(files: list[str], columns: dict[str, str], optional: tuple[str, ...],
                stamps: list[tuple[int, int]]) -> Iterator[dict[str, Any]]:
    """Every non-blank line of the files as a row of the needed columns (and the optional ones
    where a row has them), its problem, its place. A conversation (a list) or a row's tools are
    kept as their JSON text.

    Read here rather than by `datasets`, whose json loader fails on a whole file for one bad
    line (and would need one Arrow type for every row's messages). stamps (size, mtime) make a
    changed file a new cache entry.
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
                    **{c: _as_text(row.get(c)) for c in [*columns.values(), *optional]},
                    _PROBLEM: problem[0] if problem else None,
                    _DETAIL: problem[1] if problem else None,
                    _FILE: file_index,
                    _LINE: line_number,
                }


def _as_text(value: Any) -> str | None:
    """A field as the jsonl rows keep it: a string, a list or object as its JSON text."""
    if isinstance(value, str):
        return value
    return json.dumps(value) if isinstance(value, list | dict) else None


def _has_a_line(path: str) -> bool:
    with open(path, "rb") as f:
        return any(line.strip() for line in f)  # stops at the first


def read_jsonl(files: list[str], columns: dict[str, str],
               optional: tuple[str, ...] = ()) -> datasets.Dataset:
    """The jsonl files' rows (see _jsonl_rows), written to the `datasets` cache."""
    import datasets

    features = datasets.Features({
        **{c: datasets.Value("string") for c in [*columns.values(), *optional]},
        _PROBLEM: datasets.Value("string"),
        _DETAIL: datasets.Value("string"),
        _FILE: datasets.Value("int32"),
        _LINE: datasets.Value("int64"),
    })
    stamps = [(os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
    return datasets.Dataset.from_generator(
        _jsonl_rows, features=features,
        # a tuple: `datasets` takes each list of gen_kwargs as shards of one length
        gen_kwargs={"files": files, "columns": columns, "optional": tuple(optional),
                    "stamps": stamps})


def load_rows(config: TrainConfig, local_path: Path | None) -> RawRows:
    """The raw rows of the local file or directory, or (for None) of the hub data set."""
    import datasets

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
        # Only the columns the rows need are kept: which they are, the first rows say.
        seen = read_rows(files, config.dataset_format, COLUMNS_SEEN_ROWS)
        read_as = row_format(config, seen.columns if seen else [])
        # a conversation's tools, wherever a row has them: not only where the first rows did
        optional = (TOOLS_COLUMN,) if read_as.messages_field else ()
        return RawRows(read_jsonl(files, row_columns(read_as), optional), files, [],
                       seen_columns=seen.columns if seen else None)
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


def tokenize(raw: RawRows, tokenizer: Any, config: TrainConfig, num_proc: int = 1
             ) -> tuple[datasets.Dataset, dict[str, int], list[dict[str, Any]]]:
    """(encoded usable rows, skipped rows by reason, the longest skipped rows: where, tokens);
    bad_rows=error raises at the first bad row, a tokenizer failing on a row raises naming it.

    A row longer than seq_len is bad rather than truncated: truncation would cut the response
    (and its EOS, so the model would not learn to stop) without anyone noticing. num_proc: the
    map's processes (each gets a copy of the tokenizer).
    """
    rows = raw.rows
    dpo = config.method == "dpo"  # a row is a pair: the chosen example and the rejected one
    config = row_format(config, rows.column_names)  # conversations found by themselves
    missing = missing_columns(config, rows.column_names, config.dataset)
    if missing:
        raise ValueError("; ".join(message for _, message in missing))
    check_template(config, tokenizer)

    def encode_batch(batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"input_ids": [], "labels": [], _PROBLEM: [], _TOKENS: [],
                                     _INDEX: []}
        if dpo:
            out.update({REJECTED_IDS: [], REJECTED_LABELS: []})
        for i, index in enumerate(indices):
            row = {key: values[i] for key, values in batch.items()}
            rejected: tuple[list[int], list[int]] = ([], [])
            try:
                if row.get(_PROBLEM):
                    problem, input_ids, labels = (row[_PROBLEM], row[_DETAIL]), [], []
                elif dpo:
                    problem, (input_ids, labels), rejected = encode_pair(tokenizer, config, row)
                else:
                    problem, input_ids, labels = encode_row(tokenizer, config, row)
            except Exception as error:  # a tokenizer or template failing on this row
                raise ValueError(f"dataset {config.dataset}: {raw.where(index, row)}: encoding "
                                 f"failed: {type(error).__name__}: {error}") from error
            if problem is not None and config.bad_rows == "error":
                raise ValueError(bad_row_error(config, raw.where(index, row), problem[1]))
            too_long = problem is not None and problem[0] == TOO_LONG and \
                _TOO_LONG_TOKENS.search(problem[1])
            out["input_ids"].append(input_ids)
            out["labels"].append(labels)
            if dpo:
                out[REJECTED_IDS].append(rejected[0])
                out[REJECTED_LABELS].append(rejected[1])
            out[_PROBLEM].append(problem[0] if problem else None)
            out[_TOKENS].append(int(too_long.group(1)) if too_long else len(input_ids))
            out[_INDEX].append(index)
        return out

    processes = min(num_proc, len(rows) // ROWS_PER_PROCESS)
    with _environ_kept():
        encoded = rows.map(encode_batch, batched=True, with_indices=True,
                           remove_columns=rows.column_names,
                           num_proc=processes if processes > 1 else None)
    problems = encoded.data.column(_PROBLEM)
    skipped = {str(v["values"]): int(v["counts"])
               for v in problems.value_counts().to_pylist() if v["values"] is not None}
    longest: list[dict[str, Any]] = []
    if skipped:
        bad = encoded.filter(lambda problem: problem is not None, input_columns=_PROBLEM)
        order = sorted(zip(bad[_TOKENS], bad[_INDEX], bad[_PROBLEM]), reverse=True)
        for tokens, index, problem in order[:LONGEST_SKIPPED]:
            longest.append({"where": raw.where(index, rows[index]), "reason": problem,
                            "tokens": tokens})
        encoded = encoded.filter(lambda problem: problem is None, input_columns=_PROBLEM)
    return encoded.remove_columns([_PROBLEM, _INDEX]), skipped, longest


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




# -- the prepared set ----------------------------------------------------------------------------


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_version(tokenizer_path: str) -> list[Any]:
    """The tokenizer directory's files by content (a hub id: the id, as the hub names it)."""
    path = Path(tokenizer_path)
    if not path.is_dir():
        return [tokenizer_path]
    return [(str(f.relative_to(path)), _file_digest(f)) for f in sorted(path.rglob("*"))
            if f.is_file()]


def source_version(config: TrainConfig, local_path: Path | None) -> list[Any]:
    """What changes when the data changes: the data files' sizes and mtimes, an s3:// data set's
    ETags, a hub data set's revision."""
    source = dataset_source(config.dataset)
    if source == "s3":
        return ["s3", config.dataset, s3_version(config.dataset)]
    if local_path is None:
        return ["hub", config.dataset, config.dataset_split, _hub_revision(config.dataset)]
    files = data_files(local_path, config.dataset_format)
    return ["local", [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]]


def _hub_revision(name: str) -> str:
    """The hub data set's commit; unknown (offline) makes a key per name, said in the stats."""
    try:
        from huggingface_hub import HfApi

        return HfApi().dataset_info(name).sha or "unknown"
    except Exception:  # offline, gated, not found: load_dataset names the cause
        return "unknown"


def eval_dataset_config(config: TrainConfig) -> TrainConfig | None:
    """The config that reads and encodes the run's eval_dataset (one example a row, never
    packed); None without one."""
    if not config.eval_dataset:
        return None
    return replace(config, dataset=config.eval_dataset, packing=False, mixture=None)


def sources_of(config: TrainConfig) -> list[tuple[Source | None, TrainConfig]]:
    """The data sets a run reads, each with the config it is read and encoded with: the
    mixture's sources (finetune_contract.mixture), or the one data set (no Source)."""
    if not config.mixture:
        return [(None, config)]
    return [(source, source_config(config, source)) for source in
            mixture_sources(config.mixture)]


def local_datasets(config: TrainConfig) -> list[Path | None]:
    """local_dataset of each data set the run reads (sources_of)."""
    return [local_dataset(read_as) for _, read_as in sources_of(config)]


def local_eval_dataset(config: TrainConfig) -> Path | None:
    """local_dataset of the eval_dataset (None: none, or a hub name)."""
    evaluated = eval_dataset_config(config)
    return local_dataset(evaluated) if evaluated else None


def prepare_key(config: TrainConfig, local_paths: list[Path | None],
                eval_path: Path | None = None) -> str:
    """The prepared set's content address (24 hex digits): the training data's version (each
    source's, for a mixture, with its name, fields and weight or rows) and the eval_dataset's
    (read from `eval_path`), the tokenizer's and the encoding fields."""
    evaluated = eval_dataset_config(config)
    sources = sources_of(config)
    material = {
        "version": PREPARE_VERSION,
        "source": source_version(config, local_paths[0]) if not config.mixture else [
            [source.to_dict(), source_version(read_as, path)]
            for (source, read_as), path in zip(sources, local_paths, strict=True)],
        "eval_dataset": source_version(evaluated, eval_path) if evaluated else None,
        "tokenizer": tokenizer_version(str(config.tokenizer)),
        "encoding": {name: getattr(config, name) for name in ENCODING_FIELDS},
    }
    blob = json.dumps(material, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def group_key(config: TrainConfig) -> str:
    """What decides a prepared set besides the versions of the data and the tokenizer's files:
    the data set (or mixture), eval data set and tokenizer named, and the encoding fields. Runs
    with the same group key prepared at the same time get the same `prepare_key`: a sweep
    prepares once per group (trials that differ only in training fields share one set)."""
    material = {"version": PREPARE_VERSION, "dataset": config.dataset,
                "mixture": config.mixture,
                "eval_dataset": config.eval_dataset, "tokenizer": str(config.tokenizer),
                "encoding": {name: getattr(config, name) for name in ENCODING_FIELDS}}
    blob = json.dumps(material, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


@contextmanager
def _environ_kept() -> Iterator[None]:
    """`datasets`' map with processes (4.x) puts a copy in place of `os.environ` and leaves it
    there: whatever held the object it replaced (boto3's default session reads the region from
    it) no longer sees the environment change. The object is put back, with what the map left in
    the copy."""
    environ = os.environ
    try:
        yield
    finally:
        if os.environ is not environ:
            left = dict(os.environ)
            os.environ = environ  # noqa: B003 (the original object back, refilled below)
            for name in set(environ) - set(left):
                del environ[name]
            environ.update(left)


def cpu_count() -> int:
    """The cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def prepare(config: TrainConfig, root: str | Path, num_proc: int | None = None,
            log: Callable[[str], None] = print) -> dict[str, Any]:
    """Prepare the run's data set under root/<key> unless it is there; its statistics, with
    `path`, `key`, `cache_hit` and `seconds` (this call's)."""
    started = time.perf_counter()
    root = Path(root)
    if config.prompt_template == "chat":  # before any download
        from finetune_contract.transformers_import import AutoTokenizer

        check_template(config, AutoTokenizer.from_pretrained(config.tokenizer))
    local_paths, eval_path = local_datasets(config), local_eval_dataset(config)
    key = prepare_key(config, local_paths, eval_path)
    final = root / key
    if (final / STATS_FILE).is_file():
        log(f"prepare_data: cache hit: {final} holds this data set, tokenizer and encoding "
            f"(key {key}); reused, nothing encoded")
        return _stats_of(final, cache_hit=True, seconds=time.perf_counter() - started)
    root.mkdir(parents=True, exist_ok=True)
    partial = root / f".{key}.{uuid.uuid4().hex}.partial"
    try:
        num_proc = num_proc or cpu_count()
        log(f"prepare_data: encoding {_what(config)} with up to {num_proc} processes, one per "
            f"{ROWS_PER_PROCESS:,} rows (key {key})")
        stats = _prepare_into(partial, config, local_paths, num_proc, eval_path)
        if prepare_key(config, local_paths, eval_path) != key:
            changed = _what(config) + (f" or eval_dataset {config.eval_dataset}"
                                       if config.eval_dataset else "")
            raise ValueError(f"dataset {changed} changed while it was prepared (its files' "
                             "sizes, mtimes or ETags moved): nothing was kept; run again once "
                             "it is written")
        stats.update(key=key, num_proc=num_proc, prepare_seconds=time.perf_counter() - started)
        (partial / STATS_FILE).write_text(json.dumps(stats, indent=1))
        try:
            os.rename(partial, final)
        except OSError:  # another run's rename won: its set is the same one
            if not (final / STATS_FILE).is_file():
                raise
            log(f"prepare_data: {final} was prepared by another run meanwhile; reused")
            return _stats_of(final, cache_hit=True, seconds=time.perf_counter() - started)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    log(f"prepare_data: wrote {final}")
    return _stats_of(final, cache_hit=False, seconds=time.perf_counter() - started)


def prepared_root(output_dir: str) -> str:
    """Where a run's prepared sets live: <output_dir>/prepared_data (a path or an s3:// prefix),
    beside the runs, so a later run of the same key finds them."""
    if output_dir.startswith("s3://"):
        return f"{output_dir.rstrip('/')}/{PREPARED_DIR}"
    return str(Path(output_dir) / PREPARED_DIR)


def prepare_to_s3(config: TrainConfig, root_uri: str, s3: Any, num_proc: int | None = None,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    """`prepare` for an s3:// root: the set prepared in a temporary directory here and uploaded
    to <root_uri>/<key>/, stats.json last (a prefix without it is not a set); a key whose
    stats.json is there is reused. The Airflow worker and the stage's own pod both call it."""
    from botocore.exceptions import ClientError

    started = time.perf_counter()
    bucket, _, base = root_uri.removeprefix("s3://").partition("/")
    base = base.strip("/")
    key = prepare_key(config, local_datasets(config), local_eval_dataset(config))
    uri = f"s3://{bucket}/{base}/{key}"
    try:
        stats = json.loads(s3.get_object(Bucket=bucket, Key=f"{base}/{key}/{STATS_FILE}")
                           ["Body"].read())
        log(f"prepare_data: cache hit: {uri} holds this data set, tokenizer and encoding "
            f"(key {key}); reused, nothing encoded")
        return {**stats, "uri": uri, "path": uri, "cache_hit": True,
                "seconds": round(time.perf_counter() - started, 3)}
    except ClientError as error:
        if error.response["Error"]["Code"] not in ("NoSuchKey", "404", "NotFound"):
            raise
    with tempfile.TemporaryDirectory(prefix="prepare-") as staging:
        stats = prepare(config, staging, num_proc, log=log)
        local = Path(stats["path"])
        files = sorted(p for p in local.rglob("*") if p.is_file() and p.name != STATS_FILE)
        for path in [*files, local / STATS_FILE]:  # stats.json last: the set is whole
            s3.upload_file(str(path), bucket, f"{base}/{key}/{path.relative_to(local).as_posix()}")
    log(f"prepare_data: uploaded {uri}")
    return {**stats, "uri": uri, "path": uri, "seconds": round(time.perf_counter() - started, 3)}


def _stats_of(path: Path, cache_hit: bool, seconds: float) -> dict[str, Any]:
    stats = json.loads((path / STATS_FILE).read_text())
    return {**stats, "path": str(path), "cache_hit": cache_hit, "seconds": round(seconds, 3)}


def _what(config: TrainConfig) -> str:
    """The data a run reads, as a log line names it."""
    if not config.mixture:
        return config.dataset
    return "mixture of " + ", ".join(f"{source.name} ({read_as.dataset})"
                                     for source, read_as in sources_of(config))


class FieldError(ValueError):
    """Data that cannot make the run, and the field of the run's conf that names it (the
    prepare stage reports it under that field, as validate would)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


class SourceError(FieldError):
    """A mixture's source that cannot be read, encoded or split (field: mixture[1].dataset)."""

    def __init__(self, source: Source, message: str):
        super().__init__(f"{source.where}.dataset", f"{source.where} ({source.name}): {message}")


@dataclass
class EncodedSource:
    """A data set read and encoded: its usable examples (with their lengths, _TOKENS) and what
    was skipped; `read_as` is the config it was read with (its row format found)."""

    source: Source | None
    read_as: TrainConfig
    raw: RawRows
    encoded: datasets.Dataset
    skipped: dict[str, int]
    longest: list[dict[str, Any]]

    def counts(self) -> dict[str, Any]:
        """Its rows read, kept and skipped (by reason, the longest named)."""
        return {"dataset": self.read_as.dataset, "row_format": row_kind(self.read_as),
                "rows_read": len(self.raw.rows), "rows_kept": len(self.encoded),
                "skipped_rows": sum(self.skipped.values()),
                "skipped_rows_by_reason": self.skipped, "longest_skipped_rows": self.longest}


def encode_source(source: Source | None, read_as: TrainConfig, local_path: Path | None,
                  tokenizer: Any, num_proc: int) -> EncodedSource:
    """One data set read and encoded; a mixture's source names itself in any error."""
    try:
        raw = load_rows(read_as, local_path)
        read_as = row_format(read_as, raw.columns)
        other_method = source is not None and other_method_problem(read_as, raw.columns)
        if other_method:
            raise ValueError(f"dataset {read_as.dataset} {other_method}")
        encoded, skipped, longest = tokenize(raw, tokenizer, read_as, num_proc)
    except ValueError as error:
        if source is None:
            raise
        raise SourceError(source, str(error)) from error
    return EncodedSource(source, read_as, raw, encoded, skipped, longest)


def _held_out_split(part: EncodedSource, config: TrainConfig
                    ) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(training rows, held-out rows) of one data set, split with the run's seed; ValueError
    when it has too few usable rows, with its skipped rows and the first bad one."""
    try:
        _, n_eval = split_sizes(len(part.encoded), part.read_as)
    except ValueError as error:
        skipped = part.skipped
        reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(skipped.items()))
        message = str(error) + (
            f"; skipped rows: {reasons} ({_first_problem(part.raw, part.read_as)})"
            if skipped else "")
        raise (SourceError(part.source, message) if part.source else ValueError(message)) \
            from None
    rows = part.encoded.remove_columns(_TOKENS)
    if part.source is not None:  # a mixture's: each row labelled with its source
        rows = with_source(rows, part.source.index)
    split = rows.train_test_split(test_size=n_eval, shuffle=True, seed=config.seed)
    return split["train"], split["test"]


def _prepare_into(out: Path, config: TrainConfig, local_paths: list[Path | None],
                  num_proc: int, eval_path: Path | None = None) -> dict[str, Any]:
    import datasets

    from finetune_contract.transformers_import import AutoTokenizer

    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
    check_template(config, tokenizer)
    parts = [encode_source(source, read_as, path, tokenizer, num_proc)
             for (source, read_as), path in zip(sources_of(config), local_paths, strict=True)]
    splits = [_held_out_split(part, config) for part in parts]
    sources: list[dict[str, Any]] | None = None
    if config.mixture:
        counts = mixture_counts([len(train) for train, _ in splits],
                                [part.source for part in parts])
        train = mixed_train([train for train, _ in splits], counts, config.seed)
        held_outs = [held_out for _, held_out in splits]
        held_out = held_out_by_source(held_outs)
        sources = [_source_stats(part, len(available), count, held, len(train))
                   for part, (available, held), count in zip(parts, splits, counts, strict=True)]
    else:
        (train, held_out), held_outs = splits[0], [splits[0][1]]
    examples = {"train": len(train), "eval": len(held_out)}
    if REJECTED_IDS in held_out.column_names:
        # DPO: the eval loss is the chosen responses' (a held-out SFT loss on what is preferred).
        held_out = held_out.remove_columns([REJECTED_IDS, REJECTED_LABELS])
        held_outs = [rows.remove_columns([REJECTED_IDS, REJECTED_LABELS]) for rows in held_outs]
    out.mkdir(parents=True)
    if config.packing:
        # Split before packing: the eval split holds the same examples with packing on or off;
        # a mixture's is packed per source, so each packed row is one source's.
        held_out.save_to_disk(str(out / EVAL_EXAMPLES_SPLIT))
        train = pack(train, config.seq_len)
        held_out = pack(held_out, config.seq_len) if not config.mixture else \
            datasets.concatenate_datasets([
            with_source(pack(rows, config.seq_len), index)  # pack keeps its columns only
            for index, rows in enumerate(held_outs)])
    train.save_to_disk(str(out / TRAIN_SPLIT))
    held_out.save_to_disk(str(out / EVAL_SPLIT))
    evaluated = eval_dataset_config(config)
    eval_stats = None
    if evaluated is not None:
        try:  # its bad rows and unreadable files are eval_dataset's, not dataset's
            eval_stats = _encode_eval_dataset(out / EVAL_DATASET_SPLIT, evaluated, eval_path,
                                              tokenizer, num_proc)
        except ValueError as exc:
            raise FieldError("eval_dataset", str(exc)) from exc
    lengths = [length for part in parts for length in part.encoded[_TOKENS]]
    skipped: dict[str, int] = {}
    for part in parts:
        for reason, count in part.skipped.items():
            skipped[reason] = skipped.get(reason, 0) + count
    longest = sorted((row for part in parts for row in part.longest),
                     key=lambda row: row["tokens"], reverse=True)[:LONGEST_SKIPPED]
    return {
        "eval_dataset": eval_stats,
        "dataset": config.dataset if not config.mixture else _what(config),
        **({"row_format": row_kind(parts[0].read_as)} if not config.mixture else {}),
        "rows_read": sum(len(part.raw.rows) for part in parts),
        "rows_kept": sum(len(part.encoded) for part in parts),
        "skipped_rows": sum(skipped.values()),
        "skipped_rows_by_reason": skipped,
        "longest_skipped_rows": longest,
        "train_rows": len(train),
        "eval_rows": len(held_out),
        "train_examples": examples["train"],
        "eval_examples": examples["eval"],
        "packing": config.packing,
        "seq_len": config.seq_len,
        "tokens": {"total": int(sum(lengths)), "train": _tokens(train), "eval": _tokens(held_out),
                   "longest_example": max(lengths, default=0)},
        "tokens_per_epoch": _tokens(train),
        "length_histogram": length_histogram(lengths, config.seq_len),
        **({"sources": sources} if sources is not None else {}),
    }


def _source_stats(part: EncodedSource, available: int, drawn: int, held_out: datasets.Dataset,
                  train_examples: int) -> dict[str, Any]:
    """A mixture's source in the statistics: what it asked (weight or rows), its rows read,
    kept and skipped, the training rows it had, the examples drawn and their share."""
    source = part.source
    return {
        "name": source.name, "index": source.index, "weight": source.weight,
        "rows": source.rows, **part.counts(),
        "train_rows_available": available, "train_examples": drawn,
        "repeated": drawn > available, "share": drawn / train_examples if train_examples else 0,
        "eval_examples": len(held_out), "tokens_eval": _tokens(held_out),
    }


def _encode_eval_dataset(out: Path, config: TrainConfig, local_path: Path | None,
                         tokenizer: Any, num_proc: int) -> dict[str, Any]:
    """The eval_dataset encoded with the same function, one example a row, written to `out`;
    its statistics. Rows it cannot use are skipped (or fail) as the training data's are."""
    raw = load_rows(config, local_path)
    rows, skipped, _ = tokenize(raw, tokenizer, config, num_proc)
    if not len(rows):
        raise ValueError(f"eval_dataset {config.dataset} has no usable rows"
                         + (f" ({_first_problem(raw, config)})" if skipped else ""))
    tokens = rows[_TOKENS]
    rows = rows.remove_columns(_TOKENS)
    if REJECTED_IDS in rows.column_names:  # DPO: its eval loss is the chosen responses', too
        rows = rows.remove_columns([REJECTED_IDS, REJECTED_LABELS])
    rows.save_to_disk(str(out))
    return {"dataset": config.dataset, "rows_read": len(raw.rows), "rows_kept": len(rows),
            "skipped_rows_by_reason": skipped, "tokens": int(sum(tokens))}


def check_template(config: TrainConfig, tokenizer: Any) -> None:
    """Conversations (messages_field, as row_format found it) and prompt_template=chat need a
    tokenizer with a chat template."""
    if config.messages_field and not tokenizer.chat_template:
        raise ValueError(
            f"dataset {config.dataset} holds conversations (column {config.messages_field!r}), "
            f"rendered with the tokenizer's chat template, and tokenizer {config.tokenizer} has "
            "none: give a tokenizer with a chat template")
    if config.prompt_template == "chat" and not tokenizer.chat_template:
        raise ValueError(
            f"prompt_template=chat but tokenizer {config.tokenizer} has no chat template: use "
            "prompt_template=instruction or a tokenizer with a chat template")


def _tokens(ds: datasets.Dataset) -> int:
    """The tokens of a split's rows. A split taken by train_test_split or select is its table
    and a mapping of the rows it keeps (`_indices`, which `datasets` keeps in that private
    field): the lengths are taken through it, not over the whole table (which counted every
    row of the data set in both splits), without copying the token lists."""
    import pyarrow.compute as pc

    lengths = pc.list_value_length(ds.data.column("input_ids"))
    indices = getattr(ds, "_indices", None)
    if indices is not None:
        lengths = lengths.take(indices.column(0))
    return int(pc.sum(lengths).as_py() or 0)


def length_histogram(lengths: list[int], seq_len: int) -> dict[str, int]:
    """Example lengths in power-of-two bins up to seq_len: {"<=16": n, ...}."""
    edges, edge = [], 16
    while edge < seq_len:
        edges.append(edge)
        edge *= 2
    edges.append(seq_len)
    counts = dict.fromkeys((f"<={e}" for e in edges), 0)
    for length in lengths:
        counts[f"<={edges[min(bisect.bisect_left(edges, length), len(edges) - 1)]}"] += 1
    return counts


def _first_problem(raw: RawRows, config: TrainConfig) -> str:
    """The first bad row and what is wrong with it (checks fields only: no tokenizing)."""
    columns = row_columns(config)
    for index, row in enumerate(raw.rows):
        problem = (row[_PROBLEM], row[_DETAIL]) if row.get(_PROBLEM) else \
            field_problem(columns, row)
        if problem is not None:
            return f"first: {raw.where(index, row)}: {problem[1]}"
    return f"every row is longer than seq_len {config.seq_len} or has no token to learn"


def load_prepared(path: str | Path, unpacked_eval: bool = False
                  ) -> tuple[datasets.Dataset, datasets.Dataset, dict[str, Any]]:
    """(train, eval, statistics) of a prepared set, memory-mapped: nothing is tokenized.
    unpacked_eval: the eval split's examples one a row, also when the training packs them."""
    import datasets

    path = Path(path)
    if not (path / STATS_FILE).is_file():
        raise ValueError(f"prepared_data {str(path)!r} is no prepared data set (no {STATS_FILE}); "
                         "the prepare_data stage writes one")
    stats = json.loads((path / STATS_FILE).read_text())
    eval_split = EVAL_EXAMPLES_SPLIT if unpacked_eval and stats["packing"] else EVAL_SPLIT
    return (datasets.load_from_disk(str(path / TRAIN_SPLIT)),
            datasets.load_from_disk(str(path / eval_split)), stats)


def load_eval_dataset(path: str | Path) -> datasets.Dataset:
    """The prepared set's eval_dataset split (one example a row), memory-mapped; ValueError when
    the set was prepared without an eval_dataset."""
    import datasets

    split = Path(path) / EVAL_DATASET_SPLIT
    if not split.is_dir():
        raise ValueError(f"prepared_data {str(path)!r} holds no {EVAL_DATASET_SPLIT} split: it "
                         "was prepared without eval_dataset (prepare_data encodes it when set)")
    return datasets.load_from_disk(str(split))
