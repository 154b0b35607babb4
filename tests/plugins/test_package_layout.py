"""The packages' shape: no import circle among the modules of plugins/, trainer/, bench/ and
tools/ (lazy imports included), nothing of the product (plugins/, trainer/, dags/) imports the
benchmarks or the tooling (bench/ and tools/, the layers above), every module opens with a
docstring saying what it owns, and the plugin works from MWAA's plugins.zip (made by the command
docs/deploy.md gives), every module and page template included."""

from __future__ import annotations

import ast
import json
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.support.system import system_binary_or_skip

REPO_ROOT = Path(__file__).resolve().parents[2]
PLUGINS = REPO_ROOT / "plugins"
TRAINER = REPO_ROOT / "trainer"
DAGS = REPO_ROOT / "dags"
BENCH = REPO_ROOT / "bench"
TOOLS = REPO_ROOT / "tools"
DOCS = REPO_ROOT / "docs"


def module_name(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def modules_under(tree: Path, root: Path) -> dict[str, Path]:
    """The dotted name of each module under `tree`, as imported with `root` on sys.path."""
    return {module_name(p, root): p for p in tree.rglob("*.py")}


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of `modules` it imports anywhere (in functions too)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            graph[name] |= {m for m in found if m in modules and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            if group:
                found.append(sorted([v, *group]))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_among_the_plugin_trainer_bench_and_tools_modules():
    # One graph: the trainer imports the contract package (plugins/finetune_contract).
    modules = (modules_under(PLUGINS, PLUGINS) | modules_under(TRAINER, REPO_ROOT)
               | modules_under(BENCH, REPO_ROOT) | modules_under(TOOLS, REPO_ROOT))
    assert len(modules) > 60 and "trainer.model" in modules and "finetune.report" in modules
    assert "bench.train" in modules and "tools.airflow_ui" in modules
    assert cycles(import_graph(modules)) == []


# The packages above the product: the benchmarks and the tooling (the docs' screenshots).
ABOVE_THE_PRODUCT = ("bench", "tools")


def is_above_the_product(module: str) -> bool:
    return module.split(".")[0] in ABOVE_THE_PRODUCT


def imports_from_above(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a benchmark or tooling module by a product module, as "importer ->
    bench.x" (bench and tools do not import each other either)."""
    return sorted(f"{name} -> {imported}" for name, imports in graph.items()
                  for imported in imports if is_above_the_product(imported)
                  and imported.split(".")[0] != name.split(".")[0])


def test_nothing_of_the_product_imports_the_benchmarks_or_the_tooling():
    """bench/ and tools/ sit above the trainer and plugins/ (they import them); a product
    module that imported one would put the benchmarks or the tooling back into what ships."""
    modules = (modules_under(PLUGINS, PLUGINS) | modules_under(TRAINER, REPO_ROOT)
               | modules_under(DAGS, DAGS) | modules_under(BENCH, REPO_ROOT)
               | modules_under(TOOLS, REPO_ROOT))
    graph = import_graph(modules)
    assert {"bench.train", "tools.airflow_ui", "trainer.model", "finetune.pipeline",
            "llm_finetune"} <= set(graph)
    assert any(m.startswith("bench.") for imports in graph.values() for m in imports)
    assert any(m.startswith("tools.") for imports in graph.values() for m in imports)
    assert imports_from_above(graph) == []


def test_the_airflow_side_never_imports_the_trainer():
    """The Airflow side talks to the trainer through the contract and the files it writes,
    never through its modules (which need torch): plugins/ and dags/ import no trainer."""
    modules = (modules_under(PLUGINS, PLUGINS) | modules_under(TRAINER, REPO_ROOT)
               | modules_under(DAGS, DAGS))
    graph = import_graph(modules)
    airflow_side = {m for m in modules if not (m == "trainer" or m.startswith("trainer."))}
    assert [f"{m} -> {t}" for m in sorted(airflow_side) for t in sorted(graph[m])
            if t == "trainer" or t.startswith("trainer.")] == []


def test_the_scan_finds_a_product_module_that_imports_a_benchmark_or_a_tool(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "__init__.py").write_text("import trainer\n")
    (tmp_path / "bench" / "train.py").write_text("from trainer import model\n")
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "__init__.py").write_text("")
    (tmp_path / "trainer" / "model.py").write_text("def f():\n    from bench.train import g\n")
    (tmp_path / "trainer" / "data.py").write_text("import bench\n")
    (tmp_path / "trainer" / "shots.py").write_text("from tools import screenshots\n")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "__init__.py").write_text("")
    (tmp_path / "tools" / "screenshots.py").write_text("import trainer.model\n")
    graph = import_graph(modules_under(tmp_path / "bench", tmp_path)
                         | modules_under(tmp_path / "trainer", tmp_path)
                         | modules_under(tmp_path / "tools", tmp_path))
    assert imports_from_above(graph) == ["trainer.data -> bench", "trainer.model -> bench.train",
                                    "trainer.shots -> tools", "trainer.shots -> tools.screenshots"]


def test_the_graph_has_the_trainer_s_lazy_imports(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text("import pkg.b\n")
    (package / "b.py").write_text("def f():\n    from pkg.a import g\n")
    graph = import_graph(modules_under(package, tmp_path))
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]


def test_the_scan_finds_a_circle_when_there_is_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_module_opens_with_a_docstring():
    missing = [str(p.relative_to(REPO_ROOT))
               for root in (PLUGINS, TRAINER, DAGS, BENCH, TOOLS)
               for p in root.rglob("*.py")
               if p.stat().st_size and ast.get_docstring(ast.parse(p.read_text())) is None]
    assert missing == []


def plugins_zip(tmp_path: Path) -> Path:
    """plugins.zip made by the command docs/deploy.md gives (`cd plugins && zip ...`), run as
    it is written (no shell) in a copy of plugins/ with its bytecode, so the zip of the docs is
    the zip these tests import from."""
    line = next(cell for cell in (DOCS / "deploy.md").read_text().split("`")
                if cell.startswith("cd plugins && zip "))
    argv = shlex.split(line.removeprefix("cd plugins && "))
    copy = shutil.copytree(PLUGINS, tmp_path / "plugins")
    (copy / "finetune" / "__pycache__").mkdir(exist_ok=True)
    (copy / "finetune" / "__pycache__" / "stale.cpython-311.pyc").write_bytes(b"")
    subprocess.run([system_binary_or_skip("zip", "zip"), *argv[1:]], cwd=copy, check=True,
                   timeout=120)
    return tmp_path / "plugins.zip"


def test_the_plugins_zip_of_the_docs_holds_every_module_of_plugins_and_no_bytecode(tmp_path):
    names = set(zipfile.ZipFile(plugins_zip(tmp_path)).namelist())
    modules = {p.relative_to(PLUGINS).as_posix() for p in PLUGINS.rglob("*.py")
               if "__pycache__" not in p.parts}
    assert modules - names == set()
    assert {"finetune_data/prepared_set.py", "finetune_runs_plugin.py"} <= names
    assert [n for n in names if "__pycache__" in n or n.endswith(".pyc")] == []


def test_report_html_renders_from_the_plugins_zip_with_its_templates(tmp_path):
    """A page template left out of the package (or read by a file path a zip has not) fails
    here: Airflow on MWAA imports the plugin from the zip, not from a folder."""
    archive = plugins_zip(tmp_path)
    assert "finetune/templates/report.html.j2" in zipfile.ZipFile(archive).namelist()
    run_dir = tmp_path / "run"
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(archive)!r})\n"
        "import finetune.report as report\n"
        "assert report.__file__.startswith(sys.path[0]), report.__file__\n"
        f"report.write_report({str(run_dir)!r}, run_id='zip-1', status='success', config={{}})\n"
    )
    # -I: no PYTHONPATH, so plugins/ of this checkout cannot stand in for the zip
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    page = (run_dir / "report.html").read_text()
    assert "<title>Run zip-1: success</title>" in page and page.count("<svg") == 3
    assert json.loads((run_dir / "report.json").read_text())["run_id"] == "zip-1"
