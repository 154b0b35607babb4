"""The three ways to start the pipeline, against a real Airflow: api-server, scheduler and
dag-processor started once for this module (`tests.support.airflow`: LocalExecutor, SQLite, a
project-local AIRFLOW_HOME in tmp, SimpleAuthManager with a real password).

- REST/CLI: `python -m finetune.cli run --preset tiny-local --set ...` triggers llm_finetune
  and follows it to success; bad confs are refused with the reason.
- Schedule: an event on the data set asset starts llm_finetune_scheduled with the preset from
  its DAG file and the overrides from its Airflow Variable; the model asset gets an event with
  the report summary of the run promoted (the cron's own run, when it ran first: the asset's run
  then trains the same model and is no gain over it).
- Form: the trigger form in headless Chromium shows the sections, fields and presets.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from finetune_contract.presets import PRESET_DISPLAY, PRESET_NAMES
from tests.support.airflow import Airflow, Api, wait_for
from tests.support.system import system_binary_or_skip
from tools.airflow_ui import (
    HeadlessChromium,
    log_in,
    open_form_section,
    open_preset_list,
    open_trigger_form,
)

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
        # Timeouts for a machine several times slower than a quiet 2-core one (a CI machine
        # shared with other work): they cost nothing when the run ends in time.
        proc = subprocess.Popen([sys.executable, "-m", "finetune.cli", "run", *args,
                                 "--poll", "1", "--timeout", "900"],
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
    assert proc.wait(timeout=960) == 0, log.read_text()
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


def test_data_set_event_retrains_with_the_preset_and_the_model_asset_holds_the_promoted_run(
        airflow, dataset_event):
    api, out = airflow.api, airflow.out

    def runs():
        return api.get("/api/v2/dags/llm_finetune_scheduled/dagRuns")["dag_runs"]

    def finished_asset_run():
        done = [r for r in runs() if r["run_type"] == "asset_triggered"
                and r["state"] in ("success", "failed")]
        return done[0] if done else None

    run = wait_for("the asset-triggered run", finished_asset_run, 960, airflow.home,
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
    promoted = [e["extra"] for e in events]
    promote = api.get(f"/api/v2/dags/llm_finetune_scheduled/dagRuns/{run['dag_run_id']}"
                      "/taskInstances/promote")["state"]
    earlier = [r for r in runs() if r["run_type"] == "scheduled" and r["end_date"]
               and r["end_date"] <= run["start_date"] and r["state"] == "success"]
    if earlier:
        # The cron's latest past point ran first (the test ran after it: Sundays after 03:00
        # UTC) and its model became the champion; the same preset and data trained again give
        # the same eval loss, which is no gain over it: the asset's run is not promoted and the
        # model asset's one event is the scheduled run's.
        assert promote == "skipped", promote
        assert [e["run_id"] for e in promoted] == [earlier[0]["dag_run_id"]]
        extra = promoted[0]
    else:
        assert promote == "success", promote
        extra = next(e for e in promoted if e["run_id"] == run["dag_run_id"])
        assert extra["model_uri"] == Path(cfg["run_dir"], "model").as_uri()
    assert extra["status"] == "success"
    assert extra["preset"] == "tiny-local"
    assert extra["metrics"]["steps"] == SHORT["max_steps"]
    assert extra["metrics"]["final_eval_loss"] < extra["metrics"]["initial_eval_loss"]


FORM_SECTIONS = ("Preset", "Where to run", "Resources", "Parallelism", "Memory and speed",
                 "Training")


def render_trigger_form(chromium: str, api: Api, tmp_path: Path):
    """Open llm_finetune's trigger form in headless Chromium (tools.airflow_ui: logged in with
    the API token as the UI's cookie), read FORM_SECTIONS and show the preset list; returns the
    page text, the preset options, whether the Trigger buttons are disabled, and a screenshot."""
    with HeadlessChromium(chromium, tmp_path / "chromium", 1400, 2400) as browser:
        log_in(browser, api.url, api.token)
        open_trigger_form(browser, api.url, "llm_finetune", tmp_path)
        # The sections are an accordion (one open at a time): read each one's fields.
        text = ""
        for section in (*FORM_SECTIONS[1:], FORM_SECTIONS[0]):
            open_form_section(browser, section)
            text += browser.text()
        submit_disabled = browser.js("[...document.querySelectorAll('button')].filter(b => "
                                     "b.innerText.trim() === 'Trigger').map(b => b.disabled)")
        options = open_preset_list(browser)
        png = browser.screenshot()
    return text, options, submit_disabled, png
