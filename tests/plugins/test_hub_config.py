"""validate reads a hub id's config.json from the hub (finetune.hub), so the architecture table
refuses what the trainer would before any cost, for a hub id as for a local directory.

The hub here is an HTTP server of the test's speaking the hub's file protocol
(`/{org}/{name}/resolve/main/config.json`, errors named by `X-Error-Code` as the hub does),
reached through HF_ENDPOINT, the variable huggingface_hub reads too.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from finetune import hub
from finetune.config import ConfigError
from finetune.run_plan import model_config_of
from finetune.validate import validate_params

SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100,
         "max_position_embeddings": 4096}
# repo -> (HTTP status, X-Error-Code, config.json)
REPOS: dict[str, tuple[int, str, dict | None]] = {
    "org/qwen": (200, "", {**SHAPE, "model_type": "qwen2"}),
    "org/phi": (200, "", {**SHAPE, "model_type": "phi3"}),
    "org/moe": (200, "", {**SHAPE, "model_type": "mixtral", "num_local_experts": 8}),
    "org/one-kv-head": (200, "", {**SHAPE, "model_type": "qwen3", "num_key_value_heads": 1}),
    "org/short": (200, "", {**SHAPE, "model_type": "mistral", "max_position_embeddings": 256,
                            "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}),
    "org/gated": (401, "GatedRepo", None),
    "org/private-or-missing": (401, "RepoNotFound", None),
    "org/datasets-only": (404, "EntryNotFound", None),
}
EKS = {"target": "eks", "cluster_name": "c", "nodegroup": "g", "image": "r/trainer:1",
       "image_builder": "prebuilt", "procs_per_node": 8, "instance_type": "p5.48xlarge",
       "output_dir": "s3://bucket/runs"}


class _Hub(BaseHTTPRequestHandler):
    requests: list[str] = []

    def do_GET(self):  # http.server calls it by this name
        _Hub.requests.append(self.path)
        repo, _, rest = self.path.lstrip("/").partition("/resolve/")
        status, code, config = REPOS.get(repo, (401, "RepoNotFound", None))
        if rest != "main/config.json":
            status, code, config = 404, "EntryNotFound", None
        body = json.dumps(config).encode() if config is not None else b"{}"
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def hub_server(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    monkeypatch.setenv(hub.ENDPOINT_ENV, f"http://127.0.0.1:{server.server_port}")
    monkeypatch.delenv(hub.OFFLINE_ENV, raising=False)
    hub._fetch.cache_clear()
    _Hub.requests = []
    yield _Hub.requests
    server.shutdown()
    hub._fetch.cache_clear()


def refusal(params: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as error:
        validate_params({"procs_per_node": 2, **params}, run_id="r")
    return dict(error.value.errors)


def test_validate_refuses_what_the_trainer_would_from_the_hubs_config(hub_server):
    phi = refusal({"model": "org/phi", "lora_rank": 8, "lora_target_modules": "q_proj,v_proj"})
    assert "qkv_proj" in phi["lora_target_modules"] and "Phi-3" in phi["lora_target_modules"]
    assert "mixture-of-experts" in refusal({"model": "org/moe"})["model"]
    assert "num_key_value_heads (1)" in refusal({"model": "org/one-kv-head", "tp_degree": 2})[
        "tp_degree"]
    assert "max_position_embeddings (256)" in refusal({"model": "org/short", "seq_len": 512})[
        "seq_len"]
    for accepted in ({"lora_rank": 8}, {"tp_degree": 2}):
        cfg = validate_params({"model": "org/qwen", "procs_per_node": 2, **accepted}, run_id="r")
        assert cfg.model == "org/qwen"
    # the planner sizes it from the same config; the hub was asked once per repo
    assert model_config_of("org/qwen")["model_type"] == "qwen2"
    assert hub_server.count("/org/qwen/resolve/main/config.json") == 1


def test_a_repo_the_trainer_could_not_read_is_refused_on_eks_without_a_token(hub_server):
    for repo, words in (("org/gated", "gated"), ("org/private-or-missing", "no such public")):
        message = refusal({**EKS, "model": repo})["model"]
        assert words in message and "hf_token_secret" in message, message
        # with a token the pod may read it: validate cannot tell, the trainer checks at start
        validate_params({**EKS, "model": repo, "hf_token_secret": "hf:token"}, run_id="r")
        # the local target's trainer uses this machine's Hugging Face login, if any
        validate_params({"model": repo, "procs_per_node": 2}, run_id="r")
    for params in (EKS, {**EKS, "hf_token_secret": "hf:token"}, {}):
        message = refusal({**params, "model": "org/datasets-only"})["model"]
        assert "has no config.json" in message


def test_validate_goes_on_when_the_hub_is_off_or_does_not_answer(hub_server, monkeypatch,
                                                                   caplog):
    monkeypatch.setenv(hub.OFFLINE_ENV, "1")
    validate_params({**EKS, "model": "org/moe"}, run_id="r")
    assert hub_server == []  # HF_HUB_OFFLINE: the hub is not asked
    monkeypatch.delenv(hub.OFFLINE_ENV)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv(hub.ENDPOINT_ENV, f"http://127.0.0.1:{port}")
    with caplog.at_level("INFO", logger="finetune.validate"):
        validate_params({**EKS, "model": "org/moe"}, run_id="r")
    assert "did not answer" in caplog.text and "the trainer checks" in caplog.text
