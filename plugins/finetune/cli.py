"""Trigger a fine-tuning run through Airflow's REST API and follow it to the end.

    python -m finetune.cli run --preset tiny-local --set max_steps=60 --set nodes=1
    python -m finetune.cli presets

Airflow: --url or AIRFLOW_URL (default http://localhost:8080). Auth: a token (AIRFLOW_TOKEN),
or a user and password (--username / AIRFLOW_USERNAME, AIRFLOW_PASSWORD) exchanged for a JWT at
/auth/token; for `make airflow`'s standalone Airflow the generated password file in
AIRFLOW_HOME is read when no password is given. The password is never printed.
Exit code: 0 when the run succeeds, 1 when it fails, 2 when it cannot be triggered.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import tenacity

from finetune_contract.parameters import BY_NAME, FORM_PARAMETERS
from finetune_contract.presets import PRESETS

DEFAULT_URL = "http://localhost:8080"
GET_ATTEMPTS = 3
FINISHED = {"success", "failed"}


class CliError(Exception):
    """A problem to report in one line, with exit code 2."""


def parse_set(items: Sequence[str]) -> dict[str, Any]:
    """`key=value` pairs -> conf, each value typed as its parameter is declared."""
    conf: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise CliError(f"--set {item!r}: expected key=value")
        parameter = BY_NAME.get(key)
        if parameter is None or not parameter.form:
            known = ", ".join(p.name for p in FORM_PARAMETERS)
            raise CliError(f"--set {key}: unknown parameter; known: {known}")
        try:
            conf[key] = parameter.coerce(raw) if parameter.type is not str else raw
        except ValueError as exc:
            raise CliError(f"--set {key}: {exc}") from None
    return conf


def build_conf(preset: str | None, conf_json: str | None, sets: Sequence[str]) -> dict[str, Any]:
    conf: dict[str, Any] = {}
    if conf_json:
        try:
            conf = json.loads(conf_json)
        except json.JSONDecodeError as exc:
            raise CliError(f"--conf is not JSON: {exc}") from None
        if not isinstance(conf, dict):
            raise CliError("--conf must be a JSON object")
    if preset:
        if preset not in PRESETS:
            raise CliError(f"--preset {preset!r}: unknown; known: {', '.join(PRESETS)}")
        conf["preset"] = preset
    conf.update(parse_set(sets))
    return conf


class AirflowClient:
    """The few /api/v2 calls the CLI makes, with a JWT renewed when it expires."""

    def __init__(self, url: str, *, token: str | None = None, username: str | None = None,
                 password: str | None = None, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self._username, self._password = username, password
        self._token = token
        self.timeout = timeout

    def login(self) -> None:
        if not (self._username and self._password):
            raise CliError("no credentials: set AIRFLOW_TOKEN, or AIRFLOW_USERNAME and "
                           "AIRFLOW_PASSWORD")
        body = {"username": self._username, "password": self._password}
        status, data = self._send("POST", "/auth/token", body, auth=False)
        if status not in (200, 201) or "access_token" not in data:
            raise CliError(f"login as {self._username!r} at {self.url}/auth/token failed "
                           f"(HTTP {status}): {_detail(data)}")
        self._token = data["access_token"]

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        if self._token is None:
            self.login()
        status, data = self._send(method, path, body)
        if status == 401 and self._password:  # the token expired during a long run
            self.login()
            status, data = self._send(method, path, body)
        return status, data

    def _send(self, method: str, path: str, body: Any, auth: bool = True) -> tuple[int, Any]:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if auth and self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers=headers)
        # A busy api-server (its database locked by the scheduler) may not answer in time:
        # a read is asked again, a write is not (it may have been done).
        attempts = GET_ATTEMPTS if method == "GET" else 1
        asking_again = tenacity.Retrying(
            retry=tenacity.retry_if_exception(_no_answer_in_time),
            stop=tenacity.stop_after_attempt(attempts), reraise=True,
            before_sleep=lambda _: print(f"no answer to {method} {path} within "
                                         f"{self.timeout:g} s: asking again", file=sys.stderr,
                                         flush=True))
        try:
            return asking_again(self._open, request)
        except urllib.error.URLError as exc:
            raise CliError(f"cannot reach Airflow at {self.url}: {exc.reason}") from None
        except TimeoutError:
            raise CliError(f"Airflow at {self.url} did not answer {method} {path} "
                           f"within {self.timeout:g} s ({attempts} tries)") from None

    def _open(self, request: urllib.request.Request) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.status, _json(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _json(exc.read())


def _no_answer_in_time(exc: BaseException) -> bool:
    """A request that timed out: while connecting (URLError) or while reading the answer."""
    return isinstance(exc, TimeoutError) or (isinstance(exc, urllib.error.URLError)
                                             and isinstance(exc.reason, TimeoutError))


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        return {"detail": raw.decode(errors="replace")[:500]}


def _detail(data: Any) -> str:
    """The reason in an Airflow error response (FastAPI puts it in `detail`)."""
    detail = data.get("detail", data) if isinstance(data, dict) else data
    if isinstance(detail, list):  # request validation errors
        return "; ".join(f"{'.'.join(map(str, d.get('loc', [])))}: {d.get('msg')}"
                         for d in detail if isinstance(d, dict))
    return detail if isinstance(detail, str) else json.dumps(detail)


def trigger(client: AirflowClient, dag_id: str, conf: Mapping[str, Any], *,
            unpause: bool) -> str:
    """Start a run of dag_id with conf; returns its run id."""
    quoted = urllib.parse.quote(dag_id, safe="")
    status, dag = client.call("GET", f"/api/v2/dags/{quoted}")
    if status != 200:
        raise CliError(f"DAG {dag_id!r}: HTTP {status}: {_detail(dag)}")
    if dag.get("is_paused"):
        if not unpause:
            raise CliError(f"DAG {dag_id!r} is paused: its runs would wait; unpause it in the "
                           "UI or pass --unpause")
        status, data = client.call("PATCH", f"/api/v2/dags/{quoted}", {"is_paused": False})
        if status != 200:
            raise CliError(f"unpausing {dag_id!r} failed: HTTP {status}: {_detail(data)}")
        print(f"unpaused {dag_id}")
    status, run = client.call("POST", f"/api/v2/dags/{quoted}/dagRuns",
                              {"logical_date": None, "conf": dict(conf)})
    if status not in (200, 201):
        raise CliError(f"the run was refused (HTTP {status}): {_detail(run)}")
    return run["dag_run_id"]


def follow(client: AirflowClient, dag_id: str, run_id: str, *, poll_s: float = 5.0,
           timeout_s: float | None = None, out=None) -> str:
    """Print each task's state changes until the run finishes; returns the run's state."""
    out = out or sys.stdout
    base = (f"/api/v2/dags/{urllib.parse.quote(dag_id, safe='')}/dagRuns/"
            f"{urllib.parse.quote(run_id, safe='')}")
    start = time.monotonic()
    seen: dict[str, str] = {}

    def look() -> dict[str, Any]:
        status, run = client.call("GET", base)
        if status != 200:
            raise CliError(f"run {run_id}: HTTP {status}: {_detail(run)}")
        status, tis = client.call("GET", base + "/taskInstances?limit=100")
        if status == 200:
            for ti in sorted(tis.get("task_instances", []),
                             key=lambda t: (t.get("start_date") or "~", t["task_id"])):
                state = ti.get("state") or "none"
                # a mapped task's instances (a sweep's trials) each by their index
                index = ti.get("map_index")
                name = ti["task_id"] + (f"[{index}]" if index is not None and index >= 0
                                        else "")
                if seen.get(name) != state:
                    seen[name] = state
                    elapsed = time.monotonic() - start
                    note = f" (try {ti['try_number']})" if ti.get("try_number", 1) > 1 else ""
                    print(f"{elapsed:7.0f}s  {name:16s} {state}{note}", file=out, flush=True)
        return run

    def gave_up(attempt: tenacity.RetryCallState) -> NoReturn:
        state = attempt.outcome.result().get("state") if attempt.outcome else None
        raise CliError(f"run {run_id} still {state} after {timeout_s:.0f} s "
                       "(it goes on in Airflow)")

    until_finished = tenacity.Retrying(
        retry=tenacity.retry_if_result(lambda run: run.get("state") not in FINISHED),
        wait=tenacity.wait_fixed(poll_s), retry_error_callback=gave_up,
        stop=tenacity.stop_never if timeout_s is None else tenacity.stop_after_delay(timeout_s))
    return until_finished(look)["state"]


def print_summary(client: AirflowClient, dag_id: str, run_id: str, out=None) -> None:
    """collect_metrics' summary: where the report and the model are, the headline figures."""
    out = out or sys.stdout
    path = (f"/api/v2/dags/{urllib.parse.quote(dag_id, safe='')}/dagRuns/"
            f"{urllib.parse.quote(run_id, safe='')}/taskInstances/collect_metrics/xcomEntries/"
            "return_value")
    status, entry = client.call("GET", path)
    if status != 200:
        return
    summary = entry.get("value")
    if isinstance(summary, str):
        try:
            summary = json.loads(summary)
        except json.JSONDecodeError:
            return
    if not isinstance(summary, dict):
        return
    m = summary.get("metrics") or {}
    if m.get("initial_eval_loss") and m.get("final_eval_loss"):
        print(f"eval loss {m['initial_eval_loss']:.3f} -> {m['final_eval_loss']:.3f} after "
              f"{m.get('steps')} steps; {m.get('tokens_per_s') or 0:.0f} tokens/s", file=out)
    for key in ("model_dir", "report_html"):
        if summary.get(key):
            print(f"{key.split('_')[0]}: {summary[key]}", file=out)


