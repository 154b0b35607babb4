"""The trainer image for the eks target: build it once per content hash, push it to ECR, verify.

- Two images in the run's ECR repository: the base (containers/trainer-base/: CUDA, EFA,
  aws-ofi-nccl; tag `image.base_tag()`, built only when missing) and the trainer FROM it
  (containers/trainer/; tag `image.image_tag()`, the content hash of trainer/, the contract and
  containers/ with the base's reference). The repository is created when missing (scan on push,
  immutable tags); a trainer tag already in ECR skips the build.
- Builders (param `image_builder`; a set `image` param means `prebuilt`):
  - `buildkit`: the build context goes to S3 as tar.gz; a Kubernetes Job runs rootless BuildKit
    (daemonless), its init container fetches the context through a presigned URL, and the push
    credentials come from ECR `get_authorization_token` as a dockerconfigjson Secret that is
    deleted whatever the outcome;
  - `codebuild`: the same files as a zip in S3, built by an AWS CodeBuild project;
  - `buildah`: built and pushed by the task itself, where Airflow runs (buildah.py: no daemon);
  - `prebuilt`: the user's image, verified in ECR when it is an ECR image.

Service calls and pure builders only: `start_image` starts a build, `finish_image` cleans up
and verifies; the wait between them is a trigger's (`ImageBuildTrigger`), which reads the build
with `build_job_state` or `codebuild_state`.

A run records the build it waits on (a ConfigMap of the run: `record_build`) until it is done
with it, so that its teardown stops a build left running when the task was killed while
deferred (`release_run_builds`): its CodeBuild build, or the BuildKit Job and its registry
Secret, unless another run waits on that Job (it adopted it: the build of the same tag is its
build too, and the Job's deadline still bounds it).
"""

from __future__ import annotations

import base64
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from finetune import REPO_ROOT
from finetune.config import RunConfig
from finetune.image import BASE_DOCKERFILE, TRAINER_DOCKERFILE, base_tag, image_tag
from finetune.targets.eks.clients import adopt_or_create, create_or_replace, delete_object
from finetune.targets.eks.manifests import (
    APP,
    LABEL_APP,
    LABEL_PROGRAM,
    LABEL_RUN,
    job_name,
    run_labels,
    run_selector,
)
from finetune.targets.eks.registry import (
    LOG_TAIL_LINES,
    ImageBuildError,
    dockerconfigjson,
    pack_context,
    registry_credentials,
)
from finetune_contract.fields import quoted
from finetune_contract.rules import bucket_problem

log = logging.getLogger(__name__)

# Versions of what runs the build; pinned so a build today and in a year use the same tools.
BUILDKIT_IMAGE = "moby/buildkit:v0.23.2-rootless"
CONTEXT_FETCH_IMAGE = "busybox:1.37.0"
CODEBUILD_IMAGE = "aws/codebuild/amazonlinux-x86_64-standard:5.0"
CODEBUILD_COMPUTE = "BUILD_GENERAL1_LARGE"

CONTEXT_PREFIX = "finetune-build-context"
# The build context's archive for each builder that fetches it from S3 (CodeBuild's S3 source
# must be a zip).
CONTEXT_FORMATS = {"buildkit": "tar.gz", "codebuild": "zip"}
# The Job may wait for a node before its init container fetches the context.
CONTEXT_URL_TTL_S = 2 * 3600
BUILD_TIMEOUT_S = 3 * 3600
BUILD_CONTAINER = "buildkit"
BASE_BUILD_CONTAINER = "buildkit-base"
FETCH_CONTAINER = "fetch-context"
WORKSPACE = "/workspace"
# Rootless BuildKit runs as uid 1000 with this home (moby/buildkit's rootless image).
BUILDKIT_UID = 1000
BUILDKIT_HOME = "/home/user"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
LABEL_IMAGE_TAG = "finetune.airflow.apache.org/image-tag"
# The program label of a run's record of the build it waits on (record_build).
BUILD_RECORD = "image-build"
JOB_TTL_AFTER_FINISHED_S = 3600
BUILD_RESOURCES = {"requests": {"cpu": "4", "memory": "16Gi", "ephemeral-storage": "60Gi"},
                   "limits": {"memory": "32Gi", "ephemeral-storage": "100Gi"}}

