"""build_image on eks against moto in server mode (ECR, S3, CodeBuild) and the Kubernetes emulator,
where the test plays the Job controller and BuildKit's push. No image is built here: the tests
prove the API calls, the manifests and the outcomes, up to what a container engine would do."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import tarfile
import threading
import time
import urllib.request
import zipfile
from typing import Any

import boto3
import kmock
import kubernetes
import kubernetes_validate
import pytest
from airflow.sdk.exceptions import AirflowFailException

from finetune.config import ConfigError, RunConfig
from finetune.image import BASE_DOCKERFILE, TRAINER_DOCKERFILE, base_tag, context_files, image_tag
from finetune.targets.eks.image_build import (
    BASE_BUILD_CONTAINER,
    BUILD_CONTAINER,
    BUILDKIT_IMAGE,
    FETCH_CONTAINER,
    JOB_NAME_LABEL,
    LABEL_IMAGE_TAG,
    ImageBuildError,
    build_job_name,
    build_record_name,
    buildkit_job_manifest,
    codebuild_project_name,
    ensure_repository,
    pack_context,
)
from finetune.targets.eks.target import EksTarget
from finetune.validate import validate_params
from tests.support.deferral import first_event, reloaded, run_deferred
from tests.support.eks import (
    EKS_PARAMS,
    FAST,
    SCALING,
    eks_config,
    run_stage,
    scaling,
    stage_operator,
)
from tests.support.kube import Cluster, add_nodes
from tests.support.schemas import K8S_VERSION

NS = "ml"
REPO_NAME = "finetune-trainer"
BUCKET = "ctx-bucket"
ROLE = "arn:aws:iam::123456789012:role/codebuild-finetune"
MANIFEST = json.dumps({"schemaVersion": 2,
                       "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                       "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                                  "size": 2, "digest": "sha256:" + "0" * 64},
                       "layers": []})


def build_config(**changes: Any) -> RunConfig:
    return eks_config(**{"image": "", "build_bucket": BUCKET, **changes})


@pytest.fixture
def session(aws: str, monkeypatch: pytest.MonkeyPatch) -> boto3.Session:
    """The AWS session the eks target builds with (the test hooks events onto it)."""
    from finetune.targets.eks import target

    s = boto3.Session(region_name="us-east-1")
    s.client("s3").create_bucket(Bucket=BUCKET)
    monkeypatch.setattr(target, "aws_session", lambda aws_conn_id: s)
    return s


@pytest.fixture
def kube(cluster: Cluster) -> Cluster:
    """The emulator, serving Jobs and Secrets too."""
    for res in ("batch/v1/jobs", "v1/secrets"):
        cluster.emulator.resources[res] = kmock.ResourceInfo(namespaced=True)
    return cluster


def push(session: boto3.Session, tag: str, repo: str = REPO_NAME) -> None:
    """What BuildKit's (or CodeBuild's) push does to ECR."""
    session.client("ecr").put_image(repositoryName=repo, imageManifest=MANIFEST, imageTag=tag)


def secret_names(cluster: Cluster) -> list[str]:
    core = kubernetes.client.CoreV1Api(cluster.api())
    return [s.metadata.name for s in core.list_namespaced_secret(NS).items]


class JobController(threading.Thread):
    """Plays the Job controller and BuildKit: waits for the build Job, records the registry
    Secret it mounts, makes its pod and log, pushes (or not) and sets the Job's status."""

    def __init__(self, cluster: Cluster, session: boto3.Session, outcome: str = "succeeded",
                 push: bool = True, log_lines: int = 3):
        super().__init__(daemon=True)
        self.cluster, self.session, self.outcome = cluster, session, outcome
        self.push, self.log_lines = push, log_lines
        self.job: dict[str, Any] | None = None
        self.secret: dict[str, Any] | None = None

    def run(self) -> None:
        api = self.cluster.api()
        batch, core = kubernetes.client.BatchV1Api(api), kubernetes.client.CoreV1Api(api)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (jobs := batch.list_namespaced_job(NS).items):
            time.sleep(0.02)
        if not jobs:
            return
        self.job = api.sanitize_for_serialization(jobs[0])
        name = self.job["metadata"]["name"]
        volumes = self.job["spec"]["template"]["spec"]["volumes"]
        secret = next(v["secret"]["secretName"] for v in volumes if "secret" in v)
        self.secret = api.sanitize_for_serialization(core.read_namespaced_secret(secret, NS))
        pod = f"{name}-x7k2p"
        failed = self.outcome == "failed"
        core.create_namespaced_pod(NS, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod, "namespace": NS, "labels": {JOB_NAME_LABEL: name}},
            "spec": {"containers": [{"name": BUILD_CONTAINER, "image": BUILDKIT_IMAGE}]},
            "status": {"phase": "Failed" if failed else "Succeeded", "containerStatuses": [{
                "name": BUILD_CONTAINER, "ready": False, "restartCount": 0, "image": "b",
                "imageID": "", "state": {"terminated": {"exitCode": 1 if failed else 0,
                                                        "reason": "Error"}}}]}})
        self.cluster.emulator.pod_logs[NS, pod] = [
            ("2026-11-29T10:00:00Z", f"#{i} build step {i}") for i in range(self.log_lines)]
        if self.push and not failed:
            push(self.session, name.removeprefix("finetune-image-"))
        batch.patch_namespaced_job_status(name, NS, {"status": {self.outcome: 1}})


