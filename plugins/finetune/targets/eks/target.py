"""The `eks` target: Amazon EKS with Kubeflow's training operator (PyTorchJob) or Kubeflow
Trainer v2 (TrainJob), as the run's `launcher` says (`launchers`). A thin class: each stage
reads as the story of the stage, calls the part that owns the work and returns its result or a
`Wait` on one of the triggers; the methods a Wait resumes with keep their names, which a
deferred task stores.

- validate's eks checks are `checks`;
- prepare_data encodes the data set on the Airflow worker (prepare_on worker), or in a CPU pod
  of its own (prepare_on pod: `prepare_pod`, the trainer image built first when it is not in
  ECR);
- snapshot records the node group's scaling config (and the shared baseline; the fallback
  node group's too); scale_up checks the node group is the run's capacity (capacityType,
  instance types), reserves the run's nodes and sizes the node group (`nodegroup`,
  `reservations`), then waits up to capacity_wait_s for ACTIVE and for the nodes to be Ready
  with allocatable GPUs (and EFA); when they do not come it fails, or (capacity_fallback
  on-demand) scales the fallback node group instead, gives the first back and records where the
  run's nodes are for the stages after it; teardown deletes what the run created (`job`,
  `prepare_pod`, `rendezvous`) and gives back, on both node groups, only the nodes no other live
  run reserved, whatever happened to the run;
- build_image provides the trainer image (`image_build`);
- rendezvous makes the rendezvous store clean (`rendezvous`);
- preflight checks the run's nodes in a job of their own; bad ones are cordoned and replaced
  (`node_health`);
- train creates (or, on a retry, adopts) the run's job and waits for it (`job`), waking up to
  stream the leader's log, move off nodes with XID errors (`node_health`) and apply the
  sweep's rule to a trial, which may stop it (its job deleted, its pods saving their step);
  every wait of a run that holds nodes renews its reservation (a sweep's trial: the sweep's,
  on whose nodes it runs; `reservations.Renewal`, in the triggers' loop); a TrainJob past
  active_deadline_s is deleted by the task (Trainer v2.0 has no activeDeadlineSeconds);
- evaluate runs trainer.evaluate in a job of its own (`evaluation_job`); collect_metrics
  writes the report with the job's GPU metrics from Prometheus.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from finetune.config import RunConfig
from finetune.gpu_metrics import missing_section, prometheus_endpoint, prometheus_gpu_metrics
from finetune.outputs import build_report, has_outputs, report_exists, trainer_root_cause
from finetune.preflight_verdict import (
    PREFLIGHT_TRIES,
    PreflightFailed,
    failure_message,
    summary_line,
)
from finetune.run_plan import RunPlan, plan_run
from finetune.s3_dataset import check_s3_dataset
from finetune.sweep.early_stop import RungWatch, is_trial, stop_reason
from finetune.targets.base import Outcome, StageFailed, Target, TrainingFailed, Wait, resumes
from finetune.targets.eks import (
    checks,
    evaluation_job,
    job,
    node_health,
    nodegroup,
    prepare_pod,
)
from finetune.targets.eks.clients import (
    TOKEN_REFRESH_S,
    aws_session,
    kube_api_client,
    kube_credentials,
)
from finetune.targets.eks.image_build import (
    BUILD_TIMEOUT_S,
    check_image_source,
    finish_image,
    release_run_builds,
    start_image,
)
from finetune.targets.eks.launchers import LAUNCHERS, launcher_for, launcher_plan_problems
from finetune.targets.eks.manifests import PREFLIGHT_DEADLINE_S, PREPARE_DEADLINE_S
from finetune.targets.eks.rendezvous import delete_run_keys, reset_rendezvous
from finetune.targets.eks.reservations import (
    RESERVATION_TTL_S,
    Renewal,
    ReservationStore,
    record_baseline,
    renewed_while,
)
from finetune.targets.eks.triggers import (
    BatchJobTrigger,
    ImageBuildTrigger,
    JobTrigger,
    NodegroupActiveTrigger,
    NodesReadyTrigger,
)
from finetune_contract.instance_types import (
    EFA_RESOURCE,
    GPU_RESOURCE,
    INSTANCE_TYPES,
    gpu_class,
)

log = logging.getLogger(__name__)


class EksTarget(Target):
    """poll_interval: the triggers' pace; nodes_timeout: a cap on each wait for nodes (None:
    the run's capacity_wait_s alone; tests shorten it); devices_grace_s: how long a Ready node
    may lack its GPUs or EFA before scale_up names the device plugin; wake_after: how often
    train comes back to stream the log; etcd_timeout: etcd's restart; update_retries: node
    group updates while another is in progress."""

    name = "eks"
    paths_are_local = False
    launchers = tuple(LAUNCHERS)

    def __init__(self, poll_interval: float = 15.0, nodes_timeout: float | None = None,
                 wake_after: float = 60.0, etcd_timeout: float = 300.0,
                 update_retries: int = 20, reservation_ttl: float = RESERVATION_TTL_S,
                 build_timeout: float = BUILD_TIMEOUT_S,
                 refresh_interval: float = TOKEN_REFRESH_S, devices_grace_s: float = 300.0):
        self.poll_interval, self.nodes_timeout = poll_interval, nodes_timeout
        self.devices_grace_s = devices_grace_s
        self.wake_after, self.etcd_timeout = wake_after, etcd_timeout
        self.update_retries, self.reservation_ttl = update_retries, reservation_ttl
        self.build_timeout, self.refresh_interval = build_timeout, refresh_interval

    def check(self, values: dict[str, Any]) -> list[tuple[str, str]]:
        return checks.problems(values)

    def plan_problems(self, cfg: RunConfig, plan: RunPlan) -> list[tuple[str, str]]:
        return launcher_plan_problems(cfg, plan.grace_s)

    # -- clients and waits ------------------------------------------------------------------

    def _eks(self, cfg: RunConfig) -> Any:
        return aws_session(cfg.aws_conn_id).client("eks")

    def _s3(self, cfg: RunConfig) -> Any:
        return aws_session(cfg.aws_conn_id).client("s3")

    def _codebuild(self, cfg: RunConfig) -> Any:
        return aws_session(cfg.aws_conn_id).client("codebuild")

    def _kube(self, cfg: RunConfig) -> Any:
        return kube_api_client(**kube_credentials(cfg))

    def _reservations(self, cfg: RunConfig) -> ReservationStore:
        import kubernetes

        return ReservationStore(kubernetes.client.CoreV1Api(self._kube(cfg)), cfg.namespace,
                                cfg.cluster_name, cfg.nodegroup)

    def s3_client(self, cfg: RunConfig) -> Any:
        return self._s3(cfg)

    def _renewal(self, cfg: RunConfig, nodegroup: str | None = None) -> Renewal:
        """What keeps the run's node reservation live while it waits (the triggers renew it):
        its holder's (a sweep's, for its trials), on the node group its nodes are in."""
        return {"credentials": kube_credentials(cfg), "namespace": cfg.namespace,
                "cluster": cfg.cluster_name,
                "nodegroup": nodegroup or self._on_run_nodes(cfg).nodegroup,
                "holder": self._node_holder(cfg).rdzv_id, "ttl": self.reservation_ttl}

    def _wait_for_build(self, cfg: RunConfig, started: dict, resume: Callable[..., Outcome],
                        reservation: Renewal | None = None) -> Wait:
        pending = started["pending"]
        deadline = time.time() + self.build_timeout
        return Wait(ImageBuildTrigger(
            pending=pending, deadline=deadline,
            credentials=kube_credentials(cfg) if pending["builder"] == "buildkit" else None,
            aws_conn_id=cfg.aws_conn_id, poll_interval=self.poll_interval,
            refresh_interval=self.refresh_interval, reservation=reservation),
            resume=resume, deadline=deadline, state={"started": started})

    def _capacity_deadline(self, cfg: RunConfig) -> float:
        """When a wait for the run's nodes gives up: capacity_wait_s from now (wall-clock)."""
        wait = cfg.capacity_wait_s if self.nodes_timeout is None else \
            min(cfg.capacity_wait_s, self.nodes_timeout)
        return time.time() + wait

    def _wait_for_nodes(self, cfg: RunConfig, state: dict,
                        resume: Callable[..., Outcome]) -> Wait:
        """Until the run's nodes of state's node group and instance types are Ready with GPUs
        (and state["efa"]), by state's deadline."""
        deadline = state.get("deadline") or self._capacity_deadline(cfg)
        group = state.get("nodegroup", cfg.nodegroup)
        return Wait(NodesReadyTrigger(
            credentials=kube_credentials(cfg), nodegroup=group,
            nodes=cfg.nodes, gpus=cfg.procs_per_node, deadline=deadline, efa=state["efa"],
            instance_types=state.get("instance_types") or [state.get("instance_type",
                                                                     cfg.instance_type)],
            devices_grace_s=self.devices_grace_s, poll_interval=self.poll_interval,
            refresh_interval=self.refresh_interval, reservation=self._renewal(cfg, group)),
            resume=resume, deadline=deadline, state={**state, "deadline": deadline})

    def _on_run_nodes(self, cfg: RunConfig) -> RunConfig:
        """The run config with the node group the run's nodes are in: the fallback's once
        scale_up fell back to it (nodegroup.run_nodegroup), else the run's own."""
        if cfg.capacity_fallback != "on-demand":
            return cfg
        used = nodegroup.run_nodegroup(self._kube(cfg), self._node_holder(cfg))
        return cfg if used == cfg.nodegroup else dataclasses.replace(cfg, nodegroup=used)

    @staticmethod
    def _node_holder(cfg: RunConfig) -> RunConfig:
        """The run whose reservation holds the run's nodes (and records where they are): a
        sweep's, for its trials (RunConfig.node_reservation), else the run itself."""
        if not cfg.node_reservation:
            return cfg
        return dataclasses.replace(cfg, rdzv_id=cfg.node_reservation)

    @staticmethod
    def _fallback(cfg: RunConfig) -> RunConfig:
        return dataclasses.replace(cfg, nodegroup=cfg.fallback_nodegroup)

    def _job_trigger(self, cfg: RunConfig, name: str, deadline: float = 0.0) -> JobTrigger:
        """A wait on one of the run's jobs that comes back after wake_after at the latest. `cfg`
        is on the run's nodes (_on_run_nodes, which each caller has read once): its node group
        is the reservation's."""
        return JobTrigger(
            credentials=kube_credentials(cfg), namespace=cfg.namespace, name=name,
            wake_at=time.time() + self.wake_after, poll_interval=self.poll_interval,
            refresh_interval=self.refresh_interval, launcher=cfg.launcher, deadline=deadline,
            reservation=self._renewal(cfg, cfg.nodegroup))

    # -- prepare_data -----------------------------------------------------------------------

    def prepare_data(self, cfg: RunConfig) -> dict | Wait:
        """prepare_on worker: here (Target.prepare_data). pod: a CPU pod of its own, so a small
        Airflow worker never encodes a large data set: the trainer image (it holds the one
        encode function), built first when it is not in ECR (build_image then finds the tag and
        skips), then the Job, waited for deferred. Before scale_up: no GPU node is up."""
        if cfg.prepare_on != "pod":
            return super().prepare_data(cfg)
        session = aws_session(cfg.aws_conn_id)
        started = start_image(cfg, session, lambda: self._kube(cfg), timeout=self.build_timeout)
        if started["pending"] is None:
            image = finish_image(cfg, session, lambda: self._kube(cfg), started, "Complete", "")
            return self._start_prepare(cfg, image["image"])
        log.info("prepare_data: building the trainer image %s for its pod first",
                 started["image"])
        return self._wait_for_build(cfg, started, resume=self.prepare_image_built)

    @resumes
    def prepare_image_built(self, cfg: RunConfig, event: dict, state: dict) -> Wait:
        return self._start_prepare(cfg, self.build_done(cfg, event, state)["image"])

    def _start_prepare(self, cfg: RunConfig, image: str) -> Wait:
        name = prepare_pod.start_prepare_job(self._kube(cfg), cfg, image)
        deadline = time.time() + PREPARE_DEADLINE_S + self.poll_interval
        return Wait(BatchJobTrigger(
            credentials=kube_credentials(cfg), namespace=cfg.namespace, name=name,
            deadline=deadline, poll_interval=self.poll_interval,
            refresh_interval=self.refresh_interval),
            resume=self.prepare_job_done, deadline=deadline, state={"job": name, "image": image})

    @resumes
    def prepare_job_done(self, cfg: RunConfig, event: dict, state: dict) -> dict:
        """The pod's record (the statistics) decides the run, as the worker's would."""
        from finetune.prepare_stage import accept_prepared, stage_result

        record = prepare_pod.prepared_record(self._kube(cfg), cfg, state["job"], event,
                                             lambda: self._s3(cfg))
        return stage_result(accept_prepared(cfg, record), record)

    # -- snapshot ---------------------------------------------------------------------------

    def snapshot(self, cfg: RunConfig) -> dict:
        """The node group's scaling config (and the shared baseline), and the fallback node
        group's where capacity_fallback may scale it (best effort: scale_up names a fallback
        that cannot be read)."""
        eks = self._eks(cfg)
        scaling = self._record_scaling(eks, cfg)
        snap = {"target": self.name, "cluster": cfg.cluster_name, "nodegroup": cfg.nodegroup,
                "scaling_config": scaling}
        if cfg.capacity_fallback == "on-demand":
            try:
                snap["fallback"] = {"nodegroup": cfg.fallback_nodegroup, "scaling_config":
                                    self._record_scaling(eks, self._fallback(cfg))}
            except Exception as exc:
                log.warning("could not read fallback node group %s (scale_up checks it): %s",
                            cfg.fallback_nodegroup, exc)
        return snap

    def _record_scaling(self, eks: Any, cfg: RunConfig) -> dict[str, int]:
        scaling = nodegroup.current_scaling(eks, cfg)
        log.info("node group %s/%s: scaling config %s recorded for teardown", cfg.cluster_name,
                 cfg.nodegroup, scaling)
        try:  # the shared baseline, unless runs hold reservations; best effort: a setup
            self._reservations(cfg).update(
                lambda state: record_baseline(state, nodegroup.current_scaling(eks, cfg)))
        except Exception as exc:
            log.warning("could not record the node group's baseline in the cluster (scale_up "
                        "records it): %s", exc)
        return scaling

    # -- scale_up ---------------------------------------------------------------------------

    def scale_up(self, cfg: RunConfig) -> Wait:
        """Reserve the run's nodes, size the node group, then wait for it to be ACTIVE and for
        the nodes to be Ready, up to capacity_wait_s.

        Refused before any node is asked for: an s3:// data set that is missing or empty, a
        prebuilt ECR image that is not in ECR or a build's build_bucket that does not exist,
        a node group whose capacityType is not the run's capacity_type or whose instance types
        are not all of the run's GPUs with room for its pods (a fallback node group too).
        """
        if cfg.dataset.startswith("s3://"):
            check_s3_dataset(cfg.dataset, cfg.dataset_format, self._s3(cfg))
        check_image_source(cfg, aws_session(cfg.aws_conn_id))
        eks = self._eks(cfg)
        types = nodegroup.check_capacity(eks, cfg)
        if cfg.capacity_fallback == "on-demand":
            nodegroup.check_capacity(eks, self._fallback(cfg), "on-demand")
        return self._scale(eks, cfg, types)

    def _scale(self, eks: Any, cfg: RunConfig, types: list[str], **state: Any) -> Wait:
        """Reserve the run's nodes on cfg's node group, size it, and wait for it to be ACTIVE;
        the nodes' wait that follows ends at the same capacity deadline."""
        before = nodegroup.current_scaling(eks, cfg)
        scaling = nodegroup.reserve_nodes(eks, cfg, self._reservations(cfg),
                                          self.reservation_ttl, self.update_retries,
                                          self.poll_interval)
        deadline = self._capacity_deadline(cfg)
        return Wait(NodegroupActiveTrigger(
            cluster_name=cfg.cluster_name, nodegroup=cfg.nodegroup, deadline=deadline,
            aws_conn_id=cfg.aws_conn_id, poll_interval=self.poll_interval,
            reservation=self._renewal(cfg, cfg.nodegroup)),
            resume=self.nodegroup_active, deadline=deadline,
            state={"scaling_config": scaling, "before": before, "nodegroup": cfg.nodegroup,
                   "instance_types": types, "efa": INSTANCE_TYPES[cfg.instance_type].efa or 0,
                   "deadline": deadline, "wait_s": deadline - time.time(), **state})

    @resumes
    def nodegroup_active(self, cfg: RunConfig, event: dict, state: dict) -> Wait:
        if event["status"] != "success":  # failed, degraded, or not ACTIVE by the deadline
            raise StageFailed(event["message"])
        return self._wait_for_nodes(cfg, state, resume=self.nodes_ready)

    @resumes
    def nodes_ready(self, cfg: RunConfig, event: dict, state: dict) -> dict | Wait:
        """The run's nodes, or a fallback's wait (capacity_fallback on-demand) when the first
        node group's did not come."""
        if event["status"] not in ("success", "devices") and cfg.capacity_fallback == \
                "on-demand" and state.get("nodegroup", cfg.nodegroup) == cfg.nodegroup:
            return self._fall_back(cfg, event, state)
        self._nodes_came(cfg, event, state)
        log.info("%d node(s) Ready: %s", len(event["nodes"]), event["nodes"])
        placed = state.get("nodegroup", cfg.nodegroup)
        return {"nodegroup": placed, "scaling_config": state["scaling_config"],
                "nodes": event["nodes"],
                **({"instead_of": cfg.nodegroup} if placed != cfg.nodegroup else {})}

    def _nodes_came(self, cfg: RunConfig, event: dict, state: dict) -> None:
        """Fail, saying why, unless the wait for the run's nodes ended with them Ready: a
        verdict (capacity_wait_s spent, or a device plugin missing), not retried."""
        group = state.get("nodegroup", cfg.nodegroup)
        if event["status"] == "devices":
            raise StageFailed(f"node group {group}'s nodes are Ready but cannot take "
                              f"a worker: {event['message']}")
        if event["status"] != "success":
            raise StageFailed(self._missing_nodes(cfg, event, state))

    def _missing_nodes(self, cfg: RunConfig, event: dict, state: dict) -> str:
        waited = state.get("wait_s") or cfg.capacity_wait_s
        return (f"the capacity did not come: only {len(event['nodes'])} of {cfg.nodes} node(s) "
                f"of node group {state.get('nodegroup', cfg.nodegroup)} "
                f"({cfg.capacity_type if 'instead_of' not in state else 'on-demand'}) are Ready "
                f"with {cfg.procs_per_node} allocatable "
                f"{GPU_RESOURCE}{' and ' + EFA_RESOURCE if state['efa'] else ''} after "
                f"{waited:.0f} s (capacity_wait_s {cfg.capacity_wait_s}); teardown gives back "
                f"what came: {event['summary']}")

    def _fall_back(self, cfg: RunConfig, event: dict, state: dict) -> Wait:
        """capacity_fallback on-demand: the fallback node group scaled for the run instead (its
        nodes recorded as the run's), the first one given back, and the wait begins again."""
        fallback = self._fallback(cfg)
        log.warning("%s; capacity_fallback on-demand: scaling node group %s for the run "
                    "instead and giving %s back", self._missing_nodes(cfg, event, state),
                    fallback.nodegroup, cfg.nodegroup)
        eks = self._eks(cfg)
        types = nodegroup.check_capacity(eks, fallback, "on-demand")
        nodegroup.record_run_nodegroup(self._kube(cfg), cfg, fallback.nodegroup)
        wait = self._scale(eks, fallback, types, instead_of=cfg.nodegroup)
        nodegroup.give_back_nodes(
            eks, lambda: self._kube(cfg), cfg, {"scaling_config": state["before"]},
            lambda: self._reservations(cfg), self.update_retries, self.poll_interval)
        return wait

    # -- build_image ------------------------------------------------------------------------

    def build_image(self, cfg: RunConfig) -> dict | Wait:
        """Prebuilt, already in ECR (skipped), or built now (BuildKit Job or CodeBuild)."""
        session = aws_session(cfg.aws_conn_id)
        reservation = self._renewal(cfg)
        # The cluster client only when a BuildKit build needs it; a buildah build runs here.
        with renewed_while(reservation):
            started = start_image(cfg, session, lambda: self._kube(cfg),
                                  timeout=self.build_timeout)
        if started["pending"] is None:
            return finish_image(cfg, session, lambda: self._kube(cfg), started, "Complete", "")
        log.info("waiting deferred for the %s build of %s", started["pending"]["builder"],
                 started["image"])
        return self._wait_for_build(cfg, started, resume=self.build_done,
                                    reservation=reservation)

    @resumes
    def build_done(self, cfg: RunConfig, event: dict, state: dict) -> dict:
        """After the build's wait: clean up, report a failure, verify the tag in ECR."""
        return finish_image(cfg, aws_session(cfg.aws_conn_id), lambda: self._kube(cfg),
                            state["started"], event["state"], event["message"])

    # -- rendezvous -------------------------------------------------------------------------

    def rendezvous(self, cfg: RunConfig) -> dict:
        return reset_rendezvous(lambda: self._kube(cfg), cfg, self.poll_interval,
                                self.etcd_timeout)

    # -- preflight --------------------------------------------------------------------------

    def preflight(self, cfg: RunConfig, image: dict, rendezvous: dict) -> dict | Wait:
        """A job of its own on the run's nodes (trainer/preflight.py), judged against the
        instance type's profile and DCGM's XIDs; bad nodes cordoned, and replaced (then checked
        again) with replace_bad_nodes."""
        if not cfg.preflight:
            return {"skipped": True}
        return self._start_preflight(self._on_run_nodes(cfg), image["image"], tries=1)

    def _start_preflight(self, cfg: RunConfig, image: str, tries: int) -> Wait:
        name = job.start_preflight_job(self._kube(cfg), cfg, image)
        deadline = time.time() + PREFLIGHT_DEADLINE_S
        return self._wait_for_preflight(cfg, {"job": name, "image": image, "tries": tries,
                                              "deadline": deadline})

    def _wait_for_preflight(self, cfg: RunConfig, state: dict) -> Wait:
        return Wait(self._job_trigger(cfg, state["job"], deadline=state["deadline"]),
                    resume=self.preflight_wake, state=state, deadline=state["deadline"])

    @resumes
    def preflight_wake(self, cfg: RunConfig, event: dict, state: dict) -> dict | Wait:
        cfg = self._on_run_nodes(cfg)
        name, api = state["job"], self._kube(cfg)
        if event["status"] == "running":
            job.fail_unschedulable(api, cfg, name, launcher_for(cfg))
            return self._wait_for_preflight(cfg, state)
        if event["status"] != "succeeded":
            raise node_health.preflight_failure(api, cfg, name, event)
        verdict = node_health.preflight_verdict(api, cfg, name, lambda: self._s3(cfg))
        if verdict["ok"]:
            return {"ok": True, "summary": summary_line(verdict), "tries": state["tries"]}
        bad = verdict["bad_nodes"]
        node_health.cordon_nodes(api, bad)
        if bad and cfg.replace_bad_nodes and state["tries"] < PREFLIGHT_TRIES:
            replaced = node_health.replace_nodes(self._eks(cfg), api, cfg, bad)
            log.warning(failure_message(verdict, f"cordoned and replaced {', '.join(bad)} "
                        f"({', '.join(replaced)}); checking again when the new nodes are Ready"))
            return self._wait_for_nodes(cfg, {
                **state, "efa": INSTANCE_TYPES[cfg.instance_type].efa, "scaling_config": {},
                "nodegroup": cfg.nodegroup, "instance_types": list(gpu_class(cfg.instance_type)),
                "deadline": self._capacity_deadline(cfg)}, resume=self.preflight_nodes_ready)
        action = (f"cordoned {', '.join(bad)}" if bad else "no single node to blame") + (
            f"; {state['tries']} preflight(s), no more replacements" if cfg.replace_bad_nodes
            else "; set replace_bad_nodes to have them replaced")
        raise PreflightFailed(failure_message(verdict, action))

    @resumes
    def preflight_nodes_ready(self, cfg: RunConfig, event: dict, state: dict) -> Wait:
        self._nodes_came(cfg, event, state)  # fails as scale_up would
        return self._start_preflight(self._on_run_nodes(cfg), state["image"], state["tries"] + 1)

    # -- train ------------------------------------------------------------------------------

    def train(self, cfg: RunConfig, image: dict, rendezvous: dict) -> Wait:
        """Create (or adopt) the run's job, on the node group its nodes are in, and wait for
        it."""
        cfg = self._on_run_nodes(cfg)
        started = job.start_job(self._kube(cfg), cfg, image["image"])
        deadline = 0.0
        if not launcher_for(cfg).own_deadline and cfg.active_deadline_s:
            # From the job's creation (a retry keeps it); computed once, wall-clock.
            deadline = started["created"] + cfg.active_deadline_s
        return self._wait_for_job(cfg, {
            "job": started, "after": "", "deadline": deadline,
            "image": {k: image.get(k) for k in ("image", "image_tag")},
            "rendezvous": {k: rendezvous[k] for k in ("backend", "rdzv_id")}})

    def _wait_for_job(self, cfg: RunConfig, state: dict) -> Wait:
        return Wait(self._job_trigger(cfg, state["job"]["job"], state.get("deadline", 0.0)),
                    resume=self.job_wake, state=state)

    @resumes
    def job_wake(self, cfg: RunConfig, event: dict, state: dict) -> dict | Wait:
        """Each wake-up: the leader's new log lines into the task log; then wait again (the
        trigger renews the reservation), fail with the pods' reasons, or return the result."""
        cfg = self._on_run_nodes(cfg)
        name, api, launcher = state["job"]["job"], self._kube(cfg), launcher_for(cfg)
        state = {**state, "after": job.stream_leader_log(api, cfg.namespace, name,
                                                         state["after"], launcher)}
        log.info("%s %s: %s %s", launcher.kind, name, event["state"], event["message"])
        if event["status"] == "deadline":
            job.delete_job(api, cfg.namespace, name, launcher=launcher)
            raise TrainingFailed(
                f"{launcher.kind} {cfg.namespace}/{name} ran past active_deadline_s = "
                f"{cfg.active_deadline_s} s (from its creation): deleted it; teardown gives the "
                "nodes back")
        if event["status"] == "running":
            stop = RungWatch(cfg, lambda: self._s3(cfg)).poll() if is_trial(cfg) else None
            if stop is not None:  # a sweep's rule: the job deleted, its pods save and exit
                job.delete_job(api, cfg.namespace, name, launcher=launcher)
                return {**job.train_result(cfg, state["job"], state["image"],
                                           state["rendezvous"]),
                        "preemptions": state.get("preemptions", 0), "model_dir": None,
                        "stopped": {**stop, "stopped_at": None,
                                    "reason": stop_reason(stop, None)}}
            job.fail_unschedulable(api, cfg, name, launcher)
            state = self._follow_preemptions(cfg, api, name, state)
            state = node_health.move_off_xid_nodes(lambda: self._eks(cfg), api, cfg, name,
                                                   launcher, state)
            return self._wait_for_job(cfg, state)
        if event["status"] == "failed":
            report = job.failure_report(api, cfg.namespace, name, event["message"], launcher)
            raise TrainingFailed(job.first_failure(api, cfg, name, launcher,
                                                   lambda: self._s3(cfg)) + report)
        return {**job.train_result(cfg, state["job"], state["image"], state["rendezvous"]),
                "preemptions": state.get("preemptions", 0)}

    def _follow_preemptions(self, cfg: RunConfig, api: Any, name: str, state: dict) -> dict:
        """A job preempted and retried (its pods saved the step and exited 138; the operator,
        or the Job's podFailurePolicy, started them again) is the same job going on from the
        saved step; past max_preemptions the run fails (teardown deletes the job)."""
        launcher = launcher_for(cfg)
        count, source, seen = job.count_preemptions(api, cfg, name, launcher,
                                                    lambda: self._s3(cfg),
                                                    state.get("restarts_seen", []))
        if count > cfg.max_preemptions:
            raise TrainingFailed(
                f"{launcher.kind} {cfg.namespace}/{name} was preempted {count} times, more than "
                f"max_preemptions {cfg.max_preemptions} (counted from {source}): each notice's "
                "step was saved; the run stops here, and teardown deletes the job and gives the "
                "nodes back")
        # ExitCode retries a pod killed by a signal (137, 143) as it retries a saved notice, and
        # without end: restarts the history explains by no notice count as failures.
        failures = len(seen) - count if source.endswith("history.jsonl") else 0
        if failures > cfg.max_restarts:
            raise TrainingFailed(
                f"{launcher.kind} {cfg.namespace}/{name} was restarted {failures} times without "
                f"a notice's step saved (a pod killed: OOM, a node lost), more than "
                f"max_restarts {cfg.max_restarts}; teardown deletes the job and gives the nodes "
                "back")
        if count > state.get("preemptions", 0):
            log.warning("%s %s was preempted: %d of at most %d (max_preemptions; counted from "
                        "%s); the same job goes on from the step each notice saved",
                        launcher.kind, name, count, cfg.max_preemptions, source)
        return {**state, "preemptions": count, "restarts_seen": seen}

    # -- evaluate ---------------------------------------------------------------------------

    def evaluate(self, cfg: RunConfig, trained: dict, image: dict, champion: dict) -> Wait:
        """trainer.evaluate as a one-GPU job of the run's launcher (PyTorchJob or TrainJob) on
        the run's nodes (created, or adopted by a retry), then wait for it as for the training;
        teardown deletes it with the run's other jobs."""
        cfg = self._on_run_nodes(cfg)
        name = evaluation_job.start_evaluation_job(self._kube(cfg), cfg, image["image"],
                                                   champion.get("model_uri") or "")
        return self._wait_for_evaluation(cfg, {"job": name, "after": "",
                                               "started": time.time()})

    def _wait_for_evaluation(self, cfg: RunConfig, state: dict) -> Wait:
        return Wait(self._job_trigger(cfg, state["job"]), resume=self.evaluation_wake, state=state)

    @resumes
    def evaluation_wake(self, cfg: RunConfig, event: dict, state: dict) -> dict | Wait:
        cfg = self._on_run_nodes(cfg)
        name, api = state["job"], self._kube(cfg)
        state = {**state, "after": job.stream_leader_log(api, cfg.namespace, name,
                                                         state["after"], launcher_for(cfg))}
        if event["status"] == "running":
            return self._wait_for_evaluation(cfg, state)
        return evaluation_job.evaluation_outcome(api, cfg, name, event, state["started"],
                                                 lambda: self._s3(cfg))

    # -- collect_metrics --------------------------------------------------------------------

    def collect_metrics(self, cfg: RunConfig, trained: dict) -> dict:
        """The report from the trainer's metrics.jsonl and summary.json in the run directory (S3,
        or a shared file system this worker mounts), stored beside the model."""
        result = build_report(cfg.run_dir, lambda: self._s3(cfg), run_id=cfg.run_id,
                              status="success", config=cfg.to_dict(),
                              stages={"train": trained}, gpu=self.gpu_metrics(cfg, trained),
                              node_hourly_price=cfg.node_hourly_price, nodes=cfg.nodes,
                              plan=plan_run(cfg).to_dict())
        log.info("report of %s: %s", cfg.run_dir, result["report_html"])
        return result

    def gpu_metrics(self, cfg: RunConfig, trained: dict) -> dict:
        """The job's DCGM GPU metrics from Prometheus over the train stage's time window."""
        url, auth = prometheus_endpoint(cfg.prometheus_url, cfg.prometheus_conn_id)
        if not url:
            return missing_section("prometheus", "GPU metrics missing: no prometheus_url or "
                                   "prometheus_conn_id was given for this run", {})
        end = trained.get("finished") or time.time()
        start = trained.get("started") or end - trained["wall_time_s"]
        return prometheus_gpu_metrics(url, namespace=cfg.namespace, auth=auth,
                                      pod_regex=launcher_for(cfg).pod_regex(trained["job"]),
                                      start=start,
                                      end=end)

    # -- teardown ---------------------------------------------------------------------------

    def teardown(self, cfg: RunConfig, snapshot: dict) -> dict:
        """Stop the build the run waited on, delete the run's jobs, prepare_data pod and
        ConfigMaps, restore the node group; every step is tried."""
        done, problems = self._delete_run_objects(cfg)
        # Both node groups, when scale_up may have fallen back: each gives back only what no
        # other live run reserved (nothing, where this run held none).
        groups = [(cfg, snapshot, "scaling_config")]
        if snapshot.get("fallback"):
            groups.append((self._fallback(cfg), snapshot["fallback"], "fallback_scaling_config"))
        for group, snap, key in groups:
            try:
                done[key] = nodegroup.give_back_nodes(
                    self._eks(group), lambda group=group: self._kube(group), group, snap,
                    lambda group=group: self._reservations(group), self.update_retries,
                    self.poll_interval)
            except Exception as exc:
                problems.append(f"restoring node group {group.nodegroup} failed: {exc}")
        try:  # after the nodes are given back: the report is not worth an idle GPU
            report = self._failed_report(cfg)
            if report is not None:
                done["report"] = report
        except Exception as exc:
            log.warning("no failed-run report for %s: %s", cfg.run_dir, exc)
        log.info("teardown: %s", done)
        if problems:
            raise RuntimeError("teardown incomplete: " + "; ".join(problems))
        return done

    def release(self, cfg: RunConfig) -> dict:
        """A sweep's trial: its jobs, pods, ConfigMaps and rendezvous keys deleted, and a
        failed report when it has none; the nodes are the sweep's, which its teardown gives
        back."""
        done, problems = self._delete_run_objects(cfg)
        try:
            report = self._failed_report(cfg)
            if report is not None:
                done["report"] = report
        except Exception as exc:
            log.warning("no failed-run report for %s: %s", cfg.run_dir, exc)
        if problems:
            raise RuntimeError("release incomplete: " + "; ".join(problems))
        return done

    def _delete_run_objects(self, cfg: RunConfig) -> tuple[dict[str, Any], list[str]]:
        """The build it still waited on stopped (image_build.release_run_builds), the run's
        jobs, prepare_data pod and ConfigMaps deleted, its rendezvous keys too: (what was done,
        what failed)."""
        done: dict[str, Any] = {}
        problems: list[str] = []
        try:
            api = self._kube(cfg)
            done["deleted"] = (release_run_builds(api, cfg, lambda: self._codebuild(cfg)) +
                               job.delete_run_jobs(api, cfg) +
                               prepare_pod.delete_prepare_job(api, cfg) +
                               job.delete_run_configmaps(api, cfg))
        except Exception as exc:  # the node group must be restored even so
            problems.append(f"deleting the run's Kubernetes objects failed: {exc}")
        if cfg.rdzv_backend != "c10d":
            try:  # the id is unique per run; still, leave no keys behind
                done["rendezvous_keys"] = len(delete_run_keys(self._kube(cfg), cfg))
            except Exception as exc:  # no etcd service: nothing was kept there
                log.warning("could not delete rendezvous %s's keys on etcd service %s/%s: %s",
                            cfg.rdzv_id, cfg.namespace, cfg.etcd_service, exc)
        return done, problems

    def _failed_report(self, cfg: RunConfig) -> dict | None:
        """After a failed run: a failed report of what the trainer left, unless none is needed."""
        s3 = lambda: self._s3(cfg)  # noqa: E731
        if report_exists(cfg.run_dir, s3) or not has_outputs(cfg.run_dir, s3):
            return None
        return build_report(cfg.run_dir, s3, run_id=cfg.run_id, status="failed",
                            config=cfg.to_dict(), error=trainer_root_cause(cfg.run_dir, s3))
