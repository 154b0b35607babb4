"""Tensor (and sequence) parallelism: same losses as without it, checkpoints, export, checks."""

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from finetune_contract.data import IGNORE_INDEX
from finetune_contract.parallel_dims import ParallelDims
from tests.support.training import demo_rows, read_metrics, torchrun, write_jsonl
from tests.trainer.tensor_parallel_worker import CHECKPOINT_AT, EVEN_VOCAB_MODEL_ENV, STEPS
from trainer.batch import Batch
from trainer.checkpoint import Checkpointer
from trainer.config import TrainConfig
from trainer.model import builtin_config
from trainer.tensor_parallel import pad_to_multiple


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    # 80 rows: 4 held out, 76 to train on, more than the 4 steps of 8 rows take.
    return write_jsonl(tmp_path_factory.mktemp("data") / "rows.jsonl", demo_rows(80))


@pytest.fixture(scope="module")
def two_ranks(dataset, tmp_path_factory):
    """FSDP over 2 ranks, then TP=2 (with a checkpoint at CHECKPOINT_AT), then its resumption."""
    out = tmp_path_factory.mktemp("tp")
    setups = ["fsdp_dp2", "tp2_dp1", "tp2_dp1_resumed"]
    torchrun(["tests/trainer/tensor_parallel_worker.py", str(dataset), str(out), *setups])
    return out


def train_records(output_dir) -> dict[int, dict[str, float]]:
    return {r["step"]: r for r in read_metrics(output_dir) if r["type"] == "train"}


def assert_same_training(actual_dir, expected_dir, steps) -> None:
    actual, expected = train_records(actual_dir), train_records(expected_dir)
    assert sorted(actual) == list(steps)
    for step in steps:
        assert actual[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5), step
        assert actual[step]["grad_norm"] == pytest.approx(expected[step]["grad_norm"], rel=1e-4)
        assert actual[step]["tokens"] == expected[step]["tokens"], step  # counted once per group
    assert all(math.isfinite(r["loss"]) for r in actual.values())


@pytest.mark.slow
def test_tp2_trains_to_the_same_losses_as_fsdp_without_tp(two_ranks):
    assert_same_training(two_ranks / "tp2_dp1", two_ranks / "fsdp_dp2", range(1, STEPS + 1))


@pytest.mark.slow
def test_a_vocabulary_split_over_tp_ranks_trains_to_the_same_losses_as_fsdp(
    dataset, tmp_path, monkeypatch
):
    """The head's weight sharded over the vocabulary (an even vocab): the sequence-parallel loss
    gathers it and its backward reduce-scatters the gradient."""
    model_dir = tmp_path / "even-vocab"
    config = builtin_config("tiny-llama")
    config.vocab_size += 1  # 726: divisible by tp_degree 2
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained("trainer/demo/tokenizer").save_pretrained(model_dir)
    monkeypatch.setenv(EVEN_VOCAB_MODEL_ENV, str(model_dir))
    out = tmp_path / "runs"
    torchrun(["tests/trainer/tensor_parallel_worker.py", str(dataset), str(out),
              "fsdp_dp2_even_vocab", "tp2_dp1_even_vocab"])
    assert_same_training(out / "tp2_dp1_even_vocab", out / "fsdp_dp2_even_vocab",
                         range(1, STEPS + 1))
    assert int((out / "tp2_dp1_even_vocab" / "sequence_parallel_loss_calls").read_text()) > 0


@pytest.mark.slow
def test_the_tp_loss_runs_on_each_ranks_part_of_the_sequence_never_whole_logits(two_ranks):
    """TP runs take the sequence-parallel loss (every step's forward and the evals), FSDP runs
    the plain chunked one; the equal losses above show its value and gradients are right."""
    def calls(setup: str) -> int:
        return int((two_ranks / setup / "sequence_parallel_loss_calls").read_text())

    assert calls("tp2_dp1") >= STEPS * 2  # 2 micro batches a step
    assert calls("fsdp_dp2") == 0


@pytest.mark.slow
def test_a_tp_run_resumed_from_its_checkpoint_reproduces_the_uninterrupted_losses(two_ranks):
    steps = range(CHECKPOINT_AT + 1, STEPS + 1)
    assert_same_training(two_ranks / "tp2_dp1_resumed", two_ranks / "tp2_dp1", steps)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP read by one process
def test_the_model_exported_from_a_tp_run_matches_its_checkpoint_and_the_run_without_tp(
    two_ranks,
):
    exported = AutoModelForCausalLM.from_pretrained(two_ranks / "tp2_dp1" / "model").eval()
    tokenizer = AutoTokenizer.from_pretrained(two_ranks / "tp2_dp1" / "model")
    # The weights after the last step, from the DCP shards of the 2-D (dp, tp) mesh.
    trained = LlamaForCausalLM(builtin_config("tiny-llama", tokenizer)).eval()
    state = {"model": trained.state_dict()}
    dcp.load(state, checkpoint_id=Checkpointer(str(two_ranks / "tp2_dp1"), 2, 0).latest())
    trained.load_state_dict(state["model"])
    without_tp = AutoModelForCausalLM.from_pretrained(two_ranks / "fsdp_dp2" / "model").eval()

    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    inputs = tokenizer("### Instruction:\nWhich day comes after Monday?", return_tensors="pt")
    with torch.no_grad():
        logits = exported(**inputs).logits
        torch.testing.assert_close(logits, trained(**inputs).logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, without_tp(**inputs).logits, rtol=1e-3, atol=1e-3)


@pytest.mark.slow
def test_dp2_x_tp2_trains_to_the_same_losses_as_fsdp_over_2_ranks(two_ranks, dataset, tmp_path):
    torchrun(["tests/trainer/tensor_parallel_worker.py", str(dataset), str(tmp_path), "tp2_dp2"], 4)
    assert_same_training(tmp_path / "tp2_dp2", two_ranks / "fsdp_dp2", range(1, STEPS + 1))


def tp_config(**overrides) -> TrainConfig:
    return TrainConfig(**{"tp_degree": 2, **overrides})


def tiny_config(**overrides):
    config = builtin_config("tiny-llama")
    for name, value in overrides.items():
        setattr(config, name, value)
    return config


def test_the_tp_dim_is_innermost_so_a_tp_group_is_consecutive_ranks():
    plan = ((2, 4, 2), ("replicate", "shard", "tp"))
    dims = ParallelDims(world_size=16, procs_per_node=8, strategy="HYBRID_SHARD",
                        shard_group_size=4, tp_degree=2)
    assert (dims.mesh_shape, dims.mesh_dim_names) == plan


def test_padding_for_sequence_parallelism_adds_pads_without_loss_at_the_end():
    ids = torch.arange(1, 8).reshape(1, 7)
    batch = Batch(ids, ids.clone(), 7, position_ids=torch.arange(7)[None])
    padded = pad_to_multiple(batch, 4, pad_id=0)
    assert padded.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 0]]
    assert padded.labels.tolist() == [[1, 2, 3, 4, 5, 6, 7, IGNORE_INDEX]]
    assert padded.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 0]]
    assert padded.num_tokens == 7
    assert pad_to_multiple(padded, 4, pad_id=0) is padded
