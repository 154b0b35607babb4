"""The trainer image's content-addressed tags (the base's and the trainer's) and the environment a
run uses."""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
import sys
from pathlib import Path

from finetune import REPO_ROOT

# What goes into the trainer image: the tag changes exactly when one of these files does. The
# run contract is the trainer's too (it checks its config with it at start), and so is the
# prepared data set's module (it loads the set with it).
IMAGE_CONTEXT = ("trainer", "plugins/finetune_contract", "plugins/finetune_data", "containers")
# The base image (CUDA, EFA, aws-ofi-nccl, python3) is built from this folder alone.
BASE_CONTEXT = ("containers/trainer-base",)
TRAINER_DOCKERFILE = "containers/trainer/Dockerfile"
BASE_DOCKERFILE = "containers/trainer-base/Dockerfile"
BASE_TAG_PREFIX = "base-"
# What the trainer image's working directory (/app) holds under the same relative path as in
# this repository (containers/trainer/Dockerfile: COPY trainer/ /app/trainer/): a relative model,
# tokenizer or data set path the pods can read lies under one of these.
IN_POD_PATHS = ("trainer",)
_SKIP_DIRS = {"__pycache__", ".pytest_cache", ".ruff_cache"}
_SKIP_SUFFIXES = {".pyc", ".pyo"}


def context_files(root: Path = REPO_ROOT, parts: tuple[str, ...] = IMAGE_CONTEXT) -> list[Path]:
    files = []
    for part in parts:
        for path in (root / part).rglob("*"):
            rel = path.relative_to(root)
            if path.is_file() and not _SKIP_DIRS.intersection(rel.parts) \
                    and path.suffix not in _SKIP_SUFFIXES:
                files.append(rel)
    return sorted(files, key=lambda p: p.as_posix())


def content_hash(root: Path = REPO_ROOT, parts: tuple[str, ...] = IMAGE_CONTEXT) -> str:
    """sha256 over the image context's relative paths, file modes and bytes."""
    digest = hashlib.sha256()
    for rel in context_files(root, parts):
        path = root / rel
        executable = path.stat().st_mode & 0o111 != 0
        digest.update(f"{rel.as_posix()}\0{int(executable)}\0".encode())
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


def base_tag(root: Path = REPO_ROOT) -> str:
    """The base image's tag: the content hash of its folder (it lives in the trainer's repository,
    so the prefix keeps the two apart)."""
    return BASE_TAG_PREFIX + content_hash(root, BASE_CONTEXT)[:16]


def image_tag(root: Path = REPO_ROOT, base: str | None = None) -> str:
    """The trainer image's tag: the hash of its context and of the base it is built FROM (`base`,
    a reference; by default the pipeline's own base, `base_tag`)."""
    base = base or base_tag(root)
    return hashlib.sha256(f"{content_hash(root)}\0base\0{base}".encode()).hexdigest()[:16]


TRAINER_REQUIREMENTS = "trainer/requirements.txt"  # what the built image installs (Dockerfile)


def image_installs(requirement: str, root: Path = REPO_ROOT) -> bool:
    """Whether the trainer image this project builds installs `requirement` (a distribution,
    with or without its pin): a line of TRAINER_REQUIREMENTS names its distribution."""
    def name(line: str) -> str:
        return line.split("#")[0].split("==")[0].strip().lower().replace("_", "-")

    names = {name(line) for line in (root / TRAINER_REQUIREMENTS).read_text().splitlines()}
    return name(requirement) in names - {""}


ENVIRONMENT_PACKAGES = ("torch", "transformers", "datasets", "tokenizers", "safetensors",
                        "apache-airflow", "python-etcd")


def local_environment() -> dict[str, str | None]:
    """Versions of what the local target's training runs with."""
    env: dict[str, str | None] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "executable": sys.executable,
    }
    for name in ENVIRONMENT_PACKAGES:
        try:
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            env[name] = None
    return env
