"""Several data sets in one run: the `mixture` parameter's sources, parsed and checked (every
problem named by the source's index and key, as `mixture[1].response_field`), each source's
TrainConfig (the run's, with the source's own data fields), and how many training examples each
source gives.

A source is a JSON object: its `dataset`, one of `weight` (its share of the weighted sources'
training examples; 1 when neither is given) or `rows` (exactly that many training examples), an
optional `name` (the report's, the eval loss's and MLflow's; by default the data set's file or
hub name), and any of SOURCE_FIELDS, which otherwise take the run's values. Each of those is
checked by its own parameter's rule (finetune_contract.parameters): one rule, one place.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from finetune_contract.fields import Text, quoted
from finetune_contract.parameters import BY_NAME
from finetune_contract.train_config import TrainConfig

Problems = list[tuple[str, str]]
# What a source may set for itself; the run's values otherwise.
SOURCE_FIELDS = ("dataset", "dataset_format", "dataset_split", "text_field", "prompt_field",
                 "response_field", "messages_field", "prompt_template", "chosen_field",
                 "rejected_field")
WEIGHT, ROWS, NAME = "weight", "rows", "name"
SOURCE_KEYS = ("dataset", WEIGHT, ROWS, NAME, *SOURCE_FIELDS[1:])
# A source's name: a file, an MLflow metric and a report's row carry it.
NAME_TEXT = Text(64, r"[A-Za-z0-9][A-Za-z0-9_.-]*", "a name of letters, digits, '_', '.' and "
                 "'-', starting with a letter or digit")


@dataclass(frozen=True)
class Source:
    """One data set of a mixture."""

    index: int  # its place in the list, from 0, as messages name it: mixture[index]
    name: str
    fields: Mapping[str, str]  # the SOURCE_FIELDS it sets
    weight: float | None  # None for a source given `rows`
    rows: int | None

    @property
    def where(self) -> str:
        return f"mixture[{self.index}]"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **self.fields, WEIGHT: self.weight, ROWS: self.rows}


def parse_mixture(text: str | None) -> tuple[list[Source], Problems]:
    """The sources of a `mixture` value ([] when it is empty) and every problem found in it."""
    if not text or not text.strip():
        return [], []
    try:
        items = json.loads(text)
    except ValueError as error:
        return [], [("mixture", f"is not JSON ({error}): give a JSON list of sources, e.g. "
                     '[{"dataset": "a.jsonl", "weight": 2}, {"dataset": "b.jsonl"}]')]
    if not isinstance(items, list) or not items:
        what = "an empty list" if isinstance(items, list) else f"a JSON {type(items).__name__}"
        return [], [("mixture", f"is {what}: give a JSON list of one or more sources, each an "
                     'object such as {"dataset": "a.jsonl", "weight": 2}')]
    sources: list[Source] = []
    problems: Problems = []
    names: dict[str, int] = {}
    for index, item in enumerate(items):
        where = f"mixture[{index}]"
        if not isinstance(item, dict):
            problems.append((where, f"is a JSON {type(item).__name__}, not an object with a "
                             "dataset and a weight or rows"))
            continue
        found = _source_problems(where, item)
        problems += found
        if found:
            continue
        name = item.get(NAME) or _name_of(item["dataset"], index)
        if name in names:
            if NAME in item:
                problems.append((f"{where}.name", f"{quoted(name)} is also "
                                 f"mixture[{names[name]}]'s name: give each source its own"))
                continue
            name = f"{name[:60]}-{index}"
        names[name] = index
        rows = item.get(ROWS)
        sources.append(Source(
            index=index, name=name,
            fields={key: item[key].strip() for key in SOURCE_FIELDS if key in item},
            weight=None if rows is not None else float(item.get(WEIGHT, 1.0)), rows=rows))
    return sources, problems


def _source_problems(where: str, item: dict[str, Any]) -> Problems:
    problems: Problems = []
    for key in item:
        if key not in SOURCE_KEYS:
            problems.append((f"{where}.{key}", "is not a key of a source; a source has: "
                             + ", ".join(SOURCE_KEYS)))
    if "dataset" not in item:
        problems.append((f"{where}.dataset", "is missing: each source names its data set"))
    for key in SOURCE_FIELDS:
        if key in item:
            parameter = BY_NAME[key]
            value = item[key].strip() if isinstance(item[key], str) else item[key]
            problem = parameter.type_problem(value) or parameter.problem(value)
            if problem:
                problems.append((f"{where}.{key}", problem))
    weight, rows = item.get(WEIGHT), item.get(ROWS)
    if WEIGHT in item and ROWS in item:
        problems.append((f"{where}.rows", "and weight are both given: give a weight (a share "
                         "of the training examples) or rows (how many), not both"))
    if WEIGHT in item and (isinstance(weight, bool) or not isinstance(weight, int | float)
                           or not math.isfinite(weight) or weight <= 0):
        problems.append((f"{where}.weight", f"must be a positive number, got {quoted(weight)}"))
    if ROWS in item and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
        problems.append((f"{where}.rows", f"must be a positive integer (training examples "
                         f"drawn from this source), got {quoted(rows)}"))
    if NAME in item:
        name = item[NAME]
        problem = (None if isinstance(name, str) and name else "must be a non-empty string") \
            or NAME_TEXT.problem(name, quoted(name))
        if problem:
            problems.append((f"{where}.name", problem))
    return problems


def _name_of(dataset: str, index: int) -> str:
    """A source's default name: its file's or directory's name without the extension, or the
    hub data set's name."""
    last = dataset.rstrip("/").rsplit("/", 1)[-1]
    stem = last.split(".", 1)[0] if "." in last[1:] else last
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", stem).lstrip("._-")[:60]
    return name or f"source{index}"


def mixture_sources(text: str | None) -> list[Source]:
    """The sources of a `mixture` value; ValueError naming every problem."""
    sources, problems = parse_mixture(text)
    if problems:
        raise ValueError("; ".join(f"{field}: {message}" for field, message in problems))
    return sources


def source_config(cfg: TrainConfig, source: Source) -> TrainConfig:
    """The config one source is read and encoded with: the run's, with the source's fields."""
    return dataclasses.replace(cfg, mixture=None, **source.fields)


def with_source_datasets(text: str, locate: Any) -> str:
    """The mixture's JSON with each source's `dataset` as `locate` gives it (a path resolved
    where it is read); the text as it is when it is not a mixture this module can read."""
    try:
        items = json.loads(text)
    except ValueError:
        return text
    if not isinstance(items, list):
        return text
    return json.dumps([{**item, "dataset": locate(item["dataset"])}
                       if isinstance(item, dict) and isinstance(item.get("dataset"), str)
                       else item for item in items])


def mixture_counts(available: Sequence[int], sources: Sequence[Source]) -> list[int]:
    """The training examples each source gives, from the rows each has for training: a source
    with `rows` gives exactly that many (its rows repeated, each pass in another order, when it
    has fewer); the weighted sources give shares in proportion to their weights, as many as
    they can without repeating a row, so the first to run out bounds them all."""
    counts = [source.rows or 0 for source in sources]
    weighted = [i for i, source in enumerate(sources) if source.rows is None]
    if weighted:
        total = sum(sources[i].weight for i in weighted)
        size = min(available[i] * total / sources[i].weight for i in weighted)
        for i in weighted:
            counts[i] = min(available[i], round(size * sources[i].weight / total))
    return counts
