"""A real etcd for the rendezvous and reset tests (fixture `etcd_server`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.system import etcd_or_skip


@pytest.fixture
def etcd_server(tmp_path):
    """A real etcd (v2 API enabled) on loopback, stopped after the test."""
    from finetune.etcd import LocalEtcd

    server = LocalEtcd.start(etcd_or_skip(), tmp_path / "etcd-logs")
    yield server
    server.stop()
    assert not Path(server.data_dir).exists()
