"""Kubernetes manifests of the eks target, built from the run config and its plan, and the label
keys, ports and resource names they share with the parts that find those objects: pure, no I/O
(the plan's model shape is the one validate read).

- `pytorchjob_manifest`: the Kubeflow PyTorchJob (kubeflow.org/v1) that runs the FSDP trainer
  with torchrun on every node (elasticPolicy: the operator sets torchrun's PET_* variables),
  through trainer.launch, retried on a saved notice (restartPolicy ExitCode) within the plan's
  grace;
- `trainer_configmap_manifest`: the trainer's JSON config, mounted into every worker;
- `nodegroup_record_manifest`: which node group the run's nodes are in after a fallback;
- `etcd_manifests`: the etcd (v2 API) Deployment and Service torchrun's etcd rendezvous uses;
- `trainjob_manifest`: the Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1) that
  references the project's ClusterTrainingRuntime and sets what the run decides;
- `training_runtime_manifest`: that ClusterTrainingRuntime (containers/k8s/trainjob-runtime.yaml);
- `prepare_job_manifest`: the batch/v1 Job that runs the prepare_data stage on a CPU node
  (prepare_on pod).
"""

from __future__ import annotations

import json
from typing import Any

from finetune.config import RunConfig
from finetune.names import DNS_SUBDOMAIN, LABEL_VALUE, dns_label
from finetune.run_plan import plan_run
from finetune.targets.base import TORCHRUN_ENV
from finetune.trainer_config import trainer_config
from finetune_contract.checkpoint_time import (
    DEFAULT_GRACE_S,
    SHUTDOWN_TIMEOUT_ENV,
    agent_shutdown_s,
    volume_mounts,
)
from finetune_contract.instance_types import (
    GPU_RESOURCE,
    INSTANCE_TYPES,
    InstanceProfile,
    gpu_class,
)
from finetune_contract.parallel_dims import is_elastic
from finetune_contract.run_history import PREEMPTED_EXIT_CODE

PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, PYTORCHJOB_PLURAL = "kubeflow.org", "v1", "pytorchjobs"
PYTORCHJOB_API_VERSION = f"{PYTORCHJOB_GROUP}/{PYTORCHJOB_VERSION}"
TRAINER_GROUP, TRAINER_VERSION = "trainer.kubeflow.org", "v1alpha1"
TRAINJOB_PLURAL = "trainjobs"
TRAINER_API_VERSION = f"{TRAINER_GROUP}/{TRAINER_VERSION}"
# The ClusterTrainingRuntime the project ships (containers/k8s/trainjob-runtime.yaml).
TRAINING_RUNTIME = "llm-finetune-torch"
# Kubeflow Trainer's names: the trainer's replicated job (its pods are <job>-node-0-<rank>-*),
# the trainer container, and the label that marks the replicated job as the trainer.
TRAINER_REPLICATED_JOB = "node"
TRAINER_CONTAINER = "node"
TRAINER_ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
# JobSet's whole-group restarts (failurePolicy.maxRestarts): each recreates every pod, which
# resumes from the newest checkpoint.
JOBSET_MAX_RESTARTS = 3
# The grace every TrainJob's pods get: a TrainJob cannot set terminationGracePeriodSeconds
# (Trainer v2.0's podSpecOverrides has no such field), so the runtime sets one for all runs, the
# most a run planned here needs for its step and save (a 70B run on 4 p5 nodes: 563 s); validate
# refuses a trainjob run that needs more (launchers.launcher_plan_problems).
TRAINJOB_GRACE_S = 3 * DEFAULT_GRACE_S
# Labels JobSet and the Job controller put on a TrainJob's pods (the JobSet is named after it).
LABEL_JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
LABEL_REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"
LABEL_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
LABEL_RESTART_ATTEMPT = "jobset.sigs.k8s.io/restart-attempt"

# Labels tying the cluster's objects to the DAG run (values are DNS-safe, at most 63 chars).
LABEL_RUN = "finetune.airflow.apache.org/run"
METRICS_PORT_NAME = "metrics"  # the trainer's Prometheus port, when metrics_port is set
LABEL_APP = "app.kubernetes.io/managed-by"
APP = "llm-finetune-airflow"
# Labels the training operator puts on a job's pods.
LABEL_JOB_NAME = "training.kubeflow.org/job-name"
LABEL_REPLICA_TYPE = "training.kubeflow.org/replica-type"
LABEL_REPLICA_INDEX = "training.kubeflow.org/replica-index"

