"""The float8 and LoRA params: refused combinations name the field, good ones reach the trainer."""

from __future__ import annotations

import dataclasses
import re

import pytest

from finetune.config import ConfigError
from finetune.image import image_installs
from finetune.trainer_config import trainer_config
from finetune.validate import validate_params
from finetune_contract.fields import FA4_CAPABILITIES, FA4_PACKAGE, ContractError
from finetune_contract.fields import FLOAT8_MIN_CAPABILITY as MIN_CAPABILITY
from finetune_contract.instance_types import INSTANCE_TYPES
from finetune_contract.rules import device_problems, fa4_importable
from tests.support import REPO_ROOT

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


# Every GPU an instance type has, those around float8's line, and None: no GPU.
GPUS = [None, *sorted({p.capability for p in INSTANCE_TYPES.values()}
                      | {(8, 0), (8, 6), (8, 9), (9, 0), (10, 0)})]
FLOAT8 = {"float8": True, "mixed_precision": "bf16"}


def float8_refused(params: dict) -> bool:
    """Whether validate refuses `params` for float8 (other fields' problems aside)."""
    try:
        validate_params({"procs_per_node": 1, **params}, run_id="r")
    except ConfigError as error:
        return "float8" in dict(error.errors)
    return False


def local_refuses_float8(capability: tuple[int, int] | None, monkeypatch) -> bool:
    """validate on the local target, on a machine with one GPU of `capability` (None: none)."""
    import finetune.targets.local.target as local

    device = "cpu" if capability is None else "cuda"
    monkeypatch.setattr(local, "local_resources", lambda nodes, procs: {
        "device": device, "cpus": 8, "gpus": int(device == "cuda"), "processes": nodes * procs,
        "capacity": 8, "fits": True, "threads_per_process": 1, "threads": 8})
    monkeypatch.setattr(local, "gpu_capability", lambda: capability)
    return float8_refused(FLOAT8)


def eks_refuses_float8(capability: tuple[int, int], monkeypatch) -> bool:
    """validate on the eks target, its instance type's GPUs of `capability`."""
    profile = INSTANCE_TYPES["p5.48xlarge"]
    monkeypatch.setitem(INSTANCE_TYPES, profile.name,
                        dataclasses.replace(profile, capability=capability))
    return float8_refused({**EKS, **FLOAT8, "instance_type": profile.name})


def trainer_refuses_float8(capability: tuple[int, int] | None, monkeypatch) -> bool:
    """The trainer's start in a process whose device has `capability` (None: a CPU)."""
    import torch

    import trainer.parallel
    from trainer.config import load_config
    from trainer.float8 import EMULATE_ENV

    monkeypatch.delenv(EMULATE_ENV, raising=False)
    monkeypatch.setattr(trainer.parallel, "_capability", lambda device: capability)
    env = trainer.parallel.DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1,
                                   device=torch.device("cpu" if capability is None else "cuda"))
    try:
        trainer.parallel.check_start(load_config(None, FLOAT8), env)
    except ContractError as error:
        return "float8" in dict(error.errors)
    return False


@pytest.mark.parametrize("capability", GPUS, ids=lambda c: "no-gpu" if c is None else
                         ".".join(map(str, c)))
def test_the_local_target_eks_and_the_trainers_start_refuse_float8_on_the_same_gpus(
        capability, monkeypatch):
    """One rule (rules.device_problems) asked by all three: float8 is refused exactly where
    there is no GPU or its compute capability is below FLOAT8_MIN_CAPABILITY."""
    refused = capability is None or capability < MIN_CAPABILITY
    assert local_refuses_float8(capability, monkeypatch) == refused
    assert trainer_refuses_float8(capability, monkeypatch) == refused
    if capability is not None:  # every eks instance type has GPUs
        assert eks_refuses_float8(capability, monkeypatch) == refused


def test_the_eks_refusal_of_float8_names_the_instance_families_that_have_it():
    message = refusal({**EKS, **FLOAT8, "instance_type": "g5.12xlarge"})["float8"]
    having = sorted({name.split(".")[0] for name, profile in INSTANCE_TYPES.items()
                     if profile.capability >= MIN_CAPABILITY})
    assert "compute capability 8.6" in message and "set float8 to false" in message
    assert all(family in message for family in having) and "g5.12xlarge" in message


# float8's capability written out: "8.9" beside a capability or a float8, "sm_89", or (8, 9)
# anywhere but an instance profile's own GPU (`capability=(8, 9)`, the L4's).
FLOAT8_CAPABILITY_LITERAL = re.compile(
    r"(capabilit\w*|float8)[^\n]{0,40}?\b8\.9\b|\b8\.9\b[^\n]{0,3}(or|and) later|>=\s*8\.9\b"
    r"|[\"']8\.9[\"']|\bsm_?89\b|(?<!capability=)\(8,\s*9\)")


def test_float8s_capability_is_written_only_in_the_contracts_fields():
    """FLOAT8_MIN_CAPABILITY (finetune_contract/fields.py) is the one place: a copy of it in
    a check, a message or a help text elsewhere is caught here."""
    fields = REPO_ROOT / "plugins" / "finetune_contract" / "fields.py"
    copies = [f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}"
              for folder in ("plugins", "trainer", "bench")
              for path in sorted((REPO_ROOT / folder).rglob("*"))
              if path.is_file() and path != fields and "__pycache__" not in path.parts
              for number, line in enumerate(
                  path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
              if FLOAT8_CAPABILITY_LITERAL.search(line)]
    assert not copies, "\n".join(copies)


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
