"""The eks target's deferrable waits: the triggers run with asyncio against the emulator (and
moto), the operators are driven as Airflow drives them (execute, defer, the trigger's event into
the method it names), with the test playing the training operator."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from airflow.sdk.exceptions import TaskDeferred

from finetune.manifests import job_name
from finetune.operators import ScaleUpOperator
from finetune.targets.eks import kube_credentials
from finetune.triggers import PyTorchJobTrigger
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
    target,
    train_operator,
)
from tests.support.kube import add_nodes


def test_pytorchjob_trigger_wakes_while_restarting_and_fires_when_succeeded(cluster):
    cfg = eks_config()
    name = create_job(cluster, cfg)
    trigger = PyTorchJobTrigger(credentials=kube_credentials(cfg), namespace=NS, name=name,
                                poll_interval=0.05, wake_after=0.3)
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
    with pytest.raises(RuntimeError) as err:
        run_deferred(train_operator(cfg))
    operator.join(5)
    assert f"{job_name(cfg)}-worker-1: container pytorch OOMKilled (exit code 137)" in str(
        err.value)
    assert "allocating activations" in str(err.value)


def test_killing_the_train_task_deletes_the_job_on_a_worker_and_while_deferred(cluster):
    cfg = eks_config()
    op = train_operator(cfg)
    with pytest.raises(TaskDeferred):
        op.execute({})
    assert len(jobs_of_run(cluster, cfg)) == 1
    op.on_kill()
    assert jobs_of_run(cluster, cfg) == []

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
    assert first.value.kwargs["job"]["adopted"] is False
    assert retry.value.kwargs["job"]["adopted"] is True
    assert [j["metadata"]["name"] for j in jobs_of_run(cluster, cfg)] == [job_name(cfg)]


def scale_up_operator(cfg: Any, **options: Any) -> ScaleUpOperator:
    return ScaleUpOperator(task_id="scale_up", run_config=cfg.to_dict(),
                           **{**FAST, "nodes_timeout": 1.0, **options})


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


def test_scale_up_times_out_naming_each_nodes_condition(nodegroup, cluster):
    cfg = eks_config(nodes=2)
    add_nodes(cluster, 2, ready=False)
    with pytest.raises(TimeoutError) as err:
        run_deferred(scale_up_operator(cfg))
    assert "only 0 of 2 node(s)" in str(err.value)
    assert "Ready=False (KubeletNotReady: container runtime not ready)" in str(err.value)


def test_a_long_wait_re_mints_the_eks_token(nodegroup, cluster, monkeypatch):
    import finetune.kube as kube

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
                                poll_interval=0.05, wake_after=1.0, refresh_interval=0.2)
    assert asyncio.run(first_event(trigger))["status"] == "running"
    used = [t for t in cluster.emulator.tokens if t.startswith("k8s-aws-v1.token-")]
    assert len(set(used)) >= 3  # a fresh token every refresh_interval, each one used
    assert set(used) <= set(minted)