TRAINER_CONFIG_DIR = "/etc/finetune"
TRAINER_CONFIG_FILE = "trainer_config.json"
CONTAINER_NAME = "pytorch"  # the operator finds the training container by this name
ETCD_PORT = 2379
C10D_PORT = 29400
ETCD_IMAGE = "quay.io/coreos/etcd:v3.4.35"
# The taint key the EFA device plugin tolerates (not the resource name): a node tainted with
# the resource name never gets the plugin, so never advertises EFA.
EFA_TAINT = "aws.amazon.com/efa"
NODEGROUP_LABEL = "eks.amazonaws.com/nodegroup"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
HF_TOKEN_DEFAULT_KEY = "token"
TTL_AFTER_FINISHED_S = 3600
BACKOFF_LIMIT = 3
# What the training containers run: torchrun, through the launcher that exits
# PREEMPTED_EXIT_CODE once the workers saved the step a notice interrupted (trainer/launch.py).
LAUNCH_COMMAND = ["python", "-m", "trainer.launch"]

# NCCL diagnostics and torch's NCCL flight recorder: a hang dumps each rank's last collectives.
# What depends on the instance type (EFA, RDMA) is its profile's (`InstanceProfile.nccl_env`).
NCCL_ENV = {
    "NCCL_DEBUG": "WARN",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_FR_BUFFER_SIZE": "20000",  # its old name TORCH_NCCL_TRACE_BUFFER_SIZE warns
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/tmp/nccl_trace_rank_",
}


def run_labels(cfg: RunConfig) -> dict[str, str]:
    return {LABEL_APP: APP, LABEL_RUN: cfg.rdzv_id}


def run_selector(cfg: RunConfig) -> str:
    return ",".join(f"{k}={v}" for k, v in run_labels(cfg).items())


def job_name(cfg: RunConfig) -> str:
    """The PyTorchJob's name: a DNS-1035 label short enough for '<name>-worker-127' pods."""
    return dns_label("ft", cfg.rdzv_id, max_len=45)


# What a job of the run runs: the training, or the preflight check of its nodes before it.
LABEL_PROGRAM = "finetune.airflow.apache.org/program"
TRAIN, PREFLIGHT, EVALUATE = "train", "preflight", "evaluate"
PREPARE = "prepare-data"
PREFLIGHT_DEADLINE_S = 900  # NVML, a matmul and a few all-reduces: minutes, not more


def program_job_name(cfg: RunConfig, program: str) -> str:
    if program == PREPARE:
        return f"{job_name(cfg)}-prep"
    return job_name(cfg) if program == TRAIN else f"{job_name(cfg)}-pf"


def _program_args(cfg: RunConfig, program: str) -> list[str]:
    if program == PREFLIGHT:
        return ["-m", "trainer.preflight", "--out", cfg.run_dir]
    return ["-m", "trainer.train", "--config", f"{TRAINER_CONFIG_DIR}/{TRAINER_CONFIG_FILE}"]


def configmap_name(cfg: RunConfig) -> str:
    return f"{job_name(cfg)}-config"


def hf_token_ref(secret: str) -> tuple[str, str]:
    """'name' or 'name:key' -> (name, key)."""
    name, _, key = secret.partition(":")
    return name, key or HF_TOKEN_DEFAULT_KEY


def rendezvous_host(cfg: RunConfig) -> tuple[str, int]:
    """Where torchrun's rendezvous lives: the etcd service, or worker 0's service for c10d;
    with a TrainJob, node 0's host in the JobSet's headless service (Kubeflow Trainer's
    PET_MASTER_ADDR and PET_MASTER_PORT)."""
    if cfg.launcher == "trainjob":
        name = job_name(cfg)
        return f"{name}-{TRAINER_REPLICATED_JOB}-0-0.{name}", C10D_PORT
    if cfg.rdzv_backend == "c10d":
        return f"{job_name(cfg)}-worker-0", C10D_PORT
    return f"{cfg.etcd_service}.{cfg.namespace}.svc", ETCD_PORT


def nodegroup_record_name(cfg: RunConfig) -> str:
    return f"{job_name(cfg)}-nodegroup"


