"""The peers' site directories for the device: `python -m bench.peer_sites [OUT_DIR]` (.peers).

The device's Python (CPython 3.12, x86_64, CUDA 13.0) has torch, transformers and peft, but not
torchtitan, torchao, Unsloth, bitsandbytes, trl or datasets, which bench.train's peers import.
This resolves them for that Python from PyPI (pip's resolver, as a dry run for the device's
platform: nothing is installed here), keeps only what the device lacks, unpacks the wheels and
writes two archives (git-ignored; `run` carries them: `carry: [".peers"]`):

- titan-site.tar.xz: `titan-site/` (torchtitan, torchao for float8, and what they import) and
  `titan-fallback/` (datasets and tensorboard with theirs), to go after the device's own
  packages on the path, only where it has no datasets;
- unsloth-site.tar.xz: `unsloth-site/` (Unsloth, unsloth_zoo, bitsandbytes with its CUDA 13.0
  library alone, and the trl and datasets (with its dill and multiprocess) of the versions
  Unsloth pins, older than this project's);
- fa4-site.tar.xz: `fa4-site/` (flash-attn-4, the CUTLASS DSL with its CUDA 13.0 library, and
  what they import), for `attention: fa4`. Its DSL library alone is 66 MB compressed, past what
  one call carries beside anything else, so the archive is written in parts of at most
  `PART_BYTES` (`fa4-site.tar.xz.00`, `.01`): carry one a call, keep each in the device's /tmp
  while it stays warm, and unpack them joined (`cat parts | xz -d | tar -x`).

docs/trainer.md ("The peers on the device") has the lines a device command starts with.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from pathlib import Path

from finetune_contract.fields import FA4_PACKAGE

# pip takes each platform tag as given: the glibc versions the device runs wheels of.
DEVICE_PYTHON = ["--python-version", "3.12", "--only-binary=:all:",
                 *(arg for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                                   "manylinux_2_24_x86_64", "manylinux2014_x86_64", "any")
                   for arg in ("--platform", tag))]
# archive: (requirements pip resolves, {directory: the resolved packages it keeps, which the
# device lacks})
SITES = {
    "titan-site.tar.xz": (["torchtitan==0.2.2", "torchao==0.18.0"], {
        "titan-site": {"torchtitan", "torchao", "torchdata", "tyro", "docstring-parser",
                       "typeguard", "einops", "tomli"},
        "titan-fallback": {"datasets", "pyarrow", "dill", "multiprocess", "xxhash", "pandas",
                           "python-dateutil", "tzdata", "tensorboard", "tensorboard-data-server",
                           "absl-py", "grpcio", "markdown", "werkzeug", "protobuf", "markupsafe"},
    }),
    "unsloth-site.tar.xz": (["unsloth==2026.10.9", "cut-cross-entropy", "msgspec"], {
        "unsloth-site": {"unsloth", "unsloth-zoo", "bitsandbytes", "trl", "cut-cross-entropy",
                         "msgspec", "datasets", "dill", "multiprocess"},
    }),
    "fa4-site.tar.xz": ([FA4_PACKAGE, "nvidia-cutlass-dsl[cu13]==4.8.1"], {
        "fa4-site": {"flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base",
                     "nvidia-cutlass-dsl-libs-core", "nvidia-cutlass-dsl-libs-cu13",
                     "quack-kernels", "apache-tvm-ffi", "torch-c-dlpack-ext", "einops"},
    }),
}
PART_BYTES = 48 * 2**20  # an archive larger than this is written in parts (fa4-site's)
# Unpacked, then left out: tests, and the parts nothing a peer runs loads.
DROP = ["**/tests", "**/__pycache__", "pyarrow/include", "pyarrow/src", "pyarrow/*flight*",
        "pyarrow/_pyarrow_cpp_tests*", "studio", "unsloth_cli"]  # studio: Unsloth's web UI
BNB_KEEP = {"libbitsandbytes_cuda130.so", "libbitsandbytes_cpu.so"}  # torch's CUDA 13.0


def _name(name: str) -> str:
    return name.lower().replace("_", "-")


def resolve(requirements: list[str], work: Path) -> dict[str, str]:
    """{package: wheel URL} pip would install for the device's Python."""
    report = work / "report.json"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run",
                    "--ignore-installed", *DEVICE_PYTHON, "--target", str(work / "none"),
                    "--report", str(report), *requirements], check=True)
    return {_name(item["metadata"]["name"]): item["download_info"]["url"]
            for item in json.loads(report.read_text())["install"]}


def fetch(url: str, into: Path) -> Path:
    wheel = into / url.rsplit("/", 1)[-1]
    if url.startswith("file://"):
        shutil.copy(url.removeprefix("file://"), wheel)
    else:
        with urllib.request.urlopen(url) as answer, wheel.open("wb") as out:
            shutil.copyfileobj(answer, out)
    return wheel


def trim(site: Path) -> None:
    for pattern in DROP:
        for path in site.glob(pattern):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    for lib in site.glob("bitsandbytes/libbitsandbytes_*"):
        if lib.name not in BNB_KEEP:
            lib.unlink()
    # A wheel has no links: pyarrow's three copies of each of its Python libraries become one.
    for real in site.glob("pyarrow/libarrow_python*.so.*.*.*"):
        for alias in (real.with_name(real.name.rsplit(".", 2)[0]),
                      real.with_name(real.name.split(".so")[0] + ".so")):
            if alias.exists():
                alias.unlink()
                alias.symlink_to(real.name)


def build(archive: str, out: Path, work: Path) -> Path:
    stage = work / archive.removesuffix(".tar.xz")
    requirements, directories = SITES[archive]
    urls = resolve(requirements, work)
    for directory, keep in directories.items():
        missing = keep - urls.keys()
        if missing:
            raise SystemExit(f"{directory}: pip resolved no {', '.join(sorted(missing))}")
        site = stage / directory
        site.mkdir(parents=True)
        for name in sorted(keep):
            with zipfile.ZipFile(fetch(urls[name], work)) as wheel:
                wheel.extractall(site)
        trim(site)
    target = out / archive
    with target.open("wb") as xz_out:
        tar = subprocess.Popen(["tar", "-C", str(stage), "-cf", "-",
                                *directories], stdout=subprocess.PIPE)
        subprocess.run(["xz", "-T0", "-9"], stdin=tar.stdout, stdout=xz_out, check=True)
        if tar.wait():
            raise SystemExit(f"tar of {stage} failed")
    return target


def split(archive: Path, part_bytes: int = PART_BYTES) -> list[Path]:
    """`archive` as it is if it is at most `part_bytes`, else its parts (`.00`, `.01`, ...),
    which joined in name order are the archive."""
    if archive.stat().st_size <= part_bytes:
        return [archive]
    parts = []
    with archive.open("rb") as whole:
        while chunk := whole.read(part_bytes):
            parts.append(archive.with_name(f"{archive.name}.{len(parts):02d}"))
            parts[-1].write_bytes(chunk)
    archive.unlink()
    return parts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=".peers", type=Path)
    parser.add_argument("--only", choices=sorted(SITES), help="one archive")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for archive in [args.only] if args.only else SITES:
        for stale in args.out.glob(f"{archive}.[0-9][0-9]"):
            stale.unlink()
        with tempfile.TemporaryDirectory() as work:
            targets = split(build(archive, args.out, Path(work)))
        for target in targets:
            print(f"{target}: {target.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
