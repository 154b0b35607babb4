"""launcher trainjob: Kubeflow Trainer v2's TrainJob on the project's ClusterTrainingRuntime,
valid against the real CRDs, refused where it cannot work, and with the PyTorchJob launcher's
stage behaviour on the emulated cluster (the test plays the trainer and JobSet): a retry adopts
the job, the wait streams rank 0's log, a failure names each pod's reason, killing the task
deletes the job, the deadline stops it, teardown deletes what the run made."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import yaml
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from finetune.config import ConfigError
from finetune.run_plan import plan_run
from finetune.targets.eks import job
from finetune.targets.eks.launchers import TRAINJOB, trainjob_state
from finetune.targets.eks.manifests import (
    JOBSET_MAX_RESTARTS,
    TRAINING_RUNTIME,
    TRAINJOB_GRACE_S,
    job_name,
    training_runtime_manifest,
    trainjob_manifest,
)
from finetune.validate import validate_params
from finetune_contract.instance_types import INSTANCE_TYPES
from finetune_contract.run_history import PREEMPTED_EXIT_CODE
from tests.support.deferral import reloaded, run_deferred
from tests.support.eks import (
    IMAGE,
    NS,
    SCALING,
    run_stage,
    scaling,
    stage_operator,
    target,
)
from tests.support.kube import add_nodes
from tests.support.schemas import assert_valid_training_runtime, assert_valid_trainjob
from tests.support.trainer import (
    RDZV_C10D,
    TRAINJOB_PARAMS,
    TrainerController,
    create_trainjob,
    pod_name,
    set_trainjob_status,
    trainjob_config,
    trainjobs_of_run,
)

K8S_DIR = Path(__file__).resolve().parents[2] / "containers" / "k8s"
RESERVED_TORCHRUN_ENV = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
                         "PET_MASTER_PORT"}


def train(cfg, **options):
    return stage_operator("train", cfg, options, image=IMAGE, rendezvous=RDZV_C10D)


# -- manifests -------------------------------------------------------------------------------


def test_shipped_runtime_is_what_the_builder_makes_and_validates_against_the_crd():
    shipped = yaml.safe_load((K8S_DIR / "trainjob-runtime.yaml").read_text())
    assert shipped == training_runtime_manifest()
    assert_valid_training_runtime(shipped)
    spec = shipped["spec"]["template"]["spec"]
    assert spec["failurePolicy"] == {"maxRestarts": JOBSET_MAX_RESTARTS}
    (node,) = spec["replicatedJobs"]
    assert node["name"] == "node"  # Kubeflow Trainer's PET_MASTER_ADDR is <job>-node-0-0.<job>
    assert node["template"]["metadata"]["labels"] == {
        "trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
    job = node["template"]["spec"]
    assert job["backoffLimit"] == 0 and job["template"]["spec"]["restartPolicy"] == "Never"
    # a pod that saved its step after a notice is replaced without counting as a failure
    assert job["podFailurePolicy"] == {"rules": [{"action": "Ignore", "onExitCodes": {
        "containerName": "node", "operator": "In", "values": [PREEMPTED_EXIT_CODE]}}]}
    pod = job["template"]["spec"]
    assert pod["containers"][0]["name"] == "node"
    assert pod["containers"][0]["command"] == ["python", "-m", "trainer.launch"]
    assert pod["terminationGracePeriodSeconds"] == TRAINJOB_GRACE_S
    shutdown = next(e["value"] for e in pod["containers"][0]["env"]
                    if e["name"] == "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    assert 0 < int(shutdown) < TRAINJOB_GRACE_S
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    env = {e["name"] for e in pod["containers"][0]["env"]}
    assert {"NCCL_DEBUG", "TORCH_NCCL_DUMP_ON_TIMEOUT"} <= env
    assert not env & RESERVED_TORCHRUN_ENV
    assert {t["key"] for t in pod["tolerations"]} == {"nvidia.com/gpu", "aws.amazon.com/efa"}
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_schema_check_rejects_a_malformed_trainjob():
    bad = trainjob_manifest(trainjob_config(), "img:1")
    bad["spec"]["trainer"]["numNodes"] = "two"
    with pytest.raises(AssertionError, match="numNodes"):
        assert_valid_trainjob(bad)


@pytest.mark.parametrize("instance_type", sorted(INSTANCE_TYPES))
def test_every_generated_trainjob_validates_against_the_crd(instance_type):
    gpus = INSTANCE_TYPES[instance_type].gpus
    for nodes in (1, 2, 8, 128):
        cfg = trainjob_config(instance_type=instance_type, nodes=nodes, procs_per_node=gpus,
                              max_nodes=128)
        manifest = trainjob_manifest(cfg, "img:1")
        assert_valid_trainjob(manifest)
        assert manifest["spec"]["trainer"]["numNodes"] == nodes
        assert len(f"{manifest['metadata']['name']}-node-0-{nodes - 1}") <= 63


def test_trainjob_references_the_runtime_and_overrides_what_the_run_sets():
    cfg = validate_params({**TRAINJOB_PARAMS, "nodes": 2, "service_account": "trainer-irsa",
                           "volumes": "fsx-claim:/fsx", "queue_name": "gpu-queue"},
                          run_id="manual__tj")
    manifest = trainjob_manifest(cfg, "1234.dkr.ecr/ft:abc")
    assert_valid_trainjob(manifest)
    spec = manifest["spec"]
    assert spec["runtimeRef"] == {"name": TRAINING_RUNTIME, "apiGroup": "trainer.kubeflow.org",
                                  "kind": "ClusterTrainingRuntime"}
    trainer = spec["trainer"]
    assert trainer["image"] == "1234.dkr.ecr/ft:abc"
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 8)
    assert trainer["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": 8,
                                                     "vpc.amazonaws.com/efa": 4,
                                                     "hugepages-2Mi": "5120Mi"}
    env = {e["name"]: e for e in trainer["env"]}
    assert env["FI_PROVIDER"]["value"] == "efa" and env["FINETUNE_RUN_ID"]["value"]
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert not set(env) & RESERVED_TORCHRUN_ENV  # the trainer's webhook refuses those
    (override,) = spec["podSpecOverrides"]
    assert override["targetJobs"] == [{"name": "node"}]
    assert override["nodeSelector"]["eks.amazonaws.com/nodegroup"] == "gpu-p4de"
    assert override["serviceAccountName"] == "trainer-irsa"
    claims = {v["persistentVolumeClaim"]["claimName"] for v in override["volumes"]
              if "persistentVolumeClaim" in v}
    assert claims == {"fsx-claim"}
    mounts = {m["mountPath"] for m in override["containers"][0]["volumeMounts"]}
    assert mounts == {"/etc/finetune", "/fsx"}
    assert manifest["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert spec["suspend"] is True


def test_trainjob_state_reads_the_trainers_conditions():
    def job(*conditions, active=0):
        return {"status": {"conditions": [{"type": t, "status": s, "message": f"{t} msg"}
                                          for t, s in conditions],
                           "jobsStatus": [{"name": "node", "active": active}]}}

    assert trainjob_state({}) == ("Created", "")
    assert trainjob_state(job(active=2)) == ("Running", "")
    assert trainjob_state(job(("Suspended", "True"))) == ("Suspended", "Suspended msg")
    assert trainjob_state(job(("Suspended", "False"), active=1)) == ("Running", "")
    assert trainjob_state(job(("Complete", "True"))) == ("Succeeded", "Complete msg")
    assert trainjob_state(job(("Failed", "True"))) == ("Failed", "Failed msg")


# -- validate ----------------------------------------------------------------------------------


def test_the_default_launcher_is_pytorchjob_and_trainjob_params_validate():
    assert validate_params({"target": "eks", **{k: v for k, v in TRAINJOB_PARAMS.items()
                                                if k != "launcher"}},
                           run_id="r").launcher == "pytorchjob"
    assert validate_params(TRAINJOB_PARAMS, run_id="r").launcher == "trainjob"


@pytest.mark.parametrize(("changes", "field", "words"), [
    ({"rdzv_backend": "etcd-v2"}, "rdzv_backend", "launcher trainjob"),
    ({"rdzv_backend": "etcd"}, "rdzv_backend", "set rdzv_backend c10d"),
    ({"etcd_reset": "restart"}, "etcd_reset", "launcher trainjob"),
    ({"max_restarts": 2}, "max_restarts", "failurePolicy.maxRestarts"),
    ({"metrics_port": 9400}, "metrics_port", "launcher trainjob"),
    ({"nodes": 2, "min_nodes": 1}, "min_nodes", "ElasticPolicy API was removed"),
    ({"target": "local", "output_dir": "runs"}, "launcher", "not a launcher of target local"),
])
def test_combinations_the_trainjob_launcher_cannot_run_are_refused_naming_both_fields(
        changes, field, words):
    with pytest.raises(ConfigError) as err:
        validate_params({**TRAINJOB_PARAMS, **changes}, run_id="r")
    messages = dict(err.value.errors)
    assert words in messages.get(field, ""), err.value.errors
    assert "launcher" in messages[field] and (field == "launcher" or field in messages)


def test_a_trainjob_run_whose_step_and_save_need_more_than_the_runtimes_grace_is_refused(
        monkeypatch):
    import finetune.targets.eks.launchers as launchers

    needed = plan_run(validate_params(TRAINJOB_PARAMS, run_id="r")).grace_s
    monkeypatch.setattr(launchers, "TRAINJOB_GRACE_S", needed - 1)
    with pytest.raises(ConfigError) as err:
        validate_params(TRAINJOB_PARAMS, run_id="r")
    message = dict(err.value.errors)["launcher"]
    assert f"this run needs {needed} s" in message and "cannot set its own" in message
    assert validate_params({**TRAINJOB_PARAMS, "launcher": "pytorchjob",
                            "rdzv_backend": "etcd-v2"}, run_id="r")  # a PyTorchJob can


# -- the stages on the emulated cluster ----------------------------------------------------------


def test_the_rendezvous_stage_does_nothing_with_the_trainjob_launcher_and_says_so(task_log):
    cfg = trainjob_config()
    result = target().rendezvous(cfg)  # no cluster, no etcd: nothing is called
    assert result["endpoint"] == f"{job_name(cfg)}-node-0-0.{job_name(cfg)}:29400"
    assert result["deleted_keys"] == 0 and result["launcher"] == "trainjob"
    assert any("static c10d rendezvous" in line and "nothing to reset" in line
               for line in task_log)


@pytest.mark.slow
def test_a_trainjob_run_scales_up_trains_streams_rank_0s_log_and_teardown_deletes_it(
        nodegroup, cluster, task_log):
    cfg, t = trainjob_config(nodes=2), target()
    snap = t.snapshot(cfg)
    add_nodes(cluster, 2)
    run_stage("scale_up", cfg)
    controller = TrainerController(cluster, cfg)
    controller.start()
    trained, events = run_deferred(train(cfg))
    controller.join(5)
    assert "running" in [e["status"] for e in events] and events[-1]["status"] == "succeeded"
    assert trained["job"] == job_name(cfg) and trained["adopted"] is False
    logged = "\n".join(task_log)
    assert all(logged.count(f"step {s} loss") == 1 for s in (1, 2, 3))
    assert trainjobs_of_run(cluster, cfg)[0]["spec"]["runtimeRef"]["name"] == TRAINING_RUNTIME

    done = t.teardown(cfg, snap)
    assert f"trainjob/{job_name(cfg)}" in done["deleted"]
    assert trainjobs_of_run(cluster, cfg) == [] and scaling(nodegroup) == SCALING


def test_a_failed_trainjob_names_the_oomkilled_pod_and_its_last_lines(cluster):
    cfg = trainjob_config(nodes=2)
    controller = TrainerController(cluster, cfg, outcome="Failed", oom_rank=1)
    controller.start()
    with pytest.raises(AirflowFailException) as err:  # a training failure: no retry
        run_deferred(train(cfg))
    controller.join(5)
    message = str(err.value)
    # the first failure by time leads (the OOM-killed pod), then the job's own verdict
    assert message.startswith("first failure: a process killed by SIGKILL"), message
    assert f"pod {pod_name(job_name(cfg), 1)}" in message.splitlines()[0]
    assert f"TrainJob ml/{job_name(cfg)} failed: TrainJob" in message
    assert f"{pod_name(job_name(cfg), 1)}: container node OOMKilled (exit code 137)" in message
    assert "allocating activations" in message
    assert f"{pod_name(job_name(cfg), 0)}:" not in message


def test_a_retry_of_train_adopts_the_trainjob_and_one_after_a_failure_starts_it_again(cluster):
    cfg = trainjob_config()
    with pytest.raises(TaskDeferred) as first:
        train(cfg).execute({})
    with pytest.raises(TaskDeferred) as retry:
        train(cfg).execute({})
    assert first.value.kwargs["state"]["job"]["adopted"] is False
    assert retry.value.kwargs["state"]["job"]["adopted"] is True
    assert [j["metadata"]["name"] for j in trainjobs_of_run(cluster, cfg)] == [job_name(cfg)]
    set_trainjob_status(cluster, job_name(cfg), "Failed")
    with pytest.raises(TaskDeferred) as again:
        train(cfg).execute({})
    assert again.value.kwargs["state"]["job"]["adopted"] is False
    (job,) = trainjobs_of_run(cluster, cfg)
    assert trainjob_state(job)[0] == "Created"  # a new one, not the failed one


def test_a_kill_on_the_worker_leaves_the_trainjob_to_the_retry_one_while_deferred_deletes_it(
        cluster):
    cfg = trainjob_config()
    op = train(cfg)
    with pytest.raises(TaskDeferred):
        op.execute({})
    op.on_kill()
    assert len(trainjobs_of_run(cluster, cfg)) == 1  # the retry adopts it
    with pytest.raises(TaskDeferred) as retry:
        train(cfg).execute({})
    assert retry.value.kwargs["state"]["job"]["adopted"] is True
    job.delete_job(cluster.api(), NS, retry.value.kwargs["state"]["job"]["job"],
                   launcher=TRAINJOB)

    with pytest.raises(TaskDeferred) as deferred:
        train(cfg).execute({})
    assert deferred.value.trigger.serialize()[1]["launcher"] == "trainjob"
    asyncio.run(reloaded(deferred.value.trigger).on_kill())
    assert trainjobs_of_run(cluster, cfg) == []


def test_a_trainjob_past_active_deadline_s_is_deleted_and_train_fails_naming_it(cluster):
    cfg = trainjob_config(active_deadline_s=1)
    name = create_trainjob(cluster, cfg)
    set_trainjob_status(cluster, name, active=1)
    with pytest.raises(TaskDeferred) as deferred:
        train(cfg).execute({})
    kwargs = deferred.value.trigger.serialize()[1]
    assert 0 < kwargs["deadline"] <= time.time() + 1  # wall-clock, in the trigger's kwargs
    started = time.monotonic()
    with pytest.raises(AirflowFailException, match="active_deadline_s = 1 s"):  # no retry
        run_deferred(train(cfg))
    assert time.monotonic() - started < 10
    assert trainjobs_of_run(cluster, cfg) == []


def test_a_try_after_a_trainjob_was_deleted_at_its_deadline_waits_it_out_and_starts_anew(
        cluster, monkeypatch):
    """The deadline's delete does not wait: the TrainJob lingers while its finalizers run. A
    later try (a person's clear) must not meet it (409) and adopt it, its deadline then counted
    again from now: it waits it out, and fails (to be retried) while it is still there."""
    import threading

    import kubernetes

    from finetune.targets.eks.manifests import TRAINER_GROUP, TRAINER_VERSION, TRAINJOB_PLURAL

    custom = kubernetes.client.CustomObjectsApi(cluster.api())
    cfg = trainjob_config(active_deadline_s=3600)
    old = trainjob_manifest(cfg, IMAGE["image"])
    old["metadata"]["finalizers"] = ["trainer.kubeflow.org/x"]
    custom.create_namespaced_custom_object(TRAINER_GROUP, TRAINER_VERSION, NS, TRAINJOB_PLURAL,
                                           old)
    name = old["metadata"]["name"]
    job.delete_job(cluster.api(), NS, name, launcher=TRAINJOB)  # as at its deadline
    monkeypatch.setattr(job, "DELETE_TIMEOUT_S", 0.5)
    with pytest.raises(RuntimeError, match="still being deleted"):
        train(cfg).execute({})

    def finalized() -> None:  # the controller ends its finalizer: the TrainJob goes
        custom.patch_namespaced_custom_object(TRAINER_GROUP, TRAINER_VERSION, NS,
                                              TRAINJOB_PLURAL, name, {"metadata": {
                                                  "finalizers": []}})

    monkeypatch.setattr(job, "DELETE_TIMEOUT_S", 30.0)
    threading.Timer(0.5, finalized).start()
    with pytest.raises(TaskDeferred) as deferred:
        train(cfg).execute({})
    assert deferred.value.kwargs["state"]["job"]["adopted"] is False  # a new one
    assert [j["metadata"].get("deletionTimestamp") for j in trainjobs_of_run(cluster, cfg)] == [
        None]


def test_trainjob_pods_the_scheduler_cannot_place_fail_train_naming_its_reason(cluster):
    cfg = trainjob_config(nodes=2, schedule_timeout_s=600)
    reason = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    controller = TrainerController(cluster, cfg, unschedulable=reason)
    controller.start()
    with pytest.raises(AirflowFailException) as err:  # a verdict: no retry
        run_deferred(train(cfg))
    controller.join(5)
    message = str(err.value)
    assert "pod(s) of TrainJob" in message and "(schedule_timeout_s)" in message
    assert f"{pod_name(job_name(cfg), 1)} (" in message and reason in message


def test_the_trainjob_launchers_pod_regex_matches_jobset_pod_names():
    import re

    regex = TRAINJOB.pod_regex("ft-run")
    assert re.fullmatch(regex, "ft-run-node-0-3-abc12")
    assert not re.fullmatch(regex, "ft-run-worker-3")
