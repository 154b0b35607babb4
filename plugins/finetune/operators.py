"""The DAG's long waits as operators: on the eks target they start the work and defer to a
trigger (no worker slot held while nodes come up or the job trains); on any other target they
run the target's stage in the task, as the other stages do.
"""

from __future__ import annotations

import logging
from typing import Any

from airflow.sdk import BaseOperator

from finetune.kube import TOKEN_REFRESH_S

log = logging.getLogger(__name__)


def _deferrable_target(run_config: dict[str, Any], poll_interval: float,
                       nodes_timeout: float = 1800.0) -> tuple[Any, Any, bool]:
    """(target, cfg, defers): only the eks target defers; its polls use the operator's pace."""
    from finetune.targets import run_target
    from finetune.targets.eks import EksTarget

    target, cfg = run_target(run_config)
    if isinstance(target, EksTarget):
        return EksTarget(poll_interval=poll_interval, nodes_timeout=nodes_timeout), cfg, True
    return target, cfg, False


class ScaleUpOperator(BaseOperator):
    """Make the run's nodes available: on eks, reserve them, then wait deferred for the node
    group to be ACTIVE and for the nodes to be Ready with their GPUs."""

    template_fields = ("run_config",)

    def __init__(self, *, run_config: Any, poll_interval: float = 15.0,
                 nodes_timeout: float = 1800.0, refresh_interval: float = TOKEN_REFRESH_S,
                 **kwargs: Any):
        super().__init__(**kwargs)
        self.run_config, self.poll_interval = run_config, poll_interval
        self.nodes_timeout, self.refresh_interval = nodes_timeout, refresh_interval

    def execute(self, context: Any) -> dict:
        from finetune.triggers import NodegroupActiveTrigger

        target, cfg, defers = _deferrable_target(self.run_config, self.poll_interval,
                                                 self.nodes_timeout)
        if not defers:
            return target.scale_up(cfg)
        scaling = target.request_nodes(cfg)
        self.defer(trigger=NodegroupActiveTrigger(
            cluster_name=cfg.cluster_name, nodegroup=cfg.nodegroup, aws_conn_id=cfg.aws_conn_id,
            poll_interval=self.poll_interval, timeout=self.nodes_timeout),
            method_name="nodegroup_active", kwargs={"scaling_config": scaling})

    def nodegroup_active(self, context: Any, event: dict, scaling_config: dict) -> None:
        from finetune.instance_types import INSTANCE_TYPES
        from finetune.targets.eks import kube_credentials
        from finetune.triggers import NodesReadyTrigger

        if event["status"] != "success":
            raise RuntimeError(event["message"])
        _, cfg, _ = _deferrable_target(self.run_config, self.poll_interval, self.nodes_timeout)
        self.defer(trigger=NodesReadyTrigger(
            credentials=kube_credentials(cfg), nodegroup=cfg.nodegroup, nodes=cfg.nodes,
            gpus=cfg.procs_per_node, efa=INSTANCE_TYPES[cfg.instance_type].efa or 0,
            poll_interval=self.poll_interval, timeout=self.nodes_timeout,
            refresh_interval=self.refresh_interval),
            method_name="execute_complete", kwargs={"scaling_config": scaling_config})

    def execute_complete(self, context: Any, event: dict, scaling_config: dict) -> dict:
        target, cfg, _ = _deferrable_target(self.run_config, self.poll_interval,
                                            self.nodes_timeout)
        if event["status"] != "success":
            raise target.nodes_timeout_error(cfg, event["nodes"], event["summary"])
        log.info("%d node(s) Ready: %s", len(event["nodes"]), event["nodes"])
        return {"nodegroup": cfg.nodegroup, "scaling_config": scaling_config,
                "nodes": event["nodes"]}


