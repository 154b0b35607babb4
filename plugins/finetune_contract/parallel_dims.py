"""The run's parallel layout, `ParallelDims`: how a world of processes splits into data-parallel
ranks (FSDP's replicate and shard dims) and tensor-parallel groups, computed and checked once.

Its inputs are the world (its size, processes per node) and the run's strategy, shard_group_size
and tp_degree; everything else is a property. validate makes one for the world it plans
(finetune_contract.rules), the trainer for the world it started in (trainer/parallel.py builds
its device mesh from it), so a layout one side accepts the other can build. Its problems are
(field, message) pairs in the rules' words; the degrees are computed even for a layout with
problems (floor division), for the planner's estimates of settings it only compares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from finetune_contract.fields import STRATEGIES

REPLICATE_DIM = "replicate"
SHARD_DIM = "shard"
TP_DIM = "tp"
# An FSDP1 strategy name on FSDP2: the data-parallel mesh dims, and whether a block's
# parameters are freed after forward (gathered again for backward).
STRATEGY_DIMS: dict[str, tuple[tuple[str, ...], bool]] = {
    "FULL_SHARD": ((SHARD_DIM,), True),
    "SHARD_GRAD_OP": ((SHARD_DIM,), False),
    "HYBRID_SHARD": ((REPLICATE_DIM, SHARD_DIM), True),
    # A shard dim of size 1 is plain replication: DDP semantics from the same code path.
    "NO_SHARD": ((REPLICATE_DIM, SHARD_DIM), False),
}
# (field, message) pairs, in the words of the rules (finetune_contract.rules).
LayoutProblems = tuple[tuple[str, str], ...]


class LayoutFields(Protocol):
    """What a run config says of its layout (TrainConfig and the Airflow side's RunConfig)."""

    strategy: str
    shard_group_size: int
    tp_degree: int


@dataclass(frozen=True)
class ParallelDims:
    """A layout of `world_size` processes, `procs_per_node` per node (the degrees are >= 1, as
    the parameter table bounds them). An unknown strategy is a ValueError: the parameter table
    refuses it before a layout is made."""

    world_size: int
    procs_per_node: int
    strategy: str
    shard_group_size: int  # HYBRID_SHARD's processes per shard group; 0: a node's / tp_degree
    tp_degree: int
    # What stops this layout from running, as (field, message) pairs: tp_degree against the
    # node and the world; shard_group_size against the strategy and the data-parallel size
    # (measured only against a tp_degree that fits). Empty when it runs.
    tp_problems: LayoutProblems = field(init=False, repr=False, compare=False)
    shard_problems: LayoutProblems = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGY_DIMS:
            raise ValueError(f"strategy must be {', '.join(STRATEGIES[:-1])} or "
                             f"{STRATEGIES[-1]}; got {self.strategy!r}")
        object.__setattr__(self, "tp_problems", self._tp_problems())
        object.__setattr__(self, "shard_problems", self._shard_problems())

    @classmethod
    def of(cls, cfg: LayoutFields, *, world_size: int, procs_per_node: int) -> ParallelDims:
        """The layout `cfg` asks for in a world of `world_size` processes, `procs_per_node` per
        node: the planned world at validate, the real one at the trainer's start."""
        return cls(world_size=world_size, procs_per_node=procs_per_node, strategy=cfg.strategy,
                   shard_group_size=cfg.shard_group_size, tp_degree=cfg.tp_degree)

    @property
    def problems(self) -> LayoutProblems:
        """Every problem of the layout; none: it builds a mesh of world_size processes."""
        return self.tp_problems + self.shard_problems

    @property
    def dp_degree(self) -> int:
        """Data-parallel ranks: the groups of processes that read different batches (each a
        tensor-parallel group of tp_degree processes)."""
        return self.world_size // self.tp_degree

    @property
    def shard_degree(self) -> int:
        """The processes one parameter is sharded over (FSDP's shard dim; tensor parallelism
        splits it tp_degree times more): every data-parallel rank, HYBRID_SHARD's group, or
        none (NO_SHARD)."""
        if self.strategy == "HYBRID_SHARD":
            return self.shard_group_size or max(1, self.procs_per_node // self.tp_degree)
        return 1 if self.strategy == "NO_SHARD" else self.dp_degree

    @property
    def param_shards(self) -> int:
        """The pieces each parameter is split into: FSDP's shard dim times tensor parallelism's."""
        return self.shard_degree * self.tp_degree

    @property
    def replicate_degree(self) -> int:
        """The copies of each shard (FSDP's replicate dim), whose gradients are all-reduced."""
        return self.dp_degree // max(1, self.shard_degree)

    @property
    def tp_enabled(self) -> bool:
        return self.tp_degree > 1

    @property
    def dp_dim_names(self) -> tuple[str, ...]:
        """The mesh dims FSDP shards and replicates over."""
        return STRATEGY_DIMS[self.strategy][0]

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The device mesh, dims as mesh_dim_names; "tp" innermost, so the ranks of a
        tensor-parallel group are consecutive (within a node)."""
        sizes = {REPLICATE_DIM: self.replicate_degree, SHARD_DIM: self.shard_degree,
                 TP_DIM: self.tp_degree}
        return tuple(sizes[name] for name in self.mesh_dim_names)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return (*self.dp_dim_names, TP_DIM) if self.tp_enabled else self.dp_dim_names

    @property
    def reshard_after_forward(self) -> bool:
        """Free each block's gathered parameters after forward (FULL_SHARD, HYBRID_SHARD)."""
        return STRATEGY_DIMS[self.strategy][1]

    def needs_fsdp(self, cpu_offload: bool) -> bool:
        """False for one process whose weights stay on its device: nothing to shard, gather or
        reduce (trainer/master_weights.py; FULL_SHARD and HYBRID_SHARD free each block's
        compute copies after its forward there, as FSDP frees its gathered weights). FSDP's
        CPU offload keeps it."""
        one_process = self.dp_degree == 1 and not self.tp_enabled
        return not (one_process and not cpu_offload)

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of global `rank`: a tensor-parallel group's ranks are
        consecutive, and they read the same batch."""
        return rank // self.tp_degree

    def global_batch(self, micro_batch: int, grad_accum: int) -> int:
        """Sequences per optimizer step over every data-parallel rank."""
        return micro_batch * grad_accum * self.dp_degree

    def _tp_problems(self) -> LayoutProblems:
        tp, procs = self.tp_degree, self.procs_per_node
        if tp > 1 and procs % tp:
            return (("tp_degree", f"{tp} does not divide the processes per node ({procs}): "
                     "tensor parallelism stays within a node"),)
        if tp > 1 and self.world_size % tp:
            return (("tp_degree", f"{tp} does not divide the world size ({self.world_size})"),)
        return ()

    def _shard_problems(self) -> LayoutProblems:
        if self.strategy != "HYBRID_SHARD":
            return (("shard_group_size", f"applies to strategy HYBRID_SHARD only, strategy is "
                     f"{self.strategy}: set it to 0"),) if self.shard_group_size else ()
        if self.tp_problems or self.dp_degree % self.shard_degree == 0:
            return ()
        source = "shard_group_size" if self.shard_group_size else \
            "processes per node / tp_degree (shard_group_size 0)"
        return (("shard_group_size", f"the shard group ({self.shard_degree}, {source}) does not "
                 f"divide the data-parallel size ({self.dp_degree} = world size "
                 f"{self.world_size} / tp_degree {self.tp_degree}) (strategy HYBRID_SHARD)"),)


class ElasticFields(LayoutFields, Protocol):
    nodes: int
    min_nodes: int
    micro_batch: int
    grad_accum: int


def is_elastic(cfg: ElasticFields) -> bool:
    """A run that may go on with fewer nodes than it started with (min_nodes below nodes)."""
    return 0 < cfg.min_nodes < cfg.nodes


def elastic_grad_accum(cfg: ElasticFields, actual: ParallelDims) -> int:
    """The grad_accum that keeps the planned global batch (micro_batch x grad_accum x the
    data-parallel size on `nodes` nodes) on the world the run has; grad_accum itself where the
    run is not elastic or has its planned nodes. ValueError where no whole number does (validate
    refuses such a run: elastic_problems)."""
    if not is_elastic(cfg):
        return cfg.grad_accum
    planned = ParallelDims.of(cfg, world_size=cfg.nodes * actual.procs_per_node,
                              procs_per_node=actual.procs_per_node)
    batch = planned.global_batch(cfg.micro_batch, cfg.grad_accum)
    per_step = cfg.micro_batch * actual.dp_degree
    if batch % per_step:
        raise ValueError(f"the global batch of {batch} sequences (micro_batch {cfg.micro_batch} x "
                         f"grad_accum {cfg.grad_accum} x {planned.dp_degree} data-parallel ranks "
                         f"on {cfg.nodes} nodes) is not a multiple of micro_batch x the "
                         f"{actual.dp_degree} data-parallel ranks of this world")
    return batch // per_step


def elastic_problems(cfg: ElasticFields, procs_per_node: int) -> LayoutProblems:
    """Every smaller world an elastic run may go on in (min_nodes .. nodes - 1 nodes) must hold
    its layout and its global batch; (field, message) pairs naming the first that does not."""
    if cfg.min_nodes > cfg.nodes:
        return (("min_nodes", f"{cfg.min_nodes} is more than nodes ({cfg.nodes}): at most nodes, "
                 "or 0 for a run that is not elastic"),)
    if not is_elastic(cfg):
        return ()
    for nodes in range(cfg.min_nodes, cfg.nodes):
        dims = ParallelDims.of(cfg, world_size=nodes * procs_per_node,
                               procs_per_node=procs_per_node)
        if dims.problems:
            name, message = dims.problems[0]
            return (("min_nodes", f"on {nodes} node(s) ({nodes * procs_per_node} processes) "
                     f"the run's layout does not hold ({name}: {message}): raise min_nodes"),)
        try:
            elastic_grad_accum(cfg, dims)
        except ValueError as exc:
            return (("min_nodes", f"on {nodes} node(s) {exc}: grad_accum cannot keep the "
                     "global batch; raise min_nodes or choose grad_accum and micro_batch so it "
                     "divides"),)
    return ()
