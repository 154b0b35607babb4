"""The image tag is the content hash of trainer/ and containers/."""

import shutil

from finetune.image import (
    IMAGE_CONTEXT,
    TRAINER_DOCKERFILE,
    base_tag,
    content_hash,
    context_files,
    image_tag,
    local_environment,
)
from tests.support import REPO_ROOT


def test_same_tree_gives_the_same_hash(repo_copy):
    assert content_hash(repo_copy) == content_hash(repo_copy)


def test_changed_trainer_file_gives_a_new_hash(repo_copy):
    before = content_hash(repo_copy)
    target = repo_copy / "trainer" / "config.py"
    target.write_text(target.read_text() + "\n# changed\n")
    assert content_hash(repo_copy) != before


def test_new_or_renamed_file_gives_a_new_hash(repo_copy):
    before = content_hash(repo_copy)
    (repo_copy / "containers" / "extra.txt").write_text("x")
    added = content_hash(repo_copy)
    assert added != before
    (repo_copy / "containers" / "extra.txt").rename(repo_copy / "containers" / "other.txt")
    assert content_hash(repo_copy) not in (before, added)


def test_files_outside_the_context_and_bytecode_do_not_change_the_hash(repo_copy):
    before = content_hash(repo_copy)
    (repo_copy / "README.md").write_text("docs")
    (repo_copy / "trainer" / "__pycache__").mkdir(exist_ok=True)
    (repo_copy / "trainer" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    assert content_hash(repo_copy) == before


def test_the_benchmarks_are_outside_the_image_and_its_tag(repo_copy):
    """bench/ is not built into the trainer image: editing, adding or removing a benchmark keeps
    the tag (and the image) as it was."""
    assert not [part for part in IMAGE_CONTEXT if part.split("/")[0] == "bench"]
    shutil.copytree(REPO_ROOT / "bench", repo_copy / "bench",
                    ignore=shutil.ignore_patterns("__pycache__"))
    tag, files = image_tag(repo_copy), context_files(repo_copy)
    assert files and not [f for f in files if f.parts[0] == "bench"]
    train = repo_copy / "bench" / "train.py"
    train.write_text(train.read_text() + "\n# changed\n")
    (repo_copy / "bench" / "new_peer.py").write_text('"""Another peer."""\n')
    (repo_copy / "bench" / "titan.py").unlink()
    assert image_tag(repo_copy) == tag and context_files(repo_copy) == files
    # A local build sends the repository root: its ignore file keeps bench/ out of the context.
    ignore = (REPO_ROOT / f"{TRAINER_DOCKERFILE}.dockerignore").read_text().split()
    assert "bench" in ignore


def test_trainer_tag_changes_with_its_base_reference(repo_copy):
    tag = image_tag(repo_copy)
    assert len(tag) == 16 and tag == image_tag(repo_copy, base_tag(repo_copy))
    assert image_tag(repo_copy, "localhost/finetune-base:debian") != tag


def test_base_tag_changes_only_with_the_base_folder(repo_copy):
    base, trainer = base_tag(repo_copy), image_tag(repo_copy)
    assert base.startswith("base-") and len(base) == 21
    (repo_copy / "trainer" / "train.py").write_text("# changed\n")
    assert base_tag(repo_copy) == base and image_tag(repo_copy) != trainer
    changed = image_tag(repo_copy)
    dockerfile = repo_copy / "containers" / "trainer-base" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text() + "# changed\n")
    assert base_tag(repo_copy) != base and image_tag(repo_copy) != changed


def test_environment_records_the_training_stack():
    env = local_environment()
    assert env["torch"] and env["transformers"] and env["python"]
