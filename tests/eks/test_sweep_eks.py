"""A sweep on the eks target against moto and the Kubernetes emulator (the test playing the
training operator): the node group scaled once for the trials run at once, under the sweep's
reservation, which the trials' trainings renew; each trial's job on that node group; a trial the
rule stops has its job deleted (its pods save and exit) and the nodes go to the next; teardown
releases every trial and gives the nodes back once."""

from __future__ import annotations

import json

import boto3
import kubernetes
import pytest

from finetune.sweep.records import SweepRecords
from finetune.sweep.trials import validate_sweep
from finetune.targets.eks import nodegroup as nodegroup_part
from finetune.targets.eks.manifests import NODEGROUP_LABEL, job_name
from finetune.targets.eks.reservations import ReservationStore
from tests.support.eks import (
    EKS_PARAMS,
    IMAGE,
    NS,
    RDZV,
    SCALING,
    TrainingOperator,
    jobs_of_run,
    run_stage,
    scaling,
    target,
)
from tests.support.kube import add_nodes

SPACE = {"trials": [{}, {"lr": 0.01}, {"lr": 1e-5}]}


def reservations(cluster) -> dict:
    store = ReservationStore(kubernetes.client.CoreV1Api(cluster.api()), NS, "train",
                             "gpu-p4de")
    return store.read()[0]["reservations"]


def train(cluster, cfg) -> dict:
    operator = TrainingOperator(cluster, cfg)
    operator.start()
    trained = run_stage("train", cfg, image=IMAGE, rendezvous=RDZV)
    operator.join(5)
    return trained


@pytest.mark.slow
def test_a_sweep_scales_up_once_and_its_trials_train_and_stop_on_the_sweeps_nodes(
        nodegroup, cluster, task_log, monkeypatch):
    boto3.client("s3").create_bucket(Bucket="bucket")
    updates: list[dict] = []
    update = nodegroup_part.update_scaling
    monkeypatch.setattr(nodegroup_part, "update_scaling", lambda eks, cfg, scaling, *a: (
        updates.append(dict(scaling)), update(eks, cfg, scaling, *a))[1])
    sweep = validate_sweep({**EKS_PARAMS, "max_steps": 16, "eval_interval": 4,
                            "sweep_parallel": 2, "sweep_space": json.dumps(SPACE)},
                           run_id="manual__sweep", dag_id="llm_finetune_sweep")
    first, second, slow = sweep.trials
    t = target()

    snap = t.snapshot(sweep.config)
    add_nodes(cluster, 2)
    up = run_stage("scale_up", sweep.config)
    assert len(up["nodes"]) == 2 and scaling(nodegroup)["desiredSize"] == 2
    assert updates == [{"minSize": 0, "maxSize": 2, "desiredSize": 2}]
    held = reservations(cluster)
    assert list(held) == [sweep.config.rdzv_id] and held[sweep.config.rdzv_id]["nodes"] == 2

    for trial in (first, second):  # the two at once: each its own job, on the sweep's nodes
        trained = train(cluster, trial)
        assert trained["job"] == job_name(trial) and "stopped" not in trained
        [job] = jobs_of_run(cluster, trial)
        pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
        assert pod["nodeSelector"][NODEGROUP_LABEL] == "gpu-p4de"
    assert updates == [{"minSize": 0, "maxSize": 2, "desiredSize": 2}]  # no scale-up of theirs
    renewed = reservations(cluster)
    assert list(renewed) == [sweep.config.rdzv_id]  # the trials hold none of their own
    assert renewed[sweep.config.rdzv_id]["expires"] > held[sweep.config.rdzv_id]["expires"]

    # The third trial, far behind the two at the first rung (step 4), is stopped there.
    records = SweepRecords(sweep.config.sweep_dir, lambda: boto3.client("s3"))
    for trial, loss in ((first, 5.0), (second, 5.2)):
        records.record_rung(4, trial.sweep_trial, {"trial": trial.sweep_trial, "step": 4,
                                                   "eval_loss": loss, "goes_on": True})
    prefix = slow.run_dir.removeprefix("s3://bucket/")
    boto3.client("s3").put_object(Bucket="bucket", Key=f"{prefix}/metrics.jsonl", Body=(
        json.dumps({"type": "eval", "step": 0, "eval_loss": 6.6}) + "\n" +
        json.dumps({"type": "eval", "step": 4, "eval_loss": 6.5}) + "\n").encode())
    stopped = train(cluster, slow)
    assert stopped["model_dir"] is None
    assert stopped["stopped"]["reason"].startswith(
        "stopped at step 4 by the rule: eval loss 6.5000, rank 3 of 3 at rung 1")
    assert jobs_of_run(cluster, slow) == []  # deleted: its pods save their step and go
    assert records.rung(4)[slow.sweep_trial]["goes_on"] is False
    assert updates == [{"minSize": 0, "maxSize": 2, "desiredSize": 2}]

    # Teardown: every trial released, then the nodes given back once.
    for trial in sweep.trials:
        t.release(trial)
        assert jobs_of_run(cluster, trial) == []
    t.teardown(sweep.config, snap)
    assert scaling(nodegroup) == SCALING
    assert updates[1:] == [SCALING]
    assert reservations(cluster) == {}
