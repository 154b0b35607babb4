"""A run's goodput: of the node time it paid for, how much trained, and where the rest went.

From the trainer's history (finetune_contract.run_history: each round of the training, its
saves, evals and a notice), the steps metrics.jsonl keeps (each once: a resumed run drops what
it trains again) and the window the nodes were held, in node-seconds (a second of every node
in the run's world; an elastic round counts the nodes it trained on, the others are idle):

- productive: the kept steps' step time;
- start_up: from the nodes being there to the first step (images, rendezvous, preflight, the
  processes' imports, the model and data), and each later round's start-up;
- capacity_wait: nodes already there while the others were still coming (eks);
- saves_and_loads: checkpoints saved (the time the training waited for them) and loaded;
- evaluation: the eval loss measured during training;
- steps_trained_twice: steps a round trained after its last checkpoint, lost with it;
- restarts: between one round's end and the next one's start (a failure noticed, agents
  started again, the rendezvous), and the step a round was in when it failed;
- idle_nodes: the rest: nodes held but not in the training's world (an elastic run's lost
  ones, after the training ended until they were given back).

Each interruption (a round that ended before the training did) says what it cost in steps
and node-seconds: from its end until the next round trained again. A notice before a round's
first step (a node's record, merged into the history: finetune_contract.run_history) ended a
round that has no start in the history: it is an interruption of its own, kind "preempted" with
`before_first_step`, at the step the run stood at (its checkpoint), costing from its nodes'
exit until the next attempt; its time is among the restarts, where the gap between two rounds
goes. `preemptions` counts every notice (run_history.preemptions, the rule the train task
bounds with max_preemptions), a last round's too. With node_hourly_price, every figure has its
cost.
"""

from __future__ import annotations

from typing import Any

from finetune_contract.run_history import preemptions

CATEGORIES = ("productive", "start_up", "capacity_wait", "saves_and_loads", "evaluation",
              "steps_trained_twice", "restarts", "idle_nodes")


def goodput(history: list[dict[str, Any]], kept_steps: list[dict[str, Any]], *,
            held_from: float, held_until: float, nodes: int, node_hourly_price: float = 0.0,
            capacity_wait_node_s: float = 0.0) -> dict[str, Any] | None:
    """The goodput section of a run's report; None without a history (a trainer that wrote
    none, a run that failed before training)."""
    rounds = _rounds(history)
    if not rounds or held_until <= held_from:
        return None
    paid = nodes * (held_until - held_from) + capacity_wait_node_s
    spent = dict.fromkeys(CATEGORIES, 0.0)
    spent["capacity_wait"] = capacity_wait_node_s
    spent["start_up"] += nodes * max(0.0, rounds[0]["start"]["started"] - held_from)
    interruptions = []
    startup_notices = [e for e in history if e.get("before_first_step")]
    if startup_notices:  # before the first round (its start-up noticed before any training)
        first = rounds[0]["start"]
        interruptions += _startup_interruptions(
            [e for e in startup_notices if e["time"] <= first["started"]], first,
            first.get("nodes") or nodes)
    steps_of = _steps_by_round(rounds, kept_steps)
    for i, current in enumerate(rounds):
        start = current["start"]
        n = start.get("nodes") or nodes
        ended = current["ended"]
        productive = sum(r["step_time_s"] for r in steps_of[i])
        saves = sum(e["seconds"] for e in current["events"] if e["event"] == "save")
        preempted = next((e for e in current["events"] if e["event"] == "preempted"), None)
        if preempted:  # the save after the notice, finished (async) before the exit
            saves = max(saves, saves - _last_save(current["events"]) + preempted["save_s"])
        evals = sum(e["seconds"] for e in current["events"] if e["event"] == "eval")
        evals_before = sum(e["seconds"] for e in current["events"]
                           if e["event"] == "eval" and e["time"] <= start["time"])
        load = start.get("load_s") or 0.0
        nxt = rounds[i + 1]["start"] if i + 1 < len(rounds) else None
        twice = nxt.get("lost_s", 0.0) if nxt else 0.0
        start_up = max(0.0, start["time"] - start["started"] - load - evals_before)
        span = ended - start["started"]
        spent["productive"] += n * productive
        spent["saves_and_loads"] += n * (saves + load)
        spent["evaluation"] += n * evals
        spent["start_up"] += n * start_up
        spent["steps_trained_twice"] += n * twice
        accounted = productive + saves + load + evals + start_up + twice
        spent["restarts"] += n * max(0.0, span - accounted)
        if nxt is not None:
            gap = max(0.0, nxt["started"] - ended)
            spent["restarts"] += n * gap
            kind = ("preempted" if preempted else
                    "node lost" if (nxt.get("nodes") or n) < n else "failed")
            # the next attempts that a notice ended before their first step, then nxt
            noticed = [e for e in startup_notices
                       if start["started"] < e["time"] <= nxt["started"]]
            until = (n * max(0.0, noticed[0]["time"] - ended) if noticed
                     else _until_trained(ended, nxt, n))
            interruptions.append({
                "kind": kind, "at": ended,
                "step": preempted["step"] if preempted else current["last_step"],
                "steps_lost": nxt.get("lost_steps", 0),
                "node_seconds": round(n * twice + until, 1),
            })
            interruptions += _startup_interruptions(noticed, nxt, n)
    spent["idle_nodes"] = max(0.0, paid - sum(spent.values()))
    price = node_hourly_price / 3600 if node_hourly_price else 0.0
    return {
        "paid_node_s": round(paid, 1),
        "goodput": round(spent["productive"] / paid, 4) if paid else None,
        "node_s": {k: round(v, 1) for k, v in spent.items()},
        "cost_usd": ({k: round(v * price, 2) for k, v in spent.items()}
                     | {"paid": round(paid * price, 2)}) if price else None,
        "interruptions": interruptions,
        "preemptions": len(preemptions(history)),
        "rounds": len(rounds),
    }