def nodegroup_record_manifest(cfg: RunConfig, nodegroup: str) -> dict[str, Any]:
    """Where the run's nodes are once scale_up fell back to another node group
    (capacity_fallback): the stages after it place their pods there."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": nodegroup_record_name(cfg), "namespace": cfg.namespace,
                     "labels": run_labels(cfg)},
        "data": {"nodegroup": nodegroup, "instead_of": cfg.nodegroup},
    }


def trainer_configmap_manifest(cfg: RunConfig) -> dict[str, Any]:
    data = trainer_config(cfg, local_paths=False)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": configmap_name(cfg), "namespace": cfg.namespace,
                     "labels": run_labels(cfg)},
        "data": {TRAINER_CONFIG_FILE: json.dumps(data, indent=2, sort_keys=True)},
    }


# What every training pod gets, whatever the run (the ClusterTrainingRuntime holds it).
COMMON_ENV = {"PYTHONUNBUFFERED": "1", **TORCHRUN_ENV, **NCCL_ENV}


def _env(cfg: RunConfig, profile: InstanceProfile | None,
         common: bool = True) -> list[dict[str, Any]]:
    """The pods' environment; profile None: a CPU pod (no torchrun, no NCCL)."""
    plain = {**(COMMON_ENV if common else {}), "FINETUNE_RUN_ID": cfg.run_id,
             **(profile.nccl_env if profile else {})}
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in plain.items()]
    # The node the pod runs on: the preflight names a bad node by it.
    env.append({"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
    if cfg.hf_token_secret:
        name, key = hf_token_ref(cfg.hf_token_secret)
        # Never the token's value in the manifest: the kubelet reads it from the Secret.
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": name, "key": key}}})
    return env


# The image's user (containers/trainer/Dockerfile TRAINER_UID): the pods run as it, never root.
TRAINER_UID = 1000
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Mount paths the pod already uses: a volume may not take one.
RESERVED_MOUNTS = (TRAINER_CONFIG_DIR, "/dev/shm", "/app")


def parse_volumes(text: str) -> list[tuple[str, str]]:
    """`claim:/path,claim2:/path2` -> [(claim, path)]; ValueError naming what is wrong."""
    volumes = []
    for claim, path in volume_mounts(text):
        part = f"{claim}:{path}"
        if not DNS_SUBDOMAIN.match(claim) or not path.startswith("/") \
                or path.rstrip("/") in ("", *RESERVED_MOUNTS) or ".." in path.split("/"):
            raise ValueError(f"{part[:80]!r} is not claim:/mount/path (a PersistentVolumeClaim "
                             "name and an absolute path other than /, /app, /dev/shm and "
                             f"{TRAINER_CONFIG_DIR})")
        volumes.append((claim, path.rstrip("/")))
    paths = [path for _, path in volumes]
    if len(set(paths)) != len(paths):
        raise ValueError("two volumes share a mount path")
    return volumes


def parse_node_selector(text: str) -> dict[str, str]:
    """`label=value,label2=value2` -> {label: value}; ValueError naming what is wrong."""
    selector = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        prefix, slash, name = key.rpartition("/")
        if not sep or not name or len(name) > 63 or not LABEL_VALUE.match(name) \
                or (slash and not DNS_SUBDOMAIN.match(prefix)) or not LABEL_VALUE.match(value):
            raise ValueError(f"{part[:80]!r} is not label=value (a Kubernetes label key, "
                             "[prefix/]name, and a value of at most 63 letters, digits, '-', "
                             "'_' and '.')")
        if key in selector:
            raise ValueError(f"label {key[:80]!r} is given twice")
        selector[key] = value
    return selector


# The prepare_data pod's scratch space: the data set downloaded from S3 and the set written
# before its upload (the container's /tmp).
PREPARE_SCRATCH_GIB = 100
PREPARE_DEADLINE_S = 6 * 3600


def prepare_job_manifest(cfg: RunConfig, image: str) -> dict[str, Any]:
    """The Job that prepares the run's data set on a CPU node (prepare_on pod): the trainer
    image runs trainer.prepare_data with the run's trainer config (the ConfigMap the training
    mounts), writes the set to <output_dir>/prepared_data/<key>/ (stats.json last) and the
    stage's record to the run directory. No GPU is requested and no GPU taint tolerated, so
    it never holds a GPU node; one try (the task decides), a deadline, kept an hour to read."""
    from finetune_data.prepared_set import prepared_root

    from finetune_contract.fields import PREPARE_DATA_FILE

    volumes = parse_volumes(cfg.volumes)
    name = program_job_name(cfg, PREPARE)
    labels = {**run_labels(cfg), LABEL_PROGRAM: PREPARE}
    memory = f"{cfg.prepare_memory_gib}Gi"
    container = {
        "name": CONTAINER_NAME,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["python", "-m", "trainer.prepare_data"],
        "args": ["--config", f"{TRAINER_CONFIG_DIR}/{TRAINER_CONFIG_FILE}",
                 "--prepared-root", prepared_root(cfg.output_dir),
                 "--record", f"{cfg.run_dir.rstrip('/')}/{PREPARE_DATA_FILE}",
                 # the pod's cores, not the node's (sched_getaffinity sees the node's)
                 "--num-proc", str(cfg.prepare_cpu)],
        "env": [*_env(cfg, None), {"name": "TMPDIR", "value": "/scratch"},
                {"name": "HF_HOME", "value": "/scratch/hf"}],
        "resources": {
            "requests": {"cpu": str(cfg.prepare_cpu), "memory": memory,
                         "ephemeral-storage": f"{PREPARE_SCRATCH_GIB}Gi"},
            "limits": {"memory": memory},
        },
        # The first cause (trainer.prepare_data writes it there) in the pod's status.
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [
            {"name": "trainer-config", "mountPath": TRAINER_CONFIG_DIR, "readOnly": True},
            {"name": "scratch", "mountPath": "/scratch"},
            *({"name": f"data-{i}", "mountPath": path} for i, (_, path) in enumerate(volumes)),
        ],
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [container],
        "securityContext": {"runAsNonRoot": True, "runAsUser": TRAINER_UID,
                            "runAsGroup": TRAINER_UID, "fsGroup": TRAINER_UID},
        "volumes": [
            {"name": "trainer-config", "configMap": {"name": configmap_name(cfg)}},
            {"name": "scratch", "emptyDir": {"sizeLimit": f"{PREPARE_SCRATCH_GIB}Gi"}},
            *({"name": f"data-{i}", "persistentVolumeClaim": {"claimName": claim}}
              for i, (claim, _) in enumerate(volumes)),
        ],
    }
    selector = parse_node_selector(cfg.prepare_node_selector)
    if selector:
        pod_spec["nodeSelector"] = selector
    if cfg.service_account:
        pod_spec["serviceAccountName"] = cfg.service_account
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": cfg.namespace, "labels": labels,
                     "annotations": {"finetune.airflow.apache.org/run-id": cfg.run_id}},
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": PREPARE_DEADLINE_S,
            "ttlSecondsAfterFinished": TTL_AFTER_FINISHED_S,
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def node_selector(cfg: RunConfig) -> dict[str, str]:
    """The run's node group, and its instance type where only that type holds the pods (a
    pod's requests are its instance type's; `gpu_class`: the types of the same GPUs with room
    for them, any of which a spot node group may bring: `instance_type_affinity` then)."""
    selector = {NODEGROUP_LABEL: cfg.nodegroup}
    if gpu_class(cfg.instance_type) == (cfg.instance_type,):
        selector[INSTANCE_TYPE_LABEL] = cfg.instance_type
    return selector


def instance_type_affinity(cfg: RunConfig) -> dict[str, Any] | None:
    """Any instance type of the run's GPU class, where there are several (None: one, which
    `node_selector` names)."""
    types = gpu_class(cfg.instance_type)
    if len(types) == 1:
        return None
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": INSTANCE_TYPE_LABEL, "operator": "In", "values": list(types)}]}]}}}


def pod_grace_s(cfg: RunConfig) -> int:
    """The training pods' terminationGracePeriodSeconds: the plan's (finetune.run_plan), the
    step in progress and its save with room."""
    return plan_run(cfg).grace_s


def elastic_policy(cfg: RunConfig, program: str = TRAIN) -> dict[str, Any]:
    """The node range and restarts of the PyTorchJob's torchrun (the operator's PET_NNODES
    min:max, PET_MAX_RESTARTS, PET_RDZV_CONF): an elastic training (min_nodes) goes on with
    min_nodes..nodes nodes once node_wait_s has passed without the others (torchrun's
    last_call_timeout); anything else needs all its nodes."""
    elastic = program == TRAIN and is_elastic(cfg)
    policy: dict[str, Any] = {
        "minReplicas": cfg.min_nodes if elastic else cfg.nodes,
        "maxReplicas": cfg.nodes,
        "maxRestarts": cfg.max_restarts if program == TRAIN else 0,
    }
    if elastic:
        policy["rdzvConf"] = [{"key": "last_call_timeout", "value": str(cfg.node_wait_s)}]
    return policy


def pytorchjob_manifest(cfg: RunConfig, image: str, *,
                        ttl_after_finished_s: int = TTL_AFTER_FINISHED_S,
                        backoff_limit: int = BACKOFF_LIMIT,
                        program: str = TRAIN) -> dict[str, Any]:
    """The PyTorchJob for this run: one Worker per node, torchrun with nProcPerNode GPUs each.

    The training's workers are retried by the operator on a retryable exit (restartPolicy
    ExitCode: 130, 137, 138, 143; a saved notice exits PREEMPTED_EXIT_CODE, 138) without
    counting against backoffLimit (kubeflow/trainer#2045: ExitCode's retries never do, so the
    train task counts the preemptions, max_preemptions), and fail the job on any other code;
    a notice gives them the plan's grace. `program` PREFLIGHT: the check of the nodes before
    training, a job of its own with its own c10d rendezvous, no restarts and a short deadline."""
    itype = INSTANCE_TYPES[cfg.instance_type]
    volumes = parse_volumes(cfg.volumes)
    host, port = rendezvous_host(cfg)
    name, rdzv_id, rdzv_backend = job_name(cfg), cfg.rdzv_id, cfg.rdzv_backend
    if program == PREFLIGHT:
        name = program_job_name(cfg, program)
        host, port, rdzv_id, rdzv_backend = f"{name}-worker-0", C10D_PORT, f"{rdzv_id}-pf", "c10d"
        backoff_limit = 0
    efa = itype.efa > 0
    resources = itype.resources(cfg.procs_per_node)
    grace = pod_grace_s(cfg)
    container = {
        "name": CONTAINER_NAME,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        # torchrun reads nodes, rendezvous and processes per node from the operator's PET_* env.
        "command": list(LAUNCH_COMMAND),
        "args": _program_args(cfg, program),
        "env": [*_env(cfg, itype),
                {"name": SHUTDOWN_TIMEOUT_ENV, "value": str(agent_shutdown_s(grace))}],
        "resources": resources,
        "volumeMounts": [
            {"name": "trainer-config", "mountPath": TRAINER_CONFIG_DIR, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            *({"name": f"data-{i}", "mountPath": path} for i, (_, path) in enumerate(volumes)),
        ],
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    template_metadata: dict[str, Any] = {"labels": run_labels(cfg)}
    if cfg.metrics_port:
        # rank 0's Prometheus endpoint (only rank 0 serves it, so no scrape annotation on every
        # worker): containers/observability/prometheus-scrape.yaml keeps worker 0's port by name
        container["ports"] = [{"name": METRICS_PORT_NAME, "containerPort": cfg.metrics_port}]
    # The GPU nodes' taint (containers/k8s/eksctl-cluster.yaml), and the EFA device plugin's
    # own taint key, should a cluster taint its EFA nodes with it.
    tolerations = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    if efa:
        tolerations.append({"key": EFA_TAINT, "operator": "Exists", "effect": "NoSchedule"})
    run_policy: dict[str, Any] = {
        # Finished pods stay (until the TTL) so a failure's reasons and logs can be read.
        "cleanPodPolicy": "Running",
        "ttlSecondsAfterFinished": ttl_after_finished_s,
        "backoffLimit": backoff_limit,
    }
    if program == PREFLIGHT:
        run_policy["activeDeadlineSeconds"] = PREFLIGHT_DEADLINE_S
    elif cfg.active_deadline_s:
        run_policy["activeDeadlineSeconds"] = cfg.active_deadline_s
    job_labels = {**run_labels(cfg), LABEL_PROGRAM: program}
    if cfg.queue_name:
        # Kueue admits suspended jobs of its queues; it unsuspends the job when it fits.
        job_labels[KUEUE_QUEUE_LABEL] = cfg.queue_name
        run_policy["suspend"] = True
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "nodeSelector": node_selector(cfg),
        "tolerations": tolerations,
        # A notice (a spot reclaim, a drain): the step in progress and its save.
        "terminationGracePeriodSeconds": grace,
        "securityContext": {"runAsNonRoot": True, "runAsUser": TRAINER_UID,
                            "runAsGroup": TRAINER_UID, "fsGroup": TRAINER_UID},
        "volumes": [
            {"name": "trainer-config", "configMap": {"name": configmap_name(cfg)}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{itype.shm_gib}Gi"}},
            *({"name": f"data-{i}", "persistentVolumeClaim": {"claimName": claim}}
              for i, (claim, _) in enumerate(volumes)),
        ],
    }
    affinity = instance_type_affinity(cfg)
    if affinity:
        pod_spec["affinity"] = affinity
    if cfg.service_account:
        pod_spec["serviceAccountName"] = cfg.service_account
    return {
        "apiVersion": PYTORCHJOB_API_VERSION,
        "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": cfg.namespace,
                     "labels": job_labels,
                     "annotations": {"finetune.airflow.apache.org/run-id": cfg.run_id}},
        "spec": {
            "elasticPolicy": {
                "rdzvBackend": rdzv_backend,
                "rdzvHost": host,
                "rdzvPort": port,
                "rdzvId": rdzv_id,
                **elastic_policy(cfg, program),
            },
            # Not elasticPolicy.nProcPerNode, deprecated since the operator's v1.7.
            "nprocPerNode": str(cfg.procs_per_node),
            "runPolicy": run_policy,
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": cfg.nodes,
                    # The preflight keeps its pods in place: it has no restarts to give.
                    "restartPolicy": "ExitCode" if program == TRAIN else "OnFailure",
                    "template": {"metadata": template_metadata, "spec": pod_spec},
                },
            },
        },
    }


