"""End-to-end runs with two gloo processes under torchrun, as the local target starts them."""

import json
import math
import shutil
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from tests.support.aws import new_bucket
from tests.support.training import demo_rows, read_metrics, torchrun, write_jsonl
from tests.trainer.strategy_worker import GROUPS, SETUPS
from trainer.checkpoint import Checkpointer
from trainer.demo import DEMO_TOKENIZER
from trainer.model import builtin_config

pytestmark = pytest.mark.slow  # every test reads runs torchrun made (module fixtures)

STEPS, CHECKPOINT_AT = 6, 3
TRAIN_KEYS = {
    "type", "step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "tflops_per_device",
    "mfu", "step_time_s", "rank_step_time_s", "peak_memory_bytes", "time",
}  # fmt: skip
SUMMARY_KEYS = {
    "initial_eval_loss", "final_eval_loss", "steps", "tokens_per_s", "tflops_per_device", "mfu",
    "peak_memory_bytes", "wall_time_s", "world_size", "resumed_from_step", "skipped_rows",
    "skipped_rows_by_reason", "peak_flops", "peak_flops_source", "config",
}  # fmt: skip


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    # 60 usable rows: 4 held out, 28 per rank = 7 micro batches of 4 per epoch, so 6 steps of
    # 2 micro batches cross an epoch boundary after the checkpoint at step 3.
    rows = demo_rows(60) + [{"prompt": "Write in capitals: owl", "response": ""}]
    return write_jsonl(tmp_path_factory.mktemp("data") / "rows.jsonl", rows)


def train_args(dataset, output_dir) -> list[str]:
    return [
        "-m", "trainer.train", "--dataset", str(dataset), "--output_dir", str(output_dir),
        "--micro_batch", "4", "--grad_accum", "2", "--max_steps", str(STEPS),
        "--warmup_steps", "2", "--eval_interval", str(CHECKPOINT_AT),
        "--checkpoint_interval", str(CHECKPOINT_AT), "--log_interval", "2",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def full_run(dataset, tmp_path_factory):
    """An uninterrupted run of STEPS steps with checkpoints every CHECKPOINT_AT steps."""
    output_dir = tmp_path_factory.mktemp("full")
    result = torchrun(train_args(dataset, output_dir))
    return output_dir, result.stdout


def losses(output_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(output_dir) if r["type"] == "train"}


def test_a_run_resumed_from_a_checkpoint_reproduces_the_uninterrupted_losses(
    full_run, dataset, tmp_path
):
    full_dir, _ = full_run
    # What a run leaves when it dies while saving step 6: the complete step-3 checkpoint, an
    # incomplete `.tmp` one that must be ignored, and a log that got past step 3 and was torn.
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(full_dir / "checkpoints" / "step_00000003", checkpoints / "step_00000003")
    (checkpoints / "step_00000006.tmp").mkdir()
    (checkpoints / "step_00000006.tmp" / "__0_0.distcp").write_bytes(b"torn write")
    log_before_crash = (full_dir / "metrics.jsonl").read_text() + '{"type": "tr'
    (tmp_path / "metrics.jsonl").write_text(log_before_crash)
    restarted_at = time.time()

    torchrun(train_args(dataset, tmp_path))

    records = read_metrics(tmp_path)
    assert [r["step"] for r in records if r["type"] == "train"] == list(range(1, STEPS + 1))
    assert all(r["time"] > restarted_at for r in records if r["step"] > CHECKPOINT_AT)
    resumed, uninterrupted = losses(tmp_path), losses(full_dir)
    for step in range(CHECKPOINT_AT + 1, STEPS + 1):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-5), step
    summary = json.loads((tmp_path / "summary.json").read_text())
    full_summary = json.loads((full_dir / "summary.json").read_text())
    assert summary["resumed_from_step"] == CHECKPOINT_AT
    assert summary["initial_eval_loss"] == full_summary["initial_eval_loss"]
    assert summary["final_eval_loss"] == pytest.approx(full_summary["final_eval_loss"], rel=1e-5)
    assert [p.name for p in sorted(checkpoints.iterdir())] == ["step_00000003", "step_00000006"]


