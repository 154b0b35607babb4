"""A sweep's conf -> its trials, each a validated run config, before anything starts
(`validate_sweep`); and the planner's figures of every trial and their sum (`plan_rows`).

Each trial is the sweep's conf (every form field but the sweep's own) with its values from
the space (finetune.sweep.space), through the same `validate_params` a single run goes
through; a problem of trial N is named "trial N: field". The sweep's own run config (`Sweep.
config`, the first trial's with the sweep's names) is what the stages it runs once get:
snapshot, scale_up for the nodes of the trials run at once, build_image, preflight, teardown.
A trial's run directory is <sweep dir>/trial-<N>; its nodes are held by the sweep's reservation
(`node_reservation`); trials of one prepared-data group (finetune.prepare_stage.prepare_group)
share one prepare_data.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import Any

from finetune.config import ConfigError, RunConfig, run_output_dir
from finetune.names import dns_label, run_dir_name
from finetune.sweep.early_stop import first_rung, trial_rungs
from finetune.sweep.space import expand_space
from finetune.targets import get_target
from finetune.validate import validate_params
from finetune_contract.parameters import BY_NAME, FORM_PARAMETERS, SWEEP_PARAMETERS, defaults
from finetune_contract.presets import explicit_fields

log = logging.getLogger(__name__)

Problems = list[tuple[str, str]]


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A validated sweep: its own run config, its trials', each trial's values from the space,
    and each trial's prepared-data group (the index of the first trial of its group)."""

    config: RunConfig
    trials: tuple[RunConfig, ...]
    values: tuple[dict[str, Any], ...]
    groups: tuple[int, ...]

    @property
    def at_once(self) -> int:
        return min(self.config.sweep_parallel, len(self.trials))

    def to_dict(self) -> dict[str, Any]:
        """What validate_sweep hands the later tasks (XCom)."""
        return {"sweep": self.config.to_dict(), "trials": [t.to_dict() for t in self.trials],
                "values": list(self.values), "groups": list(self.groups),
                "prepare": [self.trials[i].to_dict() for i in sorted(set(self.groups))]}


def trial_run_id(run_id: str, trial: int) -> str:
    return f"{run_id}-trial-{trial}"


def trial_dir(sweep_dir: str, trial: int) -> str:
    return f"{sweep_dir.rstrip('/')}/trial-{trial}"


def sweep_settings(params: Mapping[str, Any]) -> tuple[dict[str, Any], Problems]:
    """The sweep's own fields of a conf, each checked as its parameter is declared."""
    values, errors = {}, []
    for p in SWEEP_PARAMETERS:
        value = params.get(p.name, p.default)
        if p.type is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if value is None and p.optional:
            value = ""
        if isinstance(value, str):
            value = value.strip()
        problem = p.type_problem(value) or p.problem(value)
        if problem:
            errors.append((p.name, problem))
        values[p.name] = value
    return values, errors


