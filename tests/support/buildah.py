"""buildah, a Debian base made with debootstrap and a local OCI registry requiring credentials,
for the image tests; the debootstrap tarball and the CPU torch index are cached under
.cache/image-test/ (ignored by git) so a second session does not redo them."""

from __future__ import annotations

import crypt
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support import REPO_ROOT
from tests.support.system import missing_dependency, system_binary_or_skip

CACHE = REPO_ROOT / ".cache" / "image-test"
DEBIAN_SUITE = "bookworm"  # its python3 (3.11) is the host's: the same CPU torch wheel
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = "python3,python3-venv"
TORCH_INDEX = "/torch-index"  # where the build sees the cached CPU torch index
CPU_TORCH_INDEX_URL = "https://download.pytorch.org/whl/cpu"


def image_tools_or_skip() -> dict[str, str]:
    """buildah, debootstrap, docker-registry (Debian packages; `make system-deps`), as root
    (debootstrap and buildah's vfs store with chroot isolation need it)."""
    if os.geteuid() != 0:
        missing_dependency("the image build tests run as root (debootstrap, buildah "
                           "--isolation chroot)", "Run them as root, as CI does")
    return {name: system_binary_or_skip(name, package) for name, package in
            (("buildah", "buildah"), ("debootstrap", "debootstrap"),
             ("docker-registry", "docker-registry"))}


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed ({result.returncode}):\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def debian_rootfs_tarball() -> Path:
    """A minbase Debian with python3 and venv, as a tarball (made once, then cached)."""
    tarball = CACHE / f"debian-{DEBIAN_SUITE}-python3.tar"
    if tarball.exists():
        return tarball
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        root = Path(tmp) / "root"
        run(["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", DEBIAN_SUITE,
             str(root), DEBIAN_MIRROR], timeout=900)
        shutil.rmtree(root / "var" / "cache" / "apt" / "archives", ignore_errors=True)
        run(["tar", "-C", str(root), "--numeric-owner", "-cf", f"{tarball}.part", "."])
    Path(f"{tarball}.part").rename(tarball)
    return tarball


def commit_base(storage: list[str], tarball: Path, ref: str) -> None:
    """The tarball as a local image: `buildah from scratch`, unpacked into it, committed."""
    ctr = run(["buildah", *storage, "from", "scratch"]).stdout.strip()
    try:
        mount = run(["buildah", *storage, "mount", ctr]).stdout.strip()
        run(["tar", "-C", mount, "--numeric-owner", "-xf", str(tarball)])
        run(["buildah", *storage, "config", "--env",
             "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", ctr])
        run(["buildah", *storage, "commit", "--quiet", ctr, ref])
    finally:
        subprocess.run(["buildah", *storage, "rm", ctr], capture_output=True)


def pinned_torch() -> str:
    text = (REPO_ROOT / "trainer" / "requirements.txt").read_text()
    return re.search(r"^torch==(\S+)$", text, re.M)[1]


def cpu_torch_index() -> Path:
    """A one-package simple index holding the CPU wheel of the pinned torch (pip's find-links
    or cache give it here; else the CPU wheel index), cached."""
    index = CACHE / "torch-index"
    package = index / "torch"
    wheels = sorted(package.glob(f"torch-{pinned_torch()}+cpu-*.whl"))
    if not wheels:
        package.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "-d", str(package), f"torch=={pinned_torch()}+cpu"]
        if subprocess.run(command, capture_output=True).returncode != 0:
            run([*command, "--extra-index-url", CPU_TORCH_INDEX_URL], timeout=900)
        wheels = sorted(package.glob(f"torch-{pinned_torch()}+cpu-*.whl"))
    (package / "index.html").write_text("".join(
        f'<a href="{w.name}">{w.name}</a>\n' for w in wheels))
    return index


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def registry(directory: Path, user: str, password: str) -> Iterator[str]:
    """Debian's docker-registry on 127.0.0.1, requiring `user`/`password` (htpasswd, bcrypt);
    yields its host:port."""
    port = free_port()
    htpasswd = directory / "htpasswd"
    htpasswd.write_text(f"{user}:{crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH))}\n")
    config = directory / "config.yml"
    config.write_text(
        "version: 0.1\n"
        "log: {level: warn}\n"
        f"storage: {{filesystem: {{rootdirectory: {directory / 'data'}}}}}\n"
        f"http: {{addr: '127.0.0.1:{port}'}}\n"
        f"auth: {{htpasswd: {{realm: finetune-test, path: {htpasswd}}}}}\n")
    log = (directory / "registry.log").open("w")
    proc = subprocess.Popen(["docker-registry", "serve", str(config)], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=2)
            except urllib.error.HTTPError as err:
                assert err.code == 401, err  # up, and asking for credentials
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise AssertionError("docker-registry did not start:\n"
                                         + (directory / "registry.log").read_text()) from None
                time.sleep(0.2)
            else:
                raise AssertionError("the registry served /v2/ without credentials")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
