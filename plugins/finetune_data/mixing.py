"""A mixture's prepared splits: the training examples drawn from each source (as many as
finetune_contract.mixture.mixture_counts says, the rows chosen from the run's seed) and mixed in
one order, and the held-out split kept per source, each example labelled with its source's index
(`source`) so the trainer measures the eval loss per source without reading anything else.

Pure functions on `datasets` tables; finetune_data.prepared_set encodes and splits each source
and calls them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import datasets

# The source's index (its place in the mixture) of each example of a mixture's splits.
SOURCE_COLUMN = "source"


def drawn_rows(available: int, count: int, seed: int, index: int) -> list[int]:
    """`count` of a source's `available` training rows, chosen from the run's seed and the
    source's index: without repeating a row while it has rows left, each further pass over
    them in another order."""
    rng = np.random.default_rng([seed, index])
    passes, rest = divmod(count, available)
    orders = [rng.permutation(available) for _ in range(passes)]
    if rest:
        orders.append(rng.permutation(available)[:rest])
    return np.concatenate(orders).tolist() if orders else []


def with_source(rows: datasets.Dataset, index: int) -> datasets.Dataset:
    """The rows, each labelled with its source's index. Labelled before they are split: a
    column added to rows selected from a table copies them (their indices are flattened)."""
    import datasets

    return rows.add_column(SOURCE_COLUMN, [index] * len(rows),
                           feature=datasets.Value("int32"))


def mixed_train(trains: list[datasets.Dataset], counts: list[int],
                seed: int) -> datasets.Dataset:
    """The training split of a mixture: from each source's training rows (labelled with it),
    its count of them (drawn_rows), shuffled together with the run's seed."""
    import datasets

    parts = [train.select(drawn_rows(len(train), count, seed, index))
             for index, (train, count) in enumerate(zip(trains, counts, strict=True))
             if count]
    return datasets.concatenate_datasets(parts).shuffle(seed=seed)


def held_out_by_source(held_outs: list[datasets.Dataset]) -> datasets.Dataset:
    """The held-out split of a mixture: each source's held-out rows (labelled with it), one
    source after the other, so each source's rows are one contiguous range."""
    import datasets

    return datasets.concatenate_datasets(held_outs)


def source_ranges(rows: datasets.Dataset) -> dict[int, range]:
    """Each source's contiguous range of a held-out split written by held_out_by_source; {}
    for a split without sources (one data set). ValueError when a source's rows are not
    contiguous (a split not written so)."""
    if SOURCE_COLUMN not in rows.column_names:
        return {}
    column = np.asarray(rows.data.column(SOURCE_COLUMN).to_numpy())
    ranges: dict[int, range] = {}
    starts = np.flatnonzero(np.r_[True, column[1:] != column[:-1]]) if len(column) else []
    ends = [*starts[1:], len(column)]
    for start, end in zip(starts, ends, strict=True):
        source = int(column[start])
        if source in ranges:
            raise ValueError(f"the held-out rows of source {source} are not contiguous")
        ranges[source] = range(int(start), int(end))
    return ranges
