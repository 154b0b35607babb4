"""The three ways to start the pipeline, against a real Airflow: api-server, scheduler and
dag-processor started once for this module (`tests.support.airflow`: LocalExecutor, SQLite, a
project-local AIRFLOW_HOME in tmp, SimpleAuthManager with a real password).

- REST/CLI: `python -m finetune.cli run --preset tiny-local --set ...` triggers llm_finetune
  and follows it to success; bad confs are refused with the reason.
- Schedule: an event on the data set asset starts llm_finetune_scheduled with the preset from
  its DAG file and the overrides from its Airflow Variable; the model asset gets an event with
  the report summary.
- Form: the trigger form in headless Chromium shows the sections, fields and presets.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from finetune_contract.presets import PRESET_DISPLAY, PRESET_NAMES
from tests.support.airflow import Airflow, Api, wait_for
from tests.support.system import system_binary_or_skip

pytestmark = pytest.mark.slow  # a real api-server, scheduler, dag-processor; DAG runs; Chromium

STAGES = {"validate", "snapshot", "scale_up", "build_image", "rendezvous", "preflight",
          "find_champion", "train", "evaluate", "collect_metrics", "promote", "teardown"}
# Few steps on top of the tiny-local preset: a run finishes in well under a minute.
SHORT = {"max_steps": 6, "eval_interval": 3, "checkpoint_interval": 0, "warmup_steps": 2}


@dataclasses.dataclass
class Server:
    api: Api
    env: dict  # the components' environment (AIRFLOW_HOME and config)
    password: str
    home: Path  # AIRFLOW_HOME, with each component's log
    out: Path  # where the runs write


@pytest.fixture(scope="module")
def airflow(tmp_path_factory):
    """A running Airflow with this project's DAGs, the cluster pool and the scheduled DAG's
    Variable."""
    home = tmp_path_factory.mktemp("airflow-home")
    out = tmp_path_factory.mktemp("runs")
    server = Airflow(home)
    try:
        server.start("api-server", "scheduler", "dag-processor")
        server.wait_for_dags("llm_finetune", "llm_finetune_scheduled")
        api = server.api
        status, data = api.call("POST", "/api/v2/pools", {
            "name": "finetune_cluster", "slots": 1, "include_deferred": True})
        assert status == 201, data
        conf = {**SHORT, "output_dir": str(out / "scheduled")}
        status, data = api.call("POST", "/api/v2/variables", {
            "key": "llm_finetune_scheduled", "value": json.dumps(conf)})
        assert status == 201, data
        yield Server(api, server.env, server.password, home, out)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def cli_run(airflow):
    """`python -m finetune.cli run` started in the background (it trains while other tests
    run); yields the process, its output file and the output dir."""
    api, out = airflow.api, airflow.out
    log = out / "cli.out"
    cli_env = {**airflow.env, "AIRFLOW_URL": api.url, "AIRFLOW_USERNAME": "admin",
               "AIRFLOW_PASSWORD": airflow.password}
    args = ["--preset", "tiny-local", "--set", "procs_per_node=1",
            "--set", f"output_dir={out / 'cli'}"]
    for key, value in SHORT.items():
        args += ["--set", f"{key}={value}"]
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "finetune.cli", "run", *args,
                                 "--poll", "1", "--timeout", "300"],
                                env=cli_env, stdout=f, stderr=subprocess.STDOUT)
    # One write request at a time: SQLite and concurrent triggers in one api-server deadlock.
    wait_for("the CLI's trigger", lambda: "triggered" in log.read_text() or proc.poll(), 60,
             airflow.home)
    yield proc, log, out
    if proc.poll() is None:
        proc.kill()


@pytest.fixture(scope="module")
def dataset_event(airflow, cli_run):
    """An event on the scheduled DAG's data set asset, posted through the REST API."""
    api = airflow.api
    assets = api.get("/api/v2/assets?name_pattern=finetune_dataset")["assets"]
    assert len(assets) == 1, assets
    status, event = api.call("POST", "/api/v2/assets/events", {
        "asset_id": assets[0]["id"], "extra": {"new_rows": 120}})
    assert status in (200, 201), event
    return event


