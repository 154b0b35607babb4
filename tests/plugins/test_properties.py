"""Properties over any input (hypothesis): validation fails only with its own error and lets
through nothing a later stage rejects; any DAG run id gives valid, distinct Kubernetes names."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from finetune.config import ConfigError
from finetune.names import dns_label, run_dir_name
from finetune.targets.eks.manifests import (
    configmap_name,
    job_name,
    pytorchjob_manifest,
    run_labels,
    trainer_configmap_manifest,
)
from finetune.trainer_config import trainer_config
from finetune.validate import validate_params
from finetune_contract.parameters import FORM_PARAMETERS

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
# Values the string fields take in real use, besides arbitrary text.
PLAUSIBLE = {
    "model": ["tiny-llama", "llama-8b", "meta-llama/Llama-3.1-8B", "/models/llama", "no/such"],
    "tokenizer": ["", "trainer/demo/tokenizer", "/nope", "trainer/demo"],
    "dataset": ["trainer/demo/instructions.jsonl", "trainer/demo", "s3://bucket/data/",
                "org/data", "missing.jsonl", "", "s3://bucket", "s3://Bad_Bucket/x",
                "x" * 300 + ".jsonl"],
    "text_field": ["", "response", "text"], "prompt_field": ["prompt", "question", ""],
    "response_field": ["response", "answer"],
    "selective_ac": ["op", "2", "0", "x"],
    "rdzv_endpoint": ["", "127.0.0.1:2379", "etcd:99999", "nohost", "[::1]:2379",
                      "user:pw@etcd:2379"],
    "prometheus_url": ["", "http://prom:9090", "http://user:pw@prom:9090"],
    "output_dir": ["runs", "/tmp/finetune-runs", "s3://bucket/runs", "s3://bucket",
                   "s3://Bad_Bucket/runs", "/tmp/" + "y" * 300],
    "cluster_name": ["", "train"], "nodegroup": ["", "gpu-p4de", "gpu-"],
    "image": ["", "1234.dkr.ecr.us-east-1.amazonaws.com/ft:abc", "not an image!"],
    "build_bucket": ["", "bucket", "Bad_Bucket"],
    "hf_token_secret": ["", "hf", "hf:token", ":", "hf:bad key", "hf_abcdef123"],
    "namespace": ["default", "ml", "Not_A_Label"], "codebuild_role": ["", "arn:aws:iam::1:role/x"],
}
JUNK = st.one_of(st.none(), st.text(max_size=20), st.integers(-10**12, 10**12),
                 st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                 st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3),
                                                                      st.integers(), max_size=2))


def valid_values(spec) -> st.SearchStrategy:
    if spec.choices is not None:
        return st.sampled_from(spec.choices)
    if spec.type is bool:
        return st.booleans()
    if spec.type is int:
        bounds = spec.bounds
        low = int(bounds.minimum) if bounds.minimum is not None else 0
        high = int(bounds.maximum) if bounds.maximum is not None else 10**6
        return st.integers(low, high) | st.integers(low, min(high, low + 16))
    if spec.type is float:
        bounds = spec.bounds
        low = bounds.exclusive_minimum if bounds.exclusive_minimum is not None else bounds.minimum
        return st.floats(low or 0.0, bounds.maximum or 1e6, exclude_min=bounds.exclusive_minimum
                         is not None)
    return st.sampled_from(PLAUSIBLE.get(spec.name, [spec.default])) | st.text(max_size=30)


@st.composite
def params(draw) -> dict:
    chosen = draw(st.lists(st.sampled_from(FORM_PARAMETERS), max_size=8,
                           unique_by=lambda s: s.name))
    out = {s.name: draw(st.one_of(*[valid_values(s)] * 6, JUNK))
           for s in chosen}
    if draw(st.booleans()):  # an eks run, so the eks checks and manifests are reached
        out = {"target": "eks", "cluster_name": "train", "nodegroup": "gpu-p4de",
               "image": "1234.dkr.ecr.us-east-1.amazonaws.com/ft:abc", "procs_per_node": 8,
               "micro_batch": 1, "output_dir": "s3://bucket/runs", **out}
    if draw(st.integers(0, 9)) == 0:
        out[draw(st.text(min_size=1, max_size=10))] = draw(JUNK)  # an unknown parameter
    return out


def later_stages(cfg) -> None:
    """Every check a later stage makes of a config: the trainer's config parsing, its start
    checks for its world and (once built) its model, its data loading and sampler for this
    world, and on eks the manifests (valid against the CRD and Kubernetes)."""
    import torch

    from finetune_contract.models import BUILTIN_MODELS
    from tests.support.schemas import K8S_VERSION, assert_valid_pytorchjob
    from trainer.config import TrainConfig, resolve
    from trainer.model import builtin_config
    from trainer.parallel import DistEnv, check_start

    local = cfg.target == "local"
    train = resolve(TrainConfig(**trainer_config(cfg, local_paths=local)))
    env = DistEnv(rank=0, world_size=cfg.world_size, local_rank=0,
                  local_world_size=cfg.procs_per_node,
                  device=torch.device("cpu" if local else "meta"))
    check_start(train, env)
    if cfg.model in BUILTIN_MODELS:
        check_start(train, env, builtin_config(cfg.model))
    # A hub tokenizer (a hub model's own) needs the network the trainer's pods have, not this
    # test: its data start is checked for local tokenizers.
    if local:
        if Path(train.tokenizer).is_dir():
            trainer_data_start(cfg, train, cfg.parallel_dims.dp_degree)
    else:
        import kubernetes_validate

        assert_valid_pytorchjob(pytorchjob_manifest(cfg, cfg.image or "img:1"))
        kubernetes_validate.validate(trainer_configmap_manifest(cfg), K8S_VERSION, strict=True)


@functools.lru_cache(maxsize=64)
def _splits(train):

    from trainer.data import build_splits

    return build_splits(train)


# Where prepare_data writes for these configs (content-addressed: examples share the sets).
_PREPARED = Path(tempfile.mkdtemp(prefix="properties-prepared-"))


def trainer_data_start(cfg, train, data_parallel: int) -> None:
    """What happens to the data before the first step: prepare_data (which may still refuse,
    before scale-up, with a ConfigError naming the field), then the trainer's load and the
    sampler of this data-parallel size."""
    from finetune.prepare_stage import prepare_run_data
    from trainer.data import ResumableSampler

    run = dataclasses.replace(cfg, output_dir=str(_PREPARED), run_dir=str(_PREPARED / "run"))
    try:
        prepared, _ = prepare_run_data(run, num_proc=1)
    except ConfigError as exc:
        assert exc.errors and all(field and message for field, message in exc.errors)
        event("refused at prepare_data")
        return
    key = dataclasses.replace(train, output_dir=str(_PREPARED), lr=1.0, max_steps=0,
                              prepared_data=prepared.prepared_data)
    splits = _splits(key)
    ResumableSampler(len(splits.train), train.micro_batch, 0, data_parallel, train.seed)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params())
def test_validate_raises_only_config_errors_and_accepts_only_what_later_stages_accept(conf):
    accepted_only_if_later_stages_accept(conf)


def accepted_only_if_later_stages_accept(conf: dict) -> None:
    """validate refuses with its own error only, or later_stages accepts what it accepted."""
    try:
        cfg = validate_params(conf, run_id="manual__2026-11-29T10:00:00+00:00")
    except ConfigError as exc:
        assert exc.errors and all(field and message for field, message in exc.errors)
        event("rejected")
        return
    event(f"accepted ({cfg.target})")
    later_stages(cfg)


# Local runs near the edge of what the data allows: lengths, batch sizes, fields, templates.
NEAR_VALID_LOCAL = st.fixed_dictionaries({
    "procs_per_node": st.integers(1, 2),
    "seq_len": st.integers(8, 96) | st.sampled_from([128, 1024, 1025]),
    "micro_batch": st.integers(1, 40) | st.sampled_from([700, 1500, 2900]),
    "packing": st.booleans(),
    "bad_rows": st.sampled_from(["skip", "error"]),
    "tp_degree": st.sampled_from([1, 2]),
    "text_field": st.sampled_from(["", "", "", "response", "text"]),
    "prompt_field": st.sampled_from(["prompt", "prompt", "prompt", "question"]),
    "prompt_template": st.sampled_from(["instruction", "instruction", "instruction", "chat"]),
    "dataset_format": st.sampled_from(["auto", "jsonl"]),
})


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(NEAR_VALID_LOCAL)
def test_a_local_run_near_the_limits_of_its_data_is_accepted_only_if_the_trainer_starts(conf):
    accepted_only_if_later_stages_accept(conf)


RUN_IDS = st.text(st.characters(codec="utf-8"), min_size=1, max_size=300) | st.from_regex(
    r"(manual|scheduled|asset_triggered)__20[0-9]{2}-[01][0-9]-[0-3][0-9]T[0-2][0-9]:[0-5][0-9]"
    r":[0-5][0-9](\.[0-9]{6})?\+00:00", fullmatch=True)


@pytest.mark.slow  # validate tokenizes the demo data set for each of ~400 run ids
@settings(max_examples=200, deadline=None)
@given(RUN_IDS, RUN_IDS)
def test_any_run_id_maps_to_valid_distinct_kubernetes_names_and_labels(run_id, other):
    from tests.support.eks import eks_config

    cfg = eks_config(run_id=run_id)
    name = job_name(cfg)
    assert DNS_1035.match(name) and len(f"{name}-worker-127") <= 63
    assert DNS_LABEL.match(cfg.rdzv_id) and len(cfg.rdzv_id) <= 48
    assert len(configmap_name(cfg)) <= 253
    for key, value in run_labels(cfg).items():
        assert LABEL_VALUE.match(value) and len(value) <= 63, (key, value)
    directory = run_dir_name(run_id)
    assert re.fullmatch(r"[A-Za-z0-9._-]+", directory) and directory not in (".", "..")
    assert len(directory) <= 90
    if run_id != other:  # distinct runs never share a name, a label or a directory
        assert dns_label("llm_finetune", run_id) != dns_label("llm_finetune", other)
        assert job_name(cfg) != job_name(eks_config(run_id=other))
        assert directory != run_dir_name(other)


def test_the_property_tests_see_accepted_and_rejected_configs():
    """A guard on the generator: both outcomes occur (else the first property proves little)."""
    accepted = rejected = 0
    for conf in ({"max_steps": 5}, {"nodes": "two"}, {"lr": math.nan},
                 {"target": "eks", "cluster_name": "train", "nodegroup": "gpu-p4de",
                  "image": "1234.dkr.ecr.us-east-1.amazonaws.com/ft:abc", "procs_per_node": 8,
                  "micro_batch": 1, "output_dir": "s3://bucket/runs"}):
        try:
            later_stages(validate_params(conf, run_id="r"))
            accepted += 1
        except ConfigError:
            rejected += 1
    assert accepted == 2 and rejected == 2
