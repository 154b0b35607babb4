"""The eks target's deferrable waits: the triggers run with asyncio against the emulator (and
moto), the operators are driven as Airflow drives them (execute, defer, the trigger's event into
the method it names), with the test playing the training operator."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred
from kubernetes_asyncio.client.exceptions import ApiException

from finetune.operators import StageOperator
from finetune.targets.base import StageFailed
from finetune.targets.eks.clients import kube_credentials
from finetune.targets.eks.job import pytorchjob_state
from finetune.targets.eks.manifests import (
    job_name,
)
from finetune.targets.eks.target import EksTarget
from finetune.targets.eks.triggers import (
    BatchJobTrigger,
    ImageBuildTrigger,
    NodegroupActiveTrigger,
    NodesReadyTrigger,
    PyTorchJobTrigger,
)
from tests.support.deferral import first_event, reloaded, run_deferred
from tests.support.eks import (
    FAST,
    NS,
    SCALING,
    TrainingOperator,
    create_job,
    eks_config,
    jobs_of_run,
    scaling,
    set_condition,
    stage_operator,
    target,
    train_operator,
)
from tests.support.kube import add_nodes


def test_pytorchjob_trigger_wakes_while_restarting_and_fires_when_succeeded(cluster):
    cfg = eks_config()
    name = create_job(cluster, cfg)
    trigger = PyTorchJobTrigger(credentials=kube_credentials(cfg), namespace=NS, name=name,
                                poll_interval=0.05, wake_at=time.time() + 0.3)
    set_condition(cluster, name, "Restarting")
    assert asyncio.run(first_event(trigger)) == {
        "status": "running", "state": "Restarting", "message": f"PyTorchJob {name} is Restarting"}
    set_condition(cluster, name, "Succeeded")
    assert asyncio.run(first_event(trigger))["status"] == "succeeded"


def test_train_defers_streams_the_leaders_log_at_each_wake_up_and_returns_on_success(
        cluster, task_log):
    cfg = eks_config(nodes=2)
    operator = TrainingOperator(cluster, cfg)
    operator.start()
    result, events = run_deferred(train_operator(cfg))
    operator.join(5)
    assert [e["status"] for e in events][-1] == "succeeded"
    assert "running" in [e["status"] for e in events]  # it came back to stream the log
    assert result["job"] == job_name(cfg) and result["adopted"] is False
    logged = "\n".join(task_log)
    assert all(logged.count(f"step {s} loss") == 1 for s in (1, 2, 3))


def test_train_fails_naming_the_oomkilled_pod(cluster):
    cfg = eks_config(nodes=2)
    operator = TrainingOperator(cluster, cfg, outcome="Failed", oom_worker=1)
    operator.start()
    with pytest.raises(AirflowFailException) as err:
        run_deferred(train_operator(cfg))
    operator.join(5)
    assert f"{job_name(cfg)}-worker-1: container pytorch OOMKilled (exit code 137)" in str(
        err.value)
    assert "allocating activations" in str(err.value)


def test_a_kill_on_the_worker_leaves_the_job_to_the_retry_and_teardown_deletes_it(
        nodegroup, cluster):
    """A SIGTERM on the worker (a deployment, a lost heartbeat) must not lose the training:
    the retry adopts the same job. After a person's mark-failed, teardown deletes it."""
    cfg = eks_config()
    snap = target().snapshot(cfg)
    op = train_operator(cfg)
    with pytest.raises(TaskDeferred):
        op.execute({})
    op.on_kill()
    assert [j["metadata"]["name"] for j in jobs_of_run(cluster, cfg)] == [job_name(cfg)]
    with pytest.raises(TaskDeferred) as retry:
        train_operator(cfg).execute({})
    assert retry.value.kwargs["state"]["job"]["adopted"] is True
    target().teardown(cfg, snap)
    assert jobs_of_run(cluster, cfg) == []


