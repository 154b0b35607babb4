"""A real etcd: torchrun's closed rendezvous blocks a rerun with the same id until the reset;
torchrun, as the targets start it, restarts a failed worker in place."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from finetune.etcd import (
    LocalEtcd,
    delete_rendezvous_keys,
    free_port,
    is_healthy,
    rendezvous_keys,
)
from finetune.targets.base import TORCHRUN_ENV
from tests.support.system import etcd_or_skip

WORKER = Path(__file__).with_name("rdzv_worker.py")


def torchrun(endpoint: str, rdzv_id: str, nproc: int = 2, backend: str = "etcd-v2",
             max_restarts: int = 0, **env: str) -> subprocess.CompletedProcess:
    """torchrun as the targets start it (TORCHRUN_ENV) on rdzv_worker.py."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc-per-node", str(nproc), "--rdzv-backend", backend,
           "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
           "--max-restarts", str(max_restarts), str(WORKER)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **TORCHRUN_ENV, **env}
    # A session of its own: a hung run is killed with its workers, not only the agent.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


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


@pytest.mark.slow
def test_a_port_taken_before_etcd_binds_it_starts_etcd_again_on_new_ports(tmp_path, monkeypatch):
    """free_port's port is free when asked; another program may bind it before etcd does (CI
    lost three local-target tests to this)."""
    import socket

    import finetune.etcd

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    ports = [port]
    monkeypatch.setattr(finetune.etcd, "free_port", lambda: ports.pop() if ports else free_port())
    with taken:
        server = LocalEtcd.start(etcd_or_skip(), tmp_path / "logs")
    try:
        assert is_healthy(server.endpoint)
        assert server.endpoint != f"127.0.0.1:{port}"
        assert "address already in use" in (tmp_path / "logs" / "etcd.log").read_text()
    finally:
        server.stop()


@pytest.mark.slow  # three torchrun launches
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


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["etcd-v2", "c10d"])
def test_torchrun_restarts_a_failed_worker_in_place_and_the_new_round_forms_its_group(
        etcd_server, backend):
    # Rank 1 fails after the first round's all-reduce; in the restarted round it joins late, so
    # rank 0 looks up rank 1's address first: a store kept from the first round gives it the dead
    # worker's, and the round fails or hangs.
    endpoint = etcd_server.endpoint if backend == "etcd-v2" else f"127.0.0.1:{free_port()}"
    run = torchrun(endpoint, f"restart-{backend}", backend=backend, max_restarts=1,
                   RDZV_WORKER_FAIL_RANK="1")
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert "rank 1 fails in the first round" in output
    assert output.count("sum 1") == 4  # both ranks, in both rounds


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


def test_a_rendezvous_run_again_stops_the_etcd_it_started_before(tmp_path):
    """Clearing the rendezvous task of a run starts a new etcd; the one before is recorded no
    more, so nothing else would ever stop it or remove its data dir."""
    from finetune.targets.local.target import LocalTarget
    from finetune.validate import validate_params

    etcd_or_skip()
    cfg = validate_params({"output_dir": str(tmp_path), "procs_per_node": 1}, run_id="again")
    target = LocalTarget()
    first = target.rendezvous(cfg)
    first_server = LocalEtcd(**json.loads((Path(cfg.run_dir) / "state" / "etcd.json")
                                          .read_text()))
    second = target.rendezvous(cfg)
    second_server = LocalEtcd(**json.loads((Path(cfg.run_dir) / "state" / "etcd.json")
                                           .read_text()))
    try:
        assert first["started_etcd"] and second["started_etcd"]
        assert not first_server.is_running() and not Path(first_server.data_dir).exists()
        assert second_server.is_running() and is_healthy(second["endpoint"])
    finally:
        target.release(cfg)
    assert not second_server.is_running() and not Path(second_server.data_dir).exists()
