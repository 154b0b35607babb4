"""What is allocated at a run's peak, by where it was allocated: `bench.train --memory-peak`.

PyTorch's CUDA allocator can record every allocation and free with its Python stack
(`torch.cuda.memory._record_memory_history`); replaying that trace finds the moment the allocated
bytes peaked and what was live then. Each live block is put under the innermost frame of this
repository (trainer/, bench/, plugins/) that led to it, beside the innermost frame of all (the
library or generated kernel wrapper that asked), so a peak reads as "the loss's chunk: 0.5 GiB,
a block's recompute: 1.2 GiB, ...".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

GIB = 1 << 30
OURS = ("/trainer/", "/bench/", "/plugins/")
MAX_ENTRIES = 2_000_000


def start() -> None:
    import torch

    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")


def stop() -> dict[str, Any]:
    import torch

    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return snapshot


def _where(frames: Iterable[Mapping[str, Any]]) -> str:
    frames = list(frames)
    inner = frames[0] if frames else None
    ours = next((f for f in frames if any(part in f["filename"] for part in OURS)), None)
    def name(frame: Mapping[str, Any] | None) -> str:
        if frame is None:
            return "?"
        path = frame["filename"]
        for part in OURS:
            if part in path:
                path = part.strip("/") + "/" + path.split(part, 1)[1]
                break
        else:
            path = path.rsplit("/", 1)[-1]
        return f"{path}:{frame['line']} {frame['name']}"
    return name(ours) if ours is inner else f"{name(ours)} <- {name(inner)}"


def live_at_peak(trace: list[Mapping[str, Any]], top: int = 15) -> dict[str, Any]:
    """From one device's trace (alloc / free_requested events, in order): the peak of allocated
    bytes and what was live at it, grouped by `_where` of each block's stack, largest first.
    A block counts as allocated until its free is requested, as torch.cuda.max_memory_allocated
    counts it (a free that waits for another stream's use completes later, and only then can
    the allocator hand the memory out again)."""
    allocated = peak = peak_index = 0
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            allocated += event["size"]
            if allocated > peak:
                peak, peak_index = allocated, index
        elif event["action"] == "free_requested":
            allocated -= event["size"]
    live: dict[int, Mapping[str, Any]] = {}
    for event in trace[: peak_index + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_requested":
            live.pop(event["addr"], None)
    groups: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for event in live.values():
        key = _where(event.get("frames", ()))
        groups[key] += event["size"]
        counts[key] += 1
    return {
        "peak_gib": round(peak / GIB, 3),
        "events": len(trace),
        # the record keeps the last MAX_ENTRIES events: a longer run lost its first ones (the
        # weights' allocations among them), and its peak and list are then wrong
        "truncated": len(trace) >= MAX_ENTRIES,
        "live": [{"gib": round(size / GIB, 3), "blocks": counts[key], "where": key}
                 for key, size in groups.most_common(top)],
    }


def summary(snapshot: Mapping[str, Any], device: int = 0, top: int = 15) -> dict[str, Any]:
    return live_at_peak(snapshot["device_traces"][device], top)