def test_a_train_task_marked_failed_while_deferred_deletes_the_job(cluster):
    cfg = eks_config()

    with pytest.raises(TaskDeferred) as deferred:
        train_operator(cfg).execute({})
    assert len(jobs_of_run(cluster, cfg)) == 1
    asyncio.run(reloaded(deferred.value.trigger).on_kill())
    assert jobs_of_run(cluster, cfg) == []


def test_a_retry_of_train_adopts_the_job_of_the_first_try(cluster):
    cfg = eks_config()
    with pytest.raises(TaskDeferred) as first:
        train_operator(cfg).execute({})
    with pytest.raises(TaskDeferred) as retry:  # the first try's worker died
        train_operator(cfg).execute({})
    assert first.value.kwargs["state"]["job"]["adopted"] is False
    assert retry.value.kwargs["state"]["job"]["adopted"] is True
    assert [j["metadata"]["name"] for j in jobs_of_run(cluster, cfg)] == [job_name(cfg)]


@pytest.mark.slow
def test_a_retry_after_the_job_failed_starts_it_again(cluster):
    cfg = eks_config()
    name = create_job(cluster, cfg)
    set_condition(cluster, name, "Failed")
    with pytest.raises(TaskDeferred) as retry:
        train_operator(cfg).execute({})
    assert retry.value.kwargs["state"]["job"] == {**retry.value.kwargs["state"]["job"],
                                                  "job": name, "adopted": False}
    (job,) = jobs_of_run(cluster, cfg)
    assert pytorchjob_state(job) == ("Pending", "")  # a new job, not the failed one


def scale_up_operator(cfg: Any) -> StageOperator:
    return stage_operator("scale_up", cfg, options={"nodes_timeout": 1.0})


@pytest.mark.slow
def test_scale_up_defers_until_the_nodegroup_is_active_and_the_nodes_ready(nodegroup, cluster):
    cfg = eks_config(nodes=2)
    snap = target().snapshot(cfg)
    add_nodes(cluster, 2)
    result, events = run_deferred(scale_up_operator(cfg))
    assert [e["status"] for e in events] == ["success", "success"]
    assert result["scaling_config"] == {"minSize": 0, "maxSize": 2, "desiredSize": 2}
    assert len(result["nodes"]) == 2
    target().teardown(cfg, snap)
    assert scaling(nodegroup) == SCALING


@pytest.mark.slow  # a real wall-clock timeout
def test_scale_up_times_out_naming_each_nodes_condition(nodegroup, cluster):
    cfg = eks_config(nodes=2)
    add_nodes(cluster, 2, ready=False)
    with pytest.raises(AirflowFailException) as err:  # a verdict: no retry
        run_deferred(scale_up_operator(cfg))
    assert "only 0 of 2 node(s)" in str(err.value)
    assert "Ready=False (KubeletNotReady: container runtime not ready)" in str(err.value)


def test_a_long_wait_re_mints_the_eks_token(nodegroup, cluster, monkeypatch):
    import finetune.targets.eks.clients as kube

    # EKS credentials (no kubeconfig): the endpoint is the emulator, tokens are counted.
    monkeypatch.delenv("FINETUNE_KUBECONFIG")
    monkeypatch.setattr(kube, "eks_cluster_access", lambda session, name: (cluster.url, None))
    minted: list[str] = []

    def mint(session: Any, name: str) -> str:
        minted.append(f"k8s-aws-v1.token-{len(minted)}")
        return minted[-1]

    monkeypatch.setattr(kube, "eks_token", mint)
    cfg = eks_config()
    name = create_job(cluster, cfg)
    set_condition(cluster, name, "Running")
    trigger = PyTorchJobTrigger(credentials=kube_credentials(cfg), namespace=NS, name=name,
                                poll_interval=0.05, wake_at=time.time() + 1.0,
                                refresh_interval=0.2)
    assert asyncio.run(first_event(trigger))["status"] == "running"
    used = [t for t in cluster.emulator.tokens if t.startswith("k8s-aws-v1.token-")]
    assert len(set(used)) >= 3  # a fresh token every refresh_interval, each one used
    assert set(used) <= set(minted)


