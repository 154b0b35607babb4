"""Waiting for a check to come true: asked at a fixed pace until it does or the time is up
(tenacity), for the waits that hold a task's process (etcd up or stopped, processes ended, an
object deleted, a new pod Ready); the deferrable waits are the eks triggers'."""

from __future__ import annotations

import tenacity


def until_true(timeout: float, interval: float) -> tenacity.Retrying:
    """Calls a check every `interval` seconds until it returns True (then True) or `timeout`
    seconds have passed (then False); an exception it raises ends the wait."""
    return tenacity.Retrying(retry=tenacity.retry_if_result(lambda done: not done),
                             stop=tenacity.stop_after_delay(timeout),
                             wait=tenacity.wait_fixed(interval),
                             retry_error_callback=lambda _: False)
