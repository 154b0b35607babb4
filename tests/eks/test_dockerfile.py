"""The trainer's two Dockerfiles parse and name only pinned versions. The base's (CUDA, EFA,
aws-ofi-nccl) cannot be built here (no nvidia/cuda image, no EFA download): this file is what checks
it. The trainer's is also built and run on a Debian base by tests/eks/test_image_buildah.py."""

from __future__ import annotations

import fnmatch
import io
import re
import shlex
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

from finetune.image import BASE_DOCKERFILE, IMAGE_CONTEXT, TRAINER_DOCKERFILE, context_files

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / TRAINER_DOCKERFILE
BASE = REPO / BASE_DOCKERFILE
# Global ARGs without a default that every builder passes (and the trainer's tag hashes).
SUPPLIED_ARGS = ("BASE_IMAGE",)
_PINNED_REQUIREMENT = re.compile(r"^[A-Za-z0-9][\w.\-\[\],]*==[\w.+!-]+$")


def _substitute(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), text)


def pinning_problems(dockerfile: str, requirements: dict[str, str],
                     supplied: tuple[str, ...] = ()) -> list[str]:
    """Every reason the Dockerfile's FROM images, ARG versions or pip installs are not pinned.

    `requirements` maps the files a `pip install -r` may name to their text; `supplied` names the
    global ARGs the builders always pass (pinned by them)."""
    # A file object: given none, the parser writes ./Dockerfile.
    parser = DockerfileParser(fileobj=io.BytesIO(dockerfile.encode()))
    problems: list[str] = []
    args: dict[str, str] = {}
    stages: set[str] = set()
    seen_from = False
    for instr in parser.structure:
        kind, value = instr["instruction"], instr["value"]
        if kind == "ARG" and "=" in value:
            name, default = value.split("=", 1)
            default = _substitute(default.strip().strip('"'), args)
            if not seen_from:
                args[name.strip()] = default  # global ARGs: what FROM lines see
            if "latest" in default.lower():
                problems.append(f"ARG {name} = {default!r} names 'latest'")
            if name.endswith("_VERSION") and not re.match(r"^\d+(\.\d+)+$", default):
                problems.append(f"ARG {name} = {default!r} is not an exact version")
        elif kind == "ARG" and not seen_from and value.strip() not in supplied:
            problems.append(f"global ARG {value} has no default: FROM would be unpinned")
        elif kind == "FROM":
            seen_from = True
            words = value.split()
            image = _substitute(words[0], args)
            if len(words) >= 3 and words[1].upper() == "AS":
                stages.add(words[2])
            if image in stages or image.strip("${}") in supplied:
                continue
            if "$" in image:
                problems.append(f"FROM {words[0]}: unresolved build argument")
            elif "@sha256:" not in image:
                tag = image.rsplit("/", 1)[-1].partition(":")[2]
                if not tag or tag == "latest":
                    problems.append(f"FROM {image}: no pinned tag or digest")
        elif kind == "RUN":
            for command in re.split(r"&&|;|\|\|", value):
                words = shlex.split(command)
                if words[:2] in (["pip", "install"], ["pip3", "install"]) or \
                        words[1:4] == ["-m", "pip", "install"]:
                    problems += _pip_problems(words, requirements)
            if re.search(r"\blatest\b", value):
                problems.append(f"RUN names 'latest': {value[:80]}")
    return problems


def _pip_problems(words: list[str], requirements: dict[str, str]) -> list[str]:
    problems = []
    rest = iter(words[words.index("install") + 1:])
    for word in rest:
        if word in ("-r", "--requirement"):
            path = next(rest)
            text = requirements.get(path)
            if text is None:
                problems.append(f"pip install -r {path}: not a known requirements file")
                continue
            for line in text.splitlines():
                line = line.split("#", 1)[0].strip()
                if line and not _PINNED_REQUIREMENT.match(line):
                    problems.append(f"{path}: {line!r} is not pinned with ==")
        elif word in ("--extra-index-url", "--index-url", "-i", "-c"):
            next(rest)
        elif not word.startswith("-") and not _PINNED_REQUIREMENT.match(word):
            problems.append(f"pip install {word}: not pinned with ==")
    return problems


def shipped_requirements() -> dict[str, str]:
    """The requirements files the Dockerfile copies in, under their path in the image."""
    content = DOCKERFILE.read_text()
    copies = re.findall(r"^COPY\s+(\S+)\s+(\S+)$", content, re.M)
    return {dest: (REPO / src).read_text() for src, dest in copies
            if src.endswith("requirements.txt")}


def test_trainer_and_base_dockerfiles_pin_every_image_version_and_package():
    assert pinning_problems(DOCKERFILE.read_text(), shipped_requirements(), SUPPLIED_ARGS) == []
    assert pinning_problems(BASE.read_text(), {}) == []


def test_trainer_image_is_built_from_the_supplied_base_only():
    parser = DockerfileParser(str(DOCKERFILE))
    froms = [i["value"] for i in parser.structure if i["instruction"] == "FROM"]
    assert froms == ["${BASE_IMAGE}"]
    assert re.search(r"^ARG BASE_IMAGE$", DOCKERFILE.read_text(), re.M)  # no default to drift