@pytest.mark.slow
def test_trigger_deadlines_are_wall_clock_and_a_restarted_triggerer_does_not_extend_them(
        nodegroup, cluster, monkeypatch):
    """Each deadline is computed once, when the task defers, and carried in the trigger's
    kwargs: a trigger built again from them later (a triggerer restart) keeps it and fires as
    soon as it has passed, instead of waiting a full timeout again."""
    cfg = eks_config(nodes=2)
    add_nodes(cluster, 2, ready=False)
    t = EksTarget(**{**FAST, "nodes_timeout": 0.5})

    def restarted_after_the_deadline(wait: Any) -> dict:
        deadline = wait.trigger.serialize()[1]["deadline"]
        assert deadline == wait.deadline and deadline <= time.time() + 0.5
        time.sleep(max(0.0, deadline - time.time()) + 0.1)  # the triggerer was down
        again = reloaded(wait.trigger)
        assert again.serialize()[1]["deadline"] == deadline
        began = time.monotonic()
        event = asyncio.run(first_event(again))
        assert time.monotonic() - began < 0.5  # at its first look, not after another timeout
        return event

    # A node group stuck UPDATING (moto's are ACTIVE at once).
    monkeypatch.setattr(NodegroupActiveTrigger, "_describe", lambda self: {"status": "UPDATING"})
    active = t.scale_up(cfg)
    assert restarted_after_the_deadline(active) == {
        "status": "error", "message": "node group gpu-p4de still UPDATING at its deadline"}

    ready = t.nodegroup_active(cfg, {"status": "success"}, active.state)
    event = restarted_after_the_deadline(ready)
    assert event["status"] == "timeout"
    with pytest.raises(StageFailed, match="only 0 of 2 node"):
        t.nodes_ready(cfg, event, ready.state)
    t.teardown(cfg, t.snapshot(cfg))


def test_a_degraded_nodegroup_ends_the_wait_at_once_naming_its_health_issues(monkeypatch):
    """boto3's nodegroup_active waiter would wait this out to its deadline (it fails only on
    CREATE_FAILED)."""
    degraded = {"status": "DEGRADED", "health": {"issues": [
        {"code": "AsgInstanceLaunchFailures", "message": "Could not launch On-Demand Instances"}]}}
    monkeypatch.setattr(NodegroupActiveTrigger, "_describe", lambda self: degraded)
    trigger = NodegroupActiveTrigger(cluster_name="train", nodegroup="gpu-p4de",
                                     deadline=time.time() + 30, poll_interval=0.05)
    began = time.monotonic()
    assert asyncio.run(first_event(trigger)) == {
        "status": "error", "message": "node group gpu-p4de is DEGRADED: "
        "AsgInstanceLaunchFailures: Could not launch On-Demand Instances"}
    assert time.monotonic() - began < 1


def test_every_trigger_is_built_again_from_its_serialised_kwargs():
    credentials = kube_credentials(eks_config())
    for trigger in (
            NodegroupActiveTrigger(cluster_name="train", nodegroup="gpu", deadline=1.0),
            NodesReadyTrigger(credentials=credentials, nodegroup="gpu", nodes=2, gpus=8,
                              deadline=2.0, efa=4, instance_type="p4de.24xlarge"),
            PyTorchJobTrigger(credentials=credentials, namespace=NS, name="j", wake_at=3.0,
                              launcher="trainjob", deadline=4.0),
            ImageBuildTrigger(pending={"builder": "codebuild", "build_id": "b:1"},
                              deadline=5.0, aws_conn_id="aws"),
            BatchJobTrigger(credentials=credentials, namespace=NS, name="j-prep", deadline=6.0)):
        classpath, kwargs = trigger.serialize()
        assert classpath == f"finetune.targets.eks.triggers.{type(trigger).__name__}"
        assert reloaded(trigger).serialize() == (classpath, kwargs)
        assert kwargs["deadline"] == trigger.deadline  # wall-clock, carried in the kwargs


