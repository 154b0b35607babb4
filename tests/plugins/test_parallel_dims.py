"""The parallel layout (finetune_contract.parallel_dims): the FSDP1 strategy names as mesh dims,
the degrees of any world, its problems in the rules' words, the same whichever side asks."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from finetune.config import RunConfig
from finetune_contract.fields import STRATEGIES
from finetune_contract.parallel_dims import STRATEGY_DIMS, ParallelDims
from finetune_contract.rules import config_problems
from finetune_contract.train_config import TrainConfig

LAYOUT_FIELDS = {"tp_degree", "shard_group_size"}


def layout(strategy, world_size, procs_per_node, shard_group_size=0, tp_degree=1) -> ParallelDims:
    return ParallelDims(world_size=world_size, procs_per_node=procs_per_node, strategy=strategy,
                        shard_group_size=shard_group_size, tp_degree=tp_degree)


def mesh_plan(*args) -> tuple:
    """(mesh shape, mesh dim names, reshard_after_forward) of a layout."""
    dims = layout(*args)
    return dims.mesh_shape, dims.mesh_dim_names, dims.reshard_after_forward


def test_full_shard_is_a_1d_mesh_that_reshards_after_forward():
    assert mesh_plan("FULL_SHARD", 16, 8, 0) == ((16,), ("shard",), True)


def test_shard_grad_op_keeps_parameters_unsharded_between_forward_and_backward():
    assert mesh_plan("SHARD_GRAD_OP", 16, 8, 0) == ((16,), ("shard",), False)


def test_hybrid_shard_shards_within_a_node_by_default_and_replicates_across_nodes():
    assert mesh_plan("HYBRID_SHARD", 16, 8, 0) == ((2, 8), ("replicate", "shard"), True)


def test_hybrid_shard_uses_the_configured_shard_group_size():
    assert mesh_plan("HYBRID_SHARD", 16, 8, 4) == ((4, 4), ("replicate", "shard"), True)


def test_no_shard_replicates_everywhere():
    assert mesh_plan("NO_SHARD", 16, 8, 0) == ((16, 1), ("replicate", "shard"), False)


def test_with_tensor_parallelism_fsdp_covers_the_other_dims_and_a_node_holds_one_group():
    dims = layout("HYBRID_SHARD", 16, 8, 0, tp_degree=2)
    assert dims.dp_dim_names == ("replicate", "shard") and dims.dp_degree == 8
    # The default shard group is a node's processes over tp: 8 / 2.
    assert (dims.mesh_shape, dims.mesh_dim_names) == ((2, 4, 2), ("replicate", "shard", "tp"))


def test_hybrid_shard_with_a_group_that_does_not_divide_the_world_names_the_group_and_size():
    [(field, message)] = layout("HYBRID_SHARD", 12, 8, 0).problems
    assert field == "shard_group_size" and "HYBRID_SHARD" in message
    assert "(8, processes per node / tp_degree (shard_group_size 0))" in message
    assert "(12 = world size 12 / tp_degree 1)" in message
    [(field, message)] = layout("HYBRID_SHARD", 16, 8, 5).problems
    assert field == "shard_group_size" and "shard group (5, shard_group_size)" in message


def test_an_unknown_strategy_is_rejected_with_the_choices():
    with pytest.raises(ValueError, match="FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD or NO_SHARD"):
        layout("ZERO3", 8, 8, 0)


def test_every_strategy_the_parameter_table_offers_has_its_mesh_dims():
    assert set(STRATEGY_DIMS) == set(STRATEGIES)


def test_one_process_on_its_device_needs_no_fsdp_whatever_its_strategy():
    assert not layout("SHARD_GRAD_OP", 1, 1).needs_fsdp(cpu_offload=False)
    assert not layout("NO_SHARD", 1, 1).needs_fsdp(cpu_offload=False)
    assert layout("NO_SHARD", 1, 1).needs_fsdp(cpu_offload=True)  # FSDP's offload policy
    # frees each block's compute copies after forward without FSDP
    assert not layout("FULL_SHARD", 1, 1).needs_fsdp(cpu_offload=False)
    assert layout("FULL_SHARD", 1, 1).needs_fsdp(cpu_offload=True)
    assert layout("NO_SHARD", 2, 2).needs_fsdp(cpu_offload=False)
    assert layout("NO_SHARD", 2, 2, tp_degree=2).needs_fsdp(cpu_offload=False)


def test_validate_plans_the_layout_of_the_run_config_s_world():
    cfg = RunConfig(run_id="r", run_name="r", rdzv_id="r", run_dir="/tmp/r", nodes=2,
                    procs_per_node=4, strategy="HYBRID_SHARD", tp_degree=2)
    dims = cfg.parallel_dims
    assert (dims.world_size, dims.procs_per_node, dims.dp_degree) == (8, 4, 4)
    assert (dims.replicate_degree, dims.shard_degree) == (2, 2)


WORLDS = st.fixed_dictionaries({
    "strategy": st.sampled_from(STRATEGIES),
    "nodes": st.integers(1, 8),
    "procs_per_node": st.sampled_from([1, 2, 3, 4, 6, 8]),
    "shard_group_size": st.sampled_from([0, 0, 1, 2, 3, 4, 8, 16]),
    "tp_degree": st.sampled_from([1, 1, 2, 3, 4, 8]),
})


def world_layout(world: dict) -> ParallelDims:
    return layout(world["strategy"], world["nodes"] * world["procs_per_node"],
                  world["procs_per_node"], world["shard_group_size"], world["tp_degree"])


@given(WORLDS, st.integers(1, 64), st.integers(1, 16))
def test_an_accepted_layout_s_degrees_multiply_to_the_world_size(world, micro_batch, grad_accum):
    dims = world_layout(world)
    if dims.problems:
        return
    assert dims.replicate_degree * dims.shard_degree * dims.tp_degree == dims.world_size
    assert math.prod(dims.mesh_shape) == dims.world_size
    assert dims.dp_degree * dims.tp_degree == dims.world_size
    assert len(dims.mesh_shape) == len(dims.mesh_dim_names) == len(dims.dp_dim_names) + (
        dims.tp_degree > 1)
    assert dims.param_shards == dims.shard_degree * dims.tp_degree
    # Each data-parallel rank is one tensor-parallel group: tp_degree consecutive ranks.
    ranks = [dims.dp_rank(rank) for rank in range(dims.world_size)]
    assert ranks == sorted(ranks) and set(ranks) == set(range(dims.dp_degree))
    assert all(ranks.count(r) == dims.tp_degree for r in set(ranks))
    assert dims.global_batch(micro_batch, grad_accum) == micro_batch * grad_accum * \
        len(set(ranks))


@given(WORLDS)
def test_a_layout_has_problems_exactly_when_its_world_cannot_be_divided_so(world):
    dims = world_layout(world)
    tp, procs, total = world["tp_degree"], world["procs_per_node"], dims.world_size
    tp_fits = procs % tp == 0 and total % tp == 0
    if world["strategy"] == "HYBRID_SHARD":
        group = world["shard_group_size"] or procs // tp
        fits = tp_fits and (total // tp) % group == 0
    else:
        fits = tp_fits and world["shard_group_size"] == 0
    assert (not dims.problems) == fits
    assert {field for field, _ in dims.problems} <= LAYOUT_FIELDS
    assert all(message for _, message in dims.problems)


@given(WORLDS)
def test_the_rules_refuse_a_layout_in_the_layout_s_words(world):
    """validate and the trainer's start both ask config_problems: with nothing else wrong, its
    layout problems are the layout's own."""
    cfg = TrainConfig(strategy=world["strategy"], shard_group_size=world["shard_group_size"],
                      tp_degree=world["tp_degree"], seq_len=96)
    dims = world_layout(world)
    found = config_problems(cfg, world_size=dims.world_size,
                            local_world_size=world["procs_per_node"], shape=None)
    assert [p for p in found if p[0] in LAYOUT_FIELDS] == list(dims.problems)
