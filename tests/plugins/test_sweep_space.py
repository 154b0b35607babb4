"""A sweep's search space (finetune.sweep.space): a grid, a list of confs and random samples of
ranges with a seed become each trial's values; every problem is named as sweep_space or
sweep_space.<field>, all at once."""

from __future__ import annotations

import json
import math

import pytest

from finetune.config import ConfigError
from finetune.sweep.space import expand_space


def space(kind: str, value) -> str:
    return json.dumps({kind: value})


def problems(text: str, max_trials: int = 8) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as err:
        expand_space(text, max_trials, seed=0)
    return err.value.errors


def test_a_grid_is_every_combination_in_order():
    trials = expand_space(space("grid", {"lr": [0.001, 0.003], "lora_rank": [8, 16]}), 8, 0)
    assert trials == [{"lr": 0.001, "lora_rank": 8}, {"lr": 0.001, "lora_rank": 16},
                      {"lr": 0.003, "lora_rank": 8}, {"lr": 0.003, "lora_rank": 16}]


def test_a_list_is_its_confs_and_an_empty_one_is_the_base_conf():
    assert expand_space(space("trials", [{}, {"seq_len": 256, "lr": 0.01}]), 8, 0) == \
        [{}, {"seq_len": 256, "lr": 0.01}]


def test_random_samples_are_the_budget_drawn_again_the_same_with_the_same_seed():
    ranges = {"lr": {"log_uniform": [1e-5, 1e-1]}, "warmup_steps": {"int_uniform": [0, 20]},
              "lora_rank": {"choice": [8, 16]}, "weight_decay": {"uniform": [0.0, 0.1]}}
    first = expand_space(space("random", ranges), 40, seed=7)
    assert first == expand_space(space("random", ranges), 40, seed=7)
    assert first != expand_space(space("random", ranges), 40, seed=8)
    assert len(first) == 40
    rates = [t["lr"] for t in first]
    assert all(1e-5 <= r <= 1e-1 for r in rates)
    # log-uniform: about as many samples in each decade
    decades = [sum(1 for r in rates if 10 ** -k <= r < 10 ** -(k - 1)) for k in (5, 4, 3, 2)]
    assert min(decades) >= 4, decades
    assert all(isinstance(t["warmup_steps"], int) and 0 <= t["warmup_steps"] <= 20
               for t in first)
    assert {t["lora_rank"] for t in first} == {8, 16}
    assert all(0.0 <= t["weight_decay"] <= 0.1 for t in first)


@pytest.mark.parametrize(("text", "expected"), [
    ("", [("sweep_space", "is empty")]),
    ("{", [("sweep_space", "is not JSON")]),
    ('["lr"]', [("sweep_space", "must be a JSON object with one of")]),
    ('{"grid": {}, "trials": []}', [("sweep_space", "must be a JSON object with one of")]),
    (space("grid", {"lr": [0.001, 2.0]}), [("sweep_space.lr", "value 2 of the grid (2.0)")]),
    (space("grid", {"learning_rate": [0.001]}), [("sweep_space.learning_rate",
                                                  "unknown parameter")]),
    (space("grid", {"target": ["eks"]}), [("sweep_space.target", "every trial shares it")]),
    (space("grid", {"sweep_parallel": [1]}), [("sweep_space.sweep_parallel",
                                               "a setting of the sweep itself")]),
    (space("grid", {"lr": 0.001}), [("sweep_space.lr", "must be a non-empty JSON list")]),
    (space("grid", {"lr": [0.001, 0.002, 0.003], "seed": [1, 2, 3]}),
     [("sweep_space", "the grid has 9 combinations, more than sweep_max_trials 8")]),
    (space("trials", [{"lr": 0.001}, {"micro_batch": "big"}]),
     [("sweep_space.micro_batch", "value 1 of trial 1 ('big')")]),
    (space("random", {"lr": {"log_uniform": [0, 0.1]}}), [("sweep_space.lr",
                                                          "log_uniform takes a low above 0")]),
    (space("random", {"lr": {"int_uniform": [1, 3]}}), [("sweep_space.lr",
                                                        "int_uniform needs an integer")]),
    (space("random", {"lr": {"gauss": [1, 3]}}), [("sweep_space.lr",
                                                  "must be one distribution")]),
    (space("random", {"seq_len": {"uniform": [3, 20]}}), [("sweep_space.seq_len", "sample ")]),
])
def test_a_bad_space_is_refused_naming_where(text, expected):
    found = problems(text)
    assert [field for field, _ in found] == [field for field, _ in expected]
    for (_, message), (_, start) in zip(found, expected, strict=True):
        assert start in message, message


def test_every_bad_field_of_a_space_is_named_at_once():
    found = problems(space("grid", {"lr": [5], "warmup_steps": [-1], "nodes": ["x"]}))
    assert [field for field, _ in found] == ["sweep_space.lr", "sweep_space.warmup_steps",
                                             "sweep_space.nodes"]


def test_a_sampled_real_number_keeps_four_significant_digits():
    [trial] = expand_space(space("random", {"lr": {"log_uniform": [1e-4, 1e-2]}}), 1, 3)
    assert trial["lr"] == float(f"{trial['lr']:.4g}") and not math.isnan(trial["lr"])