def test_tag_already_in_ecr_skips_the_build(session):
    ensure_repository(session.client("ecr"), REPO_NAME)
    push(session, image_tag())
    result, events = run_deferred(stage_operator("build_image", build_config()))
    assert events == []  # no wait, and no cluster needed (the test has none)
    assert result["built"] is False and result["image_tag"] == image_tag()
    assert result["image"].endswith(f"/{REPO_NAME}:{image_tag()}") and result["digest"]
    # Nothing was uploaded either.
    assert "Contents" not in session.client("s3").list_objects_v2(Bucket=BUCKET)


def test_missing_repository_is_created_with_scan_on_push_and_immutable_tags(session):
    ecr = session.client("ecr")
    uri = ensure_repository(ecr, "team/trainer")
    repo = ecr.describe_repositories(repositoryNames=["team/trainer"])["repositories"][0]
    assert repo["imageScanningConfiguration"] == {"scanOnPush": True}
    assert repo["imageTagMutability"] == "IMMUTABLE"
    assert uri == repo["repositoryUri"] and ensure_repository(ecr, "team/trainer") == uri


def test_build_job_is_a_valid_kubernetes_job_with_the_context_and_secret_wired():
    ref, url = "123456789012.dkr.ecr.us-east-1.amazonaws.com/ft:0123abcd", "https://s3/x?sig=1"
    base = "123456789012.dkr.ecr.us-east-1.amazonaws.com/ft:base-0123"
    job = buildkit_job_manifest("finetune-image-0123abcd", NS, ref, url, "reg-auth",
                                {"app": "x"}, base_ref=base, build_base=False)
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    pod = job["spec"]["template"]["spec"]
    (fetch,), (build,) = pod["initContainers"], pod["containers"]
    assert f"build-arg:BASE_IMAGE={base}" in build["args"]
    assert f"filename={TRAINER_DOCKERFILE.rsplit('/', 1)[1]}" in build["args"]
    assert fetch["name"] == FETCH_CONTAINER
    assert {"name": "CONTEXT_URL", "value": url} in fetch["env"]
    assert url not in " ".join(fetch["command"])  # passed by variable, not pasted in a script
    assert build["image"] == BUILDKIT_IMAGE and build["image"].endswith("-rootless")
    assert build["command"] == ["buildctl-daemonless.sh"]
    assert f"type=image,name={ref},push=true" in build["args"]
    auth = next(v for v in pod["volumes"] if v["name"] == "registry-auth")
    assert auth["secret"] == {"secretName": "reg-auth",
                              "items": [{"key": ".dockerconfigjson", "path": "config.json"}]}
    docker_config = next(e["value"] for e in build["env"] if e["name"] == "DOCKER_CONFIG")
    assert {"name": "registry-auth", "mountPath": docker_config, "readOnly": True} in \
        build["volumeMounts"]
    workspace = {m["mountPath"] for c in (fetch, build) for m in c["volumeMounts"]
                 if m["name"] == "workspace"}
    assert len(workspace) == 1  # the fetched context is what BuildKit builds
    assert build["securityContext"]["runAsNonRoot"] and pod["restartPolicy"] == "Never"
    assert "AWS_" not in json.dumps(job)  # no credentials in the manifest


