"""A real Airflow on this machine, for the tests and the docs' screenshots: api-server,
scheduler, dag-processor and triggerer as separate processes (LocalExecutor, SQLite in WAL mode,
an AIRFLOW_HOME of its own, SimpleAuthManager with a real password), each started, killed and
started again on its own (`Airflow`); `Api`, just enough of a REST client; `wait_for`, a bounded
wait that raises TimeoutError with the components' logs. No pytest here: tests/support/airflow.py
turns the timeout into a test failure."""

from __future__ import annotations

import json
import os
import secrets
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import psutil

from finetune import REPO_ROOT
from finetune.etcd import free_port

AIRFLOW = str(Path(sys.executable).with_name("airflow"))
COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")


class Api:
    """Just enough of a REST client for the tests' assertions and the screenshots' runs (the
    project's CLI, under test, has its own)."""

    def __init__(self, url: str, token: str):
        self.url, self.token = url, token

    def call(self, method: str, path: str, body=None) -> tuple[int, dict]:
        """(status, body). A "Database error" (500) is asked again, up to 3 times. SQLite, the
        tests' database, fails a write at once when a transaction that read first meets a newer
        snapshot another component wrote (SQLITE_BUSY, which its busy timeout does not wait
        for); CI met it once, on the PATCH that marks a run failed (2026-12-04; the api-server's
        log, with the cause, was not kept). The transaction rolled back: asking again is safe."""
        for attempt in range(3):
            status, data = self._call(method, path, body)
            detail = data.get("detail") if isinstance(data, dict) else None
            if status != 500 or not isinstance(detail, dict) or \
                    detail.get("reason") != "Database error":
                return status, data
            time.sleep(1 + attempt)
        return self._call(method, path, body)

    def _call(self, method: str, path: str, body=None) -> tuple[int, dict]:
        req = urllib.request.Request(
            self.url + path, method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {self.token}",
                     "Content-Type": "application/json"})
        try:
            # Generous: the api-server waits up to 60 s for SQLite locks the scheduler holds.
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def get(self, path: str) -> dict:
        status, data = self.call("GET", path)
        assert status == 200, (path, status, data)
        return data

    def xcom(self, dag_id: str, run_id: str, task_id: str):
        run = urllib.parse.quote(run_id, safe="")
        return self.get(f"/api/v2/dags/{dag_id}/dagRuns/{run}/taskInstances/{task_id}/"
                        "xcomEntries/return_value?deserialize=true&stringify=false")["value"]


def wait_for(what: str, check, timeout: float, logs: Path, interval: float = 1.0):
    """`check()`'s first true result, asked every `interval` seconds; TimeoutError after
    `timeout`, with the last lines of each log in `logs`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(interval)
    tails = "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace")
                                                      .splitlines()[-30:])
                      for p in sorted(logs.glob("*.log")))
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}\n{tails}")


def session_processes(sid: int) -> list[int]:
    """Every process of session `sid`: a component and what it started, the task processes
    included (they have process groups of their own, in the component's session)."""
    found = []
    for pid in psutil.pids():
        try:
            if os.getsid(pid) == sid:
                found.append(pid)
        except OSError:  # ended meanwhile
            continue
    return found


class Airflow:
    """The four components, each in a session of its own (`stop` ends one as a crash or a
    deployment would). `env` is their environment; the components' logs are in `home`."""

    def __init__(self, home: Path, extra_env: dict[str, str] | None = None):
        self.home, self.port = home, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.password = secrets.token_urlsafe(12)
        (home / "passwords.json").write_text(json.dumps({"admin": self.password}))
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__")}
        env.update({
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO_ROOT / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO_ROOT / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "4",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
            # SQLite shared by the components: wait for a lock rather than fail (WAL: below).
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db?timeout=60",
            "AIRFLOW__API__BASE_URL": self.url,
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__API__SECRET_KEY": secrets.token_hex(16),
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
            "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
            # A task's supervisor gives up on the execution API after its retries (default 5,
            # 5 s each, about 32 s in all) and kills the task: on a 2-core host shared with
            # trainings the api-server once went 61 s without answering (CI, 2026-12-07), and
            # validate was killed so. Patience for a minute or two of that, not a lost task.
            "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": "30",
            "AIRFLOW__WORKERS__EXECUTION_API_RETRIES": "8",
            # A training's OpenMP threads spin a while, then sleep, waiting for each other:
            # libgomp's default spin made two trainings sharing 2 cores each 40x slower (this
            # one: 7x; one training alone: as fast).
            "GOMP_SPINCOUNT": "20000",
            # MLflow (the promote stage): a store of this Airflow's own, not the checkout's
            "AIRFLOW__FINETUNE__MLFLOW_TRACKING_URI": f"sqlite:///{home}/mlflow.db",
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "plugins"), str(REPO_ROOT)]),
            **(extra_env or {}),
        })
        self.env = env
        self.procs: dict[str, subprocess.Popen] = {}
        self.api: Api | None = None
        subprocess.run([AIRFLOW, "db", "migrate"], env=env, check=True, capture_output=True,
                       timeout=300)
        with sqlite3.connect(home / "airflow.db") as db:  # readers do not block the writer
            db.execute("PRAGMA journal_mode=WAL")

    def start(self, *names: str) -> None:
        for name in names or COMPONENTS:
            args = (["api-server", "--port", str(self.port), "--host", "127.0.0.1"]
                    if name == "api-server" else [name])
            with (self.home / f"{name}.log").open("a") as log:
                self.procs[name] = subprocess.Popen([AIRFLOW, *args], env=self.env, stdout=log,
                                                    stderr=subprocess.STDOUT,
                                                    start_new_session=True)
        if "api-server" in (names or COMPONENTS):
            self.api = Api(self.url, wait_for("the api-server", self._token, 180, self.home,
                                              interval=2))

    def _token(self) -> str | None:
        req = urllib.request.Request(
            f"{self.url}/auth/token", method="POST",
            data=json.dumps({"username": "admin", "password": self.password}).encode(),
            headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return json.loads(r.read())["access_token"]
        except OSError:
            return None

    def kill(self, *names: str, whole_session: bool = False) -> None:
        """SIGKILL components, as a crash does: each one's process group (a process and what
        it forked: for the scheduler its executor's workers and their supervisors; the task
        processes run in groups of their own and outlive it), or with `whole_session` every
        process it started, task processes too (a lost machine or container)."""
        for name in names or COMPONENTS:
            proc = self.procs.pop(name)
            pids = session_processes(proc.pid) if whole_session else []
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(30)

    def stop(self) -> None:
        """Every component and everything it started, gently first."""
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            for pid in session_processes(proc.pid):  # task processes in groups of their own
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.procs.clear()

    def wait_for_dags(self, *dag_ids: str) -> None:
        def parsed() -> bool:
            status, data = self.api.call("GET", "/api/v2/dags")
            ids = {d["dag_id"] for d in data.get("dags", [])} if status == 200 else set()
            return set(dag_ids) <= ids
        wait_for("the DAGs to be parsed", parsed, 180, self.home, interval=2)
