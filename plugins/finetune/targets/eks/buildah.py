"""buildah, daemonless, where Airflow runs: build the trainer's Dockerfiles and push to a registry.

Pure command builders and two calls (`build`, `push`); the push credentials go through an auth
file (a dockerconfigjson, mode 0600, deleted after), never on a command line or in a message.
"""

from __future__ import annotations

import logging
import os
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from finetune import REPO_ROOT
from finetune.image import BASE_DOCKERFILE, TRAINER_DOCKERFILE
from finetune.targets.eks.registry import (
    LOG_TAIL_LINES,
    ImageBuildError,
    dockerconfigjson,
    pack_context,
    registry_credentials,
)

log = logging.getLogger(__name__)

# The ways buildah runs without a daemon or privileges beyond root on the host: no overlay
# (vfs), no OCI runtime (chroot), the host's network (pip reaches the index).
STORAGE_DRIVER = "vfs"
ISOLATION = "chroot"
HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


def storage_args(root: Path | None = None, runroot: Path | None = None) -> list[str]:
    """buildah's global options: vfs storage, in `root`/`runroot` when given (tests)."""
    args = ["--storage-driver", STORAGE_DRIVER]
    if root is not None:
        args += ["--root", str(root), "--runroot", str(runroot or Path(root) / "run")]
    return args


def build_command(context: Path, dockerfile: str, ref: str, build_args: dict[str, str], *,
                  storage: Sequence[str] = (), volumes: Sequence[str] = (),
                  authfile: Path | None = None) -> list[str]:
    """`buildah build` of `dockerfile` (relative to `context`) tagged `ref`, the host's CA bundle
    mounted so pip's HTTPS works inside."""
    command = ["buildah", *storage, "build", "--isolation", ISOLATION, "--network", "host",
               "--file", str(context / dockerfile), "--tag", ref, "--layers=false"]
    ignore = context / f"{dockerfile}.dockerignore"
    if ignore.is_file():
        command += ["--ignorefile", str(ignore)]
    if authfile is not None:  # pulls the base from the registry
        command += ["--authfile", str(authfile)]
    if os.path.isfile(HOST_CA_BUNDLE):
        command += ["--volume", f"{HOST_CA_BUNDLE}:{HOST_CA_BUNDLE}:ro"]
    for volume in volumes:
        command += ["--volume", volume]
    for key, value in sorted(build_args.items()):
        command += ["--build-arg", f"{key}={value}"]
    return [*command, str(context)]


def build(context: Path, dockerfile: str, ref: str, build_args: dict[str, str], *,
          storage: Sequence[str] = (), volumes: Sequence[str] = (), authfile: Path | None = None,
          log_path: Path | None = None, timeout: float | None = None) -> None:
    """Build `ref`; a failed build raises ImageBuildError with the build log's tail (and no
    image is tagged `ref`: buildah tags only what it committed)."""
    command = build_command(context, dockerfile, ref, build_args, storage=storage,
                            volumes=volumes, authfile=authfile)
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    output = result.stdout + result.stderr
    if log_path is not None:
        log_path.write_text(output)
    if result.returncode != 0:
        raise ImageBuildError(f"buildah build of {dockerfile} as {ref} failed (exit "
                              f"{result.returncode}); last lines of the build log:\n"
                              + log_tail(output))


def push(ref: str, destination: str, registry: str, user: str, password: str, *,
         storage: Sequence[str] = (), tls_verify: bool = True, connection: str = "",
         compress: bool = True) -> str:
    """Push local `ref` to `destination` (registry/repository:tag); the pushed digest."""
    with auth_file(registry, user, password) as auth:
        digest_file = auth.with_name("digest")
        command = ["buildah", *storage, "push", "--authfile", str(auth),
                   f"--tls-verify={str(tls_verify).lower()}", "--digestfile", str(digest_file)]
        if not compress:
            command.append("--disable-compression")
        result = subprocess.run([*command, ref, f"docker://{destination}"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            output = (result.stdout + result.stderr).replace(password, "***")
            refused = any(word in output.lower() for word in
                          ("unauthorized", "authentication required", "denied"))
            via = f" (credentials from connection {connection!r})" if connection else ""
            what = "refused the credentials" if refused else "did not take the push"
            raise ImageBuildError(f"registry {registry} {what} for {destination}{via}:\n"
                                  + log_tail(output))
        return digest_file.read_text().strip()


@contextmanager
def auth_file(registry: str, user: str, password: str) -> Iterator[Path]:
    """A dockerconfigjson for `registry` in a private temporary directory, removed after."""
    with tempfile.TemporaryDirectory(prefix="finetune-auth-") as tmp:
        auth = Path(tmp) / "auth.json"
        auth.touch(0o600)
        auth.write_text(dockerconfigjson(registry, user, password))
        yield auth


def build_and_push(ecr: Any, ref: str, base_ref: str, build_base: bool, *,
                   root: Path = REPO_ROOT, connection: str = "",
                   timeout: float | None = None) -> None:
    """image_builder buildah: the base (when `build_base`) and the trainer FROM it, built here
    from exactly the context the other builders send, each pushed to ECR once built."""
    registry, user, password = registry_credentials(ecr)
    with tempfile.TemporaryDirectory(prefix="finetune-build-") as tmp:
        context = Path(tmp) / "context"
        archive = Path(tmp) / "context.tar.gz"
        archive.write_bytes(pack_context(root, "tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(context, filter="data")
        with auth_file(registry, user, password) as auth:
            if build_base:
                log.info("building the base %s with buildah", base_ref)
                build(context, BASE_DOCKERFILE, base_ref, {}, authfile=auth, timeout=timeout)
                push(base_ref, base_ref, registry, user, password, connection=connection)
            log.info("building %s with buildah", ref)
            build(context, TRAINER_DOCKERFILE, ref, {"BASE_IMAGE": base_ref}, authfile=auth,
                  timeout=timeout)
    push(ref, ref, registry, user, password, connection=connection)


def log_tail(output: str, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join("    " + line for line in output.splitlines()[-lines:])
