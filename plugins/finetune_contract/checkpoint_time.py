"""How long a run's checkpoint takes to save and to load, and whether a notice leaves the time.

A checkpoint holds what a resumed run cannot make again: each trained parameter's fp32 master
weight and AdamW's two moments (12 bytes a parameter), sharded over the ranks; a LoRA run's
frozen base is made again from its source (trainer/checkpoint.py), so its checkpoint is the
adapters' alone. A save copies each rank's shard to host memory (a GPU's PCIe link), writes a
node's shards to where the checkpoint goes, and, for s3://, uploads them (trainer/storage.py);
a load reads and copies back. Where it goes sets the rate: the node's own disk (measured on one
H200's machine, bench/checkpoint.py), S3, or a mounted volume (FSx for Lustre, EFS).

A notice (SIGTERM: a spot reclaim, a drain) gives the pods `terminationGracePeriodSeconds` to
finish the step in progress and save it (trainer/preemption.py); on spot the instance goes two
minutes after EC2's notice, whatever the grace. `grace_period_s` is the grace a run's pods get,
`agent_shutdown_s` how long torchrun's agent waits in it for its workers to save before it kills
them, `notice_problems` refuses a spot run whose step and save do not fit the notice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9
# fp32 master weight and AdamW's exp_avg and exp_avg_sq: what a checkpoint keeps of a parameter.
STATE_BYTES_PER_PARAM = 12
# DCP's fixed cost of a save or load (planning collectives, metadata, the rename, small files).
SAVE_FIXED_S = 2.0
LOAD_FIXED_S = 1.9
# A rank's shard to host memory and through DCP's writer (pageable copies, serialization, one
# thread), and back at a load: bytes per second per GPU.
DEVICE_TO_HOST_BYTES_PER_S = 2.7 * GB
HOST_TO_DEVICE_BYTES_PER_S = 10 * GB
# Where the checkpoint goes: bytes per second a node writes and reads there.
# - local: the node's disk; the machine measured (bench/checkpoint.py, one H100 machine,
#   2026-12-06: docs/notes/2026-12-06-h100-checkpoint.log) wrote 1.08 GB/s with fsync and read
#   a checkpoint back at about 2.75 GB/s right after its save (partly from the page cache, as
#   a resume on the same node reads it). With the fixed costs and the staging rate above, the
#   1B, 3B and 8B LoRA saves come within 13% of what was measured, the loads within 20% (two
#   loads of the same 1B checkpoint took 10.9 and 7.4 s). A p5's own NVMe disks are faster;
#   an instance's disk goes with it when spot takes it back.
# - s3: boto3's multipart upload from a node's staging disk: an assumption (a few parallel
#   streams of about 100 MB/s each, well below an instance's network), not measured here
# - volume: FSx for Lustre or EFS mounted on every node: an assumption (a client's share of a
#   file system of a few TiB at 1,000 MB/s per TiB), not measured here
WRITE_BYTES_PER_S = {"local": 1.08 * GB, "s3": 1.0 * GB, "volume": 1.0 * GB}
READ_BYTES_PER_S = {"local": 2.75 * GB, "s3": 1.0 * GB, "volume": 1.0 * GB}
# An s3:// checkpoint is written to the node's disk first, then uploaded (trainer/checkpoint.py).
STAGED = {"s3": "local"}
# EC2 interrupts a spot instance two minutes after its notice; the node group's drain (EKS
# managed node groups drain a node on the notice, with the eviction API) reaches the pods some
# seconds later: what is left for the step and the save.
SPOT_NOTICE_S = 120
DRAIN_DELAY_S = 15
# The grace a run's pods get: the step and the save with room for the estimate's error, and
# the time torchrun and the process need to exit once saved.
GRACE_MARGIN = 1.5
EXIT_S = 30
# Without a step time or save estimate (an unknown model, a CPU): what the pods get.
DEFAULT_GRACE_S = 300


def volume_mounts(volumes: str) -> list[tuple[str, str]]:
    """The `volumes` parameter's `claim:/path,claim2:/path2` as (claim, path) pairs, as
    written (the eks target's manifests check each)."""
    pairs = []
    for part in (p.strip() for p in volumes.split(",")):
        if part:
            claim, _, path = part.partition(":")
            pairs.append((claim, path))
    return pairs


def storage_of(output_dir: str, volumes: str = "") -> str:
    """Where a run's checkpoints go: s3, a mounted volume (`volumes`), or the node's disk."""
    if output_dir.startswith("s3://"):
        return "s3"
    if any(path.startswith("/") and output_dir.startswith(path.rstrip("/") + "/")
           for _, path in volume_mounts(volumes)):
        return "volume"
    return "local"


@dataclass(frozen=True)
class CheckpointTime:
    """A run's checkpoint: its size and the seconds a save and a load take."""

    bytes_total: float
    bytes_per_node: float
    save_s: float
    load_s: float
    storage: str

    def to_dict(self) -> dict[str, float | str]:
        return {"bytes_total": self.bytes_total, "bytes_per_node": self.bytes_per_node,
                "save_s": self.save_s, "load_s": self.load_s, "storage": self.storage}


def checkpoint_time(trained_params: int, *, world_size: int, local_world_size: int,
                    storage: str) -> CheckpointTime:
    """The checkpoint of `trained_params` parameters (all of them for a full fine-tune, the
    adapters' for LoRA) sharded over `world_size` ranks, `local_world_size` per node."""
    total = STATE_BYTES_PER_PARAM * trained_params
    per_gpu = total / world_size
    per_node = per_gpu * local_world_size
    write = per_node / WRITE_BYTES_PER_S[STAGED.get(storage, storage)]
    upload = per_node / WRITE_BYTES_PER_S[storage] if storage in STAGED else 0.0
    save = SAVE_FIXED_S + per_gpu / DEVICE_TO_HOST_BYTES_PER_S + write + upload
    load = (LOAD_FIXED_S + per_node / READ_BYTES_PER_S[storage]
            + per_gpu / HOST_TO_DEVICE_BYTES_PER_S)
    return CheckpointTime(total, per_node, save, load, storage)


def grace_period_s(step_s: float | None, save_s: float | None) -> int:
    """The pods' terminationGracePeriodSeconds: the step in progress and its save, with room."""
    if step_s is None or save_s is None:
        return DEFAULT_GRACE_S
    return math.ceil(GRACE_MARGIN * (step_s + save_s) + EXIT_S)


# What torchrun reads its agent's shutdown timeout from (its default: 30 s).
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


def agent_shutdown_s(grace_s: int) -> int:
    """torchrun's shutdown timeout (TORCH_ELASTIC_SHUTDOWN_TIMEOUT) in a grace of `grace_s`:
    on SIGTERM its agent passes the signal to its workers and waits this long for them to save
    before it kills them; the rest of the grace is the agent's and the launcher's own exit."""
    return max(1, grace_s - EXIT_S)


def notice_problems(capacity_type: str, step_s: float | None,
                    ckpt: CheckpointTime | None) -> list[tuple[str, str]]:
    """A spot run whose step in progress and its save do not fit a spot notice."""
    if capacity_type != "spot" or ckpt is None:
        return []
    left = SPOT_NOTICE_S - DRAIN_DELAY_S
    needed = (step_s or 0.0) + ckpt.save_s
    if needed <= left:
        return []
    step = f"the step in progress (estimated {step_s:.0f} s) and " if step_s else ""
    return [("capacity_type", (
        f"spot: EC2 takes a spot node {SPOT_NOTICE_S} s after its notice, about {left} s once "
        f"the node is drained; {step}saving it (estimated {ckpt.save_s:.0f} s: "
        f"{ckpt.bytes_per_node / GB:.1f} GB from each node to {ckpt.storage}) need "
        f"{needed:.0f} s: use capacity_type on-demand, more nodes (smaller shards), LoRA, or "
        "an output_dir on a faster volume"))]
