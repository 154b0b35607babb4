"""The prepare_data stage's decision on the Airflow side: the prepared statistics fail a run
whose skipped share is over max_skipped_fraction (naming the count and the longest rows), and
give a run that goes on its prepared set and the plan's split sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.config import ConfigError
from finetune.prepare_data import RUN_RECORD, prepare_run_data
from finetune.validate import validate_params
from tests.support.training import demo_rows, write_jsonl


def dataset_with_long_rows(tmp_path: Path, long_rows: int) -> Path:
    rows = demo_rows(100 - long_rows) + [{"prompt": "word " * (300 + i), "response": "x"}
                                         for i in range(long_rows)]
    return write_jsonl(tmp_path / "rows.jsonl", rows)


def test_too_many_skipped_rows_fail_the_run_naming_count_and_longest_rows(tmp_path):
    data = dataset_with_long_rows(tmp_path, 30)
    cfg = validate_params({"dataset": str(data), "output_dir": str(tmp_path / "runs")},
                          run_id="manual__skips")
    with pytest.raises(ConfigError) as raised:
        prepare_run_data(cfg, num_proc=1)
    (field, message), = raised.value.errors
    assert field == "max_skipped_fraction"
    assert "30 of 100 rows" in message and "30 too_long" in message
    assert "rows.jsonl line 100 (" in message and "raise max_skipped_fraction" in message


def test_a_raised_threshold_lets_the_run_go_on_with_its_prepared_set_and_counted_split(tmp_path):
    data = dataset_with_long_rows(tmp_path, 30)
    cfg = validate_params({"dataset": str(data), "output_dir": str(tmp_path / "runs"),
                           "max_skipped_fraction": 0.5, "max_steps": 0, "epochs": 2.0},
                          run_id="manual__raised")
    prepared, record = prepare_run_data(cfg, num_proc=1)
    assert Path(prepared.prepared_data, "stats.json").is_file()
    assert prepared.counted_train_rows == record["train_rows"] == 70 - record["eval_rows"]
    assert prepared.counted_batches_per_epoch == record["train_rows"] // cfg.micro_batch
    saved = json.loads((Path(cfg.run_dir) / RUN_RECORD).read_text())
    assert saved["cache_hit"] is False and saved["skipped_rows"] == 30
    again, record = prepare_run_data(cfg, num_proc=1)
    assert record["cache_hit"] and again.prepared_data == prepared.prepared_data
