"""Names derived from a DAG run id: directory names, rendezvous ids, Kubernetes-safe names."""

import hashlib
import re

# Kubernetes names: a DNS label (namespaces, services) and a DNS subdomain (most objects).
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(
    r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# A label value: at most 63 characters, alphanumerics at either end.
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")
_UNSAFE_PATH = re.compile(r"[^A-Za-z0-9._-]+")
_UNSAFE_DNS = re.compile(r"[^a-z0-9-]+")


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def run_dir_name(run_id: str) -> str:
    """A directory name for a run: readable, safe on every file system, unique per run id."""
    readable = _UNSAFE_PATH.sub("-", run_id).strip("-.")[:80] or "run"
    if readable == run_id:
        return readable
    # Two run ids that differ only in unsafe characters must not share a directory.
    return f"{readable}-{_digest(run_id)[:8]}"


def dns_label(*parts: str, max_len: int = 63) -> str:
    """A DNS-1123 label (lowercase alphanumerics and '-', at most 63 chars) unique per parts.

    Used for torchrun rendezvous ids and Kubernetes names: readable prefix plus a hash suffix.
    """
    suffix = _digest(*parts)[:10]
    readable = _UNSAFE_DNS.sub("-", "-".join(parts).lower()).strip("-")
    readable = readable[: max_len - len(suffix) - 1].strip("-")
    return f"{readable}-{suffix}" if readable else f"run-{suffix}"
