"""Manifests checked against the real schemas: Kubernetes' (kubernetes-validate, at the
cluster's version), the PyTorchJob CRD of the training operator and Kubeflow Trainer v2's
TrainJob and ClusterTrainingRuntime CRDs (shared/k8s-schemas)."""

from __future__ import annotations

from functools import cache

import jsonschema
import yaml

from tests.support import REPO_ROOT

SCHEMAS = REPO_ROOT.parent / "shared" / "k8s-schemas"
# The Kubernetes version kubernetes-validate checks manifests against (the EKS cluster's).
K8S_VERSION = "1.33"


@cache
def pytorchjob_validator() -> jsonschema.protocols.Validator:
    crd = yaml.safe_load((SCHEMAS / "kubeflow.org_pytorchjobs.yaml").read_text())
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
    crd = yaml.load((SCHEMAS / file).read_text(), Loader=getattr(yaml, "CSafeLoader",
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
