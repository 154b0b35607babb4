"""A run's plan: the contract's planner (finetune_contract.planner) on the run's instance type (its
GPU memory, peak FLOPs and bus bandwidths from finetune_contract.instance_types). validate logs
it, the report compares it with the measurement, `python -m finetune.plan_cli` prints it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from finetune.config import RunConfig
from finetune.hub import hub_config
from finetune.trainer_config import local_dir, trainer_config
from finetune_contract.checkpoint_time import (
    CheckpointTime,
    agent_shutdown_s,
    checkpoint_time,
    grace_period_s,
    notice_problems,
    storage_of,
)
from finetune_contract.data import optimizer_steps
from finetune_contract.fields import hub_id_problem
from finetune_contract.instance_types import INSTANCE_TYPES, InstanceProfile
from finetune_contract.models import model_config
from finetune_contract.planner import (
    THROUGHPUT_ERROR,
    Estimate,
    Hardware,
    estimate,
    resolve_checkpointing,
    search,
    trained_parameters,
)
from finetune_contract.train_config import TrainConfig

# The near-linear scaling the SageMaker model parallel library reports (AWS, "Amazon SageMaker
# model parallel library v2" launch post, Llama 2 on p4d.24xlarge): efficiency by node count.
SAGEMAKER_SCALING = {"llama-2-7b": {32: 0.97, 128: 0.84}}
SCALING_NODES = (1, 16, 32, 64, 128)


def hardware_of(profile: InstanceProfile) -> Hardware:
    """An instance profile's GPU and links, as the planner takes them."""
    return Hardware.of_gpu(profile.gpu_model, profile.gpu_memory_gib,
                           busbw_intra_gbps=profile.busbw_intra_gbps,
                           busbw_inter_gbps=profile.busbw_inter_gbps,
                           node_memory_gib=profile.allocatable_memory_mib / 1024)


def run_hardware(cfg: RunConfig) -> Hardware:
    """The GPU a run trains on as far as validate knows: the eks instance type's; the local
    target's is not known before the trainer starts (it resolves `auto` there)."""
    if cfg.target == "eks" and cfg.instance_type in INSTANCE_TYPES:
        return hardware_of(INSTANCE_TYPES[cfg.instance_type])
    return Hardware(gpu_memory_gib=None, peak_flops=None, name=f"{cfg.target} target's device")


def model_config_of(model: str, in_pod: bool = False) -> dict[str, Any] | None:
    """The run's model config as far as this machine can know it: a built-in or stored hub
    model's, a local model directory's config.json, else a hub id's config.json from the hub
    when it answers (`finetune.hub`); None otherwise (the trainer reads it at start)."""
    model_dir = local_dir(model, in_pod)
    config = model_config(model, model_dir)
    if config is None and model_dir is None and hub_id_problem(model, namespaced=True) is None:
        config = hub_config(model).config
    return config


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """The planner's estimate of one run, with its wall time and cost where they are known."""

    train: TrainConfig  # with activation_checkpointing auto resolved
    chosen: str  # what auto chose, and why ("" when not auto)
    estimate: Estimate
    steps: int | None
    wall_time_s: float | None
    cost_usd: float | None
    train_rows: int | None = None  # max_steps 0: the rows its steps were counted from
    checkpoint: CheckpointTime | None = None  # None: the model is not known here
    grace_s: int = 0  # the pods' terminationGracePeriodSeconds: the step in progress and a save

    def to_dict(self) -> dict[str, Any]:
        return {"activation_checkpointing": self.train.activation_checkpointing,
                "activation_offload": self.train.activation_offload,
                "selective_ac": self.train.selective_ac, "chosen": self.chosen,
                **self.estimate.to_dict(), "steps": self.steps,
                "wall_time_s": self.wall_time_s, "cost_usd": self.cost_usd,
                "train_rows": self.train_rows,
                "checkpoint": self.checkpoint.to_dict() if self.checkpoint else None,
                "grace_s": self.grace_s}


def plan_run(cfg: RunConfig, train: TrainConfig | None = None, *,
             config: Any = None) -> RunPlan:
    """The estimate validate logs and the report compares with what was measured."""
    train = train or TrainConfig(**trainer_config(cfg))
    hardware = run_hardware(cfg)
    config = config if config is not None else model_config_of(cfg.model)
    world = dict(world_size=cfg.world_size, local_world_size=cfg.procs_per_node)
    train, chosen = resolve_checkpointing(train, hardware=hardware, config=config, **world)
    est = estimate(train, hardware=hardware, config=config, **world)
    # epochs: from the training split where validate counted it (RunConfig.counted_*)
    steps = train.max_steps or (optimizer_steps(train, cfg.counted_batches_per_epoch)
                                if cfg.counted_batches_per_epoch else None)
    wall = est.step_time_s * steps if est.step_time_s and steps else None
    cost = cfg.nodes * cfg.node_hourly_price * wall / 3600 if wall and cfg.node_hourly_price \
        else None
    ckpt = run_checkpoint(cfg, train, config)
    return RunPlan(train, chosen, est, steps, wall, cost,
                   train_rows=None if train.max_steps else cfg.counted_train_rows or None,
                   checkpoint=ckpt,
                   grace_s=grace_period_s(est.step_time_s, ckpt.save_s if ckpt else None))


def run_checkpoint(cfg: RunConfig, train: TrainConfig, config: Any) -> CheckpointTime | None:
    """The run's checkpoint: its size and save and load times where it goes."""
    trained = trained_parameters(train, config)
    if trained is None:
        return None
    return checkpoint_time(trained, world_size=cfg.world_size,
                           local_world_size=cfg.procs_per_node,
                           storage=storage_of(cfg.output_dir, cfg.volumes))


