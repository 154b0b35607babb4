"""The "Fine-tuning runs" UI page, served by a real Airflow api-server (started once for the
module) with this project's plugins, opened in headless Chromium."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from finetune.etcd import free_port
from finetune.gpu_metrics import sampled_gpu_metrics
from finetune.report import write_report
from tests.support import REPO_ROOT
from tests.support.system import system_binary_or_skip

pytestmark = pytest.mark.slow  # a real api-server, and Chromium

RUN_ID = "manual__2026-01-02T03:04:05+00:00"
RUN_NAME = "manual__2026-01-02T03-04-05-00-00-0123abcd"
RUNNING_NAME = "manual__2026-01-03T00-00-00-00-00-4567cdef"


def executed_run(runs: Path) -> Path:
    """A run directory as a finished run leaves it: metrics, summary, model and its report."""
    run_dir = runs / RUN_NAME
    (run_dir / "model").mkdir(parents=True)
    records = [{"type": "eval", "step": 0, "eval_loss": 6.0, "time": 1.0}]
    records += [{"type": "train", "step": s, "loss": 6.0 - s / 10, "lr": 1e-3, "grad_norm": 1.0,
                 "tokens_per_s": 50_000.0, "tflops_per_device": 321.0, "mfu": 0.325,
                 "peak_memory_bytes": 2**34, "time": 1.0 + s} for s in range(1, 21)]
    records += [{"type": "eval", "step": 20, "eval_loss": 4.0, "time": 30.0}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "summary.json").write_text(json.dumps({
        "initial_eval_loss": 6.0, "final_eval_loss": 4.0, "steps": 20, "tokens_per_s": 51234.0,
        "tflops_per_device": 321.0, "mfu": 0.325, "wall_time_s": 1234.0, "world_size": 16}))
    samples = [{"time": 100.0 + i, "gpus": [{"gpu": g, "gpu_util_pct": 90 + g, "power_w": 600,
                                             "fb_used_mib": 60000, "temperature_c": 60}
                                            for g in range(2)]} for i in range(3)]
    write_report(run_dir, run_id=RUN_ID, status="success",
                 config={"target": "eks", "model": "llama-8b", "nodes": 2, "procs_per_node": 8},
                 stages={"train": {"wall_time_s": 1800.0}},
                 gpu=sampled_gpu_metrics(samples, node="ip-10-0-0-1"),
                 node_hourly_price=40.0, nodes=2)
    return run_dir


def write_running_run(run_dir: Path, steps: int, max_steps: int) -> None:
    """A local run in its train stage: state/, and metrics.jsonl up to `steps` (0.5 s each)."""
    (run_dir / "state").mkdir(parents=True, exist_ok=True)
    now = time.time()
    records = [{"type": "data", "step": 0, "max_steps": max_steps, "time": now - 60},
               {"type": "eval", "step": 0, "eval_loss": 6.5, "time": now - 55}]
    records += [{"type": "train", "step": s, "loss": 6.0 - s / 100, "tokens": 1536,
                 "tokens_per_s": 3072.0, "tflops_per_device": 0.01, "mfu": None,
                 "step_time_s": 0.5, "time": now - (steps - s) * 0.5} for s in range(1, steps + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture(scope="module")
def api_server(tmp_path_factory):
    """`airflow api-server` on a free port: SimpleAuthManager (everyone an admin), this
    project's plugins, a project-local AIRFLOW_HOME in tmp; yields (base URL, runs dir)."""
    tmp = tmp_path_factory.mktemp("airflow")
    runs = tmp / "runs"
    executed_run(runs)
    (runs / "manual__still-training" / "state").mkdir(parents=True)
    write_running_run(runs / RUNNING_NAME, steps=30, max_steps=100)
    (tmp / "dags").mkdir()
    env = dict(os.environ)
    env.update({
        "AIRFLOW_HOME": str(tmp / "home"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(tmp / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO_ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__LAZY_LOAD_PLUGINS": "False",
        "AIRFLOW__CORE__AUTH_MANAGER":
            "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
        "AIRFLOW__API_AUTH__JWT_SECRET": os.urandom(16).hex(),
        "AIRFLOW__FINETUNE__RUNS_DIRS": str(runs),
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "plugins"), str(REPO_ROOT)]),
    })
    env.pop("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", None)
    airflow = [sys.executable, "-m", "airflow"]
    subprocess.run([*airflow, "db", "migrate"], env=env, check=True, capture_output=True,
                   timeout=300)
    port = free_port()
    log_path = tmp / "api-server.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([*airflow, "api-server", "--port", str(port), "--host",
                                 "127.0.0.1", "--workers", "1"], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/v2/monitor/health", timeout=2):
                    break
            except (OSError, urllib.error.URLError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"api-server did not start:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.5)
        yield base, runs
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()


def get(url: str, token: str | None = None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def token(base: str) -> str:
    status, body = get(f"{base}/auth/token")
    assert status == 201, body
    return json.loads(body)["access_token"]


def chromium(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    binary = system_binary_or_skip("chromium", "chromium")
    return subprocess.run(
        [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         f"--user-data-dir={tmp / 'chromium-profile'}", "--virtual-time-budget=12000", *args],
        capture_output=True, text=True, timeout=120, check=True)


def test_the_plugin_puts_the_page_in_the_ui_navigation(api_server):
    base, _ = api_server
    status, body = get(f"{base}/api/v2/plugins", token(base))
    assert status == 200, body
    plugin = next(p for p in json.loads(body)["plugins"] if p["name"] == "finetune_runs")
    assert plugin["external_views"][0]["name"] == "Fine-tuning runs"
    assert plugin["external_views"][0]["href"] == "finetune-runs/"
    assert plugin["fastapi_apps"][0]["url_prefix"] == "/finetune-runs"


def test_runs_json_has_the_headline_figures_and_status(api_server):
    base, _ = api_server
    status, body = get(f"{base}/finetune-runs/api/runs", token(base))
    assert status == 200, body
    runs = {r["name"]: r for r in json.loads(body)}
    done = runs[RUN_NAME]
    assert done["status"] == "success" and done["has_report"]
    assert done["metrics"]["tokens_per_s"] == 51234.0 and done["metrics"]["cost_usd"] == 40.0
    assert done["gpu_util_pct"] == 90.5
    assert runs["manual__still-training"]["status"] == "running"
    assert runs[RUNNING_NAME]["progress"]["step"] == 30
    assert runs[RUNNING_NAME]["progress"]["max_steps"] == 100


def test_the_table_the_page_refreshes_follows_a_running_run(api_server):
    base, runs = api_server
    auth = token(base)
    write_running_run(runs / "manual__followed", steps=10, max_steps=50)
    assert "step 10/50" in get(f"{base}/finetune-runs/table", auth)[1]
    write_running_run(runs / "manual__followed", steps=20, max_steps=50)
    status, table = get(f"{base}/finetune-runs/table", auth)
    assert status == 200 and "step 20/50" in table and "<html" not in table


def test_only_listed_runs_reports_are_served(api_server):
    base, _ = api_server
    auth = token(base)
    assert get(f"{base}/finetune-runs/runs/..%2F..%2Fetc/report.html", auth)[0] == 404
    assert get(f"{base}/finetune-runs/runs/manual__still-training/report.html", auth)[0] == 404


def test_chromium_shows_the_executed_run_and_opens_its_report(api_server, tmp_path):
    base, _ = api_server
    login = f"{base}/auth/token/login?next="
    dom = chromium(tmp_path, "--dump-dom", f"{login}/finetune-runs/").stdout
    assert "<h1>Fine-tuning runs</h1>" in dom
    assert RUN_ID in dom and "status-success" in dom
    assert "51,234" in dom and "32.5%" in dom and "20m 34s" in dom  # tokens/s, MFU, wall
    assert "6.000 → 4.000" in dom and "90.5%" in dom and "40.00 USD" in dom
    assert f'href="runs/{RUN_NAME}/report.html">{RUN_ID}</a>' in dom  # the name is the link
    assert "manual__still-training" in dom and "starting (before the first step)" in dom
    # the running run's progress from its metrics.jsonl, and the table refreshed in place
    assert "step 30/100 · ETA 35.0\u00a0s" in dom.replace("&nbsp;", "\u00a0")
    assert "loss 5.7000" in dom and "3,072" in dom
    assert 'id="updated">updated ' in dom

    screenshot = tmp_path / "finetune-runs.png"
    chromium(tmp_path, f"--screenshot={screenshot}", "--window-size=1600,500",
             f"{login}/finetune-runs/")
    assert screenshot.stat().st_size > 10_000
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    report = chromium(tmp_path, "--dump-dom",
                      f"{login}/finetune-runs/runs/{RUN_NAME}/report.html").stdout
    assert f"Run {RUN_ID}" in report
    assert 'aria-label="Loss"' in report and 'aria-label="GPU utilisation per GPU"' in report