def etcd_manifests(namespace: str, name: str = "etcd",
                   image: str = ETCD_IMAGE) -> list[dict[str, Any]]:
    """A one-member etcd 3.4 with the v2 API (torch's etcd backends) and its Service."""
    labels = {"app.kubernetes.io/name": name, LABEL_APP: APP}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            # Rendezvous state is disposable: a restart (etcd_reset=restart) starts it empty.
            "strategy": {"type": "Recreate"},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [{
                        "name": "etcd",
                        "image": image,
                        "command": [
                            "/usr/local/bin/etcd", "--name", name, "--data-dir", "/var/lib/etcd",
                            "--enable-v2=true",
                            "--listen-client-urls", f"http://0.0.0.0:{ETCD_PORT}",
                            "--advertise-client-urls", f"http://{name}:{ETCD_PORT}",
                        ],
                        "ports": [{"name": "client", "containerPort": ETCD_PORT}],
                        "readinessProbe": {"httpGet": {"path": "/health", "port": ETCD_PORT},
                                           "periodSeconds": 5},
                        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"},
                                      "limits": {"memory": "2Gi"}},
                        "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}],
                    }],
                    "volumes": [{"name": "data", "emptyDir": {}}],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {"selector": labels,
                 "ports": [{"name": "client", "port": ETCD_PORT, "targetPort": ETCD_PORT}]},
    }
    return [deployment, service]


