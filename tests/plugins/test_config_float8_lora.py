"""The float8 and LoRA params: refused combinations name the field, good ones reach the trainer."""

from __future__ import annotations

import pytest

from finetune.config import ConfigError
from finetune.image import image_installs
from finetune.trainer_config import trainer_config
from finetune.validate import validate_params
from finetune_contract.fields import FA4_CAPABILITIES, FA4_PACKAGE
from finetune_contract.fields import FLOAT8_MIN_CAPABILITY as MIN_CAPABILITY
from finetune_contract.instance_types import INSTANCE_TYPES
from finetune_contract.rules import device_problems, fa4_importable

EKS = {"target": "eks", "cluster_name": "c", "nodegroup": "g", "image": "r/trainer:1",
       "image_builder": "prebuilt", "procs_per_node": 8, "instance_type": "p5.48xlarge",
       "output_dir": "s3://bucket/runs"}


def refusal(params: dict) -> dict[str, str]:
    """The messages of a refused run, joined per field."""
    with pytest.raises(ConfigError) as error:
        validate_params({"procs_per_node": 1, **params}, run_id="r")
    messages: dict[str, str] = {}
    for field, message in error.value.errors:
        messages[field] = f"{messages.get(field, '')} {message}".strip()
    return messages


@pytest.mark.parametrize(("params", "field", "words"), [
    ({**EKS, "float8": True, "mixed_precision": "fp32"}, "float8", "mixed_precision bf16"),
    ({"float8": True, "mixed_precision": "fp16"}, "float8", "mixed_precision bf16 (got fp16)"),
    ({**EKS, "float8": True, "mixed_precision": "bf16", "cpu_offload": True}, "float8",
     "cpu_offload"),
    ({**EKS, "float8": True, "mixed_precision": "bf16", "tp_degree": 2}, "float8", "tp_degree"),
    ({**EKS, "float8": True, "mixed_precision": "bf16", "lora_rank": 8}, "float8", "lora_rank"),
    ({**EKS, "float8": True, "mixed_precision": "bf16", "seq_len": 1000}, "float8",
     "seq_len divisible by 16"),
    ({**EKS, "lora_rank": 8, "tp_degree": 2}, "lora_rank", "tp_degree"),
    ({"lora_rank": 8, "lora_target_modules": "q_proj; rm -rf /"}, "lora_target_modules",
     "comma-separated"),
    ({"lora_rank": 8, "lora_target_modules": " , "}, "lora_target_modules", "q_proj"),
    ({"lora_rank": -1}, "lora_rank", ">= 0"),
    ({"lora_alpha": 0}, "lora_alpha", "> 0"),
    ({"lora_dropout": 1.0}, "lora_dropout", "<= 0.99"),
    ({**EKS, "quantize_base": "nf4"}, "quantize_base", "lora_rank is 0"),
    ({**EKS, "quantize_base": "nf4", "lora_rank": 8, "cpu_offload": True}, "quantize_base",
     "cpu_offload"),
    ({"quantize_base": "int4"}, "quantize_base", "nf4"),
    # p4de's A100s (compute capability 8.0) have no float8 tensor cores.
    ({**EKS, "instance_type": "p4de.24xlarge", "float8": True, "mixed_precision": "bf16"},
     "float8", "p4de.24xlarge"),
])  # fmt: skip
def test_impossible_float8_and_lora_settings_are_refused_naming_the_field(params, field, words):
    errors = refusal(params)
    assert field in errors and words in errors[field], errors


def test_float8_on_the_local_target_without_gpus_is_refused():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    assert "compute capability" in refusal({"float8": True, "mixed_precision": "bf16"})["float8"]


def test_qlora_on_the_local_target_without_gpus_is_refused_and_on_gpu_nodes_reaches_the_trainer():
    import torch

    if not torch.cuda.is_available():
        assert "needs CUDA GPUs" in refusal({"quantize_base": "nf4", "lora_rank": 8})[
            "quantize_base"]
    cfg = validate_params({**EKS, "quantize_base": "nf4", "lora_rank": 8}, run_id="r")
    assert trainer_config(cfg, local_paths=False)["quantize_base"] == "nf4"


def test_float8_on_hopper_nodes_and_lora_options_reach_the_trainer_config():
    cfg = validate_params({**EKS, "float8": True,
                           "mixed_precision": "bf16"}, run_id="r")
    assert trainer_config(cfg, local_paths=False)["float8"] is True
    cfg = validate_params({"procs_per_node": 1, "lora_rank": 16, "lora_alpha": 32,
                           "lora_dropout": 0.05, "lora_target_modules": "q_proj,v_proj"},
                          run_id="r")
    from trainer.config import load_config

    trainer = load_config(None, trainer_config(cfg))
    assert (trainer.lora_rank, trainer.lora_alpha, trainer.lora_dropout) == (16, 32.0, 0.05)
    assert trainer.lora_target_modules == "q_proj,v_proj" and trainer.float8 is False