def test_rank_zero_logs_every_step_and_eval_and_writes_a_summary(full_run):
    output_dir, stdout = full_run
    records = read_metrics(output_dir)
    train = [r for r in records if r["type"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert all(set(r) == TRAIN_KEYS for r in train)
    # CPUs have no trusted peak FLOP/s: TFLOPs per device, and no MFU
    assert all(r["tokens"] > 0 and r["tflops_per_device"] > 0 and r["grad_norm"] > 0
               and r["mfu"] is None for r in train)
    assert [r["step"] for r in records if r["type"] == "eval"] == [0, 3, 6]
    assert "eta" in stdout

    summary = json.loads((output_dir / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary)
    assert summary["world_size"] == 2 and summary["steps"] == STEPS
    assert summary["skipped_rows"] == 1 and summary["skipped_rows_by_reason"] == {"empty": 1}
    data = [r for r in records if r["type"] == "data"]
    assert [(r["train_rows"], r["eval_rows"], r["skipped_rows_by_reason"]) for r in data] == [
        (summary["train_rows"], summary["eval_rows"], {"empty": 1})]
    assert summary["resumed_from_step"] is None
    assert summary["peak_flops"] is None and summary["peak_flops_source"].startswith("none")
    assert summary["mfu"] is None and summary["tokens_per_s"] == pytest.approx(
        sum(r["tokens"] for r in train[1:]) / sum(r["step_time_s"] for r in train[1:]))
    assert "config in " in stdout and "\"seq_len\":" not in stdout  # one line, not a dump
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    resolved = json.loads((output_dir / "trainer_config.resolved.json").read_text())
    assert resolved == summary["config"] and resolved["tokenizer"] == str(DEMO_TOKENIZER)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP read by one process
def test_the_exported_model_loads_with_transformers_and_matches_the_trained_weights(full_run):
    output_dir, _ = full_run
    exported = AutoModelForCausalLM.from_pretrained(output_dir / "model").eval()
    tokenizer = AutoTokenizer.from_pretrained(output_dir / "model")
    # The trainer's model after the last step, from its sharded checkpoint (written by 2 ranks).
    trained = LlamaForCausalLM(builtin_config("tiny-llama", tokenizer)).eval()
    state = {"model": trained.state_dict()}
    dcp.load(state, checkpoint_id=Checkpointer(str(output_dir), 2, 0).latest())
    trained.load_state_dict(state["model"])

    assert exported.config.tie_word_embeddings
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    input_ids = tokenizer("### Instruction:\nWhich day comes after Monday?", return_tensors="pt")
    with torch.no_grad():
        expected = trained(**input_ids).logits
        actual = exported(**input_ids).logits
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


S3_CHECKPOINT_EVERY = 2  # checkpoints at steps 2, 4, 6; the newest two are kept


def local_files(root) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def s3_files(client, bucket, prefix) -> dict[str, bytes]:
    """{path relative to the prefix: content} of every object under `prefix/`."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    keys = [obj["Key"] for page in pages for obj in page.get("Contents", [])]
    return {
        key[len(prefix) + 1 :]: client.get_object(Bucket=bucket, Key=key)["Body"].read()
        for key in keys
    }


def s3_metrics(files) -> list[dict]:
    return [json.loads(line) for line in files["metrics.jsonl"].decode().splitlines()]


@pytest.fixture(scope="module")
def s3_run(dataset, moto_endpoint, tmp_path_factory):
    """An uninterrupted run to s3:// with async checkpoints; (client, bucket, its objects)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        client, bucket = new_bucket(monkeypatch, moto_endpoint)
        staging = tmp_path_factory.mktemp("staging")
        monkeypatch.setenv("FINETUNE_STAGING_DIR", str(staging))
        args = train_args(dataset, f"s3://{bucket}/runs/first")
        args += ["--checkpoint_interval", str(S3_CHECKPOINT_EVERY), "--checkpoint_async", "true"]
        torchrun(args)
        yield client, bucket, s3_files(client, bucket, "runs/first"), staging, monkeypatch


def test_an_s3_output_gets_the_local_layout_and_async_checkpoints_train_the_same(s3_run, full_run):
    _, _, files, staging, _ = s3_run
    full_dir, _ = full_run
    local = local_files(full_dir)
    shards = {f.split("/", 2)[2] for f in local if f.startswith("checkpoints/step_00000003/")}
    assert shards == {".metadata", "__0_0.distcp", "__1_0.distcp", "trainer_state.json"}
    # Heartbeats are for the ranks of a node (trainer/watchdog.py): never uploaded.
    # The set a trainer started without the prepare_data stage prepares for itself is its input,
    # not its output layout.
    expected = {f for f in local
                if not f.startswith(("checkpoints/", "heartbeats/", "prepared_data/"))} | {
        f"checkpoints/step_0000000{step}/{name}" for step in (4, 6) for name in shards
    }
    assert set(files) == expected  # step 2 pruned from S3, nothing of the staging dir
    assert json.loads(files["checkpoints/step_00000006/trainer_state.json"])["step"] == 6
    # Background writes and uploads change nothing in training.
    train = {r["step"]: r["loss"] for r in s3_metrics(files) if r["type"] == "train"}
    assert train == pytest.approx(losses(full_dir), rel=1e-6)
    summary = json.loads(files["summary.json"])
    assert summary["steps"] == STEPS and summary["config"]["output_dir"].startswith("s3://")
    exported = (full_dir / "model" / "model.safetensors").read_bytes()
    assert files["model/model.safetensors"] == exported
    assert not list(staging.rglob("checkpoints/*"))  # uploaded shards are not kept locally


def test_a_run_resumes_from_the_newest_complete_s3_checkpoint_not_an_interrupted_upload(
    s3_run, full_run, dataset, tmp_path
):
    client, bucket, files, _, monkeypatch = s3_run
    full_dir, _ = full_run
    # What a run leaves when it dies while uploading step 6: every shard, no trainer_state.json.
    for name, body in files.items():
        if name != "checkpoints/step_00000006/trainer_state.json":
            client.put_object(Bucket=bucket, Key=f"runs/second/{name}", Body=body)
    monkeypatch.setenv("FINETUNE_STAGING_DIR", str(tmp_path))  # a new pod: nothing staged

    args = train_args(dataset, f"s3://{bucket}/runs/second")
    args += ["--checkpoint_interval", str(S3_CHECKPOINT_EVERY), "--checkpoint_async", "true"]
    result = torchrun(args)

    assert "resumed from" in result.stdout and "step_00000004" in result.stdout
    after = s3_files(client, bucket, "runs/second")
    summary = json.loads(after["summary.json"])
    assert summary["resumed_from_step"] == 4
    records = s3_metrics(after)
    assert [r["step"] for r in records if r["type"] == "train"] == list(range(1, STEPS + 1))
    resumed = {r["step"]: r["loss"] for r in records if r["type"] == "train"}
    uninterrupted = losses(full_dir)
    for step in (5, 6):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-5), step
    assert json.loads(after["checkpoints/step_00000006/trainer_state.json"])["step"] == 6
    assert {f.split("/")[1] for f in after if f.startswith("checkpoints/")} == {
        "step_00000004", "step_00000006",
    }  # fmt: skip


@pytest.fixture(scope="module")
def setup_runs(dataset, tmp_path_factory):
    """3 steps of every strategy_worker set-up, in one torchrun: start-up is most of the time."""
    root = tmp_path_factory.mktemp("setups")
    torchrun(["tests/trainer/strategy_worker.py", str(dataset), str(root), ",".join(GROUPS)])
    return root


def test_every_sharding_strategy_and_activation_checkpointing_trains_to_the_same_losses(
    setup_runs,
):
    reference = losses(setup_runs / "full_shard")
    assert len(reference) == 3 and all(math.isfinite(v) for v in reference.values())
    for name in SETUPS:
        tolerance = 2e-2 if "bf16" in name else 1e-4
        assert losses(setup_runs / name) == pytest.approx(reference, rel=tolerance), name
        assert (setup_runs / name / "model" / "model.safetensors").is_file()


def test_precision_and_activation_memory_options_train_to_the_fp32_losses(setup_runs):
    reference = losses(setup_runs / "full_shard")
    # Recomputed and offloaded activations are the same numbers: fp32 losses are equal.
    for name in ("selective_op", "selective_every_2", "offloaded", "offloaded_blocks"):
        assert losses(setup_runs / name) == pytest.approx(reference, rel=1e-6), name
    # fp16 computes the first step's loss with the same weights, then trains on its own path: the
    # scaler may skip early steps while its scale calibrates from 2**16.
    fp16 = [r for r in read_metrics(setup_runs / "fp16") if r["type"] == "train"]
    assert fp16[0]["loss"] == pytest.approx(reference[1], rel=1e-3)
    scale, skipped = 2.0**16, 0
    for record in fp16:
        assert math.isfinite(record["loss"]) and record["loss_scale"] <= scale
        skipped += record["loss_scale"] < scale  # a skipped step halves the scale
        scale = record["loss_scale"]
        assert record["skipped_steps"] == skipped
    summary = json.loads((setup_runs / "fp16" / "summary.json").read_text())
    assert summary["skipped_steps"] == skipped < len(fp16)
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    # The memory options change nothing in fp16 either.
    everything = losses(setup_runs / "fp16_all_memory_options")
    assert everything == pytest.approx(losses(setup_runs / "fp16"), rel=1e-6)
