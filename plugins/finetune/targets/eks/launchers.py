"""What runs the trainer on eks, behind one interface so that job.py (create or adopt, wait,
stream the leader's log, report failures, delete) serves both:

- `PYTORCHJOB`: Kubeflow's training operator v1, a PyTorchJob (kubeflow.org/v1);
- `TRAINJOB`: Kubeflow Trainer v2, a TrainJob (trainer.kubeflow.org/v1alpha1) on the project's
  ClusterTrainingRuntime, run by JobSet.

Each gives its manifest, its API coordinates, its state from its conditions (Succeeded, Failed
or another), the restarts one look at the job and its pods shows, the label selectors of its
pods and of its leader (rank 0), and its training container. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from finetune.config import RunConfig
from finetune.gpu_metrics import job_pod_regex
from finetune.targets.eks.manifests import (
    CONTAINER_NAME,
    LABEL_COMPLETION_INDEX,
    LABEL_JOB_NAME,
    LABEL_JOBSET_NAME,
    LABEL_REPLICA_INDEX,
    LABEL_REPLICA_TYPE,
    LABEL_REPLICATED_JOB,
    PYTORCHJOB_GROUP,
    PYTORCHJOB_PLURAL,
    PYTORCHJOB_VERSION,
    TRAIN,
    TRAINER_CONTAINER,
    TRAINER_GROUP,
    TRAINER_REPLICATED_JOB,
    TRAINER_VERSION,
    TRAINJOB_GRACE_S,
    TRAINJOB_PLURAL,
    evaluation_job_manifest,
    evaluation_trainjob_manifest,
    pytorchjob_manifest,
    trainjob_manifest,
)
from finetune_contract.parallel_dims import is_elastic
from finetune_contract.run_history import PREEMPTED_EXIT_CODE

TERMINAL = ("Succeeded", "Failed")


def _true_conditions(job: dict[str, Any]) -> list[dict[str, Any]]:
    conditions = (job.get("status") or {}).get("conditions") or []
    return [c for c in conditions if c.get("status") == "True"]


def _message(condition: dict[str, Any]) -> str:
    return condition.get("message") or condition.get("reason") or ""


def pytorchjob_state(job: dict[str, Any]) -> tuple[str, str]:
    """(state, message): Succeeded or Failed once finished, else the newest true condition
    (Created, Running, Restarting, Suspended)."""
    true = _true_conditions(job)
    for terminal in TERMINAL:
        for c in true:
            if c.get("type") == terminal:
                return terminal, _message(c)
    if true:
        return true[-1].get("type", "Unknown"), true[-1].get("message") or ""
    return "Pending", ""


def trainjob_state(job: dict[str, Any]) -> tuple[str, str]:
    """(state, message) of a TrainJob, in the PyTorchJob's words: its Complete condition is
    Succeeded, Failed is Failed, Suspended is Suspended; else Running once a child Job is
    active, Created before."""
    true = {c.get("type"): c for c in _true_conditions(job)}
    if "Failed" in true:
        return "Failed", _message(true["Failed"])
    if "Complete" in true:
        return "Succeeded", _message(true["Complete"])
    if "Suspended" in true:
        return "Suspended", _message(true["Suspended"])
    jobs = (job.get("status") or {}).get("jobsStatus") or []
    if any((j.get("active") or 0) > 0 for j in jobs):
        return "Running", ""
    return "Created", ""


def pytorchjob_restarts(job: dict[str, Any], pods: list[dict[str, Any]]) -> set[str]:
    """The restart the PyTorchJob is in, by when its Restarting condition became true: the
    operator sets it when it retries a worker (restartPolicy ExitCode: a saved notice's 138,
    or 130, 137, 143) and clears it once the workers run again."""
    return {f"Restarting since {c.get('lastTransitionTime') or c.get('lastUpdateTime')}"
            for c in _true_conditions(job) if c.get("type") == "Restarting"}


def trainjob_restarts(job: dict[str, Any], pods: list[dict[str, Any]]) -> set[str]:
    """The TrainJob's pods replaced after they saved a notice's step (exit
    PREEMPTED_EXIT_CODE, which the Job's podFailurePolicy ignores), by the minute they exited:
    the pods of one round exit at the end of the same step."""
    return {f"exit {PREEMPTED_EXIT_CODE} at {state['finishedAt'][:16]}"
            for pod in pods for status in (pod.get("status") or {}).get("containerStatuses") or []
            if (state := (status.get("state") or {}).get("terminated") or {})
            and state.get("exitCode") == PREEMPTED_EXIT_CODE and state.get("finishedAt")}


@dataclasses.dataclass(frozen=True)
class Launcher:
    name: str  # the `launcher` param's value
    kind: str
    group: str
    version: str
    plural: str
    container: str  # the training container's name in the pods
    manifest: Callable[..., dict[str, Any]]  # (cfg, image, program=TRAIN)
    # The evaluate stage's job: (cfg, image, champion model URI or "") -> its manifest.
    evaluation_manifest: Callable[..., dict[str, Any]]
    state: Callable[[dict[str, Any]], tuple[str, str]]
    # What one look at the job and its pods shows of a restart after a notice, each restart
    # one mark (what the train task counts where the trainer's history cannot be read).
    restarts: Callable[[dict[str, Any], list[dict[str, Any]]], set[str]]
    pod_labels: Callable[[str], dict[str, str]]  # every pod of the job
    leader_labels: Callable[[str], dict[str, str]]  # rank 0's pod
    pod_regex: Callable[[str], str]  # RE2 for the pods' names (the GPU metrics' query)
    # True: the job ends itself at active_deadline_s (activeDeadlineSeconds). False: the
    # train task enforces it, a wall-clock deadline in the trigger's kwargs.
    own_deadline: bool

    def pod_selector(self, name: str) -> str:
        return _selector(self.pod_labels(name))

    def leader_selector(self, name: str) -> str:
        return _selector(self.leader_labels(name))


def _selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def _escaped(name: str) -> str:
    return "".join("\\" + ch if ch in "\\.+*?()|[]{}^$" else ch for ch in name)


PYTORCHJOB = Launcher(
    name="pytorchjob", kind="PyTorchJob", group=PYTORCHJOB_GROUP, version=PYTORCHJOB_VERSION,
    plural=PYTORCHJOB_PLURAL, container=CONTAINER_NAME,
    manifest=lambda cfg, image, program=TRAIN: pytorchjob_manifest(cfg, image, program=program),
    evaluation_manifest=evaluation_job_manifest,
    state=pytorchjob_state,
    restarts=pytorchjob_restarts,
    pod_labels=lambda name: {LABEL_JOB_NAME: name},
    leader_labels=lambda name: {LABEL_JOB_NAME: name, LABEL_REPLICA_TYPE: "worker",
                                LABEL_REPLICA_INDEX: "0"},
    pod_regex=job_pod_regex,
    own_deadline=True)

TRAINJOB = Launcher(
    name="trainjob", kind="TrainJob", group=TRAINER_GROUP, version=TRAINER_VERSION,
    plural=TRAINJOB_PLURAL, container=TRAINER_CONTAINER,
    manifest=lambda cfg, image, program=TRAIN: trainjob_manifest(cfg, image, program=program),
    evaluation_manifest=evaluation_trainjob_manifest,
    state=trainjob_state,
    restarts=trainjob_restarts,
    pod_labels=lambda name: {LABEL_JOBSET_NAME: name},
    leader_labels=lambda name: {LABEL_JOBSET_NAME: name,
                                LABEL_REPLICATED_JOB: TRAINER_REPLICATED_JOB,
                                LABEL_COMPLETION_INDEX: "0"},
    # <jobset>-<replicated job>-<job index>-<completion index>-<suffix>
    pod_regex=lambda name: _escaped(name) + f"-{TRAINER_REPLICATED_JOB}-[0-9]+-[0-9]+-[a-z0-9]+",
    # Trainer v2.0's TrainJob has no activeDeadlineSeconds (added in v2.2).
    own_deadline=False)

LAUNCHERS = {launcher.name: launcher for launcher in (PYTORCHJOB, TRAINJOB)}


def launcher_for(cfg: RunConfig) -> Launcher:
    return LAUNCHERS[cfg.launcher]


def launcher_problems(values: dict[str, Any]) -> list[tuple[str, str]]:
    """Validate: combinations a launcher cannot run, naming the field and the launcher.

    PyTorchJob: an elastic run's rendezvous must outlive any one node, so not c10d, whose store
    lives on worker 0. Kubeflow Trainer v2 gives torchrun a static c10d rendezvous on node 0 (no
    etcd, no elastic policy: its ElasticPolicy API was removed) and restarts a run only as a
    whole group (JobSet's failurePolicy.maxRestarts, in the ClusterTrainingRuntime)."""
    elastic = is_elastic(SimpleNamespace(**values))
    if values["launcher"] != TRAINJOB.name:
        if elastic and values["rdzv_backend"] == "c10d":
            return [("rdzv_backend", f"c10d cannot serve an elastic run (min_nodes "
                     f"{values['min_nodes']}): its store lives on worker 0, and a lost worker 0 "
                     "takes the rendezvous of the nodes left with it; set rdzv_backend etcd-v2 "
                     "(the etcd service)")]
        return []
    what = "launcher trainjob (Kubeflow Trainer v2)"
    errors = []
    if elastic:
        errors.append(("min_nodes", f"{values['min_nodes']}: {what} cannot go on with fewer "
                       "nodes (its ElasticPolicy API was removed: torchrun gets a fixed node "
                       "count and a static rendezvous on node 0); set min_nodes 0, or launcher "
                       "pytorchjob"))
    if values["rdzv_backend"] != "c10d":
        errors.append(("rdzv_backend", f"{values['rdzv_backend']} cannot work with {what}: "
                       "torchrun gets a static c10d rendezvous on node 0 from the trainer; set "
                       "rdzv_backend c10d"))
    if values["etcd_reset"] == "restart":
        errors.append(("etcd_reset", f"restart cannot work with {what}: there is no etcd "
                       "rendezvous to reset; set etcd_reset keys (rendezvous does nothing)"))
    if values["max_restarts"]:
        errors.append(("max_restarts", f"{values['max_restarts']}: {what} has no elastic "
                       "policy, so torchrun cannot restart workers in place; JobSet restarts "
                       "the whole run (failurePolicy.maxRestarts of the ClusterTrainingRuntime)."
                       " Set max_restarts 0"))
    if values["metrics_port"]:
        errors.append(("metrics_port", f"{values['metrics_port']}: {what} cannot add a port or "
                       "the scrape annotations to its pods (Trainer v2.0's TrainJob has no pod "
                       "metadata override); set metrics_port 0 or launcher pytorchjob"))
    return errors


def launcher_plan_problems(cfg: RunConfig, grace_s: int) -> list[tuple[str, str]]:
    """Validate: what a launcher cannot give the run as planned. A TrainJob cannot set its pods'
    terminationGracePeriodSeconds (Trainer v2.0's podSpecOverrides has no such field): every
    run gets the runtime's TRAINJOB_GRACE_S, which the plan's grace (its step and save after a
    notice) must fit."""
    if cfg.launcher != TRAINJOB.name or grace_s <= TRAINJOB_GRACE_S:
        return []
    return [("launcher", f"trainjob gives every run's pods {TRAINJOB_GRACE_S} s after a notice "
             f"(the runtime's terminationGracePeriodSeconds: a TrainJob cannot set its own), but "
             f"this run needs {grace_s} s to end its step and save it (the plan's grace); use "
             "launcher pytorchjob, or more nodes or LoRA for a smaller save")]
