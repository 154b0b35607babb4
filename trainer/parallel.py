"""Process group, device mesh and FSDP2 sharding under the FSDP1 strategy names users know."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from transformers import PretrainedConfig

from finetune_contract.fields import ContractError
from finetune_contract.models import ModelShape
from finetune_contract.rules import config_problems, device_problems
from trainer.activations import checkpoint_activations, offload_activations
from trainer.blocks import decoder_blocks
from trainer.config import TrainConfig
from trainer.float8 import convert_to_float8
from trainer.master_weights import use_master_weights
from trainer.qlora import quantized_params
from trainer.tensor_parallel import (
    TP_DIM,
    apply_tensor_parallel,
    mesh_plan,
)

# Tests only: let quantize_base run on a CPU (see quantize_emulated).
QUANTIZE_ON_CPU_ENV = "TRAINER_NF4_ON_CPU"
MeshPlan = tuple[tuple[int, ...], tuple[str, ...], bool]
# The dtype blocks compute in for each mixed_precision; master weights and optimizer stay fp32.
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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
        # gloo for CPU tensors: CPU-offloaded gradients (grad norm, fp16 inf check) and the
        # collectives of asynchronous checkpoint saves; CUDA tensors go through NCCL either way.
        backend = "cuda:nccl,cpu:gloo"
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


def mixed_precision_policy(
    mixed_precision: str, data_parallel_size: int | None = None
) -> MixedPrecisionPolicy:
    """bf16/fp16: blocks compute on low-precision copies of fp32 weights; grads reduce in fp32.

    With one data-parallel rank nothing is summed: a gradient reduced in bf16 and then cast to
    fp32 is the same number as one cast first, so it reduces in the compute dtype and FSDP's
    gradient copies move half the bytes.
    """
    if mixed_precision == "fp32":
        return MixedPrecisionPolicy()
    dtype = COMPUTE_DTYPES[mixed_precision]
    return MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=dtype if data_parallel_size == 1 else torch.float32
    )


def _capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of `device` (None on a CPU), which attention fa4 needs."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)
    return None


def check_start(
    config: TrainConfig, env: DistEnv, model_config: PretrainedConfig | None = None
) -> None:
    """The contract's rules for this world (and, once built, this model): every problem in one
    ContractError, in the words `validate` uses. Warns on options that are no-ops here.

    Allowed: bf16 and fp16 on a CPU (slow, but the numerics of a GPU run, which the local demo and
    tests want); fp16 with cpu_offload (the inf check of the grad scaler reduces CPU gradients).
    """
    shape = None if model_config is None else ModelShape.from_config(config.model, model_config)
    problems = config_problems(config, world_size=env.world_size,
                               local_world_size=env.local_world_size, shape=shape)
    problems += device_problems(quantize_base=config.quantize_base,
                                gpu=env.device.type == "cuda" or quantize_emulated(),
                                attention=config.attention,
                                capability=_capability(env.device))
    if problems:
        raise ContractError(problems, "the run config cannot run here")
    if env.device.type == "cpu" and model_config is None:
        for name in ("activation_offload", "cpu_offload"):
            if getattr(config, name):
                # Still applied, so a CPU run tests the code path a GPU run takes.
                warnings.warn(
                    f"{name} saves no memory on device cpu: everything already is in CPU memory",
                    stacklevel=2,
                )


def quantize_dtype(config: TrainConfig) -> torch.dtype | None:
    """The dtype QLoRA's base weights are quantized from and dequantized to: the compute dtype
    (None: no quantize_base)."""
    return None if config.quantize_base == "none" else COMPUTE_DTYPES[config.mixed_precision]


def quantize_emulated() -> bool:
    """Tests only: NF4 on a CPU (torchao's NF4 is plain torch code; a real run is refused)."""
    return os.environ.get(QUANTIZE_ON_CPU_ENV, "") == "1"


def compile_blocks(blocks: torch.nn.ModuleList) -> None:
    """torch.compile each block in place: after checkpoint wrapping, before fully_shard (whose
    hooks then run outside the graph), as torchtitan does. Blocks of one shape share the code.

    TRAINER_COMPILE_BACKEND picks another backend (tests on CPU use aot_eager: same graphs, no
    minutes of C++ code generation).
    """
    backend = os.environ.get("TRAINER_COMPILE_BACKEND", "inductor")
    for i, block in enumerate(blocks):
        blocks[i] = torch.compile(block, backend=backend, fullgraph=True)


def _unsharded_single_device(config: TrainConfig, mesh: DeviceMesh) -> bool:
    """One rank that keeps its weights between forward and backward (SHARD_GRAD_OP, NO_SHARD) and
    on the device: FSDP has nothing to do. FULL_SHARD and HYBRID_SHARD keep FSDP at one rank,
    whose freeing of each block's weights after forward lowers the peak memory."""
    return (
        mesh.size() == 1
        and config.tp_degree == 1
        and config.strategy in ("SHARD_GRAD_OP", "NO_SHARD")
        and not config.cpu_offload
    )


def apply_parallelism(model: torch.nn.Module, config: TrainConfig, env: DistEnv) -> DeviceMesh:
    """Checkpoint activations per block if asked, then fully_shard every block and the root (or,
    with one unsharded rank, fp32 master weights with compute copies instead of FSDP)."""
    tp = config.tp_degree
    check_start(config, env, model.config)
    # With TP, FSDP's dims cover world_size / tp ranks; a node holds local_world_size / tp of them.
    shape, names, reshard = fsdp_plan(
        config.strategy,
        env.world_size // tp,
        max(1, env.local_world_size // tp),
        config.shard_group_size,
    )
    if tp > 1:
        world_shape, world_names = mesh_plan(shape, names, tp)
        world_mesh = init_device_mesh(env.device.type, world_shape, mesh_dim_names=world_names)
        # Before checkpoint wrapping, which renames the submodules the TP plan names.
        apply_tensor_parallel(model, world_mesh[TP_DIM])
        mesh = world_mesh[names]
    else:
        mesh = init_device_mesh(env.device.type, shape, mesh_dim_names=names)
    blocks = decoder_blocks(model)
    if config.float8:  # before checkpoint wrapping and compile, as torchtitan converts
        convert_to_float8(blocks, sharded=mesh["shard"].size() > 1,
                          recipe=config.float8_recipe)
    checkpoint_activations(blocks, config.activation_checkpointing, config.selective_ac)
    if config.compile:
        compile_blocks(blocks)
    if config.activation_offload:
        offload_activations(blocks, env.device)
    if _unsharded_single_device(config, mesh):
        # Nothing to shard, gather or reduce: FSDP would only copy (trainer/master_weights.py).
        if config.mixed_precision != "fp32":
            use_master_weights(model, COMPUTE_DTYPES[config.mixed_precision], config.grad_accum)
        return mesh
    policies = {
        # QLoRA: the 4-bit base stays whole on every rank (trainer/qlora.py).
        "ignored_params": set(quantized_params(model)) if config.quantize_base != "none" else None,
        "mp_policy": mixed_precision_policy(config.mixed_precision, mesh.size()),
        "offload_policy": CPUOffloadPolicy(pin_memory=env.device.type == "cuda")
        if config.cpu_offload
        else OffloadPolicy(),
    }
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, **policies)
    # The root's parameters (embeddings, final norm, head) are needed first in backward: keep them.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, **policies)
    return mesh