def test_the_default_lora_target_modules_are_the_trainers():
    from finetune_contract.parameters import BY_NAME
    from trainer.config import TrainConfig

    assert BY_NAME["lora_target_modules"].default == TrainConfig().lora_target_modules


@pytest.mark.parametrize("itype", sorted(INSTANCE_TYPES))
def test_eks_validate_refuses_fa4_and_float8_exactly_where_the_instance_types_gpus_lack_them(
        itype):
    """The instance type's compute capability decides both at validate, by the rules the
    trainer checks its own GPU with at start (the same constants), before any node is asked."""
    profile = INSTANCE_TYPES[itype]
    base = {**EKS, "instance_type": itype, "procs_per_node": profile.gpus,
            "mixed_precision": "bf16", "model": "llama-1b"}  # head dim 64: fa4 takes it
    for field, params, runs in (
            ("attention", {"attention": "fa4"}, profile.capability in FA4_CAPABILITIES),
            ("float8", {"float8": True}, profile.capability >= MIN_CAPABILITY)):
        if runs:
            validate_params({**base, **params}, run_id="r")
        else:
            message = refusal({**base, **params})[field]
            assert itype in message or "compute capability" in message, message
        at_start = device_problems(quantize_base="none", gpu=True, capability=profile.capability,
                                   attention=params.get("attention", "sdpa"),
                                   float8=params.get("float8", False))
        assert bool(at_start) == (not runs)


def test_fa4_with_the_image_this_project_builds_is_refused_naming_the_package_it_lacks():
    """The built image installs trainer/requirements.txt, which has no flash-attn-4: refused at
    validate, where the run would otherwise fail at the trainer's start after scale_up; a
    prebuilt image is the user's, and the trainer's start checks it."""
    assert not image_installs(FA4_PACKAGE)
    built = {**EKS, "image": "", "image_builder": "codebuild", "build_bucket": "build-bucket",
             "codebuild_role": "arn:aws:iam::123456789012:role/build", "attention": "fa4",
             "mixed_precision": "bf16", "model": "llama-1b"}
    message = refusal(built)["attention"]
    assert FA4_PACKAGE in message and "trainer/requirements.txt" in message
    validate_params({**EKS, "attention": "fa4", "mixed_precision": "bf16", "model": "llama-1b"},
                    run_id="r")


def test_image_installs_reads_the_distribution_names_of_the_trainer_requirements(tmp_path):
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "requirements.txt").write_text(
        "# a comment naming flash-attn-4\ntorch==2.13.0\nFlash_Attn-4==4.0.0b36  # pinned\n")
    assert image_installs(FA4_PACKAGE, root=tmp_path)
    assert image_installs("torch", root=tmp_path)
    assert not image_installs("flash-attn", root=tmp_path)


def test_fa4_where_its_package_is_missing_is_refused_naming_it_and_the_environment():
    problems = device_problems(quantize_base="none", gpu=True, attention="fa4",
                               capability=(9, 0), fa4_installed=False, where="this machine")
    ((field, message),) = problems
    assert field == "attention"
    assert FA4_PACKAGE in message and "this machine" in message and "sdpa" in message
    assert not device_problems(quantize_base="none", gpu=True, attention="fa4",
                               capability=(9, 0), fa4_installed=True)
    import importlib.util
    assert fa4_importable() == (importlib.util.find_spec("flash_attn") is not None)


FLOAT8 = {"float8": True, "mixed_precision": "bf16"}


def test_the_eks_refusal_of_float8_names_the_instance_families_that_have_it():
    message = refusal({**EKS, **FLOAT8, "instance_type": "g5.12xlarge"})["float8"]
    having = sorted({name.split(".")[0] for name, profile in INSTANCE_TYPES.items()
                     if profile.capability >= MIN_CAPABILITY})
    assert "compute capability 8.6" in message and "set float8 to false" in message
    assert all(family in message for family in having) and "g5.12xlarge" in message


@pytest.mark.parametrize(("output", "status", "capability"), [
    ("9.0\n8.9\n", 0, (8, 9)),  # a mixed machine: its run may land on either
    ("9.0\n", 0, (9, 0)),
    ("Field \"compute_cap\" is not a valid field to query.\n", 2, None),  # an older driver
    ("[N/A]\n", 0, None),
])  # fmt: skip
def test_the_local_gpus_capability_is_the_lowest_nvidia_smi_reports_or_none(
        output, status, capability, tmp_path, monkeypatch):
    from finetune.targets.local.machine import gpu_capability

    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nprintf '%s' '{output}'\nexit {status}\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu_capability() == capability
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert gpu_capability() is None