_ECR_URI = re.compile(r"^(?P<account>\d{12})\.dkr\.ecr\.(?P<region>[a-z0-9-]+)\.amazonaws\.com"
                      r"(?:\.cn)?/(?P<repo>[a-z0-9._/-]+?)(?::(?P<tag>[\w][\w.-]{0,127}))?"
                      r"(?:@(?P<digest>sha256:[0-9a-f]{64}))?$")


# -- validate --------------------------------------------------------------------------------


def effective_builder(image: str, image_builder: str) -> str:
    """A set `image` is a prebuilt image whatever `image_builder` says."""
    return "prebuilt" if image else image_builder


def image_param_errors(values: dict[str, Any]) -> list[tuple[str, str]]:
    """Validate-time checks of the image params on eks: (field, message) per problem. Each
    value's own form (an image reference, an ECR repository name, a role ARN) is the contract's
    text rule (finetune_contract.fields.TEXTS), checked before this; here: what the builder
    needs."""
    builder = effective_builder(values["image"], values["image_builder"])
    if builder == "prebuilt":
        if not values["image"]:
            return [("image", "is required with image_builder prebuilt: the image reference "
                     "(registry/repository:tag)")]
        return []
    if builder == "buildah":  # no context upload: the build runs here
        if shutil.which("buildah") is None:
            return [("image_builder", "buildah is not installed where Airflow runs (not on "
                     "PATH): install it on the workers (apt-get install buildah, or make "
                     "system-deps) or use image_builder buildkit or codebuild")]
        return []
    errors = []
    bucket = values["build_bucket"]
    if not bucket:
        errors.append(("build_bucket", f"is required to build the image with {builder}: the S3 "
                       "bucket for the build context (or set image to a prebuilt image)"))
    elif bucket_problem(bucket):
        errors.append(("build_bucket", f"{quoted(bucket)} is not an S3 bucket name "
                       f"({bucket_problem(bucket)})"))
    if builder == "codebuild" and not values["codebuild_role"]:
        errors.append(("codebuild_role", "is required with image_builder codebuild: the IAM "
                       "role ARN the project runs as"))
    return errors


# -- pure builders ---------------------------------------------------------------------------


def context_key(tag: str, fmt: str) -> str:
    return f"{CONTEXT_PREFIX}/{tag}.{fmt}"


def build_job_name(tag: str) -> str:
    """One Job per tag: a second run of the same tree adopts the running build."""
    return f"finetune-image-{tag}"[:63]


def registry_secret_manifest(name: str, namespace: str, config_json: str,
                             labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/dockerconfigjson",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "data": {".dockerconfigjson": base64.b64encode(config_json.encode()).decode()},
    }


def buildctl_args(dockerfile: str, image_ref: str, build_args: dict[str, str]) -> list[str]:
    """`buildctl build` of one Dockerfile of the fetched context, pushed as `image_ref`."""
    dockerfile_dir, dockerfile_name = dockerfile.rsplit("/", 1)
    return ["build", "--frontend", "dockerfile.v0",
            "--local", f"context={WORKSPACE}",
            "--local", f"dockerfile={WORKSPACE}/{dockerfile_dir}",
            "--opt", f"filename={dockerfile_name}",
            *[a for k, v in sorted(build_args.items()) for a in ("--opt", f"build-arg:{k}={v}")],
            "--output", f"type=image,name={image_ref},push=true"]


