"""bench/memory_peak.py replays an allocator trace: the peak, and what was live at it by place."""

from bench.memory_peak import GIB, live_at_peak


def frame(path, line, name):
    return {"filename": path, "line": line, "name": name}


LOSS = [frame("/usr/lib/torch/functional.py", 10, "mm"), frame("/repo/trainer/loss.py", 99, "fwd")]
BLOCK = [frame("/repo/trainer/offload.py", 200, "backward")]
WEIGHTS = [frame("/repo/trainer/model.py", 5, "materialize")]


def event(action, addr, gib, frames=()):
    return {"action": action, "addr": addr, "size": int(gib * GIB), "frames": list(frames)}


def test_the_peak_is_the_largest_allocated_total_and_lists_only_what_was_live_then():
    trace = [
        event("alloc", 1, 4, WEIGHTS),
        event("alloc", 2, 2, LOSS),        # 6
        event("free_requested", 2, 2),      # 4: no longer allocated (max_memory_allocated)
        event("alloc", 3, 1.5, BLOCK),      # 5.5
        event("free_completed", 2, 2),      # its memory reusable now: no change
        event("alloc", 4, 1, BLOCK),        # 6.5: the peak
        event("free_requested", 4, 1),
        event("free_completed", 4, 1),
        event("alloc", 5, 0.25, LOSS),      # after the peak: not listed
    ]
    result = live_at_peak(trace)
    assert result["peak_gib"] == 6.5 and not result["truncated"]
    assert result["live"] == [
        {"gib": 4.0, "blocks": 1, "where": "trainer/model.py:5 materialize"},
        {"gib": 2.5, "blocks": 2, "where": "trainer/offload.py:200 backward"},
    ]


def test_a_block_allocated_by_a_library_is_named_by_our_frame_and_the_librarys():
    result = live_at_peak([event("alloc", 1, 1, LOSS)])
    assert result["live"][0]["where"] == "trainer/loss.py:99 fwd <- functional.py:10 mm"
