"""This machine as the local target's cluster: its CPUs and GPUs, what a run of nodes x
procs_per_node gets of them (threads per process, devices), the environment of the Python
processes a stage starts, and whether a run directory can be made where `output_dir` points.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import psutil

from finetune import REPO_ROOT
from finetune.config import RunConfig, resolve_path
from finetune.image import IMAGE_CONTEXT
from finetune.targets.base import TORCHRUN_ENV
from finetune_contract.checkpoint_time import (
    SHUTDOWN_TIMEOUT_ENV,
    agent_shutdown_s,
    grace_period_s,
)
from finetune_contract.errors import ERROR_DIR_ENV
from finetune_contract.fields import quoted

# File systems no run directory can be made in (the kernel's views, not storage).
PSEUDO_FILESYSTEMS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "securityfs", "debugfs",
    "tracefs", "pstore", "bpf", "configfs", "fusectl", "mqueue", "hugetlbfs", "autofs",
    "efivarfs", "binfmt_misc", "nsfs", "rpc_pipefs"})


def local_cpu_count() -> int:
    """The CPUs this process may run on (its affinity), which is what torchrun's workers get."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def gpu_count() -> int:
    """GPUs on this machine, from nvidia-smi (no CUDA initialisation in the Airflow process)."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        visible = os.environ["CUDA_VISIBLE_DEVICES"].strip()
        if not visible or visible == "-1":
            return 0
    lines = _nvidia_smi("-L")
    if lines is None:
        return 0
    count = sum(1 for line in lines if line.startswith("GPU "))
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        count = min(count, len(os.environ["CUDA_VISIBLE_DEVICES"].split(",")))
    return count


def gpu_capability() -> tuple[int, int] | None:
    """The lowest CUDA compute capability of this machine's GPUs, from nvidia-smi (no CUDA
    initialisation in the Airflow process); None where it cannot say (no nvidia-smi, a driver
    older than its compute_cap query)."""
    lines = _nvidia_smi("--query-gpu=compute_cap", "--format=csv,noheader")
    try:
        found = [(int(major), int(minor)) for major, minor in
                 (line.strip().split(".") for line in lines or () if line.strip())]
    except ValueError:  # not "9.0"
        return None
    return min(found, default=None)


def _nvidia_smi(*args: str) -> list[str] | None:
    """nvidia-smi's output lines for `args`; None without nvidia-smi or where it fails."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, *args], capture_output=True, text=True, timeout=30,
                             check=True)
    except (subprocess.SubprocessError, OSError):
        return None
    return out.stdout.splitlines()


def thread_limit() -> int | None:
    """OMP_NUM_THREADS where the stage runs, when set: no trainer or evaluation process it starts
    gets more threads than that (a machine shared with other work)."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def local_resources(nodes: int, procs_per_node: int) -> dict[str, Any]:
    """What a run of nodes x procs_per_node would use here, or why it cannot run: threads per
    process the cores shared out, no more than `thread_limit`; `threads`, one process's alone
    (the evaluation's)."""
    cpus, gpus = local_cpu_count(), gpu_count()
    world = nodes * procs_per_node
    device = "cuda" if gpus else "cpu"
    capacity = gpus if gpus else cpus
    limit = thread_limit() or cpus
    return {
        "device": device, "cpus": cpus, "gpus": gpus, "processes": world,
        "capacity": capacity, "fits": world <= capacity,
        "threads_per_process": min(max(1, cpus // world), limit),
        "threads": min(cpus, limit),
    }


def python_env(threads: int) -> dict[str, str]:
    """The environment of a Python process a stage starts from this checkout: the repo
    importable, `threads` threads, its output unbuffered (followed line by line)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def torchrun_env(cfg: RunConfig, res: dict, gpus: range) -> dict[str, str]:
    """The environment of a local torchrun: the repo importable, threads per process, the
    GPUs it may use."""
    env = python_env(res["threads_per_process"])
    env[ERROR_DIR_ENV] = cfg.run_dir  # a config the trainer refuses is recorded there too
    env.update(TORCHRUN_ENV)  # in-place worker restarts get a clean store
    # After a notice the agent waits this long for its workers to save (torchrun's own: 30 s);
    # the local target knows no step time or save estimate: the planner's default grace.
    env.setdefault(SHUTDOWN_TIMEOUT_ENV, str(agent_shutdown_s(grace_period_s(None, None))))
    if res["device"] == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in gpus)
        env.setdefault("NCCL_NVLS_ENABLE", "0")
    return env


def mount_types() -> dict[Path, str]:
    """Mount point -> file system type, from the kernel's table (empty where there is none)."""
    try:
        partitions = psutil.disk_partitions(all=True)
    except OSError:
        return {}
    return {Path(p.mountpoint): p.fstype for p in partitions}


def output_dir_problems(output_dir: str) -> list[tuple[str, str]]:
    """Why the run directory `<output_dir>/<run>` could not be made here, before any stage
    tries: a file on the way, a pseudo-file system, no write permission, a relative path that
    leaves the repository, or a place inside the trainer image's build context (every run's
    outputs would change its content hash and be packed into the next build)."""
    given = quoted(output_dir)
    path = Path(os.path.abspath(resolve_path(output_dir)))  # '..' folded, links kept
    if not Path(output_dir).expanduser().is_absolute() and not path.is_relative_to(REPO_ROOT):
        return [("output_dir", f"{given} leaves the repository (relative paths are from "
                 f"{REPO_ROOT}); give an absolute path to write elsewhere")]
    real = path.resolve()
    for part in IMAGE_CONTEXT:
        if real.is_relative_to((REPO_ROOT / part).resolve()):
            return [("output_dir", f"{given} lies in {part}/, part of the trainer image's build "
                     "context (finetune.image.IMAGE_CONTEXT): every run would change the image's "
                     "content hash and its outputs be packed into the next build; use runs or "
                     "a path outside " + ", ".join(IMAGE_CONTEXT))]
    existing = path
    try:
        while not existing.exists() and not existing.is_symlink():
            existing = existing.parent
    except OSError:  # a name too long to look up: the contract's location rule names it
        return []
    if not existing.is_dir():
        where = "is a file" if existing == path else f"lies under the file {quoted(str(existing))}"
        return [("output_dir", f"{given} {where}: the run directory cannot be made there")]
    mounts = mount_types()
    mount = max((point for point in mounts if existing.resolve().is_relative_to(point)),
                key=lambda point: len(point.parts), default=None)
    if mount is not None and mounts[mount] in PSEUDO_FILESYSTEMS:
        return [("output_dir", f"{given} is on {mount}, a {mounts[mount]} pseudo-file system: "
                 "no directory can be made there")]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [("output_dir", f"{given}: {quoted(str(existing))} is not writable by this "
                 "user, so the run directory cannot be made")]
    return []
