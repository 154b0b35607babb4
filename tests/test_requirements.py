"""The requirement files: a package pinned in two of them has one pin, and requirements.txt (what
an Airflow deployment installs: docs/deploy.md) installs every package the Airflow side imports.

A new import in plugins/ or dags/ of a package that only the trainer's or the tests'
requirements bring fails here, not as a ModuleNotFoundError in a deployed worker's task."""

from __future__ import annotations

import ast
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support import REPO_ROOT

REQUIREMENT_FILES = [REPO_ROOT / "requirements.txt", REPO_ROOT / "requirements-dev.txt",
                     REPO_ROOT / "trainer" / "requirements.txt"]
AIRFLOW_SIDE = [REPO_ROOT / "plugins", REPO_ROOT / "dags"]
FIRST_PARTY = {"finetune", "finetune_contract", "finetune_data", "finetune_runs_plugin"}


def requirements(path: Path) -> list[Requirement]:
    """The packages a requirements file names itself (not those of the files it includes)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line and not line.startswith("-")]


def installed_by(names: set[str]) -> set[str]:
    """The distributions that installing `names` brings: them and their dependencies, as the
    installed metadata declares them (markers evaluated here, no extras)."""
    seen: set[str] = set()
    todo = [canonicalize_name(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return seen


def optional(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """An import inside a try whose handler takes ImportError: the code works without it."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.Try) and any(
                h.type is not None and {"ImportError", "ModuleNotFoundError"} & {
                    ast.unparse(t) for t in (h.type.elts if isinstance(h.type, ast.Tuple)
                                             else [h.type])}
                for h in node.handlers):
            return True
    return False


def required_imports(root: Path) -> dict[str, str]:
    """Each top-level module imported under `root`, anywhere in a module (lazy imports too) and
    not as an optional one: {module: the first place that imports it}."""
    found: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            if optional(node, parents):
                continue
            shown = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
            for name in names:
                found.setdefault(name.split(".")[0], f"{shown}:{node.lineno}")
    return found


def test_a_package_pinned_in_two_requirement_files_has_the_same_pin_in_both():
    pins: dict[str, dict[str, str]] = {}
    for path in REQUIREMENT_FILES:
        for req in requirements(path):
            pins.setdefault(canonicalize_name(req.name), {})[
                str(path.relative_to(REPO_ROOT))] = str(req.specifier)
    assert {name: where for name, where in pins.items() if len(set(where.values())) > 1} == {}
    assert all(str(req.specifier).startswith("==") for path in REQUIREMENT_FILES
               for req in requirements(path)), "every requirement is pinned"


def test_requirements_txt_installs_every_package_the_airflow_side_imports():
    installed = installed_by({req.name for req in requirements(REPO_ROOT / "requirements.txt")})
    providers = metadata.packages_distributions()
    missing = []
    for root in AIRFLOW_SIDE:
        for module, where in required_imports(root).items():
            if module in sys.stdlib_module_names or module in FIRST_PARTY:
                continue
            dists = {canonicalize_name(d) for d in providers.get(module, [])}
            if not dists & installed:
                missing.append(f"{module} ({where}; from {sorted(dists) or 'nothing installed'})")
    assert missing == []


def test_the_scan_sees_lazy_imports_and_leaves_out_optional_ones(tmp_path):
    (tmp_path / "m.py").write_text(
        "import json\n"
        "def f():\n    import torch.nn\n"
        "try:\n    import pynvml\nexcept ImportError:\n    pynvml = None\n"
        "try:\n    from yaml import safe_load\n"
        "except (ValueError, ModuleNotFoundError):\n    pass\n"
        "try:\n    import numpy\nexcept ValueError:\n    pass\n")
    assert set(required_imports(tmp_path)) == {"json", "torch", "numpy"}
    assert "torch" not in installed_by({"httpx"}) and "httpcore" in installed_by({"httpx"})