@pytest.mark.slow
def test_buildkit_build_pushes_verifies_and_deletes_the_secret(session, kube):
    controller = JobController(kube, session)
    controller.start()
    result = run_stage("build_image", build_config())
    controller.join(5)
    tag = image_tag()
    assert result["built"] is True and result["builder"] == "buildkit"
    assert result["image"] == f"123456789012.dkr.ecr.us-east-1.amazonaws.com/{REPO_NAME}:{tag}"
    assert result["digest"].startswith("sha256:")
    repo = session.client("ecr").describe_repositories(
        repositoryNames=[REPO_NAME])["repositories"][0]
    assert repo["imageTagMutability"] == "IMMUTABLE"
    # The Secret the Job mounted was a valid dockerconfigjson with ECR's credentials...
    assert controller.secret["type"] == "kubernetes.io/dockerconfigjson"
    config = json.loads(base64.b64decode(controller.secret["data"][".dockerconfigjson"]))
    token = session.client("ecr").get_authorization_token()["authorizationData"][0]
    registry = token["proxyEndpoint"].removeprefix("https://")
    assert list(config["auths"]) == [registry]
    user, _, password = base64.b64decode(config["auths"][registry]["auth"]).decode().partition(":")
    assert user == "AWS" and password
    # ...and is gone now.
    assert secret_names(kube) == []
    # The init container's URL serves exactly the image context.
    job = controller.job
    assert job["metadata"]["name"] == build_job_name(tag)
    # No base in ECR yet: the Job builds it first, and the trainer FROM it.
    init = job["spec"]["template"]["spec"]["initContainers"]
    assert [c["name"] for c in init] == [FETCH_CONTAINER, BASE_BUILD_CONTAINER]
    assert result["base_image"] == result["image"].rsplit(":", 1)[0] + ":" + base_tag()
    url = job["spec"]["template"]["spec"]["initContainers"][0]["env"][0]["value"]
    with urllib.request.urlopen(url, timeout=10) as resp:
        archive = tarfile.open(fileobj=io.BytesIO(resp.read()), mode="r:gz")
    assert archive.getnames() == [p.as_posix() for p in context_files()]


def test_build_job_builds_the_missing_base_first_then_the_trainer_from_it():
    ref, base = "1.dkr.ecr.us-east-1.amazonaws.com/ft:0123abcd", "1.dkr.ecr/ft:base-0123"
    job = buildkit_job_manifest("finetune-image-0123abcd", NS, ref, "https://s3/x", "reg-auth",
                                {"app": "x"}, base_ref=base, build_base=True)
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    pod = job["spec"]["template"]["spec"]
    (fetch, base_build), (build,) = pod["initContainers"], pod["containers"]
    assert fetch["name"] == FETCH_CONTAINER and base_build["name"] == BASE_BUILD_CONTAINER
    assert f"type=image,name={base},push=true" in base_build["args"]
    assert f"--local dockerfile=/workspace/{BASE_DOCKERFILE.rsplit('/', 1)[0]}" in \
        " ".join(base_build["args"])
    assert base_build["volumeMounts"] == build["volumeMounts"]  # the same context and auth
    assert f"build-arg:BASE_IMAGE={base}" in build["args"]


def test_base_already_in_ecr_is_not_built_again(session, kube):
    ecr = session.client("ecr")
    ensure_repository(ecr, REPO_NAME)
    push(session, base_tag())
    controller = JobController(kube, session)
    controller.start()
    result = run_stage("build_image", build_config())
    controller.join(5)
    uri = "123456789012.dkr.ecr.us-east-1.amazonaws.com/" + REPO_NAME
    assert result["built"] is True and result["base_image"] == f"{uri}:{base_tag()}"
    init = controller.job["spec"]["template"]["spec"]["initContainers"]
    assert [c["name"] for c in init] == [FETCH_CONTAINER]


