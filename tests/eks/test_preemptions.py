"""Nodes taken away while the run trains, on the emulated cluster (the test plays the training
operator and the trainer's history.jsonl in moto's S3): a notice's pods exit 138 and the
operator starts them again, and the same job goes on with the preemption counted; more
preemptions than max_preemptions fail the run naming them; an elastic run goes on with the
nodes it has while a lost node's pod waits for a node."""

from __future__ import annotations

import json
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowFailException

from finetune.targets.eks.launchers import pytorchjob_restarts, trainjob_restarts
from finetune_contract.run_history import HISTORY_FILE
from tests.support.eks import eks_config, jobs_of_run, target, train_beside
from tests.support.kube import add_nodes

# Whole training rounds played by the test as the operator would, each restart shown for a
# second so the stage's looks see it on a busy machine: several seconds a test.
pytestmark = pytest.mark.slow


def s3_run(s3: tuple[Any, str], **changes: Any) -> Any:
    """A run whose output is in the test's bucket, where the trainer's history goes."""
    _, bucket = s3
    cfg = eks_config(**changes)
    return eks_config(**changes, output_dir=f"s3://{bucket}/runs",
                      run_dir=f"s3://{bucket}/runs/{cfg.run_name}")


def recorder(s3: tuple[Any, str], cfg: Any) -> Any:
    """What rank 0 appends to history.jsonl when a notice's step is saved (trainer/history.py)."""
    client, bucket = s3
    key = f"{cfg.run_dir.removeprefix(f's3://{bucket}/')}/{HISTORY_FILE}"
    lines = [json.dumps({"event": "start", "time": 1.0, "nodes": cfg.nodes})]

    def preempted(round_: int) -> None:
        lines.append(json.dumps({"event": "preempted", "step": 10 * round_, "notice": 2.0,
                                 "time": 3.0, "save_s": 0.5}))
        client.put_object(Bucket=bucket, Key=key, Body="\n".join(lines) + "\n")
    return preempted


def test_a_preempted_job_is_retried_and_the_same_job_goes_on_with_the_preemption_counted(
        nodegroup, cluster, s3, task_log):
    cfg = s3_run(s3, nodes=2, max_preemptions=2)
    add_nodes(cluster, 2)
    trained, events = train_beside(cluster, cfg, preemptions=1,
                                   on_preempted=recorder(s3, cfg), hold_s=1.0)
    assert trained["preemptions"] == 1 and trained["adopted"] is False
    (job,) = jobs_of_run(cluster, cfg)  # the same job, not a new one
    assert job["metadata"]["name"] == trained["job"]
    assert "Restarting" in [e["state"] for e in events]
    assert any("was preempted: 1 of at most 2 (max_preemptions; counted from "
               f"{cfg.run_dir}/history.jsonl)" in line for line in task_log)


def test_a_run_preempted_more_than_max_preemptions_fails_naming_it_and_teardown_deletes_the_job(
        nodegroup, cluster, s3):
    cfg, t = s3_run(s3, nodes=2, max_preemptions=1), target()
    snap = t.snapshot(cfg)
    add_nodes(cluster, 2)
    with pytest.raises(AirflowFailException) as err:
        train_beside(cluster, cfg, preemptions=2, on_preempted=recorder(s3, cfg),
                     outcome="Running", hold_s=1.0)
    assert "was preempted 2 times, more than max_preemptions 1" in str(err.value)
    assert jobs_of_run(cluster, cfg)  # the job stays for teardown, which deletes it
    t.teardown(cfg, snap)
    assert jobs_of_run(cluster, cfg) == []


def test_restarts_no_notice_explains_count_against_max_restarts(nodegroup, cluster, s3):
    """ExitCode retries a pod killed by a signal (an OOM kill: 137) as it retries a saved
    notice, without end: restarts the history has no notice for are failures."""
    cfg = s3_run(s3, nodes=2, max_restarts=1)
    client, bucket = s3
    key = f"{cfg.run_dir.removeprefix(f's3://{bucket}/')}/{HISTORY_FILE}"
    client.put_object(Bucket=bucket, Key=key, Body=json.dumps(
        {"event": "start", "time": 1.0, "nodes": 2}) + "\n")
    add_nodes(cluster, 2)
    # each restart shown long enough for the stage's looks to see it on a busy machine
    with pytest.raises(AirflowFailException) as err:
        train_beside(cluster, cfg, preemptions=2, outcome="Running", hold_s=1.0)
    assert "was restarted 2 times without a notice's step saved" in str(err.value)
    assert "more than max_restarts 1" in str(err.value)


