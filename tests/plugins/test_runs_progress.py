"""The runs page's view of a run in progress (stage, step of total, loss, tokens/s, ETA) from
its metrics.jsonl, and the table's cells a user reads (name as the report link, XID n/a on
CPU runs)."""

from __future__ import annotations

import json

from finetune.report import write_report
from finetune.runs_page import list_runs, render_runs_table, run_progress

NOW = 1_800_000_000.0


def metrics_lines(steps: int, max_steps: int, step_time_s: float = 0.5) -> list[str]:
    records = [{"type": "data", "step": 0, "max_steps": max_steps, "time": NOW - 100},
               {"type": "eval", "step": 0, "eval_loss": 6.5, "time": NOW - 99}]
    records += [{"type": "train", "step": s, "loss": 6.0 - s / 100, "tokens": 1000,
                 "tokens_per_s": 1000 / step_time_s, "tflops_per_device": 0.01, "mfu": None,
                 "step_time_s": step_time_s, "time": NOW - (steps - s) * step_time_s}
                for s in range(1, steps + 1)]
    return [json.dumps(r) for r in records]


def test_a_training_run_shows_step_of_total_loss_throughput_and_eta():
    progress = run_progress(metrics_lines(30, 100), finished_training=False, now=NOW + 2)
    assert progress["stage"] == "training"
    assert (progress["step"], progress["max_steps"]) == (30, 100)
    assert progress["loss"] == 5.7 and progress["eval_loss"] == 6.5
    assert progress["tokens_per_s"] == 2000  # 29 x 1000 tokens in 29 x 0.5 s
    assert progress["eta_s"] == 35  # 70 steps at the last steps' 0.5 s
    assert progress["since_last_record_s"] == 2 and progress["elapsed_s"] == 102


def test_the_stage_follows_the_runs_files():
    assert run_progress([], False)["stage"] == "starting (before the first step)"
    assert run_progress(metrics_lines(100, 100), False)["stage"] == "final eval and model export"
    assert run_progress(metrics_lines(100, 100), True)["stage"] == "writing the report"


def test_a_running_local_run_is_listed_with_its_progress_and_model(tmp_path):
    run = tmp_path / "manual__r"
    (run / "state").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("\n".join(metrics_lines(5, 40)) + "\n")
    (run / "trainer_config.resolved.json").write_text(json.dumps({"model": "tiny-llama"}))

    (row,) = list_runs([tmp_path])
    table = render_runs_table([row])

    assert row["status"] == "running" and row["progress"]["step"] == 5
    assert "step 5/40" in table and "tiny-llama" in table and "report when it ends" in table


def test_a_finished_cpu_runs_name_links_its_report_and_its_gpu_figures_say_na(tmp_path):
    run = tmp_path / "manual__done"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(metrics_lines(3, 3)) + "\n")
    (run / "summary.json").write_text(json.dumps({
        "steps": 3, "mfu": None, "peak_flops_source": "none: CPUs have no trusted peak"}))
    write_report(run, run_id="manual__done+00:00", status="success",
                 config={"target": "local", "model": "tiny-llama", "nodes": 1,
                         "procs_per_node": 2})

    table = render_runs_table(list_runs([tmp_path]))

    assert '<a href="runs/manual__done/report.html">manual__done+00:00</a>' in table
    assert '<td class="num muted">n/a</td>' in table  # XID errors: no GPUs, not "0"
    assert ">n/a (CPU)<" in table and ">2,000<" in table  # MFU; total tokens / step time
