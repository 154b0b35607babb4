"""Where a run reads and writes must exist where the stage runs: a local output_dir the run
directory can be made in (and outside the trainer image's build context), and on eks no relative
path that only the Airflow worker has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from finetune import REPO_ROOT
from finetune.config import ConfigError
from finetune.image import IMAGE_CONTEXT, IN_POD_PATHS
from finetune.validate import validate_params
from tests.support.eks import EKS_PARAMS


def output_dir_errors(output_dir: str) -> list[str]:
    try:
        validate_params({"procs_per_node": 1, "output_dir": output_dir}, run_id="manual__r")
    except ConfigError as err:
        return [message for field, message in err.errors if field == "output_dir"]
    return []


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "not-a-dir"
    path.write_text("x")
    return path


def test_an_output_dir_that_is_a_file_is_refused(a_file):
    assert any("is a file" in m for m in output_dir_errors(str(a_file))), a_file


def test_an_output_dir_under_a_file_is_refused(a_file):
    errors = output_dir_errors(str(a_file / "runs" / "deeper"))
    assert any("lies under the file" in m for m in errors), errors


@pytest.mark.parametrize("path", ["/proc/finetune-runs", "/sys/kernel/finetune",
                                  "/proc/self/runs"])
def test_an_output_dir_on_a_pseudo_file_system_is_refused(path):
    errors = output_dir_errors(path)
    assert any("pseudo-file system" in m for m in errors), errors


@pytest.mark.parametrize("path", ["../outside", "runs/../../outside", "trainer/../../x"])
def test_a_relative_output_dir_that_leaves_the_repository_is_refused(path):
    errors = output_dir_errors(path)
    assert any("leaves the repository" in m for m in errors), errors


@pytest.mark.parametrize("part", IMAGE_CONTEXT)
def test_an_output_dir_inside_the_image_build_context_is_refused(part):
    """Every part of the build context, relative and absolute: a new part is covered too."""
    for path in (f"{part}/runs", str(REPO_ROOT / part / "out"), f"runs/../{part}"):
        errors = output_dir_errors(path)
        assert any("build context" in m for m in errors), (path, errors)


@pytest.mark.parametrize("path", ["runs", "runs/nested/deeper"])
def test_an_output_dir_that_can_be_made_is_accepted(path, tmp_path):
    assert output_dir_errors(path) == []
    assert output_dir_errors(str(tmp_path / "new" / "dirs")) == []


def test_what_the_pods_hold_is_what_the_trainer_image_copies():
    dockerfile = (REPO_ROOT / "containers" / "trainer" / "Dockerfile").read_text()
    copied = re.findall(r"^COPY (?:--\S+ )*(\S+)/ /app/(\S+)/$", dockerfile, re.M)
    same_place = {source for source, target in copied if source == target}
    assert set(IN_POD_PATHS) == same_place, copied


@pytest.mark.parametrize("field", ["dataset", "eval_dataset", "model", "tokenizer"])
def test_on_eks_a_relative_path_only_the_worker_has_is_refused_with_the_fix(field):
    """README.md exists on every checkout, never in the pods."""
    value = {"model": "plugins", "tokenizer": "containers"}.get(field, "docs")
    with pytest.raises(ConfigError) as err:
        validate_params({**EKS_PARAMS, field: value}, run_id="manual__r")
    messages = [m for f, m in err.value.errors if f == field]
    assert any("not in the training pods" in m and "s3://" in m and "hub id" in m
               for m in messages), err.value.errors


def test_on_eks_relative_paths_shipped_in_the_image_are_accepted():
    cfg = validate_params({**EKS_PARAMS, "dataset": "trainer/demo/instructions.jsonl",
                           "tokenizer": "trainer/demo/tokenizer"}, run_id="manual__r")
    assert cfg.dataset == "trainer/demo/instructions.jsonl"