def buildkit_job_manifest(name: str, namespace: str, image_ref: str, context_url: str,
                          secret_name: str, labels: dict[str, str], *, base_ref: str,
                          build_base: bool, deadline_s: int = BUILD_TIMEOUT_S) -> dict[str, Any]:
    """A Job that fetches the context from S3 and builds and pushes it with rootless BuildKit:
    the base first (an init container, when `build_base`), then the trainer FROM it."""
    rootless = {"runAsUser": BUILDKIT_UID, "runAsGroup": BUILDKIT_UID, "runAsNonRoot": True}
    fetch = {
        "name": FETCH_CONTAINER,
        "image": CONTEXT_FETCH_IMAGE,
        # A fixed script: the URL arrives as an environment variable, never pasted into it.
        "command": ["sh", "-c", f'set -e; wget -q -O /tmp/context.tar.gz "$CONTEXT_URL"; '
                    f"tar -xzf /tmp/context.tar.gz -C {WORKSPACE}"],
        "env": [{"name": "CONTEXT_URL", "value": context_url}],
        "securityContext": {**rootless, "allowPrivilegeEscalation": False},
        "volumeMounts": [{"name": "workspace", "mountPath": WORKSPACE}],
    }
    build = {
        "name": BUILD_CONTAINER,
        "image": BUILDKIT_IMAGE,
        "command": ["buildctl-daemonless.sh"],
        "args": buildctl_args(TRAINER_DOCKERFILE, image_ref, {"BASE_IMAGE": base_ref}),
        "env": [
            # No user namespaces for the build's RUN steps inside an unprivileged pod.
            {"name": "BUILDKITD_FLAGS", "value": "--oci-worker-no-process-sandbox"},
            {"name": "DOCKER_CONFIG", "value": f"{BUILDKIT_HOME}/.docker"},
        ],
        "securityContext": {**rootless, "seccompProfile": {"type": "Unconfined"},
                            "appArmorProfile": {"type": "Unconfined"}},
        "resources": BUILD_RESOURCES,
        "volumeMounts": [
            {"name": "workspace", "mountPath": WORKSPACE, "readOnly": True},
            {"name": "registry-auth", "mountPath": f"{BUILDKIT_HOME}/.docker", "readOnly": True},
            {"name": "buildkitd", "mountPath": f"{BUILDKIT_HOME}/.local/share/buildkit"},
        ],
    }
    base = {**build, "name": BASE_BUILD_CONTAINER,
            "args": buildctl_args(BASE_DOCKERFILE, base_ref, {})}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            # A failed build does not fix itself: the stage fails (ImageBuildError, no retry).
            "backoffLimit": 0,
            "activeDeadlineSeconds": deadline_s,
            "ttlSecondsAfterFinished": JOB_TTL_AFTER_FINISHED_S,
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,
                    "initContainers": [fetch, base] if build_base else [fetch],
                    "containers": [build],
                    "volumes": [
                        {"name": "workspace", "emptyDir": {}},
                        {"name": "buildkitd", "emptyDir": {}},
                        {"name": "registry-auth", "secret": {
                            "secretName": secret_name,
                            "items": [{"key": ".dockerconfigjson", "path": "config.json"}]}},
                    ],
                },
            },
        },
    }


def buildspec() -> str:
    """CodeBuild's steps; the image URIs, the registry and whether the base is built (BUILD_BASE
    1 or 0) come in as environment variables."""
    return (
        "version: 0.2\n"
        "env:\n"
        "  shell: bash\n"
        "phases:\n"
        "  build:\n"
        "    on-failure: ABORT\n"
        "    commands:\n"
        '      - aws ecr get-login-password --region "$AWS_REGION" | docker login --username AWS'
        ' --password-stdin "$REGISTRY"\n'
        f'      - if [ "$BUILD_BASE" = 1 ]; then docker build --file {BASE_DOCKERFILE}'
        ' --tag "$BASE_IMAGE" . && docker push "$BASE_IMAGE"; fi\n'
        f'      - docker build --file {TRAINER_DOCKERFILE} --build-arg BASE_IMAGE="$BASE_IMAGE"'
        ' --tag "$IMAGE_URI" .\n'
        '      - docker push "$IMAGE_URI"\n'
    )


def codebuild_project_name(repository: str) -> str:
    return "finetune-" + re.sub(r"[^A-Za-z0-9_-]", "-", repository)[:140]


# -- ECR and S3 ------------------------------------------------------------------------------


def ensure_repository(ecr: Any, name: str) -> str:
    """The repository's URI; created (scan on push, immutable tags) when missing."""
    try:
        repo = ecr.describe_repositories(repositoryNames=[name])["repositories"][0]
    except ecr.exceptions.RepositoryNotFoundException:
        repo = ecr.create_repository(
            repositoryName=name, imageTagMutability="IMMUTABLE",
            imageScanningConfiguration={"scanOnPush": True})["repository"]
        log.info("created ECR repository %s (scan on push, immutable tags)", repo["repositoryUri"])
    return repo["repositoryUri"]


def image_digest(ecr: Any, repository: str, tag: str, registry_id: str | None = None) -> str | None:
    """The digest of repository:tag in ECR, or None when it is not there."""
    extra = {"registryId": registry_id} if registry_id else {}
    try:
        details = ecr.describe_images(repositoryName=repository, imageIds=[{"imageTag": tag}],
                                      **extra)["imageDetails"]
    except (ecr.exceptions.ImageNotFoundException, ecr.exceptions.RepositoryNotFoundException):
        return None
    return details[0]["imageDigest"] if details else None


