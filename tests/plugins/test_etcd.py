"""A real etcd: torchrun's closed rendezvous blocks a rerun with the same id until the reset."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from finetune.etcd import (
    LocalEtcd,
    delete_rendezvous_keys,
    is_healthy,
    rendezvous_keys,
)

WORKER = Path(__file__).with_name("rdzv_worker.py")


def torchrun(endpoint: str, rdzv_id: str, nproc: int = 2) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc-per-node", str(nproc), "--rdzv-backend", "etcd-v2",
           "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id, str(WORKER)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)


def put(endpoint: str, key: str, value: str = "x") -> None:
    req = urllib.request.Request(f"http://{endpoint}/v2/keys{key}", method="PUT",
                                 data=f"value={value}".encode())
    urllib.request.urlopen(req, timeout=5).close()


def test_local_etcd_starts_healthy_on_loopback_and_stops_cleanly(tmp_path, etcd_server):
    assert etcd_server.endpoint.startswith("127.0.0.1:")
    assert is_healthy(etcd_server.endpoint)
    assert etcd_server.is_running()
    again = LocalEtcd(**etcd_server.to_dict())  # what teardown rebuilds from the state file
    again.stop()
    assert not etcd_server.is_running()
    assert not Path(etcd_server.data_dir).exists()


def test_second_run_with_the_same_rendezvous_id_needs_the_reset(etcd_server):
    first = torchrun(etcd_server.endpoint, "job-a")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "sum 1" in first.stdout

    rerun = torchrun(etcd_server.endpoint, "job-a")
    assert rerun.returncode != 0
    assert "RendezvousClosedError" in rerun.stderr + rerun.stdout

    deleted = delete_rendezvous_keys(etcd_server.endpoint, "job-a")
    assert "/torch/elastic/rendezvous/job-a" in deleted
    after_reset = torchrun(etcd_server.endpoint, "job-a")
    assert after_reset.returncode == 0, after_reset.stderr[-3000:]


def test_reset_deletes_only_this_runs_keys(etcd_server):
    ep = etcd_server.endpoint
    mine = "/torch/elastic/store/" + base64.b64encode(b"torch.rendezvous.run-1.0/k").decode()
    theirs = "/torch/elastic/store/" + base64.b64encode(b"torch.rendezvous.run-10.0/k").decode()
    for key in ("/torch/elastic/rendezvous/run-1", "/torch/elastic/rendezvous/run-10",
                "/torchelastic/p2p/run_run-1/state", mine, theirs):
        put(ep, key)
    deleted = delete_rendezvous_keys(ep, "run-1")
    assert sorted(deleted) == sorted(["/torch/elastic/rendezvous/run-1",
                                      "/torchelastic/p2p/run_run-1", mine])
    assert rendezvous_keys(ep, "run-1") == []
    assert sorted(rendezvous_keys(ep, "run-10")) == sorted(
        ["/torch/elastic/rendezvous/run-10", theirs])


def test_reset_of_an_unknown_id_deletes_nothing(etcd_server):
    assert delete_rendezvous_keys(etcd_server.endpoint, "never-used") == []
