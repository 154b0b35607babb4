"""Process group, device mesh and FSDP2 sharding under the FSDP1 strategy names users know."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from trainer.config import TrainConfig
from trainer.model import decoder_blocks

MeshPlan = tuple[tuple[int, ...], tuple[str, ...], bool]


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device


def init_distributed() -> DistEnv:
    """Join the torchrun process group (NCCL on GPUs, gloo on CPU), or make a world of one."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:
        # Started without torchrun: an in-memory store is all a single process needs.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistEnv(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        device=device,
    )


def fsdp_plan(
    strategy: str, world_size: int, local_world_size: int, shard_group_size: int = 0
) -> MeshPlan:
    """(mesh shape, mesh dim names, reshard_after_forward) for an FSDP1-style strategy name."""
    if strategy == "FULL_SHARD":
        return (world_size,), ("shard",), True
    if strategy == "SHARD_GRAD_OP":
        return (world_size,), ("shard",), False
    if strategy == "HYBRID_SHARD":
        shard = shard_group_size or local_world_size
        if shard < 1 or world_size % shard:
            source = "" if shard_group_size else ", from LOCAL_WORLD_SIZE"
            raise ValueError(
                f"strategy HYBRID_SHARD needs shard_group_size ({shard}{source}) to divide the "
                f"world size ({world_size}): set shard_group_size to a divisor of {world_size} or "
                "choose another strategy"
            )
        return (world_size // shard, shard), ("replicate", "shard"), True
    if strategy == "NO_SHARD":
        # A shard dim of size 1 is plain replication: DDP semantics from the same code path.
        return (world_size, 1), ("replicate", "shard"), False
    raise ValueError(
        f"strategy must be FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD or NO_SHARD; got {strategy!r}"
    )


def apply_parallelism(model: torch.nn.Module, config: TrainConfig, env: DistEnv) -> DeviceMesh:
    """Checkpoint activations per block if asked, then fully_shard every block and the root."""
    shape, names, reshard = fsdp_plan(
        config.strategy, env.world_size, env.local_world_size, config.shard_group_size
    )
    mesh = init_device_mesh(env.device.type, shape, mesh_dim_names=names)
    blocks = decoder_blocks(model)
    if config.activation_checkpointing == "full":
        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(block)
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if config.mixed_precision == "bf16"
        else MixedPrecisionPolicy()
    )
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
    # The root's parameters (embeddings, final norm, head) are needed first in backward: keep them.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy)
    return mesh