# -- Kubeflow Trainer v2 ------------------------------------------------------------------------


def _trainer_args() -> list[str]:
    return ["-m", "trainer.train", "--config", f"{TRAINER_CONFIG_DIR}/{TRAINER_CONFIG_FILE}"]


def training_runtime_manifest(name: str = TRAINING_RUNTIME,
                              max_restarts: int = JOBSET_MAX_RESTARTS) -> dict[str, Any]:
    """The ClusterTrainingRuntime every TrainJob of the project references: torch distributed
    (Kubeflow Trainer sets torchrun's PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK and a static
    rendezvous on node 0 with PET_MASTER_ADDR/PORT), on nodes tainted for GPUs (and EFA), with
    a memory-backed /dev/shm, the NCCL environment, never root.

    A pod that fails fails its Job (backoffLimit 0, restartPolicy Never): a static rendezvous
    cannot take one restarted node back into a running group, so JobSet restarts the whole
    group (failurePolicy.maxRestarts), and the trainer resumes from its newest checkpoint. A
    pod that saved its step after a notice (exit PREEMPTED_EXIT_CODE: every rank's does) is
    replaced without counting (the Job's podFailurePolicy Ignore; JobSet's own failure rules,
    RestartJobSetAndIgnoreMaxRestarts, are not in Trainer v2.0's JobSet), so the new pods meet
    on a new rendezvous and resume from that step; the train task bounds them with
    max_preemptions. Every run's pods get TRAINJOB_GRACE_S for a notice.
    """
    container = {
        "name": TRAINER_CONTAINER,
        "command": list(LAUNCH_COMMAND),
        "args": _trainer_args(),
        "env": [{"name": k, "value": v} for k, v in {
            **COMMON_ENV, SHUTDOWN_TIMEOUT_ENV: str(agent_shutdown_s(TRAINJOB_GRACE_S))}.items()],
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    pod_spec = {
        "restartPolicy": "Never",
        "containers": [container],
        # The GPU nodes' taint (eksctl-cluster.yaml), and the EFA device plugin's own key.
        "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},
                        {"key": EFA_TAINT, "operator": "Exists", "effect": "NoSchedule"}],
        "securityContext": {"runAsNonRoot": True, "runAsUser": TRAINER_UID,
                            "runAsGroup": TRAINER_UID, "fsGroup": TRAINER_UID},
        "terminationGracePeriodSeconds": TRAINJOB_GRACE_S,
        # No sizeLimit: one runtime serves every instance type; the pod's memory bounds it.
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }
    return {
        "apiVersion": TRAINER_API_VERSION,
        "kind": "ClusterTrainingRuntime",
        "metadata": {"name": name, "labels": {LABEL_APP: APP,
                                              "trainer.kubeflow.org/framework": "torch"}},
        "spec": {
            "mlPolicy": {"numNodes": 1, "torch": {"numProcPerNode": "auto"}},
            "template": {"spec": {
                "failurePolicy": {"maxRestarts": max_restarts},
                "replicatedJobs": [{
                    "name": TRAINER_REPLICATED_JOB,
                    "template": {
                        "metadata": {"labels": {TRAINER_ANCESTOR_LABEL: "trainer"}},
                        "spec": {
                            "backoffLimit": 0,
                            "podFailurePolicy": {"rules": [{
                                "action": "Ignore",
                                "onExitCodes": {"containerName": TRAINER_CONTAINER,
                                                "operator": "In",
                                                "values": [PREEMPTED_EXIT_CODE]}}]},
                            "template": {"spec": pod_spec},
                        },
                    },
                }],
            }},
        },
    }


