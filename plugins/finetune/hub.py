"""A hub model's config.json, read at validate so the architecture table's checks (family,
LoRA targets, tensor parallelism against heads, positions) run before any cost for a hub id
too, not only for a local directory or the shapes `finetune_contract.models` stores.

huggingface_hub speaks the hub's protocol: the file's URL (`hf_hub_url`) and the error kind
the hub names in `X-Error-Code` (`hf_raise_for_status` and its errors). The request is one GET
of config.json with no token: validate holds no credentials (the trainer's pod gets HF_TOKEN
from `hf_token_secret`), so a gated or private repo is not read here. It goes through an httpx
client of this module's, not huggingface_hub's session or `hf_hub_download`: HF_ENDPOINT and
HF_HUB_OFFLINE are read at each call (huggingface_hub reads them once, at import), nothing is
written to the Hugging Face cache, and no other request is made (its `build_hf_headers` may
fetch a registry from the hub for its user agent).

What the hub says decides only what the trainer would also meet: a repo without config.json
fails everywhere; a repo not found or gated fails an eks run that has no token to give. When
the hub does not answer (no network, `HF_HUB_OFFLINE`), validate goes on and the trainer
checks the config at start.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from huggingface_hub.errors import HfHubHTTPError

DEFAULT_ENDPOINT = "https://huggingface.co"
ENDPOINT_ENV = "HF_ENDPOINT"  # huggingface_hub's, so a mirror or a hub of one's own works
OFFLINE_ENV = "HF_HUB_OFFLINE"
TIMEOUT_S = 5.0
MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few kB
USER_AGENT = "finetune-validate"

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
    from huggingface_hub import hf_hub_url

    endpoint = os.environ.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT
    return hf_hub_url(repo_id, "config.json", endpoint=endpoint.rstrip("/"))


@functools.lru_cache(maxsize=64)
def _fetch(url: str) -> HubConfig:
    # Imported here: the scheduler imports validate with every DAG parse, and reads no hub.
    import httpx
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import hf_raise_for_status

    try:
        with httpx.Client(follow_redirects=True, timeout=TIMEOUT_S) as client, \
                client.stream("GET", url, headers={"User-Agent": USER_AGENT}) as response:
            hf_raise_for_status(response)
            body = b""
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > MAX_CONFIG_BYTES:
                    break
    except HfHubHTTPError as exc:
        return _refused(exc)
    except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError) as exc:  # refused, timeouts
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


def _refused(exc: HfHubHTTPError) -> HubConfig:
    """The hub's answer to a request it refused, as huggingface_hub classified it."""
    from huggingface_hub.errors import (
        GatedRepoError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
    )

    status = exc.response.status_code
    # a 404 without X-Error-Code: a mirror or plain file server that has no such file
    if isinstance(exc, RemoteEntryNotFoundError) or (
            status == 404 and not exc.response.headers.get("X-Error-Code")):
        return HubConfig(None, NO_CONFIG, "the repo has no config.json (not a transformers "
                                          "model)")
    if isinstance(exc, GatedRepoError):  # before RepositoryNotFoundError, its base class
        return HubConfig(None, GATED, f"the repo is gated (HTTP {status})")
    if isinstance(exc, RepositoryNotFoundError) or status in (401, 404):
        return HubConfig(None, NOT_FOUND, f"the hub has no such public repo (HTTP {status}: it "
                                          "does not exist, or is private)")
    return HubConfig(None, UNREACHABLE, f"the hub answered HTTP {status}")


def hub_config(repo_id: str) -> HubConfig:
    """The hub's config.json of `repo_id` (a valid org/name), read once per process."""
    if _offline():
        return HubConfig(None, UNREACHABLE, f"{OFFLINE_ENV} is set")
    try:
        url = config_url(repo_id)
    except ImportError:  # an Airflow installed without this project's requirements.txt (MWAA)
        return HubConfig(None, UNREACHABLE, "huggingface_hub is not installed where validate "
                                            "runs")
    return _fetch(url)
