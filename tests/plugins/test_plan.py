"""The planner: its error over the measured rows, the memory rule at validate, auto checkpointing,
the plan command and the scaling prediction."""

from __future__ import annotations

import json

import pytest

from finetune.config import ConfigError, RunConfig
from finetune.plan_cli import main
from finetune.run_plan import hardware_of, model_config_of, plan_text, scaling_rows
from finetune.validate import validate_params
from finetune_contract.instance_types import INSTANCE_TYPES
from finetune_contract.plan_calibration import ROWS
from finetune_contract.planner import (
    MEMORY_ERROR,
    THROUGHPUT_ERROR,
    Hardware,
    estimate,
    resolve_checkpointing,
)
from finetune_contract.train_config import TrainConfig

H200 = hardware_of(INSTANCE_TYPES["p5e.48xlarge"])
EKS_SITE = {"target": "eks", "cluster_name": "gpu", "nodegroup": "ng",
            "output_dir": "s3://bucket/runs",
            "image": "111122223333.dkr.ecr.us-east-1.amazonaws.com/finetune-trainer:abc"}


def _estimate_of(row):
    return estimate(TrainConfig(**row.config), world_size=row.gpus, local_world_size=row.gpus,
                    hardware=H200)


def _errors(measured: str, estimated: str) -> list[tuple[str, float]]:
    out = []
    for row in ROWS:
        est = getattr(_estimate_of(row), estimated)
        out.append((f"{row.model} {row.gpus} GPU {row.settings}",
                    abs(est - getattr(row, measured)) / getattr(row, measured)))
    return out


def test_estimated_peak_memory_is_within_the_stated_error_on_every_measured_row():
    errors = _errors("peak_gib", "peak_gib")
    worst = max(errors, key=lambda e: e[1])
    assert worst[1] <= MEMORY_ERROR, worst


def test_estimated_tokens_per_s_is_within_the_stated_error_on_every_measured_row():
    errors = _errors("tokens_per_s", "tokens_per_s_per_gpu")
    worst = max(errors, key=lambda e: e[1])
    assert worst[1] <= THROUGHPUT_ERROR, worst
    assert sum(e for _, e in errors) / len(errors) <= THROUGHPUT_ERROR / 2


def test_every_familys_activation_memory_is_within_8_percent_of_the_h200s():
    """The slope of peak memory over micro-batch (what the saved activations cost) of each
    family of the table, predicted against measured; the peaks within 5% (the Llama control's
    own error is 3.4% on these small models: the fixed overhead weighs more)."""
    from finetune_contract.families import FAMILIES
    from finetune_contract.plan_calibration import BASE, FAMILY_ROWS

    assert sorted(FAMILY_ROWS) == sorted(FAMILIES)
    for model_type in FAMILY_ROWS:
        config, measured_2, measured_4 = FAMILY_ROWS[model_type]
        peaks = [estimate(TrainConfig(**{**BASE, "model": "family", "micro_batch": mb}),
                          world_size=1, local_world_size=1, hardware=H200,
                          config=config).peak_gib for mb in (2, 4)]
        slope, measured_slope = peaks[1] - peaks[0], measured_4 - measured_2
        assert abs(slope - measured_slope) / measured_slope <= 0.08, (model_type, peaks)
        for peak, measured in zip(peaks, (measured_2, measured_4), strict=True):
            assert abs(peak - measured) / measured <= 0.05, (model_type, peaks)


def test_every_familys_tokens_per_s_at_8_layers_is_within_15_percent_of_the_h200s():
    """Each family's kernels (head dim 256, windows given as masks, Gemma 2's eager soft-capped
    attention) against the same call's 8-layer models; 15%, since at 8 layers the head weighs
    three times its share (the released depths below are held to THROUGHPUT_ERROR)."""
    from finetune_contract.plan_calibration import BASE, FAMILY_ROWS, FAMILY_TOKENS_PER_S

    assert sorted(FAMILY_TOKENS_PER_S) == sorted(FAMILY_ROWS)
    for model_type in FAMILY_ROWS:
        for micro_batch, measured in zip((2, 4), FAMILY_TOKENS_PER_S[model_type], strict=True):
            planned = estimate(TrainConfig(**{**BASE, "model": "family",
                                              "micro_batch": micro_batch}),
                               world_size=1, local_world_size=1, hardware=H200,
                               config=FAMILY_ROWS[model_type][0]).tokens_per_s_per_gpu
            assert abs(planned - measured) / measured <= 0.15, (model_type, micro_batch, planned)


def test_family_shapes_at_released_depth_are_within_the_stated_errors():
    """Gemma 2 2B (eager attention for its soft cap) and Gemma 3 1B and 4B (head dim 256, five of
    six layers windowed) at their released depths, each run with the attention the trainer gives
    it."""
    from finetune_contract.families import attention_kernel
    from finetune_contract.models import FAMILY_SHAPES
    from finetune_contract.plan_calibration import BASE, RELEASED_ROWS

    for row in RELEASED_ROWS:
        config = FAMILY_SHAPES[row.shape][1]
        assert attention_kernel(config) == row.attention, row  # it measured the trainer's kernel
        planned = estimate(TrainConfig(**{**BASE, "model": "family",
                                          "micro_batch": row.micro_batch}),
                           world_size=1, local_world_size=1, hardware=H200, config=config)
        assert abs(planned.tokens_per_s_per_gpu - row.tokens_per_s) / row.tokens_per_s \
            <= THROUGHPUT_ERROR, (row, planned)
        assert abs(planned.peak_gib - row.peak_gib) / row.peak_gib <= MEMORY_ERROR, (row, planned)


