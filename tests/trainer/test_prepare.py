"""The prepare_data stage's work (finetune_data.prepare): encoded once, content-addressed,
reused, safe against a concurrent prepare and a failure; and the trainer's start that only
loads it."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from finetune_data import prepare as prep

from tests.support.training import demo_rows, write_jsonl
from trainer.config import load_config


def config_for(dataset: Path, out: Path, **changes):
    return load_config(None, {"dataset": str(dataset), "output_dir": str(out), **changes})


def sets_in(root: Path) -> list[str]:
    """Every entry of the prepared root: complete sets and anything half-written."""
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_a_second_identical_prepare_is_a_cache_hit_and_a_changed_source_is_not(tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", demo_rows(300))
    config, root = config_for(data, tmp_path / "out"), tmp_path / "prepared"
    first = prep.prepare(config, root, num_proc=2)
    assert not first["cache_hit"] and first["rows_read"] == 300 == first["rows_kept"]
    assert first["train_rows"] + first["eval_rows"] == 300
    assert first["tokens_per_epoch"] == first["tokens"]["train"] > 0
    assert sum(first["length_histogram"].values()) == 300
    written = {p: p.stat().st_mtime_ns for p in Path(first["path"]).rglob("*")}
    said: list[str] = []
    second = prep.prepare(config, root, log=said.append)
    assert second["cache_hit"] and second["path"] == first["path"]
    assert "cache hit" in said[0] and "nothing encoded" in said[0]
    assert {p: p.stat().st_mtime_ns for p in Path(first["path"]).rglob("*")} == written
    # another seq_len, or a changed file: another key, prepared anew
    assert not prep.prepare(config_for(data, tmp_path / "out", seq_len=64), root)["cache_hit"]
    write_jsonl(data, demo_rows(301))
    changed = prep.prepare(config, root)
    assert not changed["cache_hit"] and changed["rows_read"] == 301
    assert len(sets_in(root)) == 3 and not [n for n in sets_in(root) if n.startswith(".")]


def test_two_runs_preparing_one_key_at_once_leave_one_whole_set(tmp_path):
    # Two preparers started together (threads: the race is the file system's, os.rename's):
    # both encode, the first rename wins, the other finds the set and reuses it.
    data = write_jsonl(tmp_path / "rows.jsonl", demo_rows(2000))
    root, config = tmp_path / "prepared", config_for(data, tmp_path / "out")
    start = threading.Barrier(2)

    def run(_: int) -> dict:
        start.wait()
        return prep.prepare(config, root, num_proc=1)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, range(2)))
    assert results[0]["path"] == results[1]["path"] and sets_in(root) == [results[0]["key"]]
    paths = [results[0]["path"]]
    train, held_out, stats = prep.load_prepared(paths[0])
    assert len(train) + len(held_out) == 2000 == stats["rows_kept"]


def test_a_bad_row_with_bad_rows_error_names_file_and_line_and_leaves_no_set(tmp_path):
    rows = demo_rows(50)
    rows[36] = {"prompt": "word " * 400, "response": "x"}
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    root = tmp_path / "prepared"
    with pytest.raises(ValueError, match=r"rows.jsonl line 37: \d+ tokens, more than seq_len"):
        prep.prepare(config_for(data, tmp_path / "out", bad_rows="error"), root, num_proc=1)
    assert sets_in(root) == []


def test_a_tokenizer_failing_on_a_row_names_it_and_leaves_no_set(tmp_path, monkeypatch):
    import transformers

    rows = demo_rows(40)
    rows[9] = {"prompt": "BOOM", "response": "x"}
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    real = transformers.AutoTokenizer.from_pretrained

    def failing(*args, **kwargs):
        tokenizer = real(*args, **kwargs)
        call = type(tokenizer).__call__

        class Failing(type(tokenizer)):
            def __call__(self, text, *a, **k):
                if "BOOM" in text:
                    raise RuntimeError("cannot encode this")
                return call(self, text, *a, **k)

        tokenizer.__class__ = Failing
        return tokenizer

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", failing)
    root = tmp_path / "prepared"
    with pytest.raises(ValueError, match="rows.jsonl line 10: encoding failed: RuntimeError: "
                                         "cannot encode this"):
        prep.prepare(config_for(data, tmp_path / "out"), root, num_proc=1)
    assert sets_in(root) == []


def test_skipped_rows_are_counted_by_reason_with_the_longest_named(tmp_path):
    rows = demo_rows(100) + [{"prompt": "word " * (200 + i), "response": "x"} for i in range(3)]
    rows.append({"prompt": "no response"})
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    stats = prep.prepare(config_for(data, tmp_path / "out"), tmp_path / "prepared")
    assert stats["skipped_rows_by_reason"] == {"too_long": 3, "missing_field": 1}
    longest = stats["longest_skipped_rows"]
    assert longest[0]["where"].endswith("rows.jsonl line 103") and longest[0]["tokens"] > 200
    assert [row["tokens"] for row in longest[:3]] == sorted(
        [row["tokens"] for row in longest[:3]], reverse=True)


def test_the_trainer_loads_the_prepared_set_and_never_encodes(tmp_path, monkeypatch):
    import finetune_contract.data
    from trainer.data import build_splits

    data = write_jsonl(tmp_path / "rows.jsonl", demo_rows(200))
    stats = prep.prepare(config_for(data, tmp_path / "out", packing=True), tmp_path / "prep")

    def no_encoding(*args, **kwargs):
        raise AssertionError("the trainer encoded a row")

    for name in ("encode_row", "encode_pair", "encode_example"):
        monkeypatch.setattr(finetune_contract.data, name, no_encoding)
        monkeypatch.setattr(prep, name, no_encoding, raising=False)
    config = config_for(data, tmp_path / "out", packing=True, prepared_data=stats["path"])
    splits = build_splits(config)
    assert len(splits.train) == stats["train_rows"] and "position_ids" in splits.train.column_names
    unpacked = build_splits(config, unpacked_eval=True).eval
    assert len(unpacked) == stats["eval_examples"]
    assert json.loads((Path(stats["path"]) / prep.STATS_FILE).read_text())["key"] == stats["key"]