def validate_sweep(params: Mapping[str, Any], *, run_id: str, dag_id: str,
                   given: Mapping[str, Any] | None = None) -> Sweep:
    """The sweep's conf -> `Sweep`, or ConfigError naming every problem: the sweep's own fields,
    the space (sweep_space.<field>), each trial's ("trial N: field") and the sweep's nodes."""
    settings, errors = sweep_settings(params)
    if errors:
        raise ConfigError(errors)
    values = expand_space(settings["sweep_space"], settings["sweep_max_trials"],
                          settings["sweep_seed"])
    base = {k: v for k, v in params.items() if k not in settings}
    # What the conf set on purpose (the form sends every field: those at their built-in
    # default are not), and each trial's values on purpose whatever they are, so a preset
    # never stands in for a trial's value that equals the built-in default.
    given_base = explicit_fields({k: v for k, v in (given or {}).items() if k not in settings},
                                 defaults())
    checked: list[RunConfig | None] = []
    for i, trial_values in enumerate(values):
        try:
            cfg = validate_params({**base, **trial_values}, run_id=trial_run_id(run_id, i),
                                  dag_id=dag_id, given={**given_base, **trial_values})
        except ConfigError as exc:
            errors += [(f"trial {i}: {field}", message) for field, message in exc.errors]
            checked.append(None)
            continue
        errors += [(f"trial {i}: {field}", message)
                   for field, message in _trial_problems(cfg, settings, i)]
        checked.append(cfg)
    errors += _shared_rungs_problems([cfg for cfg in checked if cfg is not None], settings)
    if errors:
        raise ConfigError(errors)
    trials: list[RunConfig] = [cfg for cfg in checked if cfg is not None]
    at_once = min(settings["sweep_parallel"], len(trials))
    nodes = at_once * max(cfg.nodes for cfg in trials)
    errors += _nodes_problems(trials[0], nodes, at_once)
    if at_once > 1 and trials[0].etcd_reset == "restart" \
            and trials[0].target in BY_NAME["etcd_reset"].targets:
        errors.append(("etcd_reset", "restart with sweep_parallel above 1: each trial's "
                       "rendezvous would restart the etcd the trials training beside it use; "
                       "use keys (each trial's own keys deleted)"))
    if errors:
        raise ConfigError(errors)
    run_name = run_dir_name(run_id)
    first = trials[0]
    sweep_dir = run_output_dir(first.output_dir, run_name, first.target)
    sweep = dataclasses.replace(
        first, run_id=run_id, run_name=run_name, rdzv_id=dns_label(dag_id, run_id, max_len=48),
        run_dir=sweep_dir, nodes=nodes, min_nodes=0, sweep_dir=sweep_dir, sweep_trial=-1,
        **settings)
    trials = [dataclasses.replace(cfg, run_dir=trial_dir(sweep_dir, i), sweep_dir=sweep_dir,
                                  sweep_trial=i, node_reservation=sweep.rdzv_id, **settings)
              for i, cfg in enumerate(trials)]
    return Sweep(sweep, tuple(trials), tuple(values), _groups(trials))


def _trial_problems(cfg: RunConfig, settings: Mapping[str, Any], trial: int) -> Problems:
    """What a trial the run rules accept cannot do in a sweep: be judged at its rungs."""
    if settings["sweep_reduction_factor"] <= 1:
        return []
    probe = dataclasses.replace(cfg, **settings)
    first = first_rung(probe)
    if not cfg.eval_interval:
        return [("eval_interval", "0 (eval loss at start and end only): the early-stopping "
                 "rule compares the trials' eval loss at its rungs; set eval_interval, or "
                 "sweep_reduction_factor 1 to stop no trial")]
    if first % cfg.eval_interval:
        return [("eval_interval", f"{cfg.eval_interval} does not divide sweep_first_rung "
                 f"{first}: the trial measures its eval loss every eval_interval steps, and "
                 "is judged at the rungs")]
    if not trial_rungs(probe):
        log.warning("trial %d: its first rung (step %d) is not below its last step: the rule "
                    "never judges it", trial, first)
    return []


def _shared_rungs_problems(trials: list[RunConfig], settings: Mapping[str, Any]) -> Problems:
    """The rule ranks the trials that reached a rung: with sweep_first_rung 0 each trial's
    first rung is its own eval_interval, and trials whose eval_interval differ share no rung,
    so none would ever be stopped."""
    if settings["sweep_reduction_factor"] <= 1 or settings["sweep_first_rung"]:
        return []
    firsts = sorted({first_rung(dataclasses.replace(cfg, **settings)) for cfg in trials
                     if cfg.eval_interval})
    if len(firsts) <= 1:
        return []
    return [("sweep_first_rung", f"0 starts each trial's rungs at its own eval_interval, and "
             f"the trials' differ ({', '.join(map(str, firsts))}): no two would share a rung, "
             "so the rule would stop none. Set sweep_first_rung to a step every eval_interval "
             f"divides (e.g. {math.lcm(*firsts)})")]