def trainjob_manifest(cfg: RunConfig, image: str, runtime: str = TRAINING_RUNTIME,
                      program: str = TRAIN) -> dict[str, Any]:
    """The run's TrainJob: the runtime's template with what this run sets (nodes, processes
    per node, image, resources, environment, placement, volumes, service account).
    `program` PREFLIGHT: the check of the nodes, a TrainJob of its own."""
    itype = INSTANCE_TYPES[cfg.instance_type]
    volumes = parse_volumes(cfg.volumes)
    override: dict[str, Any] = {
        "targetJobs": [{"name": TRAINER_REPLICATED_JOB}],
        # No affinity in a TrainJob's overrides: with several types of the GPU class the node
        # group alone places the pods (scale_up checked that all its types hold them).
        "nodeSelector": node_selector(cfg),
        "volumes": [
            {"name": "trainer-config", "configMap": {"name": configmap_name(cfg)}},
            *({"name": f"data-{i}", "persistentVolumeClaim": {"claimName": claim}}
              for i, (claim, _) in enumerate(volumes)),
        ],
        "containers": [{"name": TRAINER_CONTAINER, "volumeMounts": [
            {"name": "trainer-config", "mountPath": TRAINER_CONFIG_DIR, "readOnly": True},
            *({"name": f"data-{i}", "mountPath": path} for i, (_, path) in enumerate(volumes)),
        ]}],
    }
    if cfg.service_account:
        override["serviceAccountName"] = cfg.service_account
    labels = {**run_labels(cfg), LABEL_PROGRAM: program}
    spec: dict[str, Any] = {
        "runtimeRef": {"name": runtime, "apiGroup": TRAINER_GROUP,
                       "kind": "ClusterTrainingRuntime"},
        "labels": run_labels(cfg),  # onto the JobSet and its Jobs
        "trainer": {
            "image": image,
            "command": list(LAUNCH_COMMAND),
            "args": _program_args(cfg, program),
            "numNodes": cfg.nodes,
            "numProcPerNode": cfg.procs_per_node,
            "resourcesPerNode": itype.resources(cfg.procs_per_node),
            # Merged with the runtime's: the instance type's NCCL/EFA environment.
            "env": _env(cfg, itype, common=False),
        },
        "podSpecOverrides": [override],
    }
    if cfg.queue_name:
        labels[KUEUE_QUEUE_LABEL] = cfg.queue_name
        spec["suspend"] = True  # Kueue unsuspends it when admitted
    return {
        "apiVersion": TRAINER_API_VERSION,
        "kind": "TrainJob",
        "metadata": {"name": program_job_name(cfg, program), "namespace": cfg.namespace,
                     "labels": labels,
                     "annotations": {"finetune.airflow.apache.org/run-id": cfg.run_id}},
        "spec": spec,
    }


