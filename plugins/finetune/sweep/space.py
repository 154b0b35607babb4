"""A sweep's search space (the `sweep_space` parameter, JSON) -> each trial's values: a grid, a
list of confs, or random samples of ranges drawn with a seed. Every problem is named as
`sweep_space` or `sweep_space.<field>`, all at once (finetune.config.ConfigError).

    {"grid": {"lr": [0.001, 0.003], "lora_rank": [8, 16]}}        every combination, in order
    {"trials": [{"lr": 0.001}, {"seq_len": 256, "lr": 0.003}]}    these confs
    {"random": {"lr": {"log_uniform": [1e-4, 1e-2]},              sweep_max_trials samples
                "warmup_steps": {"int_uniform": [0, 20]},
                "lora_rank": {"choice": [8, 16]}}}

A field may vary when it is a form parameter of a run that does not decide where the sweep
runs or what its winner is measured on (`SHARED_FIELDS`: every trial has the sweep's value).
Each value is checked against its parameter here; each trial as a whole is validated after
(finetune.sweep.trials).
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Mapping
from typing import Any

from finetune.config import ConfigError
from finetune_contract.fields import quoted
from finetune_contract.parameters import BY_NAME, FORM_PARAMETERS, SWEEP_PARAMETERS, Parameter

FIELD = "sweep_space"
KINDS = ("grid", "trials", "random")
DISTRIBUTIONS = ("uniform", "log_uniform", "int_uniform", "choice")
# What every trial shares: where the sweep runs (its target, cluster, node group, output), a
# node's processes (the nodes are the sweep's), the preset, and what the winner is promoted on.
SHARED_FIELDS = frozenset(
    {p.name for p in FORM_PARAMETERS if p.section in ("Where to run", "EKS")}
    | {"preset", "output_dir", "procs_per_node", "rdzv_endpoint", "promotion_metric",
       "promotion_margin", "node_hourly_price"})
# A sampled real number is kept to this many significant digits (readable trial names).
SIGNIFICANT_DIGITS = 4

Problems = list[tuple[str, str]]


def expand_space(text: str, max_trials: int, seed: int) -> list[dict[str, Any]]:
    """Each trial's values (overrides of the sweep's conf), in trial order; ConfigError naming
    every problem of the space."""
    if not text.strip():
        raise ConfigError([(FIELD, 'is empty: give the fields to vary, e.g. {"grid": {"lr": '
                            '[0.001, 0.003]}} (docs/user-guide.md, Sweeps)')])
    try:
        space = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError([(FIELD, f"is not JSON: {exc}")]) from None
    kinds = [kind for kind in KINDS if isinstance(space, dict) and kind in space]
    if not isinstance(space, dict) or len(kinds) != 1 or len(space) != 1:
        raise ConfigError([(FIELD, "must be a JSON object with one of " + ", ".join(
            f'"{kind}"' for kind in KINDS) + " (got " + (", ".join(
                quoted(k) for k in space) if isinstance(space, dict) and space else
                f"a JSON {type(space).__name__}") + ")")])
    kind = kinds[0]
    trials, errors = {"grid": _grid, "trials": _listed, "random": _sampled}[kind](
        space[kind], max_trials, seed)
    if errors:
        raise ConfigError(errors)
    return trials


def _field_problems(name: Any) -> str | None:
    """Why `name` cannot vary across trials, or None."""
    if not isinstance(name, str) or name not in BY_NAME:
        return "unknown parameter; a trial may vary the form's fields: " + ", ".join(
            sorted(p.name for p in FORM_PARAMETERS if p.name not in SHARED_FIELDS))
    if BY_NAME[name] in SWEEP_PARAMETERS:
        return "a setting of the sweep itself, not of a trial"
    if not BY_NAME[name].form:
        return "set by the pipeline, not by a conf"
    if name in SHARED_FIELDS:
        return ("every trial shares it (where the sweep runs and what its winner is promoted "
                "on): set it once, outside sweep_space")
    return None


def _value_problem(p: Parameter, value: Any) -> str | None:
    if p.type is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    return p.type_problem(value) or p.problem(value)


def _where(name: Any) -> str:
    return f"{FIELD}.{str(name)[:64]}"


def _values_problems(name: str, values: Any, what: str) -> Problems:
    problem = _field_problems(name)
    if problem:
        return [(_where(name), problem)]
    if not isinstance(values, list) or not values:
        return [(_where(name), f"{what} must be a non-empty JSON list of values")]
    p = BY_NAME[name]
    return [(_where(name), f"value {i + 1} of {what} ({p.shown(value)}): {problem}")
            for i, value in enumerate(values) if (problem := _value_problem(p, value))]


def _grid(grid: Any, max_trials: int, seed: int) -> tuple[list[dict[str, Any]], Problems]:
    if not isinstance(grid, dict) or not grid:
        return [], [(f"{FIELD}.grid", "must be a JSON object of field: [values]")]
    errors = [e for name, values in grid.items()
              for e in _values_problems(name, values, "the grid")]
    if errors:
        return [], errors
    size = math.prod(len(values) for values in grid.values())
    if size > max_trials:
        return [], [(FIELD, f"the grid has {size} combinations, more than sweep_max_trials "
                     f"{max_trials}: raise sweep_max_trials or vary fewer values")]
    names = list(grid)
    return [dict(zip(names, combination, strict=True))
            for combination in itertools.product(*grid.values())], []


def _listed(trials: Any, max_trials: int, seed: int) -> tuple[list[dict[str, Any]], Problems]:
    if not isinstance(trials, list) or not trials:
        return [], [(f"{FIELD}.trials", "must be a non-empty JSON list of objects")]
    if len(trials) > max_trials:
        return [], [(FIELD, f"lists {len(trials)} trials, more than sweep_max_trials "
                     f"{max_trials}: raise sweep_max_trials or list fewer")]
    errors: Problems = []
    for i, trial in enumerate(trials):
        if not isinstance(trial, dict):
            errors.append((f"{FIELD}.trials", f"trial {i} is not a JSON object"))
            continue
        errors += [e for name, value in trial.items()
                   for e in _values_problems(name, [value], f"trial {i}")]
    return ([dict(t) for t in trials] if not errors else []), errors


def _sampled(ranges: Any, max_trials: int, seed: int) -> tuple[list[dict[str, Any]], Problems]:
    if not isinstance(ranges, dict) or not ranges:
        return [], [(f"{FIELD}.random", "must be a JSON object of field: {distribution: "
                     "arguments}")]
    errors: Problems = []
    for name, spec in ranges.items():
        errors += _distribution_problems(name, spec)
    if errors:
        return [], errors
    rng = random.Random(seed)
    trials = [{name: _draw(rng, BY_NAME[name], spec) for name, spec in ranges.items()}
              for _ in range(max_trials)]
    for i, trial in enumerate(trials):  # a range wider than the parameter's bounds
        errors += [(_where(name), f"sample {i} ({BY_NAME[name].shown(value)}): {problem}")
                   for name, value in trial.items()
                   if (problem := _value_problem(BY_NAME[name], value))]
    return trials if not errors else [], errors[:5]


def _distribution_problems(name: str, spec: Any) -> Problems:
    problem = _field_problems(name)
    if problem:
        return [(_where(name), problem)]
    p = BY_NAME[name]
    if not isinstance(spec, Mapping) or len(spec) != 1 or next(iter(spec)) not in DISTRIBUTIONS:
        return [(_where(name), "must be one distribution: " + ", ".join(
            f'{{"{d}": {"[values]" if d == "choice" else "[low, high]"}}}'
            for d in DISTRIBUTIONS))]
    kind, args = next(iter(spec.items()))
    if kind == "choice":
        return _values_problems(name, args, "the choice")
    if p.type not in (int, float):
        return [(_where(name), f"{kind} needs a number parameter; {name} takes choice")]
    if kind == "int_uniform" and p.type is not int:
        return [(_where(name), "int_uniform needs an integer parameter; use uniform or "
                 "log_uniform")]
    if not (isinstance(args, list) and len(args) == 2
            and all(isinstance(a, int | float) and not isinstance(a, bool)
                    and math.isfinite(a) for a in args) and args[0] < args[1]):
        return [(_where(name), f"{kind} takes [low, high], two numbers with low < high")]
    if kind == "log_uniform" and args[0] <= 0:
        return [(_where(name), "log_uniform takes a low above 0")]
    return []


def _draw(rng: random.Random, p: Parameter, spec: Mapping[str, Any]) -> Any:
    kind, args = next(iter(spec.items()))
    if kind == "choice":
        return rng.choice(args)
    if kind == "int_uniform":
        return rng.randint(int(args[0]), int(args[1]))
    low, high = float(args[0]), float(args[1])
    if kind == "log_uniform":
        value = math.exp(rng.uniform(math.log(low), math.log(high)))
    else:
        value = rng.uniform(low, high)
    return round(value) if p.type is int else float(f"{value:.{SIGNIFICANT_DIGITS}g}")
