"""The trainer tests' set-up: offline Hugging Face; fixtures from tests/support (moto and `s3`
from tests/conftest.py, `world_of_one` here)."""

import os
import tempfile
from pathlib import Path

from tests.support.training import world_of_one  # noqa: F401

# Before `datasets` is imported: keep its cache out of the home dir, and never reach the hub.
os.environ.setdefault("HF_DATASETS_CACHE", str(Path(tempfile.gettempdir()) / "trainer-tests-cache"))
os.environ["HF_HUB_OFFLINE"] = "1"
