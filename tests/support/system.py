"""The programs from Debian that tests need: their path, or a skip (a failure in CI)."""

from __future__ import annotations

import os
import shutil

import pytest


def system_binary_or_skip(name: str, package: str) -> str:
    """A program from Debian the tests need (etcd, prometheus, chromium).

    CI sets FINETUNE_REQUIRE_SYSTEM_DEPS=1 (`make test` installs them) so a missing one fails
    there instead of silently skipping.
    """
    binary = shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK)
                                    else None)
    if binary is None:
        if os.environ.get("FINETUNE_REQUIRE_SYSTEM_DEPS") == "1":
            pytest.fail(f"{name} is required (FINETUNE_REQUIRE_SYSTEM_DEPS=1) but not installed")
        pytest.skip(f"{name} is not installed (apt-get install {package})")
    return binary


def etcd_or_skip() -> str:
    """The etcd binary torchrun's etcd rendezvous and the reset tests use."""
    from finetune.etcd import etcd_binary

    return etcd_binary() or system_binary_or_skip("etcd", "etcd-server")
