"""report.py: a trainer's run directory becomes report.json and a self-contained report.html."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from finetune.report import load_metrics, summarize, svg_line_chart, write_report

CONFIG = {
    "model": "tiny-llama",
    "dataset": {"path": "data/train.jsonl", "max_rows": 100},
    "note": "<script>alert(1)</script>",
}

# The report's metrics taken from summary.json (eval_loss_ratio is derived from two of them).
SUMMARY_METRICS = (
    "initial_eval_loss", "final_eval_loss", "tokens_per_s", "tflops_per_device", "mfu",
    "median_step_time_s", "median_step_tokens_per_s", "peak_memory_bytes", "wall_time_s",
    "steps", "world_size", "time_to_first_step_s", "data_load_s",
)

SUMMARY = {
    "initial_eval_loss": 2.5,
    "final_eval_loss": 1.25,
    "steps": 4,
    "tokens_per_s": 12345.6,
    "tflops_per_device": 123.4,
    "mfu": 0.42,
    "median_step_time_s": 0.31,
    "median_step_tokens_per_s": 13000.0,
    "peak_memory_bytes": 20 * 1024**3,
    "wall_time_s": 3725.0,
    "time_to_first_step_s": 41.5,
    "data_load_s": 0.25,
    "world_size": 8,
    "resumed_from_step": None,
    "skipped_rows": 0,
    "peak_flops": 989e12,
    "peak_flops_source": "table",
    "config": {},
}


def train_record(step: int, loss: float, **overrides: object) -> dict:
    record = {
        "type": "train",
        "step": step,
        "loss": loss,
        "lr": 1e-4 * step,
        "grad_norm": 1.0,
        "tokens": 4096,
        "tokens_per_s": 1000.0 * step,
        "tflops_per_device": 10.0 * step,
        "mfu": 0.1 * step,
        "step_time_s": 0.5,
        "peak_memory_bytes": 1024**3 * step,
        "time": 1_700_000_000.0 + step,
    }
    return record | overrides


def eval_record(step: int, eval_loss: float) -> dict:
    return {"type": "eval", "step": step, "eval_loss": eval_loss, "time": 1_700_000_000.0 + step}


NORMAL_RECORDS = [
    eval_record(0, 2.5),
    train_record(1, 3.0),
    train_record(2, 2.4),
    eval_record(2, 1.8),
    train_record(3, 2.0),
    train_record(4, 1.5),
    eval_record(4, 1.25),
]


def make_run(
    run_dir: Path,
    records: list[dict],
    *,
    summary: dict | None = None,
    tail: str = "",
    model: bool = False,
) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(r) + "\n" for r in records)
    (run_dir / "metrics.jsonl").write_text(lines + tail, encoding="utf-8")
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    if model:
        (run_dir / "model").mkdir()
        (run_dir / "model" / "config.json").write_text("{}", encoding="utf-8")
    return run_dir


def polylines(svg_or_html: str) -> list[str]:
    return re.findall(r'<polyline points="([^"]*)"', svg_or_html)


# --- a normal, finished run ------------------------------------------------------------------


def test_finished_run_report_takes_metrics_from_summary(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run", NORMAL_RECORDS, summary=SUMMARY, model=True)

    report = write_report(run_dir, run_id="r-1", status="success", config=CONFIG)

    assert report["schema_version"] == 1
    assert report["run_id"] == "r-1"
    assert report["status"] == "success"
    assert report["config"] == CONFIG
    assert report["stages"] == {}
    for key in SUMMARY_METRICS:
        assert report["metrics"][key] == SUMMARY[key], key
    assert report["metrics"]["eval_loss_ratio"] == pytest.approx(0.5)
    assert report["artifacts"] == {
        "model": "model",
        "metrics": "metrics.jsonl",
        "report_html": "report.html",
    }
    assert report["warnings"] == []


def test_report_json_on_disk_equals_returned_report(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run", NORMAL_RECORDS, summary=SUMMARY)
    stages = {"prepare": {"status": "success", "duration_s": 12.5}}

    report = write_report(run_dir, run_id="r-1", status="success", config=CONFIG, stages=stages)

    assert json.loads((run_dir / "report.json").read_text()) == report
    assert report["stages"] == stages
    assert report["generated_at"].endswith("+00:00")


def test_series_hold_train_and_eval_points_in_step_order(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run", NORMAL_RECORDS, summary=SUMMARY)

    series = write_report(run_dir, run_id="r", status="success", config={})["series"]

    assert [p["step"] for p in series["train"]] == [1, 2, 3, 4]
    assert series["train"][1] == {
        "step": 2,
        "loss": 2.4,
        "lr": pytest.approx(2e-4),
        "grad_norm": 1.0,
        "tokens_per_s": 2000.0,
        "mfu": 0.2,
    }
    assert series["eval"] == [
        {"step": 0, "eval_loss": 2.5},
        {"step": 2, "eval_loss": 1.8},
        {"step": 4, "eval_loss": 1.25},
    ]


def test_html_shows_headline_figures_and_three_charts(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run", NORMAL_RECORDS, summary=SUMMARY)
    write_report(run_dir, run_id="r-1", status="success", config=CONFIG)

    page = (run_dir / "report.html").read_text(encoding="utf-8")

    assert "<title>Run r-1: success</title>" in page
    assert page.count("<svg") == 3
    # train loss, eval loss, tokens/s, lr
    assert len(polylines(page)) == 4
    assert "train loss" in page and "eval loss" in page
    assert "no data" not in page
    assert "12,346" in page  # tokens/s
    assert "123.4" in page  # TFLOPs/device
    assert "42.0%" in page  # MFU as a percentage
    assert "1h 02m 05s" in page  # wall time
    assert "20.00 GiB" in page  # peak memory
    assert "2.5000 → 1.2500" in page  # initial -> final eval loss


def test_html_escapes_config_values(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run", NORMAL_RECORDS, summary=SUMMARY)
    write_report(run_dir, run_id="<b>r</b>", status="success", config=CONFIG)

    page = (run_dir / "report.html").read_text(encoding="utf-8")

    assert "<script" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<b>r</b>" not in page
    assert "dataset.max_rows" in page  # nested config flattened into the table


def test_no_secret_field_of_the_config_reaches_the_report(tmp_path: Path) -> None:
    """Every field the parameter table marks secret (each may hold a credential), whatever the
    target passed: the report is stored beside the model and served by the runs page."""
    from finetune_contract.parameters import SECRET_NAMES

    assert SECRET_NAMES  # the rdzv endpoint, the token's Secret, the Prometheus URL
    run_dir = make_run(tmp_path / "run", NORMAL_RECORDS, summary=SUMMARY)
    secrets = {name: f"sekrit-{name}" for name in SECRET_NAMES}
    report = write_report(run_dir, run_id="r", status="success", config={**CONFIG, **secrets})

    assert report["config"] == json.loads(json.dumps(CONFIG))
    for page in ("report.json", "report.html"):
        assert "sekrit-" not in (run_dir / page).read_text(encoding="utf-8"), page


def test_html_is_self_contained(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run", NORMAL_RECORDS, summary=SUMMARY)
    write_report(run_dir, run_id="r", status="success", config=CONFIG)

    page = (run_dir / "report.html").read_text(encoding="utf-8")

    assert "<script" not in page
    for reference in ("src=", "href=", "url(", "http://", "https://", "@import"):
        assert reference not in page, reference


# --- failed and damaged runs -----------------------------------------------------------------


def test_failed_run_without_summary_computes_metrics_from_series(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run", NORMAL_RECORDS)

    report = write_report(run_dir, run_id="r", status="failed", config=CONFIG)

    metrics = report["metrics"]
    assert report["status"] == "failed"
    assert metrics["initial_eval_loss"] == 2.5
    assert metrics["final_eval_loss"] == 1.25
    assert metrics["eval_loss_ratio"] == pytest.approx(0.5)
    # steps 2..4 (the first includes warm-up): 3 x 4096 tokens in 3 x 0.5 s
    assert metrics["tokens_per_s"] == pytest.approx(8192.0)
    assert metrics["median_step_time_s"] == pytest.approx(0.5)
    assert metrics["tflops_per_device"] == pytest.approx(30.0)
    assert metrics["mfu"] == pytest.approx(0.3)
    assert metrics["peak_memory_bytes"] == 4 * 1024**3
    assert metrics["steps"] == 4
    # only the summary knows these: not invented
    assert metrics["wall_time_s"] is None
    assert metrics["world_size"] is None
    assert report["artifacts"]["model"] is None
    assert "summary.json missing: training did not finish" in report["warnings"]
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    assert "status-failed" in page
    assert "summary.json missing" in page


def test_resumed_run_keeps_the_last_record_of_each_step(tmp_path: Path) -> None:
    records = [
        train_record(1, 3.0),
        train_record(2, 9.9),
        train_record(3, 9.9),
        eval_record(3, 9.9),
        # resumed from the checkpoint at step 1: steps 2 and 3 are logged again
        train_record(2, 2.4),
        train_record(3, 2.0),
        eval_record(3, 1.5),
    ]
    path = make_run(tmp_path / "run", records) / "metrics.jsonl"

    train, evals, bad_lines = load_metrics(path)

    assert [(r["step"], r["loss"]) for r in train] == [(1, 3.0), (2, 2.4), (3, 2.0)]
    assert [(r["step"], r["eval_loss"]) for r in evals] == [(3, 1.5)]
    assert bad_lines == 0


def test_truncated_last_line_is_skipped_and_counted(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run", NORMAL_RECORDS, tail='{"type": "train", "step": 5, "lo')

    train, _, bad_lines = load_metrics(run_dir / "metrics.jsonl")
    report = write_report(run_dir, run_id="r", status="failed", config={})

    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert bad_lines == 1
    assert "1 unreadable lines in metrics.jsonl" in report["warnings"]


def test_records_without_an_integer_step_are_counted_as_unreadable(tmp_path: Path) -> None:
    tail = '[1, 2]\n{"type": "train", "loss": 1.0}\n{"type": "eval", "step": "3"}\n\n'
    run_dir = make_run(tmp_path / "run", NORMAL_RECORDS, tail=tail)

    train, evals, bad_lines = load_metrics(run_dir / "metrics.jsonl")

    assert len(train) == 4 and len(evals) == 3
    assert bad_lines == 3


def test_empty_metrics_file_gives_a_report_with_no_data_charts(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run", [])

    report = write_report(run_dir, run_id="r", status="failed", config=CONFIG)

    assert report["series"] == {"train": [], "eval": []}
    assert all(value is None for value in report["metrics"].values())
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    assert page.count("no data") == 3
    assert polylines(page) == []
    assert page.count("n/a") >= 5  # headline figures say so instead of inventing numbers


def test_missing_run_directory_still_gets_a_report(tmp_path: Path) -> None:
    run_dir = tmp_path / "never-started"

    report = write_report(run_dir, run_id="r", status="failed", config={})

    assert (run_dir / "report.json").is_file() and (run_dir / "report.html").is_file()
    assert report["artifacts"]["metrics"] is None
    assert "metrics.jsonl missing: no training steps were logged" in report["warnings"]


def test_unreadable_summary_falls_back_to_series_with_a_warning(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run", NORMAL_RECORDS)
    (run_dir / "summary.json").write_text('{"final_eval_loss": 1.', encoding="utf-8")

    report = write_report(run_dir, run_id="r", status="failed", config={})

    assert report["metrics"]["final_eval_loss"] == 1.25
    assert any(w.startswith("summary.json unreadable") for w in report["warnings"])


def test_non_finite_values_become_null_and_a_diverged_loss_is_warned(tmp_path: Path) -> None:
    records = [train_record(1, 3.0), train_record(2, math.nan, mfu=None), train_record(3, 2.0)]
    run_dir = make_run(tmp_path / "run", records)

    report = write_report(run_dir, run_id="r", status="failed", config={})

    assert report["series"]["train"][1]["loss"] is None
    assert report["metrics"]["mfu"] == pytest.approx(0.3)  # null mfu skipped, not zero
    assert "1 train steps with a non-finite loss" in report["warnings"]
    # strict JSON: no NaN tokens on disk
    json.loads((run_dir / "report.json").read_text(), parse_constant=pytest.fail)


def test_summary_notes_resume_and_skipped_rows(tmp_path: Path) -> None:
    summary = SUMMARY | {"resumed_from_step": 2, "skipped_rows": 7}
    run_dir = make_run(tmp_path / "run", NORMAL_RECORDS, summary=summary)

    report = write_report(run_dir, run_id="r", status="success", config={})

    assert report["warnings"] == ["run resumed from step 2", "7 dataset rows skipped"]


def test_skipped_rows_are_shown_by_reason(tmp_path: Path) -> None:
    summary = SUMMARY | {"skipped_rows": 5, "skipped_rows_by_reason": {
        "too_long": 3, "malformed": 1, "missing_field": 1}}
    run_dir = make_run(tmp_path / "run", NORMAL_RECORDS, summary=summary)

    report = write_report(run_dir, run_id="r", status="success", config={})

    note = "5 dataset rows skipped (1 malformed, 1 missing field, 3 too long)"
    assert report["warnings"] == [note]
    assert note in (run_dir / "report.html").read_text()


def test_summary_nulls_fall_back_to_series(tmp_path: Path) -> None:
    summary = SUMMARY | {"mfu": None}
    run_dir = make_run(tmp_path / "run", NORMAL_RECORDS, summary=summary)

    report = write_report(run_dir, run_id="r", status="success", config={})

    assert report["metrics"]["mfu"] == pytest.approx(0.3)


def test_tokens_per_second_is_total_tokens_over_total_step_time_not_a_mean_of_rates(
    tmp_path: Path,
) -> None:
    # a loaded machine: fast steps (0.05 s) and stalled ones (5 s) of 1,000 tokens each
    records = [train_record(1, 3.0, tokens=1000, step_time_s=9.0, tokens_per_s=111.0)]
    for step, seconds in zip(range(2, 12), [0.05] * 8 + [5.0] * 2, strict=True):
        records.append(train_record(step, 2.0, tokens=1000, step_time_s=seconds,
                                    tokens_per_s=1000 / seconds, tflops_per_device=None,
                                    mfu=None))
    run_dir = make_run(tmp_path / "run", [eval_record(0, 2.5), *records])

    report = write_report(run_dir, run_id="r", status="failed", config={})

    metrics = report["metrics"]
    assert metrics["tokens_per_s"] == pytest.approx(10_000 / 10.4)  # the mean of rates: 16,040
    assert metrics["median_step_time_s"] == pytest.approx(0.05)
    assert metrics["median_step_tokens_per_s"] == pytest.approx(20_000)
    assert metrics["mfu"] is None
    page = (run_dir / "report.html").read_text()
    assert ">962<" in page and "total tokens / step time" in page and ">0.05 s<" in page


def test_a_run_without_a_trusted_peak_shows_no_mfu(tmp_path: Path) -> None:
    records = [train_record(s, 2.0, mfu=None) for s in (1, 2, 3)]
    summary = SUMMARY | {"mfu": None, "peak_flops": None,
                         "peak_flops_source": "none: CPUs have no trusted peak"}
    run_dir = make_run(tmp_path / "run", [eval_record(0, 2.5), *records], summary=summary)

    report = write_report(run_dir, run_id="r", status="success", config={})

    assert report["metrics"]["mfu"] is None
    assert "n/a (CPU)" in (run_dir / "report.html").read_text()


def test_unknown_status_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="status"):
        write_report(tmp_path, run_id="r", status="running", config={})


def test_summarize_without_anything_is_all_null() -> None:
    metrics = summarize([], [], None)

    assert set(metrics) == {*SUMMARY_METRICS, "eval_loss_ratio", "peak_flops_source"}
    assert all(value is None for value in metrics.values())


# --- the chart -------------------------------------------------------------------------------


def test_chart_without_points_says_no_data() -> None:
    svg = svg_line_chart({"loss": []}, "Loss", "step", "loss")

    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert "no data" in svg
    assert polylines(svg) == []


def test_chart_with_a_single_point_draws_a_marker() -> None:
    svg = svg_line_chart({"eval loss": [(10, 1.5)]}, "Loss", "step", "loss")

    assert "no data" not in svg
    assert svg.count("<circle") == 1
    assert polylines(svg) == []


def test_chart_skips_none_and_nan_points() -> None:
    points = [(0, 1.0), (1, None), (2, math.nan), (3, 0.5), (math.inf, 0.1)]

    svg = svg_line_chart({"loss": points}, "Loss", "step", "loss")

    (line,) = polylines(svg)
    assert len(line.split()) == 2
    assert "nan" not in svg.lower() and "inf" not in svg.lower()


def test_chart_has_tick_labels_and_legend_and_stays_inside_its_box() -> None:
    series = {"train": [(s, 10.0 / (s + 1)) for s in range(100)], "eval": [(0, 9.0), (99, 1.0)]}

    svg = svg_line_chart(series, "Loss <vs> step", "step", "loss")

    assert "Loss &lt;vs&gt; step" in svg
    assert ">train<" in svg and ">eval<" in svg
    assert ">0<" in svg and ">20<" in svg  # x ticks
    width, height = (float(v) for v in re.search(r'viewBox="0 0 (\S+) (\S+)"', svg).groups())
    for line in polylines(svg):
        for pair in line.split():
            x, y = (float(v) for v in pair.split(","))
            assert 0 <= x <= width and 0 <= y <= height


def test_chart_of_tiny_learning_rates_labels_ticks_readably() -> None:
    svg = svg_line_chart({"lr": [(0, 0.0), (10, 2e-5)]}, "lr", "step", "lr")

    assert "e-05" in svg
    assert "0.00002000" not in svg


# --- GPU, host and cost sections ----------------------------------------------------------------


GIB_ = 1024**3


def nvml_samples(gpus: int, count: int) -> list[dict]:
    """What the local target's sampler writes: host CPU/memory and per-GPU NVML readings."""
    return [{"time": 1_700_000_000.0 + 2 * i, "cpu_percent": 40.0 + i,
             "memory_used_bytes": (8 + i) * GIB_, "memory_total_bytes": 64 * GIB_,
             "gpus": [{"gpu": g, "uuid": f"GPU-{g}", "model": "NVIDIA H200",
                       "gpu_util_pct": 80 + g + i, "mem_copy_util_pct": 30, "sm_clock_mhz": 1980,
                       "temperature_c": 55 + i, "power_w": 500.0 + 10 * g,
                       "fb_used_mib": 70000 + 100 * i} for g in range(gpus)]}
            for i in range(count)]



