"""The goodput of a run from its history: every paid node-second in one category, each
interruption's cost, the figures of a made-up history checked by hand."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from finetune.goodput import CATEGORIES, goodput


def step(n: int, end: float, seconds: float = 1.0) -> dict:
    return {"type": "train", "step": n, "time": end, "step_time_s": seconds}


# Two nodes from t=0 to t=100. Round 1 starts its processes at 10, trains from 15 (an eval of
# 1 s before), steps 1-6 of 1 s each, a 2 s save at step 4, is preempted at step 6 (saved in
# 3 s) at 26. Round 2 starts at 36, loads in 2 s, trains from 40, steps 7-10, ends at 44.
HISTORY = [
    {"event": "eval", "time": 14.0, "step": 0, "seconds": 1.0},
    {"event": "start", "time": 15.0, "started": 10.0, "nodes": 2, "world_size": 2,
     "resumed_from_step": None, "load_s": 0.0, "lost_steps": 0, "lost_s": 0.0},
    {"event": "save", "time": 21.0, "step": 4, "seconds": 2.0},
    {"event": "save", "time": 26.0, "step": 6, "seconds": 2.5},
    {"event": "preempted", "time": 26.0, "step": 6, "notice": 24.0, "save_s": 3.0},
    {"event": "start", "time": 40.0, "started": 36.0, "nodes": 2, "world_size": 2,
     "resumed_from_step": 6, "load_s": 2.0, "lost_steps": 0, "lost_s": 0.0},
    {"event": "end", "time": 44.0, "step": 10},
]
KEPT = [step(n, t) for n, t in [(1, 16), (2, 17), (3, 18), (4, 19), (5, 22), (6, 23),
                               (7, 41), (8, 42), (9, 43), (10, 44)]]


def test_each_category_of_a_preempted_run_as_counted_by_hand():
    good = goodput(HISTORY, KEPT, held_from=0.0, held_until=100.0, nodes=2,
                   node_hourly_price=3600.0)
    node_s = good["node_s"]
    assert good["paid_node_s"] == 200.0
    assert node_s["productive"] == 2 * 10
    assert node_s["saves_and_loads"] == 2 * (2.0 + 3.0 + 2.0)  # the notice's save in full
    assert node_s["evaluation"] == 2 * 1.0
    assert node_s["start_up"] == 2 * (10 + (15 - 10 - 1) + (40 - 36 - 2))
    assert node_s["steps_trained_twice"] == 0
    assert node_s["restarts"] == 2 * ((36 - 26) + (26 - 10 - 6 - 5 - 1 - 4))
    assert sum(node_s.values()) == pytest.approx(200.0)
    assert good["goodput"] == 0.1 and good["cost_usd"]["paid"] == 200.0
    [notice] = good["interruptions"]
    assert notice["kind"] == "preempted" and notice["step"] == 6 and notice["steps_lost"] == 0
    assert notice["node_seconds"] == 2 * 10 + 2 * (4 + 2)


def test_a_node_lost_costs_its_steps_trained_twice_and_the_smaller_round_is_counted_as_such():
    history = [HISTORY[1], HISTORY[2],
               {"event": "start", "time": 40.0, "started": 36.0, "nodes": 1, "world_size": 1,
                "resumed_from_step": 4, "load_s": 1.0, "lost_steps": 2, "lost_s": 2.0},
               {"event": "end", "time": 50.0, "step": 10}]
    kept = [step(n, t) for n, t in [(1, 16), (2, 17), (3, 18), (4, 19)]] + \
        [step(n, 40.0 + n - 4) for n in range(5, 11)]
    good = goodput(history, kept, held_from=10.0, held_until=50.0, nodes=2)
    [lost] = good["interruptions"]
    assert lost["kind"] == "node lost" and lost["steps_lost"] == 2
    assert good["node_s"]["steps_trained_twice"] == 2 * 2.0  # two nodes trained them
    assert good["node_s"]["productive"] == 2 * 4 + 1 * 6  # the second round on one node
    assert good["node_s"]["idle_nodes"] > 0  # the lost node's share of the second round


# A notice at 29 reached round 2's first processes (started at 28) before their first step; they
# exited at 30, merged into the history as run_history.with_startup_notices does.
NOTICED_AT_START_UP = {"event": "preempted", "step": None, "notice": 29.0, "time": 30.0,
                       "save_s": 0.0, "before_first_step": True, "started": 28.0,
                       "nodes": ["worker-1"]}


def test_a_notice_before_a_rounds_first_step_is_a_preemption_and_an_interruption_of_its_own():
    history = [*HISTORY[:5], NOTICED_AT_START_UP, *HISTORY[5:]]
    good = goodput(history, KEPT, held_from=0.0, held_until=100.0, nodes=2)
    before = goodput(HISTORY, KEPT, held_from=0.0, held_until=100.0, nodes=2)
    assert good["preemptions"] == 2
    assert good["node_s"] == before["node_s"]  # the aborted start-up is among the restarts
    saved, startup = good["interruptions"]
    assert saved["kind"] == "preempted" and saved["step"] == 6 and saved["at"] == 26.0
    assert saved["node_seconds"] == 2 * (30 - 26)  # until the next attempt's notice
    assert startup == {"kind": "preempted", "at": 30.0, "step": 6, "steps_lost": 0,
                       "node_seconds": 2 * (36 - 30) + 2 * (4 + 2), "before_first_step": True}
    # together what the one interruption cost without the aborted attempt
    assert saved["node_seconds"] + startup["node_seconds"] == \
        before["interruptions"][0]["node_seconds"]


def test_a_start_up_notice_after_the_last_round_is_counted_and_one_before_the_first_interrupts():
    noticed_last = {**NOTICED_AT_START_UP, "notice": 60.0, "time": 61.0, "started": 50.0}
    good = goodput([*HISTORY, noticed_last], KEPT, held_from=0.0, held_until=100.0, nodes=2)
    assert good["preemptions"] == 2 and len(good["interruptions"]) == 1
    first = {**NOTICED_AT_START_UP, "notice": 7.0, "time": 8.0, "started": 5.0}
    good = goodput([first, *HISTORY], KEPT, held_from=0.0, held_until=100.0, nodes=2)
    assert good["interruptions"][0] == {
        "kind": "preempted", "at": 8.0, "step": 0, "steps_lost": 0,
        "node_seconds": 2 * (10 - 8) + 2 * (15 - 10), "before_first_step": True}


def test_no_history_no_goodput():
    assert goodput([], [], held_from=0, held_until=10, nodes=1) is None


@settings(max_examples=100, deadline=None)
@given(rounds=st.lists(st.tuples(st.floats(0, 20), st.floats(0, 5), st.integers(1, 10),
                                 st.floats(0, 3), st.floats(0, 20)), min_size=1, max_size=4),
       nodes=st.integers(1, 8))
def test_the_categories_add_up_to_the_paid_node_time(rounds, nodes):
    history, kept, now = [], [], 1.0
    for gap, start_up, steps, save, tail in rounds:
        started = now + gap
        ready = started + start_up
        history.append({"event": "start", "time": ready, "started": started, "nodes": nodes,
                        "resumed_from_step": None, "load_s": 0.0, "lost_steps": 0,
                        "lost_s": 0.0})
        for n in range(steps):
            kept.append(step(n, ready + n + 1))
        history.append({"event": "save", "time": ready + steps + save, "step": steps,
                        "seconds": save})
        now = ready + steps + save + tail
    good = goodput(history, kept, held_from=0.0, held_until=now + 1, nodes=nodes)
    assert set(good["node_s"]) == set(CATEGORIES)
    assert all(v >= 0 for v in good["node_s"].values())
    assert sum(good["node_s"].values()) == pytest.approx(good["paid_node_s"], abs=0.5)
