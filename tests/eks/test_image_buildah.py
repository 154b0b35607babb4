"""The trainer image, for real: its Dockerfile built with buildah on a Debian base made here (the
CPU torch wheel instead of the CUDA one), pushed to a local registry that requires the
credentials ECR's get_authorization_token gives (moto answering, the eks target's code path with
the registry's endpoint swapped), pulled back by digest into a fresh store and run: the demo
training as the image's non-root user, its loss falling and its exported model loading. The
base's CUDA and EFA layers cannot be built here: tests/eks/test_dockerfile.py checks their pins."""

from __future__ import annotations

import json
import re
import tarfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from finetune.image import TRAINER_DOCKERFILE, image_tag
from finetune.targets.eks import buildah
from finetune.targets.eks.image_build import ImageBuildError, pack_context, registry_credentials
from tests.support import REPO_ROOT
from tests.support.buildah import (
    TORCH_INDEX,
    commit_base,
    cpu_torch_index,
    debian_rootfs_tarball,
    image_tools_or_skip,
    registry,
    run,
)

pytestmark = pytest.mark.slow
BASE_REF = "localhost/finetune-test-base:bookworm"
REPOSITORY = "finetune-trainer"
STEPS = 30


@pytest.fixture
def tools() -> dict[str, str]:
    return image_tools_or_skip()


@pytest.fixture(scope="module")
def module_store(tmp_path_factory) -> Iterator[tuple[Path, Path]]:
    """A buildah store (vfs) holding the Debian base, one for the module (committing the base
    takes a while; each test adds images under names of its own): (graphroot, runroot), also
    buildah's default store for the module (CONTAINERS_STORAGE_CONF), as the stage uses that."""
    image_tools_or_skip()
    root = tmp_path_factory.mktemp("buildah")
    graph, run_root = root / "graph", root / "graph-run"
    conf = root / "storage.conf"
    conf.write_text(f'[storage]\ndriver = "vfs"\ngraphroot = "{graph}"\n'
                    f'runroot = "{run_root}"\n')
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CONTAINERS_STORAGE_CONF", str(conf))
        commit_base(buildah.storage_args(graph, run_root), debian_rootfs_tarball(), BASE_REF)
        yield graph, run_root


@pytest.fixture
def store(tools, module_store) -> list[str]:
    """The module's buildah store, named by its root, holding the Debian base."""
    return buildah.storage_args(*module_store)


@pytest.fixture
def ecr_registry(aws, tmp_path):
    """(host:port, user, password): a registry requiring what ECR's token says."""
    _, user, password = registry_credentials(boto3.client("ecr", region_name="us-east-1"))
    (tmp_path / "registry").mkdir()
    with registry(tmp_path / "registry", user, password) as host:
        yield host, user, password


