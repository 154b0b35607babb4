import warnings

import pytest
import torch

from trainer.config import TrainConfig
from trainer.parallel import DistEnv, check_start, fsdp_plan

CPU_WORLD_OF_TWO = DistEnv(rank=0, world_size=2, local_rank=0, local_world_size=2,
                           device=torch.device("cpu"))


def test_full_shard_is_a_1d_mesh_that_reshards_after_forward():
    assert fsdp_plan("FULL_SHARD", 16, 8, 0) == ((16,), ("shard",), True)


def test_shard_grad_op_keeps_parameters_unsharded_between_forward_and_backward():
    assert fsdp_plan("SHARD_GRAD_OP", 16, 8, 0) == ((16,), ("shard",), False)


def test_hybrid_shard_shards_within_a_node_by_default_and_replicates_across_nodes():
    assert fsdp_plan("HYBRID_SHARD", 16, 8, 0) == ((2, 8), ("replicate", "shard"), True)


def test_hybrid_shard_uses_the_configured_shard_group_size():
    assert fsdp_plan("HYBRID_SHARD", 16, 8, 4) == ((4, 4), ("replicate", "shard"), True)


def test_no_shard_replicates_everywhere():
    assert fsdp_plan("NO_SHARD", 16, 8, 0) == ((16, 1), ("replicate", "shard"), False)


def test_hybrid_shard_with_a_group_size_that_does_not_divide_the_world_names_both_options():
    with pytest.raises(ValueError, match="HYBRID_SHARD") as error:
        fsdp_plan("HYBRID_SHARD", 12, 8, 0)
    assert "shard_group_size" in str(error.value) and "(12)" in str(error.value)
    with pytest.raises(ValueError, match="shard_group_size \\(5\\)"):
        fsdp_plan("HYBRID_SHARD", 16, 8, 5)


def test_an_unknown_strategy_is_rejected_with_the_choices():
    with pytest.raises(ValueError, match="FULL_SHARD"):
        fsdp_plan("ZERO3", 8, 8, 0)


@pytest.mark.parametrize("option", ["activation_offload", "cpu_offload"])
def test_offloading_on_a_cpu_device_warns_that_it_saves_no_memory(option):
    with pytest.warns(UserWarning, match=f"{option} saves no memory on device cpu"):
        check_start(TrainConfig(**{option: True}), CPU_WORLD_OF_TWO)


def test_fp16_and_bf16_are_allowed_on_a_cpu_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for precision in ("fp16", "bf16"):
            check_start(TrainConfig(mixed_precision=precision), CPU_WORLD_OF_TWO)