def test_eager_attention_keeps_its_score_rows_in_the_plan():
    """Gemma 2's soft cap runs eager attention, whose backward keeps EAGER_SCORE_ROWS bf16 rows
    of heads x seq_len scores per token and layer; the same shape without the cap (sdpa) keeps
    none."""
    from finetune_contract.models import FAMILY_SHAPES
    from finetune_contract.plan_calibration import BASE
    from finetune_contract.planner import EAGER_SCORE_ROWS

    gemma2 = FAMILY_SHAPES["gemma2-2b"][1]
    cfg = TrainConfig(**{**BASE, "model": "family", "micro_batch": 2})
    eager = estimate(cfg, world_size=1, local_world_size=1, hardware=H200, config=gemma2)
    capless = estimate(cfg, world_size=1, local_world_size=1, hardware=H200,
                       config={**gemma2, "attn_logit_softcapping": None})
    scores = (EAGER_SCORE_ROWS * 2 * gemma2["num_attention_heads"] * 4096 * 4096 * 2
              * gemma2["num_hidden_layers"])
    assert eager.peak_gib - capless.peak_gib == pytest.approx(scores / 2**30, rel=0.01)


def test_every_calibration_row_says_how_and_when_it_was_measured_and_is_a_valid_config():
    for row in ROWS:
        assert row.command.startswith(("python -m trainer.bench", "torchrun")), row
        assert row.date and row.gpu
        TrainConfig(**row.config)  # the row's settings are ones the contract accepts


def test_a_run_that_does_not_fit_the_gpu_is_refused_naming_fields_and_a_setting_that_fits():
    conf = {**EKS_SITE, "instance_type": "g5.12xlarge", "nodes": 1, "procs_per_node": 4,
            "model": "llama-8b", "mixed_precision": "bf16", "seq_len": 4096, "micro_batch": 4,
            "strategy": "FULL_SHARD", "activation_checkpointing": "none", "max_steps": 10}
    with pytest.raises(ConfigError) as err:
        validate_params(conf, run_id="r")
    (field, message), = [(f, m) for f, m in err.value.errors if "estimated peak" in m]
    assert field == "micro_batch"
    assert "24 GiB" in message and "activation_checkpointing" in message and "fits:" in message
    suggestion = message.split("fits: ")[1].split(" (estimated")[0]
    changes = dict(part.split("=") for part in suggestion.split(", "))
    typed = {k: (int(v) if v.isdigit() else {"True": True, "False": False}.get(v, v))
             for k, v in changes.items()}
    assert validate_params({**conf, **typed}, run_id="r").model == "llama-8b"


@pytest.mark.parametrize(("model", "micro_batch", "strategy", "best"), [
    ("llama-1b", 4, "SHARD_GRAD_OP", "none"),  # the benchmark's hand-picked settings
    ("llama-3b", 4, "SHARD_GRAD_OP", "none"),
])
def test_auto_checkpointing_on_one_h200_chooses_the_hand_picked_best(model, micro_batch,
                                                                     strategy, best):
    cfg = TrainConfig(model=model, micro_batch=micro_batch, seq_len=4096, strategy=strategy,
                      mixed_precision="bf16", activation_checkpointing="auto")
    chosen, why = resolve_checkpointing(cfg, world_size=1, local_world_size=1, hardware=H200)
    assert chosen.activation_checkpointing == best and not chosen.activation_offload
    assert "auto ->" in why and "fits" in why


def test_auto_on_8b_micro_batch_2_predicts_no_checkpointing_fits_one_h200_faster_than_full():
    # The benchmark hand-picked full AC (123.6 GiB measured); the planner puts no checkpointing
    # at about 131 GiB of 141: a prediction to measure, the one row auto does not reproduce.
    cfg = TrainConfig(model="llama-8b", micro_batch=2, seq_len=4096, strategy="FULL_SHARD",
                      mixed_precision="bf16", activation_checkpointing="auto")
    chosen, _ = resolve_checkpointing(cfg, world_size=1, local_world_size=1, hardware=H200)
    full = estimate(TrainConfig(**{**cfg.to_dict(), "activation_checkpointing": "full"}),
                    world_size=1, local_world_size=1, hardware=H200)
    picked = estimate(chosen, world_size=1, local_world_size=1, hardware=H200)
    assert chosen.activation_checkpointing == "none" and picked.fits
    assert picked.tokens_per_s_per_gpu > full.tokens_per_s_per_gpu
    assert 125 < picked.peak_gib < 135