def test_a_conf_outside_the_form_schema_is_refused_with_the_reason(airflow):
    api = airflow.api
    for conf, field in (({"nodes": 0}, "nodes"), ({"preset": "llama9-1t"}, "preset"),
                        ({"strategy": "ZERO3"}, "strategy")):
        status, data = api.call("POST", "/api/v2/dags/llm_finetune/dagRuns",
                                {"logical_date": None, "conf": conf})
        assert status == 400, (conf, status, data)
        assert field in json.dumps(data), data


def test_cli_refuses_an_unknown_parameter_before_calling_airflow(airflow):
    out = subprocess.run([sys.executable, "-m", "finetune.cli", "run", "--set", "nodez=2"],
                         env={**airflow.env, "AIRFLOW_URL": airflow.api.url},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "nodez: unknown parameter" in out.stderr


def test_trigger_form_shows_sections_fields_and_presets(airflow, dataset_event, tmp_path):
    chromium = system_binary_or_skip("chromium", "chromium")
    text, options, submit_disabled, png = render_trigger_form(chromium, airflow.api, tmp_path)
    (tmp_path / "trigger-form.png").write_bytes(png)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    for section in ("Model", "Data", "Checkpoints", "Output", "EKS", *FORM_SECTIONS):
        assert section in text, section
    # fields of the open sections, with titles, descriptions and enum display names
    for shown in ("Settings known to fit a model", "Sharding strategy", "FULL_SHARD (ZeRO-3)",
                  "Processes per node", "Micro-batch", "Learning rate", "Amazon EKS"):
        assert shown in text, shown
    assert [o for o in options if o in PRESET_DISPLAY.values()] == [
        PRESET_DISPLAY[name] for name in PRESET_NAMES]
    assert submit_disabled == [False, False]  # the defaults are a valid form: it can be sent


def test_cli_triggers_a_preset_run_with_overrides_and_follows_it_to_success(airflow, cli_run):
    api = airflow.api
    proc, log, out = cli_run
    assert proc.wait(timeout=360) == 0, log.read_text()
    output = log.read_text()
    assert "triggered llm_finetune run" in output and "run_id" not in output
    for stage in STAGES:  # progress: every task's states as they changed
        assert f" {stage} " in output, output
    assert "success" in output.splitlines()[-3] or "eval loss" in output
    assert airflow.password not in output  # the password is never printed
    run_id = output.split("triggered llm_finetune run ")[1].split(" with conf")[0]
    cfg = api.xcom("llm_finetune", run_id, "validate")
    assert cfg["preset"] == "tiny-local" and cfg["preset_version"] == 1
    assert cfg["model"] == "tiny-llama" and cfg["seq_len"] == 96  # from the preset
    assert cfg["procs_per_node"] == 1 and cfg["max_steps"] == 6  # the overrides
    assert Path(cfg["run_dir"], "model", "config.json").is_file()
    assert Path(cfg["run_dir"]).parent == out / "cli"


def test_data_set_event_retrains_with_the_preset_and_updates_the_model_asset(
        airflow, dataset_event):
    api, out = airflow.api, airflow.out

    def runs():
        return api.get("/api/v2/dags/llm_finetune_scheduled/dagRuns")["dag_runs"]

    def finished_asset_run():
        done = [r for r in runs() if r["run_type"] == "asset_triggered"
                and r["state"] in ("success", "failed")]
        return done[0] if done else None

    run = wait_for("the asset-triggered run", finished_asset_run, 420, airflow.home,
                   interval=2)
    assert run["state"] == "success", run
    # With catchup off the cron schedule also ran its latest past point once; one run at a
    # time: the asset's run started after it ended.
    for other in runs():
        if other["dag_run_id"] != run["dag_run_id"] and other["end_date"]:
            assert other["run_type"] == "scheduled"
            assert other["end_date"] <= run["start_date"] or other["start_date"] >= run[
                "end_date"], (other, run)
    cfg = api.xcom("llm_finetune_scheduled", run["dag_run_id"], "validate")
    assert cfg["preset"] == "tiny-local"  # from the DAG file
    assert cfg["procs_per_node"] == 2  # the preset's
    assert cfg["max_steps"] == SHORT["max_steps"]  # the Variable's override
    assert Path(cfg["run_dir"]).parent == out / "scheduled"

    model = api.get("/api/v2/assets?name_pattern=llm_finetune_scheduled.model")["assets"]
    assert len(model) == 1
    events = api.get(f"/api/v2/assets/events?asset_id={model[0]['id']}")["asset_events"]
    extra = next(e["extra"] for e in events if e["extra"].get("run_id") == run["dag_run_id"])
    assert extra["status"] == "success"
    assert extra["preset"] == "tiny-local"
    assert extra["model_uri"] == Path(cfg["run_dir"], "model").as_uri()
    assert extra["metrics"]["steps"] == SHORT["max_steps"]
    assert extra["metrics"]["final_eval_loss"] < extra["metrics"]["initial_eval_loss"]


FORM_SECTIONS = ("Preset", "Where to run", "Resources", "Parallelism", "Memory and speed",
                 "Training")


def render_trigger_form(chromium: str, api: Api, tmp_path: Path):
    """Open llm_finetune's trigger form in headless Chromium (DevTools protocol, logged in
    with the API token as the UI's cookie), read FORM_SECTIONS and show the preset list;
    returns the page text, the preset options, whether the Trigger buttons are
    disabled, and a screenshot."""
    import websocket

    profile = tmp_path / "chromium"
    proc = subprocess.Popen([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                             "--disable-dev-shm-usage", "--remote-debugging-port=0",
                             f"--user-data-dir={profile}", "--window-size=1400,2400",
                             "about:blank"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"
        wait_for("chromium", port_file.is_file, 60, tmp_path)
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=10) as r:
            page = next(t for t in json.loads(r.read()) if t["type"] == "page")
        ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60)
        ids = iter(range(1, 10_000))

        def cdp(method: str, **params):
            msg_id = next(ids)
            ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
            while True:
                msg = json.loads(ws.recv())
                if msg.get("id") == msg_id:
                    assert "error" not in msg, msg
                    return msg["result"]

        def js(expr: str):
            return cdp("Runtime.evaluate", expression=expr,
                       returnByValue=True)["result"].get("value")

        def click(label: str | None, selector: str = "button") -> bool:
            """A real mouse click on the visible element labelled `label` (None: the first
            visible one) matching selector; the UI ignores el.click()."""
            at = js(f"(() => {{ const b = [...document.querySelectorAll('{selector}')].find(b => "
                    f"b.getClientRects().length && ({json.dumps(label)} === null || "
                    f"b.innerText.trim() === {json.dumps(label)})); if (!b) return null; "
                    "b.scrollIntoView({block: 'center'}); const r = b.getBoundingClientRect();"
                    " return [r.x + r.width / 2, r.y + r.height / 2]; })()")
            for kind in ("mousePressed", "mouseReleased") if at else ():
                cdp("Input.dispatchMouseEvent", type=kind, x=at[0], y=at[1], button="left",
                    clickCount=1)
            return bool(at)

        cdp("Network.enable")
        cdp("Network.setCookie", name="_token", value=api.token, url=api.url)
        cdp("Page.navigate", url=f"{api.url}/dags/llm_finetune")
        wait_for("the Trigger button", lambda: click("Trigger"), 90, tmp_path, interval=2)
        wait_for("the form", lambda: "Where to run" in (js("document.body.innerText") or ""),
                 60, tmp_path)
        # The sections are an accordion (one open at a time): read each one's fields.
        text = ""
        for section in (*FORM_SECTIONS[1:], FORM_SECTIONS[0]):
            click(section)
            time.sleep(0.7)
            text += js("document.body.innerText")
        submit_disabled = js("[...document.querySelectorAll('button')].filter(b => "
                             "b.innerText.trim() === 'Trigger').map(b => b.disabled)")
        click(None, "input[aria-expanded]")  # the open section's select (presets): its options
        time.sleep(1)
        options = js("[...document.querySelectorAll('[role=option]')]"
                     ".map(o => o.innerText.trim())")
        png = base64.b64decode(cdp("Page.captureScreenshot", format="png",
                                   captureBeyondViewport=True)["data"])
        ws.close()
        return text, options, submit_disabled, png
    finally:
        proc.terminate()
        proc.wait(timeout=30)
