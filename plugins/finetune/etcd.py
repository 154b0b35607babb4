"""etcd for torchrun's rendezvous: a local server, and removal of one run's keys (v2 HTTP API).

torch's etcd rendezvous backends speak the etcd v2 API (etcd 3.4 needs `--enable-v2=true`):
- `etcd-v2` keeps the rendezvous state at /torch/elastic/rendezvous/<run_id> and store keys
  under /torch/elastic/store/ as base64("torch.rendezvous.<run_id>.<round>/<key>");
- the legacy `etcd` backend keeps everything under /torchelastic/p2p/run_<run_id>.
Once a job finishes, its rendezvous is closed: a new job with the same id fails with
RendezvousClosedError until those keys are deleted.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import tenacity

from finetune.polling import until_true
from finetune.targets.local.processes import command_line, is_alive, stop_processes

log = logging.getLogger(__name__)

RENDEZVOUS_PREFIX = "/torch/elastic/rendezvous"
STORE_PREFIX = "/torch/elastic/store"
LEGACY_PREFIX = "/torchelastic/p2p"


# One etcd v2 keys API call: (method, key, query) -> the JSON answer, or None when the key does
# not exist. Over plain HTTP here; the eks target sends it through the Kubernetes service proxy.
KeysRequest = Callable[[str, str, "dict[str, str] | None"], "dict | None"]


class EtcdError(RuntimeError):
    pass


class _PortTaken(Exception):
    """etcd could not bind a port free_port found free a moment before."""


# What etcd logs when a listen address is taken.
ADDRESS_IN_USE = "address already in use"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(endpoint: str, method: str, key: str, query: dict[str, str] | None = None,
             timeout: float = 5.0) -> dict | None:
    """One etcd v2 keys API call; None when the key does not exist."""
    url = f"http://{endpoint}/v2/keys{urllib.parse.quote(key)}"
    if query:
        url += "?" + urllib.parse.urlencode(query)
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise EtcdError(
            f"etcd {method} {key} failed: HTTP {exc.code} {exc.read()[:200]!r}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise EtcdError(f"etcd at {endpoint} is not reachable: {exc}") from exc


def http_keys_request(endpoint: str) -> KeysRequest:
    """Keys API calls to etcd at host:port."""
    return lambda method, key, query: _request(endpoint, method, key, query)


def _keys_request(etcd: str | KeysRequest) -> KeysRequest:
    return http_keys_request(etcd) if isinstance(etcd, str) else etcd


def rendezvous_keys(etcd: str | KeysRequest, run_id: str) -> list[str]:
    """The keys etcd (host:port, or a keys request function) holds for this rendezvous id.

    Both torch backends: etcd-v2 (rendezvous and store keys) and the legacy etcd backend.
    """
    request = _keys_request(etcd)
    keys = []
    for key in (f"{RENDEZVOUS_PREFIX}/{run_id}", f"{LEGACY_PREFIX}/run_{run_id}"):
        if request("GET", key, None) is not None:
            keys.append(key)
    store = request("GET", STORE_PREFIX, None)
    store_prefix = f"torch.rendezvous.{run_id}.".encode()
    for node in (store or {}).get("node", {}).get("nodes", []):
        name = node["key"].rsplit("/", 1)[-1]
        try:
            decoded = base64.b64decode(name, validate=True)
        except ValueError:
            continue
        if decoded.startswith(store_prefix):
            keys.append(node["key"])
    return keys


def delete_rendezvous_keys(etcd: str | KeysRequest, run_id: str) -> list[str]:
    """Delete every key of this rendezvous id so the id can be used again; returns them."""
    request = _keys_request(etcd)
    keys = rendezvous_keys(request, run_id)
    for key in keys:
        request("DELETE", key, {"recursive": "true"})
    return keys


def is_healthy(endpoint: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://{endpoint}/health", timeout=timeout) as resp:
            return json.load(resp).get("health") == "true"
    except (OSError, ValueError):
        return False


def etcd_binary() -> str | None:
    return os.environ.get("FINETUNE_ETCD_BINARY") or shutil.which("etcd") or (
        "/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None)


@dataclass(frozen=True)
class LocalEtcd:
    """An etcd server this pipeline started: enough to find and stop it from another process."""

    pid: int
    endpoint: str
    data_dir: str
    log_file: str

    @classmethod
    def start(cls, binary: str, log_dir: Path, timeout: float = 30.0,
              attempts: int = 3) -> LocalEtcd:
        """Start etcd on loopback (free ports, a temporary data dir) and wait until healthy.

        A free port is free when asked, not when etcd binds it: another program may take it in
        between, and then etcd exits at once; it is started again on new ports.
        """
        on_new_ports = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(_PortTaken),
            stop=tenacity.stop_after_attempt(attempts), reraise=True,
            before_sleep=lambda attempt: log.info(
                "etcd: %s; starting it again on new ports",
                str(attempt.outcome.exception() if attempt.outcome else "").splitlines()[0]))
        try:
            return on_new_ports(cls._start_once, binary, log_dir, timeout)
        except _PortTaken as exc:
            raise EtcdError(str(exc)) from None

    @classmethod
    def _start_once(cls, binary: str, log_dir: Path, timeout: float) -> LocalEtcd:
        data_dir = tempfile.mkdtemp(prefix="finetune-etcd-")
        client, peer = free_port(), free_port()
        log_dir.mkdir(parents=True, exist_ok=True)
        log_file = log_dir / "etcd.log"
        cmd = [
            binary, "--name", "finetune", "--data-dir", data_dir, "--enable-v2=true",
            "--listen-client-urls", f"http://127.0.0.1:{client}",
            "--advertise-client-urls", f"http://127.0.0.1:{client}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"finetune=http://127.0.0.1:{peer}",
        ]
        start = log_file.stat().st_size if log_file.exists() else 0
        with log_file.open("ab") as out:
            # Its own session: etcd must outlive this task's process (train is another task).
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        server = cls(pid=proc.pid, endpoint=f"127.0.0.1:{client}", data_dir=data_dir,
                     log_file=str(log_file))

        def up() -> bool:
            if proc.poll() is not None:
                shutil.rmtree(data_dir, ignore_errors=True)
                with log_file.open("rb") as log:  # this start's lines only
                    log.seek(start)
                    tail = log.read().decode(errors="replace")[-2000:]
                if ADDRESS_IN_USE in tail:
                    raise _PortTaken(f"port {client} or {peer} was taken before etcd bound it:"
                                     f"\n{tail}")
                raise EtcdError(f"etcd exited with code {proc.returncode}:\n{tail}")
            return is_healthy(server.endpoint)

        if until_true(timeout, 0.1)(up):
            return server
        server.stop()
        raise EtcdError(f"etcd did not become healthy within {timeout:.0f}s; log: {log_file}")

    def is_running(self) -> bool:
        # The pid may have been reused by another program since etcd was started.
        return self.data_dir in (command_line(self.pid) or "") and is_alive(self.pid)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and delete its data dir."""
        if self.is_running():
            stop_processes([self.pid], timeout)
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def to_dict(self) -> dict:
        return asdict(self)