def test_the_jobs_wake_up_time_is_wall_clock_too(cluster):
    cfg = eks_config()
    name = create_job(cluster, cfg)
    set_condition(cluster, name, "Running")
    trigger = PyTorchJobTrigger(credentials=kube_credentials(cfg), namespace=NS, name=name,
                                poll_interval=0.05, wake_at=time.time() + 0.3)
    time.sleep(0.4)
    began = time.monotonic()
    assert asyncio.run(first_event(reloaded(trigger)))["status"] == "running"
    assert time.monotonic() - began < 0.3


def test_the_task_defers_with_a_framework_timeout_beyond_the_triggers_deadline(
        nodegroup, cluster):
    cfg = eks_config(nodes=1)
    with pytest.raises(TaskDeferred) as deferred:
        stage_operator("scale_up", cfg, options={"nodes_timeout": 60.0}).execute({})
    deadline = deferred.value.trigger.serialize()[1]["deadline"]
    assert 55 < deadline - time.time() <= 60
    assert deferred.value.timeout.total_seconds() > 60  # the trigger's event comes first
    target().teardown(cfg, {"scaling_config": SCALING})


@pytest.mark.slow  # the retries' real back-off
def test_triggers_retry_transient_api_errors(cluster):
    cfg = eks_config(nodes=1)
    add_nodes(cluster, 1)
    faults = cluster.emulator.faults
    faults += [("^/api/v1/nodes$", 503), ("^/api/v1/nodes$", 429)]
    nodes = NodesReadyTrigger(credentials=kube_credentials(cfg), nodegroup=cfg.nodegroup,
                              nodes=1, gpus=8, poll_interval=0.05, deadline=time.time() + 30)
    assert asyncio.run(first_event(nodes)) == {"status": "success", "nodes": ["ip-10-0-0-0"]}
    assert faults == []  # both errors were met, and retried

    name = create_job(cluster, cfg)
    set_condition(cluster, name, "Succeeded")
    faults.append((f"/pytorchjobs/{name}$", 502))
    job = PyTorchJobTrigger(credentials=kube_credentials(cfg), namespace=NS, name=name,
                            poll_interval=0.05, wake_at=time.time() + 30)
    assert asyncio.run(first_event(job))["status"] == "succeeded"
    assert faults == []


@pytest.mark.slow  # the retries' real back-off
def test_the_stages_sync_reads_retry_transient_api_errors_too(cluster):
    """The sync client raises a subclass of ApiException for a 5xx (ServiceException)."""
    from finetune.targets.eks.job import list_pods

    cluster.emulator.faults += [(f"^/api/v1/namespaces/{NS}/pods$", 503),
                                (f"^/api/v1/namespaces/{NS}/pods$", 500)]
    assert list_pods(cluster.api(), NS, "app=none") == []
    assert cluster.emulator.faults == []  # both errors were met, and retried


def test_an_error_that_is_not_transient_is_not_retried(cluster):
    cfg = eks_config()
    cluster.emulator.faults.append(("/pytorchjobs/", 403))
    job = PyTorchJobTrigger(credentials=kube_credentials(cfg), namespace=NS, name="any",
                            poll_interval=0.05, wake_at=time.time() + 30)
    with pytest.raises(ApiException) as err:
        asyncio.run(first_event(job))
    assert err.value.status == 403


def test_no_code_outside_targets_asks_which_target_it_has():
    plugins = Path(__file__).resolve().parents[2] / "plugins"
    for path in plugins.rglob("*.py"):
        if "targets" in path.relative_to(plugins).parts:
            continue
        text = path.read_text()
        assert not re.search(r"\b(EksTarget|LocalTarget)\b|isinstance\(target", text), path
    triggers = (plugins / "finetune" / "targets" / "eks" / "triggers.py").read_text()
    assert "targets.eks.target" not in triggers  # the waits import parts, not the target
