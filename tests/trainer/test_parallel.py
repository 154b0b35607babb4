"""The trainer's start checks, and the device mesh it builds from the run's parallel layout
(finetune_contract.parallel_dims, whose arithmetic tests/plugins/test_parallel_dims.py tests)."""

import itertools
import warnings
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch.testing._internal.distributed.fake_pg import FakeStore

from finetune_contract.fields import STRATEGIES, ContractError
from finetune_contract.parallel_dims import ParallelDims
from trainer.config import TrainConfig
from trainer.parallel import DistEnv, build_mesh, check_start

CPU_WORLD_OF_TWO = DistEnv(rank=0, world_size=2, local_rank=0, local_world_size=2,
                           device=torch.device("cpu"))


@contextmanager
def fake_world(world_size: int, procs_per_node: int):
    """Rank 0 of a world of `world_size` whose collectives do nothing (torch's fake process
    group): a device mesh of any size builds in this one process."""
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield DistEnv(rank=0, world_size=world_size, local_rank=0,
                      local_world_size=procs_per_node, device=torch.device("cpu"))
    finally:
        dist.destroy_process_group()


# shard_group_size only where it applies: the rest of the refusals are tp_degree's and the group's.
LAYOUTS = st.sampled_from(STRATEGIES).flatmap(lambda strategy: st.fixed_dictionaries({
    "strategy": st.just(strategy),
    "nodes": st.integers(1, 4),
    "procs_per_node": st.sampled_from([1, 2, 4, 6, 8]),
    "shard_group_size": st.sampled_from([0, 0, 1, 2, 4, 8] if strategy == "HYBRID_SHARD"
                                        else [0]),
    "tp_degree": st.sampled_from([1, 2, 4]),
}))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(LAYOUTS)
def test_every_accepted_layout_builds_its_mesh_with_tp_groups_within_a_node(layout):
    procs = layout.pop("procs_per_node")
    world_size = layout.pop("nodes") * procs
    config = TrainConfig(**layout)
    dims = ParallelDims.of(config, world_size=world_size, procs_per_node=procs)
    with fake_world(world_size, procs) as env:
        if dims.problems:
            with pytest.raises(ContractError) as refused:
                build_mesh(config, env)
            assert refused.value.errors == list(dims.problems)
            event("refused")
            return
        event(f"built {dims.mesh_dim_names}")
        mesh = build_mesh(config, env)
        assert_mesh_of(mesh, dims, hybrid_default_group=config.strategy == "HYBRID_SHARD"
                       and not config.shard_group_size)


def assert_mesh_of(mesh, dims: ParallelDims, hybrid_default_group: bool) -> None:
    """The mesh has the layout's dims and sizes; every rank's place in it: its data-parallel
    index is dims.dp_rank, its TP group (same data-parallel index) is on one node, and
    HYBRID_SHARD's default shard group is a node."""
    assert mesh.dims == dims
    assert tuple(mesh.world.shape) == dims.mesh_shape
    assert mesh.world.mesh_dim_names == dims.mesh_dim_names
    assert mesh.data_parallel.mesh_dim_names == dims.dp_dim_names
    assert mesh.data_parallel.size() == dims.dp_degree
    assert mesh.data_parallel["shard"].size() == dims.shard_degree
    assert (mesh.tensor_parallel.size() if mesh.tensor_parallel else 1) == dims.tp_degree
    ranks, procs = mesh.world.mesh, dims.procs_per_node
    dp_shape = dims.mesh_shape[:len(dims.dp_dim_names)]
    for place in itertools.product(*(range(n) for n in dims.mesh_shape)):
        dp_place, dp_index = place[:len(dp_shape)], 0
        for size, index in zip(dp_shape, dp_place, strict=True):
            dp_index = dp_index * size + index
        assert dims.dp_rank(int(ranks[place])) == dp_index
        if dims.tp_degree > 1:
            assert len({int(r) // procs for r in ranks[dp_place]}) == 1
    if hybrid_default_group:
        for replica in ranks:
            assert len({int(r) // procs for r in replica.flatten()}) == 1


@pytest.mark.parametrize("option", ["activation_offload", "cpu_offload"])
def test_offloading_on_a_cpu_device_warns_that_it_saves_no_memory(option):
    with pytest.warns(UserWarning, match=f"{option} saves no memory on device cpu"):
        check_start(TrainConfig(**{option: True}), CPU_WORLD_OF_TWO)


def test_fp16_and_bf16_are_allowed_on_a_cpu_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for precision in ("fp16", "bf16"):
            check_start(TrainConfig(mixed_precision=precision), CPU_WORLD_OF_TWO)