def test_trainer_image_installs_the_torch_the_trainer_pins():
    reqs = shipped_requirements()
    assert reqs, "the Dockerfile installs trainer/requirements.txt"
    pinned = (REPO / "trainer" / "requirements.txt").read_text()
    assert re.search(r"^torch==\S+$", pinned, re.M)
    assert pinned in reqs.values()


def test_base_image_has_cuda_efa_checked_by_its_checksum_and_aws_ofi_nccl():
    content = BASE.read_text()
    for name in ("CUDA_VERSION", "EFA_INSTALLER_VERSION", "AWS_OFI_NCCL_VERSION"):
        assert re.search(rf"^ARG {name}=\d", content, re.M), name
    assert re.search(r"^ARG EFA_INSTALLER_SHA256=[0-9a-f]{64}$", content, re.M)
    # Both downloads of the installer are checked against the pinned checksum.
    assert content.count("efa_installer.sh") == content.count("sha256sum -c") == 2
    assert "--with-libfabric=/opt/amazon/efa" in content
    assert "nvidia/cuda:" in content and "ubuntu" in content
    assert "python3-venv" in content  # what the trainer image needs of its base
    assert not re.search(r"^COPY\s+(?!--from)", content, re.M)  # nothing from the context


def test_trainer_image_has_a_venv_and_a_non_root_user():
    parser = DockerfileParser(str(DOCKERFILE))
    args = parser.args  # the final stage's
    content = DOCKERFILE.read_text()
    assert "python3 -m venv /opt/venv" in content
    user = [i["value"] for i in parser.structure if i["instruction"] == "USER"]
    assert user and user[-1] not in ("root", "0")
    assert args["TRAINER_UID"] != "0"
    # Ships only what the content hash covers: the image tag changes exactly when it should.
    sources = re.findall(r"^COPY\s+(?!--from)(?:--\S+\s+)*(\S+)\s", content, re.M)
    context = tuple(f"{part}/" for part in IMAGE_CONTEXT)
    assert sources and all(s.startswith(context) for s in sources)


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether a .dockerignore's `patterns` leave `path` (or a folder above it) out: the last
    matching pattern decides, `!` takes back in (Docker's rules, without character classes)."""
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    out = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        glob = pattern.removeprefix("!").strip("/")
        globs = {glob, glob.replace("**/", "")} if glob.startswith("**/") else {glob}
        if any(fnmatch.fnmatchcase(c, g) and c.count("/") == g.count("/")
               for c in candidates for g in globs if "**" not in g):
            out = not keep
        elif any(fnmatch.fnmatchcase(c, g) for c in candidates for g in globs if "**" in g):
            out = not keep
    return out


def ignore_patterns(dockerfile: Path) -> list[str]:
    lines = (dockerfile.parent / f"{dockerfile.name}.dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_every_file_the_dockerfile_copies_survives_its_dockerignore():
    patterns = ignore_patterns(DOCKERFILE)
    sources = re.findall(r"^COPY\s+(?!--from)(?:--\S+\s+)*(\S+)\s", DOCKERFILE.read_text(), re.M)
    copied = [f.as_posix() for f in context_files(REPO)
              if any(f.as_posix().startswith(s.rstrip("/")) for s in sources)]
    assert copied and [f for f in copied if dockerignored(f, patterns)] == []
    # The check sees an ignore that swallows a copied folder (the bug it was written for).
    assert dockerignored("plugins/finetune_contract/fields.py", ["plugins"])
    assert not dockerignored("plugins/finetune_contract/fields.py",
                             ["plugins/*", "!plugins/finetune_contract"])
    assert dockerignored("trainer/__pycache__/x.pyc", ["**/__pycache__"])


def test_dockerignore_sits_beside_each_dockerfile():
    ignore = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().split()
    assert "**/__pycache__" in ignore and "tests" in ignore
    assert "*" in (BASE.parent / "Dockerfile.dockerignore").read_text().split()


@pytest.mark.parametrize(("snippet", "needle"), [
    ("FROM python:latest\n", "no pinned tag"),
    ("FROM python\n", "no pinned tag"),
    ("ARG BASE\nFROM ${BASE}\n", "no default"),
    ("ARG BASE_IMAGE\nARG OTHER\nFROM ${BASE_IMAGE}\n", "OTHER has no default"),
    ("ARG EFA_INSTALLER_VERSION=latest\nFROM python:3.12\n", "latest"),
    ("FROM python:3.12\nRUN pip install torch\n", "pip install torch"),
    ("FROM python:3.12\nRUN pip install -U transformers==5.0 accelerate\n", "accelerate"),
    ("FROM python:3.12\nRUN pip install -r /tmp/req.txt\n", "torch>=2"),
])
def test_pin_check_catches_unpinned_versions(snippet, needle):
    problems = pinning_problems(snippet, {"/tmp/req.txt": "torch>=2\n"}, SUPPLIED_ARGS)
    assert any(needle in p for p in problems), problems
