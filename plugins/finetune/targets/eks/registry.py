"""What every image builder of the eks target shares (the BuildKit Job, CodeBuild, buildah):
the build context as an archive, ECR's push credentials, the error a failed build raises.
Its own module so a builder module can use it while image_build (which dispatches to the
builders) imports the builders: no import circle."""

from __future__ import annotations

import base64
import gzip
import io
import json
import tarfile
import zipfile
from pathlib import Path
from typing import Any

from finetune import REPO_ROOT
from finetune.image import context_files
from finetune.targets.base import StageFailed

LOG_TAIL_LINES = 40


class ImageBuildError(StageFailed):
    """The image could not be provided; the message says why (with the build log's tail). A
    verdict, not retried: a build that failed fails again, and the run's nodes wait meanwhile."""


def pack_context(root: Path = REPO_ROOT, fmt: str = "tar.gz") -> bytes:
    """The build context (exactly `image.context_files`) as tar.gz or zip, byte-for-byte
    reproducible: the same tree gives the same archive."""
    buf = io.BytesIO()
    files = context_files(root)
    if fmt == "zip":
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
            for rel in files:
                info = zipfile.ZipInfo(rel.as_posix(), date_time=(1980, 1, 1, 0, 0, 0))
                info.external_attr = (0o100000 | _mode(root / rel)) << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                zf.writestr(info, (root / rel).read_bytes())
        return buf.getvalue()
    if fmt != "tar.gz":
        raise ValueError(f"unknown context format {fmt!r}; allowed: tar.gz, zip")
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in files:
            data = (root / rel).read_bytes()
            info = tarfile.TarInfo(rel.as_posix())
            info.size, info.mode, info.mtime = len(data), _mode(root / rel), 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _mode(path: Path) -> int:
    return 0o755 if path.stat().st_mode & 0o111 else 0o644


def dockerconfigjson(registry: str, username: str, password: str) -> str:
    auth = base64.b64encode(f"{username}:{password}".encode()).decode()
    return json.dumps({"auths": {registry: {"auth": auth}}}, sort_keys=True)


def registry_credentials(ecr: Any) -> tuple[str, str, str]:
    """(registry host, user, password) from ECR's authorization token (valid 12 hours)."""
    data = ecr.get_authorization_token()["authorizationData"][0]
    user, _, password = base64.b64decode(data["authorizationToken"]).decode().partition(":")
    return data["proxyEndpoint"].removeprefix("https://"), user, password