def _nodes_problems(cfg: RunConfig, nodes: int, at_once: int) -> Problems:
    """The nodes of the trials run at once, as the target checks a run's (its cap, this
    machine's cores); a problem named as sweep_parallel's."""
    values = {p.name: getattr(cfg, p.name) for p in FORM_PARAMETERS}
    problems = get_target(cfg.target).check({**values, "nodes": nodes})
    return [("sweep_parallel", f"{at_once} trial(s) at once x {nodes // at_once} node(s) each "
             f"= {nodes} node(s): {message}")
            for field, message in problems if field in ("nodes", "procs_per_node")]


def _groups(trials: list[RunConfig]) -> tuple[int, ...]:
    """Each trial's prepared-data group: the index of the first trial with its group key."""
    from finetune.prepare_stage import prepare_group

    first_of: dict[str, int] = {}
    return tuple(first_of.setdefault(prepare_group(cfg), i) for i, cfg in enumerate(trials))


def plan_rows(trials: list[RunConfig], values: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The planner's figures of every trial (finetune.run_plan): peak memory per GPU, steps,
    wall time and cost where known; the rule may stop a trial before its plan ends."""
    from finetune.run_plan import plan_run

    rows = []
    for cfg, trial_values in zip(trials, values, strict=True):
        plan = plan_run(cfg)
        rows.append({"trial": cfg.sweep_trial, "values": trial_values,
                     "peak_gib": plan.estimate.peak_gib, "fits": plan.estimate.fits,
                     "steps": plan.steps, "wall_time_s": plan.wall_time_s,
                     "cost_usd": plan.cost_usd})
    return rows


def plan_totals(rows: list[dict[str, Any]], at_once: int) -> dict[str, Any]:
    """The sum of the trials' planned wall time and cost, and the sweep's wall time with
    `at_once` trials at a time (None where a trial's is not known)."""
    def total(key: str) -> float | None:
        known = [row[key] for row in rows]
        return sum(known) if known and all(v is not None for v in known) else None

    wall = total("wall_time_s")
    return {"trials": len(rows), "wall_time_s": wall, "cost_usd": total("cost_usd"),
            "sweep_wall_time_s": wall / at_once if wall is not None else None,
            "peak_gib": max((row["peak_gib"] for row in rows if row["peak_gib"] is not None),
                            default=None)}


def plan_table(rows: list[dict[str, Any]], totals: dict[str, Any]) -> str:
    """The validate log's lines: each trial's values and figures, and their sum."""
    def shown(value: float | None, unit: str, digits: str) -> str:
        return "n/a" if value is None else f"{value:{digits}}{unit}"

    lines = [f"  {'trial':>5}  {'peak memory/GPU':>15}  {'steps':>7}  {'wall time':>10}  "
             f"{'cost':>10}  values"]
    for row in rows:
        wall = row["wall_time_s"]
        lines.append(f"  {row['trial']:>5}  {shown(row['peak_gib'], ' GiB', '.1f'):>15}  "
                     f"{row['steps'] or 'n/a':>7}  "
                     f"{shown(wall / 3600 if wall else None, ' h', '.2f'):>10}  "
                     f"{shown(row['cost_usd'], '', ',.2f'):>10}  "
                     + (", ".join(f"{k}={v}" for k, v in row["values"].items()) or "(the conf)"))
    wall = totals["wall_time_s"]
    lines.append(f"  {'sum':>5}  {shown(totals['peak_gib'], ' GiB', '.1f'):>15}  {'':>7}  "
                 f"{shown(wall / 3600 if wall else None, ' h', '.2f'):>10}  "
                 f"{shown(totals['cost_usd'], '', ',.2f'):>10}  (peak: the largest trial's; "
                 "cost in USD at node_hourly_price, before early stopping)")
    return "\n".join(lines)