def upload_context(s3: Any, bucket: str, key: str, data: bytes) -> None:
    try:
        s3.put_object(Bucket=bucket, Key=key, Body=data)
    except s3.exceptions.NoSuchBucket:
        raise ImageBuildError(_no_bucket(bucket)) from None
    log.info("build context (%d bytes) uploaded to s3://%s/%s", len(data), bucket, key)


def _no_bucket(bucket: str) -> str:
    return (f"build_bucket {bucket} does not exist: the build context goes there; create it, "
            "or name another bucket (or a prebuilt image)")


def check_build_bucket(s3: Any, bucket: str, key: str) -> None:
    """Refuse a build_bucket that does not exist, by a one-byte read of the context's key
    (s3:GetObject, which the build needs anyway): a missing key answers NoSuchKey, or 403
    without s3:ListBucket; a missing bucket NoSuchBucket."""
    import botocore.exceptions

    try:
        s3.get_object(Bucket=bucket, Key=key, Range="bytes=0-0")
    except s3.exceptions.NoSuchBucket:
        raise ImageBuildError(_no_bucket(bucket)) from None
    except botocore.exceptions.ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in (
                "NoSuchKey", "AccessDenied", "403", "InvalidRange"):
            raise


def check_image_source(cfg: RunConfig, session: Any, root: Path = REPO_ROOT) -> None:
    """What build_image will need, checked before any node is asked for: a prebuilt ECR image
    is in ECR; a build's bucket exists (unless the trainer's tag is in ECR: no build)."""
    builder = effective_builder(cfg.image, cfg.image_builder)
    if builder == "prebuilt":
        use_prebuilt(session, cfg.image)
        return
    if builder not in ("buildkit", "codebuild"):  # buildah builds where Airflow runs
        return
    tag = image_tag(root)
    if image_digest(session.client("ecr"), cfg.image_repository, tag) is None:
        check_build_bucket(session.client("s3"), cfg.build_bucket,
                           context_key(tag, CONTEXT_FORMATS[builder]))


# -- the builders ----------------------------------------------------------------------------


def start_image(cfg: RunConfig, session: Any, kube_api: Callable[[], Any], *,
                timeout: float = BUILD_TIMEOUT_S, root: Path = REPO_ROOT) -> dict[str, Any]:
    """The first half: the image when no build is needed (`pending` None: prebuilt, or the tag
    is in ECR), else the build started and `pending` saying what to wait for (JSON-able)."""
    builder = effective_builder(cfg.image, cfg.image_builder)
    ecr = session.client("ecr")
    if builder == "prebuilt":
        return {**use_prebuilt(session, cfg.image), "pending": None}
    tag, base = image_tag(root), base_tag(root)
    repository_uri = ensure_repository(ecr, cfg.image_repository)
    ref, base_ref = f"{repository_uri}:{tag}", f"{repository_uri}:{base}"
    result = {"image": ref, "image_tag": tag, "base_image": base_ref, "builder": builder,
              "built": False}
    digest = image_digest(ecr, cfg.image_repository, tag)
    if digest:
        log.info("image %s is already in ECR (%s): build skipped", ref, digest)
        return {**result, "digest": digest, "pending": None}
    build_base = image_digest(ecr, cfg.image_repository, base) is None
    log.info("base image %s: %s", base_ref, "to build" if build_base else "in ECR, reused")
    if builder == "buildah":
        from finetune.targets.eks.buildah import build_and_push

        build_and_push(ecr, ref, base_ref, build_base, root=root, connection=cfg.aws_conn_id,
                       timeout=timeout)
        digest = image_digest(ecr, cfg.image_repository, tag)
        if not digest:
            raise ImageBuildError(f"buildah pushed {ref}, but it is not in ECR")
        log.info("built and pushed %s (%s)", ref, digest)
        return {**result, "built": True, "digest": digest, "pending": None}
    fmt = CONTEXT_FORMATS[builder]
    key = context_key(tag, fmt)
    s3 = session.client("s3")
    upload_context(s3, cfg.build_bucket, key, pack_context(root, fmt))
    log.info("building %s with %s", ref, builder)
    if builder == "buildkit":
        url = s3.generate_presigned_url("get_object", ExpiresIn=CONTEXT_URL_TTL_S,
                                        Params={"Bucket": cfg.build_bucket, "Key": key})
        pending = start_buildkit(kube_api(), ecr, cfg.namespace, ref, tag, url, base_ref=base_ref,
                                 build_base=build_base, timeout=timeout)
    else:
        pending = start_codebuild(session, cfg, ref, key, base_ref=base_ref,
                                  build_base=build_base, timeout=timeout)
    record_build(kube_api(), cfg, tag, pending)
    return {**result, "pending": pending}


