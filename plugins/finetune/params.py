"""The trigger form: an Airflow `Param` per form parameter of the contract's table
(finetune_contract.parameters), with its JSON schema, so the form itself refuses a value of the
wrong type, outside its bounds or choices, or a text too long or with characters its rule
refuses; and the form's notes on what the presets set."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from finetune_contract.parameters import (
    FORM_PARAMETERS,
    SWEEP_PARAMETERS,
    Parameter,
    defaults,
)
from finetune_contract.presets import PRESETS

# The draft the schemas are checked against. Airflow checks a Param's schema each time it
# resolves the Param, and a serialization of a DAG (each parse by the DAG processor) resolves every
# task's copy of every Param twice: 2,834 for llm_finetune, 4,140 for the sweep
# (`python -m bench.dag_parse`). Draft-07's metaschema checks 4x faster than the newest
# (2020-12, the default without "$schema"); the keywords below mean the same in both, and
# Airflow's own serialization schema is draft-07.
JSON_SCHEMA_DRAFT = "http://json-schema.org/draft-07/schema#"


def dag_params(sweep: bool = False) -> dict[str, Any]:
    """The trigger form's Params; sweep: the sweep DAG's, the sweep's own fields first."""
    from airflow.sdk import Param

    shown = (*SWEEP_PARAMETERS, *FORM_PARAMETERS) if sweep else FORM_PARAMETERS
    return {p.name: Param(p.default, **param_schema(p)) for p in shown}


def param_schema(p: Parameter) -> dict[str, Any]:
    """JSON schema keywords for the parameter's `Param` (and so the trigger form)."""
    # An optional text may be left empty: the form sends null for it, and marks a plain
    # "string" field required.
    out: dict[str, Any] = {"$schema": JSON_SCHEMA_DRAFT,
                           "type": [p.json_type, "null"] if p.optional else p.json_type,
                           "title": p.title, "section": p.section}
    if p.name == "preset":  # Markdown: the rule, and each preset's values
        out["description_md"] = presets_markdown(defaults())
    else:
        out["description"] = p.description + preset_values_note(p.name, p.default)
    if p.choices is not None:
        out["enum"] = list(p.choices)
    if p.display:
        out["values_display"] = dict(p.display)
    if p.bounds is not None:
        for key, value in (("minimum", p.bounds.minimum), ("maximum", p.bounds.maximum),
                           ("exclusiveMinimum", p.bounds.exclusive_minimum)):
            if value is not None:
                out[key] = value
    # A secret's text rule stays with validate: the schema's error would quote the value.
    if p.text is not None and not p.secret:
        out["maxLength"] = p.text.max_length
        # JSON schema's pattern matches anywhere: anchored, as the rule's fullmatch; empty
        # where the text may be empty ("not set").
        out["pattern"] = f"^(?:{p.text.pattern})" + ("$" if p.required else "?$")
    if p.required:
        out["minLength"] = 1
    return out


def _preset_value_text(value: Any) -> str:
    return "on" if value is True else "off" if value is False else str(value)


def preset_values_note(field: str, default: Any) -> str:
    """For a field's description in the form: the values the presets give it, which a run with
    that preset uses while the field stays at its built-in default. Empty when no preset
    changes the field."""
    by_value: dict[str, list[str]] = {}
    for preset in PRESETS.values():
        if field in preset.values and preset.values[field] != default:
            by_value.setdefault(_preset_value_text(preset.values[field]), []).append(preset.name)
    if not by_value:
        return ""
    values = "; ".join(f"{value} ({', '.join(names)})" for value, names in by_value.items())
    return (f" With a preset, leaving this at its default ({_preset_value_text(default)}) "
            f"runs the preset's value: {values}.")


def presets_markdown(form_defaults: Mapping[str, Any]) -> str:
    """The preset field's description in the form (Markdown): the rule, and what each preset
    sets where it differs from the built-in defaults the form's fields show."""
    lines = [
        "Settings known to fit a model on an instance type "
        "(`plugins/finetune_contract/presets.py`).",
        "",
        "**A field left at its built-in default takes the preset's value; change a field to "
        "override the preset.** The fields below keep showing the built-in defaults; with a "
        "preset the run uses these values instead (the validate task's log lists every value "
        "the run uses):",
        "",
    ]
    for preset in PRESETS.values():
        changed = ", ".join(f"{field} **{_preset_value_text(value)}**"
                            for field, value in preset.values.items()
                            if value != form_defaults.get(field))
        lines.append(f"- `{preset.name}`: {changed}")
    return "\n".join(lines)


