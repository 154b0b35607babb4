"""What the tests need from outside the clone is found, or skipped with how to get it, in one
place (tests/support/system.py, and schemas.py for the CRDs); where CI requires everything
(FINETUNE_REQUIRE_SYSTEM_DEPS=1) a missing one fails instead."""

from __future__ import annotations

import ast

import pytest

from tests.support import REPO_ROOT, schemas
from tests.support.system import REQUIRE_ENV, missing_dependency

TESTS = REPO_ROOT / "tests"
# The modules that may look outside the clone: they skip or fail as missing_dependency says.
LOOKERS = {TESTS / "support" / "system.py", TESTS / "support" / "schemas.py"}
# Programs installed into the virtualenv (requirements-dev.txt) are inside the clone.
VENV_PROGRAMS = {TESTS / "support" / "aws.py"}  # moto_server


def outside_lookups(path) -> list[str]:
    """Each place in a test file that reaches outside the clone by itself."""
    problems = []
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
                  and ast.get_docstring(n) is not None}
    for node in ast.walk(tree):
        where = f"{path.relative_to(REPO_ROOT)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Call):
            called = ast.unparse(node.func)
            if called in ("shutil.which", "which") and path not in VENV_PROGRAMS:
                problems.append(f"{where}: {called}() (use tests.support.system)")
            if called.endswith("etcd_binary"):
                problems.append(f"{where}: etcd_binary() (use etcd_or_skip or has_etcd)")
        if isinstance(node, ast.Attribute) and node.attr in ("parent", "parents") and \
                ast.unparse(node.value) == "REPO_ROOT":
            problems.append(f"{where}: REPO_ROOT.{node.attr}, outside the clone")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                id(node) not in docstrings and (
                "../shared" in node.value or "k8s-schemas" in node.value):
            problems.append(f"{where}: {node.value[:60]!r}")
    return problems


def test_no_test_reaches_outside_the_clone_except_through_tests_support():
    files = sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)
    problems = [problem for path in files if path not in LOOKERS
                and path != TESTS / "test_outside_dependencies.py"
                for problem in outside_lookups(path)]
    assert not problems, "\n".join(problems)


def test_a_missing_dependency_skips_saying_how_to_get_it_and_fails_where_required(monkeypatch):
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="thing is missing. Get it so"):
        missing_dependency("thing is missing", "Get it so")
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=f"{REQUIRE_ENV}=1: required here"):
        missing_dependency("thing is missing", "Get it so")


def test_crd_schemas_are_found_through_the_environment_or_skip_naming_every_file(
        tmp_path, monkeypatch):
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    monkeypatch.setenv(schemas.SCHEMAS_ENV, str(tmp_path))
    with pytest.raises(pytest.skip.Exception) as skipped:
        schemas.crd_file("kubeflow.org_pytorchjobs.yaml")
    message = str(skipped.value)
    assert str(tmp_path) in message and schemas.SCHEMAS_ENV in message
    for file, (resource, url) in schemas.CRDS.items():
        assert file in message and f"kubectl get crd {resource} -o yaml" in message and \
            url in message
    (tmp_path / "kubeflow.org_pytorchjobs.yaml").write_text("kind: CustomResourceDefinition\n")
    assert schemas.crd_file("kubeflow.org_pytorchjobs.yaml") == \
        tmp_path / "kubeflow.org_pytorchjobs.yaml"
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="trainer.kubeflow.org_trainjobs.yaml"):
        schemas.crd_file("trainer.kubeflow.org_trainjobs.yaml")