def finish_image(cfg: RunConfig, session: Any, kube_api: Callable[[], Any],
                 started: dict[str, Any], state: str, message: str) -> dict[str, Any]:
    """The second half, once the wait ended in `state` ("Complete", "Failed", or "Running" when
    it timed out): clean up, report a failure with the build log's tail, verify the tag in ECR;
    the run's record of the build is deleted (it waits on it no more)."""
    pending = started["pending"]
    if pending is None:
        return {k: v for k, v in started.items() if k != "pending"}
    try:
        return _finish_build(cfg, session, kube_api, started, state, message)
    finally:
        forget_build(kube_api(), cfg)


def _finish_build(cfg: RunConfig, session: Any, kube_api: Callable[[], Any],
                  started: dict[str, Any], state: str, message: str) -> dict[str, Any]:
    pending = started["pending"]
    result = {k: v for k, v in started.items() if k != "pending"}
    ecr, ref = session.client("ecr"), started["image"]
    try:
        if pending["builder"] == "buildkit":
            finish_buildkit(kube_api(), pending, state, message,
                            shared=others_waiting(kube_api(), cfg, started["image_tag"]))
        else:
            finish_codebuild(session, pending, state)
    except ImageBuildError:
        # Immutable tags: a concurrent run may have pushed the same content first.
        digest = image_digest(ecr, cfg.image_repository, started["image_tag"])
        if not digest:
            raise
        log.info("this build failed, but %s was pushed meanwhile (another run): using it", ref)
        return {**result, "digest": digest}
    digest = image_digest(ecr, cfg.image_repository, started["image_tag"])
    if not digest:
        raise ImageBuildError(f"the {pending['builder']} build reported success, but {ref} is "
                              "not in ECR")
    log.info("built and pushed %s (%s)", ref, digest)
    return {**result, "built": True, "digest": digest}


def use_prebuilt(session: Any, image: str) -> dict[str, Any]:
    """The user's image: verified when it is in ECR, accepted as given otherwise."""
    m = _ECR_URI.match(image)
    tag = (m and m["tag"]) or (image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1]
                               else "latest")
    result = {"image": image, "image_tag": tag, "builder": "prebuilt", "built": False}
    if not m:
        log.info("using image %s as given (not in ECR: the nodes' pull will tell)", image)
        return result
    ecr = session.client("ecr", region_name=m["region"])
    ident = {"imageDigest": m["digest"]} if m["digest"] else {"imageTag": m["tag"] or "latest"}
    try:
        details = ecr.describe_images(repositoryName=m["repo"], registryId=m["account"],
                                      imageIds=[ident])["imageDetails"]
    except (ecr.exceptions.ImageNotFoundException, ecr.exceptions.RepositoryNotFoundException):
        details = []
    if not details:
        raise ImageBuildError(f"prebuilt image {image} is not in ECR (repository {m['repo']}, "
                              f"registry {m['account']}, region {m['region']})")
    log.info("using prebuilt image %s (%s)", image, details[0]["imageDigest"])
    return {**result, "digest": details[0]["imageDigest"]}


def start_buildkit(api: Any, ecr: Any, namespace: str, ref: str, tag: str, context_url: str, *,
                   base_ref: str, build_base: bool,
                   timeout: float = BUILD_TIMEOUT_S) -> dict[str, Any]:
    """Hand over ECR's push credentials as a Secret and create (or adopt) the BuildKit Job."""
    import kubernetes

    core, batch = kubernetes.client.CoreV1Api(api), kubernetes.client.BatchV1Api(api)
    name = build_job_name(tag)
    labels = {LABEL_APP: APP, LABEL_IMAGE_TAG: tag}
    secret = f"{name}-registry"
    registry, user, password = registry_credentials(ecr)
    secret_manifest = registry_secret_manifest(
        secret, namespace, dockerconfigjson(registry, user, password), labels)
    create_or_replace(core.create_namespaced_secret, core.replace_namespaced_secret,
                      secret_manifest)
    try:
        create_or_adopt_batch_job(batch, buildkit_job_manifest(
            name, namespace, ref, context_url, secret, labels, base_ref=base_ref,
            build_base=build_base, deadline_s=int(timeout)), "build Job")
    except BaseException:
        delete_registry_secret(core, namespace, secret)
        raise
    return {"builder": "buildkit", "namespace": namespace, "job": name, "secret": secret,
            "timeout": timeout}


