"""The prepare_data stage's decision on the Airflow side: the prepared statistics fail a run
whose skipped share is over max_skipped_fraction (naming the count and the longest rows), and
give a run that goes on its prepared set and the plan's split sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.config import ConfigError
from finetune.prepare_stage import RUN_RECORD, prepare_run_data
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
    per_rank = record["train_rows"] // cfg.world_size
    assert prepared.counted_batches_per_epoch == per_rank // cfg.micro_batch
    saved = json.loads((Path(cfg.run_dir) / RUN_RECORD).read_text())
    assert saved["cache_hit"] is False and saved["skipped_rows"] == 30
    again, record = prepare_run_data(cfg, num_proc=1)
    assert record["cache_hit"] and again.prepared_data == prepared.prepared_data


def test_the_report_and_the_runs_page_show_the_data_statistics_and_the_cache_hit(tmp_path):
    from finetune.report import write_report
    from finetune.runs_page import _row, render_runs_table

    record = {"path": "/p/abc", "cache_hit": True, "seconds": 0.4, "rows_read": 100,
              "rows_kept": 90, "skipped_rows": 10, "skipped_rows_by_reason": {"too_long": 10},
              "longest_skipped_rows": [{"where": "d.jsonl line 7", "tokens": 900,
                                        "reason": "too_long"}],
              "train_rows": 80, "eval_rows": 10, "tokens_per_epoch": 4000,
              "length_histogram": {"<=16": 50, "<=32": 40},
              "eval_dataset": {"dataset": "/d/held.jsonl", "rows_read": 31, "rows_kept": 30,
                               "skipped_rows_by_reason": {"empty": 1}, "tokens": 900}}
    (tmp_path / RUN_RECORD).write_text(json.dumps(record))
    report = write_report(tmp_path, run_id="r", status="success", config={})
    assert report["data"]["cache_hit"] is True and report["data"]["rows_kept"] == 90
    html = (tmp_path / "report.html").read_text()
    assert "<h2>Data</h2>" in html and "reused (cache hit)" in html
    assert "d.jsonl line 7" in html and "examples of &lt;=32 tokens" in html
    assert "/d/held.jsonl: 30 of 31 rows kept" in html
    table = render_runs_table([_row("r", str(tmp_path), report, True, 0.0, "success")])
    assert "90 of 100 rows" in table and "10 skipped; cache hit" in table


def test_on_an_s3_output_dir_the_set_is_uploaded_whole_and_a_second_run_finds_it(s3, tmp_path):
    import dataclasses

    client, bucket = s3
    data = write_jsonl(tmp_path / "rows.jsonl", demo_rows(120))
    cfg = validate_params({"dataset": str(data), "output_dir": str(tmp_path / "runs")},
                          run_id="manual__s3")
    cfg = dataclasses.replace(cfg, output_dir=f"s3://{bucket}/runs",
                              run_dir=f"s3://{bucket}/runs/{cfg.run_name}")
    prepared, record = prepare_run_data(cfg, s3_client=lambda: client, num_proc=1)
    assert not record["cache_hit"]
    prefix = prepared.prepared_data.removeprefix(f"s3://{bucket}/") + "/"
    assert prefix.startswith("runs/prepared_data/")
    keys = {o["Key"][len(prefix):] for o in
            client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]}
    assert {"stats.json", "train/state.json", "eval/state.json"} <= keys
    saved = client.get_object(Bucket=bucket, Key=f"runs/{cfg.run_name}/{RUN_RECORD}")
    assert json.loads(saved["Body"].read())["rows_read"] == 120
    again, record = prepare_run_data(cfg, s3_client=lambda: client, num_proc=1)
    assert record["cache_hit"] and again.prepared_data == prepared.prepared_data
