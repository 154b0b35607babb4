"""A hub model's config.json, read at validate so the architecture table's checks (family,
LoRA targets, tensor parallelism against heads, positions) run before any cost for a hub id
too, not only for a local directory or the shapes `finetune_contract.models` stores.

The hub's file protocol (`GET {endpoint}/{repo}/resolve/main/config.json`, the error kind in
the `X-Error-Code` header), with no token: validate holds no credentials (the trainer's pod gets
HF_TOKEN from `hf_token_secret`), so a gated or private repo is not read here. What the hub says
decides only what the trainer would also meet: a repo without config.json fails everywhere; a
repo not found or gated fails an eks run that has no token to give. When the hub does not answer
(no network, `HF_HUB_OFFLINE`), validate goes on and the trainer checks the config at start.
"""

from __future__ import annotations

import functools
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

DEFAULT_ENDPOINT = "https://huggingface.co"
ENDPOINT_ENV = "HF_ENDPOINT"  # huggingface_hub's, so a mirror or a hub of one's own works
OFFLINE_ENV = "HF_HUB_OFFLINE"
TIMEOUT_S = 5.0
MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few kB

# What the hub's X-Error-Code says, and whether a token could change it.
NOT_FOUND, GATED, NO_CONFIG, UNREACHABLE = "not found", "gated", "no config", "unreachable"


@dataclass(frozen=True)
class HubConfig:
    """config.json as the hub served it, or why there is none (`kind` one of the above)."""

    config: dict[str, Any] | None
    kind: str = ""
    reason: str = ""


def _offline() -> bool:
    return os.environ.get(OFFLINE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def config_url(repo_id: str) -> str:
    endpoint = os.environ.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT
    return f"{endpoint.rstrip('/')}/{urllib.parse.quote(repo_id)}/resolve/main/config.json"


@functools.lru_cache(maxsize=64)
def _fetch(url: str) -> HubConfig:
    request = urllib.request.Request(url, headers={"User-Agent": "finetune-validate"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            body = response.read(MAX_CONFIG_BYTES + 1)
    except urllib.error.HTTPError as exc:
        code = exc.headers.get("X-Error-Code", "")
        if code == "EntryNotFound" or (exc.code == 404 and not code):
            return HubConfig(None, NO_CONFIG, "the repo has no config.json (not a transformers "
                                              "model)")
        if code == "GatedRepo":
            return HubConfig(None, GATED, f"the repo is gated (HTTP {exc.code})")
        if code == "RepoNotFound" or exc.code in (401, 404):
            return HubConfig(None, NOT_FOUND, f"the hub has no such public repo (HTTP "
                                              f"{exc.code}: it does not exist, or is private)")
        return HubConfig(None, UNREACHABLE, f"the hub answered HTTP {exc.code}")
    except (OSError, ValueError) as exc:  # URLError, timeouts, refused connections
        return HubConfig(None, UNREACHABLE, f"the hub did not answer ({type(exc).__name__})")
    if len(body) > MAX_CONFIG_BYTES:
        return HubConfig(None, UNREACHABLE, "its config.json is larger than 1 MiB")
    try:
        config = json.loads(body)
    except ValueError:
        return HubConfig(None, UNREACHABLE, "its config.json is not JSON")
    if not isinstance(config, dict):
        return HubConfig(None, UNREACHABLE, "its config.json holds no JSON object")
    return HubConfig(config)


def hub_config(repo_id: str) -> HubConfig:
    """The hub's config.json of `repo_id` (a valid org/name), read once per process."""
    if _offline():
        return HubConfig(None, UNREACHABLE, f"{OFFLINE_ENV} is set")
    return _fetch(config_url(repo_id))