def test_a_notice_before_the_first_step_is_a_preemption_not_a_restart_without_one(
        nodegroup, cluster, s3, task_log):
    """A notice while the model loads: the node's pod exits 138 with nothing to save and rank 0
    writes no history, but the node records the notice beside it (trainer/launch.py)."""
    cfg = s3_run(s3, nodes=2)  # max_restarts 0: a restart no notice explains fails the run
    client, bucket = s3
    prefix = cfg.run_dir.removeprefix(f"s3://{bucket}/")

    def noticed_at_start_up(round_: int) -> None:
        client.put_object(Bucket=bucket, Key=f"{prefix}/notices/worker-1-2000.json",
                          Body=json.dumps({"event": "preempted", "step": None, "notice": 2.0,
                                           "time": 3.0, "save_s": 0.0,
                                           "before_first_step": True, "node": "worker-1",
                                           "started": 1.0}) + "\n")

    add_nodes(cluster, 2)
    trained, _ = train_beside(cluster, cfg, preemptions=1, on_preempted=noticed_at_start_up,
                              hold_s=1.0)
    assert trained["preemptions"] == 1
    assert any("was preempted: 1 of at most 10" in line for line in task_log)


def test_without_a_readable_history_the_jobs_restarts_are_counted(nodegroup, cluster):
    # an output on a volume the pods mount and this worker does not
    cfg = eks_config(nodes=2, max_preemptions=1, output_dir="/fsx/runs",
                     run_dir="/fsx/runs/manual", volumes="fsx:/fsx")
    add_nodes(cluster, 2)
    with pytest.raises(AirflowFailException) as err:
        train_beside(cluster, cfg, preemptions=2, outcome="Running", hold_s=1.0)
    assert "was preempted 2 times, more than max_preemptions 1 (counted from the restarts " \
        "of PyTorchJob" in str(err.value)


def test_an_elastic_run_goes_on_with_min_nodes_while_a_lost_nodes_pod_waits(
        nodegroup, cluster, task_log):
    cfg = eks_config(nodes=3, min_nodes=2, max_restarts=1, schedule_timeout_s=600)
    add_nodes(cluster, 2)
    trained, _ = train_beside(cluster, cfg, lost_workers=1)
    assert trained["job"]
    assert any("the training goes on with 2 of 3 nodes (min_nodes 2)" in line
               for line in task_log)


def test_an_elastic_run_below_min_nodes_fails_naming_the_schedulers_reason(nodegroup, cluster):
    cfg = eks_config(nodes=3, min_nodes=2, max_restarts=1, schedule_timeout_s=600)
    add_nodes(cluster, 1)
    with pytest.raises(AirflowFailException) as err:  # a verdict: no retry
        train_beside(cluster, cfg, lost_workers=2, outcome="Running")
    assert "2 pod(s)" in str(err.value) and "Insufficient nvidia.com/gpu" in str(err.value)


def test_each_launcher_shows_a_round_of_restarts_as_one_mark():
    restarting = {"status": {"conditions": [
        {"type": "Running", "status": "False"},
        {"type": "Restarting", "status": "True", "lastTransitionTime": "2026-11-29T10:01:00Z"}]}}
    assert pytorchjob_restarts(restarting, []) == {"Restarting since 2026-11-29T10:01:00Z"}
    assert pytorchjob_restarts({"status": {"conditions": [
        {"type": "Running", "status": "True"}]}}, []) == set()

    def pod(code: int, at: str) -> dict:
        return {"status": {"containerStatuses": [{"state": {"terminated": {
            "exitCode": code, "finishedAt": at}}}]}}

    # a TrainJob's pods replaced after a saved notice, all of one round at the same step's end
    assert trainjob_restarts({}, [pod(138, "2026-11-29T10:01:02Z"),
                                  pod(138, "2026-11-29T10:01:05Z"),
                                  pod(1, "2026-11-29T10:03:00Z")]) == {
        "exit 138 at 2026-11-29T10:01"}
