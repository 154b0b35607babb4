"""The trainer tests' set-up: the datasets cache; fixtures from tests/support (moto and `s3`
from tests/conftest.py, `world_of_one` here). The hub is off for every test (tests/conftest.py)."""

import os
import tempfile
from pathlib import Path

from tests.support.training import world_of_one  # noqa: F401

# Before `datasets` is imported: keep its cache out of the home dir.
os.environ.setdefault("HF_DATASETS_CACHE", str(Path(tempfile.gettempdir()) / "trainer-tests-cache"))
