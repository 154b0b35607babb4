"""A failed run says why: the report's `error` (stage, type, message, rank), its HTML section,
the runs page's status cell; and the validate task's table never shows a secret's value."""

from __future__ import annotations

import json

from markupsafe import escape

from finetune.report import write_report
from finetune.runs_page import list_runs, render_runs_page
from finetune.validate import config_table, validate_params
from finetune_contract.errors import error_file, error_record, root_cause

CAUSE = "text_field='body' is not a column of /data/rows.jsonl (columns: prompt, response)"


def test_a_failed_report_carries_the_root_cause_and_shows_it(tmp_path):
    run = tmp_path / "runs" / "r1"
    (run / "errors").mkdir(parents=True)
    record = error_record(ValueError(CAUSE), rank=1)
    (run / error_file(1)).write_text(json.dumps(record))
    error = root_cause([(run / error_file(1)).read_text()])
    report = write_report(run, run_id="r1", status="failed", config={}, error=error)
    assert report["error"] == {"stage": "train", "type": "ValueError", "message": CAUSE,
                               "rank": 1}
    page = (run / "report.html").read_text()
    assert "Why it failed" in page and escape("text_field='body'") in page
    rows = list_runs([tmp_path / "runs"])
    html = render_runs_page(rows, [tmp_path / "runs"])
    assert escape("train: ValueError: text_field='body' is not a column") in html


def test_the_earliest_record_is_the_root_cause_and_torn_ones_are_skipped():
    first = error_record(ValueError("the cause"), rank=3)
    later = {**error_record(RuntimeError("a peer died"), rank=0), "time": first["time"] + 5}
    assert root_cause([json.dumps(later), "{torn", json.dumps(first)])["message"] == "the cause"
    assert root_cause([]) is None


def test_the_validate_log_table_shows_each_value_and_hides_secrets():
    cfg = validate_params({"procs_per_node": 1, "max_steps": 7, "rdzv_endpoint": "[::1]:2379"},
                          run_id="r")
    table = config_table(cfg)
    assert [line.split() for line in table.splitlines() if " max_steps " in line] == [
        ["max_steps", "7", "this", "run"]]
    assert "[::1]:2379" not in table and "(set, not shown)" in table