def finish_buildkit(api: Any, pending: dict[str, Any], state: str, message: str,
                    shared: bool = False) -> None:
    """Fail with the pods' reasons and log tail unless the Job completed; the registry Secret is
    deleted, and a Job still running at the timeout is deleted too, unless another run waits on
    it (`shared`: it adopted it, and its deadline is later)."""
    import kubernetes

    core, batch = kubernetes.client.CoreV1Api(api), kubernetes.client.BatchV1Api(api)
    namespace, name = pending["namespace"], pending["job"]
    ended = state in ("Complete", "Failed")
    try:
        if state == "Failed":
            raise ImageBuildError(job_failure_report(core, namespace, name, message))
        if not ended:
            if not shared:
                delete_batch_job(batch, namespace, name)
            raise ImageBuildError(job_failure_report(
                core, namespace, name, f"no result after {pending['timeout']:.0f}s: " + (
                    "left to the other runs that wait on it" if shared
                    else "the Job was deleted")))
    finally:
        if ended or not shared:
            delete_registry_secret(core, namespace, pending["secret"])


def delete_registry_secret(core: Any, namespace: str, name: str) -> bool:
    """False when it was not there."""
    import kubernetes

    try:
        core.delete_namespaced_secret(name, namespace)
        log.info("deleted registry Secret %s/%s", namespace, name)
        return True
    except kubernetes.client.ApiException as exc:
        if exc.status != 404:
            raise
        return False


def build_job_state(job: dict[str, Any]) -> tuple[str, str]:
    """(Complete | Failed | Running, message) from a batch/v1 Job's status."""
    status = job.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("type") in ("Complete", "Failed") and cond.get("status") == "True":
            return cond["type"], f"{cond.get('reason', '')}: {cond.get('message', '')}".strip()
    backoff = (job.get("spec") or {}).get("backoffLimit", 6)
    if status.get("succeeded", 0) >= 1:
        return "Complete", ""
    if status.get("failed", 0) > backoff:
        return "Failed", f"{status['failed']} pod(s) failed"
    return "Running", ""


def job_failure_report(core: Any, namespace: str, name: str, message: str) -> str:
    """The Job's failure with each pod's reason and the tail of the failing container's log."""
    import kubernetes

    api = core.api_client
    pods = api.sanitize_for_serialization(core.list_namespaced_pod(
        namespace, label_selector=f"{JOB_NAME_LABEL}={name}"))["items"]
    parts = [f"image build Job {namespace}/{name} failed: {message}"]
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        pod_name = pod["metadata"]["name"]
        container, reason = _failed_container(pod)
        parts.append(f"pod {pod_name}: {reason}")
        try:
            resp = core.read_namespaced_pod_log(pod_name, namespace, container=container,
                                                tail_lines=LOG_TAIL_LINES, _preload_content=False)
            tail = resp.data.decode("utf-8", errors="replace")
        except kubernetes.client.ApiException:
            tail = ""
        if tail.strip():
            parts.append(f"  last lines of {pod_name} ({container}):\n" + "\n".join(
                "    " + line for line in tail.splitlines()[-LOG_TAIL_LINES:]))
    if len(parts) == 1:
        parts.append("no build pod found")
    return "\n".join(parts)


def _failed_container(pod: dict[str, Any]) -> tuple[str, str]:
    """(container whose log explains the failure, its reason): the context fetch or the build."""
    status = pod.get("status") or {}
    for key, default in (("initContainerStatuses", FETCH_CONTAINER),
                         ("containerStatuses", BUILD_CONTAINER)):
        for cs in status.get(key) or []:
            term = (cs.get("state") or {}).get("terminated") or {}
            if term.get("exitCode"):
                return cs.get("name", default), (f"{cs.get('name')} exited with code "
                                                 f"{term['exitCode']} ({term.get('reason', '')})")
    return BUILD_CONTAINER, f"phase {status.get('phase', 'Unknown')}"


# -- the run's record of the build it waits on -----------------------------------------------


def build_record_name(cfg: RunConfig) -> str:
    return f"{job_name(cfg)}-build"


def build_record_manifest(cfg: RunConfig, tag: str, pending: dict[str, Any]) -> dict[str, Any]:
    """A ConfigMap of the run naming the build it waits on (the BuildKit Job and Secret, or the
    CodeBuild build): labelled with the run, and with the tag, so that runs waiting on the same
    BuildKit Job see each other."""
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": build_record_name(cfg), "namespace": cfg.namespace,
                     "labels": {**run_labels(cfg), LABEL_PROGRAM: BUILD_RECORD,
                                LABEL_IMAGE_TAG: tag}},
        "data": {k: str(pending[k]) for k in ("builder", "job", "secret", "build_id")
                 if k in pending},
    }


