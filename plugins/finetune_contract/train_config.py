"""The trainer's config, `TrainConfig`: a frozen dataclass of the parameter table's trainer fields
(finetune_contract.parameters), each with its declared type and default, checked field by field
when it is made. An optional text (declared default "") is None here when not set.

The trainer builds it from the JSON a target hands it (trainer/config.py); validate builds the
same from the run config (finetune.trainer_config) and runs the same rules (rules.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from finetune_contract.fields import DEMO_DATASET, DEMO_PREFERENCES, ContractError
from finetune_contract.parameters import TRAINER_PARAMETERS, Parameter


def method_dataset(method: str, dataset: str) -> str:
    """The data set a run of `method` reads: the demo's follows the method (instructions for
    sft, preference pairs for dpo), any other is the one given."""
    return DEMO_PREFERENCES if method == "dpo" and dataset == DEMO_DATASET else dataset


class _TrainConfig:
    """Everything the trainer needs: one field per trainer parameter of the parameter table
    (finetune_contract.parameters), whose defaults are the local demo's (tiny-llama on the
    demo data). Made, it coerces each value to its field's type (strings from the command
    line parsed) and raises ContractError naming every field that is refused."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dataset", method_dataset(self.method, self.dataset))
        errors: list[tuple[str, str]] = []
        for parameter in TRAINER_PARAMETERS:
            try:
                value = parameter.coerce(getattr(self, parameter.name))
            except ValueError as exc:
                errors.append((parameter.name, str(exc)))
                continue
            object.__setattr__(self, parameter.name, value)
            problem = parameter.problem(value)
            if problem:
                errors.append((parameter.name, problem))
        if errors:
            raise ContractError(errors, "invalid trainer config")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _field(parameter: Parameter) -> tuple[str, Any, dataclasses.Field]:
    if parameter.optional:
        return parameter.name, str | None, dataclasses.field(default=None)
    return parameter.name, parameter.type, dataclasses.field(default=parameter.default)


TrainConfig = dataclasses.make_dataclass(
    "TrainConfig", [_field(p) for p in TRAINER_PARAMETERS], bases=(_TrainConfig,), frozen=True,
    namespace={"__module__": __name__, "__doc__": _TrainConfig.__doc__})


def field_names() -> tuple[str, ...]:
    return tuple(field.name for field in dataclasses.fields(TrainConfig))