def test_report_renders_gpu_host_plots_headlines_and_cost_from_a_fixture_run(tmp_path: Path):
    from finetune.gpu_metrics import host_section, sampled_gpu_metrics

    run_dir = make_run(tmp_path / "run", NORMAL_RECORDS, summary=SUMMARY)
    samples = nvml_samples(gpus=2, count=5)
    report = write_report(run_dir, run_id="r-1", status="success", config=CONFIG,
                          stages={"train": {"wall_time_s": 1800.0}},
                          gpu=sampled_gpu_metrics(samples, node="host-1"),
                          host=host_section(samples), node_hourly_price=40.0, nodes=2)

    assert report["cost"] == {"node_hourly_price_usd": 40.0, "nodes": 2, "hours": 0.5,
                              "usd": 40.0}
    assert report["metrics"]["cost_usd"] == 40.0
    assert report["gpu"]["gpus"][1]["metrics"]["gpu_util_pct"] == {"mean": 83.0, "max": 85}
    assert report["host"]["metrics"]["cpu_percent"] == {"mean": 42.0, "max": 44.0}
    assert json.loads((run_dir / "report.json").read_text()) == report
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    for title in ("GPU utilisation per GPU", "GPU memory used per GPU", "GPU power per GPU",
                  "GPU temperature per GPU", "Host CPU", "Host memory"):
        assert f'aria-label="{title}"' in page, title
    # 3 training charts + 4 GPU charts + 2 host charts; one line per GPU on each GPU chart
    assert page.count("<svg") == 9
    assert len(polylines(page)) == 4 + 4 * 2 + 2
    assert "host-1/gpu0" in page and "host-1/gpu1" in page
    assert "40.00 USD" in page and "GPU util (mean)" in page and "82.5%" in page
    assert "GPU metrics missing" not in page