def evaluation_job_name(cfg: RunConfig) -> str:
    return dns_label("ev", cfg.rdzv_id, max_len=45)


def _evaluation_container(cfg: RunConfig, champion_model: str) -> dict[str, Any]:
    """What the evaluation job's container runs and gets, whichever the launcher: plain python
    on one GPU, without EFA or the NCCL environment (nothing to talk to)."""
    profile = INSTANCE_TYPES[cfg.instance_type]
    requests = {k: v for k, v in profile.resources(1)["requests"].items()
                if k in ("cpu", "memory", GPU_RESOURCE)}
    return {
        "command": ["python", "-m", "trainer.evaluate"],
        "args": ["--config", f"{TRAINER_CONFIG_DIR}/{TRAINER_CONFIG_FILE}",
                 *(["--champion", champion_model] if champion_model else [])],
        "resources": {"requests": requests, "limits": {GPU_RESOURCE: 1}},
        "drop_env": {*profile.nccl_env, SHUTDOWN_TIMEOUT_ENV},
    }


def _as_evaluation(manifest: dict[str, Any], cfg: RunConfig) -> dict[str, Any]:
    """The metadata every evaluation job gets: its own name and program label, and no Kueue
    queue (admitted with the training's quota already)."""
    manifest["metadata"]["name"] = evaluation_job_name(cfg)
    manifest["metadata"]["labels"][LABEL_PROGRAM] = EVALUATE
    manifest["metadata"]["labels"].pop(KUEUE_QUEUE_LABEL, None)
    return manifest