def record_build(api: Any, cfg: RunConfig, tag: str, pending: dict[str, Any]) -> None:
    import kubernetes

    core = kubernetes.client.CoreV1Api(api)
    create_or_replace(core.create_namespaced_config_map, core.replace_namespaced_config_map,
                      build_record_manifest(cfg, tag, pending))


def forget_build(api: Any, cfg: RunConfig) -> None:
    import kubernetes

    delete_object(lambda: kubernetes.client.CoreV1Api(api).delete_namespaced_config_map(
        build_record_name(cfg), cfg.namespace), lambda: None)


def others_waiting(api: Any, cfg: RunConfig, tag: str) -> bool:
    """Whether another run records a wait on the build of `tag` (it adopted the same Job)."""
    import kubernetes

    records = kubernetes.client.CoreV1Api(api).list_namespaced_config_map(
        cfg.namespace, label_selector=f"{LABEL_APP}={APP},{LABEL_PROGRAM}={BUILD_RECORD},"
                                      f"{LABEL_IMAGE_TAG}={tag}").items
    return any((r.metadata.labels or {}).get(LABEL_RUN) != cfg.rdzv_id for r in records)


def release_run_builds(api: Any, cfg: RunConfig, codebuild: Callable[[], Any]) -> list[str]:
    """Teardown: the build the run still waited on (its task killed while deferred) stopped:
    its CodeBuild build, or its BuildKit Job with its pods and its registry Secret (an ECR
    token of 12 hours), unless another run waits on that Job; its record deleted. What was
    stopped or deleted."""
    import kubernetes

    core, batch = kubernetes.client.CoreV1Api(api), kubernetes.client.BatchV1Api(api)
    done = []
    for record in core.list_namespaced_config_map(
            cfg.namespace, label_selector=f"{run_selector(cfg)},{LABEL_PROGRAM}={BUILD_RECORD}"
    ).items:
        data, tag = record.data or {}, (record.metadata.labels or {}).get(LABEL_IMAGE_TAG, "")
        if data.get("builder") == "buildkit" and others_waiting(api, cfg, tag):
            log.info("build Job %s is left to the other runs that wait on it", data.get("job"))
        elif data.get("builder") == "buildkit":
            if delete_batch_job(batch, cfg.namespace, data["job"]):
                done.append(f"job/{data['job']}")
            # Background propagation leaves the pods to the garbage collector: delete them too.
            for pod in core.list_namespaced_pod(
                    cfg.namespace, label_selector=f"{JOB_NAME_LABEL}={data['job']}").items:
                if delete_object(lambda pod=pod: core.delete_namespaced_pod(
                        pod.metadata.name, cfg.namespace), lambda: None):
                    done.append(f"pod/{pod.metadata.name}")
            if delete_registry_secret(core, cfg.namespace, data["secret"]):
                done.append(f"secret/{data['secret']}")
        elif data.get("build_id"):
            client = codebuild()
            if codebuild_state(client, data["build_id"])[0] == "Running":
                client.stop_build(id=data["build_id"])
                log.info("stopped CodeBuild build %s", data["build_id"])
                done.append(f"codebuild/{data['build_id']}")
        forget_build(api, cfg)
    return done


def create_or_adopt_batch_job(batch: Any, manifest: dict[str, Any], what: str) -> None:
    """Create a batch/v1 Job (the build's, the prepare_data pod's); adopt a running one of the
    same name (an earlier try's, or a concurrent run's build of the same tag); replace a failed
    one."""
    import kubernetes

    namespace, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    try:
        job = batch.api_client.sanitize_for_serialization(
            batch.read_namespaced_job(name, namespace))
    except kubernetes.client.ApiException as exc:
        if exc.status != 404:
            raise
        job = None
    adopt_or_create(f"{what} {namespace}/{name}", job,
                    job is not None and build_job_state(job)[0] == "Failed",
                    create=lambda: batch.create_namespaced_job(namespace, manifest),
                    delete=lambda old: delete_batch_job(batch, namespace, old, wait=True))


