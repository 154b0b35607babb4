"""bench.dag_parse: the DAG processor's work on this project's DAG files, timed."""

from __future__ import annotations

import re

import pytest

from bench import dag_parse


@pytest.mark.slow
def test_the_dag_parse_bench_times_every_dag_and_counts_its_param_resolutions(capsys):
    assert dag_parse.main(["--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^parse of dags/: [\d.]+ s, 3 DAGs, 0 import errors$", out, re.M), out
    lines = {m[1]: (int(m[2]), int(m[3]), int(m[4])) for m in re.finditer(
        r"^(\S+): (\d+) params, (\d+) tasks, serialize \d+ ms \(median of 1\), (\d+) Param "
        r"resolutions$", out, re.M)}
    assert set(lines) == {"llm_finetune", "llm_finetune_scheduled", "llm_finetune_sweep"}, out
    params, tasks, resolutions = lines["llm_finetune"]
    assert params > 100 and resolutions >= params * tasks  # each task's copy, at least once
    assert lines["llm_finetune_scheduled"][0] == 0  # its values come from a Variable
