"""Benchmark of the data path: prepare (1 core and all), validate, the trainer's data start; for
conversations and for mixtures too.

python -m bench.prepare_data [--rows 100000 1000000]
python -m bench.prepare_data --kind conversations --rows 100000
python -m bench.prepare_data --kind mixture --rows 1000000 [--processes 2]

For each size, generated demo-style rows (trainer/demo/make_data.py's tasks) are written to
temporary jsonl files, then timed. `instructions` (the default): validate_params on them; the
prepare_data stage's work with one process and with all this machine's cores (a cold key each);
the same prepare again (the cache hit a second identical run gets); the trainer's data start
(build_splits on the prepared set, memory-mapped, what every rank does). `conversations`: rows of
four turns in OpenAI's messages shape (a user's question, the assistant's answer, twice),
rendered with the demo tokenizer's chat template, prepared with one process and with all cores.
`mixture`: three sources of a third of the rows each (instructions, those conversations, plain
text), mixed by weight, prepared with --processes processes (default: all cores). Figures are
wall-clock seconds on this machine; on a shared machine they are noisy.
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

KINDS = ("instructions", "conversations", "mixture")


def _timed(fn):
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def _write(path: Path, rows: Iterator[dict]) -> Path:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def conversation_rows(rows: int, seed: int) -> Iterator[dict]:
    """Conversations of four turns: two of the demo's questions, each with its answer."""
    from trainer.demo.make_data import make_rows

    pairs = make_rows(2 * rows, seed)
    for i in range(rows):
        yield {"messages": [message for prompt_response in pairs[2 * i:2 * i + 2] for message in (
            {"role": "user", "content": prompt_response["prompt"]},
            {"role": "assistant", "content": prompt_response["response"]})]}


def bench(rows: int, work: Path) -> Iterator[tuple[str, float]]:
    """(figure, seconds), each as soon as it is measured (a run stopped midway keeps them)."""
    from finetune_data.prepared_set import cpu_count, prepare

    from finetune.validate import validate_params
    from trainer.config import load_config
    from trainer.data import build_splits
    from trainer.demo.make_data import make_rows

    data = _write(work / f"rows-{rows}.jsonl", iter(make_rows(rows, 0)))
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


def bench_conversations(rows: int, work: Path) -> Iterator[tuple[str, float]]:
    """Conversations of four turns prepared with one process and with all cores."""
    from finetune_data.prepared_set import cpu_count, prepare

    from finetune_contract.transformers_import import AutoTokenizer  # noqa: F401
    from trainer.config import load_config

    data = _write(work / f"conversations-{rows}.jsonl", conversation_rows(rows, 0))
    config = load_config(None, {"dataset": str(data), "output_dir": str(work / "out")})
    seconds, stats = _timed(lambda: prepare(config, work / "p1", 1, log=_quiet))
    assert stats["row_format"] == "conversations" and stats["rows_kept"] == rows, stats
    yield "conversations_prepare_1_core_s", seconds
    cores = cpu_count()
    os.utime(data, (time.time() + 10, time.time() + 10))
    seconds, _ = _timed(lambda: prepare(config, work / "pn", cores, log=_quiet))
    yield f"conversations_prepare_{cores}_cores_s", seconds


def bench_mixture(rows: int, work: Path, processes: int | None) -> Iterator[tuple[str, float]]:
    """A mixture of three sources of rows/3 each (instructions, four-turn conversations, plain
    text), weighted by their sizes, prepared with `processes` processes."""
    from finetune_data.prepared_set import cpu_count, prepare

    from finetune_contract.transformers_import import AutoTokenizer  # noqa: F401
    from trainer.config import load_config
    from trainer.demo.make_data import make_rows

    third = rows // 3
    instructions = _write(work / "instructions.jsonl", iter(make_rows(third, 1)))
    chats = _write(work / "chats.jsonl", conversation_rows(third, 2))
    notes = _write(work / "notes.jsonl", ({"text": f"{row['prompt']} {row['response']}"}
                                          for row in make_rows(rows - 2 * third, 3)))
    mixture = [{"dataset": str(instructions), "weight": 1},
               {"dataset": str(chats), "weight": 1},
               {"dataset": str(notes), "text_field": "text", "weight": 1}]
    config = load_config(None, {"mixture": json.dumps(mixture), "output_dir": str(work / "out")})
    processes = processes or cpu_count()
    seconds, stats = _timed(lambda: prepare(config, work / "p", processes, log=_quiet))
    assert stats["rows_kept"] == rows and len(stats["sources"]) == 3, stats
    yield f"mixture_prepare_{processes}_processes_s", seconds


def _quiet(_: str) -> None:
    pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--kind", choices=KINDS, default="instructions")
    parser.add_argument("--processes", type=int, default=None,
                        help="mixture: the prepare's processes (default: all cores)")
    args = parser.parse_args(argv)
    import datasets

    datasets.disable_progress_bars()
    for rows in args.rows:
        with tempfile.TemporaryDirectory(prefix="bench-data-") as work:
            if args.kind == "mixture":
                figures = bench_mixture(rows, Path(work), args.processes)
            elif args.kind == "conversations":
                figures = bench_conversations(rows, Path(work))
            else:
                figures = bench(rows, Path(work))
            for name, seconds in figures:
                print(f"rows {rows}: {name} {seconds:.2f}", flush=True)


if __name__ == "__main__":
    main()
