"""The trainer's log starts with what a user needs: torchao's and torch's harmless import-time
records are dropped at their loggers, every other warning of theirs still shows."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

import trainer  # noqa: F401  (installs the filters, as every trainer process does)
from tests.support import REPO_ROOT


def shown(logger: str, message: str, *args: object) -> bool:
    record = logging.getLogger(logger).makeRecord(logger, logging.WARNING, __file__, 1,
                                                  message, args, None)
    return logging.getLogger(logger).filter(record)


def test_torchaos_optional_kernels_that_do_not_load_are_not_logged_but_its_other_warnings_are():
    assert not shown("torchao", "Failed to load /venv/torchao/_C_mxfp8.cpython-310-x86_64.so: "
                     "Could not load this library")
    assert shown("torchao", "Failed to load the float8 config: bad value")
    assert shown("torchao", "Skipping import of cpp extensions due to incompatible torch version")


def test_the_enum_register_constant_deprecation_is_not_logged_but_other_pytree_warnings_are():
    assert not shown("torch.utils._pytree", "%s is an Enum subclass and is now natively supported "
                     "by torch.compile as an opaque value type.", "<enum 'KernelPreference'>")
    assert shown("torch.utils._pytree", "register_pytree_node is deprecated")


@pytest.mark.slow  # imports torch, transformers and torchao in a fresh process
def test_importing_the_trainer_writes_nothing_to_stderr():
    result = subprocess.run([sys.executable, "-c", "import trainer.train"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stderr == "", result.stderr