class BuildImageOperator(BaseOperator):
    """Provide the trainer image: on eks, start the build (BuildKit Job or CodeBuild) unless the
    image is prebuilt or its tag is already in ECR, and wait deferred for it to end; then clean
    up (the registry Secret), report a failure with the build log's tail, verify the tag."""

    template_fields = ("run_config",)

    def __init__(self, *, run_config: Any, poll_interval: float = 15.0,
                 refresh_interval: float = TOKEN_REFRESH_S, **kwargs: Any):
        super().__init__(**kwargs)
        self.run_config, self.poll_interval = run_config, poll_interval
        self.refresh_interval = refresh_interval

    def execute(self, context: Any) -> dict:
        from finetune.targets.eks import kube_credentials
        from finetune.triggers import ImageBuildTrigger

        target, cfg, defers = _deferrable_target(self.run_config, self.poll_interval)
        if not defers:
            return target.build_image(cfg)
        started = target.start_build(cfg)
        pending = started["pending"]
        if pending is None:
            return target.finish_build(cfg, started, "Complete", "")
        log.info("waiting deferred for the %s build of %s", pending["builder"], started["image"])
        credentials = kube_credentials(cfg) if pending["builder"] == "buildkit" else None
        self.defer(trigger=ImageBuildTrigger(
            pending=pending, credentials=credentials, aws_conn_id=cfg.aws_conn_id,
            poll_interval=self.poll_interval, refresh_interval=self.refresh_interval),
            method_name="execute_complete", kwargs={"started": started})

    def execute_complete(self, context: Any, event: dict, started: dict) -> dict:
        target, cfg, _ = _deferrable_target(self.run_config, self.poll_interval)
        return target.finish_build(cfg, started, event["state"], event["message"])


class TrainOperator(BaseOperator):
    """Run the trainer on every node: on eks, create (or adopt) the run's PyTorchJob and wait
    deferred; every `wake_after` seconds the task resumes to copy the leader's new log lines
    into the task log and renew the run's node reservation, then defers again."""

    template_fields = ("run_config", "image", "rendezvous")

    def __init__(self, *, run_config: Any, image: Any, rendezvous: Any,
                 poll_interval: float = 15.0, wake_after: float = 60.0,
                 refresh_interval: float = TOKEN_REFRESH_S, **kwargs: Any):
        super().__init__(**kwargs)
        self.run_config, self.image, self.rendezvous = run_config, image, rendezvous
        self.poll_interval, self.wake_after = poll_interval, wake_after
        self.refresh_interval = refresh_interval
        self._job: str | None = None

    def _target(self) -> tuple[Any, Any, bool]:
        return _deferrable_target(self.run_config, self.poll_interval)

    def execute(self, context: Any) -> dict:
        target, cfg, defers = self._target()
        if not defers:
            return target.train(cfg, self.image, self.rendezvous)
        job = target.start_job(cfg, self.image)
        self._job = job["job"]
        self._defer(cfg, job, after="")

    def _defer(self, cfg: Any, job: dict, after: str) -> None:
        from finetune.targets.eks import kube_credentials
        from finetune.triggers import PyTorchJobTrigger

        self.defer(trigger=PyTorchJobTrigger(
            credentials=kube_credentials(cfg), namespace=cfg.namespace, name=job["job"],
            poll_interval=self.poll_interval, wake_after=self.wake_after,
            refresh_interval=self.refresh_interval),
            method_name="execute_complete", kwargs={"job": job, "after": after})

    def execute_complete(self, context: Any, event: dict, job: dict, after: str) -> dict:
        target, cfg, _ = self._target()
        self._job = job["job"]
        after = target.stream_leader_log(cfg, job["job"], after)
        if event["status"] == "running":
            log.info("PyTorchJob %s: %s %s", job["job"], event["state"], event["message"])
            try:
                target.renew_reservation(cfg)
            except Exception as exc:  # the reservation outlives a few missed renewals
                log.warning("could not renew the node reservation: %s", exc)
            self._defer(cfg, job, after)
        if event["status"] == "failed":
            raise RuntimeError(target.failure_report(cfg, job["job"], event["message"]))
        log.info("PyTorchJob %s: %s %s", job["job"], event["state"], event["message"])
        return target.train_result(cfg, job, self.image, self.rendezvous)

    def on_kill(self) -> None:
        """Killed while on a worker: stop the training (the trigger does it while deferred)."""
        if self._job is None:
            return
        target, cfg, defers = self._target()
        if defers and target.delete_job(cfg, self._job):
            log.info("deleted PyTorchJob %s/%s", cfg.namespace, self._job)