def context_dir(tmp_path: Path) -> Path:
    """The build context exactly as the eks builders send it (pack_context)."""
    context = tmp_path / "context"
    archive = tmp_path / "context.tar.gz"
    archive.write_bytes(pack_context(REPO_ROOT, "tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(context, filter="data")
    return context


def manifest(host: str, user: str, password: str, ref: str) -> dict:
    import base64

    request = urllib.request.Request(f"http://{host}/v2/{REPOSITORY}/manifests/{ref}", headers={
        "Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode(),
        "Accept": "application/vnd.oci.image.manifest.v1+json, "
                  "application/vnd.docker.distribution.manifest.v2+json"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.loads(resp.read())


def test_trainer_image_built_pushed_pulled_by_digest_runs_the_demo_as_its_user(
        store, ecr_registry, tmp_path):
    host, user, password = ecr_registry
    tag = image_tag(REPO_ROOT, base=BASE_REF)
    local_ref = f"localhost/{REPOSITORY}:{tag}"
    started = time.monotonic()
    buildah.build(context_dir(tmp_path), TRAINER_DOCKERFILE, local_ref,
                  {"BASE_IMAGE": BASE_REF, "TORCH_INDEX_URL": f"file://{TORCH_INDEX}"},
                  storage=store, volumes=[f"{cpu_torch_index()}:{TORCH_INDEX}:ro"],
                  log_path=tmp_path / "build.log", timeout=1500)
    build_s = time.monotonic() - started
    print(f"\nbuilt {local_ref} in {build_s:.0f} s", flush=True)
    destination = f"{host}/{REPOSITORY}:{tag}"
    started = time.monotonic()
    digest = buildah.push(local_ref, destination, host, user, password, storage=store,
                          tls_verify=False)
    push_s = time.monotonic() - started
    assert digest.startswith("sha256:")
    pushed = manifest(host, user, password, digest)
    size = sum(layer["size"] for layer in pushed["layers"])

    # Pulled back by digest into a store that never saw the build.
    fresh = buildah.storage_args(tmp_path / "fresh", tmp_path / "fresh-run")
    auth = tmp_path / "pull-auth.json"
    from finetune.targets.eks.image_build import dockerconfigjson
    auth.write_text(dockerconfigjson(host, user, password))
    started = time.monotonic()
    run(["buildah", *fresh, "pull", "--quiet", "--authfile", str(auth), "--tls-verify=false",
         f"docker://{host}/{REPOSITORY}@{digest}"], timeout=900)
    pull_s = time.monotonic() - started
    print(f"pushed {size / 2**20:.0f} MiB (compressed layers) in {push_s:.0f} s, pulled by "
          f"digest {digest} in {pull_s:.0f} s", flush=True)
    auth.unlink()
    ctr = run(["buildah", *fresh, "from", "--quiet", f"{host}/{REPOSITORY}@{digest}"]
              ).stdout.strip()
    config = json.loads(run(["buildah", *fresh, "inspect", "--type", "image",
                             f"{host}/{REPOSITORY}@{digest}"]).stdout)["OCIv1"]["config"]
    assert config["User"] == "trainer" and config["WorkingDir"] == "/app"
    out = tmp_path / "out"
    out.mkdir(mode=0o777)
    out.chmod(0o777)  # the image's user (uid 1000) writes here

    def inside(*command: str, timeout: float = 900) -> str:
        # buildah run takes the image's user, working dir and environment (the venv's PATH).
        return run(["buildah", *fresh, "run", "--isolation", "chroot", "--network", "host",
                    "--volume", f"{out}:/out", ctr, "--", *command], timeout=timeout).stdout

    assert inside("id", "-un").strip() == "trainer"
    started = time.monotonic()
    # --local-addr: the container's hostname does not resolve inside it.
    inside("python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           "--local-addr=127.0.0.1",
           "-m", "trainer.train", "--output_dir", "/out", "--max_steps", str(STEPS),
           "--eval_interval", str(STEPS), "--log_interval", "10", "--lr", "3e-3")
    train_s = time.monotonic() - started
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.1, summary
    loaded = inside("python", "-c",
                    "from transformers import AutoModelForCausalLM; "
                    "m = AutoModelForCausalLM.from_pretrained('/out/model'); "
                    "print(type(m).__name__, sum(p.numel() for p in m.parameters()))")
    assert loaded.split()[0].endswith("ForCausalLM") and int(loaded.split()[1]) > 0
    # du exits 1 on what the non-root user cannot read (/root): its total is still printed.
    rootfs = int(inside("sh", "-c", "du -sxk / 2>/dev/null; true").split()[0]) * 1024
    print(f"\ntrainer image {tag} ({digest[:19]}): {size / 2**20:.0f} MiB pushed "
          f"(compressed layers), {rootfs / 2**20:.0f} MiB rootfs; build {build_s:.0f} s, "
          f"push {push_s:.0f} s, pull {pull_s:.0f} s, training {train_s:.0f} s; loss "
          f"{summary['initial_eval_loss']:.3f} -> {summary['final_eval_loss']:.3f}")


def test_push_with_wrong_credentials_names_the_registry_never_the_password(store, ecr_registry):
    host, user, password = ecr_registry
    wrong = "not-" + password[:8] + "-the-token"
    with pytest.raises(ImageBuildError) as err:
        buildah.push(BASE_REF, f"{host}/{REPOSITORY}:refused", host, user, wrong,
                     storage=store, tls_verify=False, connection="aws_default")
    message = str(err.value)
    assert f"registry {host} refused the credentials" in message
    assert "aws_default" in message and wrong not in message and password not in message


# -- image_builder buildah: the build_image stage's own build, where Airflow runs ---------------

ECR_MANIFEST = json.dumps({"schemaVersion": 2,
                           "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                           "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                                      "size": 2, "digest": "sha256:" + "0" * 64},
                           "layers": []})


@pytest.fixture
def stage_store(tools, module_store) -> list[str]:
    """buildah's default store (what the stage uses), the module's, holding the Debian base
    (stage_build tags it as the pipeline's base in ECR, so the build does not pull it)."""
    return buildah.storage_args()


def stage_build(repo_copy: Path, storage: list[str]):
    """start_image (the build_image stage's build) with image_builder buildah on `repo_copy`,
    the base already in ECR (moto) and in the local store; ECR's describe_images afterwards."""
    from finetune.image import base_tag
    from finetune.targets.eks.image_build import ensure_repository, start_image
    from tests.support.eks import eks_config

    session = boto3.Session(region_name="us-east-1")
    ecr = session.client("ecr")
    uri = ensure_repository(ecr, REPOSITORY)
    ecr.put_image(repositoryName=REPOSITORY, imageManifest=ECR_MANIFEST,
                  imageTag=base_tag(repo_copy))
    run(["buildah", *storage, "tag", BASE_REF, f"{uri}:{base_tag(repo_copy)}"])
    cfg = eks_config(image="", image_builder="buildah", image_repository=REPOSITORY)
    with pytest.raises(ImageBuildError) as err:
        start_image(cfg, session, lambda: None, root=repo_copy, timeout=600)
    tags = [t for image in ecr.describe_images(repositoryName=REPOSITORY)["imageDetails"]
            for t in image.get("imageTags", [])]
    return str(err.value), tags, f"{uri}:{image_tag(repo_copy)}"


def test_buildah_build_missing_a_file_fails_with_the_log_tail_and_tags_nothing(
        aws, stage_store, repo_copy):
    (repo_copy / "trainer" / "requirements.txt").unlink()
    message, tags, ref = stage_build(repo_copy, stage_store)
    assert f"buildah build of {TRAINER_DOCKERFILE} as {ref} failed" in message
    assert "requirements.txt" in message.split("last lines of the build log:")[1]
    assert all(t.startswith("base-") for t in tags)  # only the base: no trainer tag
    images = run(["buildah", *stage_store, "images", "--format", "{{.Name}}:{{.Tag}}"]).stdout
    assert ref not in images


def test_buildah_build_with_a_bad_pin_fails_with_pips_error_and_tags_nothing(
        aws, stage_store, repo_copy):
    requirements = repo_copy / "trainer" / "requirements.txt"
    text = requirements.read_text()
    requirements.write_text(re.sub(r"^safetensors==\S+", "safetensors==999.0.0", text, flags=re.M))
    message, tags, ref = stage_build(repo_copy, stage_store)
    assert f"buildah build of {TRAINER_DOCKERFILE} as {ref} failed" in message
    assert "safetensors==999.0.0" in message  # pip's own line, in the tail
    assert all(t.startswith("base-") for t in tags)
