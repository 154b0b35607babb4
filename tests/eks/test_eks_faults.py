"""Faults on the eks target, against moto (EKS, ECR) and the Kubernetes emulator: a triggerer
restart mid-wait, a failure at every stage followed by teardown, and secrets kept out of
everything the pipeline writes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import urllib.request
from typing import Any

import kubernetes
import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from finetune.targets.eks.clients import kube_credentials
from finetune.targets.eks.manifests import (
    pytorchjob_manifest,
    run_selector,
    trainer_configmap_manifest,
)
from finetune.targets.eks.reservations import live_reservations
from finetune.targets.eks.triggers import NodesReadyTrigger, PyTorchJobTrigger
from tests.support.deferral import first_event, reloaded
from tests.support.eks import (
    IMAGE,
    NS,
    RDZV,
    SCALING,
    TrainingOperator,
    create_job,
    eks_config,
    jobs_of_run,
    run_stage,
    scaling,
    set_condition,
    target,
    train_operator,
)
from tests.support.kube import add_nodes


async def restarted(trigger: Any, change_after_restart: Any, waiting_for: float = 0.4) -> dict:
    """Run the trigger, stop it mid-wait as a triggerer restart does, build it again from its
    serialised kwargs (as the new triggerer does) and run that to its event; the world changes
    (`change_after_restart`) only once the first one is gone."""
    first = asyncio.ensure_future(first_event(trigger))
    await asyncio.sleep(waiting_for)
    assert not first.done(), "the trigger fired before the restart"
    first.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await first
    again = reloaded(trigger)
    threading.Timer(0.2, change_after_restart).start()
    return await first_event(again)


def test_a_restarted_triggerer_resumes_waiting_for_the_job_with_the_same_outcome(cluster):
    cfg = eks_config()
    name = create_job(cluster, cfg)
    set_condition(cluster, name, "Running")
    trigger = PyTorchJobTrigger(credentials=kube_credentials(cfg), namespace=NS, name=name,
                                poll_interval=0.05, wake_at=time.time() + 30)
    event = asyncio.run(restarted(trigger, lambda: set_condition(cluster, name, "Failed")))
    assert event == {"status": "failed", "state": "Failed",
                     "message": f"PyTorchJob {name} is Failed"}
    # The same as a trigger that was never restarted sees.
    assert asyncio.run(first_event(trigger)) == event


def test_a_restarted_triggerer_resumes_waiting_for_the_nodes(cluster):
    cfg = eks_config(nodes=2)
    trigger = NodesReadyTrigger(credentials=kube_credentials(cfg), nodegroup=cfg.nodegroup,
                                nodes=2, gpus=8, poll_interval=0.05, deadline=time.time() + 30)
    event = asyncio.run(restarted(trigger, lambda: add_nodes(cluster, 2)))
    assert event == {"status": "success", "nodes": ["ip-10-0-0-0", "ip-10-0-0-1"]}


def put_rendezvous_key(etcd_endpoint: str, rdzv_id: str) -> str:
    """What torchrun's etcd-v2 rendezvous leaves on etcd for the run."""
    key = f"/torch/elastic/rendezvous/{rdzv_id}"
    req = urllib.request.Request(f"http://{etcd_endpoint}/v2/keys{key}", data=b"value=closed",
                                 method="PUT")
    urllib.request.urlopen(req, timeout=5).close()
    return key


def etcd_has(etcd_endpoint: str, key: str) -> bool:
    try:
        urllib.request.urlopen(f"http://{etcd_endpoint}/v2/keys{key}", timeout=5).close()
        return True
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return False
        raise


