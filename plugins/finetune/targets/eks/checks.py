"""What validate refuses for the eks target, before any cloud call, as (field, message) pairs:
the cluster and node group missing, more nodes than max_nodes, a fallback node group that is the
run's own, more processes than the instance type's GPUs, what needs a GPU the instance type
lacks (float8, fa4) or a package the built image lacks (`rules.device_problems`, as the local
target and the trainer's start ask it), names Kubernetes would refuse, an output the pods cannot
reach, a path only the Airflow worker has, the image fields (`image_build.image_param_errors`),
the launcher's limits (`launchers.launcher_problems`) and prepare_on pod's needs.
"""

from __future__ import annotations

import os
from typing import Any

from finetune.config import resolve_path
from finetune.image import IN_POD_PATHS, TRAINER_REQUIREMENTS, image_installs
from finetune.names import DNS_LABEL, DNS_SUBDOMAIN
from finetune.targets.eks.image_build import effective_builder, image_param_errors
from finetune.targets.eks.launchers import launcher_problems
from finetune.targets.eks.manifests import C10D_PORT, parse_node_selector, parse_volumes
from finetune_contract.fields import FA4_PACKAGE, quoted
from finetune_contract.instance_types import INSTANCE_TYPES
from finetune_contract.models import BUILTIN_MODELS
from finetune_contract.rules import device_problems


def problems(values: dict[str, Any]) -> list[tuple[str, str]]:
    """Every problem of the eks fields of `values` (the params with their defaults)."""
    errors = _required(values, "cluster_name", "the EKS cluster's name")
    errors += _required(values, "nodegroup", "the managed node group of GPU nodes")
    errors += image_param_errors(values)
    if values["nodes"] > values["max_nodes"]:
        errors.append(("nodes", f"{values['nodes']} exceeds max_nodes = "
                       f"{values['max_nodes']}, the cap on the node group's size"))
    itype = INSTANCE_TYPES[values["instance_type"]]
    if values["procs_per_node"] > itype.gpus:
        errors.append(("procs_per_node", f"{values['procs_per_node']} processes per node, "
                       f"but {itype.name} has {itype.gpus} GPUs; allowed: 1..{itype.gpus}"))
    prebuilt = effective_builder(values["image"], values["image_builder"]) == "prebuilt"
    for field, message in device_problems(
            quantize_base=values["quantize_base"], gpu=True, attention=values["attention"],
            float8=values["float8"], capability=itype.capability,
            where=f"the trainer image this run builds (from {TRAINER_REQUIREMENTS})",
            # a prebuilt image is the user's: what it holds is known at the trainer's start
            fa4_installed=prebuilt or image_installs(FA4_PACKAGE)):
        if field == "float8":  # on eks the GPUs are chosen: the other way out
            message += f", or choose a {_float8_families()} instance_type instead of {itype.name}"
        errors.append((field, message))
    for field in ("namespace", "etcd_service"):
        if not DNS_LABEL.match(values[field]):
            errors.append((field, f"{quoted(values[field])} is not a DNS label (lowercase "
                           "letters, digits and '-', at most 63)"))
    out = values["output_dir"]
    if not (out.startswith("s3://") or out.startswith("/")):
        errors.append(("output_dir", f"{quoted(out)}: on eks give s3://bucket/prefix or an "
                       "absolute path the pods mount (volumes)"))
    if values["capacity_fallback"] == "on-demand" and \
            values["fallback_nodegroup"] == values["nodegroup"]:
        errors.append(("fallback_nodegroup", f"{quoted(values['fallback_nodegroup'])} is the "
                       "run's own node group: name another, of on-demand nodes, to fall back to"))
    if values["rdzv_backend"] == "c10d" and values["metrics_port"] == C10D_PORT:
        errors.append(("metrics_port", f"{C10D_PORT} is the c10d rendezvous port on worker "
                       "0, where rank 0 serves its metrics; choose another port"))
    return errors + _pod_problems(values) + launcher_problems(values) + \
        _prepare_problems(values)


def _float8_families() -> str:
    """The instance families whose GPUs run float8 (by the rule validate and the trainer ask),
    as a sentence lists them: 'g6, p5 or p5e'."""
    having = sorted({name.split(".")[0] for name, profile in INSTANCE_TYPES.items()
                     if not device_problems(quantize_base="none", gpu=True, float8=True,
                                            capability=profile.capability)})
    return f"{', '.join(having[:-1])} or {having[-1]}" if len(having) > 1 else having[0]


def _required(values: dict[str, Any], field: str, what: str) -> list[tuple[str, str]]:
    return [] if values[field] else [(field, f"is required for target eks: {what}")]


def _pod_problems(values: dict[str, Any]) -> list[tuple[str, str]]:
    """The pods' service account, Kueue queue and volumes; an absolute path the pods read or
    write must lie on a mounted volume (the image holds only /app)."""
    errors = []
    for field in ("service_account", "queue_name"):
        if values[field] and not DNS_SUBDOMAIN.match(values[field]):
            errors.append((field, f"{quoted(values[field])} is not a Kubernetes name "
                           "(lowercase letters, digits, '-' and '.')"))
    try:
        mounts = [path for _, path in parse_volumes(values["volumes"])]
    except ValueError as exc:
        return errors + [("volumes", str(exc))]
    errors += _worker_only_paths(values)
    for field in ("model", "tokenizer", "dataset", "output_dir"):
        path = values[field]
        if path.startswith("/") and not path.startswith("/app/") and not any(
                path == m or path.startswith(m + "/") for m in mounts):
            errors.append((field, f"{quoted(path)} is on no volume the pods mount ("
                           + (", ".join(mounts) or "volumes is empty") + "): mount its "
                           "PersistentVolumeClaim with volumes, or use s3://"))
    return errors


def _worker_only_paths(values: dict[str, Any]) -> list[tuple[str, str]]:
    """A relative path that exists on this Airflow worker but not in the pods: their working
    directory (/app) holds only the trainer and the contract (finetune.image.IN_POD_PATHS)."""
    errors = []
    for field in ("model", "tokenizer", "dataset", "eval_dataset"):
        value = values[field]
        if not value or value.startswith(("/", "s3://")) or value in BUILTIN_MODELS:
            continue
        normal = os.path.normpath(value)
        if any(normal == part or normal.startswith(part + "/") for part in IN_POD_PATHS):
            continue  # shipped in the image at the same relative path
        try:
            here = resolve_path(value).exists()
        except OSError:
            continue
        if here:
            errors.append((field, f"{quoted(value)} exists on the Airflow worker but not in the "
                           "training pods (their working directory holds only "
                           + ", ".join(f"{part}/" for part in IN_POD_PATHS) + " and the "
                           "contract): upload it and give its s3:// URI, give a hub id, or put "
                           "it on a volume the pods mount (volumes) and give the absolute path"))
    return errors


def _prepare_problems(values: dict[str, Any]) -> list[tuple[str, str]]:
    """prepare_on pod: the set and the record go to S3 (the worker reads the record there), and
    the node selector must be one."""
    try:
        parse_node_selector(values["prepare_node_selector"])
    except ValueError as exc:
        return [("prepare_node_selector", str(exc))]
    if values["prepare_on"] == "pod" and not values["output_dir"].startswith("s3://"):
        return [("output_dir", f"{quoted(values['output_dir'])}: prepare_on pod writes the "
                 "prepared set and its record to S3, where this worker reads them; give "
                 "s3://bucket/prefix, or set prepare_on to worker")]
    return []