def _rounds(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each round: its start event, the events of its processes' lifetime (from their start to
    the next round's), the step it reached and when it ended (its last event)."""
    rounds = [{"start": e, "events": [], "last_step": e.get("resumed_from_step") or 0}
              for e in history if e["event"] == "start"]
    for event in history:
        if event["event"] == "start" or event.get("before_first_step"):
            continue  # a notice before a round's first step: between two rounds
        owners = [r for r in rounds if r["start"]["started"] < event["time"]]
        if owners:
            owners[-1]["events"].append(event)
            if event.get("step") is not None:
                owners[-1]["last_step"] = max(owners[-1]["last_step"], event["step"])
    for current in rounds:
        current["ended"] = max([current["start"]["time"],
                                *(e["time"] for e in current["events"])])
    return rounds


def _until_trained(at: float, nxt: dict[str, Any], n: int) -> float:
    """Node-seconds from `at` until the round `nxt` starts (n nodes) and trains (its own)."""
    return n * max(0.0, nxt["started"] - at) + (nxt.get("nodes") or n) * (
        max(0.0, nxt["time"] - nxt["started"]) + (nxt.get("load_s") or 0.0))


def _startup_interruptions(noticed: list[dict[str, Any]], nxt: dict[str, Any],
                           n: int) -> list[dict[str, Any]]:
    """The notices before a round's first step that came before the round `nxt`: each costs
    until the next attempt (the next of them, or `nxt` trained), at the step `nxt` resumes."""
    step = nxt.get("resumed_from_step") or 0
    ends = [e["time"] for e in noticed]
    costs = [n * max(0.0, later - at) for at, later in zip(ends, ends[1:], strict=False)]
    costs += [_until_trained(ends[-1], nxt, n)] if ends else []
    return [{"kind": "preempted", "at": at, "step": step, "steps_lost": 0,
             "node_seconds": round(cost, 1), "before_first_step": True}
            for at, cost in zip(ends, costs, strict=True)]


def _steps_by_round(rounds: list[dict[str, Any]],
                    kept_steps: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Each kept step in the round that trained it: the last one whose first step began no
    later than this step began (a step's record is written at its end)."""
    by_round: list[list[dict[str, Any]]] = [[] for _ in rounds]
    for record in kept_steps:
        began = record["time"] - record["step_time_s"]
        owners = [i for i, r in enumerate(rounds) if r["start"]["time"] <= began + 1e-6]
        if owners:
            by_round[owners[-1]].append(record)
    return by_round


def _last_save(events: list[dict[str, Any]]) -> float:
    saves = [e["seconds"] for e in events if e["event"] == "save"]
    return saves[-1] if saves else 0.0
