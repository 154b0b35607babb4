"""The llm_finetune DAG, run for real through Airflow on the local target."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.demo import load_dag, run_dag, task_results
from finetune.etcd import LocalEtcd, is_healthy
from finetune.names import run_dir_name
from finetune.targets.local.processes import trainer_processes
from tests.support.system import etcd_or_skip, has_etcd

REPO_ROOT = Path(__file__).resolve().parents[2]
STAGES = ["validate", "prepare_data", "snapshot", "scale_up", "build_image", "rendezvous",
          "preflight", "find_champion", "train", "evaluate", "collect_metrics", "promote",
          "teardown"]
# Fake credentials in the environment of the full run, which must appear nowhere it writes.
SECRETS = {
    "HF_TOKEN": "hf_FakeLocalTokenThatMustNeverLeak0123456",
    "AWS_ACCESS_KEY_ID": "AKIAFAKELOCALRUN0KEY",
    "AWS_SECRET_ACCESS_KEY": "fAkE/LocalRunSecretKey0123456789abcdefXYZ",
    "AWS_SESSION_TOKEN": "FwoGZXIvYXdzEFAKELOCALSESSIONTOKEN0123456789",
}
# A short run: enough steps to see learning, few enough for the test suite.
FAST = {"max_steps": 24, "seq_len": 96, "eval_interval": 12, "checkpoint_interval": 12,
        "warmup_steps": 4}


class TaskLog(logging.Handler):
    """Every log record of the process (the stages' task logs) as text."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run_dir_of(dag_run, output_dir: Path) -> Path:
    return output_dir / run_dir_name(dag_run.run_id)


def assert_etcd_stopped(run_dir: Path) -> None:
    server = LocalEtcd(**json.loads((run_dir / "state" / "etcd.json").read_text()))
    assert not server.is_running()
    assert not is_healthy(server.endpoint)
    assert not Path(server.data_dir).exists()


@pytest.mark.parametrize("dag_file", sorted((REPO_ROOT / "dags").glob("*.py")),
                         ids=lambda path: path.stem)
def test_every_dag_file_imports_without_errors_and_without_torch_or_transformers(dag_file):
    """What the dag-processor parses: no DAG file may pull the trainer's heavy imports in."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('dag_under_test', {str(dag_file)!r})\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'transformers', 'datasets'))\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr


def test_dag_wires_the_stages_with_a_guaranteed_teardown():
    dag = load_dag()
    assert sorted(dag.task_ids) == sorted(STAGES)
    assert type(dag.timetable).__name__ == "NullTimetable"  # triggered: form, REST, CLI
    up = {t: set(dag.get_task(t).upstream_task_ids) for t in STAGES}
    assert up["prepare_data"] == {"validate"}
    assert up["snapshot"] == {"prepare_data"}
    assert up["scale_up"] == {"prepare_data", "snapshot"}
    assert up["build_image"] == up["rendezvous"] == {"prepare_data", "scale_up"}
    assert up["preflight"] == {"prepare_data", "build_image", "rendezvous"}
    assert up["train"] == {"prepare_data", "build_image", "rendezvous", "preflight"}
    assert up["find_champion"] == {"prepare_data"}
    assert up["evaluate"] == {"prepare_data", "train", "build_image", "find_champion"}
    assert up["collect_metrics"] == {"prepare_data", "train", "evaluate"}
    assert up["promote"] == {"prepare_data", "collect_metrics", "find_champion"}
    assert up["teardown"] == {"prepare_data", "snapshot", "collect_metrics"}
    assert dag.get_task("snapshot").is_setup
    assert dag.get_task("teardown").is_teardown


def test_the_dag_doc_the_ui_shows_describes_each_of_its_tasks():
    """The doc_md (the DAG's page in the Airflow UI) has a line for every task and names no
    task the DAG lacks: a stage added or renamed without it fails here."""
    import re

    for dag in (load_dag(), load_dag("llm_finetune_scheduled")):
        described = set(re.findall(r"^- \*\*(\w+)\*\*:", dag.doc_md, re.M))
        assert described == set(dag.task_ids), dag.dag_id


def test_the_stages_a_new_try_resumes_are_retried_after_a_delay_and_no_others():
    dag = load_dag()
    resumable = {"scale_up", "build_image", "preflight", "train", "collect_metrics",
                 "teardown"}
    for task_id in STAGES:
        task = dag.get_task(task_id)
        if task_id in resumable:
            assert task.retries >= 1 and task.retry_delay.total_seconds() > 0, task_id
        else:  # they would fail the same way again, or break a running training
            assert not task.retries, task_id


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, request):
    """One full local run of the DAG, with a Hugging Face token and AWS credentials in the
    environment (the trainer processes inherit it): (dag run, output dir, task log lines).

    The task log: what the stages log, and what the run printed (dag.test prints task logs).
    """
    output_dir = tmp_path_factory.mktemp("full-run")
    task_log = TaskLog()
    capture = request.config.pluginmanager.getplugin("capturemanager")
    if capture is not None and capture.is_globally_capturing():
        capture.read_global_capture()  # start from this run's output
    with pytest.MonkeyPatch.context() as env:
        for name, value in SECRETS.items():
            env.setenv(name, value)
        # The stages log through the finetune loggers (the trainer's output too, line by line).
        logger = logging.getLogger("finetune")
        old_level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(task_log)
        try:
            dag_run = run_dag({**FAST, "output_dir": str(output_dir), "procs_per_node": 2})
        finally:
            logger.removeHandler(task_log)
            logger.setLevel(old_level)
    if capture is not None and capture.is_globally_capturing():
        out, err = capture.read_global_capture()
        task_log.lines += (out + err).splitlines()
        sys.stdout.write(out)  # still shown with the test's output
        sys.stderr.write(err)
    return dag_run, output_dir, task_log.lines


@pytest.mark.slow
def test_full_local_run_trains_a_model_transformers_loads_and_writes_the_report(full_run):
    dag_run, tmp_path, _ = full_run
    states = task_results(dag_run)
    assert str(dag_run.state) == "success", states
    assert set(states.values()) == {"success"}

    run_dir = run_dir_of(dag_run, tmp_path)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "success"
    assert report["config"]["procs_per_node"] == 2
    metrics = report["metrics"]
    for key in ("initial_eval_loss", "final_eval_loss", "tokens_per_s", "tflops_per_device",
                "median_step_time_s", "peak_memory_bytes"):
        assert metrics[key] is not None and metrics[key] > 0, key
    assert metrics["mfu"] is None  # a CPU run: no trusted peak, no MFU
    assert metrics["final_eval_loss"] < metrics["initial_eval_loss"]
    html = (run_dir / "report.html").read_text()
    assert "<svg" in html and "polyline" in html

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "model")
    ids = tokenizer("### Instruction:\nhello", return_tensors="pt").input_ids
    assert model(ids).logits.shape[-1] == model.config.vocab_size

    # teardown stopped the run's etcd and left no trainer process behind
    if has_etcd():
        assert_etcd_stopped(run_dir)
    assert trainer_processes(str(run_dir / "trainer_config.json")) == []
    train_log = (run_dir / "train.log").read_text()
    assert "step" in train_log
    # prepare_data encoded the data set once, before scale_up; the trainer only loaded it
    data = report["data"]
    assert data["cache_hit"] is False and data["rows_read"] == 3000 == data["rows_kept"]
    assert data["train_rows"] + data["eval_rows"] == 3000 and data["tokens_per_epoch"] > 0
    assert Path(data["path"]).parent == tmp_path / "prepared_data"
    assert "nothing tokenized" in train_log and report["metrics"]["time_to_first_step_s"] > 0
    assert "<h2>Data</h2>" in html


def metadata_rows_of_run(run_id: str) -> dict[str, list[str]]:
    """Every row of every metadata DB table (XCom, rendered fields, triggers, logs...) as text;
    rows of other runs are left out where a table has a run_id."""
    from airflow.models.base import Base
    from airflow.utils.session import create_session

    rows: dict[str, list[str]] = {}
    with create_session() as session:
        for table in Base.metadata.sorted_tables:
            query = table.select()
            if "run_id" in table.c:
                query = query.where(table.c.run_id == run_id)
            rows[table.name] = [repr(tuple(row)) for row in session.execute(query)]
    return rows


@pytest.mark.slow
def test_no_secret_in_task_logs_xcom_rendered_fields_or_run_dir_of_a_full_run(full_run,
                                                                             request):
    from airflow.configuration import conf

    dag_run, output_dir, task_log = full_run
    assert str(dag_run.state) == "success"
    db = metadata_rows_of_run(dag_run.run_id)
    run_dir = run_dir_of(dag_run, output_dir)
    # the scan sees what the run wrote: the run config in XCom and in the rendered fields,
    # the trainer's log lines in the task log, the trainer's config and report in the run dir
    assert any(str(run_dir) in row for row in db["xcom"])
    assert any("run_config" in row and str(run_dir) in row
               for row in db["rendered_task_instance_fields"])
    assert any("eval_loss" in line for line in task_log)
    if request.config.pluginmanager.getplugin("capturemanager").is_globally_capturing():
        assert any("starting task_id=train" in line for line in task_log)  # Airflow's own lines
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    log_dir = Path(conf.get("logging", "base_log_folder"))
    files += [p for p in log_dir.rglob("*") if p.is_file()]  # task log files, where written
    assert {"trainer_config.json", "report.html", "train.log"} <= {p.name for p in files}
    texts = {f"db:{table}": "\n".join(rows) for table, rows in db.items()}
    texts["task log"] = "\n".join(task_log)
    for path in files:
        texts[str(path)] = path.read_bytes().decode("utf-8", errors="replace")
    for name, secret in SECRETS.items():
        leaks = [where for where, text in texts.items() if secret in text]
        assert leaks == [], f"{name} appears in {leaks}"


# One DAG run in the fast tier (8 s each), the other two with the slow tests.
SEMANTIC_BAD_CONFS = [
    pytest.param({"procs_per_node": 64}, "procs_per_node", id="procs_per_node"),
    pytest.param({"dataset": "no/such/file.jsonl"}, "dataset", id="dataset",
                 marks=pytest.mark.slow),
    pytest.param({"micro_batch": 4000}, "micro_batch", id="micro_batch", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("conf", "field"), SEMANTIC_BAD_CONFS)
def test_bad_conf_fails_in_validate_and_no_later_stage_runs(tmp_path, conf, field, capfd):
    dag_run = run_dag({**conf, "output_dir": str(tmp_path)})
    captured = capfd.readouterr()
    assert f"- {field}: " in captured.out + captured.err  # the task log names the field
    states = task_results(dag_run)
    assert str(dag_run.state) == "failed"
    assert states["validate"] == "failed"
    assert all(states[t] in ("upstream_failed", "None", "skipped") for t in STAGES[1:]), states
    assert list(tmp_path.iterdir()) == []  # nothing was created


def test_conf_outside_the_form_schema_is_refused_before_the_run_starts(tmp_path):
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError, match="nodes"):
        run_dag({"nodes": 0, "output_dir": str(tmp_path)})


@pytest.mark.slow
def test_teardown_stops_etcd_and_trainers_when_train_fails_and_the_report_says_why(
        tmp_path, capfd):
    etcd_or_skip()  # teardown must be seen stopping it
    from transformers import AutoTokenizer

    from trainer.model import builtin_config

    # A model directory validate accepts (a Llama config.json of the architecture table) whose
    # weights only loading them finds missing: the training fails at start, by itself.
    broken = tmp_path / "broken-model"
    builtin_config("tiny-llama", AutoTokenizer.from_pretrained("trainer/demo/tokenizer")) \
        .save_pretrained(broken)
    out = tmp_path / "runs"
    dag_run = run_dag({**FAST, "model": str(broken), "tokenizer": "trainer/demo/tokenizer",
                       "output_dir": str(out), "procs_per_node": 2})
    states = task_results(dag_run)
    assert str(dag_run.state) == "failed"
    assert states["train"] == "failed"
    # A training that failed by itself is not retried (a retry would fail the same way).
    assert {ti.task_id: ti.try_number for ti in dag_run.get_task_instances()}["train"] == 1
    assert states["collect_metrics"] == "upstream_failed"
    assert states["teardown"] == "success"

    run_dir = run_dir_of(dag_run, out)
    assert_etcd_stopped(run_dir)
    assert "has no safetensors weights" in (run_dir / "train.log").read_text()
    assert trainer_processes(str(run_dir / "trainer_config.json")) == []
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "failed"
    # The report says why, in the trainer's own words, not torchrun's ChildFailedError.
    error = report["error"]
    assert error["stage"] == "train" and error["rank"] in (0, 1)
    assert "has no safetensors weights" in error["message"]
    assert error["type"] != "ChildFailedError"
    assert "Why it failed" in (run_dir / "report.html").read_text()
    # and so does the train task's error
    captured = capfd.readouterr()
    assert f"raised {error['type']}: " in captured.out + captured.err


@pytest.mark.slow
def test_a_training_past_its_deadline_is_stopped_and_the_run_gives_everything_back(tmp_path):
    out = tmp_path / "runs"
    dag_run = run_dag({**FAST, "max_steps": 100000, "active_deadline_s": 2,
                       "output_dir": str(out), "procs_per_node": 1})
    states = task_results(dag_run)
    assert str(dag_run.state) == "failed"
    assert states["train"] == "failed" and states["teardown"] == "success"
    run_dir = run_dir_of(dag_run, out)
    assert trainer_processes(str(run_dir / "trainer_config.json")) == []
    assert json.loads((run_dir / "report.json").read_text())["status"] == "failed"
    if has_etcd():
        assert_etcd_stopped(run_dir)
