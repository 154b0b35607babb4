"""Manifests checked against the real schemas: Kubernetes' (kubernetes-validate, at the
cluster's version), the PyTorchJob CRD of the training operator and Kubeflow Trainer v2's
TrainJob and ClusterTrainingRuntime CRDs.

The CRDs are not in the clone: they are read from $FINETUNE_K8S_SCHEMAS, else from
../shared/k8s-schemas beside the clone (where CI has them). Without them the tests that need
them skip, naming the files and how to fetch them (CI fails instead)."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import jsonschema
import yaml

from tests.support import REPO_ROOT
from tests.support.system import missing_dependency

SCHEMAS_ENV = "FINETUNE_K8S_SCHEMAS"
DEFAULT_SCHEMAS = REPO_ROOT.parent / "shared" / "k8s-schemas"
_TRAINING_OPERATOR = "https://raw.githubusercontent.com/kubeflow/training-operator/v1.9.2"
_TRAINER = "https://raw.githubusercontent.com/kubeflow/trainer/v2.0.1"
# Each CRD file: the resource a cluster with the operator serves it as, and its release manifest.
CRDS = {
    "kubeflow.org_pytorchjobs.yaml": (
        "pytorchjobs.kubeflow.org",
        f"{_TRAINING_OPERATOR}/manifests/base/crds/kubeflow.org_pytorchjobs.yaml"),
    "trainer.kubeflow.org_trainjobs.yaml": (
        "trainjobs.trainer.kubeflow.org",
        f"{_TRAINER}/manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml"),
    "trainer.kubeflow.org_clustertrainingruntimes.yaml": (
        "clustertrainingruntimes.trainer.kubeflow.org",
        f"{_TRAINER}/manifests/base/crds/trainer.kubeflow.org_clustertrainingruntimes.yaml"),
}


def schemas_dir() -> Path:
    return Path(os.environ.get(SCHEMAS_ENV) or DEFAULT_SCHEMAS)


def crd_file(name: str) -> Path:
    """The CRD file `name` (one of CRDS), or a skip naming every file and how to fetch it."""
    path = schemas_dir() / name
    if not path.is_file():
        fetch = "; ".join(f"`kubectl get crd {resource} -o yaml > {file}` or `curl -fsSLo {file} "
                          f"{url}`" for file, (resource, url) in CRDS.items())
        missing_dependency(
            f"the Kubeflow CRD schema {name} is not in {schemas_dir()} (${SCHEMAS_ENV}, else "
            f"../shared/k8s-schemas beside the clone)",
            f"Put these files in that directory, from a cluster with the operators installed or "
            f"from their release manifests: {fetch}")
    return path
# The Kubernetes version kubernetes-validate checks manifests against (the EKS cluster's).
K8S_VERSION = "1.33"


@cache
def pytorchjob_validator() -> jsonschema.protocols.Validator:
    crd = yaml.safe_load(crd_file("kubeflow.org_pytorchjobs.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = version["schema"]["openAPIV3Schema"]
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    return cls(schema)


def assert_valid_pytorchjob(manifest: dict) -> None:
    errors = sorted(pytorchjob_validator().iter_errors(manifest), key=str)
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:5])


@cache
def crd_validator(file: str, version: str) -> jsonschema.protocols.Validator:
    # libyaml's loader where built: the CRDs are thousands of lines.
    crd = yaml.load(crd_file(file).read_text(), Loader=getattr(yaml, "CSafeLoader",
                                                                yaml.SafeLoader))
    schema = next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"][
        "openAPIV3Schema"]
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    return cls(schema)


def _assert_valid(validator: jsonschema.protocols.Validator, manifest: dict) -> None:
    errors = sorted(validator.iter_errors(manifest), key=str)
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:5])


def assert_valid_trainjob(manifest: dict) -> None:
    _assert_valid(crd_validator("trainer.kubeflow.org_trainjobs.yaml", "v1alpha1"), manifest)


def assert_valid_training_runtime(manifest: dict) -> None:
    _assert_valid(crd_validator("trainer.kubeflow.org_clustertrainingruntimes.yaml",
                                "v1alpha1"), manifest)
