"""bench/gaps.py: a device's idle gaps in a profiler trace, and the host op as each began."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from bench import gaps


def _x(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


EVENTS = [
    _x("cpu_op", "step", 0, 1000),
    _x("cpu_op", "aten::item", 300, 400),  # the host waits for the device...
    _x("cuda_runtime", "cudaStreamSynchronize", 300, 390),
    _x("kernel", "gemm", 10, 290),
    _x("kernel", "gemm overlapping", 200, 100),  # ends at 300: overlaps the first
    _x("gpu_memcpy", "copy", 300, 0),  # touches the end
    # ... then the device waits for the host's launch: a gap of 400 from 300 to 700
    _x("kernel", "norm", 700, 50),
    _x("kernel", "add", 760, 20),  # a gap of 10: under the threshold
    _x("cpu_op", "Optimizer.step", 770, 200),
    _x("kernel", "adam", 900, 100),  # a gap of 120 from 780, inside Optimizer.step
    {"ph": "i", "cat": "kernel", "name": "instant", "ts": 5000},  # not a complete event
]


def test_idle_is_the_window_less_the_union_of_device_intervals_with_each_gaps_host_op():
    result = gaps.idle(EVENTS, min_gap_us=50)
    assert result.window_us == 990  # 10 to 1000
    assert result.busy_us == 290 + 50 + 20 + 100
    assert result.idle_us == 990 - 460
    assert [(g.start_us, g.length_us, g.inner, g.outer) for g in result.gaps] == [
        (300, 400, "cudaStreamSynchronize", "step"),
        (780, 120, "Optimizer.step", "step"),
    ]
    assert gaps.idle([_x("cpu_op", "only host", 0, 10)]).window_us == 0


def test_the_summary_ranks_host_ops_by_the_idle_time_they_began_and_reads_gzipped_traces(
        tmp_path):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    text = gaps.summary(gaps.idle(gaps.load_trace(path), min_gap_us=50))
    lines = text.splitlines()
    assert lines[0].startswith("device window 0.99 ms: busy 0.46 ms, idle 0.53 ms (53.5%); 2 gaps")
    assert lines[2] == "  cudaStreamSynchronize | step: 1, 0.40, 0.40"
    assert lines[3] == "  Optimizer.step | step: 1, 0.12, 0.12"
    assert gaps.summary(gaps.Idle(0, 0, [])) == "no device kernels in the trace"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device's kernels")
def test_a_real_profiler_trace_has_kernels_and_a_gap_where_the_host_sleeps(tmp_path):
    import time

    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(2048, 2048, device="cuda")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        x @ x
        torch.cuda.synchronize()
        with torch.profiler.record_function("sleeping host"):
            time.sleep(0.01)
            x @ x
        torch.cuda.synchronize()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    result = gaps.idle(gaps.load_trace(path))
    assert result.busy_us > 0 and any(g.length_us >= 9000 for g in result.gaps)
