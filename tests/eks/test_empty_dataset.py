"""An s3:// data set that is missing or empty fails scale_up before any node is asked for (moto in
server mode for S3 and EKS, the Kubernetes emulator for the reservations)."""

from __future__ import annotations

import re

import boto3
import pytest
from airflow.sdk.exceptions import AirflowFailException
from botocore.stub import Stubber

from finetune.config import ConfigError
from finetune.s3_dataset import s3_dataset_problem
from finetune.targets.local.target import LocalTarget
from tests.support.eks import SCALING, eks_config, run_stage, scaling, target
from tests.support.kube import add_nodes

ROWS = b'{"prompt": "Name a bird", "response": "owl"}\n'
# Objects in the bucket, and what scale_up says of a data set URI.
EMPTY_DATA_SETS = [
    ({"data/rows.jsonl": b""}, "s3://data/data/rows.jsonl", "is an empty object (0 bytes)"),
    ({"data/a.jsonl": b"", "data/b.jsonl": b""}, "s3://data/data/",
     "every data file under the prefix is empty"),
    ({"data/_SUCCESS": b"", "data/.hidden.jsonl": ROWS, "data/notes.txt": b"x"}, "s3://data/data",
     "no data files under the prefix"),
    ({"other/rows.jsonl": ROWS}, "s3://data/data/rows.jsonl",
     "no object has that key or is under that prefix"),
    ({}, "s3://no-such-bucket/rows.jsonl", "cannot be read from Airflow (NoSuchBucket"),
]


@pytest.fixture
def bucket(aws):
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="data")
    return s3


def put(s3, objects: dict[str, bytes]) -> None:
    for key, body in objects.items():
        s3.put_object(Bucket="data", Key=key, Body=body)


# scale_up with each: an empty object and a missing key in the fast tier, the others with the
# slow tests (each scale_up runs on moto and the emulator)
SLOW_CASES = {"empty-files", "no-data-files", "no-bucket"}


@pytest.mark.parametrize(("objects", "uri", "message"), [
    pytest.param(*case, id=name, marks=[pytest.mark.slow] if name in SLOW_CASES else [])
    for case, name in zip(EMPTY_DATA_SETS, ["empty-object", "empty-files", "no-data-files",
                                             "missing", "no-bucket"], strict=True)])
def test_an_empty_or_missing_s3_data_set_fails_scale_up_before_the_node_group_changes(
        nodegroup, cluster, bucket, objects, uri, message):
    put(bucket, objects)
    cfg = eks_config(dataset=uri)
    t = target()
    snap = t.snapshot(cfg)
    # the task the DAG runs fails before it defers, without a retry
    with pytest.raises(AirflowFailException, match="- dataset: .*" + re.escape(message)) as err:
        run_stage("scale_up", cfg)
    assert isinstance(err.value.__cause__, ConfigError)
    assert scaling(nodegroup) == SCALING  # no node asked for
    assert t._reservations(cfg).read()[0]["reservations"] == {}  # none made
    t.teardown(cfg, snap)
    assert scaling(nodegroup) == SCALING


def test_a_data_set_with_rows_scales_up(nodegroup, cluster, bucket):
    put(bucket, {"data/_SUCCESS": b"", "data/a.jsonl": b"", "data/b.jsonl": ROWS})
    add_nodes(cluster, 1)
    result = run_stage("scale_up", eks_config(dataset="s3://data/data/", nodes=1))
    assert scaling(nodegroup)["desiredSize"] == 1 and len(result["nodes"]) == 1


@pytest.mark.parametrize(("dataset_format", "problem"), [
    ("auto", None), ("jsonl", None), ("parquet", "every data file under the prefix is empty"),
    ("csv", "no data files under the prefix (.jsonl, .json, .parquet, .csv of dataset_format csv"),
])
def test_only_files_of_the_data_set_format_count(bucket, dataset_format, problem):
    put(bucket, {"data/rows.jsonl": ROWS, "data/more/rows.parquet": b""})
    found = s3_dataset_problem("s3://data/data/", dataset_format, bucket)
    assert found is None if problem is None else problem in found


def test_a_data_file_on_a_later_page_of_the_listing_counts():
    s3 = boto3.client("s3", region_name="us-east-1", aws_access_key_id="test",
                      aws_secret_access_key="test")
    with Stubber(s3) as listing:  # S3 lists 1,000 keys a page
        listing.add_response("list_objects_v2", {
            "IsTruncated": True, "NextContinuationToken": "page-2",
            "Contents": [{"Key": "data/_SUCCESS", "Size": 0}]},
            {"Bucket": "data", "Prefix": "data/"})
        listing.add_response("list_objects_v2", {
            "IsTruncated": False, "Contents": [{"Key": "data/rows.jsonl", "Size": len(ROWS)}]},
            {"Bucket": "data", "Prefix": "data/", "ContinuationToken": "page-2"})
        assert s3_dataset_problem("s3://data/data/", "auto", s3) is None


def test_the_local_target_refuses_an_empty_s3_data_set_before_it_starts_anything(
        bucket, tmp_path):
    put(bucket, {"rows.jsonl": b""})
    cfg = eks_config(target="local", dataset="s3://data/rows.jsonl", run_dir=str(tmp_path / "r"))
    with pytest.raises(ConfigError, match="- dataset: 's3://data/rows.jsonl' is an empty object"):
        LocalTarget().scale_up(cfg)
    assert not (tmp_path / "r" / "state").exists()
