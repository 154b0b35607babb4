"""A run's history as every reader counts it: history.jsonl with the nodes' records of notices
that came before a round's first step (finetune_contract.run_history), from a run directory on a
path or on S3; a notice that reached several nodes in one start-up is one preemption."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from finetune.outputs import build_report, run_history
from finetune_contract.run_history import preemptions, startup_notice_file, with_startup_notices

# Round 1 trains from 15 and is preempted at step 6 (its notice at 24, saved by 26); round 2's
# processes start at 30 and a notice reaches its two nodes at 33, before its first step.
START = {"event": "start", "time": 15.0, "started": 10.0, "nodes": 2, "world_size": 2,
         "resumed_from_step": None, "load_s": 0.0, "lost_steps": 0, "lost_s": 0.0}
SAVED = {"event": "preempted", "step": 6, "notice": 24.0, "time": 26.0, "save_s": 3.0}


def notice(node: str, at: float, started: float | None, ended: float | None = None) -> str:
    """A node's record of a notice before its round's first step, as trainer.launch writes it."""
    return json.dumps({"event": "preempted", "step": None, "notice": at, "time": ended or at + 1,
                       "save_s": 0.0, "before_first_step": True, "node": node,
                       "started": started})


def test_a_notice_before_the_first_step_is_a_preemption_placed_by_its_time():
    history = [START, SAVED, {"event": "end", "step": 10, "time": 60.0}]
    merged = with_startup_notices(history, [notice("worker-1", 33.0, started=30.0)])
    assert [e["event"] for e in merged] == ["start", "preempted", "preempted", "end"]
    [_, startup] = preemptions(merged)
    assert startup["before_first_step"] and startup["step"] is None
    assert startup["notice"] == 33.0 and startup["save_s"] == 0.0
    assert startup["nodes"] == ["worker-1"]
    assert with_startup_notices(history, []) == history


def test_the_nodes_one_start_up_notice_reached_are_one_preemption_and_a_later_round_another():
    records = [notice("worker-1", 33.0, started=30.0), notice("worker-0", 33.4, started=30.2),
               # round 3's processes started after round 2's notice: a preemption of its own
               notice("worker-0", 52.0, started=40.0)]
    noticed = preemptions(with_startup_notices([START], records))
    assert [(e["notice"], e["nodes"]) for e in noticed] == [
        (33.0, ["worker-0", "worker-1"]), (52.0, ["worker-0"])]
    assert noticed[0]["time"] == 34.4  # its last node's exit


def test_a_record_torn_or_not_of_a_start_up_notice_is_skipped_and_one_without_start_counts_alone():
    records = ['{"event": "preempted", "notice"', json.dumps({**json.loads(notice(
        "worker-1", 33.0, 30.0)), "before_first_step": False}), "[]",
        notice("worker-1", 33.0, started=None), notice("worker-0", 33.2, started=None)]
    assert len(preemptions(with_startup_notices([], records))) == 2


def test_each_node_and_notice_has_a_file_of_its_own():
    first = json.loads(notice("0 (host-a)", 33.0, 30.0))
    assert startup_notice_file(first) == "notices/0_host-a-33000.json"
    assert startup_notice_file({**first, "node": "1 (host-a)"}) != startup_notice_file(first)
    assert startup_notice_file({**first, "notice": 52.0}) != startup_notice_file(first)


def test_a_run_directory_on_a_path_counts_the_nodes_notices(tmp_path: Path):
    (tmp_path / "history.jsonl").write_text(
        "\n".join(json.dumps(e) for e in (START, SAVED)) + "\n")
    (tmp_path / "notices").mkdir()
    (tmp_path / "notices" / "worker-1-33000.json").write_text(notice("worker-1", 33.0, 30.0))
    assert len(preemptions(run_history(str(tmp_path), lambda: None))) == 2
    # a run preempted before its first round's first step has no history.jsonl at all
    (tmp_path / "history.jsonl").unlink()
    assert len(preemptions(run_history(str(tmp_path), lambda: None))) == 1


def test_an_s3_run_directory_counts_the_nodes_notices_and_its_report_too(s3: tuple[Any, str]):
    client, bucket = s3
    run_dir = f"s3://{bucket}/runs/r1"
    resumed = {**START, "time": 40.0, "started": 36.0, "resumed_from_step": 6}
    history = [START, SAVED, resumed, {"event": "end", "step": 10, "time": 44.0}]
    client.put_object(Bucket=bucket, Key="runs/r1/history.jsonl",
                      Body="\n".join(json.dumps(e) for e in history) + "\n")
    client.put_object(Bucket=bucket, Key="runs/r1/notices/worker-1-33000.json",
                      Body=notice("worker-1", 33.0, started=30.0))
    assert [e.get("before_first_step", False)
            for e in preemptions(run_history(run_dir, lambda: client))] == [False, True]

    summary = build_report(run_dir, lambda: client, run_id="r1", status="success", config={},
                           stages={"train": {"started": 0.0, "ended": 100.0, "nodes": 2}})
    assert summary["metrics"]["preemptions"] == 2
    report = json.loads(client.get_object(Bucket=bucket, Key="runs/r1/report.json")["Body"]
                        .read())
    assert [x["kind"] for x in report["goodput"]["interruptions"]] == ["preempted", "preempted"]