def standalone_password(username: str) -> str | None:
    """The password `airflow standalone` generated for username (SimpleAuthManager's file)."""
    home = Path(os.environ.get("AIRFLOW_HOME", "~/airflow")).expanduser()
    path = home / "simple_auth_manager_passwords.json.generated"
    try:
        return json.loads(path.read_text()).get(username)
    except (OSError, ValueError, AttributeError):
        return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m finetune.cli",
                                     description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="trigger a run and follow it to the end")
    run.add_argument("--dag", default="llm_finetune", help="DAG id (default llm_finetune)")
    run.add_argument("--preset", help="a preset name (see `presets`)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="a run parameter (repeatable); overrides the preset")
    run.add_argument("--conf", help="more parameters as a JSON object")
    run.add_argument("--url", default=os.environ.get("AIRFLOW_URL", DEFAULT_URL))
    run.add_argument("--username", default=os.environ.get("AIRFLOW_USERNAME", "admin"))
    run.add_argument("--unpause", action="store_true", help="unpause the DAG if it is paused")
    run.add_argument("--no-follow", action="store_true", help="print the run id and exit")
    run.add_argument("--poll", type=float, default=5.0, help="seconds between polls")
    run.add_argument("--timeout", type=float, help="give up following after this many seconds")
    sub.add_parser("presets", help="list the presets")
    args = parser.parse_args(argv)

    if args.command == "presets":
        for preset in PRESETS.values():
            values = ", ".join(f"{k}={v}" for k, v in preset.values.items())
            print(f"{preset.name} (v{preset.version}): {preset.title}\n    {values}")
        return 0
    try:
        conf = build_conf(args.preset, args.conf, args.set)
        password = os.environ.get("AIRFLOW_PASSWORD") or standalone_password(args.username)
        client = AirflowClient(args.url, token=os.environ.get("AIRFLOW_TOKEN") or None,
                               username=args.username, password=password)
        run_id = trigger(client, args.dag, conf, unpause=args.unpause)
        print(f"triggered {args.dag} run {run_id} with conf {json.dumps(conf)}", flush=True)
        if args.no_follow:
            return 0
        state = follow(client, args.dag, run_id, poll_s=args.poll, timeout_s=args.timeout)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"run {run_id}: {state}")
    if state == "success":
        print_summary(client, args.dag, run_id)
    return 0 if state == "success" else 1


if __name__ == "__main__":
    sys.exit(main())
