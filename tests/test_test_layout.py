"""The test suite's layout: shared fixtures and helpers live in tests/support and are imported from
there as `tests.support.<module>`. No test file imports a test module or a conftest, loads a
conftest by path, changes sys.path (tests/conftest.py does, once), defines again a fixture that
tests/support provides, or holds a copy of one of its helpers or of tools/' (the real Airflow
and its UI in Chromium, which the tests share with the docs' screenshots)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support import REPO_ROOT

TESTS = REPO_ROOT / "tests"
SUPPORT = TESTS / "support"
TOOLS = REPO_ROOT / "tools"
ROOT_CONFTEST = TESTS / "conftest.py"
LOADERS = {"spec_from_file_location", "SourceFileLoader", "import_module", "run_path",
           "__import__", "load_source"}
# Short functions (a one-line return) are alike by chance; a copied helper is longer.
MIN_COPIED_NODES = 12


def python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def files_under_tests() -> list[Path]:
    return [p for p in python_files(TESTS) if SUPPORT not in p.parents]


def fixture_name(node: ast.AST) -> str | None:
    """The name a `@pytest.fixture` function provides, or None for any other node."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    for decorator in node.decorator_list:
        call = decorator if isinstance(decorator, ast.Call) else None
        target = call.func if call else decorator
        if ast.unparse(target) in ("pytest.fixture", "fixture"):
            named = [k.value for k in (call.keywords if call else []) if k.arg == "name"]
            return named[0].value if named and isinstance(named[0], ast.Constant) else node.name
    return None


def body_of(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The function's body without its docstring, as a layout-free dump; None when short."""
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    module = ast.Module(body=body, type_ignores=[])
    if sum(1 for _ in ast.walk(module)) < MIN_COPIED_NODES:
        return None
    return ast.dump(module)


def source_of(module: str) -> Path | None:
    """The file of a first-party module (finetune.* in plugins/, trainer.*), if any."""
    base = REPO_ROOT / "plugins" if module.split(".")[0] == "finetune" else REPO_ROOT
    path = base.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def support_provides() -> tuple[set[str], dict[str, str]]:
    """(fixture names, {helper body dump: where}) of tests/support and tools/, with the
    first-party functions tests/support re-exports (e.g. finetune.etcd.free_port)."""
    fixtures: set[str] = set()
    helpers: dict[str, str] = {}
    for path in python_files(SUPPORT) + python_files(TOOLS):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if (name := fixture_name(node)) is not None:
                fixtures.add(name)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (body := body_of(node)) is not None:
                    helpers[body] = f"{path.relative_to(REPO_ROOT)}:{node.name}"
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                origin = source_of(node.module)
                wanted = {alias.name for alias in node.names}
                if origin is None:
                    continue
                for fn in ast.walk(ast.parse(origin.read_text())):
                    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                            fn.name in wanted and (body := body_of(fn)) is not None):
                        helpers[body] = f"{node.module}.{fn.name}"
    return fixtures, helpers


FIXTURES, HELPERS = support_provides()
# What pytest's sys.path insertion would make importable by bare name: the files under tests/.
LOCAL_MODULES = {p.stem for p in files_under_tests()} | {"support"}


def import_problems(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.ImportFrom):
        if node.level:
            return [f"relative import from {'.' * node.level}{node.module or ''}"]
        modules = [node.module or ""]
        modules += [f"{node.module}.{alias.name}" for alias in node.names
                    if alias.name == "conftest" or alias.name.startswith("test_")]
    else:
        modules = [alias.name for alias in node.names]
    problems = []
    for module in modules:
        parts = module.split(".")
        if parts[0] in LOCAL_MODULES:
            problems.append(f"imports {module} by bare name: import it as tests.… (shared "
                            "code from tests.support)")
        elif any(p == "conftest" or p.startswith("test_") for p in parts):
            problems.append(f"imports {module}: a test module or conftest is not a library; "
                            "move what is shared to tests/support")
    return problems


def is_sys_path(node: ast.AST) -> bool:
    return ast.unparse(node) == "sys.path"


