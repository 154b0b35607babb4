"""Numbers as the report and the runs page write them: "n/a" for a missing or non-finite value,
durations, bytes in MiB or GiB, MFU as a percentage (or why there is none).
"""

from __future__ import annotations

from typing import Any

from finetune.report.run_files import finite

GIB = 1024**3
MIB = 1024**2


def fmt(value: Any, spec: str, suffix: str = "") -> str:
    return "n/a" if finite(value) is None else f"{value:{spec}}{suffix}"


def fmt_duration(seconds: Any) -> str:
    if finite(seconds) is None:
        return "n/a"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def fmt_bytes(value: Any) -> str:
    if finite(value) is None:
        return "n/a"
    return f"{value / GIB:.2f} GiB" if value >= GIB else f"{value / MIB:.1f} MiB"


def mfu_text(metrics: dict) -> str:
    """MFU as a percentage; 'n/a (CPU)' where the run had no trusted peak to divide by."""
    mfu = finite(metrics.get("mfu"))
    if mfu is not None:
        return f"{mfu * 100:.1f}%"
    return "n/a (CPU)" if str(metrics.get("peak_flops_source") or "").startswith("none") \
        else "n/a"