def test_failed_build_fails_with_the_log_tail_and_deletes_the_secret(session, kube):
    controller = JobController(kube, session, outcome="failed", log_lines=60)
    controller.start()
    with pytest.raises(AirflowFailException) as err:  # a verdict: no retry
        run_stage("build_image", build_config())
    controller.join(5)
    message = str(err.value)
    assert "failed" in message and "exited with code 1" in message
    assert "#59 build step 59" in message  # the end of the build log
    assert "#5 build step 5\n" not in message  # only its tail
    assert controller.secret is not None and secret_names(kube) == []


def test_build_that_succeeds_without_pushing_the_tag_fails_verification(session, kube):
    controller = JobController(kube, session, push=False)
    controller.start()
    with pytest.raises(AirflowFailException, match="not in ECR"):
        run_stage("build_image", build_config())
    controller.join(5)
    assert secret_names(kube) == []


def test_context_archive_is_reproducible_and_holds_exactly_the_context_files(repo_copy):
    expected = [p.as_posix() for p in context_files(repo_copy)]
    tgz = pack_context(repo_copy, "tar.gz")
    assert tgz == pack_context(repo_copy, "tar.gz")
    assert tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz").getnames() == expected
    with zipfile.ZipFile(io.BytesIO(pack_context(repo_copy, "zip"))) as zf:
        assert zf.namelist() == expected
    (repo_copy / "trainer" / "config.py").write_text("# changed\n")
    assert pack_context(repo_copy, "tar.gz") != tgz


def test_codebuild_project_builds_the_s3_context_and_the_tag_is_verified(session, kube):
    """moto implements create_project, start_build and batch_get_builds (which reports every
    build SUCCEEDED); it ignores start_build's overrides, does not implement update_project,
    and runs nothing: the test plays the push, as the build starts (a real build reports
    success only after its push)."""
    codebuild = session.client("codebuild")
    name = codebuild_project_name(REPO_NAME)

    def play_push(**_: object) -> None:
        push(session, image_tag())

    # Clients copy the session's event hooks when made: the build's CodeBuild client pushes.
    session.events.register("after-call.codebuild.StartBuild", play_push)
    try:
        result = run_stage("build_image", build_config(image_builder="codebuild",
                                                       codebuild_role=ROLE))
    finally:
        session.events.unregister("after-call.codebuild.StartBuild", play_push)
    assert result["built"] is True and result["builder"] == "codebuild"
    project = codebuild.batch_get_projects(names=[name])["projects"][0]
    key = f"finetune-build-context/{image_tag()}.zip"
    assert project["source"]["type"] == "S3"
    assert project["source"]["location"] == f"{BUCKET}/{key}"
    spec = project["source"]["buildspec"]
    assert 'docker push "$IMAGE_URI"' in spec and 'docker push "$BASE_IMAGE"' in spec
    assert f'--file {TRAINER_DOCKERFILE} --build-arg BASE_IMAGE="$BASE_IMAGE"' in spec
    assert f"--file {BASE_DOCKERFILE}" in spec
    assert project["environment"]["privilegedMode"] is True
    assert project["serviceRole"] == ROLE
    body = session.client("s3").get_object(Bucket=BUCKET, Key=key)["Body"].read()
    with zipfile.ZipFile(io.BytesIO(body)) as zf:
        assert zf.namelist() == [p.as_posix() for p in context_files()]


def test_prebuilt_ecr_image_is_verified_and_used(session):
    ensure_repository(session.client("ecr"), "ft")
    push(session, "v1", repo="ft")
    image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/ft:v1"
    cfg = dataclasses.replace(eks_config(), image=image, image_builder="prebuilt")
    result = run_stage("build_image", cfg)
    assert result["image"] == image and result["image_tag"] == "v1" and result["digest"]
    missing = dataclasses.replace(cfg, image=image.replace(":v1", ":v2"))
    with pytest.raises(AirflowFailException, match="not in ECR"):
        run_stage("build_image", missing)


