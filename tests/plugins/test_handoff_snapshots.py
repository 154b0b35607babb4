"""What a run hands its cluster and its trainer, held to recorded snapshots: the eks manifests
(PyTorchJob, TrainJob, the trainer's ConfigMap, the prepare and evaluation Jobs) for every
preset and the tests' eks config, and the local target's trainer config for the demo, the
tiny-local preset and a DPO run. A change to how parameters are declared or handed on must
leave these as they are; a change meant to alter them rewrites the snapshots on purpose:

    FINETUNE_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest tests/plugins/test_handoff_snapshots.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from finetune.targets.eks.manifests import (
    evaluation_job_manifest,
    prepare_job_manifest,
    pytorchjob_manifest,
    trainer_configmap_manifest,
    trainjob_manifest,
)
from finetune.trainer_config import trainer_config
from finetune.validate import validate_params
from finetune_contract.presets import PRESETS
from tests.support.eks import EKS_PARAMS

SNAPSHOTS = Path(__file__).parent / "snapshots"
RUN_ID = "manual__2026-12-04T12:00:00+00:00"
IMAGE = "1234.dkr.ecr.us-east-1.amazonaws.com/finetune-trainer:abc"
# What an eks preset needs besides its values: the cluster's names and an S3 output location.
EKS_SITE = {"cluster_name": "train", "nodegroup": "gpu", "image": IMAGE,
            "output_dir": "s3://bucket/runs"}

EKS_CONFS: dict[str, dict[str, Any]] = {
    "eks-tests": EKS_PARAMS,
    "eks-trainjob": {**EKS_PARAMS, "launcher": "trainjob", "rdzv_backend": "c10d"},
    "eks-prepare-pod": {**EKS_PARAMS, "prepare_on": "pod", "prepare_cpu": 8},
    **{f"preset-{name}": {"preset": name, **EKS_SITE}
       for name, preset in PRESETS.items() if preset.values.get("target") == "eks"},
}
LOCAL_CONFS: dict[str, dict[str, Any]] = {
    "local-default": {},
    "local-tiny-local": {"preset": "tiny-local"},
    "local-dpo": {"method": "dpo", "lora_rank": 4, "checkpoint_async": True},
}


def _eks_handoff(conf: dict[str, Any]) -> dict[str, Any]:
    cfg = validate_params(conf, run_id=RUN_ID)
    out = {"configmap": trainer_configmap_manifest(cfg),
           "evaluation": evaluation_job_manifest(cfg, IMAGE, champion_model="s3://b/champion")}
    if cfg.launcher == "trainjob":
        out["trainjob"] = trainjob_manifest(cfg, IMAGE)
    else:
        out["pytorchjob"] = pytorchjob_manifest(cfg, IMAGE)
    if cfg.prepare_on == "pod":
        out["prepare"] = prepare_job_manifest(cfg, IMAGE)
    return out


def _local_handoff(conf: dict[str, Any]) -> dict[str, Any]:
    cfg = validate_params(conf, run_id=RUN_ID)
    config = trainer_config(cfg)
    # Absolute paths of this checkout: kept relative to it, so the snapshot holds on any clone.
    root = str(Path(__file__).resolve().parents[2])
    return {"trainer_config": json.loads(json.dumps(config).replace(root, "<repo>"))}


def _check(name: str, actual: dict[str, Any]) -> None:
    path = SNAPSHOTS / f"{name}.json"
    text = json.dumps(actual, indent=1, sort_keys=True) + "\n"
    if os.environ.get("FINETUNE_UPDATE_SNAPSHOTS") == "1":
        SNAPSHOTS.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no snapshot {path.name}: run with FINETUNE_UPDATE_SNAPSHOTS=1"
    assert json.loads(path.read_text()) == json.loads(text), \
        f"{name}: the handoff differs from {path.relative_to(SNAPSHOTS.parents[2])}"


@pytest.mark.parametrize("name", sorted(EKS_CONFS))
def test_eks_manifests_are_those_recorded(name):
    _check(name, _eks_handoff(EKS_CONFS[name]))


@pytest.mark.parametrize("name", sorted(LOCAL_CONFS))
def test_the_local_trainer_config_is_the_one_recorded(name):
    _check(name, _local_handoff(LOCAL_CONFS[name]))


def test_every_snapshot_has_its_config():
    names = {path.stem for path in SNAPSHOTS.glob("*.json")}
    assert names == set(EKS_CONFS) | set(LOCAL_CONFS)
