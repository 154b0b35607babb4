"""Where a profiled GPU sat idle: the gaps between its kernels and what the host was doing then.

`bench.train --profile` on a GPU prints this after its table of kernels: a table of device time
says what the kernels cost, not why a step takes longer than its kernels. Here, from the
profiler's Chrome trace: the window from the first kernel's start to the last one's end, the time
some kernel ran (the union of kernel intervals; copies and memsets count as busy), and each gap
of at least `min_gap_us`, with the host op that was running when the gap began (the innermost
one, and the outermost one around it). A gap that starts inside `aten::item` is the host waiting
for the GPU, which then waits for the host's next launch; one inside a Python-side op is the host
too slow to keep the GPU fed. Host ops of every thread count (backward's engine thread too), so
the innermost and the outermost op may come from two threads; each gap scans every host op,
which is quick for the few dozen gaps of a compiled step.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
HOST_CATEGORIES = frozenset({"cpu_op", "user_annotation", "python_function", "cuda_runtime",
                             "cuda_driver"})


@dataclass(frozen=True)
class Gap:
    start_us: float
    length_us: float
    inner: str  # the innermost host op running when the gap began ("" if none)
    outer: str  # the outermost one


@dataclass(frozen=True)
class Idle:
    window_us: float  # first kernel's start to last kernel's end
    busy_us: float  # some kernel, copy or memset running
    gaps: list[Gap]  # at least min_gap_us long, in time order

    @property
    def idle_us(self) -> float:
        return self.window_us - self.busy_us


def load_trace(path: str | Path) -> list[dict]:
    """The events of a Chrome trace (torch.profiler's export_chrome_trace), gzipped or not."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def idle(events: list[dict], min_gap_us: float = 50.0) -> Idle:
    """The device's busy time and its gaps in `events` (complete events, "ph": "X")."""
    device = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
                    for e in events
                    if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES)
    if not device:
        return Idle(0.0, 0.0, [])
    host = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), str(e.get("name", "")))
            for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CATEGORIES]
    busy, gaps = 0.0, []
    start, end = device[0]
    for s, e in device[1:]:
        if s > end:  # a gap between `end` and `s`
            busy += end - start
            if s - end >= min_gap_us:
                inner, outer = _host_at(host, end)
                gaps.append(Gap(end, s - end, inner, outer))
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    return Idle(end - device[0][0], busy, gaps)


def _host_at(host: list[tuple[float, float, str]], t: float) -> tuple[str, str]:
    """(innermost, outermost) host op whose interval holds time t."""
    around = [(s, e, name) for s, e, name in host if s <= t < e]
    if not around:
        return "", ""
    inner = min(around, key=lambda op: op[1] - op[0])
    outer = max(around, key=lambda op: op[1] - op[0])
    return inner[2], outer[2]


def summary(result: Idle, top: int = 12) -> str:
    """The device's idle time and where it went, as lines of text."""
    if not result.window_us:
        return "no device kernels in the trace"
    lines = [f"device window {result.window_us / 1e3:.2f} ms: busy {result.busy_us / 1e3:.2f} ms, "
             f"idle {result.idle_us / 1e3:.2f} ms ({result.idle_us / result.window_us:.1%}); "
             f"{len(result.gaps)} gaps of at least the threshold, "
             f"{sum(g.length_us for g in result.gaps) / 1e3:.2f} ms"]
    by_op: dict[tuple[str, str], list[float]] = defaultdict(list)
    for gap in result.gaps:
        by_op[(gap.inner, gap.outer)].append(gap.length_us)
    lines.append("gaps by the host op running as each began (innermost | outermost): "
                 "count, total ms, largest ms")
    ranked = sorted(by_op.items(), key=lambda item: -sum(item[1]))[:top]
    for (inner, outer), lengths in ranked:
        lines.append(f"  {inner or '(no host op)'} | {outer or '-'}: {len(lengths)}, "
                     f"{sum(lengths) / 1e3:.2f}, {max(lengths) / 1e3:.2f}")
    return "\n".join(lines)