def capacity_problems(cfg: RunConfig, train: TrainConfig, config: Any) -> list[tuple[str, str]]:
    """A spot run whose step in progress and its save do not fit a notice."""
    if cfg.capacity_type != "spot":
        return []
    plan = plan_run(cfg, train, config=config)
    return notice_problems(cfg.capacity_type, plan.estimate.step_time_s, plan.checkpoint)


def _gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} GiB"


def plan_text(cfg: RunConfig, plan: RunPlan) -> str:
    """The lines validate logs and `python -m finetune.plan_cli` prints."""
    est = plan.estimate
    where = cfg.instance_type if cfg.target == "eks" else f"{cfg.target} target"
    lines = [f"plan: {cfg.model} on {cfg.nodes} x {where} ({cfg.world_size} processes), "
             f"{plan.train.strategy}, micro_batch {plan.train.micro_batch} x grad_accum "
             f"{plan.train.grad_accum}, seq_len {plan.train.seq_len}, activation_checkpointing "
             f"{plan.train.activation_checkpointing}"
             + (" + offload" if plan.train.activation_offload else "")]
    if plan.chosen:
        lines.append(f"  {plan.chosen}")
    fits = {True: "fits", False: "DOES NOT FIT", None: "n/a"}[est.fits]
    lines.append(f"  peak memory per GPU: {_gib(est.peak_gib)} of {_gib(est.gpu_memory_gib)}: "
                 f"{fits}" + (f" ({est.note})" if est.note and est.peak_gib is None else ""))
    if est.parts_gib:
        lines.append("    " + ", ".join(f"{k} {v:.1f}" for k, v in est.parts_gib.items()))
    if est.step_time_s:
        mfu = f", MFU {est.mfu:.1%}" if est.mfu else ""
        lines.append(f"  step time {est.step_time_s:.3f} s ({est.tokens_per_s_per_gpu:,.0f} "
                     f"tokens/s per GPU{mfu}; collectives {est.comm_s or 0:.3f} s, exposed "
                     f"{est.exposed_comm_s or 0:.3f} s)")
    else:
        lines.append(f"  step time: n/a ({est.note or 'no peak FLOPs known'})")
    counted = f" ({plan.train.epochs:g} epochs of {plan.train_rows:,} training rows)" \
        if plan.train_rows else ""
    if plan.wall_time_s:
        cost = f", cost ${plan.cost_usd:,.2f}" if plan.cost_usd is not None else \
            " (node_hourly_price 0: no cost)"
        lines.append(f"  {plan.steps} steps{counted}: {plan.wall_time_s / 3600:.2f} h of "
                     f"training{cost}")
    elif plan.steps:
        lines.append(f"  {plan.steps} steps{counted}; wall time: n/a (no step time)")
    else:
        lines.append("  wall time: n/a (max_steps 0, and the data set is not readable here or "
                     "too large to count: the trainer counts the steps at start)")
    if plan.checkpoint:
        ckpt = plan.checkpoint
        lines.append(f"  checkpoint {ckpt.bytes_total / 1e9:,.1f} GB "
                     f"({ckpt.bytes_per_node / 1e9:,.1f} GB a node, {ckpt.storage}): save "
                     f"{ckpt.save_s:,.0f} s, load "
                     f"{ckpt.load_s:,.0f} s; a notice gives the pods {plan.grace_s} s "
                     "(terminationGracePeriodSeconds), torchrun's workers "
                     f"{agent_shutdown_s(plan.grace_s)} s of them "
                     "(TORCH_ELASTIC_SHUTDOWN_TIMEOUT)")
        spot = notice_problems("spot", est.step_time_s, ckpt)
        lines.append("  a spot notice: " + ("the step in progress and its save fit it" if not spot
                                            else "DOES NOT FIT (" + spot[0][1] + ")"))
    lines.append(f"  (a model calibrated on measured H200 and H100 runs: memory within "
                 f"{est.memory_error:.1%}, tokens/s within {THROUGHPUT_ERROR:.0%} on the rows; "
                 "docs/trainer.md \"Planning a run\")")
    return "\n".join(lines)


def search_text(cfg: RunConfig, train: TrainConfig, limit: int = 5) -> str:
    found = search(train, world_size=cfg.world_size, local_world_size=cfg.procs_per_node,
                   hardware=run_hardware(cfg), config=model_config_of(cfg.model))
    if not found:
        return "search: no setting fits (or the GPU is not known here)"
    rows = ["search: fastest settings that fit (tokens per optimizer step kept; what changes):"]
    for changes, est in found[:limit]:
        shown = ", ".join(f"{k}={v}" for k, v in changes.items()
                          if getattr(train, k) != v) or "as given"
        rows.append(f"  {est.tokens_per_s_per_gpu or 0:>9,.0f} tokens/s per GPU  "
                    f"{est.peak_gib:>6.1f} GiB  {shown}")
    return "\n".join(rows)


def scaling_rows(train: TrainConfig, profile: InstanceProfile, config: Any = None,
                 nodes: Sequence[int] = SCALING_NODES) -> list[tuple[int, float, float]]:
    """(nodes, tokens/s per GPU, efficiency against one node) predicted for `train`."""
    hardware = hardware_of(profile)
    rows = []
    base = None
    for n in nodes:
        est = estimate(train, world_size=n * profile.gpus, local_world_size=profile.gpus,
                       hardware=hardware, config=config)
        rate = est.tokens_per_s_per_gpu or 0.0
        base = base or rate
        rows.append((n, rate, rate / base if base else 0.0))
    return rows
