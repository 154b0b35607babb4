"""transformers is imported without the packages it would import for nothing here (scikit-learn,
SciPy, torchao: finetune_contract/transformers_import.py): every module of plugins/ and dags/
takes transformers' classes through that module, the trainer's package skips them at import, and
a transformers release that stops honouring it fails here."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT

THE_MODULE = REPO_ROOT / "plugins" / "finetune_contract" / "transformers_import.py"


def _imports_transformers(path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if any(n == "transformers" or n.startswith("transformers.") for n in names):
            lines.append(node.lineno)
    return lines


def test_the_airflow_side_imports_transformers_only_through_the_module_that_skips_them():
    found = {f"{p.relative_to(REPO_ROOT)}:{line}"
             for folder in ("plugins", "dags") for p in (REPO_ROOT / folder).rglob("*.py")
             if p != THE_MODULE for line in _imports_transformers(p)}
    assert not found, ("import transformers' classes as `from finetune_contract."
                       f"transformers_import import AutoTokenizer`: {sorted(found)}")


def test_the_scan_finds_a_direct_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from transformers import AutoTokenizer\n")
    assert _imports_transformers(module) == [2]


@pytest.mark.slow
def test_a_tokenizer_validate_loads_and_every_trainer_module_leave_the_unused_unimported():
    from finetune_contract.transformers_import import UNUSED

    for package in UNUSED:
        assert importlib.util.find_spec(package), f"{package} is not installed: nothing to skip"
    code = (
        "import json, sys\n"
        "from finetune_contract.transformers_import import AutoTokenizer, UNUSED\n"
        "from trainer.demo import DEMO_TOKENIZER\n"
        "AutoTokenizer.from_pretrained(DEMO_TOKENIZER)\n"
        "plugin_side = [p for p in UNUSED if p in sys.modules]\n"
        "import trainer.train, bench.train, trainer.evaluate\n"
        "print(json.dumps([plugin_side, [p for p in UNUSED if p in sys.modules]]))\n")
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT / 'plugins'}{os.pathsep}{REPO_ROOT}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO_ROOT, env=env, check=True).stdout
    assert json.loads(out.splitlines()[-1]) == [[], []]
