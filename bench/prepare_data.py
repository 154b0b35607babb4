"""Benchmark of the data path: prepare (1 core and all), validate, the trainer's data start.

python -m bench.prepare_data [--rows 100000 1000000]

For each size, generated demo-style instruction rows (trainer/demo/make_data.py) are written to a
temporary jsonl, then timed: validate_params on them; the prepare_data stage's work with one
process and with all this machine's cores (a cold key each); the same prepare again (the cache
hit a second identical run gets); the trainer's data start (build_splits on the prepared set,
memory-mapped, what every rank does). Figures are wall-clock seconds on this machine; on a shared
machine they are noisy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


def _timed(fn):
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def bench(rows: int, work: Path) -> Iterator[tuple[str, float]]:
    """(figure, seconds), each as soon as it is measured (a run stopped midway keeps them)."""
    from finetune_data.prepared_set import cpu_count, prepare

    from finetune.validate import validate_params
    from trainer.config import load_config
    from trainer.data import build_splits
    from trainer.demo.make_data import make_rows

    data = work / f"rows-{rows}.jsonl"
    with open(data, "w") as f:
        for row in make_rows(rows, 0):
            f.write(json.dumps(row) + "\n")
    # Imported first (torch through AutoTokenizer): the figures leave import time out.
    from finetune_contract.transformers_import import AutoTokenizer  # noqa: F401

    seconds, _ = _timed(lambda: validate_params(
        {"dataset": str(data), "output_dir": str(work / "runs")}, run_id=f"bench{rows}"))
    yield "validate_s", seconds
    config = load_config(None, {"dataset": str(data), "output_dir": str(work / "out")})
    cores = cpu_count()
    seconds, _ = _timed(lambda: prepare(config, work / "p1", 1, log=_quiet))
    yield "prepare_1_core_s", seconds
    # A new mtime: a new key, and no reuse of the rows `datasets` cached for the first prepare.
    os.utime(data, (time.time() + 10, time.time() + 10))
    seconds, stats = _timed(lambda: prepare(config, work / "pn", cores, log=_quiet))
    yield f"prepare_{cores}_cores_s", seconds
    seconds, _ = _timed(lambda: prepare(config, work / "pn", log=_quiet))
    yield "prepare_cache_hit_s", seconds
    prepared = dataclasses.replace(config, prepared_data=stats["path"])
    seconds, splits = _timed(lambda: build_splits(prepared))
    assert len(splits.train) == stats["train_rows"]
    yield "trainer_data_start_s", seconds


def _quiet(_: str) -> None:
    pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    args = parser.parse_args(argv)
    import datasets

    datasets.disable_progress_bars()
    for rows in args.rows:
        with tempfile.TemporaryDirectory(prefix="bench-data-") as work:
            for name, seconds in bench(rows, Path(work)):
                print(f"rows {rows}: {name} {seconds:.2f}", flush=True)


if __name__ == "__main__":
    main()
