"""bench.train on a CPU: a tiny model, two timed steps, one JSON line per run."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT
from tests.support.training import torchrun

pytestmark = pytest.mark.slow  # each test runs the benchmark in a subprocess or under torchrun

RUN_KEYS = {
    "run", "model", "options", "micro_batch", "grad_accum", "seq_len", "steps_timed", "step_time_s",
    "step_time_mean_s", "tokens_per_s", "tflops_per_gpu", "mfu", "peak_memory_gib", "loss_first",
    "loss_last", "device", "torch",
}  # fmt: skip


def bench(*args: str) -> list[dict]:
    command = [
        sys.executable, "-m", "bench.train", "--models", "tiny", "--seq-len", "64",
        "--micro-batch", "2", "--steps", "2", "--warmup", "1", *args,
    ]  # fmt: skip
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-5000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"')]


def check_run(record: dict, run: str, tp: int = 1, accum: int = 1) -> None:
    assert set(record) == RUN_KEYS
    assert record["run"] == run and record["model"] == "tiny-llama"
    assert record["steps_timed"] == 2 and record["seq_len"] == 64 and record["micro_batch"] == 2
    assert record["tokens_per_s"] > 0 and record["tflops_per_gpu"] > 0
    # CPUs have no trusted peak: no MFU there; a GPU's is a fraction of its peak
    assert record["mfu"] is None if record["device"] == "cpu" else 0 < record["mfu"] <= 1
    # accum x 2 x 64 tokens a step; the ranks of a tensor-parallel group share them.
    assert record["grad_accum"] == accum
    tokens = accum * 128 / tp
    assert record["step_time_s"] == pytest.approx(tokens / record["tokens_per_s"], rel=1e-3)


def test_the_benchmark_prints_the_trainers_throughput_as_one_json_line():
    (record,) = bench("--no-hf")
    check_run(record, "trainer")
    assert record["options"]["mixed_precision"].startswith("bf16")
    assert record["options"]["loss"] == "chunked" and record["options"]["compile"] is False


@pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="Hugging Face Trainer needs accelerate"
)
def test_the_benchmark_runs_hugging_face_trainer_on_the_same_model_and_prints_the_ratio():
    ours, theirs, ratio = bench("--hf")
    check_run(ours, "trainer")
    check_run(theirs, "hf_trainer")
    assert theirs["options"]["attention"] == "sdpa"
    # Same model shape, init distribution and first batch: the same loss before any update.
    assert theirs["loss_first"] == pytest.approx(ours["loss_first"], rel=0.01)
    expected = ours["tokens_per_s"] / theirs["tokens_per_s"]
    assert (ratio["ours"], ratio["peer"]) == ("sdpa", "hf_trainer")
    assert ratio["ours_over_peer_tokens_per_s"] == pytest.approx(expected, rel=1e-2)


def test_on_demo_tokens_the_line_carries_every_steps_loss_and_the_loss_falls():
    (record,) = bench("--no-hf", "--tokens", "demo", "--steps", "12")
    losses = record.pop("losses")
    assert set(record) == RUN_KEYS and record["steps_timed"] == 12
    assert len(losses) == 13 and (losses[0], losses[-1]) == (record["loss_first"],
                                                             record["loss_last"])
    assert losses[-1] < losses[0]


def test_an_fp32_reference_trains_the_same_rows_and_the_contract_refuses_what_cannot_run():
    """--mixed-precision fp32 (ours only): the same model, data and first loss as bf16, in fp32;
    a combination the contract refuses (fa4 with fp32) is an error row in its words, not a run."""
    bench_args = ("--no-hf", "--peers=", "--tokens", "demo", "--packing")
    (bf16,) = bench(*bench_args)
    (fp32, refused) = bench(*bench_args, "--mixed-precision", "fp32", "--attention", "sdpa,fa4")
    assert fp32["options"]["mixed_precision"] == "fp32" and fp32["mfu"] is None
    assert fp32["loss_first"] == pytest.approx(bf16["loss_first"], rel=1e-2)
    assert fp32["loss_first"] != bf16["loss_first"]  # six digits tell the precisions apart
    assert "fa4 with mixed_precision fp32" in refused["error"]


def test_packed_demo_rows_run_and_count_only_their_documents_attention():
    """--packing end to end: a loss on fewer labels (no loss at a document's start), and the
    FLOPs of 12-token documents' attention, not 64's. That the rows keep their documents apart is
    test_bench_packing's (sdpa) and test_attention's (fa4)."""
    bench_args = ("--no-hf", "--peers=", "--tokens", "demo", "--steps", "2")
    (packed,) = bench(*bench_args, "--packing")
    (whole,) = bench(*bench_args)
    assert packed["options"]["packing"] and 9 <= packed["options"]["attended_keys"] < 17
    assert whole["options"]["attended_keys"] is None
    assert packed["losses"][0] != whole["losses"][0]
    assert packed["tflops_per_gpu"] / packed["tokens_per_s"] < (
        whole["tflops_per_gpu"] / whole["tokens_per_s"])


@pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="Hugging Face Trainer needs accelerate"
)
def test_with_gradient_accumulation_both_trainers_time_whole_optimizer_steps():
    ours, theirs, ratio = bench("--hf", "--grad-accum", "3")
    check_run(ours, "trainer", accum=3)
    check_run(theirs, "hf_trainer", accum=3)
    # steps_timed == 2 (check_run): one time per optimizer step, not per micro batch; the same
    # model and token distribution give the same first loss.
    assert theirs["loss_first"] == pytest.approx(ours["loss_first"], rel=0.01)
    assert ratio["grad_accum"] == 3


def test_the_benchmark_imports_neither_trainer_data_nor_datasets():
    modules = "'datasets', 'trainer.data'"
    code = f"import sys, bench.train; print(*(m in sys.modules for m in [{modules}]))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["False", "False"]


def test_the_benchmark_under_torchrun_prints_one_per_gpu_line_from_rank_0():
    result = torchrun(["-m", "bench.train", "--models", "tiny", "--seq-len", "64",
                       "--micro-batch", "2", "--steps", "2", "--warmup", "1", "--no-hf",
                       "--strategy", "HYBRID_SHARD", "--shard-group-size", "1"])
    lines = [json.loads(x) for x in result.stdout.splitlines() if x.startswith('{"')]
    assert len(lines) == 1  # rank 0 only, and no Hugging Face baseline with several processes
    check_run(lines[0], "trainer")
    assert lines[0]["options"]["gpus"] == 2
    assert lines[0]["options"]["strategy"] == "HYBRID_SHARD"
    assert lines[0]["options"]["shard_group_size"] == 1


def test_with_tensor_parallelism_each_gpu_is_credited_a_tp_th_of_the_tokens():
    result = torchrun(["-m", "bench.train", "--models", "tiny", "--seq-len", "64",
                       "--micro-batch", "2", "--steps", "2", "--warmup", "1", "--no-hf",
                       "--strategy", "FULL_SHARD", "--tp-degree", "2"])
    (line,) = [json.loads(x) for x in result.stdout.splitlines() if x.startswith('{"')]
    check_run(line, "trainer", tp=2)
    assert line["options"]["tp_degree"] == 2


def test_a_float8_run_reports_tokens_per_second_and_no_mfu(monkeypatch):
    # torchao's emulation stands in for the float8 tensor cores a CPU does not have.
    monkeypatch.setenv("TRAINER_FLOAT8_EMULATE", "1")
    (record,) = bench("--float8", "--no-hf")
    assert record["options"]["float8"] is True and record["tokens_per_s"] > 0
    assert record["mfu"] is None and record["tflops_per_gpu"] is None