def delete_batch_job(batch: Any, namespace: str, name: str, wait: bool = False) -> bool:
    """Delete a batch/v1 Job (Background: its pods go with it); with `wait`, until it is gone;
    False when it was not there."""
    return delete_object(
        lambda: batch.delete_namespaced_job(name, namespace, propagation_policy="Background"),
        lambda: batch.read_namespaced_job(name, namespace), wait=wait, timeout=60.0)


def start_codebuild(session: Any, cfg: RunConfig, ref: str, key: str, *, base_ref: str,
                    build_base: bool, timeout: float = BUILD_TIMEOUT_S) -> dict[str, Any]:
    """Create or update the CodeBuild project and start a build of the S3 context."""
    codebuild = session.client("codebuild")
    name = codebuild_project_name(cfg.image_repository)
    project = {
        "name": name,
        "source": {"type": "S3", "location": f"{cfg.build_bucket}/{key}",
                   "buildspec": buildspec()},
        "artifacts": {"type": "NO_ARTIFACTS"},
        "environment": {"type": "LINUX_CONTAINER", "image": CODEBUILD_IMAGE,
                        "computeType": CODEBUILD_COMPUTE,
                        # docker build needs the Docker daemon CodeBuild starts in this mode.
                        "privilegedMode": True},
        "serviceRole": cfg.codebuild_role,
        "timeoutInMinutes": max(5, min(2160, int(timeout // 60))),
    }
    if codebuild.batch_get_projects(names=[name])["projects"]:
        codebuild.update_project(**project)
    else:
        codebuild.create_project(**project)
        log.info("created CodeBuild project %s", name)
    registry = ref.split("/", 1)[0]
    build = codebuild.start_build(
        projectName=name, sourceTypeOverride="S3",
        sourceLocationOverride=f"{cfg.build_bucket}/{key}",
        environmentVariablesOverride=[
            {"name": "IMAGE_URI", "value": ref, "type": "PLAINTEXT"},
            {"name": "BASE_IMAGE", "value": base_ref, "type": "PLAINTEXT"},
            {"name": "BUILD_BASE", "value": str(int(build_base)), "type": "PLAINTEXT"},
            {"name": "REGISTRY", "value": registry, "type": "PLAINTEXT"},
            {"name": "DOCKER_BUILDKIT", "value": "1", "type": "PLAINTEXT"}])["build"]
    log.info("started CodeBuild build %s", build["id"])
    return {"builder": "codebuild", "build_id": build["id"], "timeout": timeout}


def codebuild_state(codebuild: Any, build_id: str) -> tuple[str, str]:
    """(Complete | Failed | Running, CodeBuild's status) of a build."""
    status = codebuild.batch_get_builds(ids=[build_id])["builds"][0]["buildStatus"]
    if status == "IN_PROGRESS":
        return "Running", status
    return ("Complete" if status == "SUCCEEDED" else "Failed"), status


def finish_codebuild(session: Any, pending: dict[str, Any], state: str) -> None:
    """Stop a build still running at the timeout; fail with the phases and the log's tail."""
    codebuild = session.client("codebuild")
    if state == "Running":
        codebuild.stop_build(id=pending["build_id"])
        raise ImageBuildError(f"CodeBuild build {pending['build_id']} did not finish in "
                              f"{pending['timeout']:.0f}s: stopped")
    if state != "Complete":
        build = codebuild.batch_get_builds(ids=[pending["build_id"]])["builds"][0]
        raise ImageBuildError(codebuild_failure_report(session, build))


def codebuild_failure_report(session: Any, build: dict[str, Any]) -> str:
    parts = [f"CodeBuild build {build['id']} ended {build['buildStatus']}"]
    for phase in build.get("phases") or []:
        if phase.get("phaseStatus") not in (None, "SUCCEEDED"):
            contexts = "; ".join(c.get("message", "") for c in phase.get("contexts") or [])
            parts.append(f"phase {phase['phaseType']}: {phase['phaseStatus']} {contexts}")
    logs = build.get("logs") or {}
    if logs.get("groupName") and logs.get("streamName"):
        try:
            events = session.client("logs").get_log_events(
                logGroupName=logs["groupName"], logStreamName=logs["streamName"],
                limit=LOG_TAIL_LINES, startFromHead=False)["events"]
        except Exception as exc:  # the log is extra detail: the failure is reported anyway
            events = [{"message": f"(log not readable: {exc})"}]
        parts.append("last lines of the build log:\n" + "\n".join(
            "    " + e["message"].rstrip() for e in events))
    if logs.get("deepLink"):
        parts.append(f"log: {logs['deepLink']}")
    return "\n".join(parts)