def test_report_without_gpu_metrics_says_they_are_missing_and_has_no_cost(tmp_path: Path):
    run_dir = make_run(tmp_path / "run", NORMAL_RECORDS, summary=SUMMARY)
    report = write_report(run_dir, run_id="r-1", status="success", config=CONFIG)
    assert report["gpu"] is None and report["cost"] is None
    assert report["metrics"]["cost_usd"] is None
    assert "GPU metrics missing" in (run_dir / "report.html").read_text(encoding="utf-8")


# --- hangs and stragglers (trainer/watchdog.py, finetune_contract/stragglers.py) -------------


def test_a_hang_a_restart_survived_is_named_in_the_warnings(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run", NORMAL_RECORDS, summary=SUMMARY)
    (run_dir / "errors").mkdir()
    message = ("training hang: rank 0 made no progress for 9 s after step 5 (hang_timeout_s); "
               "rank 1 (pid 42 on node-a) stopped responding")
    (run_dir / "errors" / "rank_0.json").write_text(json.dumps(
        {"stage": "train", "type": "TrainingHang", "message": message, "rank": 0, "time": 1.0}))
    (run_dir / "errors" / "rank_1.json").write_text(json.dumps(
        {"stage": "train", "type": "ValueError", "message": "other", "rank": 1, "time": 2.0}))

    report = write_report(run_dir, run_id="r", status="success", config={})

    assert report["warnings"] == [f"{message} (stacks and collective traces in hangs/)"]
    assert "rank 1 (pid 42 on node-a) stopped responding" in (run_dir / "report.html").read_text()


def test_a_rank_slower_than_the_median_by_more_than_the_threshold_is_a_straggler(
    tmp_path: Path,
) -> None:
    times = [[0.50, 0.52, 0.49, 0.70], [0.51, 0.50, 0.50, 0.66], [0.9, 0.5, 0.5, 0.5]]
    records = [train_record(step, 2.0, rank_step_time_s=t) for step, t in enumerate(times, 1)]
    run_dir = make_run(tmp_path / "run", records, summary=SUMMARY)

    report = write_report(run_dir, run_id="r", status="success",
                          config={"straggler_threshold": 0.25})

    ranks = report["rank_step_times"]
    assert ranks["median_step_time_s"] == [0.51, 0.5, 0.5, 0.66]  # rank 0's one slow step
    assert [s["rank"] for s in ranks["stragglers"]] == [3]  # 0.66 / 0.505: 31% slower
    assert report["warnings"] == [
        "rank 3 is a straggler: median step time 0.66 s, 31% slower than the ranks' median "
        "0.505 s"]
    html = (run_dir / "report.html").read_text()
    assert "rank 3 (straggler)" in html and "rank 0 (straggler)" not in html

    lenient = write_report(run_dir, run_id="r", status="success",
                           config={"straggler_threshold": 0.35})
    assert lenient["rank_step_times"]["stragglers"] == [] and lenient["warnings"] == []


def test_a_run_without_per_rank_step_times_has_no_straggler_section(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run", NORMAL_RECORDS, summary=SUMMARY)
    report = write_report(run_dir, run_id="r", status="success", config={})
    assert report["rank_step_times"] is None
    assert "Per-rank step time" not in (run_dir / "report.html").read_text()


def test_the_runs_page_links_a_tracked_run_to_its_mlflow_run_and_shows_the_decision(tmp_path):
    from finetune.report import add_sections
    from finetune.runs_page import list_runs, render_runs_table

    run = tmp_path / "runs" / "manual__r1"
    write_report(run, run_id="manual__r1", status="success", config={})
    url = "http://mlflow.example:5000/#/experiments/3/runs/abc123"
    add_sections(run, tracking={"uri": "http://mlflow.example:5000", "experiment_id": "3",
                                "run_id": "abc123", "url": url},
                 promotion={"decision": "rejected"})
    table = render_runs_table(list_runs([tmp_path / "runs"]))
    assert f'<a href="{url}">MLflow</a>' in table and "rejected" in table


def test_report_puts_the_planners_estimate_beside_what_was_measured_with_the_error(
        tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run", NORMAL_RECORDS, summary=SUMMARY)
    plan = {"peak_gib": 22.0, "step_time_s": 0.3, "tokens_per_s_per_gpu": 1600.0,
            "wall_time_s": 3600.0, "cost_usd": None, "activation_checkpointing": "full",
            "fits": True, "note": ""}

    report = write_report(run_dir, run_id="r", status="success", config=CONFIG, plan=plan,
                          node_hourly_price=10.0, nodes=1,
                          stages={"train": {"resources": {"device": "cuda"}}})

    compared = report["plan"]["compared"]
    assert compared["peak_gib"] == {"estimate": 22.0, "measured": 20.0,
                                    "error": pytest.approx(0.1)}
    assert compared["step_time_s"]["error"] == pytest.approx(0.3 / 0.31 - 1)
    assert compared["tokens_per_s_per_gpu"]["measured"] == pytest.approx(12345.6 / 8)
    assert compared["cost_usd"]["estimate"] is None and compared["cost_usd"]["error"] is None
    assert "Plan against measurement" in (run_dir / "report.html").read_text()


def test_on_a_cpu_the_report_compares_no_memory_and_says_why(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "run", NORMAL_RECORDS, summary=SUMMARY)
    report = write_report(run_dir, run_id="r", status="success", config=CONFIG,
                          plan={"peak_gib": 0.5, "note": ""},
                          stages={"train": {"resources": {"device": "cpu"}}})
    assert report["plan"]["compared"]["peak_gib"]["measured"] is None
    assert any("CPU" in note for note in report["plan"]["notes"])