def evaluation_job_manifest(cfg: RunConfig, image: str, champion_model: str = "") -> dict:
    """The evaluate stage's PyTorchJob: the training's pod (image, config, volumes, node group)
    as one worker with one GPU running trainer.evaluate, on the run's nodes before teardown."""
    manifest = _as_evaluation(pytorchjob_manifest(cfg, image, backoff_limit=0), cfg)
    name, spec = manifest["metadata"]["name"], manifest["spec"]
    # One worker; the operator's PET_* variables are there, and unused by a plain python.
    spec["elasticPolicy"].update(rdzvBackend="c10d", rdzvHost=f"{name}-worker-0",
                                 rdzvPort=C10D_PORT, rdzvId=f"{cfg.rdzv_id}-eval",
                                 minReplicas=1, maxReplicas=1, maxRestarts=0)
    spec["elasticPolicy"].pop("rdzvConf", None)
    spec["nprocPerNode"] = "1"
    spec["runPolicy"].pop("suspend", None)
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    worker.update(replicas=1, restartPolicy="Never")
    # Plain python, no torchrun and nothing to save on a notice.
    worker["template"]["spec"].pop("terminationGracePeriodSeconds")
    container = worker["template"]["spec"]["containers"][0]
    evaluation = _evaluation_container(cfg, champion_model)
    container.update(command=evaluation["command"], args=evaluation["args"],
                     resources=evaluation["resources"])
    container["env"] = [e for e in container["env"] if e["name"] not in evaluation["drop_env"]]
    return manifest


def evaluation_trainjob_manifest(cfg: RunConfig, image: str, champion_model: str = "") -> dict:
    """The evaluate stage's TrainJob (launcher trainjob): the training's TrainJob on the same
    runtime, as one node with one GPU running trainer.evaluate."""
    manifest = _as_evaluation(trainjob_manifest(cfg, image), cfg)
    spec = manifest["spec"]
    spec.pop("suspend", None)
    evaluation = _evaluation_container(cfg, champion_model)
    trainer = spec["trainer"]
    trainer.update(command=evaluation["command"], args=evaluation["args"], numNodes=1,
                   numProcPerNode=1, resourcesPerNode=evaluation["resources"])
    trainer["env"] = [e for e in trainer["env"] if e["name"] not in evaluation["drop_env"]]
    return manifest
