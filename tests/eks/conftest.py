"""The eks tests' fixtures, from tests/support: moto (tests/conftest.py), the Kubernetes emulator
(`cluster`), the node group in moto (`nodegroup`) and the target's log (`task_log`)."""

from tests.support.eks import nodegroup, task_log  # noqa: F401
from tests.support.kube import cluster  # noqa: F401