def test_scale_up_refuses_a_prebuilt_ecr_image_that_is_not_in_ecr_before_any_node(
        session, nodegroup, cluster):
    image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/ft:gone"
    cfg = dataclasses.replace(eks_config(), image=image, image_builder="prebuilt")
    with pytest.raises(AirflowFailException, match=f"prebuilt image {image} is not in ECR"):
        run_stage("scale_up", cfg)
    assert scaling(nodegroup) == SCALING  # refused before any node was asked for


def test_scale_up_refuses_a_build_bucket_that_does_not_exist_when_a_build_is_needed(
        session, nodegroup, cluster):
    cfg = build_config(build_bucket="no-such-bucket", nodes=1)
    with pytest.raises(AirflowFailException, match="build_bucket no-such-bucket does not exist"):
        run_stage("scale_up", cfg)
    assert scaling(nodegroup) == SCALING  # refused before any node was asked for
    with pytest.raises(AirflowFailException, match="build_bucket no-such-bucket does not exist"):
        run_stage("build_image", cfg)  # and at the upload, were it deleted meanwhile
    ensure_repository(session.client("ecr"), REPO_NAME)
    push(session, image_tag())  # the trainer's tag in ECR: no build, no bucket needed
    add_nodes(cluster, 1)
    assert run_stage("scale_up", cfg)["nodes"] == ["ip-10-0-0-0"]


def test_prebuilt_image_outside_ecr_is_accepted_as_given(session):
    cfg = dataclasses.replace(eks_config(), image="nvcr.io/nvidia/pytorch:25.01-py3")
    result = run_stage("build_image", cfg)
    assert result == {"image": "nvcr.io/nvidia/pytorch:25.01-py3", "image_tag": "25.01-py3",
                      "builder": "prebuilt", "built": False}


@pytest.mark.parametrize(("conf", "field", "needle"), [
    ({"image": "", "image_builder": "prebuilt"}, "image", "required with image_builder prebuilt"),
    ({"image": "not an image!"}, "image", "not an image reference"),
    ({"image": ""}, "build_bucket", "required to build the image"),
    ({"image": "", "build_bucket": "Bad_Bucket"}, "build_bucket", "not an S3 bucket"),
    ({"image": "", "build_bucket": BUCKET, "image_repository": "Team/X"}, "image_repository",
     "not an ECR repository"),
    ({"image": "", "build_bucket": BUCKET, "image_builder": "codebuild"}, "codebuild_role",
     "required with image_builder codebuild"),
    ({"image_builder": "kaniko"}, "image_builder", "buildkit, codebuild, buildah, prebuilt"),
])
def test_bad_image_params_are_refused_at_validate_naming_the_field(conf, field, needle):
    with pytest.raises(ConfigError) as err:
        validate_params({**EKS_PARAMS, **conf}, run_id="r")
    assert needle in dict(err.value.errors).get(field, ""), err.value


def test_empty_image_with_a_bucket_validates_for_a_build():
    cfg = validate_params({**EKS_PARAMS, "image": "", "build_bucket": BUCKET}, run_id="r")
    assert cfg.image_builder == "buildkit" and cfg.image_repository == REPO_NAME



def test_buildah_builder_is_refused_at_validate_where_buildah_is_not_installed(
        tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH without buildah
    with pytest.raises(ConfigError) as err:
        validate_params({**EKS_PARAMS, "image": "", "image_builder": "buildah"}, run_id="r")
    message = dict(err.value.errors)["image_builder"]
    assert "buildah is not installed where Airflow runs" in message
    assert "apt-get install buildah" in message and "buildkit or codebuild" in message


def test_buildah_builder_validates_without_a_bucket_where_buildah_is_installed(
        tmp_path, monkeypatch):
    (tmp_path / "buildah").write_text("#!/bin/sh\n")
    (tmp_path / "buildah").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))  # what validate looks for: buildah on PATH
    cfg = validate_params({**EKS_PARAMS, "image": "", "image_builder": "buildah"}, run_id="r")
    assert cfg.image_builder == "buildah" and cfg.build_bucket == ""

