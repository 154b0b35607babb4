"""The eks target's AWS sessions (finetune.targets.eks.clients.aws_session)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from finetune.targets.eks.clients import aws_session

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"


def test_every_aws_session_reads_botocore_data_through_one_loader_and_keeps_its_connection(
        monkeypatch):
    for conn_id, region in (("aws_a", "eu-west-1"), ("aws_b", "us-west-2")):
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(
            {"conn_type": "aws", "extra": {"region_name": region}}))
    a, b = aws_session("aws_a"), aws_session("aws_b")
    assert a is not b
    assert a._session.get_component("data_loader") is b._session.get_component("data_loader")
    assert (a.client("s3").meta.region_name, b.client("s3").meta.region_name) == \
        ("eu-west-1", "us-west-2")


def test_a_data_path_of_its_own_gets_a_loader_that_searches_it(monkeypatch, tmp_path):
    default = aws_session("")._session.get_component("data_loader")
    monkeypatch.setenv("AWS_DATA_PATH", str(tmp_path))
    loader = aws_session("")._session.get_component("data_loader")
    assert loader is not default and str(tmp_path) in loader.search_paths


def test_no_plugin_module_makes_an_aws_session_but_aws_session():
    """A session made elsewhere would read botocore's data again; boto3.client() (its default
    session) keeps one loader of its own."""
    made = re.compile(r"AwsBaseHook\(|boto3\.(session\.)?Session\(|\.get_session\(")
    found = [str(path.relative_to(PLUGINS))
             for path in PLUGINS.rglob("*.py")
             for line in path.read_text().splitlines()
             if made.search(line) and not line.lstrip().startswith("#")]
    assert found == ["finetune/targets/eks/clients.py"], found  # aws_session's one line
