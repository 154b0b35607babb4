"""What the tests need from outside the clone (Debian's programs, the Kubeflow CRD schemas):
where to find it, or a skip that says how to get it, which is a failure in CI."""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest

# CI sets it (.ci/run; `make test` installs the programs): there a missing dependency fails the
# test instead of skipping it.
REQUIRE_ENV = "FINETUNE_REQUIRE_SYSTEM_DEPS"


def missing_dependency(what: str, how: str) -> NoReturn:
    """Skip the test for want of something from outside the clone, saying what and how to get
    it; fail instead where FINETUNE_REQUIRE_SYSTEM_DEPS=1."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{what} ({REQUIRE_ENV}=1: required here). {how}", pytrace=False)
    pytest.skip(f"{what}. {how}")


def system_binary_or_skip(name: str, package: str) -> str:
    """A program from Debian the tests need (etcd, prometheus, promtool, chromium, buildah,
    debootstrap, docker-registry, zip); /usr/sbin too (debootstrap) where PATH lacks it."""
    binary = shutil.which(name) or next(
        (path for path in (f"/usr/bin/{name}", f"/usr/sbin/{name}") if os.access(path, os.X_OK)),
        None)
    if binary is None:
        missing_dependency(f"{name} is not installed",
                           f"Install it: apt-get install {package} (or make system-deps as root)")
    return binary


def etcd_or_skip() -> str:
    """The etcd binary torchrun's etcd rendezvous and the reset tests use."""
    from finetune.etcd import etcd_binary

    return etcd_binary() or system_binary_or_skip("etcd", "etcd-server")


def has_etcd() -> bool:
    """Whether etcd is here, for a test that runs without it and checks more with it (the local
    target falls back to c10d); where FINETUNE_REQUIRE_SYSTEM_DEPS=1 a missing etcd fails."""
    from finetune.etcd import etcd_binary

    if etcd_binary() is None and os.environ.get(REQUIRE_ENV) == "1":
        etcd_or_skip()  # fails, naming the package
    return etcd_binary() is not None
