"""Where a run's outputs go: a local directory (one host or a shared file system) or S3.

For an `s3://bucket/prefix` output the trainer writes to a local staging directory with the same
layout (env FINETUNE_STAGING_DIR, default under the temp dir) and uploads from there, so the
objects under the prefix are the files a local output directory would hold, at the same paths.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from finetune_contract.rules import split_s3

STAGING_ENV = "FINETUNE_STAGING_DIR"
S3_SCHEME = "s3://"


def is_s3(path: str) -> bool:
    return path.startswith(S3_SCHEME)


def staging_dir(uri: str) -> Path:
    """The local directory that mirrors `uri`: one per output URI, so runs never share one."""
    base = os.environ.get(STAGING_ENV) or str(Path(tempfile.gettempdir()) / "finetune-staging")
    digest = hashlib.sha256(uri.encode()).hexdigest()[:16]
    return Path(base).expanduser().absolute() / digest


class S3Prefix:
    """Files under one S3 prefix, addressed by their path relative to it ('a/b.json')."""

    def __init__(self, uri: str, client: Any = None):
        import boto3  # only S3 outputs need it

        self.uri = uri.rstrip("/")
        self.bucket, self.prefix = split_s3(uri)
        # Clients are thread-safe (uploads run in a background thread); sessions are not.
        self.client = client or boto3.client("s3")

    def key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def upload_file(self, local: Path, relative: str) -> None:
        self.client.upload_file(str(local), self.bucket, self.key(relative))

    def upload_tree(self, local_dir: Path, relative: str) -> list[str]:
        """Every file under local_dir to `relative/<its path>`; returns the relative paths."""
        uploaded = []
        for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
            name = f"{relative}/{path.relative_to(local_dir).as_posix()}"
            self.upload_file(path, name)
            uploaded.append(name)
        return uploaded

    def put_text(self, relative: str, text: str) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.key(relative), Body=text.encode())

    def exists(self, relative: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self.key(relative))
            return True
        except ClientError as error:
            if error.response["Error"]["Code"] in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def list_files(self, relative_dir: str) -> list[str]:
        """Relative paths of every object under `relative_dir/`."""
        base = self.key(relative_dir.rstrip("/") + "/")
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=base
        )
        start = len(self.key(""))
        return [obj["Key"][start:] for page in pages for obj in page.get("Contents", [])]

    def list_dirs(self, relative_dir: str) -> list[str]:
        """Names of the 'directories' directly under `relative_dir/`."""
        base = self.key(relative_dir.rstrip("/") + "/")
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=base, Delimiter="/"
        )
        return [
            entry["Prefix"][len(base) :].rstrip("/")
            for page in pages
            for entry in page.get("CommonPrefixes", [])
        ]

    def download_file(self, relative: str, local: Path) -> bool:
        """Copy one object to `local` (atomically); False when there is no such object."""
        from botocore.exceptions import ClientError

        local.parent.mkdir(parents=True, exist_ok=True)
        partial = local.with_name(f".{local.name}.{uuid.uuid4().hex}")
        try:
            self.client.download_file(self.bucket, self.key(relative), str(partial))
        except ClientError as error:
            partial.unlink(missing_ok=True)
            if error.response["Error"]["Code"] in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        os.replace(partial, local)
        return True

    def download_tree(self, relative_dir: str, local_dir: Path) -> None:
        """Make local_dir an exact copy of everything under `relative_dir/`."""
        shutil.rmtree(local_dir, ignore_errors=True)
        for name in self.list_files(relative_dir):
            inner = name[len(relative_dir.rstrip("/")) + 1 :]
            target = (local_dir / inner).resolve()
            if not target.is_relative_to(local_dir.resolve()):
                raise ValueError(f"{self.uri}/{name}: object key leaves {local_dir}")
            self.download_file(name, target)

    def delete_tree(self, relative_dir: str) -> int:
        """Delete every object under `relative_dir/`; returns how many."""
        names = self.list_files(relative_dir)
        for start in range(0, len(names), 1000):  # the most one DeleteObjects call takes
            batch = [{"Key": self.key(name)} for name in names[start : start + 1000]]
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
        return len(names)


class RunOutput:
    """The run's output location. `dir` is where the trainer writes: the output directory
    itself, or for S3 the staging directory that rank 0 and the checkpointer upload from."""

    def __init__(self, output_dir: str, rank: int):
        self.rank = rank
        self.remote = S3Prefix(output_dir) if is_s3(output_dir) else None
        self.dir = staging_dir(output_dir) if self.remote else Path(output_dir)
        self.location = output_dir
        if self.remote is not None and rank == 0:
            shutil.rmtree(self.dir / "model", ignore_errors=True)  # an earlier try's export

    def sync(self, *names: str) -> None:
        """Rank 0 uploads these files (paths relative to `dir`) when they exist there."""
        if self.remote is None or self.rank != 0:
            return
        for name in names:
            if (self.dir / name).is_file():
                self.remote.upload_file(self.dir / name, name)

    def sync_tree(self, name: str) -> None:
        """Rank 0 uploads the directory `dir/name` (the exported model)."""
        if self.remote is not None and self.rank == 0:
            self.remote.delete_tree(name)  # no file of an earlier export survives
            self.remote.upload_tree(self.dir / name, name)

    def fetch(self, name: str) -> None:
        """Rank 0 replaces its local copy of a file with the uploaded one (or drops it)."""
        if self.remote is None or self.rank != 0:
            return
        if not self.remote.download_file(name, self.dir / name):
            (self.dir / name).unlink(missing_ok=True)
