"""Which failures of the eks target's stages Airflow retries. A retry is for a try lost with its
worker or scheduler, or an error that may pass (a throttled or unreachable API); a definite
verdict (capacity that did not come, a device plugin missing, pods that cannot be scheduled, a
node group or image that is not what the run needs, a training that failed) fails the task at
once (`targets.base.VERDICTS`), so teardown gives the nodes back now instead of after five
retries that find the same."""

from __future__ import annotations

import ast
import builtins
import datetime
import functools
import importlib
import inspect
import typing
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowFailException

from finetune.config import ConfigError
from finetune.operators import StageOperator
from finetune.targets.base import VERDICTS, StageFailed, TrainingFailed
from finetune.targets.eks.target import EksTarget
from tests.support import REPO_ROOT
from tests.support.deferral import task_outcome
from tests.support.eks import eks_config, stage_operator

SCANNED = [*sorted((REPO_ROOT / "plugins/finetune/targets/eks").glob("*.py")),
           REPO_ROOT / "plugins/finetune/preflight_verdict.py"]

# The errors the eks target raises that are no verdict, (module, function, exception): why a
# retry may get past it (or why it cannot happen to a validated run). Any other raise must be
# a verdict: a new one fails this test until it is classified.
NOT_VERDICTS = {
    ("nodegroup", "reconcile_scaling", "RuntimeError"):
        "other runs kept changing the reservations: the next try sizes from the latest",
    ("job", "start_job", "RuntimeError"): "an earlier job of the run still being deleted",
    ("target", "teardown", "RuntimeError"): "teardown's steps are idempotent: a retry ends them",
    ("target", "release", "RuntimeError"): "as teardown's",
    ("rendezvous", "request", "EtcdError"): "etcd's answer through the API server's proxy",
    ("rendezvous", "restart_etcd", "TimeoutError"): "etcd's new pod may be slow to be Ready",
    ("manifests", "parse_volumes", "ValueError"): "validate refuses these values first",
    ("manifests", "parse_node_selector", "ValueError"): "validate refuses these values first",
    ("registry", "pack_context", "ValueError"): "a caller's mistake: no builder asks for it",
    ("triggers", "poll", "NotImplementedError"): "abstract",
    ("triggers", "done", "NotImplementedError"): "abstract",
    ("triggers", "timed_out", "NotImplementedError"): "abstract",
}


def raised_errors(path: Path) -> list[tuple[str, str, type]]:
    """(module, function, exception class) of each `raise X(...)` (or `raise X`) in the file;
    a function that returns the error to raise (`raise preflight_failure(...)`) counts as its
    return annotation. A bare `raise` or `raise exc` passes on what was caught (an API's
    error)."""
    module_name = ".".join(path.relative_to(REPO_ROOT / "plugins").with_suffix("").parts)
    module = importlib.import_module(module_name)
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, child.name)
                continue
            if isinstance(child, ast.Raise) and child.exc is not None:
                called = isinstance(child.exc, ast.Call)
                first, *rest = ast.unparse(child.exc.func if called else child.exc).split(".")
                made = functools.reduce(getattr, rest, vars(module).get(first) or
                                        getattr(builtins, first, None))
                if called and not inspect.isclass(made):
                    made = typing.get_type_hints(made)["return"]
                if inspect.isclass(made):  # not `raise exc`: what was caught goes on
                    found.append((module_name.rsplit(".", 1)[-1], function, made))
            visit(child, function)

    visit(ast.parse(path.read_text()), "<module>")
    return found


def test_every_error_the_eks_target_raises_is_a_verdict_or_one_a_retry_may_get_past():
    raised = [r for path in SCANNED for r in raised_errors(path)]
    assert len(raised) > 30  # the scan sees them
    unclassified = [f"{module}.{function} raises {error.__name__}"
                    for module, function, error in raised
                    if not issubclass(error, VERDICTS)
                    and (module, function, error.__name__) not in NOT_VERDICTS]
    assert unclassified == [], (
        "a verdict (what a retry would find again) must raise a targets.base.StageFailed; an "
        "error a retry may get past must be named in NOT_VERDICTS, saying why")
    stale = set(NOT_VERDICTS) - {(m, f, e.__name__) for m, f, e in raised}
    assert stale == set()


@pytest.mark.parametrize("error", [StageFailed("only 0 of 2 node(s) are Ready"),
                                   TrainingFailed("worker 1 OOMKilled"),
                                   ConfigError([("dataset", "is empty")])])
def test_a_stages_verdict_fails_its_task_without_a_retry(monkeypatch, error):
    def verdict(self, cfg):
        raise error

    monkeypatch.setattr(EksTarget, "scale_up", verdict)
    with pytest.raises(AirflowFailException) as failed:
        stage_operator("scale_up", eks_config()).execute({})
    assert str(failed.value) == str(error)


def test_an_error_a_retry_may_get_past_is_raised_as_it_is(monkeypatch):
    def lost(self, cfg):
        raise ConnectionError("the API server went away")

    monkeypatch.setattr(EksTarget, "scale_up", lost)
    with pytest.raises(ConnectionError):
        stage_operator("scale_up", eks_config()).execute({})


@pytest.mark.slow  # Airflow's task runner: its first call loads the plugins (about 10 s)
def test_airflow_fails_a_verdict_at_once_and_retries_an_error_that_may_pass(monkeypatch):
    from airflow.sdk import DAG

    outcomes = {}
    for error in (StageFailed("the capacity did not come"), ConnectionError("lost")):
        def fails(self, cfg, error=error):
            raise error

        monkeypatch.setattr(EksTarget, "scale_up", fails)
        with DAG("verdicts", schedule=None, start_date=datetime.datetime(2026, 1, 1)):
            task = StageOperator(task_id="scale_up", stage="scale_up",
                                 run_config=eks_config().to_dict(), retries=5)
        outcomes[type(error).__name__] = task_outcome(task, tries_left=True)
    assert outcomes == {"StageFailed": "failed", "ConnectionError": "up_for_retry"}