@pytest.mark.parametrize(("model", "micro_batch", "instance_type"), [
    ("llama-3b", 4, "p5.48xlarge"),  # 80 GiB: 3B micro-batch 4 measured 84.7 GiB on the H200
    ("llama-8b", 4, "p5e.48xlarge"),  # without checkpointing about 165 GiB
])
def test_auto_checkpointing_checkpoints_where_the_activations_do_not_fit(model, micro_batch,
                                                                         instance_type):
    cfg = TrainConfig(model=model, micro_batch=micro_batch, seq_len=4096,
                      strategy="SHARD_GRAD_OP" if model == "llama-3b" else "FULL_SHARD",
                      mixed_precision="bf16", activation_checkpointing="auto")
    gpu = hardware_of(INSTANCE_TYPES[instance_type])
    chosen, _ = resolve_checkpointing(cfg, world_size=1, local_world_size=1, hardware=gpu)
    assert chosen.activation_checkpointing != "none"
    assert estimate(chosen, world_size=1, local_world_size=1, hardware=gpu).fits


def test_on_a_cpu_auto_is_none_and_the_memory_is_estimated_without_a_verdict():
    cpu = Hardware(gpu_memory_gib=None, peak_flops=None, name="cpu")
    cfg = TrainConfig(activation_checkpointing="auto")  # tiny-llama, the local demo
    chosen, why = resolve_checkpointing(cfg, world_size=2, local_world_size=2, hardware=cpu)
    assert chosen.activation_checkpointing == "none" and "no GPU memory known" in why
    est = estimate(chosen, world_size=2, local_world_size=2, hardware=cpu)
    assert est.peak_gib is not None and est.fits is None and est.step_time_s is None


def test_a_model_of_unknown_shape_is_not_applicable_with_the_reason_not_an_error():
    est = estimate(TrainConfig(model="someone/some-model"), world_size=8, local_world_size=8,
                   hardware=H200)
    assert est.peak_gib is None and est.fits is None and "not built in" in est.note


def test_plan_command_prints_the_estimate_and_exits_1_with_a_setting_when_it_does_not_fit(
        tmp_path, capsys):
    conf = tmp_path / "conf.json"
    conf.write_text(json.dumps({"target": "eks", "instance_type": "p4d.24xlarge", "nodes": 1,
                                "procs_per_node": 8, "model": "llama-8b", "seq_len": 4096,
                                "mixed_precision": "bf16", "micro_batch": 4,
                                "max_steps": 100, "node_hourly_price": 5.672}))
    assert main(["--conf", str(conf)]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "search: fastest settings that fit" in out
    assert main(["--conf", str(conf), "--set", "activation_checkpointing=full",
                 "--set", "micro_batch=1"]) == 0
    out = capsys.readouterr().out
    assert "fits" in out and "cost $" in out and "100 steps" in out


def test_predicted_scaling_falls_with_nodes_across_efa_and_not_within_one_node():
    cfg = TrainConfig(model="meta-llama/Llama-2-7b-hf", seq_len=4096, micro_batch=4,
                      mixed_precision="bf16", activation_checkpointing="full")
    rows = scaling_rows(cfg, INSTANCE_TYPES["p4d.24xlarge"], model_config_of(cfg.model))
    efficiencies = [eff for _, _, eff in rows]
    assert efficiencies[0] == 1.0
    assert all(a >= b for a, b in zip(efficiencies, efficiencies[1:], strict=False))
    assert 0.5 < efficiencies[-1] < 1.0


@pytest.mark.parametrize("conf", [
    {"max_steps": 0, "epochs": 2, "micro_batch": 8},
    {"max_steps": 0, "epochs": 1.5, "micro_batch": 4, "grad_accum": 3, "procs_per_node": 1},
    {"max_steps": 0, "epochs": 1, "method": "dpo", "micro_batch": 4},
    {"max_steps": 0, "epochs": 1, "packing": True, "seq_len": 512, "micro_batch": 2},
], ids=["epochs-2", "grad-accum", "dpo", "packing"])
def test_with_max_steps_0_the_plan_counts_the_steps_the_trainer_will_run(conf, tmp_path):
    """The plan's steps (and so its wall time and cost) come from the prepared data set's
    statistics: the same split and per-rank batches as the trainer's, packed or not."""
    from finetune.prepare_stage import prepare_run_data
    from finetune.run_plan import plan_run
    from finetune.trainer_config import trainer_config
    from finetune_contract.data import optimizer_steps
    from trainer.config import resolve
    from trainer.data import ResumableSampler, build_splits

    cfg = validate_params({**conf, "output_dir": str(tmp_path)}, run_id="plan")
    cfg, _ = prepare_run_data(cfg)
    plan = plan_run(RunConfig.from_dict(cfg.to_dict()))  # as a later stage gets it (XCom)
    train = resolve(TrainConfig(**trainer_config(cfg)))  # as the trainer reads it
    splits = build_splits(train)
    sampler = ResumableSampler(len(splits.train), train.micro_batch, 0, cfg.world_size,
                                 train.seed)
    steps = optimizer_steps(train, sampler.batches_per_epoch)
    assert (plan.train_rows, plan.steps) == (len(splits.train), steps)
    assert f"{plan.steps} steps ({conf['epochs']:g} epochs of" in plan_text(cfg, plan)
