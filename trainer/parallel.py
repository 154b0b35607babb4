"""Process group, the device mesh of the run's parallel layout (finetune_contract.parallel_dims),
and FSDP2 sharding under the FSDP1 strategy names users know."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import psutil
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

from finetune_contract.families import family_of
from finetune_contract.fields import ContractError
from finetune_contract.models import ModelShape
from finetune_contract.parallel_dims import TP_DIM, ParallelDims
from finetune_contract.planner import host_offload_bytes
from finetune_contract.planner import model_config as planner_config
from finetune_contract.rules import (
    MLP_TILE_TOKENS,
    config_problems,
    device_problems,
    fa4_importable,
    float8_reads_masters,
    min_mlp_tile_tokens,
    offloads_blocks,
)
from trainer.activations import checkpoint_activations, offload_activations
from trainer.blocks import decoder_blocks
from trainer.config import TrainConfig
from trainer.float8 import convert_to_float8, emulated
from trainer.master_weights import use_master_weights
from trainer.offload import offload_blocks
from trainer.qlora import quantized_params
from trainer.tensor_parallel import apply_tensor_parallel

# Tests only: let quantize_base run on a CPU (see quantize_emulated).
QUANTIZE_ON_CPU_ENV = "TRAINER_NF4_ON_CPU"
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
        # Before the first allocation: segments that grow in place instead of a new block per
        # size. Long sequences allocate many sizes (an 8B QLoRA at 400k tokens on an H100 ran
        # out of memory with 23 of its 79 GiB reserved and free in pieces).
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
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


@dataclass(frozen=True)
class ParallelMesh:
    """The run's parallel layout and the device mesh built from it, once: FSDP shards and
    replicates over `data_parallel`, tensor parallelism splits over `tensor_parallel`."""

    dims: ParallelDims
    world: DeviceMesh  # every dim of dims.mesh_dim_names
    data_parallel: DeviceMesh  # dims.dp_dim_names
    tensor_parallel: DeviceMesh | None  # "tp"; None without tensor parallelism


def build_mesh(config: TrainConfig, env: DistEnv) -> ParallelMesh:
    """The device mesh of `config`'s layout in this world (its real size, not the planned one);
    ContractError naming the fields when the layout does not fit the world."""
    dims = ParallelDims.of(config, world_size=env.world_size, procs_per_node=env.local_world_size)
    if dims.problems:
        raise ContractError(dims.problems, "the parallel layout cannot run here")
    world = init_device_mesh(env.device.type, dims.mesh_shape, mesh_dim_names=dims.mesh_dim_names)
    if not dims.tp_enabled:
        return ParallelMesh(dims, world, world, None)
    return ParallelMesh(dims, world, world[dims.dp_dim_names], world[TP_DIM])


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
    """The CUDA compute capability of `device` (None on a CPU), which fa4 and float8 need."""
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
                                float8=config.float8 and not emulated(),
                                capability=_capability(env.device),
                                fa4_installed=fa4_importable(),
                                where="the trainer's Python environment")
    if model_config is not None:
        problems += host_memory_problems(config, env, model_config)
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


def host_memory_problems(config: TrainConfig, env: DistEnv,
                         model_config: PretrainedConfig) -> list[tuple[str, str]]:
    """Offloaded block inputs (trainer/offload.py) that this machine's free memory cannot hold,
    for all its processes: the local target's counterpart of validate's node-memory rule."""
    if not offloads_blocks(config):
        return []
    shape = planner_config(config.model, model_config)
    per_process = host_offload_bytes(config, shape) if shape is not None else 0
    if not per_process:
        return []
    needed = per_process * env.local_world_size
    available = psutil.virtual_memory().available
    if needed <= available:
        return []
    gib = 1 << 30
    return [("activation_offload",
             f"the offloaded block inputs take {needed / gib:.1f} GiB of CPU memory on this "
             f"machine ({env.local_world_size} x {per_process / gib:.1f}), more than the "
             f"{available / gib:.1f} GiB available: lower seq_len or micro_batch")]


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
    backend = compile_backend()
    for i, block in enumerate(blocks):
        blocks[i] = torch.compile(block, backend=backend, fullgraph=True)


def compile_backend() -> str:
    return os.environ.get("TRAINER_COMPILE_BACKEND", "inductor")


def apply_parallelism(
    model: torch.nn.Module, config: TrainConfig, env: DistEnv, mesh: ParallelMesh | None = None
) -> ParallelMesh:
    """Checkpoint activations per block if asked, then fully_shard every block and the root (or,
    with one unsharded rank, fp32 master weights with compute copies instead of FSDP).

    mesh: the run's, built once (train.py: the model and DPO's reference share it); None: built
    here for this world."""
    check_start(config, env, model.config)
    if mesh is None:
        mesh = build_mesh(config, env)
    dims = mesh.dims
    if mesh.tensor_parallel is not None:
        # Before checkpoint wrapping, which renames the submodules the TP plan names.
        apply_tensor_parallel(model, mesh.tensor_parallel)
    blocks = decoder_blocks(model)
    if config.float8:  # before checkpoint wrapping and compile, as torchtitan converts
        convert_to_float8(blocks, sharded=dims.shard_degree > 1, recipe=config.float8_recipe)
    if offloads_blocks(config):
        offload_blocks(blocks, env.device, tile_tokens=MLP_TILE_TOKENS,
                       min_tile_tokens=min_mlp_tile_tokens(config),
                       output_unread=family_of(model.config).mlp_output_unread,
                       compile_backend=compile_backend() if config.compile else None)
    else:
        checkpoint_activations(blocks, config.activation_checkpointing, config.selective_ac)
        if config.compile:
            compile_blocks(blocks)
        if config.activation_offload:
            offload_activations(blocks, env.device)
    if not dims.needs_fsdp(config.cpu_offload):
        # Nothing to shard, gather or reduce: FSDP would only copy (trainer/master_weights.py).
        if config.mixed_precision != "fp32":
            use_master_weights(model, COMPUTE_DTYPES[config.mixed_precision], config.grad_accum,
                               reshard=dims.reshard_after_forward,
                               float8_masters=float8_reads_masters(config))
        return mesh
    policies = {
        # QLoRA: the 4-bit base stays whole on every rank (trainer/qlora.py).
        "ignored_params": set(quantized_params(model)) if config.quantize_base != "none" else None,
        "mp_policy": mixed_precision_policy(config.mixed_precision, dims.dp_degree),
        "offload_policy": CPUOffloadPolicy(pin_memory=env.device.type == "cuda")
        if config.cpu_offload
        else OffloadPolicy(),
    }
    reshard = dims.reshard_after_forward
    for block in blocks:
        fully_shard(block, mesh=mesh.data_parallel, reshard_after_forward=reshard, **policies)
    # The root's parameters (embeddings, final norm, head) are needed first in backward: keep them.
    fully_shard(model, mesh=mesh.data_parallel, reshard_after_forward=False, **policies)
    return mesh
