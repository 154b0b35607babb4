"""What validate knows of capacity that can be taken away: a spot run whose step and save do not
fit a notice, an elastic run whose smaller worlds cannot keep its layout or global batch, and
the checkpoint's size and times the planner gives both."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from finetune.config import ConfigError
from finetune.run_plan import plan_run
from finetune.validate import validate_params
from finetune_contract.checkpoint_time import (
    SPOT_NOTICE_S,
    STATE_BYTES_PER_PARAM,
    checkpoint_time,
    grace_period_s,
    storage_of,
)
from finetune_contract.parallel_dims import ParallelDims, elastic_grad_accum, elastic_problems
from finetune_contract.train_config import TrainConfig
from tests.support.eks import EKS_PARAMS

P5 = {**EKS_PARAMS, "instance_type": "p5.48xlarge", "nodes": 1, "model": "llama-8b",
      "seq_len": 4096, "micro_batch": 1, "mixed_precision": "bf16",
      "activation_checkpointing": "full", "dataset": "s3://bucket/data.jsonl"}


def refused(params: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        validate_params(params, run_id="manual__capacity")
    return dict(err.value.errors)


def test_a_spot_run_whose_save_does_not_fit_the_notice_is_refused_naming_the_figures():
    errors = refused({**P5, "capacity_type": "spot"})
    message = errors["capacity_type"]
    assert f"{SPOT_NOTICE_S} s after its notice" in message
    assert "GB from each node to s3" in message and "need" in message
    assert "on-demand" in message and "LoRA" in message


def test_the_same_run_on_demand_or_with_lora_on_spot_is_accepted():
    validate_params({**P5, "capacity_type": "on-demand"}, run_id="manual__od")
    cfg = validate_params({**P5, "capacity_type": "spot", "lora_rank": 16}, run_id="manual__lo")
    plan = plan_run(cfg)
    assert plan.checkpoint.bytes_total < 1e9 and plan.grace_s < SPOT_NOTICE_S


def test_the_plan_counts_twelve_bytes_a_trained_parameter_sharded_over_the_nodes():
    one = checkpoint_time(8_000_000_000, world_size=8, local_world_size=8, storage="s3")
    two = checkpoint_time(8_000_000_000, world_size=16, local_world_size=8, storage="s3")
    assert one.bytes_total == STATE_BYTES_PER_PARAM * 8e9 == two.bytes_total
    assert two.bytes_per_node == one.bytes_per_node / 2 and two.save_s < one.save_s
    assert one.save_s > checkpoint_time(8_000_000_000, world_size=8, local_world_size=8,
                                        storage="local").save_s  # staged, then uploaded
    assert grace_period_s(10.0, one.save_s) > 10.0 + one.save_s
    assert grace_period_s(None, None) >= 300


@pytest.mark.parametrize(("output_dir", "volumes", "storage"), [
    ("s3://bucket/runs", "", "s3"), ("/fsx/runs", "fsx-claim:/fsx", "volume"),
    ("/fsxa/runs", "fsx-claim:/fsx", "local"), ("runs", "", "local"),
])
def test_where_a_checkpoint_goes_follows_the_output_dir(output_dir, volumes, storage):
    assert storage_of(output_dir, volumes) == storage


def test_min_nodes_above_nodes_is_refused_naming_both():
    errors = refused({"procs_per_node": 1, "nodes": 2, "min_nodes": 3})
    assert "more than nodes (2)" in errors["min_nodes"]


def test_an_elastic_run_whose_smaller_world_cannot_keep_the_global_batch_is_refused():
    # 3 nodes x 1 process, micro_batch 2, grad_accum 1: 6 sequences a step; on 2 nodes each
    # step would take 3 micro-batches of 2 over 2 ranks: no whole grad_accum does.
    errors = refused({"procs_per_node": 1, "nodes": 3, "min_nodes": 2, "micro_batch": 2,
                      "max_restarts": 1})
    assert errors["min_nodes"].startswith("on 2 node(s) the global batch of 6 sequences")


def test_an_elastic_run_without_restarts_is_refused_naming_max_restarts():
    errors = refused({"procs_per_node": 1, "nodes": 2, "min_nodes": 1})
    assert "a lost node is a restart" in errors["max_restarts"]


def test_an_on_demand_fallback_needs_its_node_group():
    errors = refused({**EKS_PARAMS, "capacity_fallback": "on-demand"})
    assert "name the on-demand node group" in errors["fallback_nodegroup"]


def test_an_elastic_run_whose_smaller_world_breaks_the_layout_is_refused():
    # HYBRID_SHARD with shard groups of 2 processes: one node of 1 process cannot hold one.
    config = TrainConfig(nodes=2, min_nodes=1, strategy="HYBRID_SHARD", shard_group_size=2,
                         micro_batch=1)
    problems = elastic_problems(config, procs_per_node=1)
    assert problems and problems[0][0] == "min_nodes" and "on 1 node(s)" in problems[0][1]


@settings(max_examples=200, deadline=None)
@given(nodes=st.integers(2, 8), procs=st.integers(1, 4), micro_batch=st.integers(1, 4),
       grad_accum=st.integers(1, 4), data=st.data())
def test_every_world_an_accepted_elastic_run_may_shrink_to_keeps_its_global_batch(
        nodes, procs, micro_batch, grad_accum, data):
    min_nodes = data.draw(st.integers(1, nodes - 1))
    config = TrainConfig(nodes=nodes, min_nodes=min_nodes, micro_batch=micro_batch,
                         grad_accum=grad_accum)
    planned = ParallelDims.of(config, world_size=nodes * procs, procs_per_node=procs)
    if elastic_problems(config, procs):
        return
    for left in range(min_nodes, nodes + 1):
        dims = ParallelDims.of(config, world_size=left * procs, procs_per_node=procs)
        accum = elastic_grad_accum(config, dims)
        assert micro_batch * accum * dims.dp_degree == planned.global_batch(micro_batch,
                                                                            grad_accum)
