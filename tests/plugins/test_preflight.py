"""The preflight's verdict (finetune/preflight_verdict.py) on what trainer/preflight.py measured,
the report's table, and the local target's preflight with real torchrun processes (gloo)."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

import trainer.preflight
from finetune.preflight_verdict import PreflightFailed, judge, result_line
from finetune.report import write_report
from finetune.targets.local.target import LocalTarget
from finetune.validate import validate_params
from finetune_contract.instance_types import BUSBW_FLOOR, INSTANCE_TYPES
from finetune_contract.preflight_result import PREFLIGHT_FILE, RESULT_PREFIX
from tests.support.preflight import measured

P4DE = INSTANCE_TYPES["p4de.24xlarge"]

# Every health problem NVML can show, as the GPU's record would carry it.
UNWELL = {
    "uncorrected ECC": {"ecc_uncorrected_volatile": 3},
    "row remap failed": {"row_remap_failure": True},
    "row remap pending": {"row_remap_pending": True},
    "retired pages pending": {"retired_pages_pending": True},
    "clocks slowed down: HW_SLOWDOWN": {"throttle": ["HW_SLOWDOWN"]},
    "95 C": {"temperature_c": 95},
}


def test_healthy_nodes_at_their_instance_types_bandwidth_pass():
    verdict = judge(measured(), P4DE)
    assert verdict["ok"] and verdict["bad_nodes"] == [] and verdict["problems"] == []
    assert [row["ok"] for row in verdict["nodes"]] == [True, True]
    assert verdict["expected_inter_gbps"] == P4DE.busbw_inter_gbps


@pytest.mark.parametrize("what", sorted(UNWELL))
def test_each_unwell_gpu_fails_its_node_naming_the_node_the_gpu_and_the_problem(what):
    verdict = judge(measured(health={(1, 5): UNWELL[what]}), P4DE)
    assert not verdict["ok"] and verdict["bad_nodes"] == ["ip-10-0-0-1"]
    (problem,) = verdict["nodes"][1]["problems"]
    assert problem.startswith("GPU 5: ") and what.split(":")[0].rstrip("d") in problem


def test_every_field_the_program_records_for_a_gpu_is_judged_or_declared_data():
    # a scan: a field trainer/preflight.py adds to a GPU's record is judged (UNWELL has a case
    # for it) or is one of the descriptive fields, so a new check cannot be silently ignored
    descriptive = {"nvml", "why", "name", "uuid", "sm_clock_mhz", "sm_clock_max_mhz",
                   "ecc_uncorrected_aggregate"}
    judged = {key for change in UNWELL.values() for key in change}
    source = inspect.getsource(trainer.preflight.gpu_health)
    recorded = set(re.findall(r'health\[\s*"(\w+)"\]', source)) | set(
        re.findall(r'"(\w+)":', source))
    assert recorded, "the scan found no fields"
    assert recorded <= descriptive | judged, f"not judged: {recorded - descriptive - judged}"


def test_bandwidth_below_the_floor_of_the_profile_fails_the_node_and_at_the_floor_passes():
    floor = BUSBW_FLOOR * P4DE.busbw_intra_gbps
    assert judge(measured(intra=floor), P4DE)["ok"]
    slow = judge(measured(intra=floor - 1), P4DE)
    assert slow["bad_nodes"] == ["ip-10-0-0-0", "ip-10-0-0-1"]
    assert "below 50% of the 230 GB/s p4de.24xlarge should reach" in \
        slow["nodes"][0]["problems"][0]


def test_slow_bandwidth_across_nodes_fails_the_run_without_blaming_a_node():
    verdict = judge(measured(inter=3.0), P4DE)  # TCP instead of EFA
    assert not verdict["ok"] and verdict["bad_nodes"] == []
    assert "across the 2 nodes at 3.0 GB/s" in verdict["problems"][0]


def test_a_gpu_much_slower_than_the_others_and_xids_fail_their_nodes():
    verdict = judge(measured(matmul={(0, 2): 90.0}), P4DE, xids={"ip-10-0-0-1": [79, 79]})
    assert verdict["bad_nodes"] == ["ip-10-0-0-0", "ip-10-0-0-1"]
    assert "GPU 2: matmul at 90 TFLOP/s" in verdict["nodes"][0]["problems"][0]
    assert verdict["nodes"][1]["problems"] == ["XID error(s) 79 (DCGM)"]


def test_without_a_profile_cpu_runs_are_judged_on_health_only():
    verdict = judge(measured(backend="gloo", intra=0.5, inter=0.1), None)
    assert verdict["ok"] and verdict["expected_inter_gbps"] is None


def test_the_result_line_is_found_in_a_log_among_other_lines():
    result = measured(nodes=1)
    log = f"warming up\n[rank0] {RESULT_PREFIX}{json.dumps(result)}\nbye\n"
    assert result_line(log) == result
    assert result_line("no result here") is None


def test_the_report_shows_the_preflight_table_and_warns_of_bad_nodes(tmp_path):
    verdict = judge(measured(health={(0, 1): {"ecc_uncorrected_volatile": 2}}), P4DE)
    (tmp_path / PREFLIGHT_FILE).write_text(json.dumps(verdict))
    report = write_report(tmp_path, run_id="r", status="failed", config={})
    assert report["preflight"]["bad_nodes"] == ["ip-10-0-0-0"]
    assert any("preflight found bad node(s): ip-10-0-0-0" in w for w in report["warnings"])
    html = (tmp_path / "report.html").read_text()
    assert "<h2>Preflight</h2>" in html and "GPU 1: 2 uncorrected ECC error(s)" in html


@pytest.mark.slow
def test_the_local_preflight_checks_every_process_with_gloo_and_writes_its_verdict(tmp_path):
    cfg = validate_params({"output_dir": str(tmp_path), "nodes": 2, "procs_per_node": 1},
                          run_id="pf")
    result = LocalTarget().preflight(cfg, image={}, rendezvous={})
    assert result["ok"] and "2 node(s) checked (gloo)" in result["summary"]
    verdict = json.loads((Path(cfg.run_dir) / PREFLIGHT_FILE).read_text())
    assert [n["node"] for n in verdict["nodes"]] == [0, 1]
    assert verdict["inter_busbw_gbps"] > 0  # measured across the two "nodes"


def test_a_local_preflight_that_cannot_measure_fails_with_the_programs_output(tmp_path,
                                                                              monkeypatch):
    cfg = validate_params({"output_dir": str(tmp_path), "nodes": 1, "procs_per_node": 1},
                          run_id="pf-bad")
    monkeypatch.setattr("finetune.targets.local.target.sys.executable", "/bin/false")
    with pytest.raises(PreflightFailed, match="preflight could not measure"):
        LocalTarget().preflight(cfg, image={}, rendezvous={})


def test_preflight_off_skips_the_check(tmp_path):
    cfg = validate_params({"output_dir": str(tmp_path), "preflight": False}, run_id="pf-off")
    assert LocalTarget().preflight(cfg, image={}, rendezvous={}) == {"skipped": True}