# -- the DAG's build_image task: the build waited on deferred --------------------------------


def build_operator(cfg: RunConfig) -> Any:
    return stage_operator("build_image", cfg)


@pytest.mark.slow
def test_build_image_task_defers_until_the_buildkit_job_completes_then_verifies(session, kube):
    controller = JobController(kube, session)
    controller.start()
    result, events = run_deferred(build_operator(build_config()))
    controller.join(5)
    assert events == [{"state": "Complete", "message": ""}]
    assert result["built"] is True and result["digest"].startswith("sha256:")
    assert "pending" not in result
    assert controller.secret is not None and secret_names(kube) == []


def test_build_image_task_fails_with_the_log_tail_after_a_deferred_wait(session, kube):
    controller = JobController(kube, session, outcome="failed", log_lines=60)
    controller.start()
    with pytest.raises(AirflowFailException, match="#59 build step 59"):
        run_deferred(build_operator(build_config()))
    controller.join(5)
    assert secret_names(kube) == []


def test_build_image_task_does_not_defer_when_the_tag_is_in_ecr(session):
    ensure_repository(session.client("ecr"), REPO_NAME)
    push(session, image_tag())
    result, events = run_deferred(build_operator(build_config()))
    assert events == [] and result["built"] is False and result["digest"]


def test_a_build_past_its_deadline_is_stopped_and_its_secret_deleted(session, kube):
    """Nothing plays the Job controller: the Job never ends. The wall-clock deadline is fixed
    when the task defers: a trigger built again from its kwargs later (a triggerer restart)
    keeps it, and fires at once when it has passed."""
    target = EksTarget(**{**FAST, "build_timeout": 0.3})
    cfg = build_config()
    wait = target.build_image(cfg)
    pending = wait.state["started"]["pending"]
    assert pending["builder"] == "buildkit" and secret_names(kube) == [pending["secret"]]
    deadline = wait.trigger.serialize()[1]["deadline"]
    time.sleep(0.4)
    restarted = reloaded(wait.trigger)
    assert restarted.serialize()[1]["deadline"] == deadline == wait.deadline
    started = time.monotonic()
    event = asyncio.run(first_event(restarted))
    assert event["state"] == "Running" and time.monotonic() - started < 1
    with pytest.raises(ImageBuildError, match="no result after"):
        target.build_done(cfg, event, wait.state)
    batch = kubernetes.client.BatchV1Api(kube.api())
    assert batch.list_namespaced_job(NS).items == [] and secret_names(kube) == []


@pytest.mark.slow
def test_codebuild_failure_is_reported_from_its_phases(session, kube, monkeypatch):
    """moto reports every build SUCCEEDED: the failed status is the test's, the report ours."""
    from finetune.targets.eks import image_build

    cfg = build_config(image_builder="codebuild", codebuild_role=ROLE)
    target = EksTarget(**FAST)
    wait = target.build_image(cfg)
    started = wait.state["started"]
    assert started["pending"]["builder"] == "codebuild"
    event = asyncio.run(first_event(reloaded(wait.trigger)))
    assert event == {"state": "Complete", "message": "SUCCEEDED"}

    real = image_build.codebuild_failure_report
    failed_build = {"id": started["pending"]["build_id"], "buildStatus": "FAILED", "phases": [
        {"phaseType": "BUILD", "phaseStatus": "FAILED",
         "contexts": [{"message": "COMMAND_EXECUTION_ERROR: docker build exited 1"}]}]}
    monkeypatch.setattr(image_build, "codebuild_failure_report",
                        lambda s, build: real(s, failed_build))
    with pytest.raises(ImageBuildError, match="phase BUILD: FAILED COMMAND_EXECUTION_ERROR"):
        target.build_done(cfg, {"state": "Failed", "message": "FAILED"}, wait.state)


# -- a build_image task killed while deferred (a mark-failed, its trigger failing) -----------