def problems_in(path: Path, source: str) -> list[str]:
    """Each way `source` (the file at `path`) breaks the layout, one line each."""
    problems = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        line = getattr(node, "lineno", 0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            problems += [f"{line}: {p}" for p in import_problems(node)]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            strings = [c.value for arg in [*node.args, *(k.value for k in node.keywords)]
                       for c in ast.walk(arg) if isinstance(c, ast.Constant)
                       and isinstance(c.value, str)]
            if name in LOADERS and any("conftest" in s or "test_" in s for s in strings):
                problems.append(f"{line}: loads a test module or conftest with {name}: import "
                                "shared code from tests.support")
            if (isinstance(func, ast.Attribute) and is_sys_path(func.value)
                    and path != ROOT_CONFTEST):
                problems.append(f"{line}: sys.path.{func.attr}: only tests/conftest.py sets "
                                "sys.path")
        elif isinstance(node, (ast.Assign, ast.AugAssign)) and path != ROOT_CONFTEST:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(is_sys_path(t) for t in targets):
                problems.append(f"{line}: assigns sys.path: only tests/conftest.py sets it")
        if (name := fixture_name(node)) in FIXTURES:
            problems.append(f"{line}: defines fixture {name!r} again: tests/support provides "
                            "it (through tests/conftest.py or the folder's conftest.py)")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                body_of(node) in HELPERS):
            problems.append(f"{line}: {node.name} is a copy of {HELPERS[body_of(node)]}: "
                            "import it")
    return problems


def test_no_test_file_imports_tests_loads_conftests_or_copies_what_support_provides():
    found = {str(p.relative_to(REPO_ROOT)): problems_in(p, p.read_text())
             for p in files_under_tests()}
    assert not {path: problems for path, problems in found.items() if problems}


def test_support_provides_the_shared_fixtures():
    assert {"moto_endpoint", "aws", "s3", "etcd_server", "cluster", "nodegroup", "task_log",
            "world_of_one"} <= FIXTURES


BREAKS_LAYOUT = {
    "a test module": "from test_manifests import assert_valid_pytorchjob\n",
    "a test module by package": "import tests.eks.test_manifests\n",
    "a test module from a package": "from tests.eks import test_manifests\n",
    "a conftest": "from conftest import torchrun\n",
    "a helper by bare name": "from strategy_worker import SETUPS\n",
    "support by bare name": "from support.eks import eks_config\n",
    "a conftest by path": (
        "import importlib.util\n"
        "spec = importlib.util.spec_from_file_location('c', ROOT / 'tests' / 'conftest.py')\n"),
    "sys.path": "import sys\nsys.path.insert(0, 'tests/eks')\n",
    "a support fixture again": "import pytest\n@pytest.fixture\ndef moto_endpoint():\n    pass\n",
    "a renamed support fixture": (
        "import pytest\n@pytest.fixture(name='aws')\ndef my_aws():\n    pass\n"),
    "a copied helper": (
        "import socket\n\ndef _free_port() -> int:\n    with socket.socket() as s:\n"
        "        s.bind(('127.0.0.1', 0))\n        return s.getsockname()[1]\n"),
    "a copied tools helper": (
        "def login(browser, url, token):\n"
        "    browser.cdp('Network.setCookie', name='_token', value=token, url=url)\n"),
}
KEEPS_LAYOUT = {
    "support": "from tests.support.eks import eks_config\nfrom tests.support import REPO_ROOT\n",
    "a companion script by package": "from tests.trainer.strategy_worker import SETUPS\n",
    "a fixture of its own": "import pytest\n@pytest.fixture\ndef bucket(aws):\n    pass\n",
    "a different function of a support name": (
        "def torchrun(endpoint):\n    return run(['torchrun', '--rdzv-endpoint', endpoint],"
        " check=True, timeout=180)\n"),
    "the project's own imports": "from finetune.etcd import free_port\nimport trainer.loss\n",
}


@pytest.mark.parametrize("source", BREAKS_LAYOUT.values(), ids=BREAKS_LAYOUT)
def test_the_scan_finds_a_file_that_breaks_the_layout(source):
    assert problems_in(TESTS / "eks" / "test_new.py", source)


@pytest.mark.parametrize("source", KEEPS_LAYOUT.values(), ids=KEEPS_LAYOUT)
def test_the_scan_passes_a_file_that_keeps_the_layout(source):
    assert problems_in(TESTS / "eks" / "test_new.py", source) == []