def fail_at(stage: str, cluster: Any, cfg: Any) -> None:
    """Run the stages up to `stage`, which fails by a fault of its own kind."""
    import dataclasses

    t = target()
    if stage == "scale_up":
        add_nodes(cluster, cfg.nodes, ready=False)  # nodes that never become Ready
        with pytest.raises(AirflowFailException, match="capacity did not come"):
            run_stage("scale_up", cfg)
        return
    add_nodes(cluster, cfg.nodes)
    run_stage("scale_up", cfg)
    if stage == "build_image":  # a prebuilt ECR image that is not in ECR
        missing = dataclasses.replace(
            cfg, image="123456789012.dkr.ecr.us-east-1.amazonaws.com/finetune-trainer:gone")
        with pytest.raises(Exception, match="not in ECR"):
            run_stage("build_image", missing)
        return
    if stage == "rendezvous":  # etcd_reset=restart, and no etcd service to restart
        with pytest.raises(kubernetes.client.ApiException):
            t.rendezvous(dataclasses.replace(cfg, etcd_reset="restart",
                                             etcd_service="no-such-etcd"))
        return
    t.rendezvous(cfg)
    operator = TrainingOperator(cluster, cfg, outcome="Failed", oom_worker=0)
    operator.start()
    with pytest.raises(AirflowFailException, match="OOMKilled"):
        run_stage("train", cfg, image=IMAGE, rendezvous=RDZV)
    operator.join(5)


@pytest.mark.parametrize("stage", ["scale_up", "build_image", "rendezvous", "train"])
@pytest.mark.slow
def test_teardown_after_a_failure_at_each_stage_gives_everything_back(
        stage, nodegroup, cluster, etcd_server):
    cfg = eks_config(nodes=2)
    cluster.emulator.proxies[NS, "etcd"] = etcd_server.endpoint
    t = target()
    snap = t.snapshot(cfg)
    fail_at(stage, cluster, cfg)
    key = put_rendezvous_key(etcd_server.endpoint, cfg.rdzv_id)  # as torchrun leaves it

    done = t.teardown(cfg, snap)
    assert scaling(nodegroup) == SCALING  # the nodes are given back
    assert jobs_of_run(cluster, cfg) == []
    core = kubernetes.client.CoreV1Api(cluster.api())
    assert core.list_namespaced_config_map(NS, label_selector=run_selector(cfg)).items == []
    state, _ = t._reservations(cfg).read()
    assert cfg.rdzv_id not in live_reservations(state, time.time())
    assert not etcd_has(etcd_server.endpoint, key)
    assert done["rendezvous_keys"] >= 1


SECRET_KEY = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzFAKESECRETKEY"
SESSION_TOKEN = "FwoGZXIvYXdzEFAKESESSIONTOKEN0123456789"
HF_TOKEN = "hf_FakeTokenThatMustNeverLeak0123456789"


def test_aws_credentials_and_the_hf_token_appear_nowhere_the_eks_run_writes(
        nodegroup, cluster, task_log, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_SESSION_TOKEN", SESSION_TOKEN)
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    written: list[Any] = []
    cfg, t = eks_config(nodes=1), target()
    written.append(cfg.to_dict())
    snap = t.snapshot(cfg)
    add_nodes(cluster, 1)
    written += [snap, run_stage("scale_up", cfg)]
    written += [pytorchjob_manifest(cfg, IMAGE["image"]), trainer_configmap_manifest(cfg)]
    with pytest.raises(TaskDeferred) as deferred:  # what the triggers table stores
        train_operator(cfg).execute({})
    written.append(deferred.value.trigger.serialize())
    written.append(deferred.value.kwargs)
    api = cluster.api()
    core = kubernetes.client.CoreV1Api(api)
    written.append(jobs_of_run(cluster, cfg))
    written.append(api.sanitize_for_serialization(core.list_namespaced_config_map(NS)))
    operator = TrainingOperator(cluster, cfg, outcome="Failed", oom_worker=0)
    operator.start()
    with pytest.raises(AirflowFailException) as failed:
        run_stage("train", cfg, image=IMAGE, rendezvous=RDZV)
    operator.join(5)
    written.append(str(failed.value))
    written.append(t.teardown(cfg, snap))
    text = json.dumps(written, default=str) + "\n".join(task_log)
    assert "OOMKilled" in text and "hf:token" in text  # the scan sees what was written
    for secret in (SECRET_KEY, SESSION_TOKEN, HF_TOKEN):
        assert secret not in text