def build_objects_left(cluster: Cluster) -> list[str]:
    """Whatever of a build is in the cluster: each object a build makes carries the tag's label
    (the Job, its pods, the registry Secret, a run's record of the wait)."""
    api = cluster.api()
    core, batch = kubernetes.client.CoreV1Api(api), kubernetes.client.BatchV1Api(api)
    found = []
    for kind, listed in (("job", batch.list_namespaced_job(NS)),
                         ("pod", core.list_namespaced_pod(NS)),
                         ("secret", core.list_namespaced_secret(NS)),
                         ("configmap", core.list_namespaced_config_map(NS))):
        found += [f"{kind}/{o.metadata.name}" for o in listed.items
                  if LABEL_IMAGE_TAG in (o.metadata.labels or {})]
    return found


def build_pod(cluster: Cluster, job: str) -> None:
    """The Job controller's pod of the build Job, building."""
    kubernetes.client.CoreV1Api(cluster.api()).create_namespaced_pod(NS, {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{job}-x7k2p", "namespace": NS, "labels": {
            JOB_NAME_LABEL: job, LABEL_IMAGE_TAG: image_tag()}},
        "spec": {"containers": [{"name": BUILD_CONTAINER, "image": BUILDKIT_IMAGE}]}})


def test_teardown_after_build_image_was_killed_while_deferred_stops_the_build(
        session, kube, nodegroup):
    """No trigger's on_kill runs for it, and the last try's trigger may fail: teardown deletes
    the BuildKit Job (up to 3 h at 4 CPUs, 16 GiB), its pod and the Secret with a 12-hour ECR
    token."""
    t, cfg = EksTarget(**FAST), build_config()
    snap = t.snapshot(cfg)
    wait = t.build_image(cfg)  # the task defers; then it is killed and never resumes
    name = wait.state["started"]["pending"]["job"]
    build_pod(kube, name)
    assert sorted(build_objects_left(kube)) == sorted([
        f"job/{name}", f"pod/{name}-x7k2p", f"secret/{name}-registry",
        f"configmap/{build_record_name(cfg)}"])
    done = t.teardown(cfg, snap)
    assert build_objects_left(kube) == []
    assert {f"job/{name}", f"secret/{name}-registry"} <= set(done["deleted"])


def test_a_build_job_another_run_waits_on_is_left_to_it_and_the_last_run_deletes_it(
        session, kube, nodegroup):
    """Runs of the same tree build one tag: a second run adopts the first one's Job, whose
    build is then its own too. Neither the first run's teardown nor its timeout stops it."""
    t = EksTarget(**FAST)
    first, second = build_config(), build_config(run_id="manual__2026-11-29T11:00:00+00:00")
    snaps = t.snapshot(first), t.snapshot(second)
    waits = t.build_image(first), t.build_image(second)  # the second adopts the Job
    name = waits[0].state["started"]["pending"]["job"]
    assert waits[1].state["started"]["pending"]["job"] == name
    with pytest.raises(ImageBuildError, match="left to the other runs that wait on it"):
        t.build_done(first, {"state": "Running", "message": ""}, waits[0].state)  # its timeout
    t.teardown(first, snaps[0])
    assert sorted(build_objects_left(kube)) == sorted([
        f"job/{name}", f"secret/{name}-registry", f"configmap/{build_record_name(second)}"])
    t.teardown(second, snaps[1])
    assert build_objects_left(kube) == []


def test_teardown_stops_the_codebuild_build_of_a_build_image_killed_while_deferred(
        session, kube, nodegroup, monkeypatch):
    from finetune.targets.eks import image_build

    t, cfg = EksTarget(**FAST), build_config(image_builder="codebuild", codebuild_role=ROLE)
    snap = t.snapshot(cfg)
    build_id = t.build_image(cfg).state["started"]["pending"]["build_id"]
    # moto reports every build SUCCEEDED at once: this one still runs
    monkeypatch.setattr(image_build, "codebuild_state", lambda codebuild, ident: (
        "Running", "IN_PROGRESS"))
    stopped: list[str] = []
    session.events.register("before-parameter-build.codebuild.StopBuild",
                            lambda params, **_: stopped.append(params["id"]))
    done = t.teardown(cfg, snap)
    assert stopped == [build_id] and f"codebuild/{build_id}" in done["deleted"]
    assert build_objects_left(kube) == []
